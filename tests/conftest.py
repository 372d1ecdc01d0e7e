"""Shared fixtures. Prerequisites: a test that needs root, gcc, runc, ... calls `require(...)`;
it skips where the prerequisite is missing, except under OCI_GPU_HOOK_REQUIRE_ALL=1 (set by
.ci/run), where a missing prerequisite fails the test instead of hiding it."""

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest


@functools.cache
def _gcc_can_build_32bit() -> bool:
    if not shutil.which("gcc"):
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "t.c")
        with open(src, "w") as f:
            f.write("int main(void) { return 0; }\n")
        proc = subprocess.run(["gcc", "-m32", "-o", os.path.join(tmp, "t"), src], capture_output=True)
        return proc.returncode == 0


def _available(name: str) -> bool:
    if name == "root":
        return os.geteuid() == 0
    if name == "gcc-m32":
        return _gcc_can_build_32bit()
    return bool(shutil.which(name)) or importlib.util.find_spec(name) is not None


@pytest.fixture(scope="session")
def require():
    """require(*names): skip the test unless every prerequisite is there.

    A name is an executable on PATH or an importable module; "root" means running as uid 0 and
    "gcc-m32" a gcc that can build 32-bit programs. With OCI_GPU_HOOK_REQUIRE_ALL=1 (CI, where
    everything is meant to be installed) a missing one fails the test instead, so a broken
    environment cannot pass by skipping.
    """

    def check(*names: str) -> None:
        missing = [name for name in names if not _available(name)]
        if not missing:
            return
        message = f"needs {', '.join(missing)}, not available here"
        if os.environ.get("OCI_GPU_HOOK_REQUIRE_ALL") == "1":
            pytest.fail(message + " (OCI_GPU_HOOK_REQUIRE_ALL=1)", pytrace=False)
        pytest.skip(message)

    return check


@pytest.fixture
def hook_cli():
    """Run the real console entry point in a subprocess; returns CompletedProcess with text."""

    def run(*args, env=None, input=None):
        return subprocess.run(
            [sys.executable, "-I", "-m", "oci_gpu_hook", *args],
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
    from oci_gpu_hook.simulate import simulate

    built = {}

    def make(**options):
        require("root", "gcc")
        key = tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in options.items()))
        if key not in built:
            root = tmp_path_factory.mktemp("simhost") / "host"
            built[key] = simulate(str(root), **options)
        return built[key]

    return make


@pytest.fixture(autouse=True)
def _compiled_settings_in_tmp(tmp_path_factory, monkeypatch):
    """In-process tests keep compiled settings out of the host's /run."""
    from oci_gpu_hook import settings

    monkeypatch.setattr(settings, "COMPILED_DIR", str(tmp_path_factory.mktemp("run")))


@pytest.fixture(scope="session", autouse=True)
def _clean_compiled_settings_of_subprocesses():
    yield
    from oci_gpu_hook import settings

    try:
        names = os.listdir(settings.COMPILED_DIR)
    except OSError:
        return
    for name in names:
        if "pytest-of-" in name:
            os.unlink(os.path.join(settings.COMPILED_DIR, name))


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
    from oci_gpu_hook import demo

    started = []

    def make(env, mount_label=None, host_options=None, debian=False):
        host = simulated_host(**(host_options or {"gpus": 2, "mig": [1]}))
        bundle = demo.make_bundle(
            str(tmp_path / f"bundle{len(started)}"),
            rootfs_debian=debian,
            args=["true"],
            env=env,
            config_file=None,
            mount_label=mount_label,
        )
        cgroup = os.path.join(CGROUP_ROOT, f"ocigpu-test-{os.getpid()}-{time.monotonic_ns()}")
        os.mkdir(cgroup)
        proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "600"])
        started.append((proc, cgroup))
        time.sleep(0.2)
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
