"""Docker's `--gpus` with the hook, end to end: a real dockerd (Debian's docker.io) started here.

dockerd registers GPU support when it finds `nvidia-container-runtime-hook` on its PATH at start;
`oci-gpu-hook install --runtime docker` writes that program (here under a --root of the test's own,
put first on dockerd's PATH). The daemon gets its own socket, data root, exec root, pid file and
cgroup parent, the vfs storage driver, and no iptables, masquerading or bridge. Afterwards it is
stopped by pid, and what it changed on the host is put back: /etc/docker (its trust key), the
net sysctls it sets (ip_forward) and its cgroups.
"""

import os
import re
import signal
import subprocess
import time

import pytest
from hookcheck import remove_cgroup

from oci_gpu_hook.toolkit import containers, install

DOCKERD = "/usr/sbin/dockerd"
DOCKER = "/usr/bin/docker"  # Debian's client, the daemon's own version (not another on the PATH)
SYSCTL_DIRS = ("/proc/sys/net/ipv4", "/proc/sys/net/ipv6/conf/all", "/proc/sys/net/ipv6/conf/default",
               "/proc/sys/net/bridge")  # fmt: skip


def sysctls() -> dict:
    """Every writable setting under the directories dockerd touches, by path."""
    found = {}
    for directory in SYSCTL_DIRS:
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if os.path.isfile(path) and os.stat(path).st_mode & 0o200:
                try:
                    with open(path) as f:
                        found[path] = f.read()
                except OSError:
                    pass
    return found


def cgroup_dirs(name: str) -> list:
    """The cgroup name in every hierarchy: /sys/fs/cgroup/<controller>/name (v1, hybrid) and
    /sys/fs/cgroup/name (pure v2)."""
    paths = [os.path.join("/sys/fs/cgroup", name)] + [os.path.join(d.path, name) for d in os.scandir("/sys/fs/cgroup")]
    return [p for p in paths if os.path.isdir(p)]


class Docker:
    def __init__(self, work: str):
        self.work = work
        self.socket = os.path.join(work, "docker.sock")
        self.env = {"DOCKER_CONFIG": os.path.join(work, "client"), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}

    def __call__(self, *args, timeout=180, check=False, **kwargs):
        stdin = kwargs.pop("stdin", subprocess.DEVNULL)
        out = subprocess.run([DOCKER, "-H", f"unix://{self.socket}", *args], capture_output=True, text=True,
                             timeout=timeout, env=self.env, stdin=stdin, **kwargs)  # fmt: skip
        if check:
            assert out.returncode == 0, out.stderr
        return out

    def run(self, gpus, script, image):
        args = ["run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
        if gpus is not None:
            args += ["--gpus", gpus]
        return self(*args, image, "sh", "-c", script)


@pytest.fixture(scope="module")
def docker(simulated_host, require, tmp_path_factory):
    require("root", "runc", "busybox", "gcc", "dockerd", "docker")
    host = simulated_host(gpus=4, mig=[2])
    work = str(tmp_path_factory.mktemp("docker"))
    root = os.path.join(work, "root")
    os.mkdir(root)
    prefix = containers.hook_command(f"{host['root']}/config.yaml")
    assert install.install(root, ("docker",), prefix)
    program_dir = os.path.join(root, "usr/bin")
    assert os.listdir(program_dir) == ["nvidia-container-runtime-hook"]

    etc_docker_existed = os.path.exists("/etc/docker")
    # Fixed paths dockerd and its containerd shims use whatever their roots: the plugin socket
    # directory and the shims' socket directory.
    run_dirs_existed = {d: os.path.exists(d) for d in ("/run/docker", "/run/containerd")}
    key_existed = os.path.exists("/etc/docker/key.json")
    settings_before = sysctls()
    parent = f"ocigpu-docker-{os.getpid()}"
    assert not cgroup_dirs(parent)
    pidfile = os.path.join(work, "docker.pid")
    log = open(os.path.join(work, "dockerd.log"), "w")
    with open(f"{work}/daemon.json", "w") as f:  # before dockerd reads it
        f.write("{}\n")
    daemon = subprocess.Popen(
        [DOCKERD, "--host", f"unix://{work}/docker.sock", "--data-root", f"{work}/data", "--exec-root",
         f"{work}/exec", "--pidfile", pidfile, "--iptables=false", "--ip-masq=false", "--bridge=none",
         "--storage-driver=vfs", f"--cgroup-parent=/{parent}", "--config-file", f"{work}/daemon.json"],
        env={"PATH": f"{program_dir}:/usr/sbin:/usr/bin:/sbin:/bin"}, stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    client = Docker(work)
    try:
        deadline = time.monotonic() + 90
        while client("version", timeout=30).returncode != 0:  # ready when it answers
            assert daemon.poll() is None, open(log.name).read()[-3000:]
            assert time.monotonic() < deadline, open(log.name).read()[-3000:]
            time.sleep(0.2)
        rootfs = containers.make_rootfs(os.path.join(work, "rootfs"))
        tar = subprocess.Popen(["tar", "-C", rootfs, "-cf", "-", "."], stdout=subprocess.PIPE)
        client("import", "-", "localhost/ocigpu-docker:test", stdin=tar.stdout, check=True)
        assert tar.wait() == 0
        yield client, host, "localhost/ocigpu-docker:test"
    finally:
        client("rmi", "-f", "localhost/ocigpu-docker:test")
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()
        # What dockerd changed on the host, put back.
        for path, value in settings_before.items():
            with open(path) as f:
                now = f.read()
            if now != value:
                with open(path, "w") as f:
                    f.write(value)
        if not key_existed and os.path.exists("/etc/docker/key.json"):
            os.unlink("/etc/docker/key.json")
        if not etc_docker_existed and os.path.isdir("/etc/docker") and not os.listdir("/etc/docker"):
            os.rmdir("/etc/docker")
        subprocess.run(["rm", "-rf", "--one-file-system", f"{work}/data", f"{work}/exec"], check=False)
        for directory, existed in run_dirs_existed.items():
            if not existed:
                subprocess.run(["rm", "-rf", "--one-file-system", directory], check=False)
        # Last: a cgroup the kernel keeps busy for a moment must not stop the steps above.
        for directory in sorted(cgroup_dirs(parent), key=len, reverse=True):
            for sub in sorted((e.path for e in os.scandir(directory) if e.is_dir()), reverse=True):
                remove_cgroup(sub)
            remove_cgroup(directory)
        assert sysctls() == settings_before
        assert not cgroup_dirs(parent)


def uuids(stdout):
    return re.findall(r"UUID: ((?:GPU|MIG)-[0-9a-f-]+)\)", stdout)


def all_uuids(host):
    return [u for g in host["gpus"] for u in [g["uuid"]] + [m["uuid"] for m in g["mig"]]]


CASES = {
    # name: (--gpus value, the UUIDs nvidia-smi must list)
    "all": (lambda h: "all", all_uuids),
    "count 2": (lambda h: "2", lambda h: [h["gpus"][0]["uuid"], h["gpus"][1]["uuid"]]),
    "device=1,3": (lambda h: '"device=1,3"', lambda h: [h["gpus"][1]["uuid"], h["gpus"][3]["uuid"]]),
    "uuid": (lambda h: f"device={h['gpus'][3]['uuid']}", lambda h: [h["gpus"][3]["uuid"]]),
    "mig uuid": (lambda h: f"device={h['gpus'][2]['mig'][1]['uuid']}",
                 lambda h: [h["gpus"][2]["uuid"], h["gpus"][2]["mig"][1]["uuid"]]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_gpus_flag(docker, case):
    client, host, image = docker
    gpus, expected = CASES[case]
    out = client.run(gpus(host), "nvidia-smi -L; echo VISIBLE=$NVIDIA_VISIBLE_DEVICES", image)
    assert out.returncode == 0, out.stderr
    assert uuids(out.stdout) == expected(host)
    # Only the chosen GPUs' nodes are in the container.
    nodes = client.run(gpus(host), "ls /dev", image).stdout.split()
    minors = {g["minor"] for g in host["gpus"] if g["uuid"] in expected(host)}
    assert sorted(n for n in nodes if re.fullmatch(r"nvidia\d+", n)) == sorted(f"nvidia{m}" for m in minors)


def test_capabilities_utility_gives_nvidia_smi_but_not_cuda(docker):
    client, host, image = docker
    script = ("echo CAPS=$NVIDIA_DRIVER_CAPABILITIES; nvidia-smi -L >/dev/null && echo SMI-OK; "
              "ls /usr/lib64/libcuda.so.1 2>/dev/null || echo NO-CUDA; ls /dev/nvidia-uvm 2>/dev/null || echo NO-UVM")
    out = client.run("all,capabilities=utility", script, image)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["CAPS=utility", "SMI-OK", "NO-CUDA", "NO-UVM"]


def test_default_capabilities_give_cuda(docker):
    client, host, image = docker
    out = client.run("1", "readlink /usr/lib64/libcuda.so.1; ls /dev/nvidia-uvm", image)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"libcuda.so.{host['driver_version']}", "/dev/nvidia-uvm"]


def test_without_gpus_the_hook_does_not_run(docker):
    client, host, image = docker
    out = client.run(None, "ls /dev; ls /usr/lib64; echo VISIBLE=${NVIDIA_VISIBLE_DEVICES-unset}", image)
    assert out.returncode == 0, out.stderr
    assert "nvidiactl" not in out.stdout and "libcuda" not in out.stdout and "VISIBLE=unset" in out.stdout
