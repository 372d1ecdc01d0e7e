"""node/rollout.py's decisions: which runtime to install for, and whether a stopping pod uninstalls
(the whole rollout on a real cluster: tests/e2e/test_toolkit_rollout.py)."""

import pytest

from oci_gpu_hook.errors import PrerequisiteError
from oci_gpu_hook.node import rollout


def node_running(version):
    return {"status": {"nodeInfo": {"containerRuntimeVersion": version}}}


def test_the_runtime_is_the_one_the_kubelet_reports():
    assert rollout.runtime_of(node_running("containerd://1.6.20")) == "containerd"
    assert rollout.runtime_of(node_running("cri-o://1.30.4")) == "crio"
    with pytest.raises(PrerequisiteError, match=r"runtime is docker://24\.0: the toolkit installs for containerd"):
        rollout.runtime_of(node_running("docker://24.0"))
    with pytest.raises(PrerequisiteError, match="runtime is not reported"):
        rollout.runtime_of({"status": {}})


def pod_of(uid="ds-1"):
    return {"metadata": {"ownerReferences": [{"kind": "DaemonSet", "name": "oci-gpu-hook-toolkit", "uid": uid}]}}


def test_only_a_removed_daemonset_uninstalls():
    """A rolling update ends the pod too, with its DaemonSet still there: the hook stays (the next
    pod replaces the bundle); a DaemonSet gone, being deleted, or made again under the same name
    (another uid) is a removal."""
    daemonset = {"metadata": {"uid": "ds-1"}}
    assert rollout.removed(pod_of(), daemonset) is False
    assert rollout.removed(pod_of(), None) is True
    assert rollout.removed(pod_of(), {"metadata": {"uid": "ds-1", "deletionTimestamp": "2026-11-30T05:00:00Z"}})
    assert rollout.removed(pod_of(), {"metadata": {"uid": "ds-2"}}) is True
    assert rollout.removed(None, daemonset) is True  # the pod itself could not be read: it is gone
    assert rollout.removed({"metadata": {}}, None) is False  # no DaemonSet made it: nothing says remove
