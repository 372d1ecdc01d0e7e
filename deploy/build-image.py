#!/usr/bin/env python3
"""Build the node services' container image offline, from this machine's own files:
`make image`, or `deploy/build-image.py [--output FILE] [--name NAME]`.

No registry, no base image and no network. The root is assembled from what is installed here:
one bundle (toolkit/bundle.py: a directory that runs from anywhere, with nothing of the host's),
under /usr/local/libexec/oci-gpu-hook/bundles/<id>/, which holds
- the host's python3 and the part of its standard library the services can load (STDLIB_LEFT_OUT
  and EXTENSIONS_LEFT_OUT say what is left out, and why);
- this project's package, from this tree (its Python files and schemas);
- its dependencies (with the `kubernetes` extra: grpcio, protobuf) at exactly the versions
  deploy/image-requirements.txt locks, copied from the environment this script runs in, which
  must hold those versions (`make image` installs them; `--lock` writes the file anew);
- every shared library the interpreter and the extension modules need, as ldd resolves them on
  this machine, and LOADED_BY_NAME, with the loader, in its own lib/;
- bin/python3, compiled here (static), which runs the interpreter with that loader and lib/;
- its launcher (`python3 -IS`, the package's directory appended), and the pre-filter in front
  of it (static), which is what runtimes run;
- the SELinux policy module, compiled for each policy family whose headers are here
  (toolkit/policy_module.py: install loads the one for the host's policy): this machine's own
  development headers (selinux-policy-dev on Debian, selinux-policy-devel on RHEL), and those
  `--selinux-headers DIR` names (RHEL's, for an image built on Debian); each family once;
and, leading into it: /usr/bin/python3, /usr/bin/oci-gpu-hook (the same launcher), and links at
the libraries' paths on this machine.
No compiled bytecode: Python compiles what it imports.

Reproducible: the same tree, lock and machine give the same archive, byte for byte. Every entry's
time is SOURCE_DATE_EPOCH (default 0), its owner root, its mode fixed by kind (directories 0755,
/tmp 1777, files 0755 when executable, else 0644), the entries in name order.

The result is a docker-archive tarball (`ctr images import`, `podman load`, `docker load`) named
localhost/oci-gpu-hook-node:<version>. Build it on the distribution and architecture the nodes
run (the interpreter and the libraries are this machine's). docs/deploy.md ("The node services
on Kubernetes") says how to roll it out with the manifests in deploy/kubernetes/.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from oci_gpu_hook.toolkit import bundle, policy_module, prefilter  # noqa: E402

LOCK = os.path.join(HERE, "image-requirements.txt")
EXTRAS = ("kubernetes",)  # the device plugin's gRPC
# The standard library's parts that no node service loads: tests, IDLE and Tk (and with _tkinter
# Tcl, Tk and X11 themselves), curses, the DBM and SQLite databases, packaging and build tools
# (distutils, ensurepip, venv, lib2to3), pydoc's topics, and config-*: the static libpython, its
# objects and Makefile, for building extensions. Compiled bytecode is left out everywhere. And
# Debian's sitecustomize.py, a link to /etc/python3.X/ (the distribution's hook, for apport): a
# bundle holds no link out of itself, and runs on hosts whose /etc is not Debian's.
STDLIB_LEFT_OUT = {"test", "idlelib", "tkinter", "turtledemo", "turtle.py", "curses", "dbm", "sqlite3", "distutils",
                   "ensurepip", "venv", "lib2to3", "pydoc_data", "site-packages", "dist-packages", "__phello__",
                   "__pycache__", "sitecustomize.py"}  # fmt: skip
EXTENSIONS_LEFT_OUT = {"_tkinter", "_curses", "_curses_panel", "readline", "_dbm", "_gdbm", "_sqlite3", "nis", "_crypt",
                       "ossaudiodev", "_ctypes_test", "_testbuffer", "_testcapi", "_testclinic", "_testimportmultiple",
                       "_testinternalcapi", "_testmultiphase", "_testsinglephase", "_xxtestfuzz", "xxlimited",
                       "xxlimited_35", "xxsubtype"}  # fmt: skip
# The package's modules, its schemas, and its C sources (the bundle's id covers the pre-filter's,
# compiled into it; no .proto).
PACKAGE_FILES = (".py", ".json", ".c", ".h")
# What pip writes about one install (which files, whether asked for by name, by which installer,
# from where), not what the distribution is: left out, so that any venv holding the lock's
# versions (`make image`'s, the test suite's) gives the same image.
INSTALL_RECORDS = {"RECORD", "REQUESTED", "INSTALLER", "direct_url.json"}
# Libraries that nothing of the bundle's NEEDs, and that it loads all the same: libselinux, by
# name (ctypes), to label what the hook creates; libgcc_s, which glibc loads itself when a thread
# exits (pthread_exit unwinds with it); and the C library's other parts that the driver's
# libraries NEED (libnvidia-ml: libdl, libpthread, librt, libm), which NVML binds by path. A
# bundle that lacked one would load the host's (the loader falls back to its default
# directories), built against another C library, or, on a host that keeps them elsewhere
# (/usr/lib64), fail.
LOADED_BY_NAME = ("libselinux.so.1", "libgcc_s.so.1", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libm.so.6",
                  "libutil.so.1", "libresolv.so.2", "libanl.so.1")  # fmt: skip


SELINUX_SOURCES = os.path.join(REPO, "selinux")
SYSTEM_SELINUX_MAKEFILE = "/usr/share/selinux/devel/Makefile"  # it sets HEADERDIR to the next
SYSTEM_SELINUX_HEADERS = "/usr/share/selinux/devel/include"
# A policy's headers say which family they are in their build.conf (DISTRO), and the module's .te
# takes that family's branch (selinux/oci_gpu_hook.te).
FLAVOUR_OF_DISTRO = {"debian": "debian", "redhat": "rhel"}
# Module format 19, the newest RHEL 8's libsepol (2.9) links; later ones add nothing the module
# uses (a checkmodule that writes 21 by default would make a module RHEL 8 refuses). -M: both
# families' policies are MCS.
CHECKMODULE = "checkmodule -M -c 19"


class BuildError(Exception):
    pass


def version() -> str:
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        return next(line.split('"')[1] for line in f if line.startswith("version"))


def python_paths(python: str) -> tuple:
    """(the interpreter's real path, its major.minor, its standard library, its extension modules)."""
    probe = ("import sys, sysconfig; print(sys.executable); print('%d.%d' % sys.version_info[:2]); "
             "print(sysconfig.get_paths()['stdlib']); print(sysconfig.get_config_var('DESTSHARED'))")  # fmt: skip
    out = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True, check=True).stdout.split("\n")
    return os.path.realpath(out[0]), out[1], out[2], out[3]


def left_out_of_stdlib(directory: str, names: list) -> list:
    """copytree's ignore: STDLIB_LEFT_OUT by name, config-* (at the top), EXTENSIONS_LEFT_OUT by
    module name (_tkinter.cpython-311-x86_64-linux-gnu.so is _tkinter), any .pyc."""
    return [n for n in names if n in STDLIB_LEFT_OUT or n.startswith("config-") or n.endswith(".pyc")
            or (".so" in n and n.split(".")[0] in EXTENSIONS_LEFT_OUT)]  # fmt: skip


def copy(source: str, root: str, target: str | None = None) -> None:
    """source (links followed) to the same path, or target, under root."""
    destination = os.path.join(root, (target or source).lstrip("/"))
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    shutil.copy2(os.path.realpath(source), destination)


def needed_libraries(path: str) -> set:
    """The shared libraries path needs, as this machine's loader resolves them (ldd)."""
    out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    found = set()
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) > parts.index("=>") + 1 and parts[parts.index("=>") + 1].startswith("/"):
            found.add(parts[parts.index("=>") + 1])
        elif parts and parts[0].startswith("/"):
            found.add(parts[0])  # the loader
    return found


# ---- the locked dependencies ---------------------------------------------------------------------


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _packaging():
    """packaging's Requirement, from packaging or, where it is not installed, pip's own copy."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def _applies(requirement, extras) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({"extra": extra}) for extra in ("", *extras))


def project_requirements() -> list:
    """The project's run-time requirements with EXTRAS, from pyproject.toml (not from an installed
    copy's metadata, which may be older than this tree)."""
    try:
        import tomllib  # novermin (before Python 3.11: pip's tomli below)
    except ImportError:  # Python < 3.11: pip's own copy of tomli (the image's venv holds pip)
        from pip._vendor import tomli as tomllib
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    texts = list(project["dependencies"])
    for extra in EXTRAS:
        texts += project["optional-dependencies"][extra]
    return texts


def installed_closure() -> dict:
    """{canonical name: version} of every distribution the project needs at run time, as this
    environment has them; BuildError when one is missing or outside what its dependant asks."""
    import importlib.metadata as metadata

    Requirement = _packaging()
    found = {}
    pending = [(Requirement(text), "pyproject.toml") for text in project_requirements()]
    while pending:
        requirement, wanted_by = pending.pop()
        if not _applies(requirement, ()):
            continue
        name = canonical(requirement.name)
        if name == "oci-gpu-hook":
            continue  # the project itself comes from this tree
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise BuildError(f"{name} (needed by {wanted_by}) is not installed in {sys.prefix}: "
                             "`make image` installs deploy/image-requirements.txt") from None  # fmt: skip
        if not requirement.specifier.contains(distribution.version, prereleases=True):
            raise BuildError(f"{name} {distribution.version} is installed, but {wanted_by} needs {requirement}")
        if name in found:
            continue
        found[name] = distribution.version
        for text in distribution.requires or ():
            needed = Requirement(text)
            if _applies(needed, requirement.extras):
                pending.append((needed, name))
    return found


def read_lock(path: str = LOCK) -> dict:
    """{canonical name: version} of the lock's lines that apply to this interpreter."""
    Requirement = _packaging()
    locked = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            try:
                requirement = Requirement(text)
            except ValueError as e:  # packaging's InvalidRequirement
                raise BuildError(f"{path}:{number}: {text!r}: {str(e).splitlines()[0]}") from None
            pinned = [s.version for s in requirement.specifier if s.operator == "=="]
            if len(pinned) != 1 or len(requirement.specifier) != 1:
                raise BuildError(f"{path}:{number}: {text!r} is not one exact version (name==version)")
            if _applies(requirement, ()):
                locked[canonical(requirement.name)] = pinned[0]
    return locked


def check_lock(installed: dict, locked: dict, lock: str) -> None:
    problems = [f"{n} {installed[n]} installed, {locked[n]} locked" for n in sorted(set(installed) & set(locked))
                if installed[n] != locked[n]]  # fmt: skip
    problems += [f"{n} needed, not locked" for n in sorted(set(installed) - set(locked))]
    problems += [f"{n} locked, not needed" for n in sorted(set(locked) - set(installed))]
    if problems:
        raise BuildError(f"{lock} does not match this environment ({'; '.join(problems)}): "
                         "`make image` installs the locked versions; after changing the dependencies, "
                         "`deploy/build-image.py --lock` writes the lock")  # fmt: skip


def write_lock(installed: dict, lock: str = LOCK) -> None:
    """The lock from this environment; lines for other interpreters (with a marker that does not
    apply here) are kept as they are."""
    Requirement = _packaging()
    kept, head = [], []
    if os.path.exists(lock):
        with open(lock) as f:
            for line in f:
                text = line.split("#", 1)[0].strip()
                if not text:
                    if not kept and line.startswith("#"):
                        head.append(line)
                elif not _applies(Requirement(text), ()):
                    kept.append(line)
    lines = [f"{name}=={installed[name]}\n" for name in installed] + kept
    with open(lock, "w") as f:
        f.writelines(head + sorted(lines, key=lambda line: canonical(re.split(r"[=<>!~; ]", line, maxsplit=1)[0])))


def copy_distribution(name: str, site: str) -> None:
    """The distribution's files as its RECORD lists them, under site: its modules and metadata,
    no scripts (outside site-packages), no bytecode and none of INSTALL_RECORDS."""
    import importlib.metadata as metadata

    distribution = metadata.distribution(name)
    for file in distribution.files or ():
        if file.parts[0] == ".." or "__pycache__" in file.parts or file.suffix == ".pyc":
            continue
        if file.parts[0].endswith(".dist-info") and file.name in INSTALL_RECORDS:
            continue
        source = str(distribution.locate_file(file))
        if not os.path.isfile(source):
            raise BuildError(f"{source}: listed in {name}'s RECORD, and not there (reinstall {name})")
        copy(source, site, str(file))


# ---- the image -----------------------------------------------------------------------------------


def normalise(root: str) -> None:
    """Modes by kind, whatever the umask and the copies' sources: directories 0755 (/tmp 1777),
    files 0755 when anyone may execute them, else 0644. Links stay links."""
    for directory, _, files in os.walk(root):
        os.chmod(directory, 0o1777 if directory == os.path.join(root, "tmp") else 0o755)
        for name in files:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                os.chmod(path, 0o755 if st.st_mode & 0o111 else 0o644)


def write_archive(root: str, output: str, name: str, command: list, epoch: int) -> None:
    """root as a docker-archive (manifest.json, the image's configuration, one layer), named name,
    running command: what `ctr images import`, `podman load` and `docker load` take. The same
    tree gives the same bytes: every entry's time is epoch (an int: a float would add a PAX
    header), its owner root, entries in name order (tarfile adds a directory's sorted)."""
    import hashlib
    import io
    import json
    import platform
    import tarfile

    def fixed(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        info.mtime = epoch
        return info

    def member(archive: tarfile.TarFile, path: str, data: bytes) -> None:
        info = fixed(tarfile.TarInfo(path))
        info.size, info.mode = len(data), 0o644
        archive.addfile(info, io.BytesIO(data))

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(os.listdir(root)):
            tar.add(os.path.join(root, entry), arcname=entry, filter=fixed)
    digest = hashlib.sha256(layer.getvalue()).hexdigest()
    machine = platform.machine()
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
    config = json.dumps({
        "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine),
        "os": "linux",
        "created": created,
        "config": {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "Cmd": command, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{digest}"]},
        "history": [{"created": created, "created_by": "deploy/build-image.py"}],
    }).encode()  # fmt: skip
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [name], "Layers": [f"{digest}/layer.tar"]}])
    with tarfile.open(output, "w", format=tarfile.PAX_FORMAT) as archive:
        member(archive, config_name, config)
        member(archive, f"{digest}/layer.tar", layer.getvalue())
        member(archive, "manifest.json", manifest.encode())


def loaded_by_name(libc: str) -> set:
    """LOADED_BY_NAME, from the C library's own directory, with what each needs."""
    found = set()
    for soname in LOADED_BY_NAME:
        path = os.path.join(os.path.dirname(libc), soname)
        if not os.path.exists(path):
            raise BuildError(f"{path}: not on this machine; the bundle needs it (install its package)")
        found |= {path} | needed_libraries(path)
    return found


def make_bundle(root: str, interpreter: str, stdlib: str, dynload: str, installed: dict, selinux_headers=()) -> str:
    """The bundle (toolkit/bundle.py) under root's BUNDLES_DIR: the interpreter, its standard
    library, this package and its locked dependencies, and every library these need, in the
    bundle's own lib/. Returns its id. The root's own paths of those libraries become links to
    the bundle's copies, so that whatever else runs in the image finds them where ldd did."""
    parent = os.path.join(root, bundle.BUNDLES_DIR.lstrip("/"))
    top = os.path.join(parent, ".staging")
    short = os.path.basename(stdlib)
    copy(interpreter, top, bundle.INTERPRETER)
    library_tree = os.path.join(top, bundle.LIBRARIES, short)
    shutil.copytree(stdlib, library_tree, symlinks=True, ignore=left_out_of_stdlib)
    if not os.path.isdir(os.path.join(library_tree, "lib-dynload")):
        shutil.copytree(dynload, os.path.join(library_tree, "lib-dynload"), ignore=left_out_of_stdlib)
    site = os.path.join(top, bundle.SITE)
    package = os.path.join(REPO, "oci_gpu_hook")
    for directory, names, files in os.walk(package):
        names[:] = [n for n in names if n != "__pycache__"]
        for file in files:
            if file.endswith(PACKAGE_FILES):
                source = os.path.join(directory, file)
                copy(source, site, os.path.relpath(source, REPO))
    for distribution in sorted(installed):
        copy_distribution(distribution, site)
    selinux_modules(top, selinux_headers)
    programs = [interpreter] + [os.path.join(d, f) for top_ in (site, library_tree)
                                for d, _, files in os.walk(top_) for f in files if ".so" in f]  # fmt: skip
    libraries = set()
    for program in programs:
        libraries |= needed_libraries(program)
    libc = next((p for p in libraries if os.path.basename(p) == "libc.so.6"), None)
    if libc is None:
        raise BuildError(f"{interpreter}: ldd names no libc.so.6 (the bundle runs only with glibc)")
    libraries |= loaded_by_name(libc)
    loaders = [p for p in libraries if os.path.basename(p).startswith("ld-linux")]
    if len(loaders) != 1:
        raise BuildError(f"{interpreter}: ldd names {len(loaders)} dynamic loaders, not one: {sorted(loaders)}")
    by_name: dict = {}
    for library in sorted(libraries):
        if by_name.setdefault(os.path.basename(library), library) != library:
            raise BuildError(f"{library} and {by_name[os.path.basename(library)]}: one name, two libraries")
        copy(library, top, f"{bundle.LIBRARIES}/{os.path.basename(library)}")
    cc = prefilter.compiler()
    if cc is None:
        raise BuildError("no C compiler (cc, gcc or $CC) to build the bundle's python3: `make image` installs one")
    os.makedirs(os.path.join(top, "bin"), exist_ok=True)
    try:
        bundle.build_python(os.path.join(top, bundle.PYTHON), os.path.basename(loaders[0]), cc)
    except bundle.BundleError as e:
        raise BuildError(str(e)) from None
    normalise(top)  # the id covers the modes the image will have
    bundle_id = bundle.identity(top)
    os.rename(top, os.path.join(parent, bundle_id))
    here = bundle.directory(bundle_id)
    try:
        program = bundle.build_prefilter(bundle_id, cc)
    except prefilter.PrefilterError as e:
        raise BuildError(f"the bundle's pre-filter (static: libc6-dev's libc.a): {e}") from None
    with open(os.path.join(root, f"{here}/{bundle.PREFILTER}".lstrip("/")), "wb") as f:
        f.write(program)
    os.chmod(os.path.join(root, f"{here}/{bundle.PREFILTER}".lstrip("/")), 0o755)
    for library in sorted(libraries):
        link = os.path.join(root, library.lstrip("/"))
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(f"{here}/{bundle.LIBRARIES}/{os.path.basename(library)}", link)
    return bundle_id


def selinux_flavour(headers: str) -> str:
    """The policy family of a header tree, from its build.conf's DISTRO."""
    distro = None
    try:
        with open(os.path.join(headers, "build.conf")) as f:
            for line in f:
                key, sep, value = line.partition("=")
                if sep and key.strip().rstrip("?:").strip() == "DISTRO":
                    distro = value.strip()
    except OSError as e:
        raise BuildError(f"{headers}: no SELinux policy headers there ({e.strerror}: build.conf)") from None
    if distro not in FLAVOUR_OF_DISTRO:
        raise BuildError(f"{headers}/build.conf: DISTRO {distro!r}, not one of {', '.join(FLAVOUR_OF_DISTRO)}: "
                         "the module has no branch for that policy family")  # fmt: skip
    return FLAVOUR_OF_DISTRO[distro]


def selinux_modules(top: str, extra_headers=()) -> list:
    """Compile selinux/oci_gpu_hook.te into top/selinux/<flavour>/oci_gpu_hook.pp, with this
    machine's development headers and each of extra_headers; returns the flavours built."""
    builds = []
    if os.path.isfile(SYSTEM_SELINUX_MAKEFILE):
        builds.append((selinux_flavour(SYSTEM_SELINUX_HEADERS), ["-f", SYSTEM_SELINUX_MAKEFILE]))
    for headers in extra_headers:
        headers = os.path.abspath(headers)
        builds.append((selinux_flavour(headers), ["-f", f"{headers}/Makefile", f"HEADERDIR={headers}",
                                                  "NAME=targeted"]))  # fmt: skip
    if not builds:
        raise BuildError(f"no SELinux policy headers ({SYSTEM_SELINUX_MAKEFILE}: selinux-policy-dev, or "
                         "--selinux-headers DIR) to compile the module the toolkit loads: `make image` "
                         "installs them")  # fmt: skip
    flavours = [flavour for flavour, _ in builds]
    if len(set(flavours)) != len(flavours):
        raise BuildError(f"SELinux headers of one family given twice ({', '.join(flavours)}): one each")
    sources = [os.path.join(SELINUX_SOURCES, f"{policy_module.MODULE}.{ext}") for ext in ("te", "if", "fc")]
    missing = [path for path in sources if not os.path.isfile(path)]
    if missing:
        raise BuildError(f"{missing[0]}: missing (the SELinux module's source, selinux/ in this tree)")
    for flavour, args in builds:
        with tempfile.TemporaryDirectory(prefix="oci-gpu-hook-selinux-") as work:
            for source in sources:
                shutil.copy(source, work)
            argv = ["make", *args, "TYPE=mcs", f"CHECKMODULE={CHECKMODULE}", f"{policy_module.MODULE}.pp"]
            try:
                done = subprocess.run(argv, cwd=work, capture_output=True, text=True,
                                      env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"})  # fmt: skip
            except OSError as e:
                raise BuildError(f"make: {e.strerror} (the SELinux module needs make, m4 and checkpolicy)") from None
            if done.returncode != 0:
                said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
                raise BuildError(f"the SELinux module for {flavour}: {said}")
            copy(os.path.join(work, f"{policy_module.MODULE}.pp"), top,
                 f"{policy_module.DIRECTORY}/{flavour}/{policy_module.MODULE}.pp")  # fmt: skip
    return flavours


def build(output: str, name: str, python: str, epoch: int, lock: str = LOCK, selinux_headers=()) -> str:
    interpreter, short, stdlib, dynload = python_paths(python)
    running = "{}.{}".format(*sys.version_info[:2])
    if short != running:
        raise BuildError(f"{python} is Python {short}, but this runs on {running} (whose packages the image takes): "
                         f"run this with a {short} environment")  # fmt: skip
    installed = installed_closure()
    check_lock(installed, read_lock(lock), lock)
    with tempfile.TemporaryDirectory(prefix="oci-gpu-hook-image-") as work:
        root = os.path.join(work, "rootfs")
        for directory in ("etc", "tmp", "usr/bin", "proc", "sys", "dev", "run", "var/cache"):
            os.makedirs(os.path.join(root, directory), exist_ok=True)
        bundle_id = make_bundle(root, interpreter, stdlib, dynload, installed, selinux_headers)
        here = bundle.directory(bundle_id)
        os.symlink(f"{here}/{bundle.PYTHON}", os.path.join(root, "usr/bin/python3"))
        note = "# The node image's bundle (deploy/build-image.py, toolkit/bundle.py).\n"
        for path in (f"{here}/{bundle.LAUNCHER}", "/usr/bin/oci-gpu-hook"):
            with open(os.path.join(root, path.lstrip("/")), "w") as f:
                f.write(bundle.launcher_text(bundle_id, note))
            os.chmod(os.path.join(root, path.lstrip("/")), 0o755)
        with open(os.path.join(root, "etc/passwd"), "w") as f:
            f.write("root:x:0:0:root:/:/usr/sbin/nologin\n")
        with open(os.path.join(root, "etc/group"), "w") as f:
            f.write("root:x:0:\n")
        normalise(root)
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        write_archive(root, output, name, ["/usr/bin/oci-gpu-hook", "--help"], epoch)
    return output


def source_date_epoch() -> int:
    text = os.environ.get("SOURCE_DATE_EPOCH", "0")
    if not text.isdigit():
        raise BuildError(f"SOURCE_DATE_EPOCH={text!r}: expected seconds since 1970 (digits)")
    return int(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=os.path.join(REPO, "build", "oci-gpu-hook-node.tar"))
    parser.add_argument("--name", default=f"localhost/oci-gpu-hook-node:{version()}")
    parser.add_argument("--python", default="/usr/bin/python3", help="the interpreter the image runs")
    parser.add_argument(
        "--requirements",
        metavar="FILE",
        default=LOCK,
        help="the lock to build with (default: deploy/image-requirements.txt)",
    )
    parser.add_argument("--selinux-headers", metavar="DIR", action="append", default=[],
                        help="another SELinux policy family's headers to compile the module for (RHEL's)")  # fmt: skip
    parser.add_argument("--lock", action="store_true",
                        help="write the lock from this environment's versions; build nothing")  # fmt: skip
    args = parser.parse_args()
    try:
        if args.lock:
            write_lock(installed_closure(), args.requirements)
            print(args.requirements)
            return 0
        print(build(args.output, args.name, args.python, source_date_epoch(), args.requirements,
                    args.selinux_headers))  # fmt: skip
    except BuildError as e:
        sys.stderr.write(f"build-image: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
