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

import kubeletcheck
from hookcheck import config_with

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


class Cluster(kubeletcheck.ContainerdKubelet):
    """The control plane and a kubelet on containerd, started by start() (or `with`), stopped and
    undone by close(). hook_config: the hook's --config in containerd's base spec."""

    def __init__(self, workdir, hook_config: str | None, **options):
        super().__init__(workdir, hook_config, **options)
        self.pki = os.path.join(self.workdir, "pki")
        self.bin: dict = {}
        self.control: list = []  # (Popen, name, log) in start order
        self.kubeconfigs: dict = {}

    # --- life cycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 90) -> Cluster:
        self.bin = programs()
        os.makedirs(self.pki, exist_ok=True)
        try:
            self._certificates()
            self._start_control_plane(timeout)
        except BaseException:
            self._stop_control_plane()
            raise
        return super().start(timeout)  # containerd, the image, the kubelet (close() on failure)

    def _certificates(self) -> None:
        pki = self.pki
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
            "kubelet": (f"/O=system:nodes/CN=system:node:{self.node_name}", None),
        }  # fmt: skip
        for name, (subject, san) in clients.items():
            _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{pki}/{name}.key", "-out",
                     f"{pki}/{name}.csr", "-subj", subject)  # fmt: skip
            extra = []
            if san:
                with open(f"{pki}/{name}.ext", "w") as f:
                    f.write(san + "\n")
                extra = ["-extfile", f"{pki}/{name}.ext"]
            _openssl("x509", "-req", "-in", f"{pki}/{name}.csr", "-CA", f"{pki}/ca.crt", "-CAkey", f"{pki}/ca.key",
                     "-CAcreateserial", "-out", f"{pki}/{name}.crt", "-days", "2", *extra)  # fmt: skip
        for name in ("admin", "controller-manager", "scheduler", "kubelet"):
            self.kubeconfigs[name] = self._kubeconfig(name)

    def _kubeconfig(self, name: str) -> str:
        path = os.path.join(self.pki, f"{name}.kubeconfig")
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": f"https://127.0.0.1:{API_PORT}",
                                                      "certificate-authority": f"{self.pki}/ca.crt"}}],
            "users": [{"name": name, "user": {"client-certificate": f"{self.pki}/{name}.crt",
                                              "client-key": f"{self.pki}/{name}.key"}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": name}}],
            "current-context": "test",
        }  # fmt: skip
        with open(path, "w") as f:
            json.dump(doc, f)  # JSON is YAML
        return path

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
        pki, b = self.pki, self.bin
        self._spawn("etcd", [b["kcp-etcd"], "-data-dir", os.path.join(self.workdir, "etcd"), "-client-url",
                             f"http://127.0.0.1:{ETCD_PORT}", "-unsafe-no-fsync"])  # fmt: skip
        self._wait(lambda: self._http_ok(f"http://127.0.0.1:{ETCD_PORT}/health"), timeout, "etcd to be healthy")
        self._spawn("kube-apiserver", [
            b["kube-apiserver"], f"--etcd-servers=http://127.0.0.1:{ETCD_PORT}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={API_PORT}", f"--tls-cert-file={pki}/apiserver.crt",
            f"--tls-private-key-file={pki}/apiserver.key", f"--client-ca-file={pki}/ca.crt",
            "--service-account-issuer=https://kubernetes.default.svc", f"--service-account-key-file={pki}/sa.pub",
            f"--service-account-signing-key-file={pki}/sa.key", "--service-cluster-ip-range=10.96.0.0/24",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction", "--allow-privileged=true",
            f"--kubelet-client-certificate={pki}/apiserver-kubelet-client.crt",
            f"--kubelet-client-key={pki}/apiserver-kubelet-client.key", "--endpoint-reconciler-type=none",
        ])  # fmt: skip
        self._wait(lambda: self.kubectl("get", "--raw", "/readyz", check=False).returncode == 0, timeout,
                   "the API server to be ready")  # fmt: skip
        cm = self.kubeconfigs["controller-manager"]
        self._spawn("kube-controller-manager", [
            b["kube-controller-manager"], f"--kubeconfig={cm}", f"--authentication-kubeconfig={cm}",
            f"--authorization-kubeconfig={cm}", "--bind-address=127.0.0.1", f"--secure-port={CONTROLLER_MANAGER_PORT}",
            "--leader-elect=false", f"--service-account-private-key-file={pki}/sa.key", f"--root-ca-file={pki}/ca.crt",
            "--use-service-account-credentials=true", f"--cluster-signing-cert-file={pki}/ca.crt",
            f"--cluster-signing-key-file={pki}/ca.key",
        ])  # fmt: skip
        sc = self.kubeconfigs["scheduler"]
        self._spawn("kube-scheduler", [
            b["kube-scheduler"], f"--kubeconfig={sc}", f"--authentication-kubeconfig={sc}",
            f"--authorization-kubeconfig={sc}", "--bind-address=127.0.0.1", f"--secure-port={SCHEDULER_PORT}",
            "--leader-elect=false",
        ])  # fmt: skip
        # Pods need the namespace's default ServiceAccount, which the controller-manager makes.
        self._wait(lambda: self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0, timeout,
                   "the default ServiceAccount")  # fmt: skip

    def _containerd_config(self) -> str:
        # Without a CNI configuration containerd reports NetworkReady=false and the node is never
        # Ready; one that no pod uses (all pods use the host's network) is enough.
        conf = os.path.join(self.containerd_dir, "cni", "conf")
        os.makedirs(conf, exist_ok=True)
        with open(os.path.join(conf, "10-unused.conflist"), "w") as f:
            json.dump({"cniVersion": "0.4.0", "name": "unused", "plugins": [{"type": "loopback"}]}, f)
        return super()._containerd_config()

    def _kubelet_flags(self) -> list:
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": f"unix://{self.address}",
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,  # this machine's hybrid cgroups count as v1
            "failSwapOn": False,
            "address": "127.0.0.1",
            "port": KUBELET_PORT,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": KUBELET_HEALTHZ_PORT,
            "readOnlyPort": 0,
            "authentication": {"x509": {"clientCAFile": f"{self.pki}/ca.crt"}, "webhook": {"enabled": False},
                               "anonymous": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "volumePluginDir": os.path.join(self.kubelet_dir, "volume-plugins"),
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            # Otherwise it adds KUBE-FIREWALL (dropping non-loopback traffic to 127/8), hint and
            # canary chains to the host's iptables, in both families, and keeps them there.
            "makeIPTablesUtilChains": False,
        }  # fmt: skip
        path = os.path.join(self.workdir, "kubelet-config.json")
        with open(path, "w") as f:
            json.dump(config, f)
        return [f"--config={path}", f"--kubeconfig={self.kubeconfigs['kubelet']}",
                f"--hostname-override={self.node_name}", f"--root-dir={self.kubelet_dir}", "--v=2"]  # fmt: skip

    def _kubelet_program(self) -> str:
        return self.bin["kubelet"]

    def _kubelet_ready(self) -> bool:
        node = self.node()
        conditions = (node or {}).get("status", {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

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
