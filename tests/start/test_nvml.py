"""The simulated host's NVML, driven by NVIDIA's official bindings, tells what procfs tells."""

import glob
import os
import re

from oci_gpu_hook.start import nvml


def procfs_gpus(root):
    gpus = {}
    for path in glob.glob(f"{root}/proc/driver/nvidia/gpus/*/information"):
        text = open(path).read()
        uuid = re.search(r"^GPU UUID:\s+(\S+)", text, re.M).group(1)
        gpus[uuid] = {
            "minor": int(re.search(r"^Device Minor:\s+(\d+)", text, re.M).group(1)),
            "bus_id": re.search(r"^Bus Location:\s+(\S+)", text, re.M).group(1),
        }
    return gpus


def test_pynvml_reads_back_what_procfs_says(simulated_host, require):
    require("pynvml")
    host = simulated_host(gpus=4, mig=[2], scramble_minors=True)
    root = host["root"]
    facts = nvml.query(f"{root}/usr/lib64/libnvidia-ml.so.1")
    version = re.search(r"Kernel Module\s+(\S+)", open(f"{root}/proc/driver/nvidia/version").read()).group(1)
    assert facts["driver_version"] == version == "550.54.15"
    assert facts["cuda_version"] == "12.4"
    procfs = procfs_gpus(root)
    assert {u: g["minor"] for u, g in facts["gpus"].items()} == {u: g["minor"] for u, g in procfs.items()}
    mig_gpu = host["gpus"][2]
    assert [(m["gi"], m["ci"], m["uuid"]) for m in facts["gpus"][mig_gpu["uuid"]]["mig"]] == [
        (m["gi"], m["ci"], m["uuid"]) for m in mig_gpu["mig"]
    ]
    assert all(not g["mig"] for u, g in facts["gpus"].items() if u != mig_gpu["uuid"])


def test_pynvml_bus_ids_match_procfs(simulated_host, require, tmp_path):
    require("pynvml")
    host = simulated_host(gpus=4, mig=[2], scramble_minors=True)
    script = tmp_path / "bus.py"
    script.write_text(
        "import ctypes, sys\n"
        "ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)\n"
        "import pynvml\n"
        "pynvml.nvmlInit()\n"
        "for i in range(pynvml.nvmlDeviceGetCount()):\n"
        "    h = pynvml.nvmlDeviceGetHandleByIndex(i)\n"
        "    print(pynvml.nvmlDeviceGetUUID(h), pynvml.nvmlDeviceGetPciInfo(h).busId)\n"
    )
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(script), f"{host['root']}/usr/lib64/libnvidia-ml.so.1"],
        capture_output=True,
        text=True,
        check=True,
    )
    procfs = procfs_gpus(host["root"])
    for line in out.stdout.splitlines():
        uuid, bus = line.split()
        domain, rest = bus.split(":", 1)
        assert f"{int(domain, 16):04x}:{rest.lower()}" == procfs[uuid]["bus_id"]
    assert len(out.stdout.splitlines()) == 4


def test_nvml_hides_gpus_whose_node_is_gone(simulated_host, require, tmp_path):
    require("pynvml")
    from oci_gpu_hook.toolkit.simulate import simulate

    host = simulate(str(tmp_path / "s"), gpus=3)
    os.unlink(f"{host['root']}/dev/nvidia1")
    facts = nvml.query(f"{host['root']}/usr/lib64/libnvidia-ml.so.1")
    assert set(facts["gpus"]) == {host["gpus"][0]["uuid"], host["gpus"][2]["uuid"]}
