"""Shared fixtures. Prerequisites: a test that needs root, gcc, runc, ... calls `require(...)`;
it skips where the prerequisite is missing, except under OCI_GPU_HOOK_REQUIRE_ALL=1 (set by
.ci/run), where a missing prerequisite fails the test instead of hiding it."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import prerequisites
import pytest


@pytest.fixture(scope="session")
def require():
    """require(*names): skip the test unless every prerequisite is there (names as
    tests/prerequisites.py reads them).
    With OCI_GPU_HOOK_REQUIRE_ALL=1 (CI, where everything is meant to be installed) a missing one
    fails the test instead, so a broken environment cannot pass by skipping.
    """

    def check(*names: str) -> None:
        missing = prerequisites.absent(*names)
        if not missing:
            return
        message = f"needs {', '.join(missing)}, not available here"
        if os.environ.get("OCI_GPU_HOOK_REQUIRE_ALL") == "1":
            pytest.fail(message + " (OCI_GPU_HOOK_REQUIRE_ALL=1)", pytrace=False)
        pytest.skip(message)

    return check


NOBODY = 65534  # the overflow uid and gid: owns nothing, so it reads only what everyone may read


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "host(gpus, mig, ..., needs=()): the module's simulated GPU host (the `host` fixture): simulate's "
        "options, and what its tests need beyond root and gcc",
    )
    config.addinivalue_line(
        "markers",
        "another_user: runs code as another user (the run_as_nobody fixture marks it); "
        "tests/test_checkout_location.py runs these from a checkout no one else can enter",
    )


E2E = os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e") + os.sep


def pytest_collection_modifyitems(items):
    # Marked by the fixture, not by hand, so a new test that uses it cannot be left out of the run
    # from a locked checkout.
    for item in items:
        if "run_as_nobody" in getattr(item, "fixturenames", ()):
            item.add_marker("another_user")
    # The end-to-end suites last, each module's order kept: the shared tools they run (a cold
    # machine builds them for about 12 minutes) are being built meanwhile by tests/toolbuild.py,
    # which `make test` starts in the background (issue 40, item 9).
    items.sort(key=lambda item: str(item.path).startswith(E2E))


def _readable_by_all(top: str) -> None:
    """Directories 0755 and files 0644 (0755 where executable), whatever the umask or the modes the
    files had in the checkout."""
    os.chmod(top, 0o755)
    for directory, dirs, files in os.walk(top):
        for name in dirs:
            os.chmod(os.path.join(directory, name), 0o755)
        for name in files:
            path = os.path.join(directory, name)
            os.chmod(path, 0o755 if os.stat(path).st_mode & 0o100 else 0o644)


def _unreachable_by_others(path: str):
    """The first directory on path's way that others cannot enter, or None."""
    directory = os.path.dirname(os.path.abspath(path))
    while True:
        if not os.stat(directory).st_mode & 0o001:
            return directory
        if directory == "/":
            return None
        directory = os.path.dirname(directory)


@pytest.fixture
def run_as_nobody(require):
    """Factory: run(args, modules=("oci_gpu_hook",), **subprocess_args) runs `python ARGS` as uid
    and gid 65534, no supplementary groups, no capabilities; returns the CompletedProcess.

    The child must not need the checkout: root may have cloned it where no one else can enter
    (its home, /root, is 0700), and the venv (its python and site-packages) lies inside it too. So
    the child runs the base interpreter (the venv's is a link to it, or a copy of it) in a
    directory made for it and removed afterwards, readable by everyone, holding copies of
    `modules` as this process imports them: the package under test, and any third-party package
    the child imports (click for the CLI). That directory is its working directory, so it comes
    first on its sys.path; -E keeps PYTHONPATH from pointing it elsewhere.
    """
    require("root")
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    locked = _unreachable_by_others(python)
    if locked:
        pytest.fail(f"{python}: other users cannot run it ({locked} is closed to them)", pytrace=False)
    made = []

    def run(args, modules=("oci_gpu_hook",), **kwargs):
        # In /tmp itself, not under tempfile's default: TMPDIR may be private (pam_tmpdir's /tmp/user/0).
        top = tempfile.mkdtemp(prefix="oci-gpu-hook-nobody-", dir="/tmp")
        made.append(top)
        for name in modules:
            spec = importlib.util.find_spec(name)
            if spec.submodule_search_locations:
                (source,) = spec.submodule_search_locations
                shutil.copytree(source, os.path.join(top, name), ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(spec.origin, top)
        _readable_by_all(top)
        # subprocess drops privileges before exec, so the kernel checks the interpreter's path as
        # nobody (setpriv execs with root's capabilities still effective, so it would not), and
        # the switch from uid 0 clears every capability.
        return subprocess.run(
            [python, "-E", "-s", "-B", *args], cwd=top, user=NOBODY, group=NOBODY, extra_groups=[], **kwargs
        )

    yield run
    for top in made:
        shutil.rmtree(top)


@pytest.fixture
def hook_cli():
    """Run the real console entry point in a subprocess; returns CompletedProcess with text."""
    from oci_gpu_hook.toolkit.containers import hook_command

    def run(*args, env=None, input=None):
        return subprocess.run(
            [*hook_command(), *args],
            capture_output=True,
            text=True,
            env=env,
            input=input,
            timeout=300,
        )

    return run


@pytest.fixture(scope="session")
def simulated_host(tmp_path_factory, require):
    """Factory: build (once per option set and session) a simulated GPU host; returns its summary
    (the simulator's own record of what it wrote, the ground truth to compare against)."""
    from oci_gpu_hook.toolkit.simulate import simulate

    built = {}

    def make(**options):
        require("root", "gcc")
        key = tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in options.items()))
        if key not in built:
            root = tmp_path_factory.mktemp("simhost") / "host"
            built[key] = simulate(str(root), **options)
        return built[key]

    return make


@pytest.fixture(scope="module")
def host(request, simulated_host, require):
    """The module's simulated GPU host, the one `host` fixture: simulate's options from the module's
    `pytestmark = pytest.mark.host(gpus=4, mig=[2], ...)` (default: 2 GPUs, GPU 1 in MIG mode),
    `needs=(...)` what its tests need beyond root and gcc. Built once per option set and session
    (simulated_host); a module that changes the host puts it back itself."""
    marker = request.node.get_closest_marker("host")
    options = {"gpus": 2, "mig": [1], **(marker.kwargs if marker else {})}
    needs = options.pop("needs", ())
    require("root", "gcc", *needs)
    return simulated_host(**options)


@pytest.fixture(autouse=True)
def _compiled_settings_in_tmp(tmp_path_factory, monkeypatch):
    """In-process tests keep compiled settings out of the host's /run."""
    from oci_gpu_hook.start import settings

    monkeypatch.setattr(settings, "RUN_DIR", str(tmp_path_factory.mktemp("run")))


@pytest.fixture(scope="session", autouse=True)
def _clean_compiled_settings_of_subprocesses(tmp_path_factory):
    """The hooks this run starts as programs (runc's, CRI-O's, ...) keep compiled settings in the
    host's /run/oci-gpu-hook: those of this run's configuration files under its base temporary
    directory, which pytest keeps, are removed at the end, and nothing else there (another run's
    are its own). Those of a configuration a test kept elsewhere are the test's to remove with
    it (leftovers.remove_directory): the module check below names them."""
    base = str(tmp_path_factory.getbasetemp())
    yield
    import leftovers

    leftovers.remove_compiled_settings(leftovers.RUN_DIR, base)


_LAST_LOOK: dict = {}  # the host as the last module left it: the next one's "before"


@pytest.fixture(scope="module", autouse=True)
def _nothing_left_on_the_host_by_module(request):
    """What a module leaves on the host (leftovers.py: compiled settings of a configuration that
    is gone, files in /etc/cdi, hooks.d, systemd's units and install's other places, podman's
    images and containers, runc's containers, caches) fails its last teardown, named. One look
    between two modules serves as the first one's "after" and the next one's "before"."""
    import leftovers

    before = _LAST_LOOK.pop("host", None) or leftovers.snapshot()
    yield
    after = _LAST_LOOK["host"] = leftovers.snapshot()
    found = leftovers.left(before, after)
    if found:
        pytest.fail(f"{request.module.__name__} left on the host: {'; '.join(found)}", pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def _host_dev_unchanged_by_module(request):
    """The host's /dev is, after each module, what it was before (hostcheck.dev_entries: names,
    types, device numbers, link targets); what a test, a harness or a program it ran made or
    removed there is named in the module's last teardown. NVIDIA's real libraries, run as root
    where /dev is the host's, make /dev/nvidiactl themselves. Left out: what the kernel makes
    and removes with a device (a loop device attached, by this suite or anyone) and the contents
    of the filesystems mounted below /dev (terminals, shared memory): hostcheck.dev_changes."""
    from hostcheck import dev_changes, dev_entries

    before = dev_entries()
    yield
    changes = dev_changes(before, dev_entries())
    if changes:
        pytest.fail(f"the host's /dev changed during {request.module.__name__}: {'; '.join(changes)}", pytrace=False)


CGROUP_ROOT = "/sys/fs/cgroup/devices"


@pytest.fixture
def live_container(tmp_path, simulated_host, require):
    """Factory: a live 'container' (a process in its own mount namespace, in a fresh cgroup v1
    devices group that denies everything, with a bundle and rootfs), as a runtime hands it to the
    hook at prestart, but kept alive afterwards so it can be inspected. Returns
    (state JSON, bundle, pid, cgroup dir, simulated host)."""
    require("root", "unshare", "busybox", "gcc")
    if not os.path.isdir(CGROUP_ROOT):
        pytest.fail("the cgroup v1 devices hierarchy is not mounted at /sys/fs/cgroup/devices")
    from hookcheck import hold_namespace

    from oci_gpu_hook.toolkit import containers

    started = []

    def make(env, mount_label=None, host_options=None, debian=False):
        host = simulated_host(**(host_options or {"gpus": 2, "mig": [1]}))
        bundle = containers.make_bundle(
            str(tmp_path / f"bundle{len(started)}"),
            rootfs_debian=debian,
            args=["true"],
            env=env,
            config_file=None,
            mount_label=mount_label,
        )
        # The holder first: if it cannot start, no cgroup is left behind.
        proc = hold_namespace(os.path.join(bundle, "rootfs"))
        cgroup = os.path.join(CGROUP_ROOT, f"ocigpu-test-{os.getpid()}-{time.monotonic_ns()}")
        os.mkdir(cgroup)
        started.append((proc, cgroup))
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(proc.pid))
        with open(os.path.join(cgroup, "devices.deny"), "w") as f:
            f.write("a")
        state = {
            "ociVersion": "1.0.2",
            "id": f"live{len(started)}",
            "status": "creating",
            "pid": proc.pid,
            "bundle": bundle,
        }
        return json.dumps(state), bundle, proc.pid, cgroup, host

    yield make
    from hookcheck import remove_cgroup

    for proc, cgroup in started:
        proc.kill()
        proc.wait()
        remove_cgroup(cgroup)


# --- measurements ---------------------------------------------------------------------------------

_MEASURED = []


@pytest.fixture
def report_measurement():
    """report_measurement(line): a wall time or other figure a test measured and does not judge,
    shown under 'measurements' after the test summary (reliability and load tests)."""
    return _MEASURED.append


def pytest_terminal_summary(terminalreporter):
    if _MEASURED:
        terminalreporter.section("measurements")
        for line in _MEASURED:
            terminalreporter.write_line(line)
