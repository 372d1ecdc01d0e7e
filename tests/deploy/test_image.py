"""`make image` (deploy/build-image.py; issue 40, item 6): the node services' image, without a
cluster (tests/e2e/test_deploy.py runs it on one).
- Two builds a second apart, the second under another umask and in another temporary directory,
  give the same archive byte for byte: fixed times, owners, modes and order, and dependencies
  copied at the lock's versions from the environment instead of resolved at build time.
- None of what no node service runs is in it (the static libpython, Tk, Tcl and X11, the
  standard library's tests, IDLE, compiled bytecode, ...), and it stays below SIZE_BOUND.
- Its Python dependencies are exactly deploy/image-requirements.txt's; a lock that disagrees
  with the environment refuses the build in one line and writes nothing.
- The services run from it: in a chroot of its root (a private mount namespace, the simulated
  host bind-mounted at its own path) labels prints the host's labels, the watchdog scans, the
  device plugin's check lists the GPUs, the exporter serves them, and every module of the
  package imports (the kubelet API's gRPC stubs included).
- `make image` installs what the build needs, and nothing of the test suite's.
- Its bundle carries the SELinux module compiled for each policy family (toolkit/policy_module.py):
  each in its family's branch of oci_gpu_hook.te, in module format 19 (RHEL 8's libsepol links it).
"""

import json
import os
import re
import struct
import subprocess
import tarfile
import time
import urllib.request

import pytest
from hookcheck import expected_labels
from imagecheck import build, image_bundle, layer
from servicecheck import free_port

from oci_gpu_hook.start import prefilter_rule
from oci_gpu_hook.toolkit import bundle, install, launcher, policy_module, prefilter

pytestmark = pytest.mark.host(gpus=2, mig=[1], needs=("unshare", "chroot", "mount"))

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOCK = os.path.join(REPO, "deploy", "image-requirements.txt")
# Where the image's package is: the site of its one bundle (toolkit/bundle.py).
SITE_PATTERN = re.escape(bundle.BUNDLES_DIR.lstrip("/")) + rf"/[0-9a-f]{{{bundle.ID_LENGTH}}}/{bundle.SITE}"
# 56 MiB measured (Debian 12, amd64, Python 3.11; grpcio alone is 18 MiB of it), with 4 MiB for
# the dependencies to grow. What the review found in it crosses the bound on its own: the static
# libpython and config-* 24 MiB, Tk, Tcl and X11 with their fonts 9 MiB, bytecode 8 MiB.
SIZE_BOUND = 60 << 20
# What no node service runs, by the names of the layer's members.
LEFT_OUT = {
    "the static libpython": r"/libpython[^/]*\.a$",
    "config-* (libpython's objects and Makefile)": r"/lib/python3\.\d+/config-",
    "Tk": r"(/tkinter(/|$)|/_tkinter\.|/libtk[^/]*\.so)",
    "Tcl": r"/lib(tcl|BLT)[^/]*\.so",
    "X11 and fonts": r"/lib(X11|xcb|Xft|Xrender|Xext|Xss|Xau|Xdmcp|fontconfig|freetype|png)[^/]*\.so",
    "IDLE": r"/idlelib(/|$)",
    "turtledemo": r"/turtledemo(/|$)",
    "the standard library's tests": r"/lib/python3\.\d+/(test|unittest/test)(/|$)|/_test[a-z]*\.cpython",
    "compiled bytecode": r"(\.pyc$|(^|/)__pycache__(/|$))",
    "curses and readline": r"(/_curses|/readline\.cpython|/lib(readline|ncurses)[^/]*\.so)",
    "SQLite and DBM": r"(/_sqlite3\.|/_dbm\.|/_gdbm\.|/lib(sqlite3|db-|gdbm)[^/]*\.so)",
    "ensurepip's wheels": r"/ensurepip(/|$)",
    # pip's records of one install (another venv with the same versions would give another image)
    "the venv's install records": r"\.dist-info/(RECORD|REQUESTED|INSTALLER|direct_url\.json)$",
}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Two builds of the image, a second apart, the second under umask 077 in another directory."""
    tmp = tmp_path_factory.mktemp("image")
    one = build(tmp / "one.tar", tmp / "tmp-one")
    assert one.returncode == 0, one.stderr
    time.sleep(1.1)
    two = build(tmp / "two.tar", tmp / "tmp-two", 0o077)
    assert two.returncode == 0, two.stderr
    return tmp / "one.tar", tmp / "two.tar"


def described(path) -> dict:
    """{member: (type, mode, owner, time, size or link)} of the archive and of its layer."""
    found = {}
    with tarfile.open(path) as archive:
        for m in archive.getmembers():
            found[m.name] = (m.type, m.mode, m.uid, m.gid, m.uname, m.gname, m.mtime, m.size)
    for m in layer(path).getmembers():
        found["layer:" + m.name] = (m.type, m.mode, m.uid, m.gid, m.uname, m.gname, m.mtime, m.size, m.linkname)
    return found


def test_two_builds_are_the_same_bytes(images):
    one, two = images
    if one.read_bytes() != two.read_bytes():
        a, b = described(one), described(two)
        differences = [f"{n}: {a.get(n)} / {b.get(n)}" for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n)]
        pytest.fail(f"two builds differ in {len(differences)} members, e.g.:\n" + "\n".join(differences[:10]))


def test_every_entry_has_fixed_times_owners_and_modes(images):
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    for member in layer(images[0]).getmembers():
        assert (member.mtime, member.uid, member.gid, member.uname, member.gname) == (epoch, 0, 0, "root", "root")
        if member.isdir():
            assert member.mode == (0o1777 if member.name == "tmp" else 0o755), member.name
        elif member.isfile():
            assert member.mode in (0o644, 0o755), (member.name, oct(member.mode))


def test_it_carries_nothing_the_services_never_run(images):
    names = layer(images[0]).getnames()
    for what, pattern in LEFT_OUT.items():
        found = [n for n in names if re.search(pattern, n)]
        assert not found, f"{what}: {found[:5]}"
    assert os.path.getsize(images[0]) < SIZE_BOUND, os.path.getsize(images[0]) >> 20


def test_its_dependencies_are_the_locked_versions(images):
    """Each locked distribution's metadata is in the image at its version, and no other's."""
    with open(LOCK) as f:
        locked = dict(line.strip().split("==") for line in f if line.strip() and not line.startswith("#"))
    found = {}
    for name in layer(images[0]).getnames():
        match = re.fullmatch(rf"{SITE_PATTERN}/([^/]+)-([^-/]+)\.dist-info", name)
        if match:
            found[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(2)
    assert found == locked


def test_a_lock_that_disagrees_with_the_environment_refuses_the_build(images, tmp_path):
    """One clear line naming each disagreement; no archive written."""
    with open(LOCK) as f:
        text = f.read()
    grpcio = re.search(r"^grpcio==(\S+)$", text, re.M).group(1)
    cases = {
        "another version": (text.replace(f"grpcio=={grpcio}", "grpcio==0.0.1"),
                            f"grpcio {grpcio} installed, 0.0.1 locked"),
        "a missing package": (re.sub(r"^attrs==.*\n", "", text, flags=re.M), "attrs needed, not locked"),
        "a package not needed": (text + "six==1.16.0\n", "six locked, not needed"),
        "a range": (text.replace(f"grpcio=={grpcio}", "grpcio>=1"), "is not one exact version"),
    }  # fmt: skip
    for case, (lock, words) in cases.items():
        (tmp_path / "lock.txt").write_text(lock)
        out = build(tmp_path / "image.tar", tmp_path / "tmp", 0o022, "--requirements", str(tmp_path / "lock.txt"))
        assert out.returncode == 1, case
        (line,) = out.stderr.splitlines()
        assert line.startswith("build-image: ") and words in line, (case, line)
        assert not (tmp_path / "image.tar").exists(), case


@pytest.fixture(scope="module")
def image_root(images, tmp_path_factory):
    root = tmp_path_factory.mktemp("image-root")
    layer(images[0]).extractall(root)  # as root: owners and modes as the image has them
    return str(root)


def in_image(root: str, host: dict, argv: list, **popen) -> subprocess.Popen:
    """argv in a chroot of the image's root, in a mount namespace of its own where the simulated
    host is bind-mounted at its own path and /proc is mounted; the process is argv's own (each
    step execs the next)."""
    script = 'mkdir -p "$1$2" && mount --bind "$2" "$1$2" && mount -t proc proc "$1/proc" && r="$1" && shift 2 && ' \
             'exec chroot "$r" "$@"'  # fmt: skip
    return subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", root,
                             host["root"], *argv], stdin=subprocess.DEVNULL, **popen)  # fmt: skip


def run_in_image(root: str, host: dict, *args: str) -> subprocess.CompletedProcess:
    proc = in_image(root, host, ["/usr/bin/oci-gpu-hook", "--config", f"{host['root']}/config.yaml", *args],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_the_services_run_from_the_image(image_root, host):
    gpus = [g["uuid"] for g in host["gpus"]]
    labels = run_in_image(image_root, host, "labels", "--output", "-")
    assert labels.returncode == 0, labels.stderr
    assert dict(line.split("=", 1) for line in labels.stdout.splitlines()) == expected_labels(host)
    watchdog = run_in_image(image_root, host, "watchdog", "--once")
    assert watchdog.returncode == 0 and "watchdog: watching" in watchdog.stderr, watchdog.stderr
    plugin = run_in_image(image_root, host, "device-plugin", "--check")
    assert plugin.returncode == 0 and all(uuid in plugin.stdout for uuid in gpus), plugin.stdout + plugin.stderr
    port = free_port()
    exporter = in_image(image_root, host, ["/usr/bin/oci-gpu-hook", "--config", f"{host['root']}/config.yaml",
                                           "exporter", "--listen", f"127.0.0.1:{port}"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                    page = r.read().decode()
                break
            except OSError:
                assert exporter.poll() is None and time.monotonic() < deadline, "the exporter did not serve"
                time.sleep(0.2)
    finally:
        exporter.terminate()
        _, errors = exporter.communicate(timeout=30)
    for uuid in gpus:
        assert re.search(rf'^\w+\{{[^}}]*UUID="{uuid}"', page, re.M), (uuid, page[:2000], errors)


def test_every_module_imports_in_the_image(image_root, host):
    probe = ("import importlib, pkgutil, sys; sys.path.append(sys.argv[1]); import oci_gpu_hook; "
             "names = [m.name for m in pkgutil.walk_packages(oci_gpu_hook.__path__, 'oci_gpu_hook.') "
             "if not m.name.endswith('__main__')]; "
             "[importlib.import_module(n) for n in names]; print(*names)")  # fmt: skip
    _, site = launcher.named(os.path.join(image_root, "usr/bin/oci-gpu-hook"))
    assert re.fullmatch("/" + SITE_PATTERN, site), site
    proc = in_image(image_root, host, ["/usr/bin/python3", "-I", "-c", probe, site], stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)  # fmt: skip
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    modules = set()  # every module and subpackage of this tree's package, as dotted names
    for directory, _, files in os.walk(os.path.join(REPO, "oci_gpu_hook")):
        for file in files:
            if file.endswith(".py") and file != "__main__.py":
                path = os.path.relpath(os.path.join(directory, file), REPO)[: -len(".py")]
                modules.add(path.replace(os.sep, ".").removesuffix(".__init__"))
    assert set(out.split()) == modules - {"oci_gpu_hook"}


def test_make_image_installs_only_what_the_build_needs():
    """`make -n -B image`: every command make would run, none run. The test suite's packages
    (setup-host.sh test: docker.io, containerd, prometheus, the SELinux tools) are not among them,
    and the Python packages it installs are the lock's."""
    out = subprocess.run(["make", "-n", "-B", "image"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "setup-host.sh image" in out.stdout and "setup-host.sh test" not in out.stdout, out.stdout
    installs = [line for line in out.stdout.splitlines() if "pip install" in line and "--upgrade pip" not in line]
    assert installs and all("-r deploy/image-requirements.txt" in line and "[test]" not in line for line in installs)


def test_the_image_carries_one_bundle_whose_id_is_its_content(image_root):
    """Everything Python is in one bundle, named by the digest of its files: the image's python3,
    its launcher and the root's library paths all lead into it, and its launcher is the one that
    install puts on a host (the same path there)."""
    top = image_bundle(image_root)
    bundle_id = os.path.basename(top)
    assert bundle.identity(top) == bundle_id
    here = bundle.directory(bundle_id)
    assert os.readlink(os.path.join(image_root, "usr/bin/python3")) == f"{here}/{bundle.PYTHON}"
    with open(os.path.join(top, bundle.LAUNCHER)) as f:
        text = f.read()
    assert text == open(os.path.join(image_root, "usr/bin/oci-gpu-hook")).read()
    assert launcher.named(os.path.join(top, bundle.LAUNCHER)) == (f"{here}/{bundle.PYTHON}", f"{here}/{bundle.SITE}")
    links = [os.path.join(d, n) for d, _, files in os.walk(os.path.join(image_root, "lib")) for n in files]
    links += [os.path.join(image_root, "lib64", n) for n in os.listdir(os.path.join(image_root, "lib64"))]
    assert links and all(os.readlink(p).startswith(f"{here}/{bundle.LIBRARIES}/") for p in links)
    assert all(os.path.isfile(image_root + os.readlink(p)) for p in links)


def test_the_bundle_runs_alone_in_an_empty_root(image_root, tmp_path, require):
    """The bundle copied alone into a root with nothing else (no C library, no loader at /lib64,
    no python3) runs the hook's CLI: it is what a host without Python, or with another C library,
    runs. Run on this host, from wherever it was copied, with the environment every runtime
    gives the hook, its process maps no file but the bundle's, even with LD_PRELOAD and
    LD_LIBRARY_PATH set by the caller (the loader would complain of a preload it cannot find),
    and even once it loads a library built as the driver's are (NEEDing libdl, which the bundle
    must carry: the loader would find the host's).
    (LC_ALL=C is why no locale file of the host's is read: in another locale, glibc reads the
    host's locale files, and ignores them where their format is not its own.)"""
    import shutil

    require("gcc")
    top = image_bundle(image_root)
    here = bundle.directory(os.path.basename(top))
    empty = tmp_path / "empty"
    shutil.copytree(top, str(empty) + here, symlinks=True)
    (empty / "proc").mkdir()
    script = 'mount -t proc proc "$1/proc" && r="$1" && shift && exec chroot "$r" "$@"'
    version = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(empty),
                              f"{here}/{bundle.LAUNCHER}", "--version"], capture_output=True, text=True, timeout=120,
                             env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})  # fmt: skip
    assert version.returncode == 0 and "oci-gpu-hook" in version.stdout, version.stdout + version.stderr
    assert set(os.listdir(empty)) == {"proc", here.split("/")[1]}  # nothing else was there
    # What a runtime runs: the pre-filter, static, answering a start that asks for no GPU itself
    # and handing the rest to the bundle's launcher (above, --version went through it).
    program = f"{here}/{bundle.PREFILTER}"
    assert prefilter.is_prefilter(str(empty) + program)
    assert prefilter.runs(str(empty) + program) == f"{here}/{bundle.LAUNCHER}"
    assert prefilter.offers_to(str(empty) + program) == prefilter_rule.START_SERVER_SOCKET
    with open(str(empty) + program, "rb") as f:
        head = f.read(1 << 16)
    assert b"/lib64/ld-linux" not in head  # no PT_INTERP: static
    (empty / "oci").mkdir()
    config = {"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "process": {"args": ["sh"], "env": ["PATH=/bin"]}}
    (empty / "oci" / "config.json").write_text(json.dumps(config))
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "created", "pid": 1, "bundle": "/oci"})
    handed = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(empty),
                             program, "--version"], capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})  # fmt: skip
    assert handed.returncode == 0 and handed.stdout == version.stdout, handed
    # A library as the driver's are built: it NEEDs the C library's libdl (libnvidia-ml does).
    driverlike = tmp_path / "libdriverlike.so"
    source = tmp_path / "driverlike.c"
    source.write_text("int driverlike(void) { return 7; }\n")
    # -l:libdl.so.2: glibc 2.34's libdl.so for linking is empty, and -ldl would record nothing.
    built = subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(driverlike), str(source), "-Wl,--no-as-needed",
                            "-l:libdl.so.2"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert "(NEEDED)             Shared library: [libdl.so.2]" in subprocess.run(
        ["readelf", "-d", str(driverlike)], capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    probe = ("import ctypes, sys; sys.path.append(sys.argv[1]); import oci_gpu_hook.hook, oci_gpu_hook.cli; "
             "assert ctypes.CDLL(sys.argv[2]).driverlike() == 7; "
             "print(sys.executable); print(*sorted({l.split()[-1] for l in open('/proc/self/maps') "
             "if l.split()[-1].startswith('/') and l.split()[-1] != sys.argv[2]}), sep='\\n')")  # fmt: skip
    elsewhere = str(empty) + here
    out = subprocess.run([f"{elsewhere}/{bundle.PYTHON}", "-IS", "-c", probe, f"{elsewhere}/{bundle.SITE}",
                          str(driverlike)],
                         capture_output=True, text=True, timeout=120,
                         env={**dict(v.split("=", 1) for v in install.HOOK_ENV), "LD_PRELOAD": "/nowhere/preload.so",
                              "LD_LIBRARY_PATH": "/usr/lib/x86_64-linux-gnu"})  # fmt: skip
    assert out.returncode == 0 and out.stderr == "", out.stderr
    executable, *mapped = out.stdout.splitlines()
    assert executable == f"{elsewhere}/{bundle.PYTHON}"
    assert mapped and all(p.startswith(elsewhere + "/") for p in mapped), mapped
    assert {f"{elsewhere}/{bundle.LIBRARIES}/{name}" for name in ("libc.so.6", "libdl.so.2")} <= set(mapped)
    os.unlink(str(empty) + f"{here}/{bundle.INTERPRETER}")  # from here on, no Python could answer
    plain = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(empty),
                            program, "prestart"], input=state, capture_output=True, text=True, timeout=120,
                           env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})  # fmt: skip
    assert plain.returncode == 0 and plain.stdout == plain.stderr == "", plain


PP_TO_CIL = "/usr/libexec/selinux/hll/pp"  # policycoreutils: a module package as CIL (semodule's own)
# What each family's branch of oci_gpu_hook.te makes gpu_container_t, and the other's does not:
# container-selinux's sandbox domain on RHEL, refpolicy's system container domain on Debian.
BRANCH_ATTRIBUTE = {"rhel": "svirt_sandbox_domain", "debian": "container_system_domain"}


def module_header(path: str) -> tuple:
    """(policy type, module format version, config) of a module package (.pp): its first section
    is the module, after the package's magic, version and section offsets, and the module's own
    magic and name (libsepol's policydb_write)."""
    with open(path, "rb") as f:
        data = f.read()
    magic, _, sections = struct.unpack_from("<III", data, 0)
    assert magic == 0xF97CFF8F and sections >= 1, path
    (offset,) = struct.unpack_from("<I", data, 12)
    module_magic, length = struct.unpack_from("<II", data, offset)
    assert module_magic == 0xF97CFF8D and data[offset + 8 : offset + 8 + length] == b"SE Linux Module", path
    return struct.unpack_from("<III", data, offset + 8 + length)


def test_the_bundle_carries_the_selinux_module_for_each_policy_family(image_root, tmp_path, require):
    require(PP_TO_CIL)
    modules = policy_module.carried(image_bundle(image_root))
    assert sorted(modules) == ["debian", "rhel"]
    for flavour, path in modules.items():
        _, version, config = module_header(path)
        assert version == 19 and config & 1, (flavour, version, config)  # config bit 0: MLS (both are MCS)
        cil = tmp_path / f"{flavour}.cil"
        out = subprocess.run([PP_TO_CIL, path, str(cil)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        text = cil.read_text()
        assert "(type gpu_container_t)" in text and "(type oci_gpu_hook_start_t)" in text
        other = BRANCH_ATTRIBUTE["debian" if flavour == "rhel" else "rhel"]
        assert f"(typeattributeset {BRANCH_ATTRIBUTE[flavour]} (gpu_container_t" in text, flavour
        assert f"(typeattributeset {other} (gpu_container_t" not in text, flavour


def test_selinux_headers_of_an_unknown_family_refuse_the_build_in_one_line(tmp_path):
    """--selinux-headers names a policy's header tree: one without build.conf, or whose DISTRO the
    module has no branch for, refuses the build in one line, and writes no archive."""
    (tmp_path / "none").mkdir()
    (tmp_path / "gentoo").mkdir()
    (tmp_path / "gentoo" / "build.conf").write_text("TYPE = mcs\nDISTRO = gentoo\n")
    for name, words in (("none", "no SELinux policy headers there"), ("gentoo", "DISTRO 'gentoo'")):
        out = build(tmp_path / "image.tar", tmp_path / "tmp", 0o022, "--selinux-headers", str(tmp_path / name))
        assert out.returncode == 1, out.stderr
        (line,) = out.stderr.splitlines()
        assert line.startswith("build-image: ") and words in line, (name, line)
        assert not (tmp_path / "image.tar").exists()
