"""The node VM (issue 38): a Debian 12 VM with systemd as PID 1, unified cgroup2 and SELinux
enforcing, booted once per session with this checkout installed in it as a user installs it; one
test per scenario in tests/vm/scenarios (tests/vmcheck.py says how to add one). Under `make test`
the boot ran in the background meanwhile, and these tests wait for its results (VMCHECK_BOOTED);
run alone, the first test boots. A VM that cannot boot fails every test here, never skips it."""

import pytest
import vmcheck

NEEDS = ("root", "qemu-system-x86_64", "debootstrap", "unshare", "mkfs.ext4", "setfiles",
         "/usr/src/selinux-policy-src.tar.zst")  # fmt: skip


def node_vm(require):
    require(*NEEDS)
    try:
        return vmcheck.session_run()
    except vmcheck.VmError as e:
        pytest.fail(f"the node VM did not run: {e}", pytrace=False)


def test_the_harness_reports_a_failing_scenario_with_its_denials(require):
    """The self-check scenario fails on purpose (exit 3) after a container_t process reads a file
    in root's home: the harness must bring back that status, its output and the denial, and its
    report must show them with the serial console."""
    run = node_vm(require)
    step = run.step("selfcheck")
    assert step.rc == 3, run.report("the self-check's exit status did not come back", step)
    assert "VMCHECK-SELFCHECK-MARKER" in step.output, run.report("its output did not come back", step)
    assert "denied" in step.avc and "container_t" in step.avc, run.report("its denial did not come back", step)
    report = run.failure("selfcheck")
    assert report and "denied" in report and "VMCHECK-" in report.split("serial console (tail)")[1]


@pytest.mark.parametrize("name", vmcheck.scenarios())
def test_scenario(require, name):
    run = node_vm(require)
    failure = run.failure(name)
    if failure:
        pytest.fail(failure, pytrace=False)
