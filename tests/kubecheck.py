"""A one-node Kubernetes cluster of the test's own (issue 28): etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and the kubelet that ../shared/tools/kube/build.sh builds
(Kubernetes 1.36, cached per machine), on Debian's containerd with the hook in its base runtime
spec (kubeletcheck.ContainerdKubelet's containerd, image and host bookkeeping). Driven the way a
user drives a cluster: kubectl against the API server.

Everything listens on loopback at ports of its own; certificates, etcd's data, the components'
state and the kubelet's --root-dir live under the test's directory. The control plane runs in the
node's cgroup of its own (hostcheck.Footprint), with containerd and the kubelet. What the kubelet
cannot be told to keep there (the device-plugin directory, /var/log/pods, kubepods cgroups, six
sysctls) is undone by close(), as kubeletcheck.ContainerdKubelet does; the footprint compares the
iptables chains named KUBE-* too. Only one cluster runs at a time (the ports and the
device-plugin directory are fixed).

Facts this is built around (../shared/tools/kube/README.md): `kubectl apply` needs
--validate=false with this build (its OpenAPI handler fails), and `kubectl logs`/`exec` cannot
reach a kubelet on 127.0.0.1, so logs are read from the files under /var/log/pods.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import criocheck
import hostcheck
import kubeletcheck
from hookcheck import config_with

from oci_gpu_hook.node import gate_report
from oci_gpu_hook.node.plugin.config import GPU_RESOURCE

ETCD_PORT, ETCD_PEER_PORT, API_PORT = 12379, 12380, 16443
CONTROLLER_MANAGER_PORT, SCHEDULER_PORT = 10357, 10359
KUBELET_PORT, KUBELET_HEALTHZ_PORT = 11250, 11248
NAMESPACE = "default"


def programs() -> dict:
    """{name: path} of the six programs, built on first use (about 5 to 16 minutes on 2 cores)."""
    kubeletcheck.kubelet_binary()  # the same prerequisites (containerd, runc, busybox, root)
    out = kubeletcheck.shared_tool("kube")
    return {os.path.basename(path): path for path in out.split("\n") if path}


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, stdin=subprocess.DEVNULL)


def certificates(pki: str, node_name: str, seen_at: str | None = None) -> dict:
    """A CA, the API server's serving certificate (127.0.0.1 and the Service names), client
    certificates for the admin (system:masters), the API server's kubelet client, the
    controller-manager, the scheduler and the kubelet of node_name, and a service-account key
    pair, made with openssl in pki; returns {client: its kubeconfig} (admin, controller-manager,
    scheduler, kubelet), each naming the files where its reader finds them (seen_at: pki as the
    node VM mounts it; default pki)."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{pki}/ca.key", "-out",
             f"{pki}/ca.crt", "-subj", "/CN=oci-gpu-hook-test-ca", "-days", "2")  # fmt: skip
    _openssl("genrsa", "-out", f"{pki}/sa.key", "2048")
    _openssl("rsa", "-in", f"{pki}/sa.key", "-pubout", "-out", f"{pki}/sa.pub")
    clients = {
        "apiserver": ("/CN=kube-apiserver", "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,"
                      "DNS:kubernetes,DNS:kubernetes.default.svc"),
        "admin": ("/O=system:masters/CN=admin", None),
        "apiserver-kubelet-client": ("/O=system:masters/CN=kube-apiserver-kubelet-client", None),
        "controller-manager": ("/CN=system:kube-controller-manager", None),
        "scheduler": ("/CN=system:kube-scheduler", None),
        "kubelet": (f"/O=system:nodes/CN=system:node:{node_name}", None),
    }  # fmt: skip
    for name, (subject, san) in clients.items():
        _client_certificate(pki, name, subject, san)
    return {name: _kubeconfig(pki, name, seen_at or pki) for name in ("admin", "controller-manager", "scheduler",
                                                                      "kubelet")}  # fmt: skip


def _client_certificate(pki: str, name: str, subject: str, san: str | None = None) -> None:
    """pki/NAME.key and NAME.crt for subject (and subjectAltName san), signed by pki's CA."""
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{pki}/{name}.key", "-out", f"{pki}/{name}.csr",
             "-subj", subject)  # fmt: skip
    extra = []
    if san:
        with open(f"{pki}/{name}.ext", "w") as f:
            f.write(san + "\n")
        extra = ["-extfile", f"{pki}/{name}.ext"]
    _openssl("x509", "-req", "-in", f"{pki}/{name}.csr", "-CA", f"{pki}/ca.crt", "-CAkey", f"{pki}/ca.key",
             "-CAcreateserial", "-out", f"{pki}/{name}.crt", "-days", "2", *extra)  # fmt: skip


def node_certificate(pki: str, node_name: str) -> str:
    """The kubelet's client certificate for one more node, node_name, signed by the CA that
    certificates() made in pki; returns its kubeconfig."""
    name = f"kubelet-{node_name}"
    _client_certificate(pki, name, f"/O=system:nodes/CN=system:node:{node_name}")
    return _kubeconfig(pki, name, pki)


def _kubeconfig(pki: str, name: str, seen_at: str) -> str:
    path = os.path.join(pki, f"{name}.kubeconfig")
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": f"https://127.0.0.1:{API_PORT}",
                                                  "certificate-authority": f"{seen_at}/ca.crt"}}],
        "users": [{"name": name, "user": {"client-certificate": f"{seen_at}/{name}.crt",
                                          "client-key": f"{seen_at}/{name}.key"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": name}}],
        "current-context": "test",
    }  # fmt: skip
    with open(path, "w") as f:
        json.dump(doc, f)  # JSON is YAML
    return os.path.join(seen_at, f"{name}.kubeconfig")


def control_plane_commands(programs_: dict, pki: str, kubeconfigs: dict, workdir: str,
                           flags: dict | None = None) -> dict:  # fmt: skip
    """{component: its command line}, in start order (etcd, kube-apiserver, kube-controller-manager,
    kube-scheduler): programs_ {name: path}, pki and kubeconfigs (certificates()) as they read
    them, etcd's data under workdir, flags {component: [more flags]} after its own. Each listens on
    loopback at its own port."""
    b = programs_
    cm, sc = kubeconfigs["controller-manager"], kubeconfigs["scheduler"]
    commands = {
        "etcd": [b["kcp-etcd"], "-data-dir", os.path.join(workdir, "etcd"), "-client-url",
                 f"http://127.0.0.1:{ETCD_PORT}", "-unsafe-no-fsync"],
        "kube-apiserver": [
            b["kube-apiserver"], f"--etcd-servers=http://127.0.0.1:{ETCD_PORT}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={API_PORT}", f"--tls-cert-file={pki}/apiserver.crt",
            f"--tls-private-key-file={pki}/apiserver.key", f"--client-ca-file={pki}/ca.crt",
            "--service-account-issuer=https://kubernetes.default.svc", f"--service-account-key-file={pki}/sa.pub",
            f"--service-account-signing-key-file={pki}/sa.key", "--service-cluster-ip-range=10.96.0.0/24",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction", "--allow-privileged=true",
            f"--kubelet-client-certificate={pki}/apiserver-kubelet-client.crt",
            f"--kubelet-client-key={pki}/apiserver-kubelet-client.key", "--endpoint-reconciler-type=none"],
        "kube-controller-manager": [
            b["kube-controller-manager"], f"--kubeconfig={cm}", f"--authentication-kubeconfig={cm}",
            f"--authorization-kubeconfig={cm}", "--bind-address=127.0.0.1", f"--secure-port={CONTROLLER_MANAGER_PORT}",
            "--leader-elect=false", f"--service-account-private-key-file={pki}/sa.key", f"--root-ca-file={pki}/ca.crt",
            "--use-service-account-credentials=true", f"--cluster-signing-cert-file={pki}/ca.crt",
            f"--cluster-signing-key-file={pki}/ca.key"],
        "kube-scheduler": [
            b["kube-scheduler"], f"--kubeconfig={sc}", f"--authentication-kubeconfig={sc}",
            f"--authorization-kubeconfig={sc}", "--bind-address=127.0.0.1", f"--secure-port={SCHEDULER_PORT}",
            "--leader-elect=false"],
    }  # fmt: skip
    for component, more in (flags or {}).items():
        commands[component] = commands[component] + list(more)
    return commands


def kubelet_configuration(endpoint: str, pki: str, cgroup_driver: str) -> dict:
    """The kubelet's KubeletConfiguration: the runtime at endpoint, on loopback at private ports,
    x509 clients of pki's CA only, low eviction thresholds and no image GC (a test machine's
    disk), no iptables chains of its own."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "containerRuntimeEndpoint": endpoint,
        "cgroupDriver": cgroup_driver,
        "failCgroupV1": False,  # this machine's hybrid cgroups count as v1
        "failSwapOn": False,
        "address": "127.0.0.1",
        "port": KUBELET_PORT,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": KUBELET_HEALTHZ_PORT,
        "readOnlyPort": 0,
        "authentication": {"x509": {"clientCAFile": f"{pki}/ca.crt"}, "webhook": {"enabled": False},
                           "anonymous": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # Otherwise it adds KUBE-FIREWALL (dropping non-loopback traffic to 127/8), hint and
        # canary chains to the host's iptables, in both families, and keeps them there.
        "makeIPTablesUtilChains": False,
    }  # fmt: skip


class Cluster(kubeletcheck.ContainerdKubelet):
    """The control plane and a kubelet on containerd, started by start() (or `with`), stopped and
    undone by close(). hook_config: the hook's --config in containerd's base spec.

    node_files ({path: text}): the node is a host of its own instead, for what installs onto it
    (the toolkit DaemonSet): containerd and the kubelet run in a mount namespace whose /etc,
    /usr/local, /usr/share, /var/lib, /var/cache and /run are overlays (their upper layers on a tmpfs there; /run: the
    hook's compiled settings, the runtime's state), with these files
    written into it; containerd reads /etc/containerd/config.toml with no flag (node_files names
    it: cricheck.user_config(cluster.containerd_dir) is the administrators' one, without the hook),
    under a supervisor that starts it again when it exits, as systemd's Restart= would.
    on_node(path) is a path of the node's as this machine reaches it.

    For a cluster of several nodes (nodes_of_their_own), each a host of its own:
    - joins: the started Cluster whose control plane this node joins, with a kubelet certificate
      of its own (node_certificate); it has no control plane of its own.
    - address: the node has a network namespace of its own too, as kind's nodes have: its
      loopback and an interface with this address (the Node's InternalIP), its kubelet's,
      its runtime's and its host-network pods' ports its own; the API server reaches it only
      through a forwarder from the node's loopback to this machine's (tests/apiforward.py).
      Nothing reaches it from outside: its_page() reads a page served in it.
    - cgroup_root: the kubelet's cgroupRoot, made in every hierarchy and removed after, so that
      each kubelet keeps to its own pods' cgroups (one would remove another's as orphans).
    - node_mounts {path: source}: bind mounts in the node's mount namespace (its own simulated
      GPU host, built at the one path every node's configuration names).
    - control_flags {component: [flags]}: more flags for the control plane it starts."""

    def __init__(self, workdir, hook_config: str | None, node_files: dict | None = None,
                 joins: Cluster | None = None, address: str | None = None, cgroup_root: str | None = None,
                 node_mounts: dict | None = None, control_flags: dict | None = None, **options):  # fmt: skip
        super().__init__(workdir, hook_config, **options)
        self.pki = os.path.join(self.workdir, "pki") if joins is None else joins.pki
        self.bin: dict = {}
        self.control: list = []  # (Popen, name, log) in start order
        self.kubeconfigs: dict = {}
        self.node_files = node_files
        self.holder = None  # the process that keeps the node's mount namespace (node_files)
        self.joins, self.address_ip, self.cgroup_root = joins, address, cgroup_root
        self.node_mounts, self.control_flags = dict(node_mounts or {}), control_flags
        self.forwarder = None  # the API server's port on the node's loopback (address)

    # --- a node of its own (node_files) ----------------------------------------------------

    def on_node(self, path: str) -> str:
        return path if self.holder is None else f"/proc/{self.holder.pid}/root{path}"

    def runtime_starts(self) -> int:
        """How many times the supervisor started the runtime (node_files)."""
        with open(self._starts_file()) as f:
            return len(f.read().split())

    def _starts_file(self) -> str:
        return os.path.join(self.containerd_dir, "starts")

    def import_image(self, archive: str) -> None:
        """A docker-archive image, into the runtime's store."""
        self.ctr("images", "import", archive)

    def _entering(self) -> list:
        """The command prefix that runs a program in the node's mount namespace (node_files), and
        its network namespace (address)."""
        network = [f"--net=/proc/{self.holder.pid}/ns/net"] if self.address_ip else []
        return ["nsenter", f"--mount=/proc/{self.holder.pid}/ns/mnt", *network]

    def its_page(self, url: str, timeout: float = 30) -> str | None:
        """The page at url (http), fetched in the node's network (address); None if none answers."""
        fetch = ("import sys, urllib.request; "
                 "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=20).read().decode())")  # fmt: skip
        proc = subprocess.run([*self._entering(), sys.executable, "-I", "-c", fetch, url], capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip
        return proc.stdout if proc.returncode == 0 else None

    def _enter_node(self, timeout: float) -> None:
        upper = os.path.join(self.workdir, "node-overlays")
        staged = os.path.join(self.workdir, "node-files")
        os.makedirs(upper)
        os.makedirs(staged)
        setup = f'mount -t tmpfs -o mode=0755 oci-gpu-hook-node "{upper}" && '
        if self.address_ip:  # the node's network: its loopback, and its address on an interface of its own
            # A veth pair with both ends in the node's namespace: this machine's kernel has no dummy.
            setup += ("ip link set lo up && ip link add oci-gpu-hook0 type veth peer name oci-gpu-hook1 && "
                      f"ip addr add {self.address_ip}/24 dev oci-gpu-hook0 && ip link set oci-gpu-hook0 up && "
                      "ip link set oci-gpu-hook1 up && ip route add default dev oci-gpu-hook0 && ")  # fmt: skip
        for path, source in sorted(self.node_mounts.items()):
            setup += f'mkdir -p "{path}" && mount --bind "{source}" "{path}" && '
        # /usr/share: CRI-O makes its default hooks directory (/usr/share/containers/oci/hooks.d).
        # /var/cache: the node pod's inventory cache (a hostPath), each node's own.
        for d in ("/etc", "/usr/local", "/usr/share", "/var/lib", "/var/cache", "/run"):
            setup += (f'mkdir -p "{upper}/u{d}" "{upper}/w{d}" && mount -t overlay oci-gpu-hook-node '
                      f'-o "lowerdir={d},upperdir={upper}/u{d},workdir={upper}/w{d}" {d} && ')  # fmt: skip
        for n, (path, text) in enumerate(sorted(self.node_files.items())):
            with open(os.path.join(staged, str(n)), "w") as f:
                f.write(text)
            setup += f'mkdir -p "{os.path.dirname(path)}" && cp "{staged}/{n}" "{path}" && '
        # Shared, as systemd makes a host's /: within this namespace only (its peer groups are
        # new). CRI-O refuses the hostPath / otherwise, and HostToContainer needs it.
        setup += "mount --make-rshared / && "
        ready = os.path.join(self.workdir, "node-ready")
        network = ["--net"] if self.address_ip else []
        self.holder = self.footprint.popen(["unshare", "--mount", *network, "--propagation", "private", "sh", "-c",
                                            setup + f'touch "{ready}" && exec sleep infinity'],
                                           stdin=subprocess.DEVNULL)  # fmt: skip
        self._wait(lambda: os.path.exists(ready), timeout, "the node's mount namespace")
        if self.address_ip:
            listening = os.path.join(self.workdir, "forwarder-ready")
            self.forwarder = self.footprint.popen([sys.executable, "-I", os.path.join(kubeletcheck.REPO, "tests",
                                                                                      "apiforward.py"),
                                                   f"/proc/{self.holder.pid}/ns/net", str(API_PORT), listening],
                                                  stdin=subprocess.DEVNULL)  # fmt: skip
            self._wait(lambda: os.path.exists(listening), timeout, "the API server's port in the node's network")
        self.device_plugin_dir = self.on_node(kubeletcheck.DEVICE_PLUGIN_DIR)
        self.kubelet_socket = os.path.join(self.device_plugin_dir, "kubelet.sock")

    def _start_runtime(self, timeout: float) -> None:
        if self.node_files is None:
            return super()._start_runtime(timeout)
        self._cni_config()
        self._enter_node(timeout)
        loop = 'while [ ! -e "$1/stop" ]; do echo start >> "$1/starts"; containerd >> "$2" 2>&1; done'
        self.containerd = self.footprint.popen([*self._entering(), "sh", "-c", loop, "sh", self.containerd_dir,
                                                self.containerd_log], stdin=subprocess.DEVNULL)  # fmt: skip
        self._wait(lambda: self.ctr("version", check=False).returncode == 0, timeout, "containerd to serve")
        self.ctr("images", "import", kubeletcheck.write_image_archive(os.path.join(self.workdir, "image.tar"),
                                                                     self.workdir))  # fmt: skip

    def _start_kubelet(self, timeout: float) -> None:
        if self.holder is not None and self._kubelet_argv[0] != "nsenter":
            self._kubelet_argv = [*self._entering(), *self._kubelet_argv]
        super()._start_kubelet(timeout)

    def _stop_runtime(self, attempt) -> None:
        if self.holder is None:
            return super()._stop_runtime(attempt)
        from oci_gpu_hook.toolkit import restart

        open(os.path.join(self.containerd_dir, "stop"), "w").close()  # the supervisor starts no other
        if self.containerd is not None and self.containerd.poll() is None:
            attempt(self._remove_tasks_and_containers)
            pid = restart.serving(self.address)
            if pid is not None:
                attempt(os.kill, pid, 15)
            attempt(self.containerd.wait, 30)
        attempt(self._kill_leftover_containers)

    def _daemons(self) -> list:
        return self._namespace_daemons() + super()._daemons()

    def _namespace_daemons(self) -> list:
        return ([(self.holder, "the node's mount namespace")] if self.holder is not None else []) + (
            [(self.forwarder, "the API server's forwarder")] if self.forwarder is not None else [])  # fmt: skip

    # --- life cycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 90) -> Cluster:
        self.bin = programs()
        if self.cgroup_root:
            for top in hostcheck.hierarchies():
                os.makedirs(os.path.join(top, self.cgroup_root.strip("/")), exist_ok=True)
            self.footprint.own_cgroup_parent(self.cgroup_root)
        if self.joins is not None:
            self.kubeconfigs = {**self.joins.kubeconfigs, "kubelet": node_certificate(self.pki, self.node_name)}
            return super().start(timeout)  # its runtime and kubelet; the control plane is joins'
        os.makedirs(self.pki, exist_ok=True)
        try:
            self._certificates()
            self._start_control_plane(timeout)
        except BaseException:
            self._stop_control_plane()
            raise
        return super().start(timeout)  # containerd, the image, the kubelet (close() on failure)

    def _certificates(self) -> None:
        self.kubeconfigs.update(certificates(self.pki, self.node_name))

    def _spawn(self, name: str, argv: list) -> None:
        log_path = os.path.join(self.workdir, f"{name}.log")
        log = open(log_path, "ab")
        proc = self.footprint.popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        self.control.append((proc, name, log_path))

    def _start_control_plane(self, timeout: float) -> None:
        import socket

        for port in (ETCD_PORT, ETCD_PEER_PORT, API_PORT, CONTROLLER_MANAGER_PORT, SCHEDULER_PORT, KUBELET_PORT,
                     KUBELET_HEALTHZ_PORT):  # fmt: skip
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    raise AssertionError(f"port {port} is in use: a cluster left running?")
        commands = control_plane_commands(self.bin, self.pki, self.kubeconfigs, self.workdir, self.control_flags)
        self._spawn("etcd", commands["etcd"])
        self._wait(lambda: self._http_ok(f"http://127.0.0.1:{ETCD_PORT}/health"), timeout, "etcd to be healthy")
        self._spawn("kube-apiserver", commands["kube-apiserver"])
        self._wait(lambda: self.kubectl("get", "--raw", "/readyz", check=False).returncode == 0, timeout,
                   "the API server to be ready")  # fmt: skip
        self._spawn("kube-controller-manager", commands["kube-controller-manager"])
        self._spawn("kube-scheduler", commands["kube-scheduler"])
        # Pods need the namespace's default ServiceAccount, which the controller-manager makes.
        self._wait(lambda: self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0, timeout,
                   "the default ServiceAccount")  # fmt: skip

    def _containerd_config(self) -> str:
        self._cni_config()
        return super()._containerd_config()

    def _cni_config(self) -> None:
        # Without a CNI configuration containerd reports NetworkReady=false and the node is never
        # Ready; one that no pod uses (all pods use the host's network) is enough.
        conf = os.path.join(self.containerd_dir, "cni", "conf")
        os.makedirs(conf, exist_ok=True)
        with open(os.path.join(conf, "10-unused.conflist"), "w") as f:
            json.dump({"cniVersion": "0.4.0", "name": "unused", "plugins": [{"type": "loopback"}]}, f)

    def _kubelet_flags(self) -> list:
        config = kubelet_configuration(f"unix://{self.address}", self.pki, "cgroupfs")
        config["volumePluginDir"] = os.path.join(self.kubelet_dir, "volume-plugins")
        if self.cgroup_root:
            config["cgroupRoot"] = self.cgroup_root
        path = os.path.join(self.workdir, "kubelet-config.json")
        with open(path, "w") as f:
            json.dump(config, f)
        node_ip = [f"--node-ip={self.address_ip}"] if self.address_ip else []
        return [f"--config={path}", f"--kubeconfig={self.kubeconfigs['kubelet']}",
                f"--hostname-override={self.node_name}", f"--root-dir={self.kubelet_dir}", *node_ip,
                "--v=2"]  # fmt: skip

    def _kubelet_program(self) -> str:
        return self.bin["kubelet"]

    def _kubelet_ready(self) -> bool:
        return self.node_condition("Ready").get("status") == "True"

    def _daemons(self) -> list:
        return super()._daemons() + [(proc, name) for proc, name, _ in self.control]

    def close(self) -> None:
        errors = []
        try:
            if self.kubelet is not None and self.kubelet.poll() is None:
                self.kubectl("delete", "deployments,daemonsets,pods", "--all", "--grace-period=1", "--wait=true",
                             "--timeout=60s", check=False)  # fmt: skip
        except Exception as e:  # the rest must still be undone
            errors.append(f"deleting the workloads: {e!r}")
        try:
            super().close()
        except AssertionError as e:
            errors.append(str(e))
        self._stop_control_plane()
        if errors:
            raise AssertionError("the cluster was not fully cleaned up:\n" + "\n".join(errors))

    def _stop_control_plane(self) -> None:
        for proc, _, _ in reversed(self.control):
            kubeletcheck._stop(proc)
        self.control = []

    # --- the API -------------------------------------------------------------------------------

    def kubectl(self, *args: str, check: bool = True, input: str | None = None, timeout: float = 90):
        proc = subprocess.run([self.bin["kubectl"], f"--kubeconfig={self.kubeconfigs['admin']}", *args],
                              capture_output=True, text=True, input=input, timeout=timeout)  # fmt: skip
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}" + self.diagnostics())
        return proc

    def get(self, *what: str) -> dict:
        return json.loads(self.kubectl("get", *what, "-o", "json").stdout)

    def apply(self, *documents: dict) -> None:
        """kubectl apply of the documents (--validate=false: this build's OpenAPI handler fails)."""
        self.kubectl("apply", "--validate=false", "-f", "-", input="\n---\n".join(json.dumps(d) for d in documents))

    def node(self) -> dict | None:
        proc = self.kubectl("get", "node", self.node_name, "-o", "json", check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    # The Node as the API server has it, which is what the scheduler and the gates see; named
    # apart from ContainerdKubelet.allocatable(), the kubelet's own count.
    def node_allocatable(self) -> dict:
        """status.allocatable ({} while there is no Node)."""
        return (self.node() or {}).get("status", {}).get("allocatable", {})

    def node_gpus(self) -> str | None:
        """The allocatable nvidia.com/gpu (None while the node offers none)."""
        return self.node_allocatable().get(GPU_RESOURCE)

    def node_condition(self, kind: str) -> dict:
        """The condition of that type ({} while there is none)."""
        conditions = (self.node() or {}).get("status", {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == kind), {})

    def hook_condition(self) -> dict:
        """GPUHookReady, the condition the gates' reporter sets."""
        return self.node_condition(gate_report.CONDITION)

    def hook_ready(self) -> bool:
        return self.hook_condition().get("status") == "True"

    def _pods(self) -> list:
        proc = self.kubectl("get", "pods", "-n", NAMESPACE, "-o", "json", check=False)
        return json.loads(proc.stdout).get("items", []) if proc.returncode == 0 else []

    def full_name(self, name: str) -> str:
        return name  # pods from the API keep their names

    def pods_of(self, selector: str) -> list:
        return self.get("pods", "-n", NAMESPACE, "-l", selector)["items"]

    def log_of(self, pod: dict, container: str = kubeletcheck.CONTAINER) -> str:
        """What a pod's container wrote, from the CRI log files under /var/log/pods."""
        meta = pod["metadata"]
        pod_dir = f"{meta['namespace']}_{meta['name']}_{meta['uid']}"
        return kubeletcheck.container_log(os.path.join(kubeletcheck.POD_LOGS_DIR, pod_dir, container))

    def wait_until(self, condition, timeout: float, what: str) -> None:
        self._wait(condition, timeout, what)

    def diagnostics(self) -> str:
        tails = "".join(f"\n--- {log} (tail)\n{kubeletcheck._tail(log, 15)}" for _, _, log in self.control)
        return super().diagnostics() + tails

    @staticmethod
    def _http_ok(url: str) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False


class CrioCluster(Cluster, criocheck.CrioKubelet):
    """A Cluster whose node runs CRI-O, as an OpenShift node does, and is a host of its own
    (node_files, required): CRI-O reads its settings from /etc/crio/crio.conf.d there (as `crio
    config` prints them, criocheck.CrioDaemon's configured), with no flag, under a supervisor, in
    the node's mount namespace; its storage, sockets and state under /var/tmp (podman's limit on
    the run root's length). Its pods get a network of their own from no CNI plugin (they use the
    host's), but CRI-O says the network is ready only with a configuration whose plugins it finds:
    the loopback one, from containerd's containernetworking-plugins."""

    CONFIGURED = "/etc/crio/crio.conf.d/10-node.conf"

    def _start_runtime(self, timeout: float) -> None:
        import tempfile

        self._enter_node(timeout)
        base = tempfile.mkdtemp(prefix="oci-gpu-hook-crio-", dir="/var/tmp")
        self.runtime_log, self.cdi_dir = os.path.join(base, "crio.log"), os.path.join(base, "cdi")
        cni = os.path.join(base, "cni")
        os.makedirs(cni, exist_ok=True)
        with open(os.path.join(cni, "10-unused.conflist"), "w") as f:
            json.dump({"cniVersion": "0.4.0", "name": "unused", "plugins": [{"type": "loopback"}]}, f)
        os.makedirs(self.on_node("/etc/crio/crio.conf.d"), exist_ok=True)
        with open(self.on_node("/etc/crio/crio.conf.d/20-loopback.conf"), "w") as f:
            f.write('[crio.network]\nplugin_dirs = ["/usr/lib/cni"]\n')
        self.crio = criocheck.CrioDaemon(base, configured=self.CONFIGURED, enter=self._entering(),
                                         node_root=self.on_node(""))  # fmt: skip
        self.address = self.crio.socket
        self.import_image(kubeletcheck.write_image_archive(os.path.join(self.workdir, "image.tar"), self.workdir))

    def import_image(self, archive: str) -> None:
        self.crio.import_archive(archive)

    def _starts_file(self) -> str:
        return self.crio.starts

    def _stop_runtime(self, attempt) -> None:
        criocheck.CrioKubelet._stop_runtime(self, attempt)

    def _daemons(self) -> list:
        return self._namespace_daemons() + criocheck.CrioKubelet._daemons(self)


def toolkit_rbac(namespace: str, account: str, pods: bool = False) -> list:
    """The namespace, a service account in it, and what the toolkit's commands need, no more:
    `toolkit report` (get and patch Nodes, patch their status, create events) and, with pods,
    `toolkit validate` (create, get and delete pods in the namespace)."""
    subject = [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]
    docs = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": f"{account}-report"},
         "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
                   {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
                   {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": f"{account}-report"}, "subjects": subject,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"{account}-report"}},
    ]  # fmt: skip
    if pods:
        docs += [
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": f"{account}-pods", "namespace": namespace},
             "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "delete"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": f"{account}-pods", "namespace": namespace}, "subjects": subject,
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{account}-pods"}},
        ]  # fmt: skip
    return docs


@contextlib.contextmanager
def control_plane(workdir):
    """The control plane alone (etcd, the API server, the controller-manager and the scheduler),
    no node: for what talks to the API only. Yields the Cluster, whose kubectl is the admin's."""
    cluster = Cluster(workdir, None)
    cluster.bin = programs()
    os.makedirs(cluster.pki, exist_ok=True)
    try:
        cluster._certificates()
        cluster._start_control_plane(90)
        yield cluster
    finally:
        cluster._stop_control_plane()
        cluster.footprint.close()


@contextlib.contextmanager
def cluster_on(host: dict, tmp, hook_settings: str):
    """A started Cluster under tmp whose node's hook reads the simulated host's configuration with
    the YAML lines hook_settings added (hookcheck.config_with); closed after the block, the host
    then checked (kubeletcheck.running). The set-up of the cluster and DaemonSet tests."""
    programs()
    with kubeletcheck.running(Cluster(tmp / "node", config_with(host, tmp, hook_settings))) as cluster:
        yield cluster


@contextlib.contextmanager
def cluster_of_its_own(tmp, node_files: dict, runtime: str = "containerd"):
    """A started Cluster under tmp whose node is a host of its own (Cluster's node_files) running
    runtime: containerd, its config.toml the administrators' (cricheck.user_config); crio:
    CrioCluster. node_files are written there too; closed after the block, this machine then
    checked (kubeletcheck.running)."""
    programs()
    with kubeletcheck.running(node_of_its_own(tmp / "node", node_files, runtime)) as cluster:
        yield cluster


def node_of_its_own(workdir, node_files: dict, runtime: str = "containerd", **options) -> Cluster:
    """A Cluster (not started) whose node is a host of its own running runtime (containerd: its
    config.toml the administrators', cricheck.user_config; crio: CrioCluster), node_files written
    there; options: Cluster's."""
    import cricheck

    if runtime == "crio":
        return CrioCluster(workdir, None, node_files=dict(node_files), **options)
    files = {"/etc/containerd/config.toml": cricheck.user_config(os.path.join(str(workdir), "containerd")),
             **node_files}  # fmt: skip
    return Cluster(workdir, None, node_files=files, **options)


# A node lost is noticed in 20 s, and its pods are evicted 10 s after (the defaults: 50 s and 300 s).
LOST_NODE_FLAGS = {
    "kube-controller-manager": ["--node-monitor-grace-period=20s", "--node-monitor-period=2s"],
    "kube-apiserver": ["--default-not-ready-toleration-seconds=10", "--default-unreachable-toleration-seconds=10"],
}  # fmt: skip


@contextlib.contextmanager
def nodes_of_their_own(tmp, nodes: list, control_flags: dict | None = None, timeout: float = 180):
    """A cluster of several nodes on this machine, as kind makes one: one control plane, and each
    node a host of its own (node_of_its_own) with a network of its own (Cluster's address), its
    own cgroup root, its own kubelet and runtime. nodes: [{"name", "runtime", "files", "mounts"}]
    (mounts: Cluster's node_mounts); the first node runs the control plane (control_flags its
    flags). Yields {name: its Cluster}, in that order. After the block every workload is deleted,
    the nodes are closed in the reverse order (each kubelet restores the sysctls it found), the
    control plane last, and this machine is checked as it was before (kubeletcheck.host_state)."""
    programs()
    before = kubeletcheck.host_state()
    started: dict = {}
    try:
        for n, spec in enumerate(nodes):
            first = next(iter(started.values()), None)
            extra = {"control_flags": control_flags} if first is None else {"joins": first}
            node = node_of_its_own(tmp / spec["name"], spec.get("files", {}), spec.get("runtime", "containerd"),
                                   node_name=spec["name"], address=f"10.79.0.{n + 2}",
                                   cgroup_root=f"oci-gpu-hook-{spec['name']}-{os.getpid()}",
                                   node_mounts=spec.get("mounts"), **extra)  # fmt: skip
            node.start(timeout)
            started[spec["name"]] = node
        yield started
    finally:
        errors = []
        if started:
            first = next(iter(started.values()))
            try:
                first.kubectl("delete", "daemonsets,deployments,replicasets,pods", "--all", "--all-namespaces",
                              "--grace-period=1", "--wait=true", "--timeout=120s", check=False,
                              timeout=180)  # fmt: skip
            except Exception as e:  # the nodes must still be closed
                errors.append(f"deleting the workloads: {e!r}")
        for node in reversed(list(started.values())):
            try:
                node.close()
            except AssertionError as e:
                errors.append(str(e))
        if errors:
            raise AssertionError("the cluster was not fully cleaned up:\n" + "\n".join(errors))
    assert kubeletcheck.host_state() == before


NODE_DAEMONSETS = ("oci-gpu-hook-node", "oci-gpu-hook-toolkit")  # what sees the host's driver and records
TOOLKIT = "oci-gpu-hook-toolkit"


def node_manifests(host: dict, tmp, records: str | None, port: int | None, toolkit: dict,
                   keep_node_selectors: bool = False, keep_propagation: bool = False,
                   moved: bool = True) -> list:  # fmt: skip
    """deploy/kubernetes/*.yaml, with what names the host changed for the simulated one: the pods'
    configuration (the simulated driver root, sysfs and the hook's records directory), hostPath
    volumes for those (the simulated root read-only for labels, whose sysfs it is), the host paths
    of the inventory cache, features.d and the MPS root (the test's own), the exporter's port, no
    mount propagation unless keep_propagation (this machine's / is not a shared mount: it has no
    systemd; a Cluster's node of its own has one), the
    host's network for the labels pod too (no CNI plugin here). No NFD nodeSelector unless
    keep_node_selectors (NFD is not here: the test labels the node as it would). The toolkit's
    container: env values toolkit {NAME: value} (RESTART, INSTALL), and, as this cluster has no
    Service network and no pod network, the API server by its address and validation pods in the
    node's network. moved False (a node of its own, as the node VM): the node's own paths for the
    cache, features.d, the MPS root and the records; tmp unused. records, port None: the manifest's."""
    import glob

    import yaml

    docs = []
    for path in sorted(glob.glob(os.path.join(kubeletcheck.REPO, "deploy", "kubernetes", "*.yaml"))):
        with open(path) as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    root = host["root"]
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            config = yaml.safe_load(doc["data"]["config.yaml"])
            config.update(driver_root=root, dev_root=root, proc_root=root)
            if records is not None:
                config["records_directory"] = records
            # features_file stays the manifest's: the features volume below puts it under tmp.
            # sys_root: the simulated host's sysfs (its PCI classes, its DMI name), as proc_root.
            config["node"]["sys_root"] = root
            if port is not None:
                config["node"]["exporter_listen"] = f":{port}"
            doc["data"]["config.yaml"] = yaml.safe_dump(config)
        elif doc["kind"] == "DaemonSet":
            spec = doc["spec"]["template"]["spec"]
            if not keep_node_selectors:
                spec.pop("nodeSelector")
            places = {"/run/oci-gpu-hook": "run", "/etc/kubernetes/node-feature-discovery/features.d": "features",
                      "/run/nvidia/mps": "mps", "/var/cache/oci-gpu-hook-node": "cache"}  # fmt: skip
            for volume in spec["volumes"]:
                if moved and "hostPath" in volume and volume["hostPath"]["path"] in places:
                    volume["hostPath"]["path"] = str(tmp / places[volume["hostPath"]["path"]])  # the type stays
            spec["volumes"].append({"name": "simulated-host", "hostPath": {"path": root, "type": "Directory"}})
            node_pod = doc["metadata"]["name"] in NODE_DAEMONSETS
            if node_pod and moved:
                spec["volumes"].append({"name": "records", "hostPath": {"path": str(tmp / "run"), "type": "Directory"}})
            else:
                spec["hostNetwork"] = True  # no CNI plugin here to give the pod a network of its own
            for container in spec["containers"]:
                # HostToContainer needs / to be a shared mount, as systemd makes it; this machine
                # has no systemd, and its / is private.
                for mount in container["volumeMounts"]:
                    if not keep_propagation:
                        mount.pop("mountPropagation", None)
                if node_pod:
                    container["volumeMounts"].append({"name": "simulated-host", "mountPath": root})
                    if moved:
                        container["volumeMounts"].append({"name": "records", "mountPath": str(tmp / "run")})
                else:  # its sysfs (the node's own /sys in the pod), read-only as that is
                    container["volumeMounts"].append({"name": "simulated-host", "mountPath": root, "readOnly": True})
                for port_spec in container.get("ports", []) if port is not None else []:
                    port_spec["containerPort"] = port
            if doc["metadata"]["name"] == TOOLKIT:
                (container,) = spec["containers"]
                for env in container["env"]:
                    env["value"] = toolkit.get(env["name"], env.get("value"))
                    if env["value"] is None:
                        env.pop("value")
                container["command"] += ["--api-server", f"https://127.0.0.1:{API_PORT}", "--host-network"]
    if moved:
        (tmp / "run").mkdir(exist_ok=True)
        (tmp / "features").mkdir(mode=0o755, exist_ok=True)  # NFD's worker makes features.d
    return docs
