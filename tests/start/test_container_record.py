"""The hook's per-container records: names, contents, the trust rules of their directory, the
readers' parsing and collection, and what a real GPU start (and a failed one) leaves."""

import hashlib
import json
import os
import subprocess
import time

import hookcheck
import pytest

from oci_gpu_hook.start import container_record as cr
from oci_gpu_hook.start import pids, settings
from oci_gpu_hook.start.state import ContainerState


@pytest.mark.parametrize(
    "container_id, expected",
    [
        ("abc", "abc.json"),
        ("a" * 64, "a" * 64 + ".json"),
        ("my_container-1.2+x", "my_container-1.2+x.json"),
        ("../etc/passwd", "%" + b"../etc/passwd".hex() + ".json"),
        (".hidden", "%" + b".hidden".hex() + ".json"),
        ("a/b", "%" + b"a/b".hex() + ".json"),
        ("é", "%" + "é".encode().hex() + ".json"),
        ("x" * 240, "x" * 240 + ".json"),
        # Too long to name a file: named by the SHA-256, so that such a container has a record too.
        ("x" * 241, "#" + hashlib.sha256(b"x" * 241).hexdigest() + ".json"),
        ("/" * 200, "#" + hashlib.sha256(b"/" * 200).hexdigest() + ".json"),
    ],
)
def test_file_name(container_id, expected):
    assert cr.file_name(container_id) == expected


def test_file_names_are_distinct_for_distinct_ids():
    ids = ["a", "%61", "%" + b"%61".hex(), "a.json", ".a", "a/", "A", "x" * 241, "x" * 242]
    names = [cr.file_name(i) for i in ids]
    assert len(set(names)) == len(ids) and all("/" not in n for n in names)


@pytest.mark.parametrize(
    "annotations, expected",
    [
        ({}, None),
        ({"io.kubernetes.cri.sandbox-name": "p", "io.kubernetes.cri.sandbox-namespace": "n",
          "io.kubernetes.cri.container-name": "c"}, {"pod": "p", "namespace": "n", "container": "c"}),
        ({"io.kubernetes.pod.name": "p2", "io.kubernetes.pod.namespace": "n2", "io.kubernetes.container.name": "c2"},
         {"pod": "p2", "namespace": "n2", "container": "c2"}),
        ({"io.kubernetes.cri.sandbox-name": "cri", "io.kubernetes.pod.name": "crio"}, {"pod": "cri"}),
        ({"io.kubernetes.pod.name": ""}, None),
    ],
)  # fmt: skip
def test_kubernetes_names_from_containerd_and_cri_o(annotations, expected):
    assert cr.kubernetes_names(annotations) == expected


def _state(pid, cid="c1"):
    return ContainerState("1.0.2", cid, "creating", pid, "/b", {})


def test_build_records_this_process_and_its_start_time():
    record = cr.build(_state(os.getpid()), {}, (), 0.25)
    assert record["pid"] == os.getpid() and record["pid_start"] == pids.start_ticks(os.getpid())
    assert record["outcome"] == "started" and record["reason"] is None and record["duration_seconds"] == 0.25
    assert cr.parse(json.dumps(record).encode()) == record
    assert cr.is_live(record)


def test_a_failed_start_names_its_reason():
    record = cr.build(_state(os.getpid()), {}, (), 0.1, failure_code=5)
    assert (record["outcome"], record["reason"]) == ("failed", "request")


def test_reused_pid_and_dead_pid_are_not_live():
    proc = subprocess.Popen(["sleep", "60"])
    try:
        record = cr.build(_state(proc.pid), {}, (), 0.1)
        assert cr.is_live(record)
        assert not cr.is_live(dict(record, pid_start=record["pid_start"] - 1))  # the pid was reused
    finally:
        proc.kill()
        proc.wait()
    assert not cr.is_live(record)
    assert not cr.is_live(dict(record, pid=None))


def test_a_zombie_is_not_live():
    proc = subprocess.Popen(["true"])
    record = cr.build(_state(proc.pid), {}, (), 0.1)
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    try:
        assert pids.start_ticks(proc.pid) is None and not cr.is_live(record)
    finally:
        proc.wait()


@pytest.mark.parametrize(
    "data",
    [b"", b"garbage", b"[]", b"{}", b'{"format": 2}', b"\xff\xfe", b"[" * 100000,
     json.dumps({"format": 1, "id": 5}).encode()],
)  # fmt: skip
def test_garbage_is_not_a_record(data):
    assert cr.parse(data) is None


@pytest.mark.parametrize(
    "field, value",
    [("pid", "1"), ("pid", True), ("pid_start", 1.5), ("cgroup", 3), ("kubernetes", {"pod": 1}),
     ("kubernetes", []), ("devices", [{"gpu_uuid": None}]), ("devices", ["x"]), ("time", "now"), ("outcome", None)],
)  # fmt: skip
def test_a_record_with_a_wrong_field_is_garbage(field, value):
    record = cr.build(_state(os.getpid()), {}, (), 0.1)
    assert cr.parse(json.dumps(record).encode()) is not None
    assert cr.parse(json.dumps(dict(record, **{field: value})).encode()) is None


def test_write_makes_a_root_only_directory_and_a_file_of_the_hooks_own_uid(tmp_path, require):
    """The directory is root's alone; the record, settings.CACHE_UID's (the one owner the readers
    trust: what a uid 0 without capabilities may make is root's), writable by it alone."""
    require("root")
    directory = str(tmp_path / "records")
    record = cr.build(_state(os.getpid(), "ab/c"), {}, (), 0.1)
    assert cr.write(directory, record)
    assert os.stat(directory).st_mode & 0o777 == 0o700
    (name,) = os.listdir(directory)
    st = os.stat(os.path.join(directory, name))
    assert name == cr.file_name("ab/c") and (st.st_uid, st.st_mode & 0o777) == (settings.CACHE_UID, 0o644)
    assert cr.read_all(directory) == {name: record}


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o707])
def test_no_record_in_a_directory_others_can_use(tmp_path, mode):
    directory = tmp_path / "records"
    directory.mkdir()
    directory.chmod(mode)
    assert not cr.write(str(directory), cr.build(_state(os.getpid()), {}, (), 0.1))
    assert os.listdir(directory) == []


def test_no_record_through_a_symlinked_directory(tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere", tmp_path / "records")
    assert not cr.write(str(tmp_path / "records"), cr.build(_state(os.getpid()), {}, (), 0.1))
    assert os.listdir(tmp_path / "elsewhere") == []


def test_readers_treat_untrusted_files_as_garbage_and_collect_them(tmp_path, require):
    """Only the hook's own files are records (settings.read_trusted): one of root's (what a uid 0
    without capabilities can make), one others may write, a FIFO or a symlink is refused, and
    said; one too large, or not a record, is garbage. The collectors remove them all."""
    require("root")
    directory = tmp_path / "records"
    good = cr.build(_state(os.getpid(), "alive"), {}, (), 0.1)
    assert cr.write(str(directory), good)
    (directory / "roots.json").write_text(json.dumps(dict(good, id="roots")))
    os.chmod(directory / "roots.json", 0o644)
    for name, mode in (("writable.json", 0o666), ("group-writable.json", 0o664)):
        settings.write_trusted(str(directory / name), json.dumps(dict(good, id=name)).encode())
        os.chmod(directory / name, mode)
    settings.write_trusted(str(directory / "big.json"), b" " * (cr.MAX_RECORD_BYTES + 1))
    settings.write_trusted(str(directory / "garbage.json"), b"{")
    os.mkfifo(directory / "fifo.json")
    os.symlink("alive.json", directory / "link.json")
    (directory / "other.txt").write_text("not ours")
    refused = {}
    records = cr.read_all(str(directory), refused)
    assert records["alive.json"] == good
    garbage = {"roots.json", "writable.json", "group-writable.json", "big.json", "garbage.json", "fifo.json",
               "link.json"}  # fmt: skip
    assert {n for n, r in records.items() if r is None} == garbage
    assert refused == {
        "roots.json": f"not a record the hook wrote: owned by uid 0 with mode 0644: only a file of uid "
                      f"{settings.CACHE_UID} that no one else may write is used",
        "writable.json": f"not a record the hook wrote: owned by uid {settings.CACHE_UID} with mode 0666: only a "
                         f"file of uid {settings.CACHE_UID} that no one else may write is used",
        "group-writable.json": f"not a record the hook wrote: owned by uid {settings.CACHE_UID} with mode 0664: "
                               f"only a file of uid {settings.CACHE_UID} that no one else may write is used",
        "big.json": f"not a record the hook wrote: larger than {cr.MAX_RECORD_BYTES} bytes",
        "fifo.json": "not a record the hook wrote: not a regular file",
        "link.json": "not a record the hook wrote: a symlink",
    }  # fmt: skip
    removed = cr.collect(str(directory), records)
    assert sorted(removed) == sorted(garbage)
    assert sorted(os.listdir(directory)) == ["alive.json", "other.txt"]


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o707])
def test_readers_refuse_a_directory_others_can_use(tmp_path, mode):
    """Forged records in a directory others can write could aim the watchdog at any container:
    the readers check the directory as the writer does, and read nothing from it."""
    directory = tmp_path / "records"
    directory.mkdir(mode=0o700)
    assert cr.write(str(directory), cr.build(_state(os.getpid(), "alive"), {}, (), 0.1))
    directory.chmod(mode)
    with pytest.raises(cr.UntrustedRecords, match="not root's alone"):
        cr.read_all(str(directory))
    directory.chmod(0o700)
    os.symlink(directory, tmp_path / "link")
    with pytest.raises(cr.UntrustedRecords):
        cr.read_all(str(tmp_path / "link"))
    assert list(cr.read_all(str(directory))) == ["alive.json"]


def test_no_annotation_makes_a_record_unreadable(tmp_path):
    """The Kubernetes names come from annotations, which whoever creates the container writes: cut
    to Kubernetes' longest name and made printable, so the record stays under the readers' bound
    (a 70 KB pod name used to make it garbage, and its container unlimited) and renders anywhere."""
    annotations = {"io.kubernetes.pod.name": "p" * 70_000, "io.kubernetes.pod.namespace": "ns\ud800\x1b[2J",
                   "io.kubernetes.container.name": "c" * 300}  # fmt: skip
    record = cr.build(_state(os.getpid(), "x" * 5000), annotations, (), 0.1, gpu_memory_limit={"GPU-1": 1 << 30})
    directory = str(tmp_path / "records")
    assert cr.write(directory, record)
    (name,) = os.listdir(directory)
    assert os.path.getsize(os.path.join(directory, name)) <= cr.MAX_RECORD_BYTES
    read = cr.read_all(directory)[name]
    assert read["kubernetes"] == {"pod": "p" * cr.MAX_KUBERNETES_NAME, "namespace": "ns\\ud800\\x1b[2J",
                                  "container": "c" * cr.MAX_KUBERNETES_NAME}  # fmt: skip
    assert read["id"] == "sha256:" + hashlib.sha256(b"x" * 5000).hexdigest()
    assert read["gpu_memory_limit"] == {"GPU-1": 1 << 30}


def test_the_hook_collects_only_past_its_threshold(tmp_path, monkeypatch):
    directory = str(tmp_path / "records")
    dead = cr.build(_state(os.getpid()), {}, (), 0.1)
    dead["pid_start"] -= 1
    monkeypatch.setattr(cr, "COLLECT_ABOVE", 5)
    monkeypatch.setattr(cr, "CHECK_ONE_IN", 1)  # every start looks
    for i in range(5):
        assert cr.write(directory, dict(dead, id=f"dead{i}"))
    assert len(os.listdir(directory)) == 5  # not past the threshold: nothing collected
    assert cr.write(directory, dict(dead, id="dead5"))
    assert os.listdir(directory) == []


def test_a_collection_told_to_stop_removes_only_what_it_read(tmp_path):
    """stop (a start server's idle spare: an offer came) ends the reading at once: of the gone
    containers' records, only those read before it said so are removed, and the rest wait for
    the next look."""
    directory = str(tmp_path / "records")
    dead = cr.build(_state(os.getpid()), {}, (), 0.1)
    dead["pid_start"] -= 1
    for i in range(6):  # below COLLECT_ABOVE: write() itself collects none
        assert cr.write(directory, dict(dead, id=f"dead{i}"))
    asked = []

    def stop():
        asked.append(True)
        return len(asked) > 2

    removed = cr.collect(directory, stop=stop)
    assert len(removed) == 2 and len(os.listdir(directory)) == 4, (removed, os.listdir(directory))
    assert sorted(cr.collect(directory) + removed) == sorted(cr.file_name(f"dead{i}") for i in range(6))


# --- what real starts leave ----------------------------------------------------------------------

ANNOTATIONS = {"io.kubernetes.pod.name": "pod-x", "io.kubernetes.pod.namespace": "ns-x",
               "io.kubernetes.container.name": "ctr-x"}  # fmt: skip


def test_a_gpu_start_leaves_its_record(live_container):
    state, bundle, pid, cgroup, host = live_container({"NVIDIA_VISIBLE_DEVICES": "0,1:1"})
    config = json.load(open(os.path.join(bundle, "config.json")))
    config["annotations"] = ANNOTATIONS
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(config, f)
    started = time.monotonic()
    done = hookcheck.run_hook(f"{host['root']}/config.yaml", state)
    lived = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    container_id = json.loads(state)["id"]
    records = cr.read_all(f"{host['root']}/containers")
    record = records[cr.file_name(container_id)]
    gpus = host["gpus"]
    assert record["devices"] == [
        {"gpu_index": 0, "gpu_uuid": gpus[0]["uuid"], "mig_index": None, "mig_uuid": None},
        {"gpu_index": 1, "gpu_uuid": gpus[1]["uuid"], "mig_index": 1, "mig_uuid": gpus[1]["mig"][1]["uuid"]},
    ]
    assert record["pid"] == pid and cr.is_live(record)
    assert record["cgroup"] == "/" + os.path.relpath(cgroup, "/sys/fs/cgroup/devices")
    assert record["kubernetes"] == {"pod": "pod-x", "namespace": "ns-x", "container": "ctr-x"}
    # The hook's own time, in seconds: some, and no more than its process lived as seen from here
    # (not a bound on how long a start may take; the kernel's start time is in clock ticks, so a
    # duration counted from it may read up to one tick long). Two ticks: one CI run read 0.5 ms past
    # the one tick (55.07 ms against 44.53 lived), a skew whose source is not found yet.
    assert 0 < record["duration_seconds"] <= lived + 2 / os.sysconf("SC_CLK_TCK")


def test_a_failed_start_leaves_a_failure_record(live_container):
    state, bundle, pid, cgroup, host = live_container({"NVIDIA_VISIBLE_DEVICES": "7"})  # no GPU 7
    done = hookcheck.run_hook(f"{host['root']}/config.yaml", state)
    assert done.returncode == 5, done.stderr
    record = cr.read_all(f"{host['root']}/containers")[cr.file_name(json.loads(state)["id"])]
    assert record["pid"] == pid
    assert (record["outcome"], record["reason"], record["devices"]) == ("failed", "request", [])


def test_a_non_gpu_container_leaves_no_record(live_container):
    state, bundle, pid, cgroup, host = live_container({"NVIDIA_VISIBLE_DEVICES": "void"})
    assert hookcheck.run_hook(f"{host['root']}/config.yaml", state).returncode == 0
    assert not [r for r in cr.read_all(f"{host['root']}/containers").values() if r and r["pid"] == pid]


def _as_the_runtime_applied(host, bundle, names, env):
    """config.json as a runtime that applied the spec `cdi generate` wrote leaves it for the
    named devices (CRI-O; containerd 1.7+): their nodes in linux.devices, their variables in the
    env, NVIDIA_VISIBLE_DEVICES=void from the spec's own edits. No mounts: the hook must not need
    the driver files to record the container."""
    from oci_gpu_hook.start import inventory_cache, settings
    from oci_gpu_hook.toolkit import cdi

    config_file = f"{host['root']}/config.yaml"
    spec = cdi.build_spec(inventory_cache.load(settings.load(config_file)), settings.load(config_file))
    edits = [d["containerEdits"] for d in spec["devices"] if d["name"] in names]
    assert len(edits) == len(names)
    config = json.load(open(os.path.join(bundle, "config.json")))
    config["process"]["env"] += [e for edit in edits for e in edit["env"]] + env
    nodes = [n for edit in [spec["containerEdits"], *edits] for n in edit["deviceNodes"]]
    config["linux"]["devices"] = [{"path": n["path"], "type": "c", "major": n["major"], "minor": n["minor"],
                                   "fileMode": 0o666, "uid": 0, "gid": 0} for n in nodes]  # fmt: skip
    config["annotations"] = ANNOTATIONS
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(config, f)


def test_a_start_whose_devices_the_runtime_applied_leaves_a_record_marked_so(live_container):
    """cdi-cri and cdi-annotations on a runtime that applies CDI (issue 39, item 7): the hook
    gives nothing, and records the container, its devices, its limit and its pod, so that the
    watchdog enforces the limit and the exporter names the pod."""
    state, bundle, pid, cgroup, host = live_container({"NVIDIA_VISIBLE_DEVICES": "void"})
    gpus = host["gpus"]
    _as_the_runtime_applied(host, bundle, [gpus[0]["uuid"], "1:1"], ["OCI_GPU_HOOK_GPU_MEMORY_LIMIT=1GiB"])
    rootfs = os.path.join(bundle, "rootfs")
    before = sorted(os.listdir(os.path.join(rootfs, "dev")))
    done = hookcheck.run_hook(f"{host['root']}/config.yaml", state)
    assert done.returncode == 0, done.stderr
    record = cr.read_all(f"{host['root']}/containers")[cr.file_name(json.loads(state)["id"])]
    mig = gpus[1]["mig"][1]
    assert sorted(record["devices"], key=lambda d: d["gpu_index"]) == [
        {"gpu_index": 0, "gpu_uuid": gpus[0]["uuid"], "mig_index": None, "mig_uuid": None},
        {"gpu_index": 1, "gpu_uuid": gpus[1]["uuid"], "mig_index": 1, "mig_uuid": mig["uuid"]},
    ]
    assert (record["outcome"], record["applied_by"], record["pid"]) == ("started", "runtime", pid)
    assert record["gpu_memory_limit"] == {gpus[0]["uuid"]: 1 << 30, mig["uuid"]: 1 << 30}
    assert record["kubernetes"] == {"pod": "pod-x", "namespace": "ns-x", "container": "ctr-x"}
    # The runtime configured the container: the hook made no node and mounted nothing.
    assert sorted(os.listdir(os.path.join(rootfs, "dev"))) == before
    with open(f"/proc/{pid}/mountinfo") as f:
        assert "nvidia" not in f.read()


def test_devices_the_runtime_did_not_apply_are_neither_given_nor_recorded(live_container):
    """The variables are the pod's to forge; linux.devices is the runtime's alone. Without the
    devices' nodes there, the hook gives nothing (these variables never ask it for a GPU) and
    records nothing."""
    state, bundle, pid, cgroup, host = live_container({"NVIDIA_VISIBLE_DEVICES": "void"})
    _as_the_runtime_applied(host, bundle, ["0"], [])
    config = json.load(open(os.path.join(bundle, "config.json")))
    config["linux"]["devices"] = [d for d in config["linux"]["devices"] if d["path"] != "/dev/nvidia0"]
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(config, f)
    done = hookcheck.run_hook(f"{host['root']}/config.yaml", state)
    assert done.returncode == 0, done.stderr
    assert not [r for r in cr.read_all(f"{host['root']}/containers").values() if r and r["pid"] == pid]
    with open(f"/proc/{pid}/mountinfo") as f:
        assert "nvidia" not in f.read()
