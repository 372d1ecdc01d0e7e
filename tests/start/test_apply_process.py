"""apply carries the plan out in the hook's own process (issue 41): it joins the container's mount
namespace and gives the process back as it found it, after a success as after a rollback: its
own mount namespace, working directory, descriptors and SIGALRM handler. Everything after apply
(the container record, the log) depends on it seeing the host again."""

import os
import signal

import hookcheck

from oci_gpu_hook.errors import Exit
from oci_gpu_hook.start.apply import FAULT_ENV

ENV = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "utility,compute"}


def own_place():
    return (
        os.readlink("/proc/self/ns/mnt"),
        os.stat("/").st_ino,
        os.getcwd(),
        sorted(os.listdir("/proc/self/fd")),
        signal.getsignal(signal.SIGALRM),
        signal.getitimer(signal.ITIMER_REAL),
    )


def mounted_in(pid: int, path: str) -> bool:
    with open(f"/proc/{pid}/mountinfo") as f:
        return any(line.split()[4].endswith(path) for line in f)


def test_the_process_is_given_back_after_a_success(live_container, capsys, tmp_path, monkeypatch):
    state, bundle, pid, cgroup, host = live_container(ENV)
    monkeypatch.chdir(tmp_path)
    before = own_place()
    result = hookcheck.run_hook_in_process(f"{host['root']}/config.yaml", state, capsys)
    assert result.returncode == 0, result.stderr
    assert own_place() == before
    assert mounted_in(pid, "/dev/nvidia0"), "the GPU was not mounted in the container's namespace"
    assert not mounted_in(os.getpid(), "/dev/nvidia0"), "a mount was made in the hook's own namespace"


def test_the_process_is_given_back_after_a_rollback(live_container, capsys, tmp_path, monkeypatch):
    container = live_container(ENV)
    state, bundle, pid, cgroup, host = container
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(FAULT_ENV, "20")  # the hook reads it from its own environment
    before, observed = own_place(), hookcheck.observe(container)
    result = hookcheck.run_hook_in_process(f"{host['root']}/config.yaml", state, capsys)
    assert result.returncode == Exit.APPLY
    assert "injected fault" in hookcheck.one_clear_line(result.stderr)
    assert own_place() == before
    hookcheck.assert_rolled_back(observed, hookcheck.observe(container))
