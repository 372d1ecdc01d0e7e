"""The node VM (issues 38 and 50): a Debian 12 VM with systemd as PID 1, unified cgroup2 and SELinux
enforcing, in two flavours of policy (debian: Debian's refpolicy; rhel: Fedora's targeted policy
with container-selinux, the RHEL family's), each booted once per session with this checkout
installed in it as a user installs it; one test per scenario in tests/vm/scenarios and flavour
(tests/vmcheck.py says how to add one). Under `make test` the boots ran in the background
meanwhile, and these tests wait for their results (VMCHECK_BOOTED); run alone, the first test of a
flavour boots it. A VM that cannot boot fails every test of its flavour, never skips it."""

import os

import pytest
import vmcheck

NEEDS = ("root", "qemu-system-x86_64", "debootstrap", "unshare", "mkfs.ext4", "setfiles",
         "/usr/src/selinux-policy-src.tar.zst")  # fmt: skip


# the rhel flavour's policy is built from the workplace's source (tests/vm/build-base.sh)
FLAVOUR_NEEDS = {"debian": (), "rhel": ("checkpolicy", "m4", "semodule", "rpmbuild", os.path.normpath(
    os.path.join(vmcheck.REPO, "..", "shared", "tools", "selinux-rhel", "build-policy.sh")))}  # fmt: skip


def node_vm(require, flavour):
    require(*NEEDS, *FLAVOUR_NEEDS[flavour])
    try:
        return vmcheck.session_run(flavour)
    except vmcheck.VmError as e:
        pytest.fail(f"the node VM did not run: {e}", pytrace=False)


@pytest.mark.parametrize("flavour", vmcheck.flavours())
def test_the_harness_reports_a_failing_scenario_with_its_denials(require, flavour):
    """The self-check scenario fails on purpose (exit 3) after a container_t process reads a file
    in root's home: the harness must bring back that status, its output and the denial, and its
    report must show them with the serial console."""
    run = node_vm(require, flavour)
    step = run.step("selfcheck")
    assert step.rc == 3, run.report("the self-check's exit status did not come back", step)
    assert "VMCHECK-SELFCHECK-MARKER" in step.output, run.report("its output did not come back", step)
    assert "denied" in step.avc and "container_t" in step.avc, run.report("its denial did not come back", step)
    report = run.failure("selfcheck")
    assert report and "denied" in report and "VMCHECK-" in report.split("serial console (tail)")[1]


@pytest.mark.parametrize(
    ("flavour", "name"), [(flavour, name) for flavour in vmcheck.flavours() for name in vmcheck.scenarios(flavour)]
)
def test_scenario(require, flavour, name):
    run = node_vm(require, flavour)
    failure = run.failure(name)
    if failure:
        pytest.fail(failure, pytrace=False)
