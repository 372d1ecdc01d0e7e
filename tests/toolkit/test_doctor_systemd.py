"""doctor asks systemd about the units install writes (issue 38, item 4). Under systemd itself
this runs in the node VM (tests/vm/scenarios/systemd_units.sh); here, what it does where systemd
cannot be asked."""

import os

from oci_gpu_hook.toolkit import doctor, install


def test_the_node_checks_name_the_units_install_writes():
    assert doctor.NODE_UNITS == {"exporter": install.EXPORTER_SERVICE, "labels": install.LABELS_SERVICE,
                                 "watchdog": install.WATCHDOG_SERVICE,
                                 "device_plugin": install.DEVICE_PLUGIN_SERVICE}  # fmt: skip


def test_no_systemd_is_asked_about_another_root(tmp_path):
    """An image tree's units are not the running systemd's: nothing is said of them."""
    assert doctor.unit_state(str(tmp_path), install.PATH_UNIT) is None
    assert doctor.systemd_says(str(tmp_path), install.EXPORTER_SERVICE) == ""


def test_no_systemd_is_asked_where_it_is_not_pid_1():
    if os.path.isdir("/run/systemd/system"):
        return  # a systemd host: the node VM's scenario covers it
    assert doctor.unit_state("/", install.PATH_UNIT) is None


def test_a_service_started_through_the_pre_filter_is_found():
    """What a unit install wrote runs as, once the pre-filter hands over: the Python launcher as a
    script (`python -IS .../oci-gpu-hook-python watchdog`). The node VM found doctor blind to it."""
    import subprocess
    import sys

    from oci_gpu_hook.toolkit import launcher

    script = "import time; print('ready', flush=True); time.sleep(60)"
    argv = [sys.executable, "-c", script, launcher.PYTHON_LAUNCHER, "watchdog"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"ready\n"  # running as itself, not a fork on its way there
        assert proc.pid in doctor.service_processes("watchdog")
        assert proc.pid not in doctor.service_processes("device-plugin")
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_only_ascii_digit_names_under_proc_are_processes(tmp_path):
    """'¹' under /proc made int() raise out of doctor, and '٣' was counted as process 3."""
    for name in ("12", "\u00b9", "\u0663", "\uff12"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cmdline").write_bytes(b"/usr/bin/oci-gpu-hook\0watchdog\0")
    assert doctor.service_processes("watchdog", proc=str(tmp_path)) == [12]
