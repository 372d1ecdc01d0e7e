"""deploy/monitoring/: the alert rules, run by promtool on series that should fire each rule and on
near misses that should not (below the threshold, shorter than `for:`, a counter that resets, a
container with no limit, no starts at all); the PrometheusRule, which must carry the rules file's
groups; and the ServiceMonitor, whose honorLabels a real Prometheus shows keeping the workload's
pod, namespace and container on the device series (docs/alerts.md)."""

import http.server
import json
import os
import subprocess
import sys
import threading
from typing import NamedTuple

import pytest
import yaml
from servicecheck import Prometheus

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MONITORING = os.path.join(REPO, "deploy", "monitoring")
RULES = os.path.join(MONITORING, "oci-gpu-hook.rules.yml")
PROMETHEUS_RULE = os.path.join(MONITORING, "prometheusrule.yaml")
SERVICE_MONITOR = os.path.join(MONITORING, "servicemonitor.yaml")
SERVICE = os.path.join(REPO, "deploy", "kubernetes", "40-service.yaml")
JOB = "oci-gpu-hook-exporter"  # the Service's name, which the operator gives the job


def load(path: str):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def rules() -> list:
    return [rule for group in load(RULES)["groups"] for rule in group["rules"]]


def alerting_rules() -> dict:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


# --- The series the cases are made of, as the exporter labels them (docs/monitoring.md) -------------

EXPORTER = {"instance": "gpu-node-1", "job": JOB}  # what Prometheus adds to every series of the target
NODE = {**EXPORTER, "Hostname": "gpu-node-1"}
GPU0 = {"gpu": "0", "UUID": "GPU-3b9521e4-f0b2-520f-8ee3-2dbc4ee49933", "pci_bus_id": "00000000:07:00.0",
        "device": "nvidia0", "modelName": "NVIDIA A100-SXM4-40GB", "DCGM_FI_DRIVER_VERSION": "550.163.01"}  # fmt: skip
GPU1 = {**GPU0, "gpu": "1", "UUID": "GPU-e23fcfa5-35e9-5f7b-815d-619e4a20056c", "pci_bus_id": "00000000:0F:00.0",
        "device": "nvidia1"}  # fmt: skip
MIG13 = {**GPU1, "GPU_I_PROFILE": "1g.5gb", "GPU_I_ID": "13"}
MIG14 = {**GPU1, "GPU_I_PROFILE": "2g.10gb", "GPU_I_ID": "14"}
TRAINER = {"container": "trainer", "pod": "train-7f9c", "namespace": "ml"}
NOTEBOOK = {"container": "lab", "pod": "notebook-2", "namespace": "ml"}
NOBODY = {"container": "", "pod": "", "namespace": ""}  # no container holds it, or several do
GIB = 1 << 30


def series(name: str, labels: dict, values: str) -> dict:
    """An input series of promtool's. An empty label is left out: Prometheus stores none."""
    text = ",".join(f'{k}="{v}"' for k, v in labels.items() if v)
    return {"series": f"{name}{{{text}}}", "values": values}


def of(*dicts) -> dict:
    """The labels an alert carries: those of the series it came from, merged; empty ones dropped."""
    merged = {}
    for d in dicts:
        merged.update(d)
    return {k: v for k, v in merged.items() if v}


def held(device: dict, holder: dict, container_id: str) -> dict:
    """A container family's labels: the device's, then container_id, container, pod, namespace."""
    return {**device, "container_id": container_id, **holder}


class Case(NamedTuple):
    """Input series, the time the rule is looked at (minutes), and the alerts firing then:
    [(labels, rendered summary)]; [] for a near miss."""

    what: str
    input: list
    at: int
    firing: list


def _xid_cases(xid: str, name: str, device: dict = GPU0, gpu_text: str = None) -> list:
    gpu_text = gpu_text or f"GPU {device['gpu']} ({device['UUID']})"
    xids = "oci_gpu_hook_gpu_xid_errors_total"
    summary = f"XID {xid} ({name}) on gpu-node-1 {gpu_text}"
    alert = of(NODE, device, {"xid": xid})
    return [
        Case("one XID on a held GPU", [series(xids, {**NODE, **device, **TRAINER, "xid": xid}, "0x30 1x30")], 40,
             [(alert, summary)]),
        # The XID ends the pod: its series goes stale, and the device's next one, held by no
        # one, starts at 1. A rule on each series alone would see no increase.
        Case("the XID comes as the pod holding the GPU goes",
             [series(xids, {**NODE, **device, **TRAINER, "xid": xid}, "0x30 stale"),
              series(xids, {**NODE, **device, **NOBODY, "xid": xid}, "_x31 1x29")], 40, [(alert, summary)]),
        Case("none", [series(xids, {**NODE, **device, "xid": xid}, "0x60")], 40, []),
        Case("the exporter restarted: the counter went back to 0",
             [series(xids, {**NODE, **device, "xid": xid}, "3x20 0x40")], 40, []),
        Case("another XID", [series(xids, {**NODE, **device, "xid": xid}, "0x60"),
                             series(xids, {**NODE, **device, "xid": "13"}, "0x30 1x30")], 40, []),
        Case("an hour after the last one", [series(xids, {**NODE, **device, "xid": xid}, "0x10 1x80")], 75, []),
    ]  # fmt: skip


def _over_limit_cases() -> list:
    used, limit = "oci_gpu_hook_container_gpu_memory_used_bytes", "oci_gpu_hook_container_gpu_memory_limit_bytes"
    a, on_mig = held(GPU0, TRAINER, "c0ffee"), held(MIG13, TRAINER, "c0ffee")

    def both(labels: dict, in_use: str, allowed: str) -> list:
        return [series(used, {**NODE, **labels}, in_use), series(limit, {**NODE, **labels}, allowed)]

    uses = "Container ml/train-7f9c/trainer uses"
    summary = f"{uses} 9GiB of gpu-node-1 GPU 0 ({GPU0['UUID']}), over its GPU memory limit"
    mig_summary = f"{uses} 3GiB of gpu-node-1 GPU 1 MIG instance 13 ({GPU1['UUID']}), over its GPU memory limit"
    return [
        Case("9 GiB used, 8 GiB allowed, for 10 minutes", both(a, f"{9 * GIB}x10", f"{8 * GIB}x10"), 10,
             [(of(NODE, a), summary)]),
        Case("on a MIG device", both(on_mig, f"{3 * GIB}x10", f"{2 * GIB}x10"), 10, [(of(NODE, on_mig), mig_summary)]),
        Case("at the limit", both(a, f"{8 * GIB}x10", f"{8 * GIB}x10"), 10, []),
        Case("over for 3 minutes, shorter than for:", both(a, f"{8 * GIB}x9 {9 * GIB}x3", f"{8 * GIB}x12"), 12, []),
        Case("a container with no limit", [series(used, {**NODE, **a}, f"{40 * GIB}x10")], 10, []),
        Case("the limit is another container's",
             [series(used, {**NODE, **a}, f"{9 * GIB}x10"),
              series(limit, {**NODE, **held(GPU0, NOTEBOOK, "beef")}, f"{8 * GIB}x10")], 10, []),
        # One container on two MIG devices of a GPU: each use is held to its own device's limit.
        Case("two MIG devices of one container, each within its own limit",
             both(on_mig, f"{1 * GIB}x10", f"{2 * GIB}x10")
             + both(held(MIG14, TRAINER, "c0ffee"), f"{3 * GIB}x10", f"{4 * GIB}x10"), 10, []),
    ]  # fmt: skip


def _idle_cases() -> list:
    allocated, util = "oci_gpu_hook_container_gpu_allocated", "DCGM_FI_DEV_GPU_UTIL"
    own = "oci_gpu_hook_container_gpu_utilization_percent"
    a, b = held(GPU0, TRAINER, "c0ffee"), held(GPU0, NOTEBOOK, "beef")
    summary = f"ml/{{pod}}/{{container}} has held gpu-node-1 GPU 0 ({GPU0['UUID']}) for an hour without using it"
    return [
        Case("a GPU held for 70 minutes at 0%",
             [series(allocated, {**NODE, **a}, "1x70"), series(util, {**NODE, **GPU0, **TRAINER}, "0x70")], 70,
             [(of(NODE, a), summary.format(pod="train-7f9c", container="trainer"))]),
        Case("busy", [series(allocated, {**NODE, **a}, "1x70"), series(util, {**NODE, **GPU0, **TRAINER}, "60x70")],
             70, []),
        Case("idle for the last 30 minutes only",
             [series(allocated, {**NODE, **a}, "1x75"), series(util, {**NODE, **GPU0, **TRAINER}, "60x45 0x30")], 75,
             []),
        # The GPU sat idle before; the pod has held it for half an hour.
        Case("held for 30 minutes on a GPU idle for long",
             [series(allocated, {**NODE, **a}, "_x60 1x30"), series(util, {**NODE, **GPU0, **NOBODY}, "0x90")], 90,
             []),
        # Time-sliced: the GPU is busy with the trainer's work; the notebook's own use is nothing.
        Case("of two containers sharing a busy GPU, the one doing nothing",
             [series(allocated, {**NODE, **a}, "1x70"), series(allocated, {**NODE, **b}, "1x70"),
              series(util, {**NODE, **GPU0, **NOBODY}, "80x70"),
              series(own, {**NODE, **a, "engine": "sm"}, "80x70"), series(own, {**NODE, **b, "engine": "sm"}, "0x70")],
             70, [(of(NODE, b), summary.format(pod="notebook-2", container="lab"))]),
        Case("a container whose own use is high on a GPU that reads idle",
             [series(allocated, {**NODE, **a}, "1x70"), series(util, {**NODE, **GPU0, **TRAINER}, "0x70"),
              series(own, {**NODE, **a, "engine": "sm"}, "50x70")], 70, []),
        Case("a MIG device: NVML gives no utilization to judge by",
             [series(allocated, {**NODE, **held(MIG13, TRAINER, "c0ffee")}, "1x70")], 70, []),
    ]  # fmt: skip


def _start_failure_cases() -> list:
    starts, failures = "oci_gpu_hook_gpu_container_starts_total", "oci_gpu_hook_gpu_container_failures_total"

    def failing(**rising) -> list:
        """A failures series per reason, every one at 0 from the start; the ones named rise so."""
        return [series(failures, {**EXPORTER, "reason": r}, rising.get(r, "0x60"))
                for r in ("request", "inventory", "cgroup", "ldconfig", "apply")]  # fmt: skip

    summary = "20% of GPU container starts failed on gpu-node-1 in the last 30 minutes"
    return [
        Case("one start in five fails in the cgroup step",
             [series(starts, EXPORTER, "0+10x60"), *failing(cgroup="0+2x60")], 40, [(EXPORTER, summary)]),
        Case("one in twenty", [series(starts, EXPORTER, "0+20x60"), *failing(apply="0+1x60")], 40, []),
        Case("the pods' own requests refused", [series(starts, EXPORTER, "0+10x60"), *failing(request="0+5x60")], 40,
             []),
        Case("no starts at all", [series(starts, EXPORTER, "0x60"), *failing()], 40, []),
        # Not what the exporter gives (a failure is a start too), but what 0 starts would make of
        # any failure without the guard: +Inf.
        Case("failures with no start counted", [series(starts, EXPORTER, "0x60"), *failing(ldconfig="0+1x60")], 40,
             []),
        # 40 starts at once, all failing: 12% of the window's starts, for 3 minutes.
        Case("for 3 minutes, shorter than for:",
             [series(starts, EXPORTER, "0+10x30 340+10x29"), *failing(cgroup="0x30 40x29")], 34, []),
        Case("the exporter restarted: every counter went back to 0",
             [series(starts, EXPORTER, "400+10x20 0+10x40"), *failing(cgroup="40x20 0x40")], 50, []),
    ]  # fmt: skip


def _cases() -> dict:
    """{alert name: [Case]}: each alerting rule's cases; every rule has both kinds (a test checks)."""
    health, remap = "oci_gpu_hook_gpu_health", "DCGM_FI_DEV_ROW_REMAP_FAILURE"
    remapped, stale = "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "oci_gpu_hook_gpu_facts_stale"
    actions, up = "oci_gpu_hook_watchdog_actions_total", "up"
    gpu0 = f"GPU 0 ({GPU0['UUID']})"
    return {
        "GpuXid48DoubleBitEcc": _xid_cases("48", "double-bit ECC error"),
        "GpuXid79FallenOffTheBus": _xid_cases("79", "GPU fallen off the bus"),
        "GpuXid94ContainedEccError": _xid_cases("94", "contained uncorrectable ECC error", MIG13,
                                                f"GPU 1 MIG instance 13 ({GPU1['UUID']})"),
        "GpuXid95UncontainedEccError": _xid_cases("95", "uncontained uncorrectable ECC error"),
        "GpuXid63RowRemapPending": _xid_cases("63", "row remapping or page retirement recorded"),
        "GpuXid64RowRemapFailure": _xid_cases("64", "row remapping or page retirement failed"),
        "GpuRowRemapFailure": [
            Case("the flag is set", [series(remap, {**NODE, **GPU0, **TRAINER}, "0x10 1x20")], 15,
                 [(of(NODE, GPU0), f"Row remapping has failed on gpu-node-1 {gpu0}")]),
            Case("not set", [series(remap, {**NODE, **GPU0}, "0x30")], 15, []),
        ],
        "GpuUncorrectableRowsRemapped": [
            Case("one more row", [series(remapped, {**NODE, **GPU0}, "2x20 3x20")], 30,
                 [(of(NODE, GPU0), f"Rows remapped for uncorrectable errors on gpu-node-1 {gpu0}")]),
            Case("some rows, long ago", [series(remapped, {**NODE, **GPU0}, "2x40")], 30, []),
            Case("the exporter restarted", [series(remapped, {**NODE, **GPU0}, "5x20 0x20")], 30, []),
        ],
        "GpuMarkedUnhealthy": [
            Case("unhealthy for 9 minutes", [series(health, {**NODE, **GPU0}, "1x10 0x20")], 20,
                 [(of(NODE, GPU0), f"The device plugin marked gpu-node-1 {gpu0} unhealthy")]),
            # The pod holding it went meanwhile: the device's series changed, its health did not.
            Case("unhealthy while its holder changes",
                 [series(health, {**NODE, **GPU0, **TRAINER}, "1x10 0x5 stale"),
                  series(health, {**NODE, **GPU0, **NOBODY}, "_x16 0x14")], 20,
                 [(of(NODE, GPU0), f"The device plugin marked gpu-node-1 {gpu0} unhealthy")]),
            Case("for 3 minutes, shorter than for:", [series(health, {**NODE, **GPU0}, "1x10 0x30")], 13, []),
            Case("healthy", [series(health, {**NODE, **GPU0}, "1x30")], 20, []),
        ],
        "GpuContainerOverMemoryLimit": _over_limit_cases(),
        "GpuWatchdogKilledContainer": [
            Case("a kill", [series(actions, {**EXPORTER, "action": "kill"}, "0x10 1x10")], 15,
                 [({**EXPORTER, "action": "kill"},
                   "The GPU memory watchdog on gpu-node-1 killed a container's processes")]),
            Case("warnings and dry-run kills only",
                 [series(actions, {**EXPORTER, "action": "kill"}, "0x20"),
                  series(actions, {**EXPORTER, "action": "warn"}, "0x10 1x10"),
                  series(actions, {**EXPORTER, "action": "would-kill"}, "0x10 2x10")], 15, []),
            Case("the watchdog restarted", [series(actions, {**EXPORTER, "action": "kill"}, "2x10 0x10")], 15, []),
        ],
        "GpuAllocatedButIdle": _idle_cases(),
        "GpuHookStartFailures": _start_failure_cases(),
        "GpuFactsStale": [
            Case("stale for 15 minutes", [series(stale, EXPORTER, "0x5 1x20")], 20,
                 [(EXPORTER, "The exporter on gpu-node-1 has not read its GPUs from NVML for 10 minutes")]),
            Case("for 7 minutes, shorter than for:", [series(stale, EXPORTER, "0x5 1x20")], 12, []),
            Case("current", [series(stale, EXPORTER, "0x30")], 20, []),
        ],
        "GpuExporterDown": [
            Case("down for 10 minutes", [series(up, EXPORTER, "1x5 0x10")], 15,
                 [(EXPORTER, "Prometheus cannot scrape the oci-gpu-hook exporter on gpu-node-1")]),
            Case("for 3 minutes, shorter than for:", [series(up, EXPORTER, "1x5 0x10")], 8, []),
            Case("another job's target down", [series(up, EXPORTER, "1x20"),
                                               series(up, {"instance": "n:9100", "job": "node"}, "0x20")], 15, []),
        ],
        "GpuExporterAbsent": [
            Case("no target of the job", [series(up, {"instance": "n:9100", "job": "node"}, "1x30")], 20,
                 [({"job": JOB}, "Prometheus has no oci-gpu-hook exporter target at all")]),
            Case("a target that is down is still there", [series(up, EXPORTER, "0x30")], 20, []),
            Case("gone for 9 minutes, shorter than for:", [series(up, EXPORTER, "1x10 stale")], 20, []),
        ],
    }  # fmt: skip


CASES = _cases()


def promtool_tests(alert: str, cases: list) -> dict:
    """promtool's unit test file: a test per case, each checking the alerts firing at its time. The
    description and the action are the rule's own text (static, a test checks); the summary is
    the rendered one the case expects, and the labels are the series' plus the rule's."""
    rule = alerting_rules()[alert]
    annotations = {k: v for k, v in rule["annotations"].items() if k != "summary"}
    return {
        "rule_files": [RULES],
        "evaluation_interval": "1m",
        "tests": [
            {
                "name": f"{alert}: {case.what}",
                "interval": "1m",
                "input_series": case.input,
                "alert_rule_test": [
                    {
                        "eval_time": f"{case.at}m",
                        "alertname": alert,
                        "exp_alerts": [
                            {
                                "exp_labels": {**labels, **rule.get("labels", {})},
                                "exp_annotations": {**annotations, "summary": summary},
                            }
                            for labels, summary in case.firing
                        ],
                    }
                ],
            }
            for case in cases
        ],
    }


def promtool_test(tmp_path, tests: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "tests.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    return subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=120)


def test_promtool_accepts_the_rules(require):
    require("promtool")
    proc = subprocess.run(["promtool", "check", "rules", RULES], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("alert", sorted(CASES))
def test_the_rule_fires_where_it_should_and_nowhere_else(alert, tmp_path, require):
    require("promtool")
    proc = promtool_test(tmp_path, promtool_tests(alert, CASES[alert]))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_rule_has_cases_that_fire_it_and_near_misses_that_do_not():
    """A rule without cases would pass unseen; so would cases of a name no rule has (promtool
    expects nothing of a rule it does not find)."""
    assert set(CASES) == set(alerting_rules())
    for alert, cases in CASES.items():
        assert any(case.firing for case in cases), f"{alert}: no case fires it"
        assert any(not case.firing for case in cases), f"{alert}: no near miss"
    # The recorded series exist for the alerts on them, whose cases exercise them.
    recorded = [rule["record"] for rule in rules() if "record" in rule]
    for name in recorded:
        assert any(name in rule["expr"] for rule in alerting_rules().values()), name


def test_the_cases_can_fail(tmp_path, require):
    """promtool fails a case whose expectation is wrong, either way: the harness above is not
    passing by seeing nothing."""
    require("promtool")
    alert = "GpuXid79FallenOffTheBus"
    fires, quiet = CASES[alert][0], CASES[alert][2]
    assert fires.firing and not quiet.firing
    for case in (fires._replace(firing=[]), quiet._replace(firing=fires.firing)):
        proc = promtool_test(tmp_path, promtool_tests(alert, [case]))
        assert proc.returncode != 0, case.what


def test_every_alert_says_what_it_means_and_what_to_do():
    """A summary that names where (its labels), a description and an action that are the same
    for every alert of the rule (no template: the cases above compare them as written)."""
    for alert, rule in alerting_rules().items():
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "action"}, alert
        if not rule["expr"].startswith("absent("):  # which has no target's labels to name
            assert "{{ $labels." in annotations["summary"], alert
        for key in ("description", "action"):
            assert annotations[key].strip() and "{{" not in annotations[key], (alert, key)
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), alert


# --- The PrometheusRule and the ServiceMonitor ------------------------------------------------------


def test_the_prometheusrule_carries_the_rules_files_groups():
    rule = load(PROMETHEUS_RULE)
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["metadata"]["namespace"] == load(SERVICE)["metadata"]["namespace"]
    assert rule["spec"]["groups"] == load(RULES)["groups"]


def test_the_prometheusrule_is_the_scripts_output(tmp_path):
    """Written by make-prometheusrule.py, not by hand: run it after changing the rules file."""
    out = tmp_path / "prometheusrule.yaml"
    script = os.path.join(MONITORING, "make-prometheusrule.py")
    subprocess.run([sys.executable, script, "--output", str(out)], check=True, timeout=60)
    with open(PROMETHEUS_RULE, encoding="utf-8") as f:
        assert out.read_text() == f.read(), "deploy/monitoring/prometheusrule.yaml: run make-prometheusrule.py"


def test_the_servicemonitor_selects_the_exporters_service_and_port():
    monitor, service = load(SERVICE_MONITOR), load(SERVICE)
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]  # its own namespace: no selector
    assert "namespaceSelector" not in monitor["spec"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert service["metadata"]["name"] == JOB  # the job the operator names after it, which the rules select
    assert f'job="{JOB}"' in alerting_rules()["GpuExporterDown"]["expr"]


def test_deploy_kubernetes_needs_no_prometheus_operator():
    """kubectl apply -f deploy/kubernetes/ must work on a cluster without the operator's CRDs."""
    directory = os.path.join(REPO, "deploy", "kubernetes")
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), encoding="utf-8") as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    assert not doc["apiVersion"].startswith("monitoring.coreos.com/"), (name, doc["kind"])


# --- honorLabels, through a real Prometheus ----------------------------------------------------------

EXPORTER_POD = "oci-gpu-hook-node-x7k2p"
NODE_NAME = "gpu-node-1"
# A device held by a pod, one held by none (its holder labels empty, as the exporter writes them),
# and a series of the exporter's own with no such labels.
PAGE = (
    "# TYPE DCGM_FI_DEV_FB_USED gauge\n"
    'DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-3b9521e4-f0b2-520f-8ee3-2dbc4ee49933",Hostname="gpu-node-1",'
    'container="trainer",pod="train-7f9c",namespace="ml"} 1024\n'
    'DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-e23fcfa5-35e9-5f7b-815d-619e4a20056c",Hostname="gpu-node-1",'
    'container="",pod="",namespace=""} 0\n'
    "# TYPE oci_gpu_hook_gpu_facts_stale gauge\n"
    "oci_gpu_hook_gpu_facts_stale 0\n"
)


class _Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = PAGE.encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def page():
    """A static exporter page on a port of its own: 127.0.0.1:PORT."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def operator_scrape(endpoint: dict, service: dict, honor_labels: bool):
    """(target labels, scrape config text) equivalent to what the Prometheus operator makes of the
    ServiceMonitor's endpoint: Kubernetes discovery's labels for the exporter's pod given as the
    static target's, then the operator's relabelling to namespace, service, pod, container, job
    and endpoint, then the endpoint's own relabelings."""
    name = service["metadata"]["name"]
    discovered = {
        "__meta_kubernetes_namespace": service["metadata"]["namespace"],
        "__meta_kubernetes_service_name": name,
        "__meta_kubernetes_pod_name": EXPORTER_POD,
        "__meta_kubernetes_pod_container_name": "exporter",
        "__meta_kubernetes_pod_node_name": NODE_NAME,
    }
    relabel = [
        {"source_labels": [f"__meta_kubernetes_{source}"], "target_label": target}
        for source, target in (("namespace", "namespace"), ("service_name", "service"), ("pod_name", "pod"),
                               ("pod_container_name", "container"), ("service_name", "job"))
    ] + [{"target_label": "endpoint", "replacement": endpoint["port"]}]  # fmt: skip
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label", "separator": "separator",
            "regex": "regex", "replacement": "replacement", "action": "action", "modulus": "modulus"}  # fmt: skip
    relabel += [{keys[k]: v for k, v in r.items()} for r in endpoint.get("relabelings", [])]
    config = (
        f"honor_labels: {json.dumps(honor_labels)}\n"
        f"metrics_path: {endpoint.get('path', '/metrics')}\n"
        f"scheme: {endpoint.get('scheme', 'http')}\n"
        f"relabel_configs: {json.dumps(relabel)}\n"
    )
    return discovered, config


def scraped(tmp_path, target: str, honor_labels: bool) -> dict:
    """{gpu or "exporter": the labels Prometheus stored} for the page's three series, scraped as the
    ServiceMonitor's endpoint has it but for honor_labels."""
    (endpoint,) = load(SERVICE_MONITOR)["spec"]["endpoints"]
    discovered, job = operator_scrape(endpoint, load(SERVICE), honor_labels)
    prometheus = Prometheus(tmp_path, target, job=job, labels=discovered, job_name="serviceMonitor/oci-gpu-hook/0")
    try:
        devices = prometheus.wait_until(
            lambda: [s for s in [prometheus.query("DCGM_FI_DEV_FB_USED")] if len(s) == 2], "both devices' series"
        )[0]
        (own,) = prometheus.wait_for("oci_gpu_hook_gpu_facts_stale")
    finally:
        prometheus.stop()
    found = {s["metric"]["gpu"]: s["metric"] for s in devices}
    found["exporter"] = own["metric"]
    return found


def honor_labels_of_the_servicemonitor() -> bool:
    (endpoint,) = load(SERVICE_MONITOR)["spec"]["endpoints"]
    return endpoint.get("honorLabels", False)  # the operator's default


def test_the_servicemonitor_keeps_the_workloads_labels(tmp_path, page, require):
    """As the ServiceMonitor has it: a held device's series keep the workload's pod, namespace and
    container; an unheld one has none (not the exporter pod's); nothing is renamed exported_*.
    The exporter's own series, which carry no such labels, get the exporter pod's."""
    require("prometheus")
    found = scraped(tmp_path, page, honor_labels_of_the_servicemonitor())
    held, unheld, own = found["0"], found["1"], found["exporter"]
    assert (held["pod"], held["namespace"], held["container"]) == ("train-7f9c", "ml", "trainer")
    assert not {"pod", "namespace", "container"} & set(unheld), unheld
    assert [k for s in found.values() for k in s if k.startswith("exported_")] == []
    assert (own["pod"], own["namespace"], own["container"]) == (EXPORTER_POD, "oci-gpu-hook", "exporter")
    # The operator's target labels, and the endpoint's relabeling: the node's name as instance.
    for labels in found.values():
        assert (labels["job"], labels["service"], labels["endpoint"]) == (JOB, JOB, "metrics")
        assert labels["instance"] == NODE_NAME


def test_the_other_honor_labels_puts_the_exporters_pod_on_every_series(tmp_path, page, require):
    """The same scrape with the ServiceMonitor's honorLabels turned over: the workload's names move
    to exported_*, and every series, held or not, names the exporter's pod (so the test above can
    tell the two apart)."""
    require("prometheus")
    found = scraped(tmp_path, page, not honor_labels_of_the_servicemonitor())
    held, unheld = found["0"], found["1"]
    assert (held["pod"], held["namespace"], held["container"]) == (EXPORTER_POD, "oci-gpu-hook", "exporter")
    assert (held["exported_pod"], held["exported_namespace"], held["exported_container"]) == ("train-7f9c", "ml",
                                                                                              "trainer")  # fmt: skip
    assert (unheld["pod"], unheld["namespace"], unheld["container"]) == (EXPORTER_POD, "oci-gpu-hook", "exporter")
    assert not any(k.startswith("exported_") for k in unheld), unheld
