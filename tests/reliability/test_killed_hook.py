"""Attack round 2, class 9: a hook killed with SIGKILL in the middle of apply (the runtime's
timeout, the OOM killer). Its mounts die with the container's namespace; the empty files,
directories and symlinks it made in a plain-directory rootfs are named in its journal, and the
next GPU start of the same rootfs removes them before doing anything else.
"""

import json
import os
import signal

import hookcheck
import pytest

from oci_gpu_hook.start import settings
from oci_gpu_hook.start.apply import FAULT_ENV
from oci_gpu_hook.start.linux.journal import Journal
from oci_gpu_hook.start.linux.rootfs import Rootfs

ENV = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "all"}


def state_for(bundle, pid, name):
    return json.dumps({"ociVersion": "1.0.2", "id": name, "status": "creating", "pid": pid, "bundle": bundle})


@pytest.mark.parametrize("kill_at", [5, 20, 40])
def test_the_next_start_removes_what_a_killed_hook_made(live_container, kill_at):
    state, bundle, pid, cgroup, host = live_container(ENV)
    rootfs = os.path.join(bundle, "rootfs")
    config = f"{host['root']}/config.yaml"
    pristine = hookcheck.tree(rootfs)

    killed = hookcheck.run_hook(config, state, env={**hookcheck.HOOK_ENV, FAULT_ENV: f"{kill_at}:kill"})
    # The plan is carried out in the hook's own process (issue 41): the kill ends the hook itself,
    # as a runtime's timeout does, and the runtime reports it; nothing of the hook's can.
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)
    assert killed.stderr == b""
    left = set(hookcheck.tree(rootfs)) - set(pristine)
    assert left, "the killed hook made nothing; the case tests nothing"
    journals = os.listdir(f"{host['root']}/pending")
    assert journals, "no journal was left for the killed apply"
    # The hook's own, as recovery takes it (linux/journal.py): its uid's, writable by it alone.
    assert all(settings.trusted(os.stat(f"{host['root']}/pending/{name}")) for name in journals)

    # The runtime gives up on that container; the same rootfs is started again (a new namespace),
    # and this start fails at its first operation: all that remains is what recovery did.
    holder = hookcheck.hold_namespace(rootfs, 60)
    try:
        again = hookcheck.run_hook(config, state_for(bundle, holder.pid, "again"),
                                   env={**hookcheck.HOOK_ENV, FAULT_ENV: "1"})  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    assert again.returncode != 0 and "injected fault" in again.stderr.decode()
    assert hookcheck.tree(rootfs) == pristine
    assert os.listdir(f"{host['root']}/pending") == []


def test_a_running_apply_is_not_recovered(live_container):
    """A journal whose apply still holds its lock belongs to a start in progress: left alone. The
    apply in progress is this test's, its journal opened as the hook's apply opens it (a file of
    the hook's own uid, which recovery would take were it not locked)."""
    state, bundle, pid, cgroup, host = live_container(ENV)
    rootfs = os.path.join(bundle, "rootfs")
    made = os.path.join(rootfs, "usr/lib64/made-by-a-running-apply")
    open(made, "w").close()
    running = Rootfs(rootfs)
    journal = Journal.start(f"{host['root']}/pending", running)
    try:
        journal.intend("file", "/usr/lib64/made-by-a-running-apply")
        path = f"{host['root']}/pending/{journal.name}"
        assert settings.trusted(os.stat(path))
        out = hookcheck.run_hook(f"{host['root']}/config.yaml", state)
        assert out.returncode == 0, out.stderr
        assert os.path.exists(made) and os.path.exists(path)
    finally:  # the simulated host is shared: no journal may outlive the test
        journal.close()
        running.close()
