"""`oci-gpu-hook toolkit rollout`: what the toolkit DaemonSet runs on each GPU node
(deploy/kubernetes/25-toolkit.yaml; issue 47). A round, then another every interval seconds:
1. install: the image's bundle onto the host and `install` there for the node's runtime
   (toolkit/host.py), which restarts the runtime only when what it reads at start changed.
   Skipped with --no-install, where the hook came another way (the RPM);
2. gate toolkit (node/gate_validation.py); an install that failed fails it, with install's line;
3. gate plugin, once gate toolkit passed: the device plugin registers on that verdict
   (`device-plugin --gate`), so the pod this gate makes can be scheduled only then. While gate
   toolkit has not passed, gate plugin is pending: nothing downstream acts on an old pass;
4. report: labels, the GPUHookReady condition and events on the Node (node/gate_report.py).
Each round repeats all four: a runtime whose configuration was changed under the hook fails
gate toolkit at the next round, and the device plugin withdraws the node's GPUs.

On SIGTERM it uninstalls, but only when its DaemonSet is gone or being deleted (removed): a
rolling update also ends this pod, and the next one, of the same DaemonSet, finds the hook in
place and replaces the bundle in one rename, so that no container starts without a hook. Where
the API does not say, the hook stays. Removing, it first fails gate toolkit (the device plugin
withdraws the GPUs), then uninstalls, then takes the gates' file, the Node's gate labels and its
condition back, and exits.
"""

from __future__ import annotations

import os
import signal
import time

from oci_gpu_hook.errors import HookError, PrerequisiteError
from oci_gpu_hook.node import gate_report, gate_validation, gates
from oci_gpu_hook.node.kubeapi import ApiError, Client

INTERVAL = 300.0
# containerRuntimeVersion's scheme (the kubelet's "containerd://1.6.20", "cri-o://1.30.4"): install's runtime.
RUNTIMES = {"containerd": "containerd", "cri-o": "crio"}


class Stopped(BaseException):
    """SIGTERM, raised where a round may be cut short (a validation pod's wait, the sleep between
    rounds); never in install, which a cut would leave half done."""


def runtime_of(node: dict) -> str:
    """install's --runtime for the Node, from the runtime its kubelet reports."""
    version = (node.get("status", {}).get("nodeInfo") or {}).get("containerRuntimeVersion") or ""
    scheme = version.split("://", 1)[0]
    if scheme not in RUNTIMES:
        raise PrerequisiteError(f"the node's runtime is {version or 'not reported'}: the toolkit installs for "
                                f"{' and '.join(RUNTIMES)} (--runtime)")  # fmt: skip
    return RUNTIMES[scheme]


def owner(pod: dict | None) -> dict | None:
    """The ownerReference of the DaemonSet that made pod, if one did."""
    references = ((pod or {}).get("metadata") or {}).get("ownerReferences") or []
    return next((o for o in references if o.get("kind") == "DaemonSet"), None)


def removed(pod: dict | None, daemonset: dict | None) -> bool:
    """Whether this pod ends because its DaemonSet is being taken away: the pod, as the API has it
    still, was made by a DaemonSet that is gone (daemonset None) or being deleted. Nothing else
    is: a rolling update (the same DaemonSet), a DaemonSet made again under the name (another uid:
    its own pod takes over the node), a pod the API no longer has (pod None: force-deleted, or
    its credentials gone), which says nothing of the DaemonSet, and a pod no DaemonSet made."""
    made_by = owner(pod)
    if made_by is None:
        return False
    if daemonset is None:
        return True
    meta = daemonset.get("metadata", {})
    return meta.get("uid") == made_by.get("uid") and bool(meta.get("deletionTimestamp"))


def restarts_on_removal(runtime: str | None) -> bool:
    """Whether uninstall restarts the runtime when the DaemonSet is removed. Not CRI-O: it stops
    this very pod's container (StopContainer, until the grace period ends), and its graceful stop
    waits for that call, so a restart asked from this pod waits on itself. Nor does it need one:
    CRI-O watches its hooks directories, and forgets the hook once uninstall removes its file
    there (the drop-in it read at start names directories only). containerd's base spec names
    the hook's program: it must read its configuration again before the program goes."""
    return runtime != "crio"


def validation_selinux_type(host_root: str) -> str | None:
    """The SELinux type of the validation pods on the node whose root is at host_root: the module's
    GPU container domain where the node's kernel has SELinux (its selinuxfs, seen through the
    host's root: the pod's own /sys has none), since container_t may not open the GPU's nodes
    and a GPU pod there runs so; None elsewhere (no seLinuxOptions at all)."""
    from oci_gpu_hook.toolkit import policy_module

    enabled = os.path.exists(os.path.join(host_root, "sys/fs/selinux/enforce"))
    return policy_module.CONTAINER_DOMAIN if enabled else None


class Rollout:
    """One node's rollout. install(runtime) and uninstall(restart) are toolkit/host.py's steps with
    their options bound (install None: --no-install; restart False: the runtime is not restarted);
    inventory() loads the node's GPUs; say(line) prints."""

    def __init__(self, client: Client, node: str, namespace: str, pod: str | None, image: str, gates_file: str,
                 inventory, install, uninstall, say, runtime: str | None = None, timeout: float = 120.0,
                 host_network: bool = False, selinux_type: str | None = None):  # fmt: skip
        self.client, self.node, self.namespace, self.pod, self.image = client, node, namespace, pod, image
        self.gates_file, self.inventory, self.install, self.uninstall = gates_file, inventory, install, uninstall
        self.say, self.runtime, self.timeout, self.host_network = say, runtime, timeout, host_network
        self.selinux_type = selinux_type  # the validation pods' (gate_validation.pod)
        self._interruptible = False
        self._stopping = False

    # --- a round ---------------------------------------------------------------------------

    def round(self) -> None:
        try:
            line = self._toolkit()
        except ApiError:
            raise  # the API server away: the round ends, and the verdicts stand
        except HookError as e:  # install, the node's runtime, its inventory: gate toolkit says it
            line = gate_validation.record(self.gates_file, {  # the last verdict's line is said
                "plugin": gates.verdict("pending"),
                "toolkit": gates.verdict("failed", str(e), f"oci-gpu-hook doctor on the node; kubectl logs -n "
                                         f"{self.namespace} {self.pod or 'the toolkit pod'}")})  # fmt: skip
        self.say(line)
        passed = line == gates.line("toolkit", gates.verdict("passed"))
        if not passed:
            gate_validation.record(self.gates_file, {"plugin": gates.verdict("pending")})
        self._report()  # the Node says gate toolkit's verdict before gate plugin's pod runs
        if passed:
            self.say(self._interruptible_call(self._validate, "plugin", None))
            self._report()

    def _toolkit(self) -> str:
        """Install, then gate toolkit; its line."""
        if self.install is not None:
            runtime = self.runtime or runtime_of(self.client.get(f"/api/v1/nodes/{self.node}"))
            try:
                for line in self.install(runtime):
                    self.say(line)
            except HookError as e:
                raise PrerequisiteError(f"install on the host failed: {e}") from None
        _, whole = gate_validation.gpus(self.inventory())
        if not whole:
            raise PrerequisiteError("this node's inventory lists no full GPU to validate with")
        return self._interruptible_call(self._validate, "toolkit", whole[-1])

    def _validate(self, gate: str, uuid: str | None) -> str:
        known, _ = gate_validation.gpus(self.inventory())
        return gate_validation.validate(self.client, gate, self.node, self.namespace, self.image, self.gates_file,
                                        known, uuid, timeout=self.timeout, host_network=self.host_network,
                                        selinux_type=self.selinux_type)  # fmt: skip

    def _report(self) -> None:
        try:
            verdicts, untrusted = gates.read(self.gates_file), None
        except ValueError as e:
            verdicts, untrusted = None, f"the gates' verdicts cannot be trusted: {e}"
        try:
            # The events in "default": the API puts those about a cluster-wide object (a Node) there.
            for line in gate_report.report(self.client, self.node, verdicts, "default", untrusted):
                self.say(line)
        except ApiError as e:  # the verdicts stand (the device plugin reads them); the next round reports
            self.say(f"report: {e}")

    # --- the loop and its end --------------------------------------------------------------

    def run(self, interval: float = INTERVAL, once: bool = False) -> None:
        """Rounds until SIGTERM (once: one round); then uninstall when removed()."""
        previous = signal.signal(signal.SIGTERM, self._on_term)
        try:
            try:
                while not self._stopping:
                    try:
                        self.round()
                    except ApiError as e:  # the API server away: the node keeps what it had
                        self.say(f"round: {e}")
                    if once:
                        return
                    self._interruptible_call(time.sleep, interval)
            except Stopped:
                pass
            self._ended()
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _on_term(self, signum, frame) -> None:
        self._stopping = True
        if self._interruptible:
            self._interruptible = False
            raise Stopped

    def _interruptible_call(self, function, *args):
        if self._stopping:
            raise Stopped
        self._interruptible = True
        try:
            return function(*args)
        finally:
            self._interruptible = False

    def _ended(self) -> None:
        try:  # what a cut round left
            gate_validation.remove_pods(self.client, self.node, self.namespace)
        except HookError:
            pass
        if self.pod is None or self.uninstall is None:
            self.say("stopping: the hook stays on the host")
            return
        try:
            removing = self._removed()
        except ApiError as e:  # no way to tell a removal from an update: keep what works
            self.say(f"stopping, and the hook stays on the host: cannot tell whether the DaemonSet is removed ({e})")
            return
        if not removing:
            self.say("stopping, and the hook stays on the host: the DaemonSet is not being deleted")
            return
        self.say("the DaemonSet is being removed: uninstalling from the host")
        # First the GPUs withdrawn (the device plugin reads the verdict), then the hook taken away.
        fix = "delete the toolkit DaemonSet's pods again, or run oci-gpu-hook uninstall on the node"
        self.say(gate_validation.record(self.gates_file, {
            "plugin": gates.verdict("pending"),
            "toolkit": gates.verdict("failed", "the toolkit DaemonSet is being removed", fix)}))  # fmt: skip
        self._report()
        try:
            runtime = self.runtime or runtime_of(self.client.get(f"/api/v1/nodes/{self.node}"))
        except HookError:
            runtime = None  # not known: restarted as configured
        try:
            for line in self.uninstall(restarts_on_removal(runtime)):
                self.say(line)
        except HookError as e:  # the GPUs stay withdrawn, and the Node says why
            self.say(gate_validation.record(self.gates_file, {"toolkit": gates.verdict(
                "failed", f"uninstall on the host failed: {e}", "oci-gpu-hook uninstall on the node")}))  # fmt: skip
            self._report()
            raise
        try:
            os.unlink(self.gates_file)
        except FileNotFoundError:
            pass
        try:
            for line in gate_report.take_back(self.client, self.node):
                self.say(line)
        except ApiError as e:
            self.say(f"the Node's gate labels and condition stay: {e}")

    def _removed(self) -> bool:
        """removed() for this pod and its DaemonSet as the API has them now; ApiError when the API
        does not say (no answer)."""
        # A pod the API will not show (gone, or these credentials gone) says nothing: None.
        pod = self._read(f"/api/v1/namespaces/{self.namespace}/pods/{self.pod}", (401, 403, 404))
        made_by = owner(pod)
        if made_by is None:
            return False
        name = made_by.get("name")
        # Only a 404 says the DaemonSet is gone; a refusal raises (cannot tell).
        return removed(pod, self._read(f"/apis/apps/v1/namespaces/{self.namespace}/daemonsets/{name}", (404,)))

    def _read(self, path: str, absent: tuple) -> dict | None:
        """The object at path; None on an answer in absent; ApiError on any other failure."""
        try:
            return self.client.get(path)
        except ApiError as e:
            if e.status in absent:
                return None
            raise
