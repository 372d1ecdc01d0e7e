"""`oci-gpu-hook exporter` as a program on a simulated H100 host (GPM, HBM, row remapping, NVLink)
whose NVML values the tests set: every field of DCGM exporter's default list under its name and
unit, the profiling ratios from GPM, per-container utilization, XIDs from NVML's events, a
time-sliced GPU counted once, and a page that promtool reads. (tests/node/test_exporter.py has the
A100 host: the rest of the exporter, and a GPU without GPM.)"""

import re
import subprocess
import time

import pytest
from nvmlevents import clear_events, inject_xid
from servicecheck import ANNOTATIONS, Exporter, start_gpu_container, values

from oci_gpu_hook.node import metrics
from oci_gpu_hook.toolkit.simulate import control

# GPU 0 whole, with two NVLinks (its traffic is both links'), GPU 1 in MIG mode, GPU 2 whole
HOST = {"gpus": 3, "model": "h100", "nvlinks": "0+1,0+2", "mig": [1]}
pytestmark = [pytest.mark.host(**HOST, needs=("pynvml", "prometheus_client")),
              pytest.mark.usefixtures("fresh_nvml_values")]  # fmt: skip

MIB = 1 << 20


@pytest.fixture
def exporter(host, tmp_path):
    started = []

    def start():
        e = Exporter(f"{host['root']}/config.yaml", tmp_path)
        started.append(e)
        return e

    yield start
    for e in started:
        e.stop()
    clear_events(host["root"])


def test_every_default_field_as_set(host, exporter):
    gpu0 = host["gpus"][0]
    control.write(host["root"], {gpu0["uuid"]: {
        "memory_temp": 71, "pcie_replay": 3, "enc_util": 12, "dec_util": 34, "memory_reserved": 600 * MIB,
        "memory_used": 2000 * MIB, "remapped_correctable": 5, "remapped_uncorrectable": 2, "remap_failure": 1,
        "nvlink_raw_tx": 1000, "nvlink_raw_rx": 24, "gpm_graphics_util": 55, "gpm_tensor_util": 37,
        "gpm_dram_util": 20, "gpm_pcie_tx": 3, "gpm_pcie_rx": 5}})  # fmt: skip
    e = exporter()
    samples = e.scrape()  # GPM's second sample: the exporter rendered the first as it started
    gpu = {"gpu": "0", "UUID": gpu0["uuid"]}
    expected = {
        "DCGM_FI_DEV_MEMORY_TEMP": 71, "DCGM_FI_DEV_ENC_UTIL": 12, "DCGM_FI_DEV_DEC_UTIL": 34,
        "DCGM_FI_DEV_FB_RESERVED": 600, "DCGM_FI_DEV_FB_USED": 2000, "DCGM_FI_DEV_ROW_REMAP_FAILURE": 1,
        # prometheus_client's parser adds _total to a counter's samples; the page has DCGM's names
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER_total": 3, "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS_total": 5,
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS_total": 2, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL_total": 1024,
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.55, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.37,
        "DCGM_FI_PROF_DRAM_ACTIVE": 0.2, "DCGM_FI_PROF_PCIE_TX_BYTES": 3 * MIB, "DCGM_FI_PROF_PCIE_RX_BYTES": 5 * MIB,
    }  # fmt: skip
    for name, value in expected.items():
        assert values(samples, name, **gpu) == [pytest.approx(value)], name
    total = gpu0["model"]["memory_total"] >> 20
    assert values(samples, "DCGM_FI_DEV_FB_FREE", **gpu) == [total - 2000 - 600]
    (labels,) = [ls for n, ls, v in samples if n == "DCGM_FI_DEV_GPU_TEMP" and ls["gpu"] == "0"]
    assert (
        labels["pci_bus_id"] == "0000" + gpu0["bus_id"] and labels["DCGM_FI_DRIVER_VERSION"] == host["driver_version"]
    )
    assert labels["device"] == "nvidia0" and labels["pod"] == labels["namespace"] == labels["container"] == ""
    # Every metric field of the default list is on the page but the vGPU licence (a guest's) and
    # nothing else is made up: a bare-metal GPU has no licence series.
    names = {n.removesuffix("_total") for n, _, _ in samples if n.startswith("DCGM_")}
    assert names == {name for name, _, _ in metrics.DEVICE_METRICS.values()} - {"DCGM_FI_DEV_VGPU_LICENSE_STATUS"} | {
        "DCGM_FI_DEV_XID_ERRORS"}  # fmt: skip


def test_gpm_ratios_follow_what_the_gpu_reports(host, exporter):
    """A GPU's ratios over the time between two scrapes, and a MIG device's, its GPU instance's."""
    gpu0, mig = host["gpus"][0], host["gpus"][1]["mig"][0]
    e = exporter()
    assert values(e.scrape(), "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", gpu="0") == [0]
    control.write(host["root"], {gpu0["uuid"]: {"gpm_tensor_util": 90}, mig["uuid"]: {"gpm_dram_util": 45}})
    samples = e.scrape()
    assert values(samples, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", gpu="0") == [pytest.approx(0.9)]
    assert values(samples, "DCGM_FI_PROF_DRAM_ACTIVE", GPU_I_ID=str(mig["gi"])) == [pytest.approx(0.45)]
    assert "has no GPM" not in e.output()


def test_per_container_utilization_from_nvml(host, exporter, live_container):
    gpu0 = host["gpus"][0]
    options = {"host_options": HOST}
    a, pid_a = start_gpu_container(lambda env: live_container(env, **options), host, "0", ANNOTATIONS)
    b, pid_b = start_gpu_container(lambda env: live_container(env, **options), host, "0",
                                   {**ANNOTATIONS, "io.kubernetes.cri.sandbox-name": "pod-b"})  # fmt: skip
    control.write(host["root"], {gpu0["uuid"]: {"util_gpu": 80, "power": 400000}},
                  processes=[(gpu0["uuid"], pid_a, 100 * MIB), (gpu0["uuid"], pid_b, 300 * MIB)],
                  process_utilization=[(gpu0["uuid"], pid_a, 60, 10, 0, 0)])  # fmt: skip
    samples = exporter().scrape()
    # Two holders of one GPU: its series once, naming neither, and each holder on its own.
    assert values(samples, "DCGM_FI_DEV_POWER_USAGE", gpu="0") == [400.0]
    (labels,) = [ls for n, ls, v in samples if n == "DCGM_FI_DEV_GPU_UTIL" and ls["gpu"] == "0"]
    assert labels["pod"] == "" and labels["container"] == ""
    assert sorted(ls["pod"] for n, ls, v in samples if n == "oci_gpu_hook_container_gpu_allocated") == [
        "pod-a",
        "pod-b",
    ]
    sm = {ls["pod"]: v for n, ls, v in samples if n == "oci_gpu_hook_container_gpu_utilization_percent"
          and ls["engine"] == "sm"}  # fmt: skip
    assert sm == {"pod-a": 60, "pod-b": 0}  # b's process has no sample: it ran nothing since
    used = {ls["pod"]: v for n, ls, v in samples if n == "oci_gpu_hook_container_gpu_memory_used_bytes"}
    assert used == {"pod-a": 100 * MIB, "pod-b": 300 * MIB}
    assert {a, b} == {ls["container_id"] for n, ls, v in samples if n == "oci_gpu_hook_container_gpu_allocated"}


def test_an_xid_shows_as_the_last_one_and_in_its_count(host, exporter):
    gpu1 = host["gpus"][1]
    e = exporter()
    before = e.scrape()
    assert values(before, "DCGM_FI_DEV_XID_ERRORS", gpu="1") == [0]
    assert values(before, "oci_gpu_hook_gpu_xid_errors_total", gpu="1", xid="79") == [0]  # there from the start
    inject_xid(host["root"], gpu1["uuid"], 79)
    deadline = time.monotonic() + 20
    while True:
        time.sleep(1.1)
        after = e.scrape()
        if values(after, "DCGM_FI_DEV_XID_ERRORS", gpu="1") == [79] or time.monotonic() > deadline:
            break
    (last,) = [ls for n, ls, v in after if n == "DCGM_FI_DEV_XID_ERRORS" and ls["gpu"] == "1"]
    assert (last["err_code"], last["err_msg"]) == ("79", "GPU has fallen off the bus"), e.output()
    assert values(after, "oci_gpu_hook_gpu_xid_errors_total", gpu="1", xid="79") == [1]
    assert values(after, "oci_gpu_hook_gpu_xid_errors_total", gpu="0", xid="79") == [0]


def test_the_page_passes_promtool_but_for_dcgms_own_names(host, exporter, require):
    """promtool check metrics finds no fault in the page's format; its only lint findings are the
    two rules DCGM exporter's own names break, which compatibility keeps: camelCase label names
    (UUID, modelName, Hostname, GPU_I_ID...) and counters without _total (DCGM's field names)."""
    require("promtool")
    e = exporter()
    e.scrape()
    page = e.text()
    found = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True, text=True)
    camel = re.compile(r"^\S+ label names should be written in 'snake_case' not 'camelCase'$")
    total = re.compile(
        r'^(DCGM_FI_\S+) (counter metrics should have "_total" suffix|metric name should not include '
        r"type 'counter')$"
    )  # DCGM_FI_DEV_PCIE_REPLAY_COUNTER
    lines = [line for line in (found.stdout + found.stderr).splitlines() if line.strip()]
    others = [line for line in lines if not camel.match(line) and not total.match(line)]
    assert others == [], others
    assert {total.match(line).group(1) for line in lines if total.match(line)} <= {
        name for name, kind, _ in metrics.DEVICE_METRICS.values() if kind == "counter"}  # fmt: skip
    assert found.returncode in (0, 3), found  # 3: lint findings, which are the two above


def test_a_vgpu_guest_reports_its_licence(simulated_host, tmp_path):
    """DCGM_FI_DEV_VGPU_LICENSE_STATUS where NVML has one: in a vGPU guest (a bare-metal host has
    none, test_every_default_field_as_set)."""
    guest = simulated_host(gpus=1, vgpu_host_driver=("550.54.16", "r550_00"))
    e = Exporter(f"{guest['root']}/config.yaml", tmp_path)
    try:
        assert values(e.scrape(), "DCGM_FI_DEV_VGPU_LICENSE_STATUS", gpu="0") == [1]
        control.write(guest["root"], {guest["gpus"][0]["uuid"]: {"vgpu_licensed": 0}})
        time.sleep(1.1)  # a new page
        assert values(e.scrape(), "DCGM_FI_DEV_VGPU_LICENSE_STATUS", gpu="0") == [0]
    finally:
        e.stop()
        control.clear(guest["root"])
