"""node/rollout.py's decisions: which runtime to install for, whether a stopping pod uninstalls, and
the validation pods' SELinux type (the whole rollout on a real cluster:
tests/e2e/test_toolkit_rollout.py)."""

import pytest

from oci_gpu_hook.errors import PrerequisiteError
from oci_gpu_hook.node import gate_validation, rollout


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
    pod replaces the bundle). Only positive evidence is a removal: the pod, still there, was made
    by a DaemonSet that is gone or being deleted. A DaemonSet made again under the name (another
    uid) takes the node over with its own pod; a pod the API no longer shows (force-deleted, or
    the credentials gone) says nothing of the DaemonSet."""
    daemonset = {"metadata": {"uid": "ds-1"}}
    deleting = {"metadata": {"uid": "ds-1", "deletionTimestamp": "2026-11-30T05:00:00Z"}}
    assert rollout.removed(pod_of(), daemonset) is False
    assert rollout.removed(pod_of(), None) is True
    assert rollout.removed(pod_of(), deleting) is True
    assert rollout.removed(pod_of(), {"metadata": {"uid": "ds-2"}}) is False
    assert rollout.removed(pod_of("ds-2"), deleting) is False  # another DaemonSet's deletion
    assert rollout.removed(None, None) is False
    assert rollout.removed({"metadata": {}}, None) is False  # no DaemonSet made it


def test_removal_restarts_containerd_but_not_crio():
    """containerd's base spec names the hook's program: it reads its configuration again before
    the program goes. CRI-O would wait on this pod's own stop, and forgets the hook by itself."""
    assert rollout.restarts_on_removal("containerd") is True
    assert rollout.restarts_on_removal(None) is True
    assert rollout.restarts_on_removal("crio") is False


def test_on_a_node_with_selinux_the_validation_pods_run_in_the_gpu_domain(tmp_path):
    """Where the host's root shows a selinuxfs, gate_validation's pods get exactly the type a GPU
    pod there runs in (the admission policy allows that one, with no user, role or level);
    elsewhere no seLinuxOptions at all."""
    assert rollout.validation_selinux_type(str(tmp_path)) is None
    plain = gate_validation.pod("plugin", "node-a", "oci-gpu-hook", "image")
    assert "seLinuxOptions" not in plain["spec"]["containers"][0]["securityContext"]
    (tmp_path / "sys/fs/selinux").mkdir(parents=True)
    (tmp_path / "sys/fs/selinux/enforce").write_text("1")
    kind = rollout.validation_selinux_type(str(tmp_path))
    assert kind == "gpu_container_t"
    confined = gate_validation.pod("toolkit", "node-a", "oci-gpu-hook", "image", "GPU-1", selinux_type=kind)
    assert confined["spec"]["containers"][0]["securityContext"]["seLinuxOptions"] == {"type": "gpu_container_t"}
    assert "securityContext" not in confined["spec"]  # nothing pod-wide
