"""node/attribution.py: what each container's processes use, read from a process table (a
directory laid out as /proc: <pid>/cgroup) against the records' cgroups."""

from oci_gpu_hook.node import attribution
from oci_gpu_hook.node.nvml_reader import Device, Sample

GPU = Device("GPU-00000000-0000-0000-0000-000000000000", 0, "GPU-00000000-0000-0000-0000-000000000000", 0, "T4")


def record(name: str) -> dict:
    return {"id": name, "outcome": "started", "cgroup": f"/pods/{name}", "devices": [{"gpu_index": 0,
            "gpu_uuid": GPU.uuid}]}  # fmt: skip


def proc_table(tmp_path, cgroups: dict) -> str:
    for pid, cgroup in cgroups.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(f"0::{cgroup}\n")
    return str(tmp_path)


def test_utilization_is_summed_per_holder_and_an_idle_holder_used_zero(tmp_path):
    a, b, c = record("a"), record("b"), record("c")
    proc = proc_table(tmp_path, {11: "/pods/a", 12: "/pods/a/worker", 21: "/pods/b", 99: "/system.slice/x"})
    sample = Sample(GPU, {}, (), ((11, 30, 10, 0, 0), (12, 25, 5, 1, 2), (21, 40, 20, 0, 0), (99, 5, 5, 5, 5)))
    found = {r["id"]: use for r, _, use in attribution.utilization_by_container([sample], [a, b, c], proc)}
    # a's two processes add up; the host's process (99) is nobody's; c holds the GPU and ran nothing.
    assert found == {"a": (55, 15, 1, 2), "b": (40, 20, 0, 0), "c": (0, 0, 0, 0)}


def test_no_per_process_accounting_gives_no_utilization(tmp_path):
    proc = proc_table(tmp_path, {11: "/pods/a"})
    sample = Sample(GPU, {}, ((11, 1 << 20),))  # utilization None: NVML keeps none for this device
    assert attribution.utilization_by_container([sample], [record("a")], proc) == []
    assert [use for _, _, use in attribution.memory_by_container([sample], [record("a")], proc)] == [1 << 20]


def test_a_process_cgroup_is_read_once_per_pass(tmp_path):
    proc = proc_table(tmp_path, {11: "/pods/a"})
    owner = attribution.Owners([record("a")], proc)
    assert owner(11)["id"] == "a"
    (tmp_path / "11" / "cgroup").write_text("0::/pods/elsewhere\n")
    assert owner(11)["id"] == "a"  # the pass's answer, not a second read
    assert attribution.Owners([record("a")], proc)(11) is None  # a new pass reads again
