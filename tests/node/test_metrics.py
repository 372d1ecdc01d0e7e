"""node/metrics.py: the page from samples and records, without NVML. Each device's own series
appear once however many containers hold it (a sum is the node's true total); who holds it and
what each holder uses are families of their own; the labels are DCGM exporter's; and every
counter an alert reads exists at 0 before its first event."""

import os

from prometheus_client.parser import text_string_to_metric_families

from oci_gpu_hook.node import metrics
from oci_gpu_hook.node.nvml_reader import Device, Sample

GPU0 = Device("GPU-00000000-0000-0000-0000-000000000000", 0, "GPU-00000000-0000-0000-0000-000000000000", 3,
              "NVIDIA A100-SXM4-40GB", pci_bus_id="00000000:07:00.0")  # fmt: skip
GPU1 = Device("GPU-11111111-1111-1111-1111-111111111111", 1, "GPU-11111111-1111-1111-1111-111111111111", 4,
              "NVIDIA A100-SXM4-40GB", pci_bus_id="00000000:0F:00.0")  # fmt: skip
MIG = GPU1.replace(uuid="MIG-22222222-2222-2222-2222-222222222222", gi=3, ci=0, profile="1g.5gb")


def record(name: str, *devices, limit=None, pod=True) -> dict:
    return {
        "id": f"id-{name}",
        "outcome": "started",
        "devices": [
            {"gpu_index": d.gpu_index, "gpu_uuid": d.gpu_uuid, **({"mig_uuid": d.uuid} if d.gi else {})}
            for d in devices
        ],  # fmt: skip
        "kubernetes": {"pod": f"pod-{name}", "namespace": "team", "container": "main"} if pod else None,
        "gpu_memory_limit": limit,
        "time": 1.0,
        "duration_seconds": 0.02,
    }


def page(samples, live=(), **fields) -> dict:
    """{(name, frozenset(labels)): value} of the rendered page, read back by Prometheus's own parser."""
    fields.setdefault("counters", metrics.StartCounters())
    text = metrics.render(samples, metrics.Page(hostname="node-a", driver_version="550.163.01", live=list(live),
                                                **fields))  # fmt: skip
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in found, f"a series twice: {key}"
            found[key] = s.value
    return found


def series(found: dict, name: str, **labels) -> list:
    return [v for (n, ls), v in found.items() if n == name and all((k, w) in ls for k, w in labels.items())]


def labelsets(found: dict, name: str) -> list:
    return [dict(ls) for (n, ls), _ in found.items() if n == name]


def test_a_shared_gpu_is_counted_once_and_each_holder_in_its_own_family():
    samples = [Sample(GPU0, {"power": 250.5, "temperature": 60}, ()), Sample(GPU1, {"power": 100.0}, ())]
    a, b = record("a", GPU0), record("b", GPU0)
    found = page(samples, [a, b])
    # One series per GPU: the node's power is the sum of its GPUs', not 250.5 counted twice.
    assert sorted(series(found, "DCGM_FI_DEV_POWER_USAGE")) == [100.0, 250.5]
    assert sum(series(found, "DCGM_FI_DEV_POWER_USAGE")) == 350.5
    # Two holders: the device's series name neither (empty, not absent), each is in the allocated family.
    (shared,) = [ls for ls in labelsets(found, "DCGM_FI_DEV_GPU_TEMP")]
    assert (shared["pod"], shared["namespace"], shared["container"]) == ("", "", "")
    allocated = labelsets(found, "oci_gpu_hook_container_gpu_allocated")
    assert sorted((ls["pod"], ls["UUID"], ls["container_id"]) for ls in allocated) == [
        ("pod-a", GPU0.uuid, "id-a"), ("pod-b", GPU0.uuid, "id-b")]  # fmt: skip
    assert series(found, "oci_gpu_hook_container_gpu_allocated") == [1, 1]


def test_a_single_holder_is_named_on_the_devices_series_with_dcgm_labels():
    found = page([Sample(GPU0, {"temperature": 61}, ()), Sample(GPU1, {"temperature": 40}, ())], [record("a", GPU0)])
    (held,) = [ls for ls in labelsets(found, "DCGM_FI_DEV_GPU_TEMP") if ls["gpu"] == "0"]
    assert held == {"gpu": "0", "UUID": GPU0.uuid, "pci_bus_id": "00000000:07:00.0", "device": "nvidia0",
                    "modelName": "NVIDIA A100-SXM4-40GB", "Hostname": "node-a",
                    "DCGM_FI_DRIVER_VERSION": "550.163.01", "container": "main", "pod": "pod-a",
                    "namespace": "team"}  # fmt: skip
    # device is DCGM's nvidia<index>, not the device node's minor (3 here)
    (free,) = [ls for ls in labelsets(found, "DCGM_FI_DEV_GPU_TEMP") if ls["gpu"] == "1"]
    assert free["device"] == "nvidia1" and free["pod"] == "" and free["container"] == ""


def test_a_container_outside_kubernetes_is_named_by_its_id_with_empty_pod_and_namespace():
    found = page([Sample(GPU0, {"temperature": 61}, ())], [record("a", GPU0, pod=False)])
    (labels,) = labelsets(found, "DCGM_FI_DEV_GPU_TEMP")
    assert (labels["container"], labels["pod"], labels["namespace"]) == ("id-a", "", "")


def test_a_value_nvml_did_not_give_has_no_series_not_a_zero():
    found = page([Sample(GPU0, {"temperature": 61}, ())])
    assert series(found, "DCGM_FI_DEV_GPU_TEMP") == [61]
    for name in ("DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_DEV_ROW_REMAP_FAILURE",
                 "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"):  # fmt: skip
        assert series(found, name) == [], name


DEFAULT_COUNTERS = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "reference",
                                                 "dcgm-exporter", "default-counters.csv"))  # fmt: skip


def test_every_default_field_has_its_dcgm_name_and_type(require):
    """Each metric field of dcgm-exporter's own default list (../shared/reference, as NVIDIA ships
    it) renders under its name and type; the XID gauge is rendered apart, from events."""
    require(DEFAULT_COUNTERS)
    default = {}
    with open(DEFAULT_COUNTERS) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                name, kind, _ = (part.strip() for part in line.split(",", 2))
                if kind != "label":
                    default[name] = kind
    ours = {name: kind for name, kind, _ in metrics.DEVICE_METRICS.values()}
    ours["DCGM_FI_DEV_XID_ERRORS"] = "gauge"
    assert len(default) == 25 and ours == default
    values = {field: 1 for field in metrics.DEVICE_METRICS}
    text = metrics.render([Sample(GPU0, values, ())], metrics.Page(hostname="n", live=[], xids=metrics.XidCounts(),
                                                                   counters=metrics.StartCounters()))  # fmt: skip
    for name, kind in default.items():
        assert f"# TYPE {name} {kind}\n" in text, name


def test_a_mig_device_carries_its_instance_and_its_gpus_uuid():
    found = page([Sample(GPU1, {"fb_used": 10}, ()), Sample(MIG, {"fb_used": 5}, ())], [record("m", MIG)])
    (mig,) = [ls for ls in labelsets(found, "DCGM_FI_DEV_FB_USED") if "GPU_I_ID" in ls]
    assert (mig["GPU_I_ID"], mig["GPU_I_PROFILE"], mig["UUID"], mig["pod"]) == ("3", "1g.5gb", GPU1.uuid, "pod-m")
    (gpu,) = [ls for ls in labelsets(found, "DCGM_FI_DEV_FB_USED") if "GPU_I_ID" not in ls]
    assert gpu["pod"] == ""  # the GPU itself is not what the container holds


def test_counters_an_alert_reads_exist_at_zero_before_their_first_event():
    found = page([Sample(GPU0, {}, ())], xids=metrics.XidCounts(), watchdog={})
    failures = {dict(ls)["reason"]: v for (n, ls), v in found.items()
                if n == "oci_gpu_hook_gpu_container_failures_total"}  # fmt: skip
    assert set(failures) == set(metrics.FAILURE_REASONS) and set(failures.values()) == {0}
    assert {"request", "inventory", "cgroup", "ldconfig", "apply", "label"} <= set(failures)
    actions = {dict(ls)["action"]: v for (n, ls), v in found.items() if n == "oci_gpu_hook_watchdog_actions_total"}
    assert actions == {"kill": 0, "warn": 0, "would-kill": 0}
    xids = {dict(ls)["xid"]: v for (n, ls), v in found.items() if n == "oci_gpu_hook_gpu_xid_errors_total"}
    assert set(xids) == {str(x) for x in metrics.XID_MEANINGS} and set(xids.values()) == {0}
    assert {"48", "63", "64", "79", "94", "95"} <= set(xids)
    (last,) = labelsets(found, "DCGM_FI_DEV_XID_ERRORS")
    assert (last["err_code"], last["err_msg"]) == ("0", "No error")
    assert series(found, "DCGM_FI_DEV_XID_ERRORS") == [0]


def test_a_failure_of_a_reason_not_listed_is_still_counted():
    counters = metrics.StartCounters()
    failed = dict(record("a", GPU0), outcome="failed", reason="unknown")
    counters.observe({"a.json": failed})
    found = page([], counters=counters)
    assert series(found, "oci_gpu_hook_gpu_container_failures_total", reason="unknown") == [1]
    assert series(found, "oci_gpu_hook_gpu_container_failures_total", reason="request") == [0]


def test_xids_are_the_last_one_and_a_count_of_each_per_gpu():
    xids = metrics.XidCounts()
    for xid in (79, 48, 48, 7):
        xids.record(GPU0.uuid, xid)
    found = page([Sample(GPU0, {}, ()), Sample(GPU1, {}, ()), Sample(MIG, {}, ())], xids=xids)
    last = {dict(ls)["gpu"]: (dict(ls)["err_code"], dict(ls)["err_msg"], v) for (n, ls), v in found.items()
            if n == "DCGM_FI_DEV_XID_ERRORS"}  # fmt: skip
    assert last == {"0": ("7", "XID 7", 7), "1": ("0", "No error", 0)}  # once per GPU, not per MIG device
    assert series(found, "oci_gpu_hook_gpu_xid_errors_total", gpu="0", xid="48") == [2]
    assert series(found, "oci_gpu_hook_gpu_xid_errors_total", gpu="0", xid="79") == [1]
    assert series(found, "oci_gpu_hook_gpu_xid_errors_total", gpu="0", xid="7") == [1]  # seen: now listed
    assert series(found, "oci_gpu_hook_gpu_xid_errors_total", gpu="1", xid="7") == []
    assert series(found, "oci_gpu_hook_gpu_xid_errors_total", gpu="1", xid="79") == [0]


def test_memory_limits_and_use_per_container_beside_each_other():
    a = record("a", GPU0, limit={GPU0.uuid: 4 << 30})
    b = record("b", GPU0)
    found = page([Sample(GPU0, {}, ())], [a, b], memory=[(a, GPU0, 5 << 30), (b, GPU0, 1 << 30)])
    assert series(found, "oci_gpu_hook_container_gpu_memory_limit_bytes", pod="pod-a") == [4 << 30]
    assert series(found, "oci_gpu_hook_container_gpu_memory_limit_bytes", pod="pod-b") == []  # no limit, no series
    assert series(found, "oci_gpu_hook_container_gpu_memory_used_bytes", pod="pod-a") == [5 << 30]
    # the two families share their labels, so "over its share" is one comparison in PromQL
    (limit,) = labelsets(found, "oci_gpu_hook_container_gpu_memory_limit_bytes")
    (used,) = [ls for ls in labelsets(found, "oci_gpu_hook_container_gpu_memory_used_bytes") if ls["pod"] == "pod-a"]
    assert limit == used


def test_utilization_per_container_by_engine():
    a = record("a", GPU0)
    found = page([Sample(GPU0, {}, ())], [a], utilization=[(a, GPU0, (37, 12, 0, 5))])
    by_engine = {dict(ls)["engine"]: v for (n, ls), v in found.items()
                 if n == "oci_gpu_hook_container_gpu_utilization_percent"}  # fmt: skip
    assert by_engine == {"sm": 37, "memory": 12, "encoder": 0, "decoder": 5}


def test_stale_facts_and_their_age():
    found = page([Sample(GPU0, {"temperature": 50}, ())], stale=True, age=31.5)
    assert series(found, "oci_gpu_hook_gpu_facts_stale") == [1]
    assert series(found, "oci_gpu_hook_gpu_facts_age_seconds") == [31.5]
    assert series(page([]), "oci_gpu_hook_gpu_facts_age_seconds") == []  # never read: no age


def test_the_page_writes_no_label_a_scrape_sets():
    """Scraped with honoured labels (the ServiceMonitor's honorLabels), a label the page wrote
    would win over the target's: the page has none of the names Prometheus or its operator set,
    whatever the records say."""
    hostile = dict(record("x", GPU0), kubernetes={"pod": 'p",job="evil', "namespace": "ns", "container": "c"})
    xids = metrics.XidCounts()
    xids.record(GPU0.uuid, 79)
    counters = metrics.StartCounters()
    counters.observe({"a.json": dict(record("a", GPU0), outcome="failed", reason="request")})
    found = page([Sample(GPU0, {field: 1 for field in metrics.DEVICE_METRICS}, ((11, 5),)), Sample(MIG, {}, ())],
                 [hostile], counters=counters, xids=xids, watchdog={"kill": 1}, stale=True, age=1.0,
                 memory=[(hostile, GPU0, 5)], utilization=[(hostile, GPU0, (1, 2, 3, 4))],
                 sharing={GPU0.uuid: ("time-sliced", 4, "nvidia.com/gpu")}, health={GPU0.uuid: "XID 79"})  # fmt: skip
    names = {k for _, labels in found for k, _ in labels}
    assert names.isdisjoint({"job", "instance", "service", "endpoint", "__name__"}), names
    assert {ls.get("pod") for ls in labelsets(found, "oci_gpu_hook_container_gpu_allocated")} == {'p",job="evil'}


def test_the_device_plugins_verdicts_per_device():
    found = page([Sample(GPU0, {}, ()), Sample(GPU1, {}, ()), Sample(MIG, {}, ())],
                 health={GPU0.uuid: None, MIG.uuid: "XID 79 (a critical XID: health.criticalXids)"})  # fmt: skip
    by_device = {(dict(ls)["gpu"], dict(ls).get("GPU_I_ID")): (v, dict(ls)["reason"]) for (n, ls), v in found.items()
                 if n == "oci_gpu_hook_gpu_health"}  # fmt: skip
    assert by_device == {("0", None): (1, ""), ("1", "3"): (0, "XID 79 (a critical XID: health.criticalXids)")}
    assert series(page([Sample(GPU0, {}, ())]), "oci_gpu_hook_gpu_health") == []  # no plugin: no verdicts


def test_how_each_device_is_offered():
    offers = {GPU0.uuid: ("time-sliced", 4, "nvidia.com/gpu"), MIG.uuid: ("mig", 1, "nvidia.com/mig-1g.5gb")}
    found = page([Sample(GPU0, {}, ()), Sample(MIG, {}, ())], sharing=offers)
    offered = {dict(ls)["gpu"]: (dict(ls)["mechanism"], dict(ls)["replicas"], dict(ls)["resource"])
               for ls in labelsets(found, "oci_gpu_hook_gpu_sharing")}  # fmt: skip
    assert offered == {"0": ("time-sliced", "4", "nvidia.com/gpu"), "1": ("mig", "1", "nvidia.com/mig-1g.5gb")}


def test_our_per_device_families_name_no_holder_but_carry_the_labels_empty():
    """The XID counts, the sharing and the plugin's verdicts are the board's: while a pod holds the
    GPU they name no pod (a count stays one series whoever holds it, so an XID that comes as its
    pod goes is still an increase), and they carry the holder labels empty, so that honoured
    labels do not give them the exporter pod's names. DCGM's own XID gauge names the holder."""
    xids = metrics.XidCounts()
    xids.record(GPU0.uuid, 48)
    found = page([Sample(GPU0, {}, ())], [record("a", GPU0)], xids=xids, health={GPU0.uuid: None},
                 sharing={GPU0.uuid: ("whole", 1, "nvidia.com/gpu")})  # fmt: skip
    for name in ("oci_gpu_hook_gpu_xid_errors_total", "oci_gpu_hook_gpu_sharing", "oci_gpu_hook_gpu_health"):
        for labels in labelsets(found, name):
            assert (labels["pod"], labels["namespace"], labels["container"]) == ("", "", ""), (name, labels)
    (gauge,) = labelsets(found, "DCGM_FI_DEV_XID_ERRORS")
    assert gauge["pod"] == "pod-a"
