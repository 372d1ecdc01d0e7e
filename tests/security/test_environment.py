"""The image's environment never reaches the hook or anything it runs (CVE-2025-23266's lesson).

The image (process.env) is the attacker's: LD_PRELOAD, LD_AUDIT, LD_LIBRARY_PATH, PYTHONPATH,
PYTHONHOME, a PATH into the rootfs, and the hook's own OCI_GPU_HOOK_* variables. A runtime passes a
hook exactly the env its hook entry names, so every file that wires the hook in names a fixed one;
the hook reads process.env only as data (the NVIDIA_* request); ldconfig and the NVML child get
environments of their own (empty; PATH and LC_ALL). The traps: a preload library and a
sitecustomize.py that leave a marker file wherever they run, and an image `ldconfig` that would do
the same.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import hookcheck
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXED_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}

PRELOAD_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
__attribute__((constructor)) static void trap(void) {
    char exe[512] = "", line[700];
    if (readlink("/proc/self/exe", exe, sizeof exe - 1) < 0) strcpy(exe, "?");
    int fd = open("%(markers)s/preload", O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0) return;
    snprintf(line, sizeof line, "%%d %%s\n", (int)getpid(), exe);
    write(fd, line, strlen(line));
    close(fd);
}
"""


@pytest.fixture
def traps(tmp_path, require):
    """(markers dir, image env that springs the traps): all traps write into markers/."""
    require("gcc")
    markers = tmp_path / "markers"
    markers.mkdir()
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "preload.c").write_text(PRELOAD_C % {"markers": markers})
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(evil / "preload.so"), str(evil / "preload.c")], check=True)
    trap_py = f"open({str(markers / 'python')!r}, 'a').write(__name__ + '\\n')\n"
    for name in ("sitecustomize.py", "usercustomize.py", "startup.py"):
        (evil / name).write_text(trap_py)
    (evil / "bin").mkdir()
    for name in ("ldconfig", "python3", "sh", "nsenter", "mount"):
        script = evil / "bin" / name
        script.write_text(f"#!/bin/sh\necho {name} >> {markers}/path\n")
        script.chmod(0o755)
    (evil / "config.yaml").write_text("cgroups: off\ndriver_root: /nonexistent\n")
    env = {
        "LD_PRELOAD": str(evil / "preload.so"),
        "LD_AUDIT": str(evil / "preload.so"),
        "LD_LIBRARY_PATH": str(evil),
        "PYTHONPATH": str(evil),
        "PYTHONSTARTUP": str(evil / "startup.py"),
        "PYTHONHOME": str(evil),
        "PYTHONINSPECT": "1",
        "PYTHONWARNINGS": "error",
        "PATH": f"{evil}/bin:/usr/bin:/bin",
        "OCI_GPU_HOOK_FAULT_AT": "1",
        "OCI_GPU_HOOK_CONFIG": str(evil / "config.yaml"),
        "OCI_GPU_HOOK_DEBUG": "1",
        "GCONV_PATH": str(evil),
    }
    return markers, env


def sprung(markers) -> dict:
    return {p.name: p.read_text() for p in markers.iterdir()}


def test_the_traps_work(traps):
    """The traps are real: a process that does take the environment springs them."""
    markers, env = traps
    subprocess.run(["/bin/true"], env={"LD_PRELOAD": env["LD_PRELOAD"]}, check=True)
    subprocess.run([sys.executable, "-c", "pass"], env={"PYTHONPATH": env["PYTHONPATH"]}, check=True)
    subprocess.run(["ldconfig", "-p"], env={"PATH": env["PATH"]}, check=True, capture_output=True)
    assert set(sprung(markers)) == {"preload", "python", "path"}


def test_hooks_d_gives_the_hook_a_fixed_environment():
    with open(os.path.join(REPO, "hooks.d/oci-gpu-hook.json")) as f:
        hook = json.load(f)["hook"]
    assert dict(entry.split("=", 1) for entry in hook["env"]) == FIXED_ENV


def _hook_snippets(path):
    with open(os.path.join(REPO, path)) as f:
        text = f.read()
    blocks = re.findall(r"```json\n(.*?)```", text, re.S)
    return [b for b in blocks if '"prestart"' in b and "oci-gpu-hook" in b]


@pytest.mark.parametrize("path", ["README.md", "docs/cli.md"])
def test_runc_examples_give_the_hook_a_fixed_environment(path):
    snippets = _hook_snippets(path)
    assert snippets, f"{path} shows no runc hook entry"
    for snippet in snippets:
        hooks = json.loads("{" + snippet.strip() + "}")["hooks"]["prestart"]
        for hook in hooks:
            assert dict(entry.split("=", 1) for entry in hook["env"]) == FIXED_ENV


def test_demo_bundles_give_the_hook_a_fixed_environment():
    from oci_gpu_hook.toolkit import containers

    config = containers.make_config(["true"], {"LD_PRELOAD": "/x.so", "PYTHONPATH": "/x"}, "/c.yaml")
    (hook,) = config["hooks"]["prestart"]
    assert dict(entry.split("=", 1) for entry in hook["env"]) == FIXED_ENV
    assert hook["args"][:3] == [sys.executable, "-I", "-m"]  # isolated mode: no PYTHON* variables


def test_image_environment_never_reaches_the_hook_under_runc(traps, simulated_host, require, tmp_path):
    """A real runc container whose image sets every trap: the hook runs with its fixed env, so it
    neither injects the image's fault nor reads the image's config, and no trap springs."""
    require("root", "runc", "busybox", "gcc")
    from oci_gpu_hook.toolkit import containers

    markers, env = traps
    host = simulated_host(gpus=2, mig=[1])
    bundle = containers.make_bundle(
        str(tmp_path / "bundle"), args=["sh", "-c", "nvidia-smi -L"], env={"NVIDIA_VISIBLE_DEVICES": "1", **env},
        config_file=f"{host['root']}/config.yaml",
    )  # fmt: skip
    with open(os.path.join(bundle, "config.json")) as f:
        config = json.load(f)
    assert set(env.items()) <= {tuple(e.split("=", 1)) for e in config["process"]["env"]}  # the image's env
    out = containers.runc_run(bundle, f"ocigpu-env-{os.getpid()}")
    assert out.returncode == 0, out.stderr
    assert hookcheck.listed_uuids(out.stdout, ("GPU",)) == [host["gpus"][1]["uuid"]]
    assert sprung(markers) == {}


def test_the_hook_takes_nothing_from_the_image_environment(traps, live_container):
    """Direct: the image's OCI_GPU_HOOK_FAULT_AT / _CONFIG / _DEBUG are data, not settings."""
    markers, env = traps
    container = live_container({"NVIDIA_VISIBLE_DEVICES": "0", **env})
    state, bundle, pid, cgroup, host = container
    out = hookcheck.run_hook(f"{host['root']}/config.yaml", state)
    assert out.returncode == 0, out.stderr
    assert out.stderr == b""
    assert "c 195:0 rw" in hookcheck.device_rules(cgroup)  # the image's config (cgroups: off) was not read
    assert sprung(markers) == {}


def test_the_nvml_child_gets_a_fixed_environment(traps, simulated_host, monkeypatch):
    """`inventory refresh` asks NVML in a child: a polluted caller's env does not reach it."""
    from oci_gpu_hook.start import nvml

    markers, env = traps
    host = simulated_host(gpus=2, mig=[1])
    for key in ("LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONSTARTUP", "PYTHONINSPECT", "PATH"):
        monkeypatch.setenv(key, env[key])
    facts = nvml.query(f"{host['root']}/usr/lib64/libnvidia-ml.so.{host['driver_version']}")
    assert len(facts["gpus"]) == 2
    assert sprung(markers) == {}
