"""The node image's toolkit puts the hook on a host, as the cluster will run it (issue 47):
`oci-gpu-hook toolkit install --runtime containerd|crio`, run from the image's bundle in a chroot
of an image root, the host's root at its /host. No `install` is typed on the host and no Python
of the host's is used: the bundle is copied onto the host and runs there.

The host is this machine in a mount namespace of the test's own, whose /etc, /usr/local,
/usr/share and /var/lib are overlays. The runtime runs with no flag at all, reading its configuration from /etc
(containerd's config.toml from tests/cricheck.py, CRI-O's settings as `crio config` prints them in
crio.conf.d), under a supervisor that starts it again when it exits, as systemd's Restart= would
(the toolkit's --restart signal is for such hosts).
- Before: a CRI container asking for GPU 1 gets none.
- toolkit install (restart auto, the default): the hook is installed, and the restart refused in
  one line, since no systemd runs this host; the runtime still runs.
- toolkit install --restart signal: nothing left to write, and the restart the first one owed is
  made, once; the same container gets exactly GPU 1, through the link to the bundle's pre-filter.
- toolkit install again: nothing changes, and the runtime is not restarted.
- toolkit uninstall: the runtime is restarted once more, after its configuration is taken back
  and before the programs go; the container gets no GPU again; the runtime's configuration is
  byte for byte as before, and nothing of ours is left under /usr/local or /var/lib.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import cricheck
import pytest
from hookcheck import config_with, listed_uuids
from imagecheck import build, image_bundle, layer

from oci_gpu_hook.toolkit import bundle, install, launcher

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

INSIDE = r"""
import json, os, subprocess, sys, time
runtime, work, hook_config, parent, tests, image, bundle_launcher = sys.argv[1:8]
sys.path.insert(0, tests)
import cricheck, hookcheck, kubeletcheck
from cricheck import run
from oci_gpu_hook.toolkit import restart
out = {}
# The node pod's view: the image's root, the host's at /host (recursively, as a hostPath), /proc, /dev.
for argv in (["mount", "--rbind", "/", image + "/host"], ["mount", "-t", "proc", "proc", image + "/proc"],
             ["mount", "--rbind", "/dev", image + "/dev"]):
    subprocess.run(argv, check=True)
if runtime == "containerd":
    sock, starts, watched = os.path.join(work, "containerd.sock"), os.path.join(work, "starts"), ["/etc/containerd"]
    loop = 'while [ ! -e "$1/stop" ]; do echo start >> "$1/starts"; containerd >> "$1/containerd.log" 2>&1; done'
    supervisor = subprocess.Popen(["sh", "-c", loop, "sh", work], stdin=subprocess.DEVNULL)
    crictl = os.path.join(kubeletcheck.shared_tool("crio"), "crictl")
    def ready():
        cricheck.wait_for_containerd(sock)
    def pod(phase):
        got = cricheck.gpu_pod(work, crictl, sock, parent, phase)
        assert all(got[step]["rc"] == 0 for step in ("runp", "create", "start", "rmp")), got
        return got["log"]
    def stop():
        open(os.path.join(work, "stop"), "w").close()
        pid = restart.serving(sock)
        if pid is not None:
            os.kill(pid, 15)
        supervisor.wait(60)
    ready()
    out["import"] = cricheck.import_test_image(work, sock)
else:
    import criocheck
    crio = criocheck.CrioDaemon(os.path.join(work, "crio"), configured="/etc/crio/crio.conf.d/10-node.conf")
    sock, starts, watched = crio.socket, crio.starts, ["/etc/crio", "/etc/containers"]
    def ready():
        deadline = time.monotonic() + 60
        while restart.serving(sock) is None:
            assert time.monotonic() < deadline, crio.log()
            time.sleep(0.1)
    def pod(phase):
        return crio.run_pod({phase: ({"NVIDIA_VISIBLE_DEVICES": "1"}, ["sh", "-c", "nvidia-smi -L"])})[phase][0]
    stop = crio.stop
def toolkit(*args):
    return run("chroot", image, bundle_launcher, "--config", hook_config, "toolkit", *args)
def started():
    with open(starts) as f:
        return len(f.read().split())
try:
    out["tree_before"] = {p: hookcheck.tree(p, contents=True) for p in watched}
    out["before"] = pod("before")
    # auto finds no systemd here: install writes, then fails to restart; the next install, which
    # has nothing to write, still owes that restart, and makes it.
    out["install_auto"] = toolkit("install", "--runtime", runtime)
    out["starts_auto"] = started()
    out["install"] = toolkit("install", "--runtime", runtime, "--restart", "signal")
    out["starts_installed"] = started()
    ready()
    out["installed"] = pod("installed")
    out["again"] = toolkit("install", "--runtime", runtime, "--restart", "signal")
    out["starts_again"] = started()
    out["uninstall"] = toolkit("uninstall", "--restart", "signal")
    out["starts_uninstalled"] = started()
    ready()
    out["uninstalled"] = pod("uninstalled")
    out["tree_after"] = {p: hookcheck.tree(p, contents=True) for p in watched}
    out["left"] = [p for p in ("/usr/local/libexec/oci-gpu-hook", "/var/lib/oci-gpu-hook") if os.path.lexists(p)]
finally:
    stop()
print(json.dumps(out))
"""


@pytest.mark.parametrize("runtime", ["containerd", "crio"])
def test_the_toolkit_installs_restarts_and_uninstalls(runtime, simulated_host, tmp_path, require):
    require("root", "unshare", "chroot", "runc", "busybox", "gcc",
            *(("containerd", "ctr") if runtime == "containerd" else ("podman", "conmon")))  # fmt: skip
    host = simulated_host(gpus=4)
    hook_config = config_with(host, tmp_path, "")
    out = build(tmp_path / "image.tar", tmp_path / "build")
    assert out.returncode == 0, out.stderr
    layer(tmp_path / "image.tar").extractall(tmp_path / "image-layer")
    top = image_bundle(str(tmp_path / "image-layer"))
    here = bundle.directory(os.path.basename(top))
    image = str(tmp_path / "image")  # the image root: the bundle alone, and where the pod's mounts go
    shutil.copytree(top, image + here, symlinks=True)
    for directory in ("host", "proc", "dev"):
        os.mkdir(os.path.join(image, directory))
    # Short, under /var/tmp: podman refuses a run root of over 50 characters (CRI-O's store).
    work = tempfile.mkdtemp(prefix="oci-gpu-hook-tk-", dir="/var/tmp")
    try:
        name = f"toolkit-{runtime}"
        args = [runtime, work, hook_config, cricheck.cgroup_parent(name), TESTS, image, f"{here}/{bundle.LAUNCHER}"]
        stdout = cricheck.run_as_a_host(work, name, INSIDE, args, containerd=runtime == "containerd")
        out = json.loads(stdout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    diagnostics = json.dumps({k: v for k, v in out.items() if not k.startswith("tree_")}, indent=1)
    assert listed_uuids(out["before"]) == [], diagnostics
    # The first install (restart auto, the default): written, and the restart refused in one line.
    failed = out["install_auto"]
    assert failed["rc"] != 0 and failed["stdout"] == "" and out["starts_auto"] == 1, diagnostics
    said = "is not a systemd service: restart it yourself to read what install changed (or --restart signal"
    assert said in failed["stderr"] and len(failed["stderr"].splitlines()) == 1, diagnostics
    # Installed: the restart it owed made, once; exactly GPU 1 through the link.
    lines = out["install"]["stdout"].splitlines()
    assert out["install"]["rc"] == 0 and [line for line in lines if line.startswith("wrote ")] == [], diagnostics
    assert [line for line in lines if line.startswith(f"restarted {runtime}: pid ")], diagnostics
    assert out["starts_installed"] == 2, diagnostics
    # No systemd runs this host: the units are not started, and nothing is left for a user to type.
    assert f"systemd does not run this host: {install.PATH_UNIT} {install.SERVICE}" in "\n".join(lines), diagnostics
    assert not [line for line in lines if line.startswith("then:")], diagnostics
    assert listed_uuids(out["installed"]) == [host["gpus"][1]["uuid"]], diagnostics
    # Again: nothing to do, no restart.
    assert out["again"]["rc"] == 0 and out["again"]["stdout"] == "nothing to do: already installed\n", diagnostics
    assert out["starts_again"] == 2, diagnostics
    # Uninstalled: restarted once more, between the configuration and the programs; no GPU; the
    # runtime's configuration as it was; nothing of ours left.
    lines = out["uninstall"]["stdout"].splitlines()
    assert out["uninstall"]["rc"] == 0 and out["starts_uninstalled"] == 3, diagnostics
    restarted = next(i for i, line in enumerate(lines) if line.startswith(f"restarted {runtime}: pid "))
    taken_back = install.RUNTIME_FILES[runtime][-1]
    assert lines.index(f"removed {launcher.LAUNCHER}") > restarted > lines.index(f"removed {taken_back}"), diagnostics
    assert listed_uuids(out["uninstalled"]) == [], diagnostics
    assert out["tree_after"] == out["tree_before"] and out["left"] == [], diagnostics
