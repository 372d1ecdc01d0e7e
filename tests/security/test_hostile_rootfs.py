"""Hostile images: rootfs trees crafted to make the hook write, mount or read outside the rootfs.

Each case crafts the live container's rootfs (symlinks, loops, magic links, wrong file types,
read-only mounts, the image's own driver files), then runs the hook as the runtime does. Whatever
the outcome, nothing outside the rootfs may be created, changed or mounted over: a canary tree on
the host (the absolute targets of the hostile links), the simulated host, a few real host
directories (for links to '/' and '../..' chains) and the host's mount table are compared before
and after (tests/hookcheck.py). A case then either succeeds safely (mounts only inside the rootfs)
or fails with one clear line and a full rollback (the container's mounts, rootfs tree and device
rules exactly as before).

Every case runs twice: with the kernel's openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS), through
the real entry point in a subprocess, and with the hook's own O_NOFOLLOW walk (what kernels before
5.6 get), in-process with openat2 switched off.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import hookcheck
import pytest

ENV = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "all"}
LIB64 = "usr/lib64"
MULTIARCH = "usr/lib/x86_64-linux-gnu"


# --- crafting -----------------------------------------------------------------------------------


class Ctx:
    """What a case crafts with: the rootfs, the canary (absolute host path), the container, the host."""

    def __init__(self, rootfs, canary, pid, host):
        self.rootfs, self.canary, self.pid, self.host = rootfs, canary, pid, host
        self.version = host["driver_version"]

    def path(self, relative):
        return os.path.join(self.rootfs, relative.lstrip("/"))

    def remove(self, relative):
        path = self.path(relative)
        if os.path.islink(path) or not os.path.isdir(path):
            if os.path.lexists(path):
                os.unlink(path)
        else:
            shutil.rmtree(path)

    def link(self, relative, value):
        """Replace rootfs/relative (whatever it is) with a symlink to value."""
        self.remove(relative)
        os.makedirs(os.path.dirname(self.path(relative)), exist_ok=True)
        os.symlink(value, self.path(relative))

    def write(self, relative, data=b"from the image\n", mode=0o644):
        path = self.path(relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.remove(relative)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)

    def dotdot(self, target):
        """A relative link value that climbs far above the rootfs, then descends to target."""
        return "../" * 24 + target.lstrip("/")


# --- the cases: (craft, expected outcome, words the failure line must contain) -------------------

OK = "ok"
FAIL = "fail"


class Case:
    def __init__(self, craft, expect, words=None, debian=False, proc=True, walk=None):
        self.craft, self.expect, self.words, self.debian, self.proc = craft, expect, words, debian, proc
        # The walk reads a magic link's text and resolves that inside the rootfs (openat2 refuses
        # it): a different outcome, as contained.
        self.walk = walk or expect


def _own_ldconfig(c: Ctx):
    # The image's own ldconfig would run as root if the hook took it from the rootfs (the
    # ldconfig CVEs): it writes a marker into the canary.
    script = f"#!/bin/sh\necho ran >> {c.canary}/etc/image-ldconfig-ran\n".encode()
    c.write("sbin/ldconfig", script, 0o755)
    c.write("usr/sbin/ldconfig", script, 0o755)


def _ld_so_conf_through_proc(c: Ctx):
    # ldconfig, chrooted into the rootfs, is told to scan a directory behind /proc/1/root (the
    # host's root) and one behind /proc/self/root: its dropped capabilities stop the first, and
    # the second is its own (chrooted) root. Either way the canary's libcuda gets no link.
    c.write("etc/ld.so.conf", f"/proc/1/root{c.canary}/usr/lib64\n/proc/self/root{c.canary}/usr/lib64\n"
                              "include /etc/ld.so.conf.d/*.conf\n".encode())  # fmt: skip


def _link_to_canary_and_in_root(c: Ctx, relative: str):
    """relative -> an absolute path under the host's canary, which the image also has (so that,
    resolved inside the rootfs, it is a directory)."""
    target = f"{c.canary}/{relative}"
    os.makedirs(c.path(target.lstrip("/")), exist_ok=True)
    c.link(relative, target)


def _ld_so_conf_d_to_canary(c: Ctx):
    c.write("etc/ld.so.conf", b"include /etc/ld.so.conf.d/*.conf\n")
    c.link("etc/ld.so.conf.d", f"{c.canary}/etc/ld.so.conf.d")


def _ld_so_conf_d_loop(c: Ctx):
    c.write("etc/ld.so.conf", b"include /etc/ld.so.conf.d/*.conf\n")
    c.link("etc/ld.so.conf.d", "/etc/ld.so.conf.d")


def _chain(c: Ctx):
    # 50 links in a row, more than any resolver follows (40).
    os.rename(c.path(LIB64), c.path("usr/lib64.real"))
    for i in range(50):
        os.symlink(f"chain{i + 1}" if i < 49 else "lib64.real", c.path(f"usr/chain{i}"))
    os.symlink("chain0", c.path(LIB64))


def _loop_pair(c: Ctx):
    c.link(LIB64, "lib64.b")
    c.link("usr/lib64.b", "lib64")


def _fifo(relative):
    def craft(c: Ctx):
        c.remove(relative)
        os.mkfifo(c.path(relative))

    return craft


def _char_device(relative):
    def craft(c: Ctx):
        c.remove(relative)
        os.mknod(c.path(relative), 0o666 | stat.S_IFCHR, os.makedev(1, 3))

    return craft


def _directory(relative):
    def craft(c: Ctx):
        c.remove(relative)
        os.makedirs(c.path(relative))

    return craft


def _readonly_rootfs(c: Ctx):
    # An image on a read-only filesystem (root.readonly is already true in the bundle): the
    # rootfs bound read-only onto itself, with runc's writable tmpfs on /dev.
    hookcheck.in_container(c.pid, "mount", "--bind", c.rootfs, c.rootfs)
    hookcheck.in_container(c.pid, "mount", "-o", "remount,bind,ro", c.rootfs)
    hookcheck.in_container(c.pid, "mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", c.path("dev"))


def _in_root_vulkan(c: Ctx):
    os.makedirs(c.path("usr/share/vulkan/icd.d"))
    c.link("etc/vulkan", "../usr/share/vulkan")


CASES = {
    # absolute symlinks to the canary at every path the hook writes or reads
    "usr-lib64-absolute": Case(lambda c: c.link(LIB64, f"{c.canary}/usr/lib64"), FAIL, "/usr/lib64"),
    # The library layout is chosen from the directories the image has, resolved inside the
    # rootfs (as libnvidia-container chooses it). A multiarch or /usr/lib link to the host's
    # canary is no directory there: the hook places the libraries elsewhere (/usr/lib64,
    # /usr/lib32) and never goes through it. Where the image also has that path, the link
    # resolves inside the rootfs, as runc resolves one: the libraries land there, contained.
    "multiarch-absolute": Case(lambda c: c.link(MULTIARCH, f"{c.canary}/{MULTIARCH}"), OK, debian=True),
    "usr-lib-32bit-absolute": Case(lambda c: c.link("usr/lib", f"{c.canary}/usr/lib"), OK),
    "multiarch-absolute-in-root": Case(lambda c: _link_to_canary_and_in_root(c, MULTIARCH), OK, debian=True),
    "usr-lib-32bit-absolute-in-root": Case(lambda c: _link_to_canary_and_in_root(c, "usr/lib"), OK),
    "usr-bin-absolute": Case(lambda c: c.link("usr/bin", f"{c.canary}/usr/bin"), FAIL, "/usr/bin"),
    "usr-absolute": Case(lambda c: c.link("usr", f"{c.canary}/usr"), FAIL, "/usr/lib64"),
    "dev-absolute": Case(lambda c: c.link("dev", f"{c.canary}/dev"), FAIL, "/dev/nvidiactl"),
    "dev-node-absolute": Case(lambda c: c.link("dev/nvidiactl", f"{c.canary}/dev/nvidiactl"), FAIL, "dangling"),
    "proc-absolute": Case(lambda c: c.link("proc", f"{c.canary}/proc"), OK, proc=False),
    "proc-driver-nvidia-absolute": Case(
        lambda c: c.link("proc/driver/nvidia", f"{c.canary}/proc/driver/nvidia"), OK, proc=False
    ),
    "ld-so-cache-absolute": Case(lambda c: c.link("etc/ld.so.cache", f"{c.canary}/etc/ld.so.cache"), OK),
    "ld-so-conf-d-absolute": Case(_ld_so_conf_d_to_canary, OK),
    "persistenced-absolute": Case(
        lambda c: c.link("var/run/nvidia-persistenced", f"{c.canary}/var/run/nvidia-persistenced"), FAIL, "persistenced"
    ),
    "firmware-absolute": Case(lambda c: c.link("lib/firmware", f"{c.canary}/lib/firmware"), FAIL, "/lib/firmware"),
    "vulkan-absolute": Case(lambda c: c.link("etc/vulkan", f"{c.canary}/etc/vulkan"), FAIL, "/etc/vulkan"),
    "etc-absolute": Case(lambda c: c.link("etc", f"{c.canary}/etc"), FAIL, "/etc"),
    # relative links and '..' chains climbing out of the rootfs
    "usr-lib64-dotdot": Case(lambda c: c.link(LIB64, c.dotdot(f"{c.canary}/usr/lib64")), FAIL, "/usr/lib64"),
    "multiarch-dotdot-to-root": Case(lambda c: c.link(MULTIARCH, "../../" * 12), OK, debian=True),
    "usr-bin-dotdot-to-root": Case(lambda c: c.link("usr/bin", "../" * 24), OK),
    "dev-dotdot-to-host-dev": Case(lambda c: c.link("dev", c.dotdot("/dev")), FAIL, "/dev/nvidiactl"),
    "ld-so-cache-dotdot": Case(lambda c: c.link("etc/ld.so.cache", c.dotdot(f"{c.canary}/etc/ld.so.cache")), OK),
    "vulkan-relative-inside": Case(_in_root_vulkan, OK),
    "usr-lib64-to-root": Case(lambda c: c.link(LIB64, "/"), OK),
    # loops and dangling links
    "loop-self": Case(lambda c: c.link(LIB64, "/usr/lib64"), FAIL, "/usr/lib64"),
    "loop-pair": Case(_loop_pair, FAIL, "/usr/lib64"),
    "loop-chain-of-50": Case(_chain, FAIL, "/usr/lib64"),
    "ld-so-conf-d-loop": Case(_ld_so_conf_d_loop, OK),
    "dangling-usr-bin": Case(lambda c: c.link("usr/bin", "/nonexistent"), FAIL, "dangling"),
    "dangling-device-node": Case(lambda c: c.link("dev/nvidia0", "/nonexistent"), FAIL, "dangling"),
    # magic links: a procfs is mounted at rootfs/proc, as runc has done by prestart
    "magic-usr-lib64-proc-self-root": Case(
        lambda c: c.link(LIB64, f"/proc/self/root{c.canary}/usr/lib64"), FAIL, "/usr/lib64"
    ),
    "magic-dev-proc-1-root": Case(lambda c: c.link("dev", f"/proc/1/root{c.canary}/dev"), FAIL, "/dev/nvidiactl"),
    "magic-usr-bin-proc-self-cwd": Case(lambda c: c.link("usr/bin", "/proc/self/cwd"), FAIL, "/usr/bin", walk=OK),
    "magic-ld-so-cache": Case(lambda c: c.link("etc/ld.so.cache", f"/proc/self/root{c.canary}/etc/ld.so.cache"), OK),
    "magic-ld-so-conf-entries": Case(_ld_so_conf_through_proc, OK),
    # a file where a directory is expected, and the reverse; FIFOs and device nodes at targets
    "file-for-usr-lib64": Case(lambda c: c.write(LIB64), FAIL, "/usr/lib64"),
    "file-for-dev": Case(lambda c: c.write("dev"), FAIL, "/dev/nvidiactl"),
    "dir-for-device-node": Case(_directory("dev/nvidia0"), FAIL, "/dev/nvidia0"),
    "dir-for-library": Case(lambda c: _directory(f"{LIB64}/libcuda.so.{c.version}")(c), FAIL, "libcuda"),
    "fifo-for-device-node": Case(_fifo("dev/nvidiactl"), FAIL, "/dev/nvidiactl"),
    "device-node-for-device-node": Case(_char_device("dev/nvidiactl"), FAIL, "/dev/nvidiactl"),
    "fifo-for-library": Case(lambda c: _fifo(f"{LIB64}/libnvidia-ml.so.{c.version}")(c), FAIL, "libnvidia-ml"),
    "fifo-for-ld-so-cache": Case(_fifo("etc/ld.so.cache"), OK),
    "read-only-rootfs": Case(_readonly_rootfs, FAIL, "Read-only file system"),
    # the image ships its own driver files or loader cache
    "own-libnvidia-ml-so-1": Case(lambda c: c.write(f"{LIB64}/libnvidia-ml.so.1", b"\x7fELF not really\n"), OK),
    "own-versioned-library": Case(lambda c: c.write(f"{LIB64}/libcuda.so.{c.version}", b"image's own\n"), OK),
    "own-ld-so-cache": Case(lambda c: c.write("etc/ld.so.cache", os.urandom(4096)), OK),
    "own-ldconfig": Case(_own_ldconfig, OK),
}


@pytest.fixture(params=["openat2", "nofollow-walk"])
def resolver(request, monkeypatch):
    if request.param == "nofollow-walk":
        from oci_gpu_hook.start.linux import rootfs

        monkeypatch.setattr(rootfs, "_openat2_works", False)
    return request.param


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_rootfs(name, resolver, live_container, tmp_path, capsys):
    case = CASES[name]
    container = live_container(ENV, debian=case.debian)
    state, bundle, pid, cgroup, host = container
    rootfs = os.path.join(bundle, "rootfs")
    canary = hookcheck.make_canary(str(tmp_path / "canary"), host)
    ctx = Ctx(rootfs, canary, pid, host)
    case.craft(ctx)
    if case.proc:
        hookcheck.mount_proc(pid, rootfs)
    config = f"{host['root']}/config.yaml"

    before = hookcheck.observe(container, canary)
    if resolver == "openat2":
        out = hookcheck.run_hook(config, state, timeout=30)
        out = hookcheck.Result(out.returncode, out.stderr.decode("utf-8", "replace"))
    else:
        out = hookcheck.run_hook_in_process(config, state, capsys)
    after = hookcheck.observe(container, canary)

    hookcheck.assert_contained(before, after, rootfs, canary)
    if (case.expect if resolver == "openat2" else case.walk) == OK:
        assert out.returncode == 0, out.stderr
        # It did configure the container: the GPU's node is mounted inside the rootfs.
        mounted = {m[0] for m in after.container_mounts} - {m[0] for m in before.container_mounts}
        assert os.path.join(os.path.realpath(rootfs), "dev/nvidia0") in mounted
    else:
        assert out.returncode != 0, f"the hook accepted the hostile rootfs ({name})"
        line = hookcheck.one_clear_line(out.stderr)
        assert case.words in line, line
        hookcheck.assert_rolled_back(before, after)


def test_there_are_at_least_25_cases():
    assert len(CASES) >= 25


def test_image_ldconfig_never_runs(live_container, tmp_path):
    """The own-ldconfig case's marker, checked directly: the host's ldconfig ran, not the image's."""
    container = live_container(ENV)
    state, bundle, pid, cgroup, host = container
    canary = hookcheck.make_canary(str(tmp_path / "canary"), host)
    _own_ldconfig(Ctx(os.path.join(bundle, "rootfs"), canary, pid, host))
    out = hookcheck.run_hook(f"{host['root']}/config.yaml", state)
    assert out.returncode == 0, out.stderr
    assert not os.path.exists(f"{canary}/etc/image-ldconfig-ran")
    cache = subprocess.run(["/sbin/ldconfig", "-p", "-C", os.path.join(bundle, "rootfs/etc/ld.so.cache")],
                           capture_output=True, text=True)  # fmt: skip
    assert "libcuda.so.1" in cache.stdout
