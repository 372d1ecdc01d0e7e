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
place and replaces the bundle in one rename, so that no container starts without a hook. It then
takes the gates' file and the Node's gate labels back, and exits.
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
GONE = (401, 403, 404)  # no pod, no DaemonSet, or no credentials left: the deployment is being removed


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
    """Whether this pod ends because its DaemonSet is gone or being deleted, not by a rolling
    update (the same DaemonSet, which makes the next pod). pod None: it could not be read."""
    if pod is None:
        return True
    made_by = owner(pod)
    if made_by is None:
        return False  # not a DaemonSet's: nothing says the rollout is being taken away
    if daemonset is None:
        return True
    meta = daemonset.get("metadata", {})
    return meta.get("uid") != made_by.get("uid") or bool(meta.get("deletionTimestamp"))


class Rollout:
    """One node's rollout. install(runtime) and uninstall() are toolkit/host.py's steps with their
    options bound (install None: --no-install); inventory() loads the node's GPUs; say(line)
    prints."""

    def __init__(self, client: Client, node: str, namespace: str, pod: str | None, image: str, gates_file: str,
                 inventory, install, uninstall, say, runtime: str | None = None, timeout: float = 120.0,
                 host_network: bool = False):  # fmt: skip
        self.client, self.node, self.namespace, self.pod, self.image = client, node, namespace, pod, image
        self.gates_file, self.inventory, self.install, self.uninstall = gates_file, inventory, install, uninstall
        self.say, self.runtime, self.timeout, self.host_network = say, runtime, timeout, host_network
        self._interruptible = False
        self._stopping = False

    # --- a round ---------------------------------------------------------------------------

    def round(self) -> None:
        failed = None  # (why, fix) of a gate toolkit that failed before its pod
        if self.install is not None:
            runtime = self.runtime or runtime_of(self.client.get(f"/api/v1/nodes/{self.node}"))
            try:
                for line in self.install(runtime):
                    self.say(line)
            except HookError as e:
                failed = (f"install on the host failed: {e}", "oci-gpu-hook doctor on the node; kubectl logs -n "
                          f"{self.namespace} {self.pod or 'the toolkit pod'}")  # fmt: skip
        if failed is None:
            _, whole = gate_validation.gpus(self.inventory())
            if whole:
                line = self._interruptible_call(self._validate, "toolkit", whole[-1])
            else:
                failed = ("this node's inventory lists no full GPU to validate with", "oci-gpu-hook doctor on the node")
        if failed is not None:
            line = gate_validation.record(self.gates_file, {"toolkit": gates.verdict("failed", *failed),
                                                            "plugin": gates.verdict("pending")})  # fmt: skip
        self.say(line)
        if line != gates.line("toolkit", gates.verdict("passed")):
            gate_validation.record(self.gates_file, {"plugin": gates.verdict("pending")})
        self._report()  # the Node says gate toolkit's verdict before gate plugin's pod runs
        if line == gates.line("toolkit", gates.verdict("passed")):
            self.say(self._interruptible_call(self._validate, "plugin", None))
            self._report()

    def _validate(self, gate: str, uuid: str | None) -> str:
        known, _ = gate_validation.gpus(self.inventory())
        return gate_validation.validate(self.client, gate, self.node, self.namespace, self.image, self.gates_file,
                                        known, uuid, timeout=self.timeout, host_network=self.host_network)  # fmt: skip

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
        if self.pod is None or self.uninstall is None:
            self.say("stopping: the hook stays on the host")
            return
        try:
            removing = self._removed()
        except ApiError as e:  # no way to tell a removal from an update: keep what works
            self.say(f"stopping, and the hook stays on the host: cannot tell whether the DaemonSet is removed ({e})")
            return
        if not removing:
            self.say("stopping for a new pod of this DaemonSet: the hook stays on the host")
            return
        self.say("the DaemonSet is being removed: uninstalling from the host")
        for line in self.uninstall():
            self.say(line)
        try:
            os.unlink(self.gates_file)
        except FileNotFoundError:
            pass
        try:  # merge-patch null takes a label away; credentials already gone leave them
            self.client.patch(f"/api/v1/nodes/{self.node}", {"metadata": {"labels": {
                gate_report.LABEL_PREFIX + g: None for g in gates.ORDER}}})  # fmt: skip
        except ApiError as e:
            self.say(f"the Node's gate labels stay: {e}")

    def _removed(self) -> bool:
        """removed() for this pod and its DaemonSet as the API has them now; ApiError when the API
        does not say (no answer)."""
        pod = self._read(f"/api/v1/namespaces/{self.namespace}/pods/{self.pod}")
        made_by = owner(pod)
        if made_by is None:
            return removed(pod, None)
        name = made_by.get("name")
        return removed(pod, self._read(f"/apis/apps/v1/namespaces/{self.namespace}/daemonsets/{name}"))

    def _read(self, path: str) -> dict | None:
        """The object at path; None when the API says it is gone or these credentials are."""
        try:
            return self.client.get(path)
        except ApiError as e:
            if e.status in GONE:
                return None
            raise
