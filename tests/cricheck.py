"""containerd as users run it, and one CRI pod through it, for the tests that wire the hook into it
themselves (tests/e2e/test_containerd_install.py: `install`; tests/e2e/test_toolkit_host.py: the
node image's toolkit). Imported by the scripts those tests run inside their namespaces (tests/ on
sys.path)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import kubeletcheck

from oci_gpu_hook.toolkit import containerd

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


def run_as_a_host(work: str, name: str, script: str, args, timeout: float = 600, containerd: bool = True) -> str:
    """Run the Python script (with args after it) in a mount namespace of its own, as root on a
    host of the test's own: /etc, /usr/local, /usr/share and /var/lib are overlays whose upper
    layers are on a tmpfs under work (/usr/share: CRI-O makes its default hooks directory,
    /usr/share/containers/oci/hooks.d, where there is none); containerd: /etc/containerd/config.toml
    is user_config(work). Its processes run in a cgroup of the test's own, cgroup_parent(name)
    (hostcheck.Footprint), killed and checked when it ends. Returns what it printed; asserts it
    succeeded."""
    import sys

    import hostcheck

    upper = os.path.join(work, "overlays")
    os.makedirs(upper)
    with open(os.path.join(work, "user-config.toml"), "w") as f:
        f.write(user_config(work))
    setup = f'mount -t tmpfs -o mode=0755 oci-gpu-hook-test "{upper}" && '
    for d in ("/etc", "/usr/local", "/usr/share", "/var/lib"):
        setup += (f'mkdir -p "{upper}/u{d}" "{upper}/w{d}" && mount -t overlay oci-gpu-hook-test '
                  f'-o "lowerdir={d},upperdir={upper}/u{d},workdir={upper}/w{d}" {d} && ')  # fmt: skip
    if containerd:
        setup += f'mkdir -p /etc/containerd && cp "{work}/user-config.toml" /etc/containerd/config.toml && '
    footprint = hostcheck.Footprint(name, directories=[work])
    footprint.own_cgroup_parent(cgroup_parent(name))
    try:
        proc = footprint.popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                setup + 'exec "$0" -I -c "$@"', sys.executable, script, *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        footprint.close()
    assert proc.returncode == 0, stdout + stderr
    return stdout


def cgroup_parent(name: str) -> str:
    """The cgroup parent run_as_a_host's processes (and the pods they start) run under."""
    return f"ocigpu-{name}-{os.getpid()}"


def run(*argv) -> dict:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=120)
    return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}


def ctr(sock: str) -> list:
    return ["ctr", "--address", sock, "--namespace", "k8s.io"]


def wait_for_containerd(sock: str, daemon=None, timeout: float = 60) -> None:
    """Until containerd serves sock (daemon: its process, which must not have exited)."""
    deadline = time.monotonic() + timeout
    while run(*ctr(sock), "version")["rc"] != 0:
        assert (daemon is None or daemon.poll() is None) and time.monotonic() < deadline, "containerd did not serve"
        time.sleep(0.2)


def import_test_image(work: str, sock: str) -> dict:
    archive = kubeletcheck.write_image_archive(os.path.join(work, "image.tar"), work)
    return run(*ctr(sock), "images", "import", archive)


def gpu_pod(work: str, crictl: str, sock: str, parent: str, phase: str) -> dict:
    """One pod through containerd's CRI whose container asks for GPU 1 and lists its GPUs: each
    step's result, what the container printed ("log") and the spec containerd gave it ("spec")."""

    def cri(*args):
        return run(crictl, "-r", "unix://" + sock, "-i", "unix://" + sock, *args)

    got = {}
    logs = os.path.join(work, "pods-" + phase)
    sandbox = {
        "metadata": {"name": "gpu-pod", "namespace": "team", "uid": "uid-" + phase},
        "log_directory": logs,
        "linux": {"cgroup_parent": "/" + parent, "security_context": {"namespace_options": {"network": 2}}},
    }
    spec = {"metadata": {"name": "main"}, "image": {"image": kubeletcheck.IMAGE},
            "command": ["sh", "-c", "nvidia-smi -L"],
            "envs": [{"key": "NVIDIA_VISIBLE_DEVICES", "value": "1"}], "log_path": "main.log"}  # fmt: skip
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
    while (cri("inspect", "-o", "go-template", "--template", "{{.status.state}}", cid)["stdout"].strip()
           != "CONTAINER_EXITED" and time.monotonic() < deadline):  # fmt: skip
        time.sleep(0.2)
    path = os.path.join(logs, "main.log")
    got["log"] = kubeletcheck.cri_log(path) if os.path.exists(path) else ""
    got["spec"] = json.loads(run(*ctr(sock), "containers", "info", cid)["stdout"] or "{}").get("Spec", {})
    cri("stopp", pod_id)
    got["rmp"] = cri("rmp", "-f", pod_id)
    return got
