"""What DCGM exporter's default fields ask of the simulated NVML (csrc/nvml.c): field values,
PCIe replays, encoder and decoder use, reserved memory, row remapping, GPM and per-process
utilization, read through NVIDIA's pynvml from built simulated hosts of three models, with the
figures set through the control file (simulate.control).

The hosts: an A100 pair (GPU 1 in MIG mode, no NVLink), an H100 pair joined by an NVLink (GPU 1 in
MIG mode) and one T4, each built once per session (the `simulated_host` factory).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from oci_gpu_hook.toolkit.simulate import control

MIB = 1 << 20
GIB = 1 << 30
RESERVED = 384 * MIB  # a GPU's reserved memory when the control file sets none
USED = 512 * MIB  # a built host's GPU's used memory when nothing sets it (build.py's host data)
NO_PID = 4194303  # the highest pid Linux hands out; the tests check that it is not running
NOT_SUPPORTED, NOT_FOUND, INVALID_ARGUMENT, INSUFFICIENT_SIZE, VERSION_MISMATCH = 3, 6, 2, 7, 25
UINT, ULONGLONG = 1, 3  # NVML_VALUE_TYPE_UNSIGNED_INT, NVML_VALUE_TYPE_UNSIGNED_LONG_LONG


@pytest.fixture
def hosts(simulated_host, require):
    require("pynvml")
    built = {
        "a100": simulated_host(gpus=2, mig=[1]),
        "h100": simulated_host(model="h100", gpus=2, mig=[1], nvlinks="0+1"),
        "t4": simulated_host(model="t4", gpus=1),
    }
    for host in built.values():
        assert not os.path.exists(os.path.join(host["root"], control.FILE))
    yield built
    for host in built.values():
        control.clear(host["root"])


PREAMBLE = """
import ctypes, json, sys, time
lib = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
import pynvml as N
from oci_gpu_hook.toolkit.simulate import control
root = sys.argv[2]
N.nvmlInit()
gpus = [N.nvmlDeviceGetHandleByIndex(i) for i in range(N.nvmlDeviceGetCount())]

def err(fn, *args):
    try:
        fn(*args)
    except N.NVMLError as e:
        return e.value
    return 0

def mig(gpu, index):
    return N.nvmlDeviceGetMigDeviceHandleByIndex(gpus[gpu], index)

def now_us():
    return time.time_ns() // 1000

r = {}
"""


def nvml(host, *parts: str) -> dict:
    """Run the parts (snippets, each dedented on its own) with pynvml bound to host's
    libnvidia-ml.so.1 (gpus: its handles; root: the host's directory, for control.write); returns
    what they put in r."""
    body = "".join(textwrap.dedent(part) + "\n" for part in parts)
    code = PREAMBLE + body + "N.nvmlShutdown()\nprint(json.dumps(r))\n"
    lib = os.path.join(host["root"], "usr/lib64/libnvidia-ml.so.1")
    proc = subprocess.run([sys.executable, "-c", code, lib, host["root"]], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def uuids(host):
    """(GPU 0, GPU 1, GPU 1's MIG devices) of a two-GPU host."""
    gpu0, gpu1 = host["gpus"]
    return gpu0["uuid"], gpu1["uuid"], [m["uuid"] for m in gpu1["mig"]]


FIELDS = """
def fields(handle, ids):
    out = []
    for f in N.nvmlDeviceGetFieldValues(handle, ids):
        value = f.value.uiVal if f.valueType == N.NVML_VALUE_TYPE_UNSIGNED_INT else f.value.ullVal
        out.append([f.fieldId, f.scopeId, f.nvmlReturn, f.valueType if f.nvmlReturn == 0 else None, value,
                    f.latencyUsec])
    return out

def stamps(handle, ids):
    before = now_us()
    values = N.nvmlDeviceGetFieldValues(handle, ids)
    after = now_us()
    return all(before <= f.timestamp <= after for f in values)
"""

MEMORY_TEMP, PCIE_REPLAY, RAW_TX, RAW_RX, ENERGY = 82, 94, 140, 141, 83  # NVML_FI_DEV_*


def test_field_values_as_set_with_their_types_and_the_others_not_supported(hosts):
    a0 = hosts["a100"]["gpus"][0]["uuid"]
    h0, h1, _ = uuids(hosts["h100"])
    control.write(hosts["a100"]["root"], {a0: {"memory_temp": 71, "pcie_replay": 12, "nvlink_raw_tx": 9}})
    control.write(hosts["h100"]["root"], {h0: {"nvlink_raw_tx": (1 << 40) + 5, "nvlink_raw_rx": 7, "memory_temp": 80},
                                          h1: {"pcie_replay": 4_000_000_000}})  # fmt: skip
    ids = [MEMORY_TEMP, PCIE_REPLAY, RAW_TX, RAW_RX, ENERGY, 9999]
    body = f"r['gpu0'] = fields(gpus[0], {ids})\nr['gpu1'] = fields(gpus[1], {ids})\n"
    a100 = nvml(
        hosts["a100"], FIELDS, body, f"r['mig'] = fields(mig(1, 0), {ids})\nr['stamps'] = stamps(gpus[0], {ids})\n"
    )
    h100 = nvml(
        hosts["h100"], FIELDS, body, f"r['scoped'] = fields(gpus[0], [({RAW_TX}, 3), ({RAW_RX}, 0xFFFFFFFF)])\n"
    )
    # [field, scope, nvmlReturn, valueType, value, latency]: the call succeeds; each field answers
    assert a100["gpu0"] == [
        [MEMORY_TEMP, 0, 0, UINT, 71, 0],
        [PCIE_REPLAY, 0, 0, ULONGLONG, 12, 0],
        [RAW_TX, 0, NOT_SUPPORTED, None, 0, 0],  # no NVLink on this host: the set value is not shown
        [RAW_RX, 0, NOT_SUPPORTED, None, 0, 0],
        [ENERGY, 0, NOT_SUPPORTED, None, 0, 0],  # a field the simulation does not model
        [9999, 0, NOT_SUPPORTED, None, 0, 0],
    ]
    assert a100["gpu1"][:2] == [[MEMORY_TEMP, 0, 0, UINT, 45, 0], [PCIE_REPLAY, 0, 0, ULONGLONG, 0, 0]]  # defaults
    assert [f[2] for f in a100["mig"]] == [NOT_SUPPORTED] * len(ids)  # board values: a MIG device has none
    assert a100["stamps"] is True  # microseconds since 1970, taken during the call
    assert h100["gpu0"][:4] == [
        [MEMORY_TEMP, 0, 0, UINT, 80, 0],
        [PCIE_REPLAY, 0, 0, ULONGLONG, 0, 0],
        [RAW_TX, 0, 0, ULONGLONG, (1 << 40) + 5, 0],
        [RAW_RX, 0, 0, ULONGLONG, 7, 0],
    ]
    assert h100["gpu1"][:4] == [
        [MEMORY_TEMP, 0, 0, UINT, 45, 0],
        [PCIE_REPLAY, 0, 0, ULONGLONG, 4_000_000_000, 0],
        [RAW_TX, 0, 0, ULONGLONG, 0, 0],  # GPU 1 has the other end of the NVLink
        [RAW_RX, 0, 0, ULONGLONG, 0, 0],
    ]
    # A link the GPU lacks (it has one, link 0) is refused; UINT_MAX, all links, is the total
    # (the scope is handed back as given).
    assert h100["scoped"] == [[RAW_TX, 3, INVALID_ARGUMENT, None, 0, 0], [RAW_RX, 0xFFFFFFFF, 0, ULONGLONG, 7, 0]]


def test_nvlink_traffic_by_link_and_for_all_links(simulated_host):
    """nvml.h: an NVLink field's scopeId names a link, UINT_MAX all of them summed. The control file
    sets a GPU's total; its links share it evenly (the first take what does not divide)."""
    host = simulated_host(model="h100", gpus=3, nvlinks="0+1,0+2")  # GPU 0: two links
    try:
        control.write(host["root"], {host["gpus"][0]["uuid"]: {"nvlink_raw_tx": 11, "nvlink_raw_rx": 4}})
        found = nvml(host, FIELDS, f"r['f'] = fields(gpus[0], [({RAW_TX}, 0), ({RAW_TX}, 1), ({RAW_TX}, 0xFFFFFFFF), "
                                   f"({RAW_RX}, 0), ({RAW_RX}, 0xFFFFFFFF), ({RAW_RX}, 2)])\n")  # fmt: skip
    finally:
        control.clear(host["root"])
    assert [(f[1], f[2], f[4]) for f in found["f"]] == [
        (0, 0, 6), (1, 0, 5), (0xFFFFFFFF, 0, 11), (0, 0, 2), (0xFFFFFFFF, 0, 4), (2, INVALID_ARGUMENT, 0)]  # fmt: skip


def test_memory_temperature_only_on_hbm_models(hosts):
    t4 = nvml(hosts["t4"], FIELDS, f"r['t4'] = fields(gpus[0], [{MEMORY_TEMP}, {PCIE_REPLAY}])\n")
    assert t4["t4"] == [[MEMORY_TEMP, 0, NOT_SUPPORTED, None, 0, 0], [PCIE_REPLAY, 0, 0, ULONGLONG, 0, 0]]
    control.write(hosts["t4"]["root"], {hosts["t4"]["gpus"][0]["uuid"]: {"memory_temp": 60}})
    t4 = nvml(hosts["t4"], FIELDS, f"r['t4'] = fields(gpus[0], [{MEMORY_TEMP}])\n")
    assert t4["t4"] == [[MEMORY_TEMP, 0, NOT_SUPPORTED, None, 0, 0]]  # a GDDR board has no such sensor
    assert [hosts[name]["gpus"][0]["model"]["hbm"] for name in ("a100", "h100", "t4")] == [True, True, False]


def test_field_values_fail_with_nvml_and_refuse_no_array(hosts):
    r = nvml(
        hosts["a100"],
        f"""
        control.write(root, fail=999)  # NVML failing while the client runs
        r["fail"] = err(N.nvmlDeviceGetFieldValues, gpus[0], [{MEMORY_TEMP}])
        control.clear(root)
        r["no_array"] = lib.nvmlDeviceGetFieldValues(gpus[0], 2, None)
        r["negative"] = lib.nvmlDeviceGetFieldValues(gpus[0], -1, None)
        r["none"] = lib.nvmlDeviceGetFieldValues(gpus[0], 0, None)
        """,
    )
    assert r == {"fail": 999, "no_array": INVALID_ARGUMENT, "negative": INVALID_ARGUMENT, "none": 0}


def test_pcie_replays_encoder_and_decoder(hosts):
    a0, a1, _ = uuids(hosts["a100"])
    control.write(hosts["a100"]["root"], {a0: {"pcie_replay": 3, "enc_util": 17, "dec_util": 100}, a1: {"enc_util": 5}})
    r = nvml(
        hosts["a100"],
        """
        r["gpus"] = [[N.nvmlDeviceGetPcieReplayCounter(g), N.nvmlDeviceGetEncoderUtilization(g),
                      N.nvmlDeviceGetDecoderUtilization(g)] for g in gpus]
        m = mig(1, 0)
        r["mig"] = [err(N.nvmlDeviceGetPcieReplayCounter, m), err(N.nvmlDeviceGetEncoderUtilization, m),
                    err(N.nvmlDeviceGetDecoderUtilization, m)]
        value = ctypes.c_uint()
        r["no_period"] = lib.nvmlDeviceGetEncoderUtilization(gpus[0], ctypes.byref(value), None)
        """,
    )
    # (percent, the sampling period in microseconds: a fixed 167 ms)
    assert r["gpus"] == [[3, [17, 167000], [100, 167000]], [0, [5, 167000], [0, 167000]]]
    assert r["mig"] == [NOT_SUPPORTED] * 3
    assert r["no_period"] == INVALID_ARGUMENT


MEMORY = """
def memory(handle):
    m = N.nvmlDeviceGetMemoryInfo(handle, version=N.nvmlMemory_v2)
    assert m.total == m.reserved + m.used + m.free, (m.total, m.reserved, m.used, m.free)
    return [m.total, m.reserved, m.used, m.free]
"""


def test_reserved_memory_and_the_sum_that_holds(hosts):
    a0, a1, a_migs = uuids(hosts["a100"])
    body = """
        r["gpus"] = [memory(g) for g in gpus]
        r["migs"] = [memory(mig(1, i)) for i in range(3)]
        r["v1"] = [[m.total, m.used, m.free] for m in [N.nvmlDeviceGetMemoryInfo(g) for g in gpus]]
        m = N.c_nvmlMemory_v2_t()
        m.version = N.nvmlMemory_v2 + 1
        r["wrong_version"] = lib.nvmlDeviceGetMemoryInfo_v2(gpus[0], ctypes.byref(m))
    """
    r = nvml(hosts["a100"], MEMORY, body)
    assert r["gpus"] == [[40 * GIB, RESERVED, USED, 40 * GIB - RESERVED - USED]] * 2
    assert r["migs"] == [[m["memory_total"], 0, 0, m["memory_total"]] for m in hosts["a100"]["gpus"][1]["mig"]]
    assert r["v1"] == [[40 * GIB, USED, 40 * GIB - USED]] * 2  # the first version knows no reserved memory
    assert r["wrong_version"] == VERSION_MISMATCH

    control.write(
        hosts["a100"]["root"],
        {a0: {"memory_reserved": 600 * MIB, "memory_used": 3 * GIB},
         a1: {"memory_used": 40 * GIB},  # all of it: what reservation leaves
         a_migs[1]: {"memory_reserved": 5 * MIB, "memory_used": MIB}},
    )  # fmt: skip
    r = nvml(hosts["a100"], MEMORY, body)
    assert r["gpus"] == [
        [40 * GIB, 600 * MIB, 3 * GIB, 40 * GIB - 600 * MIB - 3 * GIB],
        [40 * GIB, RESERVED, 40 * GIB - RESERVED, 0],
    ]
    total = hosts["a100"]["gpus"][1]["mig"][1]["memory_total"]
    assert r["migs"][1] == [total, 5 * MIB, MIB, total - 6 * MIB]
    assert r["v1"] == [[40 * GIB, 3 * GIB, 37 * GIB], [40 * GIB, 40 * GIB, 0]]


def test_remapped_rows_from_ampere_on(hosts):
    a0 = hosts["a100"]["gpus"][0]["uuid"]
    control.write(hosts["a100"]["root"], {a0: {"remapped_correctable": 2, "remapped_uncorrectable": 1,
                                               "remap_pending": 1, "remap_failure": 1}})  # fmt: skip
    body = """
        r["gpus"] = [err(N.nvmlDeviceGetRemappedRows, g) or list(N.nvmlDeviceGetRemappedRows(g)) for g in gpus]
    """
    a100 = nvml(hosts["a100"], body, "r['mig'] = err(N.nvmlDeviceGetRemappedRows, mig(1, 0))")
    h100 = nvml(hosts["h100"], body)
    t4 = nvml(hosts["t4"], body)
    # (correctable rows, uncorrectable rows, a remap pending, a remap failed)
    assert a100 == {"gpus": [[2, 1, 1, 1], [0, 0, 0, 0]], "mig": NOT_SUPPORTED}
    assert h100 == {"gpus": [[0, 0, 0, 0], [0, 0, 0, 0]]}
    assert t4 == {"gpus": [NOT_SUPPORTED]}  # Turing retires pages; row remapping came with Ampere


GPM = """
METRICS = [1, 2, 3, 5, 10, 20, 21, 4]  # the seven modelled, and FP64 utilization, which is not

def support(handle):
    return N.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice

def request(s1, s2, metrics=METRICS, version=N.NVML_GPM_METRICS_GET_VERSION):
    m = N.c_nvmlGpmMetricsGet_t()
    m.version, m.numMetrics, m.sample1, m.sample2 = version, len(metrics), s1, s2
    for i, metric in enumerate(metrics):
        m.metrics[i].metricId = metric
    return m

def metrics(s1, s2):
    m = N.nvmlGpmMetricsGet(request(s1, s2))
    return [[x.metricId, x.nvmlReturn, x.value] for x in m.metrics[: m.numMetrics]]

def sample(take):
    s = N.nvmlGpmSampleAlloc()
    take(s)
    return s
"""
GPM_KEYS = ("gpm_graphics_util", "gpm_sm_util", "gpm_sm_occupancy", "gpm_tensor_util", "gpm_dram_util",
            "gpm_pcie_tx", "gpm_pcie_rx")  # fmt: skip


def test_gpm_on_hopper_the_second_samples_values(hosts):
    h0 = hosts["h100"]["gpus"][0]["uuid"]
    first = dict(zip(GPM_KEYS, (10, 20, 30, 40, 50, 600, 700)))
    second = dict(zip(GPM_KEYS, (91, 82, 73, 64, 55, 4600, 4700)))
    control.write(hosts["h100"]["root"], {h0: first})
    r = nvml(
        hosts["h100"],
        GPM,
        f"""
        r["support"] = [support(g) for g in gpus] + [support(mig(1, 0))]
        s1 = sample(lambda s: N.nvmlGpmSampleGet(gpus[0], s))
        control.write(root, {{{h0!r}: {second!r}}})
        s2 = sample(lambda s: N.nvmlGpmSampleGet(gpus[0], s))
        r["metrics"] = metrics(s1, s2)
        info = N.nvmlGpmMetricsGet(request(s1, s2)).metrics
        names = lambda m: [n and n.decode() for n in (m.shortName, m.longName, m.unit)]
        r["info"] = [names(info[i].metricInfo) for i in (0, 6, 7)]
        s3 = sample(lambda s: N.nvmlGpmSampleGet(gpus[0], s))  # the file unchanged since s2
        r["unchanged"] = [x[2] for x in metrics(s2, s3)]
        control.clear(root)
        s4 = sample(lambda s: N.nvmlGpmSampleGet(gpus[0], s))
        r["defaults"] = [x[2] for x in metrics(s3, s4)]
        other = sample(lambda s: N.nvmlGpmSampleGet(gpus[1], s))
        untaken = N.nvmlGpmSampleAlloc()
        r["refused"] = [lib.nvmlGpmMetricsGet(ctypes.byref(request(s2, s1))),  # not in the order taken
                        lib.nvmlGpmMetricsGet(ctypes.byref(request(s1, s1))),
                        lib.nvmlGpmMetricsGet(ctypes.byref(request(s4, other))),  # another device
                        lib.nvmlGpmMetricsGet(ctypes.byref(request(s1, untaken))),
                        lib.nvmlGpmMetricsGet(ctypes.byref(request(s1, s2, version=2))),
                        lib.nvmlGpmMetricsGet(None)]
        for s in (s1, s2, s3, s4, other, untaken):
            N.nvmlGpmSampleFree(s)
        r["freed"] = [err(N.nvmlGpmSampleFree, s1), lib.nvmlGpmMetricsGet(ctypes.byref(request(s1, s2)))]
        support_v2 = N.c_nvmlGpmSupport_t()
        support_v2.version = 2
        r["support_version"] = lib.nvmlGpmQueryDeviceSupport(gpus[0], ctypes.byref(support_v2))
        """,
    )
    assert r["support"] == [1, 1, 1]  # Hopper: both GPUs, and a MIG device answers for its GPU
    # Each metric: the rate the control file set when the second sample was taken.
    assert r["metrics"] == [[1, 0, 91.0], [2, 0, 82.0], [3, 0, 73.0], [5, 0, 64.0], [10, 0, 55.0],
                            [20, 0, 4600.0], [21, 0, 4700.0], [4, NOT_SUPPORTED, 0.0]]  # fmt: skip
    assert r["info"] == [["gr_util", "graphics engine utilization", "%"],
                         ["pcie_rx", "PCIe bytes received", "MiB/s"], [None, None, None]]  # fmt: skip
    assert r["unchanged"] == [91.0, 82.0, 73.0, 64.0, 55.0, 4600.0, 4700.0, 0.0]
    assert r["defaults"] == [0.0] * 8
    assert r["refused"] == [INVALID_ARGUMENT] * 4 + [VERSION_MISMATCH, INVALID_ARGUMENT]
    assert r["freed"] == [INVALID_ARGUMENT, INVALID_ARGUMENT]  # a freed sample is no sample
    assert r["support_version"] == VERSION_MISMATCH


def test_gpm_too_many_metrics_is_refused(hosts):
    r = nvml(
        hosts["h100"],
        GPM,
        """
        s1 = sample(lambda s: N.nvmlGpmSampleGet(gpus[0], s))
        s2 = sample(lambda s: N.nvmlGpmSampleGet(gpus[0], s))
        m = request(s1, s2, metrics=[1])
        m.numMetrics = N.NVML_GPM_METRIC_MAX + 1  # past the array nvml.h gives the caller
        r["over"] = lib.nvmlGpmMetricsGet(ctypes.byref(m))
        m.numMetrics = N.NVML_GPM_METRIC_MAX
        r["at_max"] = lib.nvmlGpmMetricsGet(ctypes.byref(m))
        """,
    )
    assert r == {"over": INVALID_ARGUMENT, "at_max": 0}


def test_gpm_not_before_hopper(hosts):
    r = nvml(
        hosts["a100"],
        GPM,
        """
        r["support"] = [support(g) for g in gpus] + [support(mig(1, 0))]
        s = N.nvmlGpmSampleAlloc()
        r["sample"] = [err(N.nvmlGpmSampleGet, g, s) for g in gpus] + [err(N.nvmlGpmMigSampleGet, gpus[1], 1, s)]
        """,
    )
    assert r == {"support": [0, 0, 0], "sample": [NOT_SUPPORTED] * 3}


def test_gpm_of_a_mig_device_on_hopper(hosts):
    _, h1, h_migs = uuids(hosts["h100"])
    gis = [m["gi"] for m in hosts["h100"]["gpus"][1]["mig"]]
    control.write(hosts["h100"]["root"], {h1: {"gpm_sm_util": 99}, h_migs[1]: {"gpm_sm_util": 42, "gpm_pcie_tx": 7},
                                          h_migs[2]: {"gpm_sm_util": 13}})  # fmt: skip
    r = nvml(
        hosts["h100"],
        GPM,
        f"""
        gis = {gis}
        def of_instance(gi):
            s1 = sample(lambda s: N.nvmlGpmMigSampleGet(gpus[1], gi, s))
            s2 = sample(lambda s: N.nvmlGpmMigSampleGet(gpus[1], gi, s))
            return [x[2] for x in metrics(s1, s2)[:7]]
        r["instances"] = [of_instance(gi) for gi in gis]
        g1 = sample(lambda s: N.nvmlGpmSampleGet(gpus[1], s))
        g2 = sample(lambda s: N.nvmlGpmSampleGet(gpus[1], s))
        r["gpu"] = metrics(g1, g2)[1][2]
        m1 = sample(lambda s: N.nvmlGpmSampleGet(mig(1, 1), s))  # the MIG device's own handle
        m2 = sample(lambda s: N.nvmlGpmMigSampleGet(gpus[1], gis[1], s))
        r["own_handle"] = metrics(m1, m2)[1][2]
        r["mixed"] = lib.nvmlGpmMetricsGet(ctypes.byref(request(g2, m2)))  # a GPU's and its MIG device's
        s = N.nvmlGpmSampleAlloc()
        r["refused"] = [err(N.nvmlGpmMigSampleGet, gpus[1], 2, s), err(N.nvmlGpmMigSampleGet, gpus[0], gis[0], s),
                        err(N.nvmlGpmMigSampleGet, mig(1, 0), gis[0], s)]
        """,
    )
    assert r["instances"] == [[0.0] * 7, [0.0, 42.0, 0.0, 0.0, 0.0, 7.0, 0.0], [0.0, 13.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    assert r["gpu"] == 99.0
    assert r["own_handle"] == 42.0
    assert r["mixed"] == INVALID_ARGUMENT
    # no instance 2 on GPU 1; GPU 0 has no MIG devices; the GPU is asked, not a MIG device
    assert r["refused"] == [NOT_FOUND, NOT_FOUND, INVALID_ARGUMENT]
    assert 2 not in gis


UTILIZATION = """
def samples(handle, last_seen):
    try:
        found = N.nvmlDeviceGetProcessUtilization(handle, last_seen)
    except N.NVMLError as e:
        return e.value
    return sorted([s.pid, s.timeStamp, s.smUtil, s.memUtil, s.encUtil, s.decUtil] for s in found)

def raw(handle, capacity, last_seen=0):
    count = ctypes.c_uint(capacity)
    array = (N.c_nvmlProcessUtilizationSample_t * max(capacity, 1))() if capacity else None
    ret = lib.nvmlDeviceGetProcessUtilization(handle, array, ctypes.byref(count), ctypes.c_ulonglong(last_seen))
    return [ret, count.value]
"""


def test_process_utilization_of_live_processes_newer_than_asked(hosts, sleepers):
    a, b = sleepers(), sleepers()
    assert not os.path.exists(f"/proc/{NO_PID}")
    a0, a1, _ = uuids(hosts["a100"])
    control.write(
        hosts["a100"]["root"],
        processes=[(a0, a.pid, GIB)],  # a memory line beside them, read apart
        process_utilization=[(a0, a.pid, 40, 30, 20, 10), (a0, b.pid, 100, 0, 0, 1), (a0, NO_PID, 5, 5, 5, 5),
                             (a1, a.pid, 1, 1, 1, 1)],
    )  # fmt: skip
    r = nvml(
        hosts["a100"],
        UTILIZATION,
        """
        before = now_us()
        r["all"] = samples(gpus[0], 0)
        after = now_us()
        r["in_call"] = all(before <= s[1] <= after for s in r["all"])
        r["since_before"] = len(samples(gpus[0], before - 1))
        r["future"] = samples(gpus[0], now_us() + 60_000_000)
        r["protocol"] = [raw(gpus[0], 0), raw(gpus[0], 1), raw(gpus[0], 2), raw(gpus[0], 2, now_us() + 60_000_000)]
        r["null_count"] = lib.nvmlDeviceGetProcessUtilization(gpus[0], None, None, ctypes.c_ulonglong(0))
        r["mig_mode_gpu"] = samples(gpus[1], 0)
        r["mig"] = samples(mig(1, 0), 0)
        """,
    )
    assert [s[:1] + s[2:] for s in r["all"]] == sorted([[a.pid, 40, 30, 20, 10], [b.pid, 100, 0, 0, 1]])
    assert r["in_call"] is True  # stamped at the call, in microseconds since 1970
    assert r["since_before"] == 2
    assert r["future"] == NOT_FOUND  # nothing newer than asked
    # the count query (no array, or one too small) says how many; a fitting one gets them
    assert r["protocol"] == [[INSUFFICIENT_SIZE, 2], [INSUFFICIENT_SIZE, 2], [0, 2], [NOT_FOUND, 0]]
    assert r["null_count"] == INVALID_ARGUMENT
    assert r["mig_mode_gpu"] == NOT_SUPPORTED  # per-process samples: GPUs without MIG only
    assert r["mig"] == NOT_SUPPORTED

    a.kill()
    a.wait()
    r = nvml(hosts["a100"], UTILIZATION, "r['left'] = samples(gpus[0], 0)\n")
    assert [s[0] for s in r["left"]] == [b.pid]  # a process that exited is not reported
    b.kill()
    b.wait()
    assert nvml(hosts["a100"], UTILIZATION, "r['left'] = samples(gpus[0], 0)\n") == {"left": NOT_FOUND}


def test_process_utilization_without_lines_is_not_found(hosts, sleepers):
    p = sleepers()
    t0 = hosts["t4"]["gpus"][0]["uuid"]
    r = nvml(hosts["t4"], UTILIZATION, "r['none'] = samples(gpus[0], 0)\n")
    assert r == {"none": NOT_FOUND}
    control.write(hosts["t4"]["root"], process_utilization=[(t0, p.pid, 7, 6, 5, 4)])
    r = nvml(hosts["t4"], UTILIZATION, "r['one'] = [s[:1] + s[2:] for s in samples(gpus[0], 0)]\n")
    assert r == {"one": [[p.pid, 7, 6, 5, 4]]}


def test_a_vgpu_guests_licence_and_bare_metals_none(simulated_host, hosts):
    """A vGPU guest's GPUs say vGPU mode and report their vGPU feature's licence as the control file
    sets it (licensed by default); a bare-metal GPU is in no virtualization mode and has nothing
    to license."""
    guest = simulated_host(gpus=1, vgpu_host_driver=("550.54.16", "r550_00"))
    probe = """
        mode = N.nvmlDeviceGetVirtualizationMode(gpus[0])
        f = N.nvmlDeviceGetGridLicensableFeatures(gpus[0])
        r[key] = [mode, f.isGridLicenseSupported, f.licensableFeaturesCount,
                  [(x.featureCode, x.featureState) for x in f.gridLicensableFeatures[: f.licensableFeaturesCount]]]
    """
    try:
        assert nvml(guest, "key = 'default'", probe)["default"] == [2, 1, 1, [[1, 1]]]
        control.write(guest["root"], {guest["gpus"][0]["uuid"]: {"vgpu_licensed": 0}})
        assert nvml(guest, "key = 'unlicensed'", probe)["unlicensed"] == [2, 1, 1, [[1, 0]]]
    finally:
        control.clear(guest["root"])
    assert nvml(hosts["a100"], "key = 'bare'", probe)["bare"] == [0, 0, 0, []]
