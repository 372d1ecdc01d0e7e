"""MPS sharing (plugin/mps.py): the daemon's defaults and a client's answer from a simulated host's
inventory, the daemons' life cycle with the simulator's control program (its record of what it
was told), the same commands accepted by NVIDIA's real nvidia-cuda-mps-control (driver
550.163.01, run only where /dev is private: tests/drivercheck.py), and hostile client pods (uid 0,
no capability, in a root of their own holding what a client container gets) against the daemons."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import drivercheck
import pytest
from hookcheck import config_with

from oci_gpu_hook.node.plugin import config as plugin_config
from oci_gpu_hook.node.plugin import mps
from oci_gpu_hook.node.plugin import resources as plugin_resources

pytestmark = pytest.mark.host(gpus=2, mig=[])
MIB = 1 << 20


def inventory_of(config_path):
    from oci_gpu_hook.start import inventory_cache
    from oci_gpu_hook.start import settings as settings_module

    return inventory_cache.load(settings_module.load(config_path))


def mps_resource(inventory, root, replicas=2, renamed=False):
    doc = {"flags": {"mpsRoot": str(root)},
           "sharing": {"mps": {"renameByDefault": renamed,
                               "resources": [{"name": "nvidia.com/gpu", "replicas": replicas}]}}}  # fmt: skip
    (resource,) = plugin_resources.resources(inventory, plugin_config.parse(doc, "test"))
    return resource


@pytest.fixture
def mps_root():
    """A short mpsRoot of the test's own: the daemon's sockets must have paths of at most 107
    bytes, which pytest's tmp_path, deep and long-named, leaves too little room for."""
    path = tempfile.mkdtemp(prefix="mps-", dir="/tmp")
    yield pathlib.Path(path)
    shutil.rmtree(path)


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
                      ("/dev/shm", f"{root}/nvidia.com/gpu/shm", False))  # fmt: skip
    # Renamed (renameByDefault), the directories follow the resource's name, as NVIDIA's do.
    doc = {"sharing": {"mps": {"renameByDefault": True, "resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}}
    (renamed,) = plugin_resources.resources(inventory, plugin_config.parse(doc, "test"))
    assert renamed.name == "nvidia.com/gpu.shared" and renamed.mps_root == plugin_config.DEFAULT_MPS_ROOT
    assert mps.client_answer(renamed, units)[0]["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/nvidia.com/gpu.shared/pipe"


def test_the_plugins_allocate_answer_carries_the_mps_client_answer(host, tmp_path):
    from oci_gpu_hook.node.plugin import allocation

    inventory = inventory_of(config_with(host, tmp_path, ""))
    doc = {"flags": {"mpsRoot": str(tmp_path / "mps")},
           "sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}}  # fmt: skip
    config = plugin_config.parse(doc, "test")
    (resource,) = plugin_resources.resources(inventory, config)
    answer = allocation.allocate(resource, [resource.devices[3].id], config, inventory, "nvidia.com/gpu")
    envs, mounts = mps.client_answer(resource, [resource.devices[3].unit])
    assert answer.envs == {"NVIDIA_VISIBLE_DEVICES": host["gpus"][1]["uuid"], **envs}
    assert answer.mounts == mounts
    with pytest.raises(allocation.AllocationError) as e:
        allocation.allocate(resource, [d.id for d in resource.devices[:2]], config, inventory, "k")
    # The key of MPS sharing, which the refusal named as sharing.timeSlicing's (issue 52, item 8b).
    assert str(e.value) == ("nvidia.com/gpu: a container may ask for 1 MPS replica, not 2 "
                            "(sharing.mps.failRequestsGreaterThanOne, true unless set false)")  # fmt: skip


def test_daemons_start_with_their_defaults_restart_on_a_change_and_quit(host, tmp_path, mps_root):
    """Each start is a generation of its own: the clients' pipe and shm links name the new one
    once its daemon has its defaults, and the one before goes (its tmpfs detached, its
    directory removed); quit at the end removes the last."""
    inventory = inventory_of(config_with(host, tmp_path, ""))
    root = mps_root
    pipe = f"{root}/nvidia.com/gpu/pipe"
    said = []
    daemons = mps.Daemons(said.append)
    before = len(record(host))
    try:
        daemons.sync([mps_resource(inventory, root, replicas=2)], inventory)
        first = daemons.running["nvidia.com/gpu"].generation
        assert os.path.dirname(first) == f"{root}/nvidia.com/gpu"
        assert os.path.realpath(pipe) == mps.daemon_pipe(first)
        assert os.path.realpath(f"{root}/nvidia.com/gpu/shm") == mps.daemon_shm(first)
        told = [line for line in record(host)[before:] if line.startswith(mps.daemon_pipe(first) + " Cmd:")]
        assert tuple(line.split(" Cmd:")[1] for line in told) == mps.daemon_commands(
            mps_resource(inventory, root, replicas=2)
        )
        assert os.path.exists(f"{pipe}/control") and os.path.exists(f"{root}/nvidia.com/gpu/log/control.log")
        daemons.sync([mps_resource(inventory, root, replicas=2)], inventory)  # nothing changed: left alone
        assert len([s for s in said if "MPS daemon started" in s]) == 1
        daemons.sync([mps_resource(inventory, root, replicas=5)], inventory)  # new defaults: started again
        second = daemons.running["nvidia.com/gpu"].generation
        assert second != first and not os.path.lexists(first) and os.path.realpath(pipe) == mps.daemon_pipe(second)
        assert record(host)[-1] == f"{mps.daemon_pipe(second)} Cmd:set_default_active_thread_percentage 20"
        assert [s.split(" (")[0] for s in said] == ["nvidia.com/gpu: MPS daemon started", "nvidia.com/gpu: MPS daemon "
                                                    "stopped", "nvidia.com/gpu: MPS daemon started"]  # fmt: skip
        assert said[-1].endswith("; set_default_active_thread_percentage 20)") and second in said[-1]
    finally:
        daemons.stop_all()
    assert record(host)[-2:] == [f"{mps.daemon_pipe(second)} Cmd:quit", f"{mps.daemon_pipe(second)} Exit with status 0"]
    assert not os.path.exists(f"{pipe}/control") and daemons.running == {}
    assert sorted(os.listdir(f"{root}/nvidia.com/gpu")) == ["log", "pipe", "shm"]  # the links, dangling


def test_a_daemon_that_cannot_start_is_one_line(host, tmp_path, mps_root):
    inventory = inventory_of(config_with(host, tmp_path, ""))
    resource = mps_resource(inventory, mps_root)
    with pytest.raises(mps.MpsError) as e:
        mps.launch(resource, str(tmp_path / "no-such-program"))
    assert "\n" not in e.value.message and "starting the MPS daemon for nvidia.com/gpu failed" in e.value.message
    assert os.listdir(mps_root / "nvidia.com/gpu") == ["log"]  # its generation went, tmpfs and all


def test_our_daemon_commands_are_what_the_real_control_program_takes(host, tmp_path, mps_root, require):
    """The real driver's files: the inventory finds its nvidia-cuda-mps-control, and the real
    program, started as the plugin starts it (its generation's tmpfs, its own /dev/shm), takes
    every default the plugin sets and answers them back (no 'Unknown command'); quit stops it."""
    require("root", "gcc", "ldconfig", "unshare")
    layout = drivercheck.make_layout("rhel", str(tmp_path / "driver"))
    state = tmp_path / "state"
    state.mkdir()
    real_config = tmp_path / "real.yaml"
    real_config.write_text(drivercheck.config_text(layout, host["root"], str(state)))
    root = mps_root
    # Everything that runs the real program runs where /dev is private (drivercheck's rule).
    script = (
        "import json, sys\n"
        "from oci_gpu_hook.node.plugin import config as plugin_config\n"
        "from oci_gpu_hook.node.plugin import mps\n"
        "from oci_gpu_hook.node.plugin import resources as plugin_resources\n"
        "from oci_gpu_hook.start import discover, inventory_cache, settings\n"
        "real = discover.discover(settings.load(sys.argv[1]))\n"
        "program = mps.control_program(real)\n"
        "simulated = inventory_cache.load(settings.load(sys.argv[2]))\n"
        "doc = {'flags': {'mpsRoot': sys.argv[3]}, 'sharing': {'mps': {'resources': "
        "[{'name': 'nvidia.com/gpu', 'replicas': 2}]}}}\n"
        "(resource,) = plugin_resources.resources(simulated, plugin_config.parse(doc, 'test'))\n"
        "daemon = mps.launch(resource, program)\n"
        "asked = ['get_default_active_thread_percentage', 'get_default_device_pinned_mem_limit 0',\n"
        "         'get_default_device_pinned_mem_limit 1']\n"
        "answer = mps.send(daemon, asked)\n"
        "mps.stop(daemon)\n"
        "import os\n"
        "print(json.dumps({'program': program, 'commands': daemon.commands, 'answer': answer,\n"
        "                  'left': os.path.lexists(daemon.generation)}))\n"
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
    # It answered through the plugin's links to its sockets (as root, the real program connects to
    # control_privileged), and its generation went with it.
    assert result["answer"].split() == ["50.0", f"{share_gib}G", f"{share_gib}G"], result
    assert result["left"] is False
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


def test_a_daemon_that_died_is_seen_and_started_again(host, tmp_path, mps_root):
    import signal
    import time

    from oci_gpu_hook.start import pids

    inventory = inventory_of(config_with(host, tmp_path, ""))
    resource = mps_resource(inventory, mps_root)
    pipe = mps.pipe_dir(resource.mps_root, resource.name)
    said = []
    daemons = mps.Daemons(said.append)
    try:
        daemons.sync([resource], inventory)
        assert not daemons.lost() and said == [said[0]]
        dead = daemons.running[resource.name].generation
        pid = int(open(os.path.join(pipe, mps.PID_FILE)).read())
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10  # a hang guard only
        while pids.start_ticks(pid) is not None:  # gone, or a zombie: what mps.alive() goes by
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert daemons.lost() and daemons.running == {}
        assert said[-1] == f"nvidia.com/gpu: the MPS daemon is gone ({dead}): starting it again"
        assert not os.path.lexists(dead)  # its generation went at once (its socket, pid file and all)
        before = len(record(host))
        daemons.sync([resource], inventory)
        assert [line.split(" Cmd:")[1] for line in record(host)[before:] if " Cmd:" in line] == list(
            mps.daemon_commands(resource)
        )
        assert not daemons.lost() and int(open(os.path.join(pipe, mps.PID_FILE)).read()) != pid
    finally:
        daemons.stop_all()
    assert not os.path.exists(os.path.join(pipe, mps.PID_FILE))


def test_what_a_pod_puts_in_the_pipe_directory_does_not_steer_the_daemons_watch(host, tmp_path, mps_root):
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
    resource = mps_resource(inventory, mps_root)
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


@pytest.mark.parametrize("case", ["root-owned-by-a-user", "a-users-link-on-the-way", "log-a-link",
                                  "parent-others-can-write"])  # fmt: skip
def test_an_mps_root_others_can_change_is_refused_and_nothing_outside_it_changes(host, tmp_path, mps_root, case):
    """The plugin makes and chmods the daemons' directories under flags.mpsRoot as root, mounts
    tmpfs there (shm 1777) and mounts them into every client pod. Where a local user owns a
    directory on the way (mpsRoot under /tmp, made first by them), a symlink there (nvidia.com ->
    /etc, say) would have root make its directories in /etc, and mount them into every client pod.
    Every directory is made and chmodded through descriptors, never through a symlink of a user's
    (nor through one as the last component), in directories root alone can change; else the start
    is refused in one line."""
    inventory = inventory_of(config_with(host, tmp_path, ""))
    victim = mps_root / "victim"  # root's, as /etc is
    victim.mkdir(mode=0o755)
    place = mps_root / "place"
    place.mkdir(mode=0o755)
    root = place / "mps"
    root.mkdir(mode=0o755)
    if case == "log-a-link":
        (root / "nvidia.com/gpu").mkdir(parents=True)
        os.symlink(victim, root / "nvidia.com/gpu/log")
    else:
        os.symlink(victim, root / "nvidia.com")
    if case == "root-owned-by-a-user":
        os.chown(root, 65534, 65534)
        os.lchown(root / "nvidia.com", 65534, 65534)
    elif case == "a-users-link-on-the-way":
        os.lchown(root / "nvidia.com", 65534, 65534)
    elif case == "parent-others-can-write":
        os.chmod(place, 0o777)
    daemons = mps.Daemons([].append)
    try:
        with pytest.raises(mps.MpsError) as refused:
            daemons.sync([mps_resource(inventory, root)], inventory)
    finally:
        daemons.stop_all()
    assert "\n" not in refused.value.message and "the MPS directories must be root's alone" in refused.value.message
    assert os.stat(victim).st_mode & 0o7777 == 0o755 and os.listdir(victim) == []
    assert daemons.running == {}


def test_a_device_node_put_as_the_pid_file_is_never_opened(host, tmp_path, mps_root):
    """A pod with CAP_MKNOD may make a device node in its pipe directory, at the name where the
    daemon writes its pid as root, outside any device cgroup: opening /dev/watchdog's numbers arms
    the node's watchdog. Neither the plugin (which watches the daemon through /proc) nor the daemon
    it starts again when this one dies opens it (inotify sees no open): the new daemon's pipe
    directory is a new one. /dev/null's numbers stand in for the watchdog's."""
    import ctypes
    import select
    import signal
    import stat
    import struct
    import time

    from oci_gpu_hook.start import pids

    inventory = inventory_of(config_with(host, tmp_path, ""))
    resource = mps_resource(inventory, mps_root)
    node = os.path.join(mps.pipe_dir(resource.mps_root, resource.name), mps.PID_FILE)
    libc = ctypes.CDLL(None, use_errno=True)
    inotify = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert inotify >= 0
    in_open = 0x20
    daemons = mps.Daemons([].append)
    try:
        daemons.sync([resource], inventory)
        with open(node) as f:
            pid = int(f.read())
        os.unlink(node)
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        assert libc.inotify_add_watch(inotify, node.encode(), in_open) >= 0
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10  # a hang guard only
        while pids.start_ticks(pid) is not None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert daemons.lost()
        daemons.sync([resource], inventory)  # started again
        opened = []
        while select.select([inotify], [], [], 0.2)[0]:
            data = os.read(inotify, 4096)
            opened += [struct.unpack_from("iIII", data, offset)[1] & in_open for offset in range(0, len(data), 16)]
        assert in_open not in opened
        assert list(daemons.running) == [resource.name] and daemons.running[resource.name].process is not None
    finally:
        os.close(inotify)
        daemons.stop_all()


# The daemons' life in a mount namespace of its own (unshare --propagation private), so that what
# the plugin mounts on the host reaches no other process, and goes with the namespace.
SHM_LIFE = """
import json, os, sys
from oci_gpu_hook.node.plugin import config as plugin_config
from oci_gpu_hook.node.plugin import mps
from oci_gpu_hook.node.plugin import resources as plugin_resources
from oci_gpu_hook.start import inventory_cache, settings
config, root = sys.argv[1:]
inventory = inventory_cache.load(settings.load(config))
doc = {"flags": {"mpsRoot": root}, "sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}}
(resource,) = plugin_resources.resources(inventory, plugin_config.parse(doc, "test"))
def tmpfs(path):
    st, vfs = os.stat(path), os.statvfs(path)
    return {"own": st.st_dev != os.stat(root).st_dev, "mode": oct(st.st_mode & 0o7777),
            "bytes": vfs.f_blocks * vfs.f_frsize, "flags": vfs.f_flag & (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC)}
daemons = mps.Daemons([].append)
daemons.sync([resource], inventory)
shm, pipe = mps.shm_dir(root, resource.name), mps.pipe_dir(root, resource.name)
try:
    running, ipc = tmpfs(shm), tmpfs(pipe)
    with open(shm + "/fill", "wb") as f:  # what a pod writes to its /dev/shm lands here
        try:
            f.write(b"x" * (mps.SHM_BYTES + (1 << 20)))
            running["filled"] = "all"
        except OSError as e:
            running["filled"] = e.strerror
    generation = daemons.running[resource.name].generation
finally:
    daemons.stop_all()
print(json.dumps({"running": running, "pipe": ipc, "stopped": os.path.lexists(generation)}))
"""


def test_the_clients_dev_shm_is_a_bounded_tmpfs_of_its_own(host, tmp_path, mps_root):
    """The shm link is every client pod's /dev/shm, read-write: as a plain directory it was the
    filesystem mpsRoot lies on (/run by default), which a pod could fill for the whole node (no
    runtime, no systemd unit could then write to /run), its files outliving it. As NVIDIA's
    mount-shm does, it is a tmpfs of its own: 64 MiB, nosuid, nodev, noexec; the pipe directory
    too (4 MiB); both go when the daemon stops."""
    config = config_with(host, tmp_path, "")
    root = str(mps_root)
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", SHM_LIFE, config,
                           root], capture_output=True, text=True, timeout=120, cwd=os.getcwd())  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    flags = os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC
    assert got == {"running": {"own": True, "mode": "0o1777", "bytes": 64 << 20, "flags": flags,
                               "filled": "No space left on device"},
                   "pipe": {"own": True, "mode": "0o755", "bytes": 4 << 20, "flags": flags},
                   "stopped": False}  # fmt: skip


# --- hostile client pods --------------------------------------------------------------------------

# The view a client container of the resource gets, built in a mount namespace of its own: a tmpfs
# root holding the host's /usr (read-only, for the interpreter) and the client_answer's mounts at
# their container paths (their host paths resolved as the runtime resolves them); then chroot, and
# the pod's program run as uid 0 with no capability at all (setpriv: bounding, inheritable and
# ambient sets empty, no new privileges), as a container that runs as root without privileges.
POD_VIEW = """
import json, os, subprocess, sys
view, mounts, setpriv, python, program, plan = sys.argv[1], json.loads(sys.argv[2]), *sys.argv[3:]
def run(*argv):
    subprocess.run(argv, check=True)
run("mount", "-t", "tmpfs", "-o", "mode=0755", "pod-view", view)
for top in ("usr", "bin", "lib", "lib64", "sbin", sys.base_prefix.strip("/").split("/")[0]):
    if os.path.lexists(view + "/" + top) or not os.path.lexists("/" + top):
        continue
    if os.path.islink("/" + top):
        os.symlink(os.readlink("/" + top), view + "/" + top)
    else:
        os.mkdir(view + "/" + top)
        run("mount", "--rbind", "/" + top, view + "/" + top)
        run("mount", "-o", "remount,bind,ro", view + "/" + top)
for container, host, read_only in mounts:
    os.makedirs(view + container)
    run("mount", "--bind", host, view + container)
    if read_only:
        run("mount", "-o", "remount,bind,ro", view + container)
with open(view + "/probe", "w") as f:  # another user's file, 0600: root with no capability cannot read it
    f.write("not yours")
os.chown(view + "/probe", 65534, 65534)
os.chmod(view + "/probe", 0o600)
os.chroot(view)
os.chdir("/")
os.execv(setpriv, ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", "--no-new-privs",
                   "--", python, "-I", "-S", "-c", program, plan])
"""

# The pod's program: what a client pod running as root may do to the daemon it shares. It says
# what it did on one line, then (with a squatted control socket) accepts and holds every connection
# without a word until its stdin closes, and says how many there were.
HOSTILE = """
import json, os, select, socket, sys, time
plan = json.loads(sys.argv[1])
pipe = plan["pipe"]
did = {"uid": os.getuid()}
try:
    open("/probe").read()
    did["capabilities"] = "some"
except PermissionError:
    try:
        os.chroot("/")
        did["capabilities"] = "some"
    except PermissionError:
        did["capabilities"] = "none"
if plan.get("quit"):  # the control protocol, as the pod's own nvidia-cuda-mps-control speaks it
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(pipe + "/control")
        s.sendall(b"quit\\n")
        s.shutdown(socket.SHUT_WR)
        s.recv(4096)
    deadline = time.monotonic() + 10
    while os.path.lexists(pipe + "/control") and time.monotonic() < deadline:
        time.sleep(0.02)
    did["quit"] = "gone" if not os.path.lexists(pipe + "/control") else "still there"
for name, target in plan.get("links", {}).items():
    if os.path.lexists(name):
        os.unlink(name)
    os.symlink(target, name)
squatter = None
if plan.get("squat"):
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(pipe + "/control")
    os.chmod(pipe + "/control", 0o666)
    squatter.listen(16)
if "write" in plan:
    path, wanted = plan["write"]
    fd, written = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644), 0
    try:
        while wanted is None or written < wanted:
            written += os.write(fd, b"x" * (1 << 20))
        did["wrote"] = "all"
    except OSError as e:
        did["wrote"] = e.strerror
    finally:
        os.close(fd)
    did["bytes"] = written
print(json.dumps(did), flush=True)
held = []
while squatter is not None and not select.select([sys.stdin], [], [], 0)[0]:
    if select.select([squatter], [], [], 0.05)[0]:
        held.append(squatter.accept()[0])
sys.stdin.read()
print(json.dumps({"connections": len(held)}), flush=True)
"""


class HostilePod:
    """A client pod of resource at its worst (HOSTILE, doing plan), in the view its container gets."""

    def __init__(self, resource, where, plan: dict):
        import shutil

        envs, mounts = mps.client_answer(resource, [resource.devices[0].unit])
        resolved = [(container, os.path.realpath(host), read_only) for container, host, read_only in mounts]
        view = where / f"pod-{len(os.listdir(where))}"
        view.mkdir()
        plan = {"pipe": envs["CUDA_MPS_PIPE_DIRECTORY"], **plan}
        python = os.path.realpath(sys.executable)
        self.process = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", sys.executable, "-I", "-c", POD_VIEW, str(view),
             json.dumps(resolved), shutil.which("setpriv"), python, HOSTILE, json.dumps(plan)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def did(self) -> dict:
        """What the pod says it did (its first line)."""
        import select

        ready = select.select([self.process.stdout], [], [], 60)[0]  # a hang guard only
        assert ready, "the hostile pod said nothing in 60 s"
        line = self.process.stdout.readline()
        assert line, self.process.stderr.read()
        return json.loads(line)

    def finish(self) -> dict:
        """Let the pod go; what it saw meanwhile."""
        out, err = self.process.communicate("", timeout=60)
        assert self.process.returncode == 0, err
        return json.loads(out.splitlines()[-1])


def root_only_files(where, names) -> dict:
    """{name: path} of host files of root's, mode 0600, each holding its own secret."""
    made = {}
    for name in names:
        path = where / f"victim-{name}"
        path.write_text(f"root's {name}\n")
        os.chmod(path, 0o600)
        made[name] = str(path)
    return made


def unchanged(victims) -> dict:
    """{name: (content, mode)} of the victims: each must still be root's own."""
    return {name: (open(path).read(), oct(os.stat(path).st_mode & 0o7777)) for name, path in victims.items()}


def wait_for_its_death(daemons) -> None:
    import time

    deadline = time.monotonic() + 10  # a hang guard only
    while not daemons.lost():
        assert time.monotonic() < deadline, "the daemon the pod quit still runs"
        time.sleep(0.05)


def test_a_pod_that_quits_the_daemon_gets_no_root_write_through_its_links(host, tmp_path, mps_root, require):
    """A client pod running as root (no capability) sends the shared daemon `quit`, then leaves
    links to root-only host files where the next daemon writes as root: its pid file and
    control_lock in the pipe directory, its cuda.shm file in /dev/shm. Before, the plugin started
    the daemon again on the same directories, and it wrote its pid and truncated through them. Now
    the daemon started again has a new generation, which no pod has had: every file stays root's,
    the new daemon answers, and the pod's links are nowhere a new pod looks."""
    require("root", "unshare", "setpriv")
    inventory = inventory_of(config_with(host, tmp_path, ""))
    resource = mps_resource(inventory, mps_root)
    victims = root_only_files(tmp_path, ("pid", "lock", "shm"))
    before = unchanged(victims)
    pipe = "/mps/nvidia.com/gpu/pipe"  # the pod's CUDA_MPS_PIPE_DIRECTORY
    links = {f"{pipe}/{mps.PID_FILE}": victims["pid"], f"{pipe}/control_lock": victims["lock"],
             "/dev/shm/cuda.shm.sim": victims["shm"]}  # fmt: skip
    daemons = mps.Daemons([].append)
    pod = None
    try:
        daemons.sync([resource], inventory)
        pod = HostilePod(resource, tmp_path, {"quit": True, "links": links})
        assert pod.did() == {"uid": 0, "capabilities": "none", "quit": "gone"}
        wait_for_its_death(daemons)
        daemons.sync([resource], inventory)  # the plugin's next round starts it again
        assert unchanged(victims) == before
        answer = mps.send(daemons.running[resource.name], ["get_default_active_thread_percentage"])
        assert answer.split() == ["50.0"]
        # What a pod started now gets: the new daemon's own files, none of the pod's links.
        _, mounts = mps.client_answer(resource, [resource.devices[0].unit])
        for _, path, _ in mounts:
            assert not [n for n in os.listdir(path) if os.path.islink(os.path.join(path, n))], path
        pod.finish()
    finally:
        if pod is not None and pod.process.poll() is None:
            pod.process.kill()
            pod.process.wait()
        daemons.stop_all()
    assert unchanged(victims) == before


def test_a_pod_squatting_the_control_socket_does_not_hold_the_restart(host, tmp_path, mps_root, require):
    """A client pod quits the daemon and binds a socket of its own at <pipe>/control, which accepts
    and never answers. Before, the plugin's restart sent `quit` there first (waiting out its 30 s
    timeout, the whole round with it), then the new daemon found the name taken ("An instance of
    this daemon is already running") and did not start. Now the restart never looks at a name the
    pod had: it returns with the new daemon answering, and the pod's socket saw no connection."""
    require("root", "unshare", "setpriv")
    inventory = inventory_of(config_with(host, tmp_path, ""))
    resource = mps_resource(inventory, mps_root)
    daemons = mps.Daemons([].append)
    pod = None
    try:
        daemons.sync([resource], inventory)
        pod = HostilePod(resource, tmp_path, {"quit": True, "squat": True})
        assert pod.did() == {"uid": 0, "capabilities": "none", "quit": "gone"}
        wait_for_its_death(daemons)
        daemons.sync([resource], inventory)
        answer = mps.send(daemons.running[resource.name], ["get_default_active_thread_percentage"])
        assert answer.split() == ["50.0"]
        daemons.stop_all()  # its quit does not go to the pod's socket either
        assert pod.finish() == {"connections": 0}
    finally:
        if pod is not None and pod.process.poll() is None:
            pod.process.kill()
            pod.process.wait()
        daemons.stop_all()


def test_a_pod_that_fills_its_dev_shm_leaves_another_resources_alone(host, tmp_path, mps_root, require):
    """Two MPS resources (nvidia.com/gpu, and nvidia.com/gpu.shared of a second configuration on the
    same mpsRoot). Before, every MPS resource's clients had the one <mpsRoot>/shm: a pod of the
    first that filled its /dev/shm left none for the pods of the second. Now each generation of
    each resource has its own 64 MiB."""
    require("root", "unshare", "setpriv")
    inventory = inventory_of(config_with(host, tmp_path, ""))
    first, second = mps_resource(inventory, mps_root), mps_resource(inventory, mps_root, renamed=True)
    daemons = mps.Daemons([].append)
    pods = []
    try:
        daemons.sync([first, second], inventory)
        pods.append(HostilePod(first, tmp_path, {"write": ["/dev/shm/fill", None]}))
        filled = pods[-1].did()
        assert filled["bytes"] > mps.SHM_BYTES // 2, filled
        full = "No space left on device"
        assert filled == {"uid": 0, "capabilities": "none", "wrote": full, "bytes": filled["bytes"]}
        pods.append(HostilePod(second, tmp_path, {"write": ["/dev/shm/mine", 1 << 20]}))
        assert pods[-1].did() == {"uid": 0, "capabilities": "none", "wrote": "all", "bytes": 1 << 20}
        for pod in pods:
            pod.finish()
    finally:
        for pod in pods:
            if pod.process.poll() is None:
                pod.process.kill()
                pod.process.wait()
        daemons.stop_all()
