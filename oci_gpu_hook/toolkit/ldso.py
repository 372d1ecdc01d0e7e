"""What glibc's dynamic loader maps into a program, and every place it looks, found without running
anything: install's trust check (launcher.check_trusted) follows the hook's interpreter with it.

An interpreter built with --enable-shared (pyenv, conda, most source builds) maps libpython from
its RUNPATH; an extension module maps its own libraries (conda's libssl, libffi, libz) from its
RUNPATH or RPATH. Whoever can change any of these, or put a file of the same name earlier in the
loader's search order, runs code as root at every container start. So each object is found as
glibc's loader finds it (elf/dl-load.c, _dl_map_object), read from the ELF files (start/elf.py)
and the loader's cache (start/ldcache.py), and at every step the file found, or the place where
one would be found first if someone made it, is checked as the hook checks its host sources
(HostSources): root's, writable by no one else, in directories only root can change. Never ldd
or the loader itself: that runs the vetted files' code (their constructors, an IFUNC resolver).

The search for a name NEEDed by object O (no '/' in the name):
  1. unless O has a RUNPATH: the RPATH of O, of the object that loaded O, ..., of the program;
  2. LD_LIBRARY_PATH: not followed: the hook entries install writes set PATH and LC_ALL only;
  3. O's own RUNPATH (not inherited);
  4. /etc/ld.so.cache (every entry of that name and class: the loader picks one by hwcaps);
  5. the default directories (the union of the distributions' lists: every one that exists).
In each directory of 1, 3 and 5 the loader first tries hwcaps subdirectories (glibc-hwcaps/<level>,
before glibc 2.37 tls, the platform, ...): each of those that exists is checked whole.
$ORIGIN, $LIB and $PLATFORM are expanded as the loader does ($LIB and $PLATFORM to every value
they can have); a directory left relative (or an empty entry: the working directory) is refused.
Where the search could stop at more than one file (hwcaps, the defaults), every one is followed.
/etc/ld.so.preload is followed for the program; the ld.so.conf files and every directory they
name are checked, as ldconfig rebuilds the cache from them. Extension modules are followed as
dlopen() maps them: what the program already mapped is reused; they inherit the RPATHs of the
program's startup objects.
"""

from __future__ import annotations

import itertools
import os
import re
import stat

from oci_gpu_hook.errors import InventoryError
from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.start import elf, files, ldcache
from oci_gpu_hook.start.linux import arch
from oci_gpu_hook.start.linux.sources import HostSources, UntrustedSource

MAX_PRELOAD = 64 << 10
# The first component of every hwcaps subdirectory glibc has searched under a search directory:
# glibc-hwcaps/<level> (2.33 on), and the legacy tls/, platform and hwcap names (x86_64: haswell,
# xeon_phi, avx512_1, x86_64; aarch64: aarch64), removed in 2.37. Names of other machines are
# looked for too: one more lstat where they are absent.
HWCAPS_TOPS = ("glibc-hwcaps", "tls", "haswell", "xeon_phi", "avx512_1", "x86_64", "aarch64")
_DST = re.compile(r"\$(?:\{(ORIGIN|LIB|PLATFORM)\}|(ORIGIN|LIB|PLATFORM)(?![A-Za-z0-9_]))")


def default_directories(machine: arch.Architecture) -> tuple:
    """The loader's built-in directories, for every distribution's glibc (Debian's multiarch
    ones, Fedora's lib64, the plain ones): a directory this glibc does not search only costs
    a check of it."""
    multiarch = machine.multiarch  # /usr/lib/<triplet>
    found = [multiarch[len("/usr") :], multiarch, "/lib64", "/usr/lib64", "/lib", "/usr/lib"]
    return tuple(dict.fromkeys(found))


class Loaded(Frozen):
    """One mapped object."""

    __slots__ = ("path", "dynamic")
    path: str  # as the loader opened it: its directory is the object's $ORIGIN
    dynamic: elf.Dynamic


class Loader:
    """Follows a program and what it dlopens; every file and place on the way is checked with
    sources, and UntrustedSource (or OSError) says what is not root's alone. files: the real path
    of every object it would map, in the order found."""

    def __init__(self, sources: HostSources, machine: arch.Architecture | None = None, etc: str = "/etc"):
        """etc: where the loader's ld.so.preload and ld.so.cache are, and ldconfig's ld.so.conf."""
        self.sources = sources
        self.machine = machine or arch.current()
        self.etc = etc
        self.defaults = default_directories(self.machine)
        self.files: dict = {}  # real path -> Loaded
        self.program_object: Loaded | None = None
        self._startup_names: set = set()  # names the program's startup objects answer to
        self._startup_rpaths: tuple = ()  # what a dlopen()ed object inherits
        self._cache: dict | None = None  # ld.so.cache: name -> [(word size, path)]
        self._places: dict = {}  # search directory -> {name: [paths in its hwcaps subdirectories]}
        self._located: dict = {}
        self._read: dict = {}  # path -> Loaded or None (not an ELF file)

    # --- what the program maps ----------------------------------------------------------------

    def program(self, path: str) -> None:
        """The program at path (a runtime execs it), its loader (PT_INTERP), /etc/ld.so.preload,
        and everything they NEED, breadth first as the loader maps them at start."""
        real = os.path.realpath(path)  # $ORIGIN of the program: /proc/self/exe's directory
        main = self._object(real)
        if main is None:
            raise UntrustedSource(path, "not an ELF program: what it loads cannot be told")
        self.program_object = main
        interpreter = main.dynamic.interpreter
        if interpreter is not None:
            if not interpreter.startswith("/"):
                raise UntrustedSource(path, f"its loader {interpreter!r} is relative to the working directory")
            loader = self._object(self._kernel_path(interpreter))
            if loader is not None:
                self._mapped(loader)
        self._conf()
        names: set = set()
        queue = [(main, ())]
        for name in self._preloaded():  # mapped as if the program NEEDed them
            for found in self._locate(name, main, self._search(main, ())):
                queue.append((self._object(found), ()))
                names.add(name)
        self._follow(queue, names)
        self._startup_names = names
        rpaths = []
        for loaded in self.files.values():
            rpaths.extend(self._own_rpath(loaded))
        self._startup_rpaths = tuple(dict.fromkeys(rpaths))

    def dlopen(self, path: str) -> None:
        """An object the program dlopen()s (an extension module) and what it NEEDs. One that is
        not an ELF object of the program's class and machine is not mapped: skipped."""
        loaded = self._object(path)
        main = self.program_object
        if loaded is None or main is None or not self._matches(loaded, main):
            return
        self._follow([(loaded, self._startup_rpaths)], set(self._startup_names))

    def _follow(self, queue: list, names: set) -> None:
        """queue: [(object, the RPATH directories of the objects that loaded it, nearest first)];
        names: the names of what is mapped already (a NEEDED of one of them maps nothing)."""
        done = set()
        while queue:
            loaded, inherited = queue.pop(0)
            if (loaded.path, inherited) in done:
                continue
            done.add((loaded.path, inherited))
            self._mapped(loaded)
            if loaded.dynamic.soname:
                names.add(loaded.dynamic.soname)
            search = self._search(loaded, inherited)
            passed_on = tuple(dict.fromkeys(self._own_rpath(loaded) + inherited))
            for name in loaded.dynamic.needed:
                if name in names:
                    continue
                for found in self._locate(name, loaded, search):
                    names.add(name)
                    queue.append((self._object(found), passed_on))

    def _own_rpath(self, loaded: Loaded) -> tuple:
        # A DT_RUNPATH makes the loader ignore the object's DT_RPATH (get-dynamic-info.h).
        if loaded.dynamic.runpath is not None or loaded.dynamic.rpath is None:
            return ()
        return self._directories(loaded, loaded.dynamic.rpath, "RPATH")

    def _search(self, loaded: Loaded, inherited: tuple) -> tuple:
        """The directories searched, in order, for what loaded NEEDs, before the cache: its
        RUNPATH if it has one, else the RPATHs of it, of what loaded it and of the program."""
        if loaded.dynamic.runpath is not None:
            return self._directories(loaded, loaded.dynamic.runpath, "RUNPATH")
        main = () if self.program_object is None else self._own_rpath(self.program_object)
        return tuple(dict.fromkeys(self._own_rpath(loaded) + inherited + main))

    def _directories(self, loaded: Loaded, text: str, tag: str) -> tuple:
        found = []
        for entry in text.split(":"):
            for directory in self._expand(entry, loaded):
                if not directory.startswith("/"):
                    raise UntrustedSource(loaded.path, f"its {tag} names {entry or '(empty)'!r}, a directory relative "
                                                       "to the working directory the runtime starts it in")  # fmt: skip
                found.append(self._kernel_path(directory))
        return tuple(found)

    def _expand(self, text: str, loaded: Loaded) -> list:
        """text with $ORIGIN (the directory the object was opened from), $LIB and $PLATFORM put
        in, once for each value they can have. One loader gives a name one value in every place it
        stands, so the choices are per name, not per occurrence: a RUNPATH that repeats $LIB forty
        times is three strings, not three to the fortieth."""
        values = {
            "ORIGIN": (os.path.dirname(loaded.path),),
            "LIB": ("lib", "lib64", self.machine.multiarch[len("/usr/") :]),
            "PLATFORM": tuple(dict.fromkeys((self.machine.machine, "haswell", "xeon_phi"))),
        }
        names = sorted({m.group(1) or m.group(2) for m in _DST.finditer(text)})
        out = []
        for choice in itertools.product(*(values[name] for name in names)):
            chosen = dict(zip(names, choice))
            out.append(_DST.sub(lambda m, chosen=chosen: chosen[m.group(1) or m.group(2)], text))
        return list(dict.fromkeys(out))

    def _kernel_path(self, path: str) -> str:
        """path with '..' taken as the kernel takes it, after the symlinks before it (HostSources
        reads paths lexically): each part up to a '..' is checked (root's symlinks only) first."""
        parts = [p for p in path.split("/") if p and p != "."]
        done = "/"
        for part in parts:
            if part == "..":
                if os.path.lexists(done):
                    os.close(self.sources.open(done, "dir"))
                    done = os.path.realpath(done)
                done = os.path.dirname(done)
            else:
                done = os.path.join(done, part)
        return done

    # --- where a name is found ----------------------------------------------------------------

    def _locate(self, name: str, loaded: Loaded, search: tuple) -> list:
        """The paths the loader may map for name, NEEDed by loaded; every place before them checked."""
        key = (name, search, loaded.dynamic.wide, loaded.dynamic.machine)
        if key not in self._located:
            self._located[key] = self._find(name, loaded, search)
        return self._located[key]

    def _find(self, name: str, loaded: Loaded, search: tuple) -> list:
        if "/" in name:  # a path: opened as it is, never searched for
            found = []
            for path in self._expand(name, loaded):
                if not path.startswith("/"):
                    raise UntrustedSource(loaded.path, f"it NEEDs {name!r}, relative to the working directory")
                found.extend(self._at(self._kernel_path(path), loaded))
            return found
        for directory in search:
            found = self._in_directory(directory, name, loaded)
            if found:
                return found
        found = []
        for word_size, path in self._cache_entries().get(name, ()):
            if word_size in (0, 64 if loaded.dynamic.wide else 32) and path.startswith("/"):
                found.extend(self._at(self._kernel_path(path), loaded))
        if found:
            return found
        for directory in self.defaults:
            found.extend(self._in_directory(directory, name, loaded))
        return found

    def _in_directory(self, directory: str, name: str, loaded: Loaded) -> list:
        """What the loader maps for name from directory (its hwcaps subdirectories first), once
        directory, or the place it would be made, is checked."""
        variants = self._place(directory)
        return [found for path in variants.get(name, []) + [f"{directory}/{name}"] for found in self._at(path, loaded)]

    def _at(self, path: str, loaded: Loaded) -> list:
        """[path] if the loader would map the file there for loaded (an ELF object of its class and
        machine); [] if there is none (its place then checked). A file there that does not match
        is checked all the same: it could be replaced by one that does."""
        if not os.path.lexists(path):
            try:
                os.close(self.sources.open_place(path, "file"))
            except (FileNotFoundError, NotADirectoryError):
                pass
            return []
        try:
            found = self._object(path)
        except FileNotFoundError:  # a link of root's to nothing, in directories of root's
            return []
        return [path] if found is not None and self._matches(found, loaded) else []

    def _place(self, directory: str) -> dict:
        """Check directory (or, if it does not exist, the nearest existing directory above it) and
        every hwcaps subdirectory in it, whole; {name: [paths]} of the files in those."""
        if directory in self._places:
            return self._places[directory]
        variants: dict = {}
        try:
            os.close(self.sources.open_place(directory, "dir"))
        except (FileNotFoundError, NotADirectoryError):
            pass
        if os.path.isdir(directory):
            for top in HWCAPS_TOPS:
                if os.path.lexists(f"{directory}/{top}"):
                    self._whole(f"{directory}/{top}", variants)
        self._places[directory] = variants
        return variants

    def _whole(self, top: str, variants: dict) -> None:
        """Every file and directory under top root's and writable by no one else (symlinks: their
        targets, checked from their own paths)."""
        os.close(self.sources.open(top, "dir" if os.path.isdir(top) else "file"))
        if not os.path.isdir(top):
            return

        def refuse(error: OSError):
            raise UntrustedSource(error.filename or top, error.strerror or str(error))

        seen = set()
        for directory, dirs, names in os.walk(top, onerror=refuse, followlinks=True):  # the loader follows them
            real = os.path.realpath(directory)
            if real in seen:
                dirs[:] = []
                continue
            seen.add(real)
            for name in dirs + names:
                path = os.path.join(directory, name)
                kind = "dir" if os.path.isdir(path) else "file"
                try:
                    os.close(self.sources.open(path, kind))
                except FileNotFoundError:
                    continue  # a dangling link of root's, in a directory of root's: nothing maps
                if kind == "file" and stat.S_ISREG(os.stat(path).st_mode):
                    variants.setdefault(name, []).append(path)

    def _cache_entries(self) -> dict:
        """The loader's cache, by name; read once. A cache the loader cannot read is one it skips."""
        if self._cache is None:
            self._cache = {}
            cache = f"{self.etc}/ld.so.cache"
            try:
                fd = self.sources.open_place(cache, "file")
            except FileNotFoundError:
                return self._cache
            try:
                if os.path.lexists(cache):
                    for entry in ldcache.read(f"/proc/self/fd/{fd}"):
                        self._cache.setdefault(entry.name, []).append((entry.word_size, entry.path))
            except InventoryError:  # the loader ignores a cache it cannot parse
                pass
            finally:
                os.close(fd)
        return self._cache

    def _preloaded(self) -> list:
        """The names in /etc/ld.so.preload (the file, or where it would be made, checked)."""
        preload = f"{self.etc}/ld.so.preload"
        fd = self.sources.open_place(preload, "file")
        try:
            if not os.path.lexists(preload):
                return []
            data = files.read_bounded(f"/proc/self/fd/{fd}", MAX_PRELOAD)[:MAX_PRELOAD]  # never blocks on a FIFO
            text = data.decode("utf-8", "surrogateescape")
        finally:
            os.close(fd)
        return [name for name in re.split(r"[\s:]+", text) if name]

    def _conf(self) -> None:
        """The ld.so.conf files and the directories they name: ldconfig builds the loader's cache
        from them, as root, at the next package install."""
        from oci_gpu_hook.start.linux import ldconfig

        text, _ = ldconfig.flatten_conf(_HostFiles(self.sources, self.etc))
        for line in text.splitlines():
            directory = line.split("=", 1)[0].strip().rstrip("/")  # an old "dir=TYPE" line
            if directory.startswith("/"):
                self._place(directory)

    # --- the objects ----------------------------------------------------------------------------

    def _object(self, path: str) -> Loaded | None:
        """The object at path, checked (root's alone) and read through the checked descriptor;
        None if it is not an ELF file."""
        if path in self._read:
            return self._read[path]
        fd = self.sources.open(path, "file")
        try:
            dynamic = elf.read(f"/proc/self/fd/{fd}")
        except elf.NotElf:
            dynamic = None
        finally:
            os.close(fd)
        loaded = None if dynamic is None else Loaded(path, dynamic)
        self._read[path] = loaded
        return loaded

    def _mapped(self, loaded: Loaded) -> None:
        self.files.setdefault(os.path.realpath(loaded.path), loaded)

    @staticmethod
    def _matches(loaded: Loaded, wanted: Loaded) -> bool:
        return (loaded.dynamic.wide, loaded.dynamic.machine) == (wanted.dynamic.wide, wanted.dynamic.machine)


class _HostFiles:
    """The host's files as ldconfig.flatten_conf reads an image's: each opened through sources,
    so a configuration file or include directory that is not root's alone is refused; /etc is
    etc."""

    def __init__(self, sources: HostSources, etc: str):
        self.sources, self.etc = sources, etc

    def open(self, path: str, flags: int = os.O_PATH) -> int:
        if path == "/etc" or path.startswith("/etc/"):
            path = self.etc + path[len("/etc") :]
        fd = self.sources.open(path, "dir" if flags & os.O_DIRECTORY else "file")
        if flags & os.O_PATH:
            return fd
        try:
            return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)
        finally:
            os.close(fd)
