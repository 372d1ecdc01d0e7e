"""Debian's containerd with the hook wired by `oci-gpu-hook install --runtime containerd`, as a user
wires it: a CRI container (crictl, the CRI's own client, in place of a kubelet) asking for
NVIDIA_VISIBLE_DEVICES=1 gets no GPU before install, exactly GPU 1 of a simulated host once install
has run and containerd restarted, and none again after uninstall; doctor's verdict agrees each time.

All of it runs in a mount namespace of the test's own whose /etc, /usr/local and /var/lib are
writable overlays (their upper layers on a tmpfs of its own): install writes the real paths, and
containerd starts with no flag at all, reading the default /etc/containerd/config.toml (the
administrators' file, which keeps containerd's root, state and socket under the test's directory,
as users' own files may). Then uninstall leaves /etc/containerd byte for byte as it was. The
namespace's processes run in a cgroup of the test's own (hostcheck.Footprint), killed and
checked when it ends."""

from __future__ import annotations

import json
import os

import cricheck
import kubeletcheck
from hookcheck import config_with, listed_uuids

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Inside the namespace, three times (before install, installed, uninstalled): doctor, then
# containerd (no flags) and one pod whose container asks for GPU 1; containerd restarted between.
INSIDE = r"""
import json, os, subprocess, sys, time
work, hook_config, crictl, parent, tests = sys.argv[1:6]
sys.path.insert(0, tests)
import cricheck, hookcheck
from cricheck import run
cli, out = [sys.executable, "-I", "-m", "oci_gpu_hook"], {}
sock = os.path.join(work, "containerd.sock")
def pod(phase):
    # containerd as the user starts it, one pod, containerd stopped: what the container printed.
    got = {"doctor": run(*cli, "--config", hook_config, "doctor")}
    log = open(os.path.join(work, "containerd.log"), "ab")
    daemon = subprocess.Popen(["containerd"], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        cricheck.wait_for_containerd(sock, daemon)
        if phase == "before":
            got["import"] = cricheck.import_test_image(work, sock)
        got.update(cricheck.gpu_pod(work, crictl, sock, parent, phase))
    finally:
        daemon.terminate()
        daemon.wait(30)
    return got
out["tree_before"] = hookcheck.tree("/etc/containerd", contents=True)
out["before"] = pod("before")
out["install"] = run(*cli, "--config", hook_config, "install", "--runtime", "containerd", "--no-prefilter")
out["installed"] = pod("installed")
out["uninstall"] = run(*cli, "uninstall")
out["tree_after"] = hookcheck.tree("/etc/containerd", contents=True)
out["uninstalled"] = pod("uninstalled")
print(json.dumps(out))
"""


def doctor_line(result) -> str:
    lines = [line for line in result["stdout"].splitlines() if line.split()[1:2] == ["containerd"]]
    assert len(lines) == 1, result
    return lines[0]


def test_a_cri_container_gets_exactly_its_gpu_through_what_install_wrote(simulated_host, tmp_path, require):
    require("root", "unshare", "containerd", "ctr", "runc", "busybox", "gcc")
    crictl = os.path.join(kubeletcheck.shared_tool("crio"), "crictl")
    host = simulated_host(gpus=4)
    hook_config = config_with(host, tmp_path, "")
    work = str(tmp_path / "ctd")
    os.makedirs(work)
    parent = cricheck.cgroup_parent("containerd-install")
    stdout = cricheck.run_as_a_host(work, "containerd-install", INSIDE,
                                               [work, hook_config, crictl, parent, TESTS], timeout=400)  # fmt: skip
    out = json.loads(stdout)
    diagnostics = json.dumps({k: v for k, v in out.items() if not k.startswith("tree_")}, indent=1)
    with open(os.path.join(work, "containerd.log")) as f:
        diagnostics += "\ncontainerd.log:\n" + f.read()[-4000:]
    before, installed, uninstalled = out["before"], out["installed"], out["uninstalled"]
    assert before["import"]["rc"] == 0, diagnostics
    for got in (before, installed, uninstalled):
        assert all(got[step]["rc"] == 0 for step in ("runp", "create", "start", "rmp")), diagnostics
    # Before: no hook in the container's spec, no GPU, and doctor says FAIL.
    assert "hooks" not in before["spec"] and listed_uuids(before["log"]) == [], diagnostics
    assert doctor_line(before["doctor"]).startswith("FAIL"), diagnostics
    # Installed, containerd restarted: our prestart hook, exactly GPU 1, and doctor says PASS.
    assert out["install"]["rc"] == 0, diagnostics
    assert [h["args"][-1] for h in installed["spec"]["hooks"]["prestart"]] == ["prestart"], diagnostics
    assert listed_uuids(installed["log"]) == [host["gpus"][1]["uuid"]], diagnostics
    assert doctor_line(installed["doctor"]).startswith("PASS"), diagnostics
    # Uninstalled: /etc/containerd byte for byte as it was; no GPU again, and doctor says FAIL.
    assert out["uninstall"]["rc"] == 0 and out["tree_after"] == out["tree_before"], diagnostics
    assert "hooks" not in uninstalled["spec"] and listed_uuids(uninstalled["log"]) == [], diagnostics
    assert doctor_line(uninstalled["doctor"]).startswith("FAIL"), diagnostics
