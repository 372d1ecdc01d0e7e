"""node/nvml_reader.py: a node service whose NVML library changed under it says what changed.

A process cannot unload the NVML library it loaded, so on a changed library a service exits 75
for systemd or Kubernetes to start it again. Its one line names the change it saw: another
version, the library at another path, the same version installed again (another file at the same
path: review 4 saw "the NVIDIA driver changed (550.54.15 -> 550.54.15)"), or the library gone.
"""

import os
import re

import pytest
from servicecheck import Exporter

from oci_gpu_hook.node.nvml_reader import library_change, library_identity

OLD = "550.54.15"


def install(path, text):
    """A new file at path, as a package manager installs one: written beside it, renamed over it."""
    with open(f"{path}.new", "w") as f:
        f.write(text)
    os.rename(f"{path}.new", path)


def test_each_change_is_named(tmp_path):
    loaded = str(tmp_path / "libnvidia-ml.so.1")
    install(loaded, "the library the process loaded")
    before = library_identity(loaded)
    moved = str(tmp_path / "lib64" / "libnvidia-ml.so.1")
    os.mkdir(os.path.dirname(moved))
    install(moved, "x")

    assert library_change(OLD, before, "555.42.02", library_identity(moved)) == (
        f"the NVIDIA driver changed ({OLD} -> 555.42.02, {moved})"
    )
    assert library_change(OLD, before, OLD, library_identity(moved)) == (
        f"the NVIDIA driver's NVML library moved ({OLD}, {loaded} -> {moved})"
    )
    install(loaded, "the same version, installed again")
    assert library_identity(loaded) != before
    assert library_change(OLD, before, OLD, library_identity(loaded)) == (
        f"the NVIDIA driver was reinstalled ({OLD} again, {loaded} is another file)"
    )
    os.unlink(loaded)
    assert library_change(OLD, before, OLD, library_identity(loaded)) == (
        f"the NVIDIA driver's NVML library is gone ({OLD}, {loaded} cannot be read)"
    )
    assert library_change(OLD, before, None, library_identity(None)) == (
        f"the NVIDIA driver's NVML library is gone ({OLD}, {loaded} is no longer in the inventory)"
    )


def test_a_service_names_a_reinstall_of_the_same_version(tmp_path, require):
    """The exporter on a simulated host that is built again with the same driver (new files at
    the same paths): it exits 75 with a line that says so, not '550.54.15 -> 550.54.15'."""
    require("root", "gcc", "pynvml", "prometheus_client")
    from oci_gpu_hook.node.nvml_reader import RESTART
    from oci_gpu_hook.toolkit.simulate import simulate

    root = str(tmp_path / "host")
    host = simulate(root, gpus=1)
    assert host["driver_version"] == OLD
    e = Exporter(f"{root}/config.yaml", tmp_path)
    try:
        assert "DCGM_FI_DEV_GPU_TEMP" in e.text()
        simulate(root, gpus=1)
        with pytest.raises(OSError):  # the reply never comes: the process ends
            e.text()
        assert e.proc.wait(timeout=60) == RESTART
        output = e.output()
    finally:
        e.stop()
    lines = [line for line in output.splitlines() if "NVIDIA driver" in line]
    assert len(lines) == 1, output
    pattern = rf"the NVIDIA driver was reinstalled \({re.escape(OLD)} again, (\S+) is another file\): starting again"
    found = re.search(pattern, lines[0])
    assert found, lines[0]
    assert found.group(1).startswith(root) and "libnvidia-ml.so" in found.group(1), lines[0]


class _Sample:
    def __init__(self, pid, stamp, sm):
        self.pid, self.timeStamp, self.smUtil, self.memUtil, self.encUtil, self.decUtil = pid, stamp, sm, 0, 0, 0


def _reader_with(monkeypatch, tmp_path, calls: dict):
    """A reader whose NVML is pynvml's own errors and the given functions: what a driver answers
    that the simulated one never does (a failing detail call, garbage samples) cannot be had
    otherwise; everything else of the reader is real."""
    import types

    import pynvml

    from oci_gpu_hook.node.nvml_reader import NvmlReader

    nvml = types.SimpleNamespace(**{k: v for k, v in vars(pynvml).items() if k.startswith("NVMLError")}, **calls)
    inventory = types.SimpleNamespace(files=(), driver_root=str(tmp_path), gpus=())
    said = []
    reader = NvmlReader(inventory, detail=True, tell=said.append)
    reader._nvml = nvml
    return reader, nvml, said


def test_a_failing_detail_call_is_left_out_and_said_once(monkeypatch, tmp_path, require):
    """Round 49's review: a driver whose per-process utilization fails (its size query and its
    answer disagree) made the whole page stale. Now that one detail is left out, said once while
    it fails and once when it answers again; not supported is no failure at all."""
    require("pynvml")
    import pynvml

    answers = [pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)] * 2 + [[_Sample(7, 1, 30)]]

    def utilization(handle, seen):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    reader, nvml, said = _reader_with(monkeypatch, tmp_path, {"nvmlDeviceGetProcessUtilization": utilization})
    assert reader._utilization(nvml, None, "GPU-x") is None
    assert reader._utilization(nvml, None, "GPU-x") is None
    assert reader._utilization(nvml, None, "GPU-x") == ((7, 30, 0, 0, 0),)
    assert said == ["GPU-x: NVML fails per-process utilization (Insufficient Size): left out of the page while it does",
                    "GPU-x: NVML answers per-process utilization again"]  # fmt: skip

    def not_supported(handle):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    assert reader._optional("GPU-x", "encoder use", not_supported, None) is None
    assert len(said) == 2


def test_a_sample_from_the_future_does_not_hide_the_next_ones(monkeypatch, tmp_path, require):
    """A garbage timestamp taken as the newest seen would make every later query ask for samples
    after it: none would come, and every holder would look idle."""
    require("pynvml")
    import time

    now = time.time_ns() // 1000
    asked = []

    def utilization(handle, seen):
        asked.append(seen)
        return [_Sample(7, now, 30), _Sample(8, now + 10**12, 99)]

    reader, nvml, _ = _reader_with(monkeypatch, tmp_path, {"nvmlDeviceGetProcessUtilization": utilization})
    assert reader._utilization(nvml, None, "GPU-x") == ((7, 30, 0, 0, 0),)
    reader._utilization(nvml, None, "GPU-x")
    assert asked == [0, now]
