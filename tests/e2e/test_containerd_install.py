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
import subprocess
import sys

import hostcheck
import kubeletcheck
from hookcheck import config_with, listed_uuids

from oci_gpu_hook.toolkit import containerd

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRI = containerd.CRI


def user_config(work: str) -> str:
    """The administrators' config.toml: containerd's state under work, no CNI (host-network pods),
    the test image as the sandbox image; no base_runtime_spec (install adds it)."""

    def q(*parts):
        return json.dumps(os.path.join(work, *parts))

    return "\n".join([
        "version = 2",
        f"root = {q('root')}",
        f"state = {q('state')}",
        'disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",'
        ' "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]',
        "[grpc]",
        f"address = {q('containerd.sock')}",
        "[ttrpc]",
        f"address = {q('containerd.sock.ttrpc')}",
        '[plugins."io.containerd.internal.v1.opt"]',
        f"path = {q('opt')}",
        f'[plugins."{CRI}"]',
        f"sandbox_image = {json.dumps(kubeletcheck.IMAGE)}",
        "restrict_oom_score_adj = true",
        "disable_apparmor = true",
        'stream_server_address = "127.0.0.1"',
        'stream_server_port = "0"',
        f'[plugins."{CRI}".cni]',
        f"bin_dir = {q('cni', 'bin')}",
        f"conf_dir = {q('cni', 'conf')}",
        f'[plugins."{CRI}".containerd.runtimes.runc]',
        'runtime_type = "io.containerd.runc.v2"',
        f'[plugins."{CRI}".containerd.runtimes.runc.options]',
        f"Root = {q('runc')}",
        "",
    ])  # fmt: skip


# Inside the namespace, three times (before install, installed, uninstalled): doctor, then
# containerd (no flags) and one pod whose container asks for GPU 1; containerd restarted between.
INSIDE = r"""
import json, os, subprocess, sys, time
work, hook_config, crictl, parent, tests = sys.argv[1:6]
sys.path.insert(0, tests)
import hookcheck, kubeletcheck
cli, out = [sys.executable, "-I", "-m", "oci_gpu_hook"], {}
def run(*argv):
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=120)
    return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
sock = os.path.join(work, "containerd.sock")
ctr = ["ctr", "--address", sock, "--namespace", "k8s.io"]
def cri(*args):
    return run(crictl, "-r", "unix://" + sock, "-i", "unix://" + sock, *args)
def pod(phase):
    # containerd as the user starts it, one pod, containerd stopped: what the container printed.
    got = {"doctor": run(*cli, "--config", hook_config, "doctor")}
    log = open(os.path.join(work, "containerd.log"), "ab")
    daemon = subprocess.Popen(["containerd"], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while run(*ctr, "version")["rc"] != 0:
            assert daemon.poll() is None and time.monotonic() < deadline, "containerd did not serve"
            time.sleep(0.2)
        if phase == "before":
            archive = kubeletcheck.write_image_archive(os.path.join(work, "image.tar"), work)
            got["import"] = run(*ctr, "images", "import", archive)
        logs = os.path.join(work, "pods-" + phase)
        sandbox = {"metadata": {"name": "gpu-pod", "namespace": "team", "uid": "uid-" + phase}, "log_directory": logs,
                   "linux": {"cgroup_parent": "/" + parent,
                             "security_context": {"namespace_options": {"network": 2}}}}
        spec = {"metadata": {"name": "main"}, "image": {"image": kubeletcheck.IMAGE},
                "command": ["sh", "-c", "nvidia-smi -L"],
                "envs": [{"key": "NVIDIA_VISIBLE_DEVICES", "value": "1"}], "log_path": "main.log"}
        files = []
        for name, doc in (("pod", sandbox), ("ctr", spec)):
            files.append(os.path.join(work, name + "-" + phase + ".json"))
            with open(files[-1], "w") as f:
                json.dump(doc, f)
        got["runp"] = cri("runp", files[0])
        pod_id = got["runp"]["stdout"].strip()
        got["create"] = cri("create", pod_id, files[1], files[0])
        cid = got["create"]["stdout"].strip()
        got["start"] = cri("start", cid)
        deadline = time.monotonic() + 60
        while cri("inspect", "-o", "go-template", "--template", "{{.status.state}}", cid)["stdout"].strip() \
                != "CONTAINER_EXITED" and time.monotonic() < deadline:
            time.sleep(0.2)
        path = os.path.join(logs, "main.log")
        got["log"] = kubeletcheck.cri_log(path) if os.path.exists(path) else ""
        got["spec"] = json.loads(run(*ctr, "containers", "info", cid)["stdout"] or "{}").get("Spec", {})
        cri("stopp", pod_id)
        got["rmp"] = cri("rmp", "-f", pod_id)
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
    upper = os.path.join(work, "overlays")
    os.makedirs(upper)
    parent = f"ocigpu-containerd-{os.getpid()}"
    with open(os.path.join(work, "user-config.toml"), "w") as f:
        f.write(user_config(work))
    setup = f'mount -t tmpfs -o mode=0755 oci-gpu-hook-test "{upper}" && '
    for d in ("/etc", "/usr/local", "/var/lib"):
        setup += (f'mkdir -p "{upper}/u{d}" "{upper}/w{d}" && mount -t overlay oci-gpu-hook-test '
                  f'-o "lowerdir={d},upperdir={upper}/u{d},workdir={upper}/w{d}" {d} && ')  # fmt: skip
    setup += f'mkdir -p /etc/containerd && cp "{work}/user-config.toml" /etc/containerd/config.toml && '
    footprint = hostcheck.Footprint("containerd-install", directories=[work])
    footprint.own_cgroup_parent(parent)
    try:
        proc = footprint.popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                setup + 'exec "$0" -I -c "$@"', sys.executable, INSIDE, work, hook_config, crictl,
                                parent, TESTS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        footprint.close()
    assert proc.returncode == 0, stdout + stderr
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
