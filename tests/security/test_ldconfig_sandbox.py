"""Attack round 2, classes 1 and 2: the ld cache refresh against an image that plants device
nodes, FIFOs and hard links where ldconfig reads and writes, and against a compromised ldconfig.

Loop devices stand in for the host's disks: an image that ships a block device node with a loop
device's numbers at /etc/ld.so.cache~ (and every other path ldconfig opens) must leave the loop's
backing file byte for byte as it was. Real runc and podman run the containers; a static probe
program takes ldconfig's place to show what a compromised ldconfig could reach.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import textwrap

import pytest
import startservercheck

from oci_gpu_hook.start.linux import ldconfig
from oci_gpu_hook.start.linux.rootfs import Rootfs
from oci_gpu_hook.toolkit import containers

pytestmark = pytest.mark.host(gpus=2, mig=[1], needs=("runc", "busybox"))

# Every path glibc's ldconfig opens or creates in the rootfs when run the usual way (-r ROOT).
LDCONFIG_PATHS = (
    "etc/ld.so.cache~",
    "etc/ld.so.cache",
    "etc/ld.so.conf",
    "var/cache/ldconfig/aux-cache~",
    "var/cache/ldconfig/aux-cache",
)
LEGACY = {"CUDA_VERSION": "12.4.1"}  # a legacy CUDA image: no NVIDIA_* variable, all GPUs, by default
ONE_GPU = {"NVIDIA_VISIBLE_DEVICES": "0"}


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture
def disk(tmp_path, require):
    """A loop device over a 1 MiB file of a known pattern: (device path, rdev, backing file)."""
    require("root", "losetup")
    backing = tmp_path / "disk.img"
    backing.write_bytes(b"superblock of a host disk\n" * 40330)
    device = subprocess.run(["losetup", "--find", "--show", str(backing)], capture_output=True, text=True)
    if device.returncode != 0:
        pytest.fail(f"losetup: {device.stderr.strip()}")
    path = device.stdout.strip()
    try:
        yield path, os.stat(path).st_rdev, backing
    finally:
        subprocess.run(["losetup", "--detach", path], capture_output=True)


@pytest.fixture(params=["fork", "fork-into-empty", "helper"])
def started_by(request, require):
    """Who makes ldconfig's sandbox: the hook's own fork (copying the container's mount table),
    the fork of a start server's worker (into a copy of the server's empty mount namespace), or a
    Helper made ahead, as a start server's warm spare holds one (the tests assert which one the
    Sandbox used)."""
    require("root")
    if request.param == "helper":
        ldconfig.hold_helper()
        assert ldconfig._held is not None
        startservercheck.wait_until("the helper ready", ldconfig._held.usable, timeout=30)
    elif request.param == "fork-into-empty":
        ldconfig.hold_empty_namespace()
        assert ldconfig._empty is not None
    try:
        yield request.param
    finally:
        ldconfig.drop_helper()
        if ldconfig._empty is not None:
            os.close(ldconfig._empty)
            ldconfig._empty = None


def sandboxed(started_by: str, *args, **kwargs) -> bytes:
    """ldconfig.Sandbox(*args, **kwargs)'s cache, started the way started_by says."""
    sandbox = ldconfig.Sandbox(*args, **kwargs)
    assert sandbox.via_helper == (started_by == "helper")
    return sandbox.result()


def helper_of_its_own(started_by: str) -> None:
    """In a child the test forked: the fixture's helper is the test process's child, not this
    one's (it could neither be handed a start nor reaped here); a helper of its own instead, made
    in its own namespaces, where started_by says so."""
    ldconfig._held = None
    if started_by == "helper":
        ldconfig.hold_helper()
        startservercheck.wait_until("the helper ready", ldconfig._held.usable, timeout=30)


def plant(rootfs: str, relative: str, make) -> None:
    path = os.path.join(rootfs, relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.unlink(path)
    make(path)


def block_node(rdev):
    return lambda path: os.mknod(path, stat.S_IFBLK | 0o666, rdev)


def run_container(tmp_path, host, env, rootfs_hook=None, name="c"):
    bundle = containers.make_bundle(str(tmp_path / f"bundle-{name}"), args=["sh", "-c", "nvidia-smi -L"], env=env,
                              config_file=f"{host['root']}/config.yaml")  # fmt: skip
    rootfs = os.path.join(bundle, "rootfs")
    if rootfs_hook:
        rootfs_hook(rootfs)
    return containers.runc_run(bundle, f"ocigpu-{os.getpid()}-{name}", timeout=60), rootfs


# --- class 1: device nodes, FIFOs and hard links at ldconfig's paths ------------------------------


@pytest.mark.parametrize("env", [LEGACY, ONE_GPU], ids=["legacy-cuda-image", "one-gpu"])
def test_block_devices_at_every_ldconfig_path_are_never_written(tmp_path, host, disk, env):
    device, rdev, backing = disk
    before = sha256(backing)

    def craft(rootfs):
        for relative in LDCONFIG_PATHS:
            plant(rootfs, relative, block_node(rdev))

    out, rootfs = run_container(tmp_path, host, env, craft)
    assert out.returncode == 0, out.stderr
    assert "GPU 0" in out.stdout  # the container works: its new ld cache finds the driver
    assert sha256(backing) == before
    # The image's cache entry was replaced by a regular file (rename), never opened.
    assert stat.S_ISREG(os.lstat(os.path.join(rootfs, "etc/ld.so.cache")).st_mode)
    for relative in ("etc/ld.so.cache~", "var/cache/ldconfig/aux-cache~", "var/cache/ldconfig/aux-cache"):
        assert stat.S_ISBLK(os.lstat(os.path.join(rootfs, relative)).st_mode), relative  # untouched


def test_block_device_as_ld_so_conf_include_is_not_opened(tmp_path, host, disk):
    device, rdev, backing = disk
    before = sha256(backing)

    def craft(rootfs):
        with open(os.path.join(rootfs, "etc/ld.so.conf"), "w") as f:
            f.write("include /etc/ld.so.conf.d/*.conf\n")
        plant(rootfs, "etc/ld.so.conf.d/disk.conf", block_node(rdev))
        plant(rootfs, "etc/ld.so.conf.d/fifo.conf", os.mkfifo)
        plant(rootfs, "usr/lib64/libdisk.so.1", block_node(rdev))  # where ldconfig scans for libraries

    out, _ = run_container(tmp_path, host, LEGACY, craft)
    assert out.returncode == 0, out.stderr
    assert sha256(backing) == before


def test_fifos_at_ldconfig_paths_do_not_hang_the_start(tmp_path, host):
    def craft(rootfs):
        for relative in LDCONFIG_PATHS:
            plant(rootfs, relative, os.mkfifo)

    out, rootfs = run_container(tmp_path, host, ONE_GPU, craft)
    assert out.returncode == 0, out.stderr
    assert "GPU 0" in out.stdout
    assert stat.S_ISFIFO(os.lstat(os.path.join(rootfs, "etc/ld.so.cache~")).st_mode)


def test_hard_links_to_host_files_are_never_written(tmp_path, host):
    """A plain-directory rootfs shares the host's filesystem: hard links there can name host files."""
    canary = tmp_path / "host-secret"
    canary.write_bytes(b"a host file the image hard-linked\n")
    canary.chmod(0o600)
    before = sha256(canary)

    def craft(rootfs):
        for relative in ("etc/ld.so.cache~", "etc/ld.so.cache", "etc/ld.so.conf"):
            plant(rootfs, relative, lambda path: os.link(canary, path))

    out, rootfs = run_container(tmp_path, host, LEGACY, craft)
    assert out.returncode == 0, out.stderr
    assert sha256(canary) == before
    assert os.stat(canary).st_nlink == 3  # ld.so.cache~ and ld.so.conf still link it; ld.so.cache was replaced
    assert not os.path.samefile(canary, os.path.join(rootfs, "etc/ld.so.cache"))


def test_podman_image_layer_with_device_nodes(tmp_path, host, disk, require):
    """The same attack shipped in an image layer (podman import keeps device nodes as root)."""
    require("podman")
    device, rdev, backing = disk
    before = sha256(backing)
    rootfs = containers.make_rootfs(str(tmp_path / "rootfs"))
    for relative in LDCONFIG_PATHS:
        plant(rootfs, relative, block_node(rdev))
    tag = f"localhost/ocigpu-ldconfig-attack-{os.getpid()}:latest"
    containers.podman_image(rootfs, tag)
    try:
        hooks = containers.write_hooks_dir(str(tmp_path / "hooks.d"), f"{host['root']}/config.yaml")
        script = ["sh", "-c", "ls -l /etc/ld.so.cache~ /etc/ld.so.cache; nvidia-smi -L"]
        out = containers.podman_run(hooks, tag, script, LEGACY)
    finally:
        subprocess.run(["podman", "rmi", "-f", tag], capture_output=True)
    assert out.returncode == 0, out.stderr
    assert "GPU 0" in out.stdout
    lines = {line.split()[-1]: line[0] for line in out.stdout.splitlines() if line.startswith(("b", "-"))}
    assert lines == {"/etc/ld.so.cache~": "b", "/etc/ld.so.cache": "-"}, out.stdout
    assert sha256(backing) == before


# --- the hook's own reading of ld.so.conf ---------------------------------------------------------


def test_flattened_configuration_follows_includes_and_skips_what_is_not_a_file(tmp_path):
    root = tmp_path / "rootfs"
    (root / "etc/ld.so.conf.d").mkdir(parents=True)
    (root / "etc/ld.so.conf").write_text(
        "# comment\n/opt/first\ninclude ld.so.conf.d/*.conf other.conf\nhwcap 1 nosegneg\n/opt/last # trailing\n"
    )
    (root / "etc/ld.so.conf.d/b.conf").write_text("/opt/b\n")
    (root / "etc/ld.so.conf.d/a.conf").write_text("/opt/a:/opt/a2\n")
    (root / "etc/ld.so.conf.d/skip.txt").write_text("/opt/not-included\n")
    (root / "etc/ld.so.conf.d/.hidden.conf").write_text("/opt/hidden\n")
    os.mkfifo(root / "etc/ld.so.conf.d/c.conf")
    (root / "etc/other.conf").write_text("/opt/other\n")
    os.link(root / "etc/other.conf", root / "etc/ld.so.conf.d/d.conf")  # a hard link: never read
    (root / "etc/ld.so.conf.d/e.conf").symlink_to("/etc/ld.so.conf.d/b.conf")  # inside the root: read
    rootfs = Rootfs(str(root))
    try:
        text, notes = ldconfig.flatten_conf(rootfs)
    finally:
        rootfs.close()
    assert text.splitlines() == ["/opt/first", "/opt/a:/opt/a2", "/opt/b", "/opt/b", "/opt/last"]
    assert len(notes) == 3 and all("not a regular file with one link" in n for n in notes), notes
    assert any("c.conf" in n for n in notes) and any("d.conf" in n for n in notes)


def test_an_include_loop_is_bounded(tmp_path):
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc/ld.so.conf").write_text("/opt/x\ninclude /etc/ld.so.conf\n")
    rootfs = Rootfs(str(root))
    try:
        text, notes = ldconfig.flatten_conf(rootfs)
    finally:
        rootfs.close()
    assert len(text.splitlines()) == ldconfig.MAX_CONF_FILES and notes


def _odd_image(root) -> None:
    """An ld.so.conf naming directories, and including files, whose names are not UTF-8; a
    library in the first directory, which only ld.so.conf names."""
    etc = os.fsencode(root / "etc")
    os.makedirs(etc + b"/ld.so.conf.d")
    os.makedirs(os.fsencode(root) + b"/opt/\xff\xfe-lib")
    shutil.copy(os.path.realpath(containers._host_libc()), os.fsencode(root) + b"/opt/\xff\xfe-lib/libc.so.6")
    with open(etc + b"/ld.so.conf", "wb") as f:
        f.write(b"/opt/\xff\xfe-lib\ninclude /etc/ld.so.conf.d/\xfe*.conf\n")
    with open(etc + b"/ld.so.conf.d/\xfe1.conf", "wb") as f:
        f.write(b"/opt/\xfd-other\n")
    os.mkfifo(etc + b"/ld.so.conf.d/\xfe2.conf")  # said, never opened


def test_names_in_the_configuration_are_kept_as_the_image_wrote_them(tmp_path):
    """Names are bytes (issue 46, item 7): a directory named in ld.so.conf, an include pattern
    and the file it matches, none of them UTF-8, are read, matched and handed on as the very
    bytes the image wrote (os.fsencode of what flatten_conf gives), and a note names the FIFO."""
    root = tmp_path / "rootfs"
    _odd_image(root)
    rootfs = Rootfs(str(root))
    try:
        text, notes = ldconfig.flatten_conf(rootfs)
    finally:
        rootfs.close()
    assert os.fsencode(text) == b"/opt/\xff\xfe-lib\n/opt/\xfd-other\n"
    assert notes == ["/etc/ld.so.conf.d/\udcfe2.conf in the image ignored: not a regular file with one link"]


def test_ldconfig_indexes_a_directory_with_a_non_utf8_name(tmp_path, started_by):
    """The sandboxed ldconfig gets the image's ld.so.conf with its bytes: the library in the
    directory only it names is in the cache, under that directory's own name."""
    from oci_gpu_hook.start import ldcache

    root = tmp_path / "rootfs"
    _odd_image(root)
    rootfs = Rootfs(str(root))
    try:
        conf, _ = ldconfig.flatten_conf(rootfs)
        data = sandboxed(started_by, rootfs.fd, conf, [], timeout=20)
    finally:
        rootfs.close()
    paths = [os.fsencode(entry.path) for entry in ldcache.parse(data, "the new cache")]
    assert b"/opt/\xff\xfe-lib/libc.so.6" in paths, paths


@pytest.mark.parametrize(
    "name,pattern,hit",
    [("a.conf", "*.conf", True), ("a.conf", "?.conf", True), ("ab.conf", "?.conf", False),
     ("x.conf", "[a-x].conf", True), ("y.conf", "[a-x].conf", False), ("y.conf", "[!a-x].conf", True),
     ("a.conf", "*.co", False), ("", "*", True), ("conf", "conf", True), ("a[b", "a[b", True),
     ("x-1.conf", "*-[0-9].conf", True), ("ab", "*a*b*", True), ("ba", "*a*b*", False), ("", "", True),
     ("a", "", False), ("abc", "a**c", True), ("]", "[]]", True), ("a", "[]]", False)],
)  # fmt: skip
def test_include_patterns_match_as_glob_does(name, pattern, hit):
    import fnmatch

    assert ldconfig._matches(name, pattern) is hit
    assert fnmatch.fnmatchcase(name, pattern) is hit  # the reference


def test_include_patterns_agree_with_fnmatch_on_random_input():
    import fnmatch
    import random

    rng = random.Random(12)
    alphabet = "ab-.*?[]!"
    for _ in range(20000):
        name = "".join(rng.choice("ab-.[]") for _ in range(rng.randrange(0, 8)))
        pattern = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 8)))
        assert ldconfig._matches(name, pattern) == fnmatch.fnmatchcase(name, pattern), (name, pattern)


def test_a_hostile_include_pattern_costs_little():
    """'*a*a*...b' against a long run of 'a': exponential for a naive matcher, and deep."""
    assert ldconfig._matches("a" * 250, "*a" * 60 + "b") is False
    assert ldconfig._matches("a" * 250, "*" * 5000 + "a") is True


# --- class 2: a compromised ldconfig --------------------------------------------------------------

PROBE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
extern char **environ;
static FILE *out;
static void attempt(const char *what, int result) {
    fprintf(out, "%s=%s\n", what, result < 0 ? strerrorname_np(errno) : "ALLOWED");
}
int main(int argc, char **argv) {
    int fds = 0; for (int i = 0; i < 4096; i++) if (fcntl(i, F_GETFD) >= 0) fds++;
    /* ldconfig's output file is the only way out: a "cache" with the magic, then the report. */
    int fd = open("/etc/ld.so.cache", O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return 3;
    out = fdopen(fd, "w");
    fprintf(out, "glibc-ld.so.cache1.1\n");
    fprintf(out, "uid=%d euid=%d gid=%d groups=%d pid=%d\n", getuid(), geteuid(), getgid(),
            getgroups(0, NULL), getpid());
    int envs = 0; for (char **e = environ; *e; e++) envs++;
    fprintf(out, "environ=%d\n", envs);
    fprintf(out, "fds=%d\n", fds);
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];
    syscall(SYS_capget, &h, d);
    fprintf(out, "cap_eff=%x%x cap_prm=%x%x cap_inh=%x%x\n", d[1].effective, d[0].effective,
            d[1].permitted, d[0].permitted, d[1].inheritable, d[0].inheritable);
    int bounding = 0; for (int c = 0; c < 64; c++) if (prctl(PR_CAPBSET_READ, c, 0, 0, 0) == 1) bounding++;
    fprintf(out, "bounding=%d nnp=%d\n", bounding, prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0));
    sigset_t blocked; sigprocmask(SIG_SETMASK, NULL, &blocked);
    int held = 0, ignored = 0;
    for (int sig = 1; sig < 65; sig++) {
        struct sigaction was;
        if (sigismember(&blocked, sig) == 1) held++;
        if (sigaction(sig, NULL, &was) == 0 && was.sa_handler == SIG_IGN) ignored++;
    }
    fprintf(out, "signals_blocked=%d signals_ignored=%d\n", held, ignored);
    attempt("write_image", open("/probe-was-here", O_WRONLY | O_CREAT, 0644));
    attempt("open_block_device", open("/disk", O_RDWR));
    attempt("host_canary", open(argv[argc - 1], O_RDONLY));
    attempt("chroot", chroot("/usr"));
    attempt("mount", mount("none", "/usr", "tmpfs", 0, NULL));
    attempt("unshare_mount", unshare(CLONE_NEWNS));
    char handle[128] = {0}; ((unsigned int *)handle)[0] = 8;
    attempt("open_by_handle_at", syscall(SYS_open_by_handle_at, AT_FDCWD, handle, O_RDONLY));
    attempt("kill_others", kill(-1, 0));
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {AF_INET, htons(atoi(argv[argc - 2])), {htonl(INADDR_LOOPBACK)}};
    attempt("connect_host_loopback", connect(s, (struct sockaddr *)&a, sizeof a));
    fclose(out);
    return 0;
}
"""


def test_a_compromised_ldconfig_reaches_nothing(tmp_path, monkeypatch, disk, require, started_by):
    """A static program in ldconfig's place reports what it can do from inside the sandbox,
    whoever made it: the hook's fork or a start server's helper."""
    require("root", "gcc")
    import socket

    device, rdev, backing = disk
    before = sha256(backing)
    src = tmp_path / "probe.c"
    src.write_text(textwrap.dedent(PROBE))
    probe = tmp_path / "bin" / "ldconfig"
    probe.parent.mkdir()
    built = subprocess.run(["gcc", "-static", "-O1", "-o", str(probe), str(src)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    monkeypatch.setattr(ldconfig, "LDCONFIG_PATHS", (str(probe),))
    for key in ("LD_PRELOAD", "PYTHONPATH", "HOME"):
        monkeypatch.setenv(key, "/polluted")
    canary = tmp_path / "host-canary"
    canary.write_text("host\n")
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "usr").mkdir()
    os.mknod(root / "disk", stat.S_IFBLK | 0o666, rdev)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    leaked = open(tmp_path / "an-open-host-file", "w")  # must not be inherited
    rootfs = Rootfs(str(root))
    try:
        report = sandboxed(started_by, rootfs.fd, "", [str(port), str(canary)], timeout=20)
    finally:
        rootfs.close()
        leaked.close()
        listener.close()
    facts = dict(item.split("=", 1) for line in report.decode().splitlines()[1:] for item in line.split())
    assert facts["uid"] == facts["euid"] == facts["gid"] == str(ldconfig.SANDBOX_ID)
    assert facts["groups"] == "0" and facts["pid"] == "1"
    assert facts["environ"] == "0"
    assert facts["fds"] == "3"  # stdin and stdout on /dev/null, stderr to the hook, and nothing else
    assert facts["cap_eff"] == facts["cap_prm"] == facts["cap_inh"] == "00"
    assert facts["bounding"] == "0" and facts["nnp"] == "1"
    # The hook's signal state is not ldconfig's: the deadline's SIGALRM is held back while the
    # start is handed over, and Python ignores SIGPIPE and SIGXFSZ; exec would keep both.
    assert facts["signals_blocked"] == facts["signals_ignored"] == "0"
    assert facts["write_image"] == "EROFS"
    assert facts["open_block_device"] == "EACCES"  # nodev
    assert facts["host_canary"] == "ENOENT"  # the host is not in its view at all
    for escape in ("chroot", "mount", "unshare_mount", "open_by_handle_at"):
        assert facts[escape] == "EPERM", escape
    assert facts["kill_others"] == "ESRCH"  # alone in its PID namespace
    assert facts["connect_host_loopback"] == "ENETUNREACH"  # its own network namespace
    assert not (root / "probe-was-here").exists()
    assert sha256(backing) == before


def test_nothing_the_sandbox_mounts_is_seen_beside_it(tmp_path, started_by):
    """The rootfs a shared mount, as a runtime may leave it: once ldconfig has run, the namespace
    the hook works in has no mount more than before (the view and the tmpfs on its /etc were
    made private before anything was mounted on them). In a child with a mount namespace of its
    own, so that the host's table is not touched."""
    from oci_gpu_hook.start.linux import _linux

    root = tmp_path / "rootfs"
    _odd_image(root)
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            _linux.unshare(_linux.CLONE_NEWNS)
            _linux.mount(None, "/", None, _linux.MS_REC | _linux.MS_PRIVATE)
            _linux.mount(str(root), str(root), None, _linux.MS_BIND)
            _linux.mount(None, str(root), None, 1 << 20)  # MS_SHARED
            helper_of_its_own(started_by)
            with open("/proc/self/mountinfo") as f:
                before = f.read()
            rootfs = Rootfs(str(root))
            conf, _ = ldconfig.flatten_conf(rootfs)
            sandboxed(started_by, rootfs.fd, conf, [], timeout=20)
            rootfs.close()
            with open("/proc/self/mountinfo") as f:
                after = f.read()
            os.write(writer, b"same" if after == before else after.encode())
            code = 0
        finally:
            ldconfig.drop_helper()
            os._exit(code)
    os.close(writer)
    with os.fdopen(reader, "rb") as f:
        seen = f.read()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert seen == b"same", seen.decode()


FLOOD = r"""
#include <string.h>
#include <unistd.h>
int main(void) {
    static char block[1 << 16];
    memset(block, 'x', sizeof block);
    for (int i = 0; i < 4096; i++)  /* 256 MiB */
        if (write(2, block, sizeof block) < 0) return 2;
    write(2, "\nthe last line\n", 15);
    return 1;
}
"""


def test_an_ldconfig_that_floods_its_stderr_costs_the_hook_no_memory(tmp_path, monkeypatch, require, started_by):
    """256 MiB written to stderr, then a line and a failure: the hook keeps only the end (the
    line it reports comes from there), so its memory does not grow with what ldconfig writes."""
    require("gcc")
    import resource

    src = tmp_path / "flood.c"
    src.write_text(FLOOD)
    flood = tmp_path / "bin" / "ldconfig"
    flood.parent.mkdir()
    built = subprocess.run(["gcc", "-static", "-O1", "-o", str(flood), str(src)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    monkeypatch.setattr(ldconfig, "LDCONFIG_PATHS", (str(flood),))
    (tmp_path / "rootfs" / "etc").mkdir(parents=True)
    rootfs = Rootfs(str(tmp_path / "rootfs"))
    reader, writer = os.pipe()
    child = os.fork()  # its own peak resident size, apart from pytest's
    if child == 0:
        try:
            helper_of_its_own(started_by)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            try:
                sandboxed(started_by, rootfs.fd, "", [], timeout=60)
                said = "no failure"
            except ldconfig.LdconfigError as e:
                said = e.message
            grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
            os.write(writer, f"{grown}\n{said}".encode())
        finally:
            ldconfig.drop_helper()
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as f:
        grown, said = f.read().split("\n", 1)
    os.waitpid(child, 0)
    rootfs.close()
    assert said == "ldconfig failed: the last line"
    assert int(grown) < 16 << 10, f"the hook grew by {int(grown) >> 10} MiB"  # KiB; 256 MiB were written


def test_a_dynamic_or_foreign_ldconfig_is_refused(tmp_path, monkeypatch, require):
    """A dynamically linked program would have its loader looked up inside the image."""
    require("root")
    fake = tmp_path / "ldconfig"
    shutil.copy("/bin/true", fake)
    monkeypatch.setattr(ldconfig, "LDCONFIG_PATHS", (str(fake),))
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    rootfs = Rootfs(str(root))
    try:
        with pytest.raises(ldconfig.LdconfigError, match="dynamically linked"):
            ldconfig.Sandbox(rootfs.fd, "", [])
        os.chmod(fake, 0o777)
        with pytest.raises(ldconfig.LdconfigError, match="writable by others than root: refusing to run it"):
            ldconfig.Sandbox(rootfs.fd, "", [])
    finally:
        rootfs.close()
