"""The launcher: the small Python program a runtime runs, whatever way the package was installed.

The RPM's /usr/bin/oci-gpu-hook, the program `oci-gpu-hook install` writes for a pip install
(LAUNCHER), and Docker's nvidia-container-runtime-hook are all this text, so every way of
installing the hook starts a container as fast as the RPM does. A console script made by pip
would not: it starts Python without -I and with site (the host's and the venv's .pth files run
on every container start), imports re, and Docker's program would add a shell in front.

- `-IS`: isolated (no PYTHONPATH, PYTHONHOME or user site from the runtime's environment) and
  no site module. One word: a shebang passes everything after the interpreter as one argument.
- The package's directory is appended, after the standard library, so that nothing installed
  beside the package can stand in for a standard module.
- Everything the launched process loads must be root's alone: it runs as root on every
  container start, so whoever can change any of it runs code as root (`check_trusted`). That
  includes what the dynamic loader maps: an interpreter built with --enable-shared maps
  libpython from its RUNPATH, extension modules map their own libraries (ldso.py).
"""

from __future__ import annotations

import os
import stat
import sys

from oci_gpu_hook.errors import Exit, HookError, printable
from oci_gpu_hook.start.linux.sources import HostSources, UntrustedSource
from oci_gpu_hook.toolkit import ldso

MARKER = "# oci-gpu-hook launcher"
# Where install puts the launcher when no RPM's /usr/bin/oci-gpu-hook is one: a directory of its
# own, so that nothing else of the host's is shadowed or replaced.
LAUNCHER = "/usr/local/libexec/oci-gpu-hook/oci-gpu-hook"
# Beside it, where install puts the compiled pre-filter at LAUNCHER: the launcher it runs.
PYTHON_LAUNCHER = LAUNCHER + "-python"
MAX_SHEBANG = 255  # the kernel reads 256 bytes of '#!' line (BINPRM_BUF_SIZE) since Linux 5.1


class LauncherError(HookError):
    exit_code = Exit.INSTALL


def package_parent() -> str:
    """The directory this package is imported from (site-packages, or a source checkout)."""
    import oci_gpu_hook

    return os.path.dirname(os.path.dirname(os.path.abspath(oci_gpu_hook.__file__)))


def text(interpreter: str, parent: str, options=(), note: str = "") -> str:
    """The launcher for interpreter with the package in parent; options go before the user's
    arguments (a --config). note: comment lines (each '# ...\n') saying who wrote it and why."""
    for what, value in (("interpreter", interpreter), ("package directory", parent)):
        if not os.path.isabs(value) or any(c.isspace() or not c.isprintable() for c in value):
            raise LauncherError(f"{value!r}: the {what} of a launcher must be an absolute path without spaces")
    shebang = f"#!{interpreter} -IS"
    if len(shebang) > MAX_SHEBANG:
        raise LauncherError(f"{interpreter}: too long for a '#!' line ({len(shebang)} bytes, the kernel reads "
                            f"{MAX_SHEBANG})")  # fmt: skip
    call = f"main(options={list(options)!r})" if options else "main()"
    return (
        f"{shebang}\n"
        f"{MARKER}: -IS keeps the runtime's environment and the site module out of every container start.\n"
        + note
        + "import sys\n"
        f"sys.path.append({parent!r})\n"
        "from oci_gpu_hook.hook import main\n"
        f"sys.exit({call})\n"
    )


def for_this_install(options=(), note: str = "") -> str:
    """The launcher of the interpreter and package this process runs (a venv's python stays the
    venv's: its pyvenv.cfg is read without site, and the CLI's site then adds the venv's packages)."""
    return text(sys.executable, package_parent(), options, note)


def is_launcher(path: str) -> bool:
    """Whether path is a launcher (its second line carries MARKER)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    lines = head.split(b"\n")
    return len(lines) > 1 and lines[0].startswith(b"#!") and lines[1].startswith(MARKER.encode())


def named(path: str):
    """(interpreter, package directory) a launcher written by text() names; None for any other
    file (doctor asks whether users may reach them)."""
    import ast

    if not is_launcher(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read(1 << 16).splitlines()
    interpreter = lines[0][2:].split()[0] if lines[0][2:].split() else None
    parents = [line[len("sys.path.append(") : -1] for line in lines if line.startswith("sys.path.append(")]
    try:
        parent = ast.literal_eval(parents[0]) if parents else None
    except (ValueError, SyntaxError):
        parent = None
    return (interpreter, parent) if interpreter and isinstance(parent, str) else None


def check_trusted(interpreter: str | None = None, parent: str | None = None) -> None:
    """Refuse a launcher whose process could load anything that anyone but root could change.

    The process runs as root on every container start (and as the node services), and loads:
    the interpreter and what the dynamic loader maps for it (its loader, the libraries it NEEDs,
    libpython for an --enable-shared build, each found as the loader finds it); the venv's
    pyvenv.cfg, whose `home` names the standard library (-I and -S do not stop that); the
    standard library; the package; and, once site runs for the CLI and for a changed
    configuration, every directory site puts on sys.path and the .pth files there; the
    extension modules in all of these, and what the loader maps for each of them.
    Each is checked as the hook checks its mount sources (HostSources: every directory on the way
    root's and not writable by others), and every file and directory in each importable tree must
    be root's and writable by no one else. Last, a start as a runtime makes it imports the hook
    with the interpreter and every file its process maps is checked the same way."""
    interpreter = interpreter or sys.executable
    parent = parent or package_parent()
    sources = HostSources()
    try:
        _trusted(sources, interpreter, "file")
        for config in _venv_configs(interpreter):
            _trusted(sources, config, "file")
        # Before the interpreter first runs (to ask for its import path): read from the files,
        # never by running it or the loader, since that would run a user's library as root.
        loader = ldso.Loader(sources)
        _checked(loader.program, interpreter)
        seen: set = set()
        objects: list = []
        # Python imports from its standard library as it starts (encodings, even with -I -S),
        # before the first question below has an answer: so that library, where Python would
        # find it, is checked first too, found from the files as Python's own start finds it.
        for entry in _standard_libraries(interpreter):
            _trusted_tree(sources, entry, seen, objects)
        # Twice: without site first (the standard library, the site-packages directories and the
        # .pth files there, none of which that run executes), so that site's own run below, which
        # executes the .pth files as root, comes only once they were found root's alone.
        for entry in _import_path(interpreter, site=False) + [parent]:
            _trusted_tree(sources, entry, seen, objects)
        for entry in _import_path(interpreter):
            _trusted_tree(sources, entry, seen, objects)
        for path in objects:
            _checked(loader.dlopen, path)
        for path in _mapped_at_start(interpreter, parent):
            _trusted(sources, path, "file")
    finally:
        sources.close()


def _checked(follow, path: str) -> None:
    """follow(path) (a Loader's), its refusals made the launcher's."""
    try:
        follow(path)
    except UntrustedSource as e:
        _refuse(e.path, e.why)
    except OSError as e:
        raise LauncherError(f"{e.filename or path}: {e.strerror}") from None


def _mapped_at_start(interpreter: str, parent: str) -> list:
    """The files the interpreter's process maps once it has imported the hook, as a runtime starts
    it (-I -S, no environment), read from its own /proc/self/maps: the loader's truth on this host,
    whatever the ELF files did not say (a library the hook's imports dlopen()). Run only once all
    that the files say it loads was found root's."""
    import subprocess

    code = (f"import sys; sys.path.append({parent!r}); import oci_gpu_hook.hook; "
            "sys.stdout.write(open('/proc/self/maps').read())")  # fmt: skip
    try:
        done = subprocess.run([interpreter, "-I", "-S", "-c", code], capture_output=True, env={}, cwd="/",
                              timeout=60)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        raise LauncherError(f"{interpreter}: cannot start it as a runtime does: {e}") from None
    if done.returncode != 0:
        raise LauncherError(f"{interpreter}: cannot import the hook as a runtime starts it: "
                            f"{printable(done.stderr.decode(errors='replace').strip()[-200:])}")  # fmt: skip
    paths = []
    for line in done.stdout.decode("utf-8", "surrogateescape").splitlines():
        fields = line.split(None, 5)  # address perms offset dev inode path
        if len(fields) == 6 and fields[5].startswith("/") and not fields[5].endswith(" (deleted)"):
            paths.append(fields[5])
    return list(dict.fromkeys(paths))


def _venv_configs(interpreter: str) -> list:
    """The pyvenv.cfg files Python would read at start: beside the interpreter, or one up."""
    bin_dir = os.path.dirname(interpreter)
    candidates = [os.path.join(bin_dir, "pyvenv.cfg"), os.path.join(os.path.dirname(bin_dir), "pyvenv.cfg")]
    return [c for c in candidates if os.path.lexists(c)]


def _standard_libraries(interpreter: str) -> list:
    """The directories Python may take its standard library from, found without running it, as
    its start (getpath) looks for the landmark lib/pythonX.Y/os.py: under every directory above
    the interpreter (as named, and its real path), and above each venv's `home`. Every one that
    holds os.py is returned, lib64 too: a directory Python does not use only costs a check."""
    import re

    starts = [os.path.dirname(interpreter), os.path.dirname(os.path.realpath(interpreter))]
    for config in _venv_configs(interpreter):
        try:
            with open(config, encoding="utf-8", errors="replace") as f:
                lines = f.read(1 << 16).splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip().startswith("/"):
                starts += [value.strip(), os.path.realpath(value.strip())]
    found = []
    for start in dict.fromkeys(starts):
        directory = os.path.normpath(start)
        while True:
            for lib in ("lib", "lib64"):
                try:
                    names = sorted(os.listdir(os.path.join(directory, lib)))
                except OSError:
                    continue
                for name in names:
                    path = os.path.join(directory, lib, name)
                    if re.fullmatch(r"python\d+\.\d+t?", name) and os.path.isfile(os.path.join(path, "os.py")):
                        found.append(path)
            if directory == "/":
                break
            directory = os.path.dirname(directory)
    return list(dict.fromkeys(found))


def _import_path(interpreter: str, site: bool = True) -> list:
    """sys.path as the interpreter has it once site has run (what the CLI and the node services
    import from), asked of the interpreter itself, as a runtime starts it: -I, no environment.
    site=False: asked with -S, which runs no .pth file: sys.path then, with the directories site
    would add (site.getsitepackages(), computed without running site.main())."""
    import json
    import subprocess

    if site:
        command = [interpreter, "-I", "-c", "import json, sys; print(json.dumps(sys.path))"]
    else:
        # A venv's prefix is set by site.main(), which runs the .pth files: set it here as site
        # would (Debian's getsitepackages picks its directories by whether sys.prefix is a venv).
        venvs = [os.path.dirname(config) for config in _venv_configs(interpreter)]
        code = ("import json, site, sys\n"
                "found = sys.path + site.getsitepackages()\n"
                "for venv in sys.argv[1:]:\n"
                "    sys.prefix = sys.exec_prefix = venv\n"
                "    found += site.getsitepackages([venv])\n"
                "print(json.dumps(found))\n")  # fmt: skip
        command = [interpreter, "-I", "-S", "-c", code, *venvs]
    try:
        done = subprocess.run(command, capture_output=True, env={}, cwd="/", timeout=60)
        entries = json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        raise LauncherError(f"{interpreter}: cannot ask it for its import path: {e}") from None
    if not isinstance(entries, list):
        raise LauncherError(f"{interpreter}: cannot ask it for its import path: "
                            f"{printable(done.stderr.decode(errors='replace').strip()[-200:])}")  # fmt: skip
    # Path hooks (an editable install's finder) are names, not paths: their files are the package.
    entries = list(dict.fromkeys(e for e in entries if isinstance(e, str) and e.startswith("/")))
    return entries + [e for e in _pth_entries(entries) if e not in entries]


def _pth_entries(directories) -> list:
    """The directories the .pth files in directories name, existing or not: site leaves out one
    that does not exist, until someone makes it."""
    found = []
    for directory in directories:
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".pth"))
        except OSError:
            continue
        for name in names:
            try:
                with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as f:
                    lines = f.read(1 << 20).splitlines()
            except OSError:
                continue
            for line in (line.strip() for line in lines):
                if line and not line.startswith(("#", "import ", "import\t")):
                    found.append(os.path.normpath(os.path.join(directory, line)))
    return found


def _refuse(path: str, why: str):
    raise LauncherError(f"{path}: {why}: the hook runs as root on every container start, so its interpreter, "
                        "package and everything they import must be root's alone (install it as root, outside "
                        "a user's home)")  # fmt: skip


def _trusted(sources: HostSources, path: str, kind: str, place: bool = False) -> None:
    """path checked as the hook checks its host sources (place: where it would be made, if it is
    not there: HostSources.open_place); LauncherError naming what is wrong."""
    try:
        os.close(sources.open_place(path, kind) if place else sources.open(path, kind))
    except UntrustedSource as e:
        _refuse(e.path, e.why)
    except OSError as e:
        raise LauncherError(f"{path}: {e.strerror}") from None


def _importable(name: str) -> bool:
    """Whether an entry of a sys.path directory can be imported (a module, a package, a native
    module: its name up to the first dot is an identifier) or runs at start (a .pth file)."""
    return name.split(".", 1)[0].isidentifier() or name.endswith(".pth")


def _shared_object(name: str) -> bool:
    """Whether a file in an importable tree may be one the loader maps (an extension module, a
    library a wheel ships beside it): *.so, *.so.N."""
    return name.endswith(".so") or ".so." in name


def _trusted_tree(sources: HostSources, top: str, seen: set, objects: list) -> None:
    """top (a sys.path entry: a directory, or a zip file) and every importable entry under it:
    root's and writable by no one else; a symlink's target is checked from its own path. An entry
    that does not exist (python311.zip, usually) must stay so: its nearest existing directory
    must be one only root can change. objects: gets the shared objects found, for the loader."""
    if not os.path.lexists(top):
        _trusted(sources, top, "dir", place=True)
        return
    if os.path.isfile(top):
        _trusted(sources, top, "file")
        return
    _trusted(sources, top, "dir")
    real = os.path.realpath(top)
    if real in seen:
        return
    seen.add(real)
    for directory, dirs, names in os.walk(top, onerror=lambda e: _refuse(e.filename, e.strerror)):
        if directory == top:  # in a sys.path directory only what can be imported (not .git, .venv)
            dirs[:] = [d for d in dirs if _importable(d)]
            names = [n for n in names if _importable(n)]
        objects.extend(os.path.join(directory, n) for n in names if _shared_object(n))
        for name in dirs + names:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                target = os.path.isdir(path)
                _trusted(sources, path, "dir" if target else "file")
                if target:
                    _trusted_tree(sources, path, seen, objects)
            elif st.st_uid != 0:
                _refuse(path, f"owned by uid {st.st_uid}, not root")
            elif st.st_mode & 0o022:
                _refuse(path, "writable by others than root")
