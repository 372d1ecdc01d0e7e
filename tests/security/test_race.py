"""The symlink-swap race (CVE-2024-0132's kind): while the hook runs, another process keeps
exchanging directories of the rootfs with symlinks to the host (renameat2 RENAME_EXCHANGE, atomic),
so any path the hook checked and then used again by name would lead outside. 200 runs, half
through openat2 (subprocess, the real entry point), half through the O_NOFOLLOW walk (in-process):
none may leave a mount or a file outside the rootfs, whatever each run's outcome.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import hookcheck

RUNS = 200
# rootfs directory -> where its symlink twin points: absolute (a host path) and '..'-relative.
PAIRS = {
    "usr/lib64": "{canary}/usr/lib64",
    "dev": "../../../../../../../../../../../../..{canary}/dev",
    "usr/bin": "{canary}/usr/bin",
}

SWAPPER = r"""
import ctypes, random, sys, time
libc = ctypes.CDLL("libc.so.6", use_errno=True)
SYS_renameat2, AT_FDCWD, RENAME_EXCHANGE = 316, -100, 2
pairs = [(a.encode(), b.encode()) for a, b in zip(sys.argv[1::2], sys.argv[2::2])]
sys.stdout.write("ready\n"); sys.stdout.flush()
def exchange(a, b):
    if libc.syscall(SYS_renameat2, AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) != 0:
        raise SystemExit(f"renameat2: errno {ctypes.get_errno()}")
while True:
    # The symlink stands in for the directory for a moment, at random times: the hook must never
    # act on it; most of its lookups see the directory, so some runs succeed and some do not.
    # The window is held open for up to 0.1 ms: with back-to-back exchanges it was a few
    # microseconds, and a whole CI run of 200 starts could miss it every time.
    a, b = random.choice(pairs)
    exchange(a, b)
    time.sleep(random.uniform(0, 0.0001))
    exchange(a, b)
    time.sleep(random.uniform(0, 0.01))
"""


def rename_exchange(a: str, b: str) -> None:
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.syscall(316, -100, a.encode(), -100, b.encode(), 2) != 0:
        raise OSError(ctypes.get_errno(), "renameat2", a)


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Until the process is in state T (stopped): SIGSTOP is delivered asynchronously."""
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state in ("T", "t"):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop (state {state})"
        time.sleep(0.0005)


def normalise(rootfs: str) -> None:
    """Put every directory back under its own name (the swapper is stopped)."""
    for name in PAIRS:
        path = os.path.join(rootfs, name)
        if os.path.islink(path):
            rename_exchange(path, path + ".swap")
        assert os.path.isdir(path) and not os.path.islink(path) and os.path.islink(path + ".swap")


def clean(pid: int, rootfs: str, cgroup: str, baseline_mounts, baseline_tree) -> None:
    """Undo a successful run so the next one starts from the same container."""
    with open(os.path.join(cgroup, "devices.deny"), "w") as f:
        f.write("a")  # the live container's cgroup starts out denying everything
    extra = [m[0] for m in hookcheck.mountinfo(pid) if m not in baseline_mounts]
    if extra:
        hookcheck.in_container(pid, "umount", "-l", *sorted(extra, key=len, reverse=True))
    for path in sorted(set(hookcheck.tree(rootfs)) - set(baseline_tree), key=len, reverse=True):
        full = os.path.join(rootfs, path)
        if os.path.isdir(full) and not os.path.islink(full):
            os.rmdir(full)
        else:
            os.unlink(full)


def test_swapping_directories_and_symlinks_never_leads_outside(live_container, tmp_path, capsys, monkeypatch):
    from oci_gpu_hook.start.linux import rootfs as rootfs_module

    container = live_container({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"})
    state, bundle, pid, cgroup, host = container
    rootfs = os.path.join(bundle, "rootfs")
    canary = hookcheck.make_canary(str(tmp_path / "canary"), host)
    for name, value in PAIRS.items():
        os.symlink(value.format(canary=canary), os.path.join(rootfs, name + ".swap"))
    config = f"{host['root']}/config.yaml"
    baseline = hookcheck.observe(container, canary)
    baseline_mounts = set(baseline.container_mounts)
    baseline_tree = hookcheck.tree(rootfs)

    argv = [a for name in PAIRS for a in (os.path.join(rootfs, name), os.path.join(rootfs, name + ".swap"))]
    swapper = subprocess.Popen([sys.executable, "-I", "-c", SWAPPER, *argv], stdout=subprocess.PIPE, text=True)
    outcomes = {"ok": 0, "failed": 0}
    reasons = set()
    started = time.monotonic()
    try:
        assert swapper.stdout.readline() == "ready\n"
        for run in range(RUNS):
            os.kill(swapper.pid, signal.SIGCONT)
            if run % 2 == 0:
                out = hookcheck.run_hook(config, state, timeout=30)
                result = hookcheck.Result(out.returncode, out.stderr.decode("utf-8", "replace"))
            else:
                monkeypatch.setattr(rootfs_module, "_openat2_works", False)
                result = hookcheck.run_hook_in_process(config, state, capsys)
                monkeypatch.setattr(rootfs_module, "_openat2_works", None)
            os.kill(swapper.pid, signal.SIGSTOP)
            assert swapper.poll() is None, "the swapper stopped"
            wait_stopped(swapper.pid)  # kill() returns before a running process has stopped
            normalise(rootfs)
            after = hookcheck.observe(container, canary)
            hookcheck.assert_contained(baseline, after, rootfs, canary)
            if result.returncode == 0:
                outcomes["ok"] += 1
                clean(pid, rootfs, cgroup, baseline_mounts, baseline_tree)
            else:
                outcomes["failed"] += 1
                line = hookcheck.one_clear_line(result.stderr)
                reasons.add(line.rsplit(": ", 1)[-1])
                hookcheck.assert_rolled_back(baseline, after)
            assert set(hookcheck.mountinfo(pid)) == baseline_mounts, f"run {run}: cleanup left mounts"
    finally:
        swapper.kill()
        swapper.wait()
    elapsed = time.monotonic() - started
    print(f"race: {RUNS} runs in {elapsed:.1f} s: {outcomes}; failures: {sorted(reasons)}")
    assert outcomes["failed"] > 0, "the swapper never got in the hook's way; the race was not exercised"
    assert outcomes["ok"] > 0, "no start succeeded while the swapper ran"
