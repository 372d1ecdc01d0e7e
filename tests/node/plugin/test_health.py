"""node/plugin/health.py: the device plugin's verdicts, kept for the exporter. Only a file the
plugin wrote (write_trusted's owner and mode) while its process runs is a verdict: anyone else's
file, or a stopped plugin's, says nothing."""

import json
import os
import subprocess

from oci_gpu_hook.node.plugin import health

UUID = "GPU-00000000-0000-0000-0000-000000000000"


def records_directory(tmp_path) -> str:
    path = tmp_path / "run" / "containers"
    path.mkdir(parents=True, mode=0o700)
    return str(path)


def test_what_the_plugin_keeps_the_exporter_reads(tmp_path, require):
    require("root")
    records = records_directory(tmp_path)
    verdicts = {UUID: None, "MIG-11111111-1111-1111-1111-111111111111": "XID 79 (a critical XID: health.criticalXids)"}
    health.write_health(records, verdicts)
    assert health.read_health(records) == verdicts
    st = os.stat(health.health_path(records))
    assert os.path.dirname(health.health_path(records)) == os.path.dirname(records)  # beside, not among records
    assert st.st_mode & 0o022 == 0 and st.st_uid != 0  # write_trusted's: no one else writes it, nor root's


def test_a_file_anyone_else_wrote_is_no_verdict(tmp_path, require):
    require("root")
    records = records_directory(tmp_path)
    path = health.health_path(records)
    with open(path, "w") as f:  # root's, as any uid 0 could write it
        json.dump({"format": 1, "pid": os.getpid(), "devices": {UUID: "forged"}}, f)
    assert health.read_health(records) == {}
    os.unlink(path)
    os.symlink("/etc/passwd", path)
    assert health.read_health(records) == {}


def test_a_stopped_plugins_verdicts_end_with_it_a_reused_pid_included(tmp_path, require):
    require("root")
    records = records_directory(tmp_path)
    gone = subprocess.Popen(["true"])
    gone.wait()
    health.write_health(records, {UUID: "NVML does not list it"})
    with open(health.health_path(records)) as f:
        doc = json.load(f)
    from oci_gpu_hook.start.settings import write_trusted

    write_trusted(health.health_path(records), json.dumps(dict(doc, pid=gone.pid)).encode())
    assert health.read_health(records) == {}
    # A live process on the plugin's pid that is not the plugin (a reused pid: another start time)
    write_trusted(health.health_path(records), json.dumps(dict(doc, pid_start=doc["pid_start"] - 1)).encode())
    assert health.read_health(records) == {}
    write_trusted(health.health_path(records), json.dumps(doc).encode())
    assert health.read_health(records) == {UUID: "NVML does not list it"}
