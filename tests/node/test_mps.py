"""MPS sharing (node/mps.py): the daemon's defaults and a client's answer from a simulated host's
inventory, the daemons' life cycle with the simulator's control program (its record of what it
was told), and the same commands accepted by NVIDIA's real nvidia-cuda-mps-control (driver
550.163.01, run only where /dev is private: tests/drivercheck.py)."""

import json
import os
import subprocess
import sys

import drivercheck
import pytest
from hookcheck import config_with

from oci_gpu_hook.node import mps, plugin_config, plugin_devices

pytestmark = pytest.mark.host(gpus=2, mig=[])
MIB = 1 << 20


def inventory_of(config_path):
    from oci_gpu_hook.start import inventory_cache
    from oci_gpu_hook.start import settings as settings_module

    return inventory_cache.load(settings_module.load(config_path))


def mps_resource(inventory, root, replicas=2, **flags):
    doc = {"flags": {"mpsRoot": str(root), **flags},
           "sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": replicas}]}}}  # fmt: skip
    (resource,) = plugin_devices.resources(inventory, plugin_config.parse(doc, "test"))
    return resource


def record(host) -> list:
    try:
        with open(os.path.join(host["root"], "mps-control.log")) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def test_defaults_and_a_clients_answer_follow_the_hosts_gpus(host, tmp_path):
    inventory = inventory_of(config_with(host, tmp_path, ""))
    resource = mps_resource(inventory, tmp_path / "mps", replicas=4)
    share = host["gpus"][0]["model"]["memory_total"] // 4 // MIB  # from the simulator's record, not our code
    assert resource.mps_root == str(tmp_path / "mps") and len(resource.devices) == 8
    assert mps.daemon_commands(resource) == (f"set_default_device_pinned_mem_limit 0 {share}M",
                                             f"set_default_device_pinned_mem_limit 1 {share}M",
                                             "set_default_active_thread_percentage 25")  # fmt: skip
    units = [resource.devices[0].unit]
    envs, mounts = mps.client_answer(resource, units)
    assert envs == {"CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe", "CUDA_MPS_LOG_DIRECTORY":
                    "/mps/nvidia.com/gpu/log", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={share}M"}  # fmt: skip
    root = str(tmp_path / "mps")
    assert mounts == (("/mps/nvidia.com/gpu/pipe", f"{root}/nvidia.com/gpu/pipe", False),
                      ("/mps/nvidia.com/gpu/log", f"{root}/nvidia.com/gpu/log", True),
                      ("/dev/shm", f"{root}/shm", False))  # fmt: skip
    # Renamed (renameByDefault), the directories follow the resource's name, as NVIDIA's do.
    doc = {"sharing": {"mps": {"renameByDefault": True, "resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}}
    (renamed,) = plugin_devices.resources(inventory, plugin_config.parse(doc, "test"))
    assert renamed.name == "nvidia.com/gpu.shared" and renamed.mps_root == plugin_config.DEFAULT_MPS_ROOT
    assert mps.client_answer(renamed, units)[0]["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/nvidia.com/gpu.shared/pipe"


def test_the_plugins_allocate_answer_carries_the_mps_client_answer(host, tmp_path):
    from oci_gpu_hook.node import plugin_allocation

    inventory = inventory_of(config_with(host, tmp_path, ""))
    doc = {"flags": {"mpsRoot": str(tmp_path / "mps")},
           "sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}}  # fmt: skip
    config = plugin_config.parse(doc, "test")
    (resource,) = plugin_devices.resources(inventory, config)
    answer = plugin_allocation.allocate(resource, [resource.devices[3].id], config, inventory, "nvidia.com/gpu")
    envs, mounts = mps.client_answer(resource, [resource.devices[3].unit])
    assert answer.envs == {"NVIDIA_VISIBLE_DEVICES": host["gpus"][1]["uuid"], **envs}
    assert answer.mounts == mounts
    with pytest.raises(plugin_allocation.AllocationError, match="failRequestsGreaterThanOne"):
        plugin_allocation.allocate(resource, [d.id for d in resource.devices[:2]], config, inventory, "k")


def test_daemons_start_with_their_defaults_restart_on_a_change_and_quit(host, tmp_path):
    inventory = inventory_of(config_with(host, tmp_path, ""))
    root = tmp_path / "mps"
    pipe = f"{root}/nvidia.com/gpu/pipe"
    said = []
    daemons = mps.Daemons(said.append)
    before = len(record(host))
    try:
        daemons.sync([mps_resource(inventory, root, replicas=2)], inventory)
        told = [line for line in record(host)[before:] if line.startswith(pipe + " Cmd:")]
        # (The quit for a daemon an earlier run left found none: nothing answered it.)
        assert tuple(line.split(" Cmd:")[1] for line in told) == mps.daemon_commands(
            mps_resource(inventory, root, replicas=2)
        )
        assert os.path.exists(f"{pipe}/control") and os.path.exists(f"{root}/nvidia.com/gpu/log/control.log")
        daemons.sync([mps_resource(inventory, root, replicas=2)], inventory)  # nothing changed: left alone
        assert len([s for s in said if "MPS daemon started" in s]) == 1
        daemons.sync([mps_resource(inventory, root, replicas=5)], inventory)  # new defaults: started again
        assert record(host)[-1] == f"{pipe} Cmd:set_default_active_thread_percentage 20"
        assert [s.split(" (")[0] for s in said] == ["nvidia.com/gpu: MPS daemon started", "nvidia.com/gpu: MPS daemon "
                                                    "stopped", "nvidia.com/gpu: MPS daemon started"]  # fmt: skip
        assert said[-1].endswith("; set_default_active_thread_percentage 20)") and pipe in said[-1]
    finally:
        daemons.stop_all()
    assert record(host)[-2:] == [f"{pipe} Cmd:quit", f"{pipe} Exit with status 0"]
    assert not os.path.exists(f"{pipe}/control") and daemons.running == {}


def test_a_daemon_that_cannot_start_is_one_line(host, tmp_path):
    inventory = inventory_of(config_with(host, tmp_path, ""))
    resource = mps_resource(inventory, tmp_path / "mps")
    with pytest.raises(mps.MpsError) as e:
        mps.launch(resource, str(tmp_path / "no-such-program"))
    assert "\n" not in e.value.message and "starting the MPS daemon for nvidia.com/gpu failed" in e.value.message


def test_our_daemon_commands_are_what_the_real_control_program_takes(host, tmp_path, require):
    """The real driver's files: the inventory finds its nvidia-cuda-mps-control, and the real
    program, started as the plugin starts it, takes every default the plugin sets and answers them
    back (no 'Unknown command'); quit stops it."""
    require("root", "gcc", "ldconfig", "unshare")
    layout = drivercheck.make_layout("rhel", str(tmp_path / "driver"))
    state = tmp_path / "state"
    state.mkdir()
    real_config = tmp_path / "real.yaml"
    real_config.write_text(drivercheck.config_text(layout, host["root"], str(state)))
    root = tmp_path / "mps"
    # Everything that runs the real program runs where /dev is private (drivercheck's rule).
    script = (
        "import json, sys\n"
        "from oci_gpu_hook.node import mps, plugin_config, plugin_devices\n"
        "from oci_gpu_hook.start import discover, inventory_cache, settings\n"
        "real = discover.discover(settings.load(sys.argv[1]))\n"
        "program = mps.control_program(real)\n"
        "simulated = inventory_cache.load(settings.load(sys.argv[2]))\n"
        "doc = {'flags': {'mpsRoot': sys.argv[3]}, 'sharing': {'mps': {'resources': "
        "[{'name': 'nvidia.com/gpu', 'replicas': 2}]}}}\n"
        "(resource,) = plugin_devices.resources(simulated, plugin_config.parse(doc, 'test'))\n"
        "daemon = mps.launch(resource, program)\n"
        "asked = ['get_default_active_thread_percentage', 'get_default_device_pinned_mem_limit 0',\n"
        "         'get_default_device_pinned_mem_limit 1']\n"
        "answer = mps.send(daemon, asked)\n"
        "mps.stop(daemon)\n"
        "print(json.dumps({'program': program, 'commands': daemon.commands, 'answer': answer}))\n"
    )
    out = drivercheck.run_with_private_dev(
        # (A host's /dev has shm; the private one starts empty.)
        ["sh", "-c", 'mkdir /dev/shm && exec "$@"', "sh", sys.executable, "-c", script, str(real_config),
         config_with(host, tmp_path, ""), str(root)],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=os.getcwd())  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["program"] == os.path.join(layout, "usr/bin/nvidia-cuda-mps-control")
    share_gib = host["gpus"][0]["model"]["memory_total"] // 2 >> 30
    assert result["answer"].split() == ["50.0", f"{share_gib}G", f"{share_gib}G"], result
    log = (root / "nvidia.com/gpu/log/control.log").read_text()
    assert all(f"Cmd:{c}" in log for c in result["commands"]), log
    assert "Unknown command" not in log and "Exit with status 0" in log, log
    # (The real daemon leaves its socket file behind when it quits; the next start binds anew.)


def test_a_driver_without_the_control_program_is_one_line(host, tmp_path):
    inventory = inventory_of(config_with(host, tmp_path, ""))
    assert mps.control_program(inventory) == os.path.join(host["root"], "usr/bin/nvidia-cuda-mps-control")
    without = inventory.replace(files=tuple(f for f in inventory.files if "mps-control" not in f.path))
    with pytest.raises(mps.MpsError) as e:
        mps.start(mps_resource(without, tmp_path / "mps"), without)
    assert e.value.message == "sharing.mps: the driver has no nvidia-cuda-mps-control (it is part of the driver's " \
                              "compute files)"  # fmt: skip


def test_a_daemon_that_died_is_seen_and_started_again(host, tmp_path):
    import signal
    import time

    inventory = inventory_of(config_with(host, tmp_path, ""))
    resource = mps_resource(inventory, tmp_path / "mps")
    pipe = mps.pipe_dir(resource.mps_root, resource.name)
    said = []
    daemons = mps.Daemons(said.append)
    try:
        daemons.sync([resource], inventory)
        assert not daemons.lost() and said == [said[0]]
        pid = int(open(os.path.join(pipe, mps.PID_FILE)).read())
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10  # a hang guard only
        while os.path.exists(f"/proc/{pid}/cmdline") and open(f"/proc/{pid}/cmdline", "rb").read():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert daemons.lost() and daemons.running == {}
        assert said[-1] == f"nvidia.com/gpu: the MPS daemon is gone ({pipe}): starting it again"
        before = len(record(host))
        daemons.sync([resource], inventory)  # its socket was left behind: the new daemon binds anew
        assert [line.split(" Cmd:")[1] for line in record(host)[before:] if " Cmd:" in line] == list(
            mps.daemon_commands(resource)
        )
        assert not daemons.lost() and int(open(os.path.join(pipe, mps.PID_FILE)).read()) != pid
    finally:
        daemons.stop_all()
    assert not os.path.exists(os.path.join(pipe, mps.PID_FILE))
