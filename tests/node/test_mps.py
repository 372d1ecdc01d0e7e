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

    from oci_gpu_hook.start import pids

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
        while pids.start_ticks(pid) is not None:  # gone, or a zombie: what mps.alive() goes by
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


def test_what_a_pod_puts_in_the_pipe_directory_does_not_steer_the_daemons_watch(host, tmp_path):
    """A client pod has the pipe directory read-write (mps.client_answer): the pid file there is the
    pod's to remove or replace, and the plugin that watches the daemon runs as root. Its watch must
    not hang on a FIFO put there, must not restart the shared daemon (cutting every other pod's
    clients off) because the file went, and must not take a process the pod names there for the
    daemon that died. (A symlink there, to /dev/watchdog say, is never opened either.)"""
    import signal
    import threading
    import time

    from oci_gpu_hook.start import pids

    inventory = inventory_of(config_with(host, tmp_path, ""))
    resource = mps_resource(inventory, tmp_path / "mps")
    pid_path = os.path.join(mps.pipe_dir(resource.mps_root, resource.name), mps.PID_FILE)
    said = []
    daemons = mps.Daemons(said.append)
    decoy = None
    try:
        daemons.sync([resource], inventory)
        with open(pid_path) as f:
            pid = int(f.read())
        os.unlink(pid_path)  # the pod removes it: the daemon runs on
        assert not daemons.lost() and list(daemons.running) == [resource.name]
        os.mkfifo(pid_path)  # the pod puts a FIFO there: nothing opens it and waits
        answers = []
        watch = threading.Thread(target=lambda: answers.append(daemons.lost()), daemon=True)
        watch.start()
        watch.join(10)  # a hang guard only
        if watch.is_alive():  # let the blocked open go, so the test ends
            os.close(os.open(pid_path, os.O_WRONLY | os.O_NONBLOCK))
            watch.join(10)
        assert answers == [False] and list(daemons.running) == [resource.name]
        os.unlink(pid_path)
        # A process named as the control program (a pod's, say), its pid put there, and the daemon gone.
        decoy = subprocess.Popen([mps.CONTROL, "60"], executable="/bin/sleep")
        with open(pid_path, "w") as f:
            f.write(f"{decoy.pid}\n")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10  # a hang guard only
        while pids.start_ticks(pid) is not None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert daemons.lost() and daemons.running == {}
    finally:
        if decoy is not None:
            decoy.kill()
            decoy.wait()
        daemons.stop_all()


@pytest.mark.parametrize("case", ["root-owned-by-a-user", "shm-a-symlink", "parent-others-can-write"])
def test_an_mps_root_others_can_change_is_refused_and_nothing_outside_it_changes(host, tmp_path, case):
    """The plugin makes and chmods the daemons' directories under flags.mpsRoot as root (shm 1777).
    Where a local user owns a directory on the way (mpsRoot under /tmp, made first by them), a
    symlink there (shm -> /etc, say) would have root make /etc world-writable and mount it into
    every client pod. Every directory is made and chmodded through descriptors, never through a
    symlink, in directories root alone can change; else the start is refused in one line."""
    inventory = inventory_of(config_with(host, tmp_path, ""))
    victim = tmp_path / "victim"  # root's, as /etc is
    victim.mkdir(mode=0o755)
    place = tmp_path / "place"
    place.mkdir(mode=0o755)
    root = place / "mps"
    root.mkdir(mode=0o755)
    if case == "root-owned-by-a-user":
        os.chown(root, 65534, 65534)
        os.symlink(victim, root / "shm")
        os.lchown(root / "shm", 65534, 65534)
    elif case == "shm-a-symlink":
        os.symlink(victim, root / "shm")
    else:
        os.chmod(place, 0o777)
        os.symlink(victim, root / "shm")
    daemons = mps.Daemons([].append)
    try:
        with pytest.raises(mps.MpsError) as refused:
            daemons.sync([mps_resource(inventory, root)], inventory)
    finally:
        daemons.stop_all()
    assert "\n" not in refused.value.message and "flags.mpsRoot" in refused.value.message
    assert os.stat(victim).st_mode & 0o7777 == 0o755 and os.listdir(victim) == []
    assert daemons.running == {}


def test_a_device_node_put_as_the_pid_file_is_never_opened(host, tmp_path):
    """A pod with CAP_MKNOD may make a device node in the pipe directory, where the plugin reads
    the daemon's pid file as root, outside any device cgroup: opening /dev/watchdog's numbers arms
    the node's watchdog. The plugin looks at what is there (O_PATH) before it opens anything: a
    node is not read (inotify would see a read-only open and close of it), and the daemon is then
    not watched, which the log says. /dev/null's numbers stand in for the watchdog's."""
    import ctypes
    import select
    import stat
    import struct

    inventory = inventory_of(config_with(host, tmp_path, ""))
    resource = mps_resource(inventory, tmp_path / "mps")
    pipe = mps.pipe_dir(resource.mps_root, resource.name)
    os.makedirs(pipe)
    node = os.path.join(pipe, mps.PID_FILE)
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    libc = ctypes.CDLL(None, use_errno=True)
    inotify = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert inotify >= 0
    in_close_nowrite = 0x10
    said = []
    daemons = mps.Daemons(said.append)
    try:
        assert libc.inotify_add_watch(inotify, node.encode(), in_close_nowrite) >= 0
        daemons.sync([resource], inventory)  # the daemon writes its pid into the node: lost
        reads = []
        while select.select([inotify], [], [], 0.2)[0]:
            data = os.read(inotify, 4096)
            reads += [struct.unpack_from("iIII", data, offset)[1] for offset in range(0, len(data), 16)]
        assert reads == []
        assert list(daemons.running) == [resource.name] and not daemons.lost()
        program = daemons.running[resource.name].program
        assert said[-1] == (f"{resource.name}: the MPS daemon's {mps.PID_FILE} names no process of {program}: "
                            "if the daemon dies, it is not started again")  # fmt: skip
    finally:
        os.close(inotify)
        daemons.stop_all()


# The daemons' life in a mount namespace of its own (unshare --propagation private), so that what
# the plugin mounts on the host reaches no other process, and goes with the namespace.
SHM_LIFE = """
import json, os, sys
from oci_gpu_hook.node import mps, plugin_config, plugin_devices
from oci_gpu_hook.start import inventory_cache, settings
config, root = sys.argv[1:]
inventory = inventory_cache.load(settings.load(config))
doc = {"flags": {"mpsRoot": root}, "sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}}
(resource,) = plugin_devices.resources(inventory, plugin_config.parse(doc, "test"))
def shm():
    st, vfs = os.stat(root + "/shm"), os.statvfs(root + "/shm")
    return {"own": st.st_dev != os.stat(root).st_dev, "mode": oct(st.st_mode & 0o7777),
            "bytes": vfs.f_blocks * vfs.f_frsize, "flags": vfs.f_flag & (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC)}
daemons = mps.Daemons([].append)
daemons.sync([resource], inventory)
try:
    running = shm()
    with open(root + "/shm/fill", "wb") as f:  # what a pod writes to its /dev/shm lands here
        try:
            f.write(b"x" * (mps.SHM_BYTES + (1 << 20)))
            running["filled"] = "all"
        except OSError as e:
            running["filled"] = e.strerror
finally:
    daemons.stop_all()
print(json.dumps({"running": running, "stopped": shm()["own"]}))
"""


def test_the_clients_dev_shm_is_a_bounded_tmpfs_of_its_own(host, tmp_path):
    """<mpsRoot>/shm is every client pod's /dev/shm, read-write: as a plain directory it was the
    filesystem mpsRoot lies on (/run by default), which a pod could fill for the whole node (no
    runtime, no systemd unit could then write to /run), its files outliving it. As NVIDIA's
    mount-shm does, it is a tmpfs of its own: 64 MiB, nosuid, nodev, noexec; unmounted when the
    daemons stop."""
    config = config_with(host, tmp_path, "")
    root = str(tmp_path / "mps")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", SHM_LIFE, config,
                           root], capture_output=True, text=True, timeout=120, cwd=os.getcwd())  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    flags = os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC
    assert got == {"running": {"own": True, "mode": "0o1777", "bytes": 64 << 20, "flags": flags,
                               "filled": "No space left on device"}, "stopped": False}  # fmt: skip
