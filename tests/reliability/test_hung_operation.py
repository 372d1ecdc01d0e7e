"""An operation that hangs while the hook is inside the container's mount namespace (issue 41: the
plan is carried out in the hook's own process), and what the container can reach meanwhile.

The hang is real: a FUSE filesystem whose daemon never answers (a hung fuse-overlayfs, sshfs or
network filesystem), mounted at the rootfs's /usr/bin in the container's namespace only. A FUSE
request waits killably: the hook's SIGALRM deadline cannot end it (the handler runs only when the
system call returns), a SIGKILL can. The forked apply child was killed by its parent 5 s after
the deadline; the hook's own process now arms a kernel timer that kills it then, since a runtime
need not set a hook timeout (dockerd's --gpus hook has none: the start hung until the source
answered). Its journal is left for the next start.

While it is held, the hook is a root process on the host that sits in the container's mount
namespace holding descriptors of the host (its own mount namespace, root and working directory,
to go back). A container that shares the host's PID namespace (hostPID) sees its pid; with a
runtime's default capabilities (no CAP_SYS_PTRACE) it must not reach those descriptors, nor the
hook's root, through /proc/<pid>/."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import hookcheck

from oci_gpu_hook.start import inventory_cache, settings
from oci_gpu_hook.toolkit import containers

ENV = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "utility,compute"}

# runc's (and podman's, containerd's) default capability set for a container's processes.
RUNTIME_DEFAULT_CAPS = ("chown", "dac_override", "fsetid", "fowner", "mknod", "net_raw", "setgid", "setuid",
                        "setfcap", "setpcap", "net_bind_service", "sys_chroot", "kill", "audit_write")  # fmt: skip

# What a process of the container tries on the held hook's /proc entry: each must be refused.
ATTACK = r"""
import json, os, sys
pid = int(sys.argv[1])
tried = {}
def attempt(name, call):
    try:
        call()
        tried[name] = "allowed"
    except OSError as e:
        tried[name] = e.strerror
attempt("root", lambda: os.listdir(f"/proc/{pid}/root/"))
attempt("cwd", lambda: os.listdir(f"/proc/{pid}/cwd/"))
# The fd directory itself is root's, mode 0500: CAP_DAC_OVERRIDE lists its numbers, nothing more.
# Every number it lists is tried (a number the hook does not hold is "no such file" whoever asks,
# so guessing one past the list, as this once did, says nothing about the hook's own).
for n in [int(n) for n in os.listdir(f"/proc/{pid}/fd")]:
    attempt(f"open fd {n}", lambda: os.close(os.open(f"/proc/{pid}/fd/{n}", os.O_PATH)))
    attempt(f"readlink fd {n}", lambda: os.readlink(f"/proc/{pid}/fd/{n}"))
attempt("ns/mnt", lambda: os.close(os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)))
attempt("mem", lambda: os.close(os.open(f"/proc/{pid}/mem", os.O_RDONLY)))
attempt("environ", lambda: os.close(os.open(f"/proc/{pid}/environ", os.O_RDONLY)))
print(json.dumps(tried))
"""


def hold_with_hung_fuse(rootfs: str) -> subprocess.Popen:
    """A container at prestart as runc leaves it (its own mount namespace, the rootfs rbind-mounted
    onto itself, submounts kept) with a FUSE filesystem at <rootfs>/usr/bin whose daemon never
    answers: the holder keeps /dev/fuse open (its end of the connection) and never reads it.
    Killing the holder closes the connection and fails every waiting request."""
    script = ('mount --rbind "$1" "$1" && exec 3<>/dev/fuse && '
              'mount -i -t fuse -o fd=3,rootmode=40000,user_id=0,group_id=0 hung "$1/usr/bin" && '
              'echo ready && exec sleep 600')  # fmt: skip
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", rootfs],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)  # fmt: skip
    if proc.stdout.readline() != b"ready\n":
        proc.kill()
        proc.wait()
        raise RuntimeError("cannot mount a FUSE filesystem in a private namespace (/dev/fuse, mount -t fuse)")
    return proc


def wait_until(predicate, seconds: float, what: str):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {seconds} s: {what}")


def in_namespace_of(hook: subprocess.Popen, holder: subprocess.Popen) -> bool:
    try:
        return os.readlink(f"/proc/{hook.pid}/ns/mnt") == os.readlink(f"/proc/{holder.pid}/ns/mnt")
    except FileNotFoundError:
        return False


def blocked(pid: int) -> bool:
    """Sleeping in the kernel (S or D), not running Python code."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("S", "D")


def test_a_hung_operation_ends_the_hook_at_its_deadline_and_the_container_reaches_nothing_meanwhile(
    live_container, tmp_path, require
):
    require("root", "unshare", "setpriv")
    if not os.path.exists("/dev/fuse"):
        import pytest

        pytest.fail("/dev/fuse is missing: the test needs the fuse module")
    _, bundle, _, cgroup, host = live_container(ENV)
    rootfs = os.path.join(bundle, "rootfs")
    holder = hold_with_hung_fuse(rootfs)
    hook = None
    pending = f"{host['root']}/pending"
    journals_before = set(os.listdir(pending)) if os.path.isdir(pending) else set()
    try:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(holder.pid))
        state = json.dumps({"ociVersion": "1.0.2", "id": "hung", "status": "creating", "pid": holder.pid,
                            "bundle": bundle})  # fmt: skip
        config = hookcheck.config_with(host, tmp_path, "deadline_seconds: 3\n")
        # A fresh inventory: a stale one would have the hook ask NVML, not apply, in its budget.
        inventory_cache.refresh(settings.load(config))
        hook = subprocess.Popen([*containers.hook_command(config), "prestart"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=hookcheck.HOOK_ENV)  # fmt: skip
        hook.stdin.write(state.encode())
        hook.stdin.close()
        wait_until(lambda: in_namespace_of(hook, holder) or hook.poll() is not None, 30, "the hook joined")
        assert hook.poll() is None, hook.stderr.read().decode()

        wait_until(lambda: blocked(hook.pid) or hook.poll() is not None, 30, "the hook waited on the FUSE source")
        assert hook.poll() is None and in_namespace_of(hook, holder), hook.stderr.read().decode()
        # It joined the mount namespace alone: its PID and user namespaces are still the host's.
        for kind in ("pid", "user"):
            assert os.readlink(f"/proc/{hook.pid}/ns/{kind}") == os.readlink(f"/proc/self/ns/{kind}")
        # What is at stake: the held hook has descriptors of the host's mount namespace and root.
        held = [os.readlink(f"/proc/{hook.pid}/fd/{n}") for n in os.listdir(f"/proc/{hook.pid}/fd")]
        assert os.readlink("/proc/self/ns/mnt") in held, held

        # A process of a hostPID container: uid 0, the runtime's default capabilities.
        caps = ",".join(f"+{c}" for c in RUNTIME_DEFAULT_CAPS)
        attack = subprocess.run(
            ["setpriv", "--inh-caps=-all", f"--bounding-set=-all,{caps}", sys.executable, "-I", "-c", ATTACK,
             str(hook.pid)], capture_output=True, text=True, timeout=30)  # fmt: skip
        assert attack.returncode == 0, attack.stderr
        refused = ("Permission denied", "Operation not permitted")
        reached = {k: v for k, v in json.loads(attack.stdout).items() if v not in refused}
        assert reached == {}, f"the container reached the held hook's /proc entries: {reached}"

        # Past its 3 s deadline, the SIGALRM pending behind the FUSE request, the hook ends itself
        # (a SIGKILL timer at the deadline plus 5 s), with no runtime timeout (dockerd's --gpus
        # hook has none): the start fails instead of hanging until the source answers.
        assert hook.wait(timeout=30) == -signal.SIGKILL, hook.stderr.read().decode()
        assert hook.stderr.read() == b"", "a killed hook cannot have written its one line"
        assert set(os.listdir(pending)) - journals_before, "no journal was left for the next start"
    finally:
        if hook is not None and hook.poll() is None:
            hook.kill()
        holder.kill()  # closes the FUSE connection: a request still waiting fails
        holder.wait()
        if hook is not None:
            hook.wait(timeout=30)  # the FUSE connection is closed: the wait ends
        if os.path.isdir(pending):  # the simulated host is shared: no journal may outlive the test
            for name in set(os.listdir(pending)) - journals_before:
                os.unlink(os.path.join(pending, name))
