"""The hook installed the other ways a user installs it, for `make bench` (bench/run.py times what
runtimes run beside the RPM's launcher, hook:gpu1, in its interleaved rounds):
- venv: `pip install` of the project into a venv of the interpreter the bench runs on;
- user: `pip install --user` with that interpreter outside any venv (pip itself from the venv:
  Debian's python3 has none).
Each install's own CLI then runs `oci-gpu-hook install --runtime podman --runtime docker` into a
--root of its own, as a user would; the programs timed are what podman (hooks.d) and Docker
(nvidia-container-runtime-hook) then run, and, for comparison, the venv's console script pip wrote
(what a user would have wired without install).
"""

import json
import os
import subprocess
import sys

from oci_gpu_hook.start.inventory import host_path
from oci_gpu_hook.toolkit import install

PYTHON = os.path.realpath(sys.executable)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(argv, env=None) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return out.stdout


def wire(cli, root: str, env=None) -> dict:
    """`install --runtime podman --runtime docker` by cli (an install's program and its --config)
    into root; the argv each runtime then runs: {"hooks.d": ..., "docker": ...}."""
    os.mkdir(root)
    # --no-prefilter: these compare the launchers each way writes (the pre-filter, which runs in
    # front of any of them, is measured on its own); and the pre-filter a --root install compiles
    # runs the launcher at its host path, which is not there.
    _run([*cli, "install", "--root", root, "--runtime", "podman", "--runtime", "docker", "--no-prefilter"], env)
    with open(host_path(root, install.HOOKS_D_FILE)) as f:
        hook = json.load(f)["hook"]
    # hook.path is the host's path: here, under root.
    return {"hooks.d": [host_path(root, hook["path"]), *hook["args"][1:]],
            "docker": [host_path(root, install.DOCKER_HOOK), "prestart"]}  # fmt: skip


def hooks(work: str, config: str) -> dict:
    """{case name: the hook's argv} for each way, installed under work."""
    venv = os.path.join(work, "venv")
    _run([PYTHON, "-m", "venv", venv])
    _run([os.path.join(venv, "bin/pip"), "install", "-q", REPO])
    script = os.path.join(venv, "bin/oci-gpu-hook")
    wired = wire([script, "--config", config], os.path.join(work, "root-venv"))
    cases = {"install:venv hooks.d": wired["hooks.d"], "install:venv docker": wired["docker"],
             "console script:venv": [script, "--config", config, "prestart"]}  # fmt: skip

    site = _run([os.path.join(venv, "bin/python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    user = dict(os.environ, PYTHONUSERBASE=os.path.join(work, "userbase"))
    # --ignore-installed: the venv's packages, on PYTHONPATH for pip's sake, would otherwise count
    # as installed, and the user site would lack the dependencies.
    _run([PYTHON, "-m", "pip", "install", "-q", "--user", "--break-system-packages", "--ignore-installed", REPO],
         dict(user, PYTHONPATH=site.strip()))  # fmt: skip
    wired = wire([os.path.join(work, "userbase/bin/oci-gpu-hook"), "--config", config], os.path.join(work, "root-user"),
                 user)  # fmt: skip
    cases.update({"install:user hooks.d": wired["hooks.d"], "install:user docker": wired["docker"]})
    return cases
