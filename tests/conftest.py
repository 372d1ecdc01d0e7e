"""Shared fixtures. Prerequisites: a test that needs root, gcc, runc, ... asks `require(...)`;
it skips where the prerequisite is missing, except under OCI_GPU_HOOK_REQUIRE_ALL=1 (set by
.ci/run), where a missing prerequisite fails the test instead of hiding it."""

import os
import shutil
import subprocess
import sys

import pytest

REQUIRE_ALL = os.environ.get("OCI_GPU_HOOK_REQUIRE_ALL") == "1"


def _missing(name: str):
    if name == "root":
        return None if os.geteuid() == 0 else "needs root"
    if name == "gcc-m32":
        ok = (
            shutil.which("gcc")
            and subprocess.run(
                ["gcc", "-m32", "-x", "c", "-c", "-o", "/dev/null", "-"], input=b"int x;", capture_output=True
            ).returncode
            == 0
        )
        return None if ok else "needs gcc -m32 (gcc-multilib)"
    if name == "pynvml":
        try:
            import pynvml  # noqa: F401
        except ImportError:
            return "needs nvidia-ml-py"
        return None
    return None if shutil.which(name) else f"needs {name}"


@pytest.fixture(scope="session")
def require():
    def check(*names):
        for name in names:
            reason = _missing(name)
            if reason:
                if REQUIRE_ALL:
                    pytest.fail(f"prerequisite missing in CI: {reason}")
                pytest.skip(reason)

    return check


@pytest.fixture
def hook_cli():
    """Run the real console entry point in a subprocess; returns CompletedProcess with text."""

    def run(*args, env=None, input=None):
        return subprocess.run(
            [sys.executable, "-m", "oci_gpu_hook", *args],
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
