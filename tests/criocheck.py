"""CRI-O for tests: its programs, built by ../shared/tools/crio/build.sh on first use (about 2
minutes on 2 cores, cached per machine), and what `crio config` says a configuration tree means."""

from __future__ import annotations

import os
import subprocess

import hostcheck
import kubeletcheck
from kubeletcheck import shared_tool

from oci_gpu_hook.toolkit import runtime_config


def programs() -> str:
    """The directory holding crio, pinns and crictl."""
    return shared_tool("crio")


def config(root: str, *options: str) -> dict:
    """The configuration CRI-O merges from crio.conf and crio.conf.d under root, as `crio config`
    prints it (parsed)."""
    crio = os.path.join(programs(), "crio")
    conf = root + runtime_config.CRIO_CONF
    # An absent crio.conf is CRI-O's defaults; named on the command line, it would be an error.
    done = subprocess.run([crio, "--config", conf if os.path.exists(conf) else "", "--config-dir",
                           root + runtime_config.CRIO_DROPIN_DIR, "config", *options], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return runtime_config.load_toml(done.stdout)


def hooks_dirs(root: str) -> list:
    """The hooks directories CRI-O reads: `crio config` leaves out (comments) a value that is the
    default, which `crio config --default` then prints."""
    runtime = config(root)["crio"]["runtime"]
    return runtime["hooks_dir"] if "hooks_dir" in runtime else config(root, "--default")["crio"]["runtime"]["hooks_dir"]


# The capabilities by number (linux/capability.h), to name those a bounding set lacks.
CAPABILITY_NAMES = (
    "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP LINUX_IMMUTABLE "
    "NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO SYS_CHROOT "
    "SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE "
    "AUDIT_WRITE AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ "
    "PERFMON BPF CHECKPOINT_RESTORE"
).split()


def capabilities_absent() -> list:
    """CAP_ names of the capabilities this process's bounding set lacks (this machine: none on a
    plain host; CAP_SYS_RESOURCE where it runs in a container that dropped it)."""
    with open("/proc/self/status") as f:
        (bounding,) = [int(line.split()[1], 16) for line in f if line.startswith("CapBnd:")]
    return [f"CAP_{name}" for bit, name in enumerate(CAPABILITY_NAMES) if not bounding >> bit & 1]


def runc_for_this_machine(base: str) -> str:
    """Debian's runc, behind a wrapper that drops from the bundle what this machine cannot do, and
    nothing else: the infra container's negative oomScoreAdj (no CAP_SYS_RESOURCE here; as
    ../shared/tools/crio/runc-no-oom), and, where the hugetlb controller is on the unified
    hierarchy of a hybrid cgroup layout (no v1 hierarchy to join), the zero hugepage limits the
    kubelet asks for: CRI-O passes them, and runc's v1 manager would fail to join a hugetlb cgroup.
    On a node with all v1 controllers mounted, or with cgroup v2 alone, neither is dropped. And
    the capabilities this machine's bounding set lacks (capabilities_absent), which CRI-O gives a
    privileged container all the same (containerd gives it those it has)."""
    import json

    drop = {"process": ["oomScoreAdj"]}
    unified = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
    if not unified and not os.path.isdir("/sys/fs/cgroup/hugetlb"):
        drop["linux.resources"] = ["hugepageLimits"]
    absent = capabilities_absent()
    path = os.path.join(base, "runc")
    with open(path, "w") as f:
        f.write(f"""#!/bin/sh
# runc for this machine (tests/criocheck.py, runc_for_this_machine): drops {json.dumps(drop)}
# and the capabilities this machine's bounding set lacks: {json.dumps(absent)}
for a in "$@"; do
  case "$prev" in --bundle|-b) b=$a ;; esac; prev=$a
done
if [ -n "${{b:-}}" ] && [ -f "$b/config.json" ]; then
  /usr/bin/python3 -I -c '
import json, sys
path, drop = sys.argv[1], json.loads(sys.argv[2])
with open(path) as f:
    config = json.load(f)
for where, keys in drop.items():
    place = config
    for part in where.split("."):
        place = place.get(part) or {{}}
    for key in keys:
        place.pop(key, None)
absent = set(json.loads(sys.argv[3]))
for kind, names in ((config.get("process") or {{}}).get("capabilities") or {{}}).items():
    names[:] = [n for n in names if n not in absent]
with open(path, "w") as f:
    json.dump(config, f)
' "$b/config.json" '{json.dumps(drop)}' '{json.dumps(absent)}' || exit 1
fi
exec /usr/bin/runc "$@"
""")
    os.chmod(path, 0o755)
    return path


class CrioDaemon:
    """A CRI-O of its own, as an OpenShift node runs it (hooks.d, runc, cgroupfs), driven by crictl:
    private storage, sockets, state and cgroup parent; a busybox image imported with podman (no
    registry), which is the pause image too; host networking (no CNI). stop() removes the pods,
    stops CRI-O by its pid, then undoes what its hostcheck.Footprint holds: CRI-O runs in a cgroup
    of its own, with its conmons (however they daemonize), the containers in its cgroup parent;
    those processes are killed by pid, the mounts under its base unmounted without detaching (a
    busy one is raised with what holds it) and the cgroups removed. It raises for anything left."""

    def __init__(self, base: str, hooks_dir: str | None = None, config_dir: str | None = None,
                 etc_containers: str | None = None, configured: str | None = None, enter=(),
                 node_root: str = ""):  # fmt: skip
        """hooks_dir: given as --hooks-dir (None: CRI-O reads what its configuration says);
        config_dir: its --config-dir (None: an empty one of its own); etc_containers: a directory
        CRI-O sees over the host's /etc/containers (an install --root's), so that the host's
        stays as it is. On this host (no enter) it runs in a mount namespace of its own whose
        /usr/share is an overlay: what CRI-O makes there goes with it. configured: instead of flags, a file in
        /etc/crio/crio.conf.d (of a namespace whose /etc is the test's) where the settings go as
        `crio config` prints them; CRI-O then starts with no flag at all, as a node's does, under
        a supervisor that starts it again whenever it exits (as systemd's Restart= would), each
        start a line in `starts`, until stop(). enter: a command prefix that runs it in the node's
        mount namespace (nsenter), whose root this process reaches at node_root, where configured
        is written."""
        import tempfile
        import time

        from oci_gpu_hook.toolkit import containers

        self.base = base
        self.bin = programs()
        self.parent = f"oci-gpu-hook-{os.path.basename(base)}"  # unique: two may run at once
        self.footprint = hostcheck.Footprint("crio", directories=[base])
        self.footprint.own_cgroup_parent(self.parent)
        d = {k: os.path.join(base, k) for k in ("root", "runroot", "runcroot", "log", "ns", "exits", "attach", "cni",
                                                 "conf.d", "pods", "rootfs", "cdi")}  # fmt: skip
        for path in d.values():
            os.makedirs(path, exist_ok=True)
        self.dirs = d
        rootfs = containers.make_rootfs(d["rootfs"])
        os.symlink("busybox", os.path.join(rootfs, "bin/sleep"))
        with open(os.path.join(rootfs, "pause"), "w") as f:
            f.write("#!/bin/sh\nexec sleep 100000\n")
        os.chmod(os.path.join(rootfs, "pause"), 0o755)
        self.store = ["--root", d["root"], "--runroot", d["runroot"], "--storage-driver", "overlay"]
        with tempfile.TemporaryFile() as tar:
            subprocess.run(["tar", "-C", rootfs, "-cf", "-", "."], stdout=tar, check=True)
            tar.seek(0)
            subprocess.run(["podman", *self.store, "import", "-", self.IMAGE], stdin=tar, check=True,
                           capture_output=True)  # fmt: skip
        policy = os.path.join(base, "policy.json")
        with open(policy, "w") as f:
            f.write('{"default": [{"type": "insecureAcceptAnything"}]}')
        empty = os.path.join(base, "crio.conf")
        open(empty, "w").close()
        self.socket = os.path.join(base, "crio.sock")
        wrapper = runc_for_this_machine(base)
        argv = [os.path.join(self.bin, "crio"), "--config", empty, "--config-dir", config_dir or d["conf.d"],
                *self.store, "--listen", self.socket, "--cgroup-manager", "cgroupfs",
                "--conmon", "/usr/bin/conmon", "--pinns-path", os.path.join(self.bin, "pinns"),
                "--runtimes", f"runc:{wrapper}:{d['runcroot']}", "--default-runtime", "runc",
                "--pause-image", self.IMAGE, "--pause-command", "/pause", "--signature-policy", policy,
                "--log-dir", d["log"], "--version-file", os.path.join(base, "version"),
                "--version-file-persist", os.path.join(base, "version-persist"),
                "--clean-shutdown-file", os.path.join(base, "clean-shutdown"), "--namespaces-dir", d["ns"],
                "--container-exits-dir", d["exits"], "--container-attach-socket-dir", d["attach"],
                "--cni-config-dir", d["cni"], "--log", os.path.join(base, "crio.log"),
                "--cdi-spec-dirs", d["cdi"], "--enable-metrics=false"]  # fmt: skip
        if hooks_dir is not None:
            argv += ["--hooks-dir", hooks_dir]
        self.configured, self.starts = configured, os.path.join(base, "starts")
        if configured is not None:
            done = subprocess.run([*argv, "config"], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-3000:]
            os.makedirs(os.path.dirname(node_root + configured), exist_ok=True)
            with open(node_root + configured, "w") as f:
                f.write(done.stdout)
            argv = ["sh", "-c", 'while [ ! -e "$0/stop" ]; do echo start >> "$0/starts"; "$1" >> "$0/crio.log" 2>&1; '
                    "done", base, argv[0]]  # fmt: skip
        if not enter:
            # On this host: in a mount namespace of its own, whose /usr/share is an overlay (its
            # upper layer on a tmpfs in base), since CRI-O makes the hooks directories it reads
            # where there are none (its default, /usr/share/containers/oci/hooks.d). And
            # etc_containers: a read-only overlay, the given tree's files over the host's
            # /etc/containers. Seen by CRI-O, its conmon, runc and the hook only; they go when the
            # last of them exits.
            share = os.path.join(base, "usr-share")
            os.makedirs(share)
            mounts = (f'mount -t tmpfs -o mode=0700 oci-gpu-hook-share "{share}" && mkdir "{share}/u" "{share}/w" && '
                      f'mount -t overlay oci-gpu-hook-share -o "lowerdir=/usr/share,upperdir={share}/u,'
                      f'workdir={share}/w" /usr/share && ')  # fmt: skip
            if etc_containers is not None:
                mounts += 'mount -t overlay oci-gpu-hook-etc -o "lowerdir=$0:/etc/containers" /etc/containers && '
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mounts + 'exec "$@"',
                    etc_containers or "-", *argv]  # fmt: skip
        self.proc = self.footprint.popen([*enter, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        try:
            while not os.path.exists(self.socket):
                assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
                time.sleep(0.05)
        except BaseException:
            self.footprint.close()
            raise
        self.pods = 0

    IMAGE = "localhost/oci-gpu-hook-crio:1"

    def import_archive(self, archive: str) -> None:
        """A docker-archive image (kubeletcheck.write_image_archive's), into CRI-O's store."""
        subprocess.run(["podman", *self.store, "load", "-i", archive], check=True, capture_output=True)

    def log(self) -> str:
        try:
            with open(os.path.join(self.base, "crio.log")) as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def crictl(self, *args) -> subprocess.CompletedProcess:
        endpoint = f"unix://{self.socket}"
        return subprocess.run([os.path.join(self.bin, "crictl"), "-r", endpoint, "-i", endpoint, *args],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    def start_pod(self, pod_name: str = "gpu-pod", namespace: str = "team") -> str:
        """A host-network pod (its infra container running); returns its id."""
        import json

        self.pods += 1
        # The labels the kubelet sets: CRI-O copies them into every container's annotations, where
        # the hook finds the pod's names (crictl sets none of its own).
        self.labels = {"io.kubernetes.pod.name": pod_name, "io.kubernetes.pod.namespace": namespace,
                       "io.kubernetes.pod.uid": f"uid-{self.pods}"}  # fmt: skip
        self.pod = {"metadata": {"name": pod_name, "namespace": namespace, "uid": f"uid-{self.pods}"},
                    "labels": self.labels, "log_directory": os.path.join(self.dirs["pods"], str(self.pods)),
                    "linux": {"cgroup_parent": f"/{self.parent}",
                              "security_context": {"namespace_options": {"network": 2}}}}  # fmt: skip
        self.pod_file = os.path.join(self.base, f"pod-{self.pods}.json")
        with open(self.pod_file, "w") as f:
            json.dump(self.pod, f)
        runp = self.crictl("runp", self.pod_file)
        assert runp.returncode == 0, runp.stderr + self.log()
        self.pod_id = runp.stdout.strip()
        return self.pod_id

    def start_container(self, name: str, env: dict, command, attempt: int = 0) -> tuple:
        """(container id or None, the create/start error or None) of a container of the current pod;
        attempt: the kubelet's restart count (a restart is a new container of the same name)."""
        import json

        spec = {"metadata": {"name": name, "attempt": attempt}, "image": {"image": self.IMAGE},
                "command": list(command), "labels": {**self.labels, "io.kubernetes.container.name": name},
                "envs": [{"key": k, "value": v} for k, v in env.items()],
                "log_path": f"{name}.{attempt}.log"}  # fmt: skip
        spec_file = os.path.join(self.base, f"ctr-{self.pods}-{name}-{attempt}.json")
        with open(spec_file, "w") as f:
            json.dump(spec, f)
        create = self.crictl("create", self.pod_id, spec_file, self.pod_file)
        if create.returncode != 0:
            return None, create.stderr
        cid = create.stdout.strip()
        start = self.crictl("start", cid)
        return cid, (start.stderr if start.returncode != 0 else None)

    def state(self, cid: str) -> str:
        return self.crictl("inspect", "-o", "go-template", "--template", "{{.status.state}}", cid).stdout.strip()

    def wait_log(self, name: str, cid: str, attempt: int = 0) -> str:
        """The container's output, once it has exited."""
        import time

        deadline = time.monotonic() + 60
        while self.state(cid) != "CONTAINER_EXITED":
            assert time.monotonic() < deadline, f"{name} did not exit"
            time.sleep(0.1)
        return kubeletcheck.cri_log(os.path.join(self.pod["log_directory"], f"{name}.{attempt}.log"))

    def run_pod(self, containers_: dict, pod_name: str = "gpu-pod", namespace: str = "team") -> dict:
        """A pod with containers {name: (env, command)}, each waited for; returns {name: (its output,
        or the create/start error; container id or None)}."""
        self.start_pod(pod_name, namespace)
        out = {}
        for name, (env, command) in containers_.items():
            cid, error = self.start_container(name, env, command)
            out[name] = (error, cid) if error else (self.wait_log(name, cid), cid)
        return out

    def remove_pods(self) -> None:
        for pod_id in self.crictl("pods", "-q").stdout.split():
            self.crictl("stopp", pod_id)
            self.crictl("rmp", "-f", pod_id)

    def stop(self) -> None:
        import shutil

        try:
            self.remove_pods()
        finally:
            if self.configured is not None:  # the supervisor stops, then the CRI-O it runs now
                from oci_gpu_hook.toolkit import restart

                open(os.path.join(self.base, "stop"), "w").close()
                serving = restart.serving(self.socket)
                if serving is not None:
                    os.kill(serving, 15)
            kubeletcheck._stop(self.proc, timeout=30)
            runc = ["runc", "--root", self.dirs["runcroot"]]
            for cid in subprocess.run([*runc, "list", "-q"], capture_output=True, text=True).stdout.split():
                subprocess.run([*runc, "delete", "-f", cid], capture_output=True)
            self.footprint.close()  # raises for what it could not undo: the base is then kept, to look at
            shutil.rmtree(self.base)


class CrioKubelet(kubeletcheck.ContainerdKubelet):
    """The OpenShift node's path: the kubelet (standalone, as kubeletcheck.ContainerdKubelet runs it)
    on a CRI-O of its own (CrioDaemon, with the hooks.d file install writes) in place of containerd,
    which runs runc, which runs the hook. CDI specs for CRI-O go in cdi_dir. close() stops the
    kubelet, then CRI-O (CrioDaemon.stop), and undoes what the kubelet changed on the host as
    kubeletcheck.ContainerdKubelet does."""

    def __init__(self, workdir, hook_config: str, **options):
        super().__init__(workdir, hook_config, **options)
        self.crio: CrioDaemon | None = None
        self.runtime_log = self.cdi_dir = ""  # known once CRI-O's base is made

    def _start_runtime(self, timeout: float) -> None:
        import tempfile

        from oci_gpu_hook.toolkit import containers

        hooks = containers.write_hooks_dir(os.path.join(self.workdir, "hooks.d"), self.hook_config)
        # Short: podman refuses a run root of over 50 characters.
        base = tempfile.mkdtemp(prefix="oci-gpu-hook-crio-", dir="/var/tmp")
        self.runtime_log, self.cdi_dir = os.path.join(base, "crio.log"), os.path.join(base, "cdi")
        self.crio = CrioDaemon(base, hooks)
        self.address = self.crio.socket
        self.crio.import_archive(kubeletcheck.write_image_archive(os.path.join(self.workdir, "image.tar"),
                                                                  self.workdir))  # fmt: skip

    def _daemons(self) -> list:
        return [(self.crio.proc if self.crio else None, "CRI-O"), (self.kubelet, "the kubelet")]

    def _stop_runtime(self, attempt) -> None:
        if self.crio is not None:
            attempt(self.crio.stop)

    def crictl(self, *args: str) -> subprocess.CompletedProcess:
        return self.crio.crictl(*args)

    def _inspect(self, container_id: str) -> dict:
        import json

        done = self.crictl("inspect", "-o", "json", container_id)
        assert done.returncode == 0, done.stderr + self.diagnostics()
        return json.loads(done.stdout)

    def _task_states(self) -> dict:
        import json

        listed = json.loads(self.crictl("ps", "-a", "-o", "json").stdout or "{}").get("containers") or []
        return {c["id"]: "RUNNING" if c["state"] == "CONTAINER_RUNNING" else "STOPPED" for c in listed}

    def _task_pids(self) -> dict:
        return {cid: self._inspect(cid)["info"]["pid"] for cid, state in self._task_states().items()
                if state == "RUNNING"}  # fmt: skip

    def oci_spec(self, name: str) -> dict:
        return self._inspect(self.container_id(name))["info"]["runtimeSpec"]

    def exec(self, name: str, argv, timeout: float = 30) -> subprocess.CompletedProcess:
        return self.crictl("exec", "--timeout", str(int(timeout)), self.container_id(name), *argv)
