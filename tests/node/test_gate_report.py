"""node/gate_report.py's condition, and node/kubeapi.py's refusals (against a real API server:
tests/e2e/test_gate_report_api.py)."""

import pytest

from oci_gpu_hook.node import gate_report, gates, kubeapi


def test_the_condition_is_true_only_once_every_gate_passed():
    pending, passed = gates.verdict("pending"), gates.verdict("passed")
    failed = gates.verdict("failed", "the pod saw 0 GPUs", "see its events")
    assert gate_report.condition({"toolkit": passed, "plugin": pending}) == {
        "status": "Unknown", "reason": "GatesPending", "message": "gates pending: plugin"}  # fmt: skip
    assert gate_report.condition({"toolkit": pending, "plugin": failed}) == {
        "status": "False", "reason": "GatePluginFailed",
        "message": "gate plugin failed: the pod saw 0 GPUs (fix: see its events)"}  # fmt: skip
    assert gate_report.condition({"toolkit": passed, "plugin": passed})["status"] == "True"


def test_the_client_speaks_https_to_a_server_it_can_verify(tmp_path, monkeypatch):
    with pytest.raises(kubeapi.ApiError, match="over https:// only"):
        kubeapi.Client("http://127.0.0.1:6443", "/dev/null", "/dev/null")
    (tmp_path / "ca.crt").write_text("not a certificate\n")
    with pytest.raises(kubeapi.ApiError, match=r"ca\.crt: not the API server's CA"):
        kubeapi.Client("https://127.0.0.1:6443", "/dev/null", str(tmp_path / "ca.crt"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(kubeapi.ApiError, match="KUBERNETES_SERVICE_HOST is not set"):
        kubeapi.Client.from_environment()
