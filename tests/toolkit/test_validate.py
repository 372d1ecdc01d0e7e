"""validate: a container per GPU, with the hook, on a simulated host (root, runc, busybox, gcc)."""

import os
import shutil
import subprocess
import sys
import sysconfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_validate_passes_on_a_simulated_host(simulated_host, require, hook_cli):
    require("root", "runc", "busybox", "gcc")
    host = simulated_host(gpus=4, mig=[2], scramble_minors=True)
    out = hook_cli("--config", f"{host['root']}/config.yaml", "validate")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert [line.split()[3] for line in lines] == [gpu["uuid"] for gpu in host["gpus"]]
    assert all(line.startswith("PASS") for line in lines)
    assert "4 of 4 GPU(s) passed" in out.stdout


def test_validate_fails_clearly_when_a_gpu_node_is_missing(fresh_host, require, hook_cli):
    require("root", "runc", "busybox", "gcc")
    host = fresh_host(gpus=3)
    os.unlink(os.path.join(host["root"], "dev", f"nvidia{host['gpus'][1]['minor']}"))
    out = hook_cli("--config", f"{host['root']}/config.yaml", "validate")
    assert out.returncode == 1
    lines = [line for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert [line[:4] for line in lines] == ["PASS", "FAIL", "PASS"]
    assert lines[1].endswith(f"oci-gpu-hook: GPU 1 (/dev/nvidia{host['gpus'][1]['minor']}): device node missing")
    assert "2 of 3 GPU(s) passed" in out.stdout


def test_validate_with_podman_and_a_named_oci_runtime(simulated_host, require, hook_cli):
    require("root", "podman", "runc", "busybox", "gcc")
    host = simulated_host(gpus=4, mig=[2], scramble_minors=True)
    out = hook_cli("--config", f"{host['root']}/config.yaml", "validate", "--runtime", "podman",
                   "--oci-runtime", "runc")  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 of 4 GPU(s) passed" in out.stdout
    assert all("in a podman (runc) container" in line for line in out.stdout.splitlines() if line.startswith("PASS"))


def test_an_oci_runtime_podman_cannot_use_is_one_error_before_any_container(simulated_host, require, hook_cli):
    require("root", "podman", "gcc")
    host = simulated_host(gpus=4, mig=[2], scramble_minors=True)
    out = hook_cli("--config", f"{host['root']}/config.yaml", "validate", "--runtime", "podman",
                   "--oci-runtime", "no-such-runtime")  # fmt: skip
    assert out.returncode == 7 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "no-such-runtime" in out.stderr and "Traceback" not in out.stderr
    runc = hook_cli("validate", "--oci-runtime", "crun")  # runc is the OCI runtime itself
    assert runc.returncode == 2 and "--oci-runtime goes with --runtime podman" in runc.stderr


def _installed_copy(tmp_path):
    """A virtual environment with the package installed by pip from a copy of the sources (so the
    build leaves the checkout alone); the third-party packages come from the test's own
    environment through a .pth line. Returns (python, site-packages)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), src)
    shutil.copytree(os.path.join(REPO, "oci_gpu_hook"), src / "oci_gpu_hook",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", site, str(src)],
                         capture_output=True, text=True)  # fmt: skip
    assert pip.returncode == 0, pip.stdout + pip.stderr
    with open(os.path.join(site, "test-dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")  # click, pyyaml, jsonschema, ...
    return python, site


def test_validate_with_podman_from_an_installed_copy(simulated_host, require, tmp_path):
    """An installed copy has no hooks.d/ directory beside the package: validate builds the hooks.d
    file itself. And podman runs containers with the OCI runtime it is configured with."""
    require("root", "podman", "runc", "busybox", "gcc")
    host = simulated_host(gpus=4, mig=[2], scramble_minors=True)
    python, site = _installed_copy(tmp_path)
    where = subprocess.run([python, "-I", "-c", "import oci_gpu_hook; print(oci_gpu_hook.__file__)"],
                           capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert where == os.path.join(site, "oci_gpu_hook", "__init__.py")
    assert not os.path.exists(os.path.join(os.path.dirname(site), "hooks.d"))
    assert not os.path.exists(os.path.join(site, "hooks.d"))
    argv = [python, "-I", "-m", "oci_gpu_hook", "--config", f"{host['root']}/config.yaml", "validate", "--runtime",
            "podman"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 of 4 GPU(s) passed" in out.stdout
    default = subprocess.run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"], capture_output=True,
                             text=True, check=True).stdout.strip()  # fmt: skip
    passed = [line for line in out.stdout.splitlines() if line.startswith("PASS")]
    assert len(passed) == 4 and all(f"in a podman ({default}) container" in line for line in passed), out.stdout
