"""A Kubernetes node of the test's own: a real containerd and a real kubelet (standalone: static
pods, no API server), for end-to-end tests of the device plugin and of the hook under Kubernetes.

Every app container gets our prestart hook through containerd's CRI `base_runtime_spec`, as a node
with the hook installed would. The image comes from no registry: a docker archive written here from
busybox-static (containers.make_rootfs) and imported with ctr. The kubelet is the one
../shared/tools/kubelet/build.sh builds (its README holds the facts this module is designed around).

Host side effects are owned and undone by ContainerdKubelet.close(): containerd's root, state,
socket and runc state live under the test's directory; the kubelet's --root-dir too, except what
this kubelet hard-codes (the device-plugin directory, /var/log/pods, kubepods cgroups, six
sysctls). Its processes, mounts and cgroups are what its hostcheck.Footprint holds: the daemons run
in a cgroup of its own (the shims too, however they daemonize), the pods in the kubepods cgroups it
made, the mounts under its directory; they are killed by pid, unmounted without detaching and
removed, and close() raises for any left. Only log entries that were not there before are removed.
Only one node can run at a time: the kubelet's ports and the device-plugin directory are fixed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence

import hostcheck
import pytest
import toolbuild

from oci_gpu_hook.toolkit import containers, install

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# In CI the checkout is a clone whose sibling `shared` is a link to the real one: join, not realpath.

IMAGE = "localhost/oci-gpu-hook-test:1"
# containers.APPLETS plus what pods and the sandbox run (the image's default command is a long sleep,
# so the same image serves as the CRI sandbox image).
IMAGE_APPLETS = containers.APPLETS + ("sleep", "env", "id", "mkdir", "ps", "tail", "printf")
SANDBOX_COMMAND = ["sleep", "1000000000"]

# The device manager hard-codes this (pluginapi.DevicePluginPath), whatever --root-dir says: the
# plugin's socket and the kubelet's kubelet.sock and checkpoint are always here.
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
DEVICE_CHECKPOINT = "kubelet_internal_checkpoint"
# The pod log directory is a config-file setting only (podLogsDir), and this kubelet ignores --config.
POD_LOGS_DIR = "/var/log/pods"
CONTAINER_LOGS_DIR = "/var/log/containers"
# What the kubelet's setupKernelTunables rewrites on start (vm.overcommit_memory=1, kernel.panic=10, ...).
KUBELET_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")  # fmt: skip
# Annotation prefixes containerd passes from the CRI request into the OCI spec (the hook reads them).
DEFAULT_ANNOTATIONS = ("oci-gpu-hook.io/*", "cdi.k8s.io/*")
NAMESPACE = "default"
CONTAINER = "main"  # the one container of every pod add_pod writes

PROGRAMS = ("containerd", "ctr", "runc", "busybox", "iptables-save", "ip6tables-save")  # the last: hostcheck's chains


def missing(message: str) -> None:
    """A prerequisite is missing: skip, or fail under OCI_GPU_HOOK_REQUIRE_ALL=1 (as conftest's require)."""
    if os.environ.get("OCI_GPU_HOOK_REQUIRE_ALL") == "1":
        pytest.fail(message + " (OCI_GPU_HOOK_REQUIRE_ALL=1)", pytrace=False)
    pytest.skip(message)


def kubelet_binary() -> str:
    """The kubelet's path, built by ../shared/tools/kubelet/build.sh on first use (about 4 minutes on
    2 cores) and cached per machine. A missing tool or program skips (fails under REQUIRE_ALL); a
    build that fails fails the test."""
    absent = [name for name in PROGRAMS if not shutil.which(name)]
    if absent:
        missing(f"needs {', '.join(absent)} for a Kubernetes node, not available here")
    return shared_tool("kubelet")


def containerd17() -> str:
    """The directory of containerd 1.7's programs (Debian 13's package, which applies CDI; Debian
    12's 1.6 does not), fetched by tests/tools/containerd17.sh on first use and cached per machine."""
    return shared_tool("containerd17")


def shared_tool(tool: str) -> str:
    """What ../shared/tools/<tool>'s script prints (the built program, the directory of several, a
    fetched tree), made on first use into its cache (toolbuild.py, which `make test` also runs in
    the background from the start)."""
    script = toolbuild.script(tool)
    if os.geteuid() != 0:
        missing(f"needs root for {tool}")
    if not os.path.exists(script):
        missing(f"{script} is missing (the shared {tool} tools)")
    proc = toolbuild.build(tool)
    made = proc.stdout.split("\n")  # a path a line (several, for a tool that builds several programs)
    if proc.returncode != 0 or not proc.stdout.strip() or not all(os.path.exists(p) for p in made if p):
        pytest.fail(f"{script} failed ({proc.returncode}): {proc.stderr[-3000:]}", pytrace=False)
    return proc.stdout.strip()


# --- the image ------------------------------------------------------------------------------------


def write_image_archive(path: str, workdir: str, name: str = IMAGE) -> str:
    """A docker-archive tarball of a busybox rootfs with the host's glibc (so the simulated
    nvidia-smi runs), its default command a long sleep."""
    rootfs = containers.make_rootfs(os.path.join(workdir, "image-rootfs"))
    for applet in IMAGE_APPLETS:
        # Symlinks, never hard links: a hard-linked applet lost its execute bit in the imported layer.
        link = os.path.join(rootfs, "bin", applet)
        if not os.path.lexists(link):
            os.symlink("busybox", link)
    docker_archive(rootfs, path, name, SANDBOX_COMMAND)
    shutil.rmtree(rootfs)
    return path


def docker_archive(rootfs: str, path: str, name: str, cmd: Sequence[str]) -> str:
    """A docker-archive tarball (manifest.json, the image's config, one layer) of rootfs, files
    owned by root, named name, running cmd: what `ctr images import` and `podman load` take, so
    that no registry is needed. Returns path."""
    import hashlib
    import io
    import platform
    import tarfile

    def as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        for entry in sorted(os.listdir(rootfs)):
            tar.add(os.path.join(rootfs, entry), arcname=entry, filter=as_root)
    layer_bytes = layer.getvalue()
    diff_id = hashlib.sha256(layer_bytes).hexdigest()
    machine = platform.machine()
    config = {
        "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine),
        "os": "linux",
        "config": {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "Cmd": list(cmd), "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
        "history": [{"created_by": "tests/kubeletcheck.py docker_archive"}],
    }
    config_bytes = json.dumps(config).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": [name], "Layers": [f"{diff_id}/layer.tar"]}]
    with tarfile.open(path, "w") as archive:
        for member, data in ((config_name, config_bytes), (f"{diff_id}/layer.tar", layer_bytes),
                             ("manifest.json", json.dumps(manifest).encode())):  # fmt: skip
            info = tarfile.TarInfo(member)
            info.size = len(data)
            info.mode = 0o644
            archive.addfile(info, io.BytesIO(data))
    return path


# --- host state -----------------------------------------------------------------------------------


def read_sysctls() -> dict[str, str]:
    values = {}
    for name in KUBELET_SYSCTLS:
        with open(f"/proc/sys/{name}") as f:
            values[name] = f.read().strip()
    return values


def write_sysctls(values: dict[str, str]) -> None:
    for name, value in values.items():
        with open(f"/proc/sys/{name}", "w") as f:
            f.write(value)


def _stop(proc: subprocess.Popen | None, timeout: float = 15) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def _identity(path: str):
    """What tells a file from the one it replaced: the inode number alone is reused at once."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as e:
        return f"({e})"


class ContainerdKubelet:
    """containerd and a standalone kubelet, started by start() (or `with`), stopped by close().

    workdir: the test's directory (its path names sockets, so it must stay short: tmp_path is).
    hook_config: the hook's --config for every app container (hookcheck.config_with).
    containerd_bin: the directory of the containerd, ctr and shims to run (containerd17()'s);
    None: the host's, found on PATH (Debian 12's 1.6).
    cdi: turn on containerd's CDI (1.7+), its specs read from cdi_dir (under workdir).
    """

    def __init__(self, workdir, hook_config: str | None, annotations: Sequence[str] = DEFAULT_ANNOTATIONS,
                 read_only_port: int = 10255, node_name: str | None = None, containerd_bin: str | None = None,
                 cdi: bool = False):  # fmt: skip
        self.workdir = os.path.abspath(str(workdir))
        self.hook_config = hook_config
        self.annotations = list(annotations)
        self.read_only_port = read_only_port
        self.node_name = node_name or f"ocigpu-{os.getpid()}"
        self.device_plugin_dir = DEVICE_PLUGIN_DIR
        self.kubelet_socket = os.path.join(DEVICE_PLUGIN_DIR, "kubelet.sock")
        self.containerd_dir = os.path.join(self.workdir, "containerd")
        self.address = os.path.join(self.containerd_dir, "containerd.sock")
        self.runc_root = os.path.join(self.containerd_dir, "runc")
        self.containerd_bin = containerd_bin
        self.cdi_dir = os.path.join(self.workdir, "cdi") if cdi else ""
        self.kubelet_dir = os.path.join(self.workdir, "kubelet")
        self.manifests = os.path.join(self.workdir, "manifests")
        self.containerd_log = self.runtime_log = os.path.join(self.workdir, "containerd.log")
        self.kubelet_log = os.path.join(self.workdir, "kubelet.log")
        self.containerd: subprocess.Popen | None = None
        self.kubelet: subprocess.Popen | None = None
        self._kubelet_argv: list[str] = []
        self._kubelet_log_start = 0  # where the running kubelet's own lines begin in its log
        self._uids: dict[str, str] = {}
        self._before: dict | None = None
        # The kubelet's iptables chains are named KUBE-* (it is told to make none: compared).
        self.footprint = hostcheck.Footprint("kubelet", directories=[self.workdir], chains=("KUBE-",))

    # --- life cycle ----------------------------------------------------------------------------

    def __enter__(self) -> ContainerdKubelet:
        self.start()
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is not None:  # the test's own assertion failed: pytest shows this with it
            sys.stderr.write(self.diagnostics() + "\n")
        self.close()

    def start(self, timeout: float = 60) -> ContainerdKubelet:
        kubelet = self._kubelet_program()
        if len(self.address) > 100:
            raise ValueError(f"{self.workdir}: too long a path for the sockets under it")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", self.read_only_port)) == 0:
                pytest.fail(f"port {self.read_only_port} is in use: a kubelet left running?", pytrace=False)
        # The kubelet's pods go under kubepods, in every hierarchy: its own where it makes it.
        self.footprint.own_cgroup_parent("kubepods", only_new=True)
        self._before = {
            "sysctls": read_sysctls(),
            "pod_logs": set(os.listdir(POD_LOGS_DIR)) if os.path.isdir(POD_LOGS_DIR) else None,
            "container_logs": set(os.listdir(CONTAINER_LOGS_DIR)) if os.path.isdir(CONTAINER_LOGS_DIR) else None,
            "var_lib_kubelet": os.path.exists("/var/lib/kubelet"),
            "device_plugin_dir": os.path.exists(DEVICE_PLUGIN_DIR),
            "run_containerd": os.path.exists("/run/containerd"),
        }
        try:
            # A checkpoint left by an earlier run would keep its devices reserved for pods that are gone.
            self._remove_device_checkpoint()
            for directory in (self.containerd_dir, self.kubelet_dir, self.manifests, self.cdi_dir):
                if directory:
                    os.makedirs(directory, exist_ok=True)
            self._start_runtime(timeout)
            self._kubelet_argv = [kubelet, *self._kubelet_flags()]
            self._start_kubelet(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _start_runtime(self, timeout: float) -> None:
        """containerd, serving, with the image imported."""
        config = os.path.join(self.containerd_dir, "config.toml")
        with open(config, "w") as f:
            f.write(self._containerd_config())
        log = open(self.containerd_log, "ab")
        env = None
        if self.containerd_bin:  # containerd finds its shim (containerd-shim-runc-v2) on PATH
            env = {**os.environ, "PATH": f"{self.containerd_bin}:{os.environ.get('PATH', '')}"}
        self.containerd = self.footprint.popen([self._program("containerd"), "--config", config], stdout=log,
                                               stderr=log, stdin=subprocess.DEVNULL, env=env)  # fmt: skip
        log.close()
        self._wait(lambda: self.ctr("version", check=False).returncode == 0, timeout, "containerd to serve")
        self.ctr("images", "import", write_image_archive(os.path.join(self.workdir, "image.tar"), self.workdir))

    def _daemons(self) -> list:
        """(process, name) of what must keep running while the node waits for something."""
        return [(self.containerd, "containerd"), (self.kubelet, "the kubelet")]

    def _containerd_config(self) -> str:
        spec = os.path.join(self.containerd_dir, "base-spec.json")
        with open(spec, "w") as f:
            json.dump(self.base_runtime_spec(), f, indent=1)
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        return "\n".join([
            "version = 2",
            f"root = {json.dumps(os.path.join(self.containerd_dir, 'root'))}",
            f"state = {json.dumps(os.path.join(self.containerd_dir, 'state'))}",
            # Plugins that would probe or write outside our directories, and that we do not use.
            'disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",'
            ' "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]',
            "[grpc]",
            f"address = {json.dumps(self.address)}",
            "[ttrpc]",
            f"address = {json.dumps(self.address + '.ttrpc')}",
            '[plugins."io.containerd.internal.v1.opt"]',
            f"path = {json.dumps(os.path.join(self.containerd_dir, 'opt'))}",
            f"[{cri}]",
            f"sandbox_image = {json.dumps(IMAGE)}",
            # No CAP_SYS_RESOURCE here: the pause container's negative oom_score_adj would fail runc init.
            "restrict_oom_score_adj = true",
            "disable_apparmor = true",
            'stream_server_address = "127.0.0.1"',
            'stream_server_port = "0"',
            *(["enable_cdi = true", f"cdi_spec_dirs = {json.dumps([self.cdi_dir])}"] if self.cdi_dir else []),
            f"[{cri}.cni]",  # no CNI: pods use the host network; keep it off /etc/cni and /opt/cni
            f"bin_dir = {json.dumps(os.path.join(self.containerd_dir, 'cni', 'bin'))}",
            f"conf_dir = {json.dumps(os.path.join(self.containerd_dir, 'cni', 'conf'))}",
            f"[{cri}.containerd]",
            'snapshotter = "overlayfs"',
            'default_runtime_name = "runc"',
            f"[{cri}.containerd.runtimes.runc]",
            'runtime_type = "io.containerd.runc.v2"',
            f"base_runtime_spec = {json.dumps(spec)}",
            # Device plugin annotations reach the OCI spec only when listed here.
            f"container_annotations = {json.dumps(self.annotations)}",
            f"[{cri}.containerd.runtimes.runc.options]",
            "SystemdCgroup = false",
            # runc's state under our directory, not /run/containerd/runc: close() finds what is left.
            f"Root = {json.dumps(self.runc_root)}",
            "",
        ])  # fmt: skip

    def base_runtime_spec(self) -> dict:
        """containerd's default spec (`ctr oci spec`) with our prestart hook, shaped as
        containers.make_config writes it. containerd 1.6 builds the sandbox (pause) container's spec
        without it, so only app containers get the hook."""
        proc = subprocess.run([self._program("ctr"), "oci", "spec"], capture_output=True, text=True, check=True)
        spec = json.loads(proc.stdout)
        hook_args = containers.hook_command(self.hook_config) + ["prestart"]
        spec["hooks"] = {"prestart": [{"path": hook_args[0], "args": hook_args, "env": list(install.HOOK_ENV),
                                       "timeout": install.HOOK_TIMEOUT}]}  # fmt: skip
        return spec

    def _kubelet_flags(self) -> list[str]:
        # All as flags: this kubelet ignores --config.
        return [
            f"--container-runtime-endpoint=unix://{self.address}",
            f"--hostname-override={self.node_name}",
            "--cgroup-driver=cgroupfs",
            "--fail-swap-on=false",
            f"--pod-manifest-path={self.manifests}",
            "--file-check-frequency=5s",
            "--anonymous-auth=true",
            "--authentication-token-webhook=false",
            "--authorization-mode=AlwaysAllow",
            "--address=127.0.0.1",
            f"--read-only-port={self.read_only_port}",
            "--healthz-bind-address=127.0.0.1",
            "--eviction-hard=memory.available<100Mi,nodefs.available<1%,imagefs.available<1%",
            "--image-gc-high-threshold=100",
            "--image-gc-low-threshold=99",
            # Its state under ours; these two default to /var/lib/kubelet and /usr/libexec whatever --root-dir.
            f"--root-dir={self.kubelet_dir}",
            f"--cert-dir={os.path.join(self.kubelet_dir, 'pki')}",
            f"--volume-plugin-dir={os.path.join(self.kubelet_dir, 'volume-plugins')}",
            "--make-iptables-util-chains=false",  # it would add KUBE-FIREWALL rules to the host's iptables
            "--v=2",  # the device manager's capacity lines (capacity() reads them)
        ]

    def _start_kubelet(self, timeout: float) -> None:
        old_socket = _identity(self.kubelet_socket)
        log = open(self.kubelet_log, "ab")
        self._kubelet_log_start = log.tell()
        self.kubelet = self.footprint.popen(self._kubelet_argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()

        def ready():
            socket_ready = _identity(self.kubelet_socket) not in (None, old_socket)
            return socket_ready and self._kubelet_ready()

        self._wait(ready, timeout, "the kubelet to serve /pods and the device-plugin registration socket")

    def _kubelet_program(self) -> str:
        return kubelet_binary()

    def _kubelet_ready(self) -> bool:
        return self._get("/pods") is not None

    def restart_kubelet(self, timeout: float = 60, pods_when=None) -> None:
        """Stop the kubelet by pid and start it again with the same flags. The new kubelet wipes the
        device-plugin directory (the plugin's socket included); the plugin must register again, and
        capacity() counts from the new kubelet's lines only.

        pods_when: a function that says (True) when the pods may reach the new kubelet. Until then
        the static manifests are held back, then put back unchanged (same paths, so the same pod
        UIDs, and the checkpointed devices are theirs). Why: running pods holding plugin devices
        are admitted again against the devices registered by then, and 1.32's devicesToAllocate
        refuses them ("no healthy devices present") unless the resource is registered and healthy.
        In a cluster the pods come from the API server, and a real kubelet skips that check for
        containers still running while its pod sources are not all seen (the device manager's
        "kubelet restart" case). This fork can get to neither: its PodConfig.SeenAllSources
        returns a flag that NewMainKubelet sets to true before any source is read, and its
        makePodSourceConfig wires only the file source (--manifest-url is parsed, then ignored).
        The pods reach it within a tenth of a second of its start, so without pods_when the test
        would race the plugin. Holding the manifests is safe for well under the kubelet's first
        housekeeping (2 s), which would stop containers that belong to no pod."""
        _stop(self.kubelet)  # first: the running kubelet would stop the pods of manifests that go
        held = []
        if pods_when is not None:
            hold = os.path.join(self.workdir, "manifests-held")
            os.makedirs(hold, exist_ok=True)
            for name in sorted(os.listdir(self.manifests)):
                os.rename(os.path.join(self.manifests, name), os.path.join(hold, name))
                held.append(name)
        try:
            self._start_kubelet(timeout)
            if pods_when is not None:
                deadline = time.monotonic() + timeout
                while not pods_when():
                    if time.monotonic() > deadline:
                        raise AssertionError(f"timed out after {timeout}s waiting to give the kubelet its pods\n"
                                             + self.diagnostics())  # fmt: skip
                    time.sleep(0.01)
        finally:
            for name in held:
                os.rename(os.path.join(self.workdir, "manifests-held", name), os.path.join(self.manifests, name))

    def close(self) -> None:
        """Stop everything by pid and undo every host change this node made; raises if something
        could not be undone (after trying everything else)."""
        errors = []

        def attempt(step, *args):
            try:
                step(*args)
            except Exception as e:  # one failed step must not leave the rest undone
                errors.append(f"{getattr(step, '__name__', step)}: {e!r}")

        if os.path.isdir(self.manifests):
            for name in os.listdir(self.manifests):
                attempt(os.unlink, os.path.join(self.manifests, name))
        if self.kubelet is not None and self.kubelet.poll() is None:
            attempt(self._wait_for_no_pods, 20)
        attempt(_stop, self.kubelet)
        self._stop_runtime(attempt)
        for proc, _ in reversed(self._daemons()):  # by pid, each given its time to end
            attempt(_stop, proc)
        # What is left of its processes killed by pid, its mounts unmounted, its cgroups removed.
        attempt(self.footprint.close)
        if self._before is not None:
            attempt(self._remove_new_logs)
            attempt(self._remove_device_plugin_state)
            attempt(self._remove_new_run_dirs)
            attempt(write_sysctls, self._before["sysctls"])
            self._before = None
        if errors:
            raise AssertionError("the Kubernetes node was not fully cleaned up:\n" + "\n".join(errors))

    def _stop_runtime(self, attempt) -> None:
        """Stop the runtime and whatever it started, each step through attempt."""
        if self.containerd is not None and self.containerd.poll() is None:
            attempt(self._remove_tasks_and_containers)
        attempt(_stop, self.containerd)
        attempt(self._kill_leftover_containers)

    def _wait_for_no_pods(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._pods():
            time.sleep(0.5)

    def _remove_tasks_and_containers(self) -> None:
        """Through containerd, so that it unmounts the rootfs snapshots and ends the shims itself."""
        for container_id in self._task_pids():
            self.ctr("tasks", "kill", "--signal", "SIGKILL", container_id, check=False)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(s != "STOPPED" for s in self._task_states().values()):
            time.sleep(0.2)
        for container_id in self._task_states():
            self.ctr("tasks", "delete", "--force", container_id, check=False)
        listing = self.ctr("containers", "list", "--quiet", check=False).stdout.split()
        for container_id in listing:
            self.ctr("containers", "delete", container_id, check=False)

    def _kill_leftover_containers(self) -> None:
        """What survived containerd: runc containers in our runc root (the processes left in the
        footprint's cgroups, shims among them, are killed by its close())."""
        if os.path.isdir(self.runc_root):
            for namespace in os.listdir(self.runc_root):
                root = os.path.join(self.runc_root, namespace)
                listing = subprocess.run(["runc", "--root", root, "list", "--quiet"], capture_output=True, text=True)
                for container_id in listing.stdout.split():
                    subprocess.run(["runc", "--root", root, "delete", "--force", container_id], capture_output=True)

    def _remove_new_logs(self) -> None:
        for directory, key in ((POD_LOGS_DIR, "pod_logs"), (CONTAINER_LOGS_DIR, "container_logs")):
            before = self._before[key]
            if not os.path.isdir(directory):
                continue
            for name in set(os.listdir(directory)) - (before or set()):
                path = os.path.join(directory, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            if before is None:
                os.rmdir(directory)

    def _remove_device_checkpoint(self) -> None:
        try:
            os.unlink(os.path.join(DEVICE_PLUGIN_DIR, DEVICE_CHECKPOINT))
        except FileNotFoundError:
            pass

    def _remove_device_plugin_state(self) -> None:
        # Only what this node created: the checkpoint, or the directories if they were not there.
        created = None
        if not self._before["var_lib_kubelet"]:
            created = "/var/lib/kubelet"
        elif not self._before["device_plugin_dir"]:
            created = DEVICE_PLUGIN_DIR
        if created and os.path.exists(created):
            shutil.rmtree(created)
        self._remove_device_checkpoint()

    def _remove_new_run_dirs(self) -> None:
        # containerd 1.6 puts shim sockets in /run/containerd/s/ whatever its state directory; the
        # shims remove their sockets, the directories stay.
        if self._before["run_containerd"]:
            return
        for directory in ("/run/containerd/s", "/run/containerd/fifo", "/run/containerd"):
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                pass

    # --- containerd ----------------------------------------------------------------------------

    def _program(self, name: str) -> str:
        return os.path.join(self.containerd_bin, name) if self.containerd_bin else name

    def ctr(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """ctr against our containerd, in the CRI's namespace (k8s.io)."""
        proc = subprocess.run([self._program("ctr"), "--address", self.address, "--namespace", "k8s.io", *args],
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip
        if check and proc.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args)}: {proc.stderr.strip()}" + self.diagnostics())
        return proc

    def _task_table(self) -> list[list[str]]:
        lines = self.ctr("tasks", "list", check=False).stdout.splitlines()[1:]  # TASK PID STATUS
        return [line.split() for line in lines if len(line.split()) == 3]

    def _task_pids(self) -> dict[str, int]:
        return {task: int(pid) for task, pid, _ in self._task_table()}

    def _task_states(self) -> dict[str, str]:
        return {task: status for task, _, status in self._task_table()}

    # --- pods ----------------------------------------------------------------------------------

    def full_name(self, name: str) -> str:
        """A static pod's name as the kubelet reports it: the node's name appended."""
        return f"{name}-{self.node_name}"

    def add_pod(self, name: str, command: str | Sequence[str], limits: dict | None = None,
                env: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> str:  # fmt: skip
        """Write a static pod manifest: one container, `command` (a string runs under sh -c), the
        resource limits (default one nvidia.com/gpu; {} for none). A pod whose resource the kubelet
        does not report yet is rejected for good: wait_for_resource first. Returns the manifest's path."""
        argv = ["sh", "-c", command] if isinstance(command, str) else list(command)
        limits = {"nvidia.com/gpu": 1} if limits is None else limits
        container = {
            "name": CONTAINER,
            "image": IMAGE,
            "imagePullPolicy": "Never",
            "command": argv,
            "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
            "resources": {"limits": {k: str(v) for k, v in limits.items()}},
        }
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "annotations": dict(annotations or {})},
            "spec": {"hostNetwork": True, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [container]},
        }  # fmt: skip
        path = os.path.join(self.manifests, f"{name}.json")
        # The kubelet skips dot files: write there, then rename, so it never reads half a manifest.
        partial = os.path.join(self.manifests, f".{name}.json")
        with open(partial, "w") as f:
            json.dump(pod, f, indent=1)
        os.rename(partial, path)
        return path

    def remove_pod(self, name: str, timeout: float = 30) -> None:
        """Delete the manifest; return once the kubelet no longer lists the pod and its container
        has stopped (its devices are then free for the next pod)."""
        container_id = self._container_id(self.pod(name)) if self.pod(name) else None
        os.unlink(os.path.join(self.manifests, f"{name}.json"))
        self._wait(lambda: self.pod(name) is None, timeout, f"pod {name} to go")
        if container_id:
            self._wait(lambda: self._task_states().get(container_id, "STOPPED") == "STOPPED", timeout,
                       f"pod {name}'s container to stop")  # fmt: skip

    def _pods(self) -> list[dict]:
        body = self._get("/pods")
        return (body or {}).get("items") or []

    def pod(self, name: str) -> dict | None:
        """The pod as the kubelet reports it on the read-only port (spec and status), or None."""
        for pod in self._pods():
            meta = pod.get("metadata", {})
            if meta.get("name") == self.full_name(name) and meta.get("namespace") == NAMESPACE:
                self._uids[name] = meta.get("uid")
                return pod
        return None

    def wait_for_phase(self, name: str, phases: str | Iterable[str], timeout: float = 60) -> dict:
        """Wait until the pod's phase is one of phases (Pending, Running, Succeeded, Failed); fail at
        once if it ends in another."""
        wanted = {phases} if isinstance(phases, str) else set(phases)
        seen = {}

        def reached():
            pod = self.pod(name)
            seen["pod"] = pod
            phase = (pod or {}).get("status", {}).get("phase")
            if phase in ("Succeeded", "Failed") and phase not in wanted:
                raise AssertionError(f"pod {name} ended {phase}: {json.dumps(pod.get('status'))}" + self.diagnostics())
            return phase in wanted

        self._wait(reached, timeout, f"pod {name} to be {'/'.join(sorted(wanted))}",
                   lambda: f"\npod status: {json.dumps((seen.get('pod') or {}).get('status'))}")  # fmt: skip
        return seen["pod"]

    def _container_id(self, pod: dict) -> str | None:
        for status in pod.get("status", {}).get("containerStatuses") or []:
            if status.get("name") == CONTAINER and status.get("containerID"):
                return status["containerID"].split("://", 1)[1]
        return None

    def container_id(self, name: str) -> str:
        pod = self.pod(name)
        container_id = self._container_id(pod) if pod else None
        if not container_id:
            raise AssertionError(f"pod {name} has no container yet" + self.diagnostics())
        return container_id

    def container_pid(self, name: str) -> int:
        """The host pid of the pod's app container's init process."""
        container_id = self.container_id(name)
        pid = self._task_pids().get(container_id)
        if not pid:
            raise AssertionError(f"pod {name}'s container {container_id} has no task" + self.diagnostics())
        return pid

    def oci_spec(self, name: str) -> dict:
        """The OCI spec containerd made for the pod's app container (the base spec with the hook,
        plus what the kubelet and the device plugin's Allocate answer added)."""
        info = json.loads(self.ctr("containers", "info", self.container_id(name)).stdout)
        return info["Spec"]

    def exec(self, name: str, argv: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """Run argv in the pod's running app container (ctr tasks exec); returns the CompletedProcess."""
        exec_id = f"exec-{time.monotonic_ns()}"
        # ctr's own fifos in our directory, not in /run/containerd/fifo.
        fifos = os.path.join(self.containerd_dir, "fifo")
        return self.ctr("tasks", "exec", "--fifo-dir", fifos, "--exec-id", exec_id, self.container_id(name), *argv,
                        check=False, timeout=timeout)  # fmt: skip

    def logs(self, name: str) -> str:
        """What the pod's app container wrote to stdout and stderr, from the CRI log files the
        runtime writes under /var/log/pods/<namespace>_<full name>_<uid>/<container>/<restart>.log."""
        uid = self._uids.get(name) or (self.pod(name) or {}).get("metadata", {}).get("uid")
        directory = os.path.join(POD_LOGS_DIR, f"{NAMESPACE}_{self.full_name(name)}_{uid}", CONTAINER)
        return container_log(directory)

    def wait_for_log(self, name: str, text: str, timeout: float = 30) -> str:
        """Wait until the pod's log holds text; returns the log."""
        self._wait(lambda: text in self.logs(name), timeout, f"{text!r} in pod {name}'s log",
                   lambda: f"\nlog: {self.logs(name)[-2000:]!r}")  # fmt: skip
        return self.logs(name)

    # --- device plugin resources -------------------------------------------------------------------

    def _device_lines(self) -> dict[str, tuple[int, int]]:
        """{resource: (capacity, allocatable)} from the device manager's lines since the kubelet's start.

        Nothing on the read-only port serves the node's status (no API server, so no Node object), and
        the checkpoint lags: after a restart it still lists the last kubelet's devices while the new
        one counts none until the plugin registers again. These log lines (-v=2) follow every device
        list the plugin sends and every endpoint loss, which is what admission uses."""
        with open(self.kubelet_log, errors="replace") as f:
            f.seek(self._kubelet_log_start)
            text = f.read()
        found = {}
        pattern = re.compile(
            r'"Processed device updates for resource" resourceName="([^"]+)" totalCount=(\d+) '
            r'healthyCount=(\d+)|"Mark all resources Unhealthy for resource" resourceName="([^"]+)"'
        )
        for match in pattern.finditer(text):
            if match.group(1):
                found[match.group(1)] = (int(match.group(2)), int(match.group(3)))
            else:
                found[match.group(4)] = (found.get(match.group(4), (0, 0))[0], 0)
        return found

    def capacity(self) -> dict[str, int]:
        """{resource: devices} the plugins reported, healthy or not (the node's capacity)."""
        return {resource: total for resource, (total, _) in self._device_lines().items()}

    def allocatable(self) -> dict[str, int]:
        """{resource: healthy devices} (the node's allocatable: what pods are admitted against)."""
        return {resource: healthy for resource, (_, healthy) in self._device_lines().items()}

    def wait_for_resource(self, resource: str, count: int, timeout: float = 60) -> None:
        """Wait until the kubelet counts exactly count healthy devices of resource."""
        self._wait(lambda: self.allocatable().get(resource) == count, timeout, f"{count} allocatable {resource}",
                   lambda: f"\nallocatable: {self.allocatable()}")  # fmt: skip

    def allocated_devices(self, name: str) -> dict[str, list[str]]:
        """{resource: device ids} the device manager gave the pod's container, from its checkpoint."""
        uid = self._uids.get(name) or (self.pod(name) or {}).get("metadata", {}).get("uid")
        try:
            with open(os.path.join(DEVICE_PLUGIN_DIR, DEVICE_CHECKPOINT)) as f:
                entries = json.load(f)["Data"]["PodDeviceEntries"] or []
        except FileNotFoundError:
            return {}
        found = {}
        for entry in entries:
            if entry["PodUID"] == uid and entry["ContainerName"] == CONTAINER:
                ids = [i for per_numa in (entry["DeviceIDs"] or {}).values() for i in per_numa]
                found.setdefault(entry["ResourceName"], []).extend(ids)
        return {resource: sorted(ids) for resource, ids in found.items()}

    # --- plumbing ------------------------------------------------------------------------------

    def _get(self, path: str):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.read_only_port}{path}", timeout=10) as r:
                return json.load(r)
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def diagnostics(self) -> str:
        """The tails of containerd's and the kubelet's logs, for failure messages."""
        return (f"\n--- {self.kubelet_log} (tail)\n{_tail(self.kubelet_log)}"
                f"\n--- {self.runtime_log} (tail)\n{_tail(self.runtime_log)}")  # fmt: skip

    def _wait(self, condition, timeout: float, what: str, detail=lambda: "") -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            for proc, program in self._daemons():
                if proc is not None and proc.poll() is not None:
                    raise AssertionError(f"{program} exited ({proc.returncode}) while waiting for {what}"
                                         + self.diagnostics())  # fmt: skip
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{detail()}" + self.diagnostics())
            time.sleep(0.2)


class DevicePlugin:
    """`oci-gpu-hook device-plugin` as a program, stopped by its pid."""

    def __init__(self, hook_config, node, tmp_path, doc, name, options=()):
        import yaml

        self.config_file = tmp_path / f"{name}.yaml"
        self.config_file.write_text(yaml.safe_dump(doc))
        self.log_path = tmp_path / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [*containers.hook_command(hook_config), "device-plugin", "--config-file", str(self.config_file),
             "--socket-dir", node.device_plugin_dir, "--interval", "0.3", *options],
            stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def registrations(self) -> int:
        """How many times a resource was registered with a kubelet."""
        return self.output().count(": registered with the kubelet")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def container_log(directory: str) -> str:
    """What a container wrote, from the CRI log files in its log directory (one per restart, in
    restart order); empty when there are none yet."""
    try:
        files = sorted(os.listdir(directory), key=lambda n: int(n.split(".")[0]) if n[0].isdigit() else -1)
    except FileNotFoundError:
        return ""
    return "".join(cri_log(os.path.join(directory, file)) for file in files)


def cri_log(path: str) -> str:
    """The text of one CRI log file: TIMESTAMP STREAM TAG MESSAGE lines, TAG P for a partial line
    and F for its end."""
    text = []
    with open(path, errors="replace") as f:
        for line in f:
            parts = line.rstrip("\n").split(" ", 3)
            if len(parts) == 4:
                text.append(parts[3] + ("\n" if parts[2] == "F" else ""))
    return "".join(text)


def host_state() -> dict:
    """What a node must leave as it found it: the six sysctls its kubelet rewrites, and what every
    harness of this process has on the host (hostcheck.owned_state: the processes in its cgroups,
    zombies left out; the mounts under its directories; its cgroups; its iptables chains' changes),
    which is nothing before one starts and after it is closed. Nothing of another user's: a
    program named like ours, a mount or a chain elsewhere, is theirs."""
    return {"sysctls": read_sysctls(), **hostcheck.owned_state()}


@contextlib.contextmanager
def running(node):
    """node (a ContainerdKubelet, a CrioKubelet, a kubecheck.Cluster) started for the block and
    closed after it, the host then compared with what host_state said before it started."""
    before = host_state()
    with node:
        yield node
    assert host_state() == before


def over_share_is_named_and_killed(node, host: dict, hook_config: str, tmp, pids: dict, held: dict, totals: dict,
                                   over: str, under: str) -> None:  # fmt: skip
    """Pod over uses more than half its GPU's memory (its replica's share), pod under a quarter of
    its own: the real exporter names both pods on their GPUs, the real `watchdog --once` kills only
    over (its pod then ends), and under keeps running. pids: pod name -> its process; held: pod
    name -> its GPU uuids; totals: uuid -> the GPU's memory."""
    import json

    from servicecheck import Exporter

    from oci_gpu_hook.toolkit.containers import hook_command
    from oci_gpu_hook.toolkit.simulate import control

    big, small = held[over][0], held[under][0]
    control.write(host["root"], processes=[(big, pids[over], totals[big] // 2 + (64 << 20)),
                                           (small, pids[under], totals[small] // 4)])  # fmt: skip
    exporter = Exporter(hook_config, tmp)
    try:
        samples = exporter.scrape()
    finally:
        exporter.stop()
    used = {(ls.get("pod"), ls.get("namespace"), ls.get("UUID")) for n, ls, v in samples
            if n == "oci_gpu_hook_container_gpu_memory_used_bytes"}  # fmt: skip
    assert {(node.full_name(n), "default", held[n][0]) for n in (over, under)} <= used, used
    out = subprocess.run([*hook_command(hook_config), "watchdog", "--once"], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    control.clear(host["root"])
    (killed,) = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert (killed["action"], killed["pids"], killed["device"]) == ("kill", [pids[over]], big)
    assert (killed["pod"], killed["namespace"]) == (node.full_name(over), "default")
    node.wait_for_phase(over, ("Failed", "Succeeded"))  # SIGKILL: its only process is gone
    assert node.pod(under)["status"]["phase"] == "Running" and os.path.exists(f"/proc/{pids[under]}")
