"""The node VM harness's hand-over from the background boot `make test` starts (tests/vmcheck.py,
booted()): a session waits for the boot to finish, then its tests read that run as their own
boot's, a failed scenario included; a boot that ended without a result, or with an error, fails
them with why. The boot itself is tests/e2e/test_node_vm.py's."""

import fcntl
import json
import os
import subprocess
import sys
import time

import pytest
import vmcheck

NAMES = ["selfcheck", "podman_gpu_enforcing", "systemd_units"]  # real scenarios: a report quotes them


def _finished_run(top) -> str:
    """A run directory as boot() leaves it: the set-up passed, one scenario passed, one failed."""
    directory = top / "runs" / "20260101-000000-abcdef"
    steps = {"setup": 0, "scenarios/selfcheck": 3, f"scenarios/{NAMES[1]}": 0, f"scenarios/{NAMES[2]}": 1}
    for step, rc in steps.items():
        (directory / "results" / step).mkdir(parents=True)
        (directory / "results" / step / "rc").write_text(f"{rc}\n")
        (directory / "results" / step / "output.log").write_text(f"{step} SAYS-WHY\n")
    (directory / "serial.log").write_text("VMCHECK-GUEST took 300 s\n")
    return str(directory)


def _result(tmp_path, doc) -> str:
    result = tmp_path / "node-vm.json"
    result.write_text(json.dumps(doc))
    (tmp_path / "node-vm.json.lock").touch()
    return str(result)


def test_a_finished_background_boot_is_the_sessions_run_failures_included(tmp_path):
    directory = _finished_run(tmp_path)
    result = _result(tmp_path, {"names": NAMES, "directory": directory, "qemu_rc": 0, "wall": 300.0})
    run = vmcheck.booted(result, NAMES, wait=5)
    assert (run.directory, run.names, run.qemu_rc) == (directory, NAMES, 0)
    assert run.failure(NAMES[1]) is None
    report = run.failure(NAMES[2])
    assert report.startswith(f"scenario {NAMES[2]} failed") and f"scenarios/{NAMES[2]} SAYS-WHY" in report, report


def test_a_session_waits_while_the_background_boot_holds_its_lock(tmp_path):
    """A process of its own holds the lock as the background boot does, and writes the result
    only after the session has begun waiting."""
    directory = _finished_run(tmp_path)
    result = tmp_path / "node-vm.json"
    holder = (
        "import fcntl, json, os, sys, time\n"
        "made = sys.argv[1] + '.lock.new'\n"
        "lock = open(made, 'w'); fcntl.flock(lock, fcntl.LOCK_EX); os.rename(made, sys.argv[1] + '.lock')\n"
        "print('locked', flush=True); time.sleep(2)\n"
        "json.dump({'names': sys.argv[2].split(','), 'directory': sys.argv[3], 'qemu_rc': 0, 'wall': 1.0},"
        " open(sys.argv[1], 'w'))\n"
    )
    background = subprocess.Popen([sys.executable, "-c", holder, str(result), ",".join(NAMES), directory],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert background.stdout.readline() == "locked\n"
        started = time.monotonic()
        run = vmcheck.booted(str(result), NAMES, wait=60)
        waited = time.monotonic() - started
    finally:
        background.wait(timeout=60)
    assert run.directory == directory and waited >= 1, waited


def test_a_background_boot_that_left_no_result_fails_with_its_log(tmp_path):
    (tmp_path / "node-vm.json.lock").touch()
    with pytest.raises(vmcheck.VmError, match=f"ended without a result .*its log: {tmp_path}/node-vm.log"):
        vmcheck.booted(str(tmp_path / "node-vm.json"), NAMES, wait=5)


def test_a_background_boot_that_failed_fails_with_its_error(tmp_path):
    result = _result(tmp_path, {"names": NAMES, "error": "the base image build failed (2): no debootstrap"})
    with pytest.raises(vmcheck.VmError, match=r"^the base image build failed \(2\): no debootstrap$"):
        vmcheck.booted(result, NAMES, wait=5)


def test_no_background_boot_at_all_fails_once_the_wait_is_over(tmp_path):
    with pytest.raises(vmcheck.VmError, match="no background boot started"):
        vmcheck.booted(str(tmp_path / "node-vm.json"), NAMES, wait=1)


def test_a_session_does_not_take_a_lock_that_is_still_held(tmp_path):
    """The wait ends with the hang guard, not with a result read while the boot still works."""
    result = _result(tmp_path, {"names": NAMES, "error": "not this one"})
    with open(f"{result}.lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(vmcheck.VmError, match="did not finish within 3 s"):
            vmcheck.booted(result, NAMES, wait=3)
    assert os.path.exists(result)


def test_each_flavour_boots_its_own_scenarios_and_writes_its_own_result(monkeypatch):
    """A scenario's `# flavours:` line keeps it to those flavours (the RPM and the boolean exist on
    RHEL's policy alone); one without runs on both. Each flavour's background boot has a result
    file of its own, and their errors name the one log they share."""
    monkeypatch.delenv("VMCHECK_SCENARIOS", raising=False)
    monkeypatch.delenv("VMCHECK_FLAVOURS", raising=False)
    debian, rhel = vmcheck.scenarios("debian"), vmcheck.scenarios("rhel")
    for only_rhel in ("rpm_selinux_package", "selinux_container_use_devices"):
        assert only_rhel in rhel and only_rhel not in debian
    assert set(debian) < set(rhel) and "podman_gpu_enforcing" in debian
    assert vmcheck.result_of("/b/node-vm.json", "debian") == "/b/node-vm.json"
    assert vmcheck.result_of("/b/node-vm.json", "rhel") == "/b/node-vm-rhel.json"
    assert vmcheck._log_of("/b/node-vm-rhel.json") == vmcheck._log_of("/b/node-vm.json") == "/b/node-vm.log"
    # narrowed to a scenario of one flavour, a session boots that flavour alone
    monkeypatch.setenv("VMCHECK_SCENARIOS", "rpm_selinux_package")
    assert vmcheck.flavours() == ["rhel"] and vmcheck.scenarios("rhel") == ["rpm_selinux_package"]
