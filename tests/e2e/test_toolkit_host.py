"""The node image's toolkit puts the hook on a host with containerd, as the cluster will run it
(issue 47): `oci-gpu-hook toolkit install --runtime containerd`, run from the image's bundle in a
chroot of an image root, the host's root at its /host. No `install` is typed on the host and no
Python of the host's is used: the bundle is copied onto the host and runs there.

The host is this machine in a mount namespace of the test's own, whose /etc, /usr/local and
/var/lib are overlays (tests/cricheck.py's config.toml keeps containerd's state under the test's
directory). containerd runs with no flag, under a supervisor that starts it again when it exits
(as systemd's Restart= would; the toolkit's --restart signal is for such hosts).
- Before: a CRI container asking for GPU 1 gets none.
- toolkit install: containerd is restarted once, and the same container gets exactly GPU 1,
  through the link to the bundle's pre-filter.
- toolkit install again: nothing changes, and containerd is not restarted.
- toolkit uninstall: containerd is restarted once more, after its configuration is taken back
  and before the programs go; the container gets no GPU again; /etc/containerd is byte for byte
  as before, and nothing of ours is left under /usr/local or /var/lib.
"""

from __future__ import annotations

import json
import os
import shutil

import cricheck
import kubeletcheck
from hookcheck import config_with, listed_uuids
from imagecheck import build, image_bundle, layer

from oci_gpu_hook.toolkit import bundle, launcher

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

INSIDE = r"""
import json, os, subprocess, sys, time
work, hook_config, crictl, parent, tests, image, bundle_launcher = sys.argv[1:8]
sys.path.insert(0, tests)
import cricheck, hookcheck
from cricheck import run
from oci_gpu_hook.toolkit import restart
out = {}
sock = os.path.join(work, "containerd.sock")
starts = os.path.join(work, "starts")
supervisor = subprocess.Popen(["sh", "-c", 'while [ ! -e "$1/stop" ]; do echo start >> "$1/starts"; '
                               'containerd >> "$1/containerd.log" 2>&1; done', "sh", work], stdin=subprocess.DEVNULL)
# The node pod's view: the image's root, the host's at /host (recursively, as a hostPath), /proc, /dev.
for argv in (["mount", "--rbind", "/", image + "/host"], ["mount", "-t", "proc", "proc", image + "/proc"],
             ["mount", "--rbind", "/dev", image + "/dev"]):
    subprocess.run(argv, check=True)
def toolkit(*args):
    return run("chroot", image, bundle_launcher, "--config", hook_config, "toolkit", *args)
def started():
    with open(starts) as f:
        return len(f.read().split())
try:
    cricheck.wait_for_containerd(sock)
    out["import"] = cricheck.import_test_image(work, sock)
    out["tree_before"] = hookcheck.tree("/etc/containerd", contents=True)
    out["before"] = cricheck.gpu_pod(work, crictl, sock, parent, "before")
    out["install"] = toolkit("install", "--runtime", "containerd", "--restart", "signal")
    out["starts_installed"] = started()
    cricheck.wait_for_containerd(sock)
    out["installed"] = cricheck.gpu_pod(work, crictl, sock, parent, "installed")
    out["again"] = toolkit("install", "--runtime", "containerd", "--restart", "signal")
    out["starts_again"] = started()
    out["uninstall"] = toolkit("uninstall", "--restart", "signal")
    out["starts_uninstalled"] = started()
    cricheck.wait_for_containerd(sock)
    out["uninstalled"] = cricheck.gpu_pod(work, crictl, sock, parent, "uninstalled")
    out["tree_after"] = hookcheck.tree("/etc/containerd", contents=True)
    out["left"] = [p for p in ("/usr/local/libexec/oci-gpu-hook", "/var/lib/oci-gpu-hook") if os.path.lexists(p)]
finally:
    open(os.path.join(work, "stop"), "w").close()
    pid = restart.serving(sock)
    if pid is not None:
        os.kill(pid, 15)
    supervisor.wait(60)
print(json.dumps(out))
"""


def test_the_toolkit_installs_restarts_and_uninstalls_on_a_containerd_host(simulated_host, tmp_path, require):
    require("root", "unshare", "chroot", "containerd", "ctr", "runc", "busybox", "gcc")
    crictl = os.path.join(kubeletcheck.shared_tool("crio"), "crictl")
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
    work = str(tmp_path / "ctd")
    os.makedirs(work)
    parent = cricheck.cgroup_parent("toolkit-host")
    args = [work, hook_config, crictl, parent, TESTS, image, f"{here}/{bundle.LAUNCHER}"]
    stdout = cricheck.run_as_a_containerd_host(work, "toolkit-host", INSIDE, args)
    out = json.loads(stdout)
    diagnostics = json.dumps({k: v for k, v in out.items() if not k.startswith("tree_")}, indent=1)
    with open(os.path.join(work, "containerd.log")) as f:
        diagnostics += "\ncontainerd.log:\n" + f.read()[-4000:]
    assert out["import"]["rc"] == 0, diagnostics
    for got in (out["before"], out["installed"], out["uninstalled"]):
        assert all(got[step]["rc"] == 0 for step in ("runp", "create", "start", "rmp")), diagnostics
    assert "hooks" not in out["before"]["spec"] and listed_uuids(out["before"]["log"]) == [], diagnostics
    # Installed: the bundle placed, containerd restarted once, exactly GPU 1 through the link.
    lines = out["install"]["stdout"].splitlines()
    assert out["install"]["rc"] == 0 and lines[0] == f"wrote /host{here}", diagnostics
    assert [line for line in lines if line.startswith("restarted containerd: pid ")], diagnostics
    assert out["starts_installed"] == 2, diagnostics
    (hook,) = out["installed"]["spec"]["hooks"]["prestart"]
    assert hook["path"] == launcher.LAUNCHER and hook["args"][-1] == "prestart", diagnostics
    assert listed_uuids(out["installed"]["log"]) == [host["gpus"][1]["uuid"]], diagnostics
    # Again: nothing to do, no restart.
    assert out["again"]["rc"] == 0 and out["again"]["stdout"] == "nothing to do: already installed\n", diagnostics
    assert out["starts_again"] == 2, diagnostics
    # Uninstalled: restarted once more; no GPU; /etc/containerd as it was; nothing of ours left.
    lines = out["uninstall"]["stdout"].splitlines()
    assert out["uninstall"]["rc"] == 0 and out["starts_uninstalled"] == 3, diagnostics
    restarted = next(i for i, line in enumerate(lines) if line.startswith("restarted containerd: pid "))
    assert lines.index(f"removed {launcher.LAUNCHER}") > restarted > lines.index(
        "removed /etc/containerd/oci-gpu-hook-base-spec.json"), diagnostics  # fmt: skip
    assert "hooks" not in out["uninstalled"]["spec"] and listed_uuids(out["uninstalled"]["log"]) == [], diagnostics
    assert out["tree_after"] == out["tree_before"] and out["left"] == [], diagnostics
