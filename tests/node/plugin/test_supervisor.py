"""`oci-gpu-hook device-plugin` for real (supervisor.run, and the servers, calls and health it
keeps): the program in a subprocess, serving the kubelet's v1beta1 API on unix sockets, and a
fake kubelet in the test (a Registration server on kubelet.sock, and DevicePlugin clients on the
plugin's sockets). No kubelet, no cluster.

The host is a simulated 4-GPU H100 host with MIG on GPU 3, used by this module alone: tests here
take device nodes away and make NVML fail, and put them back. Waiting is by deadline, on what the
plugin says (Register calls, ListAndWatch messages), never a fixed sleep."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from resource import RLIMIT_AS, setrlimit
from types import SimpleNamespace

import hookcheck
import pytest

from oci_gpu_hook.errors import Exit
from oci_gpu_hook.toolkit.containers import hook_command

pytestmark = pytest.mark.host(gpus=4, mig=[3], model="h100", needs=("pynvml",))  # changed and restored here

DEADLINE = 30  # seconds: how long a change may take to show (the plugin checks every 0.3 s)
INTERVAL = "0.3"
PROFILES = ["1g.5gb", "2g.10gb", "3g.20gb"]
MIXED_SHARED = """\
version: v1
flags:
  migStrategy: mixed
sharing:
  timeSlicing:
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 2
      memoryLimit: per-replica
"""
RESOURCES = ["nvidia.com/gpu"] + [f"nvidia.com/mig-{p}" for p in PROFILES]


@pytest.fixture(scope="module")
def api(require):
    require("grpc", "google.protobuf")
    import grpc

    from oci_gpu_hook.node.kubelet_api import deviceplugin_pb2, deviceplugin_pb2_grpc

    return SimpleNamespace(grpc=grpc, pb2=deviceplugin_pb2, pb2_grpc=deviceplugin_pb2_grpc)


@pytest.fixture
def host_config(host):
    return f"{host['root']}/config.yaml"


@pytest.fixture
def socket_dir():
    """The kubelet's device-plugins directory: short, under /tmp (a unix socket path has 107 bytes)."""
    path = tempfile.mkdtemp(prefix="dp-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def plugin_file(tmp_path):
    def write(text=MIXED_SHARED):
        path = tmp_path / f"plugin-{len(list(tmp_path.glob('plugin-*')))}.yaml"
        path.write_text(text)
        return str(path)

    return write


def expected_ids(host) -> dict:
    """{resource: [ids]} for MIXED_SHARED, from the simulator's summary."""
    full = [g for g in host["gpus"] if not g["mig"]]
    found = {"nvidia.com/gpu": [f"{g['uuid']}::{r}" for g in full for r in range(2)]}
    for profile in PROFILES:
        migs = [m for g in host["gpus"] for m in g["mig"] if m["profile"] == profile]
        found[f"nvidia.com/mig-{profile}"] = [m["uuid"] for m in migs]
    return found


def socket_name(resource: str) -> str:
    return "oci-gpu-hook-" + resource.replace("/", "_") + ".sock"


# ---- the fake kubelet, the plugin, a ListAndWatch stream ------------------------------------------


class FakeKubelet:
    """The kubelet's side of registration: a Registration server on kubelet.sock that records
    every RegisterRequest."""

    def __init__(self, api, socket_dir: str):
        self.api, self.path = api, os.path.join(socket_dir, "kubelet.sock")
        self.requests: list = []
        self.changed = threading.Condition()
        kubelet = self

        class Registration(api.pb2_grpc.RegistrationServicer):
            def Register(self, request, context):
                with kubelet.changed:
                    kubelet.requests.append(request)
                    kubelet.changed.notify_all()
                return api.pb2.Empty()

        self.server = api.grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api.pb2_grpc.add_RegistrationServicer_to_server(Registration(), self.server)
        assert self.server.add_insecure_port("unix://" + self.path) != 0
        self.server.start()

    def wait_for(self, count: int, plugin) -> list:
        """The first count RegisterRequests, once there are that many."""
        deadline = time.monotonic() + DEADLINE
        with self.changed:
            while len(self.requests) < count:
                left = deadline - time.monotonic()
                if left <= 0 or plugin.proc.poll() is not None:
                    pytest.fail(f"{len(self.requests)} of {count} registrations; the plugin said:\n{plugin.output()}")
                self.changed.wait(min(left, 0.5))
            return list(self.requests[:count])

    def stop(self):
        self.server.stop(None).wait(10)


class Plugin:
    def __init__(self, host_config: str, socket_dir: str, config_file: str, log_dir, umask: int | None = None,
                 options=(), output=None):  # fmt: skip
        """output: where its stdout and stderr go (a descriptor), instead of its log file."""
        self.socket_dir = socket_dir
        self.log = open(log_dir / f"device-plugin-{time.monotonic_ns()}.log", "w+")
        self.proc = subprocess.Popen(
            [*hook_command(host_config), "device-plugin", "--socket-dir",
             socket_dir, "--config-file", config_file, "--interval", INTERVAL, *options],
            stdout=output or self.log, stderr=output or self.log, stdin=subprocess.DEVNULL,
            # Popen's own umask (set in the child by C code): a preexec_fn would run Python in a
            # child forked while this process's gRPC threads (the fake kubelet) were busy.
            umask=-1 if umask is None else umask,
        )  # fmt: skip

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def said(self, words: str) -> str:
        """Its output, once it holds words (by deadline)."""
        deadline = time.monotonic() + DEADLINE
        while words not in self.output():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                pytest.fail(f"the plugin did not say {words!r}:\n{self.output()}")
            time.sleep(0.1)
        return self.output()

    def socket(self, resource: str) -> str:
        return os.path.join(self.socket_dir, socket_name(resource))

    def stub(self, api, resource: str):
        channel = api.grpc.insecure_channel("unix://" + self.socket(resource))
        return channel, api.pb2_grpc.DevicePluginStub(channel)

    def call(self, api, resource: str, method: str, request):
        channel, stub = self.stub(api, resource)
        with channel:
            return getattr(stub, method)(request, timeout=DEADLINE)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=DEADLINE)
        finally:
            self.log.close()


class Watch:
    """One ListAndWatch stream, read in a thread: the latest {id: health} it sent."""

    def __init__(self, api, plugin: Plugin, resource: str):
        self.plugin, self.resource = plugin, resource
        self.channel, stub = plugin.stub(api, resource)
        self.call = stub.ListAndWatch(api.pb2.Empty())
        self.messages: queue.Queue = queue.Queue()
        self.latest = None
        self.received = 0  # lists taken from the stream so far
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for response in self.call:
                self.messages.put({d.ID: d.health for d in response.devices})
        except Exception as e:  # the stream ended: cancelled by close(), or the plugin stopped serving it
            self.messages.put(e)

    def _read_while(self, waiting, what: str, timeout: float) -> dict:
        """Take lists from the stream while waiting() holds; fail at the deadline or if it ends."""
        deadline = time.monotonic() + timeout
        while waiting():
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"{self.resource}: no ListAndWatch message where {what}; the last was {self.latest}; "
                            f"the plugin said:\n{self.plugin.output()}")  # fmt: skip
            try:
                message = self.messages.get(timeout=left)
            except queue.Empty:
                continue
            if isinstance(message, Exception):
                pytest.fail(f"{self.resource}: the stream ended ({message}) before {what}:\n{self.plugin.output()}")
            self.latest, self.received = message, self.received + 1
        return self.latest

    def until(self, predicate, what: str, timeout: float = DEADLINE) -> dict:
        return self._read_while(lambda: self.latest is None or not predicate(self.latest), what, timeout)

    def after(self, seen: int, timeout: float = DEADLINE) -> dict:
        """The newest list, once more than `seen` lists have come (every health change is sent to
        every stream, so a change elsewhere brings each stream a new list)."""
        return self._read_while(lambda: self.received <= seen or not self.messages.empty(), "a new list came",
                                timeout)  # fmt: skip

    def close(self):
        self.call.cancel()
        self.channel.close()
        self.thread.join(DEADLINE)


@pytest.fixture
def kubelet(api, socket_dir):
    made = [FakeKubelet(api, socket_dir)]
    yield made[0]
    for k in made:
        k.stop()


@pytest.fixture
def start(host_config, socket_dir, plugin_file, tmp_path):
    """start(config text) -> Plugin, stopped (and its output shown on failure) at the end."""
    started = []

    def make(text=MIXED_SHARED, umask=None, options=(), output=None):
        plugin = Plugin(host_config, socket_dir, plugin_file(text), tmp_path, umask, options, output)
        started.append(plugin)
        return plugin

    yield make
    for plugin in started:
        plugin.stop()


@pytest.fixture
def watches():
    opened = []

    def make(api, plugin, resource):
        opened.append(Watch(api, plugin, resource))
        return opened[-1]

    yield make
    for watch in opened:
        watch.close()


def all_health(health: str):
    return lambda devices: bool(devices) and set(devices.values()) == {health}


# ---- registration and the calls ---------------------------------------------------------------------


def test_registers_each_resource_and_serves_it(api, host, kubelet, start, watches, socket_dir):
    plugin = start()
    requests = kubelet.wait_for(4, plugin)
    assert sorted(r.resource_name for r in requests) == RESOURCES
    for request in requests:
        assert request.version == "v1beta1"
        assert request.endpoint == socket_name(request.resource_name)  # relative to the directory
        assert request.options.get_preferred_allocation_available and not request.options.pre_start_required
        assert stat.S_ISSOCK(os.stat(os.path.join(socket_dir, request.endpoint)).st_mode)
    expected = expected_ids(host)
    for resource in RESOURCES:
        options = plugin.call(api, resource, "GetDevicePluginOptions", api.pb2.Empty())
        assert options.get_preferred_allocation_available is True and options.pre_start_required is False
        devices = watches(api, plugin, resource).until(lambda d: True, "any list")
        assert list(devices) == expected[resource], resource
        assert set(devices.values()) == {"Healthy"}
    assert plugin.proc.poll() is None
    assert kubelet.requests == requests  # registered once: nothing changed


def test_allocate_and_preferred_allocation(api, host, kubelet, start):
    plugin = start()
    kubelet.wait_for(4, plugin)
    ids = expected_ids(host)["nvidia.com/gpu"]
    request = api.pb2.PreferredAllocationRequest(container_requests=[
        api.pb2.ContainerPreferredAllocationRequest(available_deviceIDs=ids, must_include_deviceIDs=[ids[3]],
                                                    allocation_size=2)])  # fmt: skip
    (answer,) = plugin.call(api, "nvidia.com/gpu", "GetPreferredAllocation", request).container_responses
    assert answer.deviceIDs[0] == ids[3] and len(answer.deviceIDs) == 2
    assert answer.deviceIDs[1].split("::")[0] != ids[3].split("::")[0]  # another GPU
    request = api.pb2.AllocateRequest(container_requests=[api.pb2.ContainerAllocateRequest(devices_ids=[ids[2]])])
    (got,) = plugin.call(api, "nvidia.com/gpu", "Allocate", request).container_responses
    gpu1 = host["gpus"][1]["uuid"]
    assert dict(got.envs) == {"NVIDIA_VISIBLE_DEVICES": gpu1, "OCI_GPU_HOOK_GPU_MEMORY_LIMIT": "50%"}
    assert [(m.container_path, m.host_path, m.read_only) for m in got.mounts] == [
        ("/var/run/oci-gpu-hook/gpu-memory-limit/50%", "/dev/null", True)]  # fmt: skip
    assert (list(got.devices), dict(got.annotations), list(got.cdi_devices)) == ([], {}, [])
    mig = expected_ids(host)["nvidia.com/mig-2g.10gb"]
    request = api.pb2.AllocateRequest(container_requests=[api.pb2.ContainerAllocateRequest(devices_ids=mig)])
    (got,) = plugin.call(api, "nvidia.com/mig-2g.10gb", "Allocate", request).container_responses
    assert dict(got.envs) == {"NVIDIA_VISIBLE_DEVICES": mig[0]} and list(got.mounts) == []
    prestart = api.pb2.PreStartContainerRequest(devices_ids=ids)
    assert plugin.call(api, "nvidia.com/gpu", "PreStartContainer", prestart) == api.pb2.PreStartContainerResponse()


def test_preferred_allocation_follows_the_configured_policy(api, host, kubelet, start):
    """flags.plugin.sharedDevicesAllocationPolicy: packed reaches the plugin's answer (it was
    refused): two replicas of one GPU, where distributed (above) gives two GPUs."""
    packed = "  migStrategy: mixed\n  plugin:\n    sharedDevicesAllocationPolicy: packed\n"
    plugin = start(MIXED_SHARED.replace("  migStrategy: mixed\n", packed))
    kubelet.wait_for(4, plugin)
    ids = expected_ids(host)["nvidia.com/gpu"]
    request = api.pb2.PreferredAllocationRequest(container_requests=[
        api.pb2.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=2)])  # fmt: skip
    (answer,) = plugin.call(api, "nvidia.com/gpu", "GetPreferredAllocation", request).container_responses
    assert list(answer.deviceIDs) == ids[:2] and ids[0].split("::")[0] == ids[1].split("::")[0]


def test_allocate_refusals_are_invalid_argument_and_the_plugin_serves_on(api, host, kubelet, start):
    plugin = start()
    kubelet.wait_for(4, plugin)
    ids = expected_ids(host)["nvidia.com/gpu"]

    def allocate(resource, *containers):
        return plugin.call(api, resource, "Allocate", api.pb2.AllocateRequest(container_requests=[
            api.pb2.ContainerAllocateRequest(devices_ids=c) for c in containers]))  # fmt: skip

    with pytest.raises(api.grpc.RpcError) as e:
        allocate("nvidia.com/gpu", ["GPU-nope::0"])
    assert e.value.code() == api.grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "nvidia.com/gpu: unknown device id 'GPU-nope::0'"
    with pytest.raises(api.grpc.RpcError) as e:  # the second container's ids are wrong: the whole call fails
        allocate("nvidia.com/mig-1g.5gb", expected_ids(host)["nvidia.com/mig-1g.5gb"], [ids[0]])
    assert e.value.code() == api.grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == f"nvidia.com/mig-1g.5gb: unknown device id {ids[0]!r}"
    with pytest.raises(api.grpc.RpcError) as e:
        allocate("nvidia.com/gpu", [ids[0], ids[2]])
    assert e.value.code() == api.grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == ("nvidia.com/gpu: a container may ask for 1 time-sliced GPU, not 2 "
                                 "(sharing.timeSlicing.failRequestsGreaterThanOne is set)")  # fmt: skip
    # still serving, and answering
    (first, second) = allocate("nvidia.com/gpu", [ids[0]], [ids[5]]).container_responses
    assert first.envs["NVIDIA_VISIBLE_DEVICES"] == host["gpus"][0]["uuid"]
    assert second.envs["NVIDIA_VISIBLE_DEVICES"] == host["gpus"][2]["uuid"]
    assert plugin.proc.poll() is None
    assert "Allocate refused: nvidia.com/gpu: unknown device id 'GPU-nope::0'" in plugin.output()


def test_a_plugin_whose_log_reader_went_away_still_answers(api, host, kubelet, start):
    """Its log is a pipe the runtime reads (conmon's, the shim's); found on a CRI-O node of the
    GPU cluster (tests/e2e/test_gpu_cluster.py): with that pipe's reader gone, the line Allocate
    says failed with EPIPE, and so did the Allocate, and the pod (UnexpectedAdmissionError). The
    log is the service's to lose, not the answer."""
    reader, writer = os.pipe()
    try:
        plugin = start(output=writer)
    finally:
        os.close(writer)
    kubelet.wait_for(4, plugin)
    os.close(reader)  # no one reads its log any more
    ids = expected_ids(host)["nvidia.com/gpu"]
    request = api.pb2.AllocateRequest(container_requests=[api.pb2.ContainerAllocateRequest(devices_ids=[ids[0]])])
    (got,) = plugin.call(api, "nvidia.com/gpu", "Allocate", request).container_responses
    assert got.envs["NVIDIA_VISIBLE_DEVICES"] == host["gpus"][0]["uuid"]
    assert plugin.proc.poll() is None


# ---- health ---------------------------------------------------------------------------------------


def test_an_nvml_failure_makes_every_device_unhealthy_until_it_clears(api, host, kubelet, start, watches):
    from oci_gpu_hook.toolkit.simulate import control

    plugin = start()
    kubelet.wait_for(4, plugin)
    streams = [watches(api, plugin, r) for r in RESOURCES]
    for stream in streams:
        stream.until(all_health("Healthy"), "every device is Healthy")
    try:
        control.write(host["root"], fail=999)
        for stream in streams:
            stream.until(all_health("Unhealthy"), "every device is Unhealthy")
    finally:
        control.clear(host["root"])
    for stream in streams:
        stream.until(all_health("Healthy"), "every device is Healthy again")
    assert "Unhealthy: " in plugin.output() and "Healthy again: " in plugin.output()


class NodeAside:
    """A device node of the simulated host moved aside (as if the driver lost it), and back."""

    def __init__(self, host, name: str):
        self.path = os.path.join(host["root"], "dev", name)
        self.aside = os.path.join(host["root"], ".aside-" + name.replace("/", "-"))

    def __enter__(self):
        os.rename(self.path, self.aside)
        return self

    def restore(self):
        if os.path.lexists(self.aside):
            os.rename(self.aside, self.path)

    def __exit__(self, *exc):
        self.restore()


def test_a_missing_gpu_node_marks_that_gpu_unhealthy(api, host, kubelet, start, watches):
    plugin = start()
    kubelet.wait_for(4, plugin)
    gpu = host["gpus"][1]
    streams = {r: watches(api, plugin, r) for r in RESOURCES}
    for stream in streams.values():
        stream.until(all_health("Healthy"), "every device is Healthy")
    ours = {f"{gpu['uuid']}::0", f"{gpu['uuid']}::1"}
    seen = {r: s.received for r, s in streams.items()}

    def only_ours(devices):
        return all((health == "Unhealthy") == (i in ours) for i, health in devices.items())

    with NodeAside(host, f"nvidia{gpu['minor']}") as node:
        devices = streams["nvidia.com/gpu"].until(only_ours, f"only GPU {gpu['index']}'s replicas are Unhealthy")
        assert sorted(devices) == sorted(expected_ids(host)["nvidia.com/gpu"])
        for resource in RESOURCES[1:]:  # told of the change too, and still Healthy
            assert set(streams[resource].after(seen[resource]).values()) == {"Healthy"}, resource
        node.restore()
        streams["nvidia.com/gpu"].until(all_health("Healthy"), "every device is Healthy again")
    assert f"/dev/nvidia{gpu['minor']}: missing" in plugin.output()


def test_a_missing_mig_gpu_node_marks_its_mig_devices_unhealthy(api, host, kubelet, start, watches):
    plugin = start()
    kubelet.wait_for(4, plugin)
    (gpu,) = [g for g in host["gpus"] if g["mig"]]
    streams = {r: watches(api, plugin, r) for r in RESOURCES}
    for stream in streams.values():
        stream.until(all_health("Healthy"), "every device is Healthy")
    seen = streams["nvidia.com/gpu"].received
    with NodeAside(host, f"nvidia{gpu['minor']}") as node:
        for resource in RESOURCES[1:]:
            # 10 s: over 30 rounds
            streams[resource].until(all_health("Unhealthy"), f"GPU {gpu['index']}'s MIG device is Unhealthy", 10)
        assert set(streams["nvidia.com/gpu"].after(seen).values()) == {"Healthy"}
        node.restore()
        for resource in RESOURCES[1:]:
            streams[resource].until(all_health("Healthy"), "the MIG device is Healthy again")


def test_a_mig_device_that_goes_away_is_no_longer_offered_and_comes_back(api, host, kubelet, start, watches):
    """Without its compute instance's capability node NVML no longer lists the MIG device: the
    inventory is read again, its resource stops (socket removed, stream ended) and is registered
    again once the node is back."""
    plugin = start()
    kubelet.wait_for(4, plugin)
    (gpu,) = [g for g in host["gpus"] if g["mig"]]
    (mig,) = [m for m in gpu["mig"] if m["profile"] == "2g.10gb"]
    streams = {r: watches(api, plugin, r) for r in RESOURCES}
    for stream in streams.values():
        stream.until(all_health("Healthy"), "every device is Healthy")
    gone = plugin.socket("nvidia.com/mig-2g.10gb")
    seen = {r: s.received for r, s in streams.items()}
    with NodeAside(host, f"nvidia-caps/nvidia-cap{mig['ci_cap_minor']}") as node:
        deadline = time.monotonic() + DEADLINE
        while os.path.exists(gone):
            assert time.monotonic() < deadline and plugin.proc.poll() is None, plugin.output()
            time.sleep(0.05)
        assert "nvidia.com/mig-2g.10gb: no longer offered" in plugin.output()
        for resource in ("nvidia.com/gpu", "nvidia.com/mig-1g.5gb", "nvidia.com/mig-3g.20gb"):
            assert set(streams[resource].after(seen[resource]).values()) == {"Healthy"}, resource
            assert os.path.exists(plugin.socket(resource))
        node.restore()
        (again,) = kubelet.wait_for(5, plugin)[4:]
    assert again.resource_name == "nvidia.com/mig-2g.10gb" and again.endpoint == os.path.basename(gone)
    devices = watches(api, plugin, "nvidia.com/mig-2g.10gb").until(all_health("Healthy"), "it is offered again")
    assert list(devices) == [mig["uuid"]]


# ---- kubelet restarts ---------------------------------------------------------------------------------


def test_the_gate_holds_registration_until_the_toolkit_passes_and_a_failed_gate_withdraws_every_device(
        api, host, kubelet, start, watches, tmp_path):  # fmt: skip
    """--gate FILE (issue 47): nothing is served or registered while the toolkit gate is pending
    (no file yet); once it passes, every resource registers; a failed gate toolkit makes every
    device of every resource Unhealthy with the gate's line (a failed gate plugin does not), and a
    pass heals them, on the same registration;
    a verdicts file anyone else could have written counts as a failure, and so does none at all
    once the toolkit gate had passed."""
    from oci_gpu_hook.node import gates

    path = str(tmp_path / "gates.json")
    plugin = start(options=("--gate", path))
    plugin.said(f"waiting for gate toolkit to pass ({path}): nothing is offered until it does")
    assert kubelet.requests == [] and not [n for n in os.listdir(plugin.socket_dir) if n != "kubelet.sock"]
    gates.write(path, {"toolkit": gates.verdict("passed")})
    assert sorted(r.resource_name for r in kubelet.wait_for(4, plugin)) == RESOURCES
    streams = [watches(api, plugin, resource) for resource in RESOURCES]
    for stream in streams:
        stream.until(all_health("Healthy"), "every device healthy")
    why, fix = "the validation pod saw 0 GPUs, not 1", "oci-gpu-hook doctor on the node"
    # A failed gate plugin withdraws nothing: its next pod could never be placed otherwise.
    gates.write(path, {"toolkit": gates.verdict("passed"), "plugin": gates.verdict("failed", "not scheduled", fix)})
    time.sleep(2)  # rounds of 0.3 s: had it withdrawn, the next write would come second
    gates.write(path, {"toolkit": gates.verdict("failed", why, fix), "plugin": gates.verdict("pending")})
    for stream in streams:
        stream.until(all_health("Unhealthy"), "every device withdrawn")
    plugin.said(f"gate toolkit failed: {why} (fix: {fix})")
    assert "gate plugin failed" not in plugin.output()
    gates.write(path, {"toolkit": gates.verdict("passed"), "plugin": gates.verdict("passed")})
    for stream in streams:
        stream.until(all_health("Healthy"), "every device back")
    os.chmod(path, 0o666)  # anyone's now: not a verdict to go by
    for stream in streams:
        stream.until(all_health("Unhealthy"), "withdrawn for an untrusted file")
    plugin.said("the gates' verdicts cannot be trusted")
    os.unlink(path)  # after a pass, no verdicts is no longer "not yet": the devices stay withdrawn
    gates.write(path, {"toolkit": gates.verdict("passed")})
    for stream in streams:
        stream.until(all_health("Healthy"), "every device back")
    os.unlink(path)
    for stream in streams:
        stream.until(all_health("Unhealthy"), "withdrawn once the verdicts are gone")
    plugin.said("gate toolkit is pending again")
    assert len(kubelet.requests) == 4  # registered once, all along


def test_deleted_sockets_are_served_and_registered_again(api, host, kubelet, start, watches, socket_dir):
    """What a kubelet restart does to the directory: our sockets are gone."""
    plugin = start()
    first = kubelet.wait_for(4, plugin)
    for resource in RESOURCES:
        os.unlink(plugin.socket(resource))
    again = kubelet.wait_for(8, plugin)[4:]
    assert sorted(r.resource_name for r in again) == RESOURCES
    assert [(r.version, r.endpoint) for r in sorted(again, key=lambda r: r.resource_name)] == [
        (r.version, r.endpoint) for r in sorted(first, key=lambda r: r.resource_name)]  # fmt: skip
    for resource in RESOURCES:
        assert stat.S_ISSOCK(os.stat(plugin.socket(resource)).st_mode)
        devices = watches(api, plugin, resource).until(lambda d: True, "any list")
        assert list(devices) == expected_ids(host)[resource]
    assert sorted(os.listdir(socket_dir)) == sorted(["kubelet.sock", *map(socket_name, RESOURCES)])


def test_a_new_kubelet_socket_is_registered_with_again(api, host, kubelet, start, socket_dir, watches):
    """A kubelet that restarted without (yet) wiping the directory: a new kubelet.sock."""
    plugin = start()
    kubelet.wait_for(4, plugin)
    # The old kubelet's socket moves aside but stays bound, so the new one cannot reuse its inode.
    os.rename(kubelet.path, os.path.join(socket_dir, "kubelet-old.sock"))
    new = FakeKubelet(api, socket_dir)
    try:
        requests = new.wait_for(4, plugin)
        assert sorted(r.resource_name for r in requests) == RESOURCES
        assert all(r.version == "v1beta1" for r in requests)
        devices = watches(api, plugin, "nvidia.com/gpu").until(lambda d: True, "any list")
        assert list(devices) == expected_ids(host)["nvidia.com/gpu"]
    finally:
        new.stop()
    assert len(kubelet.requests) == 4  # the old kubelet heard nothing more


def test_waits_for_the_kubelet_to_appear(api, host, start, socket_dir):
    plugin = start()
    deadline = time.monotonic() + DEADLINE
    while "waiting for the kubelet" not in plugin.output():
        assert plugin.proc.poll() is None and time.monotonic() < deadline, plugin.output()
        time.sleep(0.1)
    kubelet = FakeKubelet(api, socket_dir)
    try:
        assert sorted(r.resource_name for r in kubelet.wait_for(4, plugin)) == RESOURCES
        assert plugin.output().count("waiting for the kubelet") == 1  # said once, not every round
    finally:
        kubelet.stop()


# ---- stopping -------------------------------------------------------------------------------------


def test_sigterm_exits_zero_and_removes_its_sockets(api, host, kubelet, start, watches, socket_dir):
    plugin = start()
    kubelet.wait_for(4, plugin)
    watches(api, plugin, "nvidia.com/gpu").until(lambda d: True, "any list")  # an open stream does not hold it up
    plugin.proc.send_signal(signal.SIGTERM)
    assert plugin.proc.wait(timeout=DEADLINE) == 0, plugin.output()
    assert os.listdir(socket_dir) == ["kubelet.sock"]
    assert plugin.output().splitlines()[-1] == "oci-gpu-hook device-plugin: stopped"


# ---- bad input at start: one line, and the exit status --------------------------------------------


def run_cli(*args, timeout=120, preexec_fn=None):
    return subprocess.run([*hook_command(), *args], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=timeout, preexec_fn=preexec_fn)  # fmt: skip


UNKNOWN_PROFILE = MIXED_SHARED + "    - name: nvidia.com/mig-7g.80gb\n      replicas: 2\n"


@pytest.mark.parametrize(
    "text, words",
    [("version: v1\nflags: [unclosed\n", ": not valid YAML or JSON (line "),
     (MIXED_SHARED.replace("replicas: 2", "replicas: 0"),
      ": sharing.timeSlicing.resources[0].replicas: 0 is not accepted (expected a whole number from 1 to 1024)"),
     ("version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 1\n",
      ": sharing.mps.resources[0].replicas: 1: MPS sharing needs at least 2 replicas"),
     (UNKNOWN_PROFILE, ": sharing.timeSlicing.resources[1].name: unknown MIG profile: no MIG device on this node has "
                       "profile 7g.80gb (profiles here: 1g.5gb, 2g.10gb, 3g.20gb)"),
     (MIXED_SHARED.replace("per-replica", "96GiB"), ": sharing.timeSlicing.resources[0].memoryLimit: 96GiB is more "
                                                     "than GPU-")],
    ids=["yaml", "replicas", "mps", "unknown-profile", "limit-too-large"],
)  # fmt: skip
@pytest.mark.parametrize("form", ["check", "serve"])
def test_bad_configuration_is_one_line_and_exit_3(host_config, plugin_file, socket_dir, text, words, form):
    path = plugin_file(text)
    args = ["--config", host_config, "device-plugin", "--config-file", path, "--socket-dir", socket_dir]
    p = run_cli(*args, "--check") if form == "check" else run_cli(*args, "--interval", INTERVAL)
    assert p.returncode == Exit.CONFIG, p.stderr
    assert len(p.stderr.splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("oci-gpu-hook: ") and words in p.stderr, p.stderr
    assert p.stdout == ""
    assert p.stderr.startswith(f"oci-gpu-hook: {path}: "), p.stderr
    assert os.listdir(socket_dir) == []  # nothing served


def test_a_missing_socket_dir_is_one_line(host_config, plugin_file, tmp_path):
    missing = tmp_path / "no" / "device-plugins"
    p = run_cli("--config", host_config, "device-plugin", "--config-file", plugin_file(), "--socket-dir", str(missing))
    assert p.returncode == Exit.PREREQUISITE, p.stderr
    assert len(p.stderr.splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith(f"oci-gpu-hook: {missing}: no such directory"), p.stderr
    assert not missing.exists()


# ---- --check -------------------------------------------------------------------------------------


def test_check_prints_what_the_mixed_strategy_offers(host, host_config, plugin_file, socket_dir):
    expected = "nvidia.com/gpu: 3 devices\n" + "".join(f"  {g['uuid']}\n" for g in host["gpus"][:3])
    for profile in PROFILES:
        (mig,) = [m for g in host["gpus"] for m in g["mig"] if m["profile"] == profile]
        expected += f"nvidia.com/mig-{profile}: 1 device\n  {mig['uuid']}\n"
    p = run_cli("--config", host_config, "device-plugin", "--check", "--config-file",
                plugin_file("version: v1\nflags:\n  migStrategy: mixed\n"))  # fmt: skip
    assert (p.returncode, p.stderr, p.stdout) == (0, "", expected)
    shared = run_cli("--config", host_config, "device-plugin", "--check", "--config-file", plugin_file())
    assert shared.returncode == 0, shared.stderr
    lines = shared.stdout.splitlines()
    assert lines[0] == "nvidia.com/gpu: 6 devices, memory limit 50% each"
    assert lines[1:7] == [f"  {i}" for i in expected_ids(host)["nvidia.com/gpu"]]
    assert lines[7:] == expected.splitlines()[4:]
    assert os.listdir(socket_dir) == []


def test_check_without_a_file_follows_the_node_settings(host, host_config, tmp_path):
    p = run_cli("--config", host_config, "device-plugin", "--check")
    assert p.returncode == 0, p.stderr
    assert p.stdout == "nvidia.com/gpu: 4 devices\n" + "".join(f"  {g['uuid']}\n" for g in host["gpus"])
    config = tmp_path / "config.yaml"
    config.write_text(open(host_config).read().replace("node:\n", "node:\n  mig_strategy: mixed\n  replicas: 2\n"))
    p = run_cli("--config", str(config), "device-plugin", "--check")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == "nvidia.com/gpu: 6 devices"
    assert "nvidia.com/mig-1g.5gb: 1 device" in p.stdout.splitlines()
    single = tmp_path / "single.yaml"
    single.write_text(open(host_config).read().replace("node:\n", "node:\n  mig_strategy: single\n"))
    p = run_cli("--config", str(single), "device-plugin", "--check")
    assert p.returncode == Exit.CONFIG and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith("oci-gpu-hook: node settings (node.mig_strategy, node.replicas): flags.migStrategy "
                               "single needs MIG on every GPU"), p.stderr  # fmt: skip


# ---- hostile configuration files: one line, in bounded time and memory ---------------------------


def alias_bomb(levels: int) -> str:
    """A YAML flow list of `levels` anchors, each nine aliases of the one before: 9**levels values
    in under 500 bytes."""
    items = ["&a0 [x, x, x, x, x, x, x, x, x]"]
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "[" + ", ".join(items) + "]"


HOSTILE_KEYS = {"version": "version: {}\n", "migStrategy": "flags:\n  migStrategy: {}\n",
                "deviceIDStrategy": "flags:\n  plugin:\n    deviceIDStrategy: {}\n",
                "passDeviceSpecs": "flags:\n  plugin:\n    passDeviceSpecs: {}\n",
                "replicas": "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
                            "      replicas: {}\n"}  # fmt: skip


def run_limited(args, memory=1 << 30, timeout=60):
    """run_cli under an address-space limit: a configuration that grows without bound fails here."""
    return run_cli(*args, timeout=timeout, preexec_fn=lambda: setrlimit(RLIMIT_AS, (memory, memory)))


@pytest.mark.parametrize("key", list(HOSTILE_KEYS))
@pytest.mark.parametrize("value, words", [
    (alias_bomb(9), "more than 100000 values (YAML aliases counted as often as they are used)"),
    (alias_bomb(4), "a list"),  # within the bound: shown by its kind, never by repr()
    ("[" * 5000 + "]" * 5000, "nested more than 32 deep; this is not a configuration"),
    ("9" * 5000, "not valid YAML or JSON: Exceeds the limit (4300 digits)"),
    (f"!!pairs [[a, {alias_bomb(8)}]]", "pairs values are not accepted"),
    ("[&m0 {a: 1}, " + ", ".join(f"&m{i} {{<<: [*m{i - 1}, *m{i - 1}], k{i}: 1}}" for i in range(1, 41)) + "]",
     "merge keys (<<) are not accepted"),
    ("[x, " + ", ".join(f"[{i}]" for i in range(8000)) + "]", "a list of more than 1024 items"),
], ids=["bomb", "small-bomb", "deep", "huge-int", "pairs-bomb", "merge-bomb", "long-list"])  # fmt: skip
def test_hostile_configuration_is_one_line_in_bounded_time_and_memory(host_config, plugin_file, key, value, words):
    path = plugin_file(HOSTILE_KEYS[key].format(value))
    p = run_limited(["--config", host_config, "device-plugin", "--check", "--config-file", path])
    assert p.returncode == Exit.CONFIG, p.stderr[-2000:]
    assert len(p.stderr.splitlines()) == 1 and len(p.stderr) < 400, p.stderr[-2000:]
    assert p.stderr.startswith(f"oci-gpu-hook: {path}: ") and words in p.stderr, p.stderr
    # The same limit lets a good configuration through: it is the configuration that was bounded.
    good = run_limited(["--config", host_config, "device-plugin", "--check", "--config-file", plugin_file()])
    assert good.returncode == 0, good.stderr


# Bounded in time, not only in the end (docs/security.md, attack round 4, class 7): each took PyYAML
# 5 to 38 s to build before the bounds looked at it; the parser stops at a bound now, within a
# second. The guard is generous, and yet shorter than building any of them took.
BOUNDED_SECONDS = 5


@pytest.mark.parametrize("kind", list(hookcheck.one_mib_documents("x")))
def test_a_one_mib_configuration_is_refused_before_it_is_built(host_config, plugin_file, kind):
    text, words = hookcheck.one_mib_documents("version")[kind]
    path = plugin_file(text)
    p = run_limited(["--config", host_config, "device-plugin", "--check", "--config-file", path],
                    timeout=BOUNDED_SECONDS)  # fmt: skip
    assert (p.returncode, p.stdout, p.stderr) == (Exit.CONFIG, "", f"oci-gpu-hook: {path}: {words}; this is not "
                                                                    "a configuration\n")  # fmt: skip


@pytest.mark.parametrize("change, key, lines", [
    (lambda t: t + "flags:\n  migStrategy: none\n", "flags", "lines 2 and 11"),
    (lambda t: t.replace("  migStrategy: mixed\n", "  migStrategy: mixed\n  migStrategy: none\n"),
     "flags.migStrategy", "lines 3 and 4"),
    (lambda t: t.replace("      replicas: 2\n", "      replicas: 2\n      replicas: 8\n"),
     "sharing.timeSlicing.resources[0].replicas", "lines 9 and 10"),
    (lambda t: "version: v1\nflags: {migStrategy: mixed, migStrategy: none}\n", "flags.migStrategy",
     "both on line 2"),
    (lambda t: t.replace("version: v1\n", "version: v1\n'version': v1\n"), "version", "lines 1 and 2"),
], ids=["top-level", "nested", "in-a-list-item", "on-one-line", "written-differently"])  # fmt: skip
def test_a_key_written_twice_is_refused(host_config, plugin_file, change, key, lines):
    """A second key used to replace the first silently (attack round 4, class 8a): the plugin told
    the kubelet what the key's second value said, whatever a reader saw first."""
    path = plugin_file(change(MIXED_SHARED))
    p = run_cli("--config", host_config, "device-plugin", "--check", "--config-file", path)
    assert (p.returncode, p.stdout, p.stderr) == (Exit.CONFIG, "", f"oci-gpu-hook: {path}: key '{key}' appears "
                                                                   f"twice ({lines})\n")  # fmt: skip


def test_an_oversized_configuration_is_refused_not_cut(host_config, plugin_file):
    """A file past the bound used to be read up to its first MiB and accepted."""
    from oci_gpu_hook.start.settings import MAX_CONFIG_BYTES

    path = plugin_file("version: v1\n#" + "x" * MAX_CONFIG_BYTES + "\nflags: {migStrategy: bogus}\n")
    p = run_cli("--config", host_config, "device-plugin", "--check", "--config-file", path)
    assert p.returncode == Exit.CONFIG and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr == f"oci-gpu-hook: {path}: the device plugin configuration is larger than {MAX_CONFIG_BYTES} " \
                       "bytes\n"  # fmt: skip


def test_a_configuration_others_can_change_is_refused(host_config, plugin_file):
    """What the plugin reads decides what the kubelet is told: root's alone, as the hook's own."""
    path = plugin_file()
    os.chown(path, 65534, 65534)
    p = run_cli("--config", host_config, "device-plugin", "--check", "--config-file", path)
    assert p.returncode == Exit.CONFIG and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith(f"oci-gpu-hook: {path}: the device plugin configuration is owned by uid 65534"), p.stderr


def test_the_sockets_are_the_kubelets_alone_whatever_the_umask(api, host, kubelet, start, socket_dir):
    """Allocate says which device nodes a container gets. Started under umask 000, gRPC used to
    make the sockets 0777 and any local user could ask; the plugin binds under umask 077 itself."""
    os.chmod(socket_dir, 0o755)  # a directory others can enter: the socket's own mode must hold
    plugin = start(umask=0)
    kubelet.wait_for(4, plugin)
    for resource in RESOURCES:
        assert stat.S_IMODE(os.stat(plugin.socket(resource)).st_mode) & 0o077 == 0
    probe = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect(sys.argv[1])\n"
             "except PermissionError:\n    sys.exit(13)\n")  # fmt: skip
    # A real other user: the base interpreter (the venv may lie where nobody cannot enter), with
    # the standard library only, as uid and gid 65534 with no groups and so no capabilities.
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    done = subprocess.run([python, "-I", "-S", "-c", probe, plugin.socket(RESOURCES[0])], user=65534, group=65534,
                          extra_groups=[], capture_output=True, text=True, cwd="/", timeout=60)  # fmt: skip
    assert done.returncode == 13, done.stderr


def test_a_new_driver_starts_the_plugin_again(api, kubelet, socket_dir, tmp_path):
    """NVML's library is loaded once per process: when the driver changes under the plugin (here its
    files rebuilt in place), it says so in one line and exits 75, for systemd or Kubernetes to
    start it again on the new driver (issue 32), instead of serving on the old library."""
    from oci_gpu_hook.node.nvml_reader import RESTART
    from oci_gpu_hook.toolkit.simulate import simulate

    root = str(tmp_path / "private")
    simulate(root, gpus=2)
    plugin_file = tmp_path / "plugin.yaml"
    plugin_file.write_text("version: v1\n")
    plugin = Plugin(f"{root}/config.yaml", socket_dir, str(plugin_file), tmp_path)
    try:
        kubelet.wait_for(1, plugin)  # registered: it has read NVML, and checked the devices' health
        simulate(root, gpus=2, driver_version="555.42.02", cuda_version="12.5")
        assert plugin.proc.wait(timeout=DEADLINE) == RESTART, plugin.output()
        assert "the NVIDIA driver changed (550.54.15 -> 555.42.02" in plugin.output()
    finally:
        plugin.stop()


# ---- topology and XID health (issue 39) ------------------------------------------------------------

MIXED = "version: v1\nflags:\n  migStrategy: mixed\n"


def xid_ready(plugin):
    """Until the plugin's XID thread has registered the GPUs for events (an XID before that is
    delivered to no event set, as on a real driver)."""
    deadline = time.monotonic() + DEADLINE
    while "XID health: waiting on NVML events" not in plugin.output():
        if time.monotonic() > deadline or plugin.proc.poll() is not None:
            pytest.fail(f"the XID thread did not start:\n{plugin.output()}")
        time.sleep(0.1)


def wait_for_output(plugin, text):
    deadline = time.monotonic() + DEADLINE
    while text not in plugin.output():
        if time.monotonic() > deadline or plugin.proc.poll() is not None:
            pytest.fail(f"{text!r} not said:\n{plugin.output()}")
        time.sleep(0.1)


@pytest.fixture
def events(host):
    import nvmlevents

    yield lambda uuid, xid: nvmlevents.inject_xid(host["root"], uuid, xid)
    nvmlevents.clear_events(host["root"])


def test_list_and_watch_gives_each_device_its_gpus_numa_node(api, host, kubelet, start, watches):
    plugin = start(MIXED)
    kubelet.wait_for(4, plugin)
    numa = {}
    for gpu in host["gpus"]:  # the simulator's description: sysfs numa_node of each GPU
        numa[gpu["uuid"]] = gpu["numa_node"]
        for mig in gpu["mig"]:
            numa[mig["uuid"]] = gpu["numa_node"]
    assert sorted(set(numa.values())) == [0, 1]  # the host spreads its GPUs over two nodes
    for resource in RESOURCES:
        channel, stub = plugin.stub(api, resource)
        with channel:
            first = next(iter(stub.ListAndWatch(api.pb2.Empty(), timeout=DEADLINE)))
        assert {d.ID: [n.ID for n in d.topology.nodes] for d in first.devices} == {
            d.ID: [numa[d.ID]] for d in first.devices
        }, resource


def test_a_critical_xid_marks_its_gpu_unhealthy_until_the_gpu_comes_back(api, host, kubelet, start, watches,
                                                                         events):  # fmt: skip
    plugin = start()
    kubelet.wait_for(4, plugin)
    streams = {r: watches(api, plugin, r) for r in RESOURCES}
    for stream in streams.values():
        stream.until(all_health("Healthy"), "every device is Healthy")
    xid_ready(plugin)
    gpu0, gpu1 = host["gpus"][0], host["gpus"][1]
    ours = {f"{gpu1['uuid']}::0", f"{gpu1['uuid']}::1"}

    def only_ours(devices):
        return all((health == "Unhealthy") == (i in ours) for i, health in devices.items())

    events(gpu1["uuid"], 79)  # fell off the bus
    streams["nvidia.com/gpu"].until(only_ours, "GPU 1's replicas are Unhealthy", 10)
    assert f"Unhealthy: {gpu1['uuid']}: XID 79" in plugin.output()
    events(gpu0["uuid"], 13)  # an application's error (graphics engine exception): not the GPU's
    wait_for_output(plugin, f"XID 13 on {gpu0['uuid']}: not critical here")
    seen = streams["nvidia.com/gpu"].received
    events(gpu0["uuid"], 31)  # a page fault, also the application's
    wait_for_output(plugin, f"XID 31 on {gpu0['uuid']}: not critical here")
    assert streams["nvidia.com/gpu"].received == seen and only_ours(streams["nvidia.com/gpu"].latest)
    for resource in RESOURCES[1:]:
        assert set(streams[resource].latest.values()) == {"Healthy"}, resource
    # The GPU goes (its node, as after it fell off the bus) and comes back: Healthy again.
    with NodeAside(host, f"nvidia{gpu1['minor']}") as node:
        wait_for_output(plugin, f"{gpu1['uuid']}: its GPU is gone")
        node.restore()
        streams["nvidia.com/gpu"].until(all_health("Healthy"), "every device is Healthy again")


def test_an_xid_on_a_mig_device_marks_that_mig_device_alone(api, host, kubelet, start, watches, events):
    plugin = start(MIXED)
    kubelet.wait_for(4, plugin)
    streams = {r: watches(api, plugin, r) for r in RESOURCES}
    for stream in streams.values():
        stream.until(all_health("Healthy"), "every device is Healthy")
    xid_ready(plugin)
    (gpu,) = [g for g in host["gpus"] if g["mig"]]
    mig = next(m for m in gpu["mig"] if m["profile"] == "2g.10gb")
    events(mig["uuid"], 48)  # a double-bit ECC error in that MIG device's GPU instance
    streams["nvidia.com/mig-2g.10gb"].until(all_health("Unhealthy"), "the 2g.10gb device is Unhealthy", 10)
    for resource in ("nvidia.com/gpu", "nvidia.com/mig-1g.5gb", "nvidia.com/mig-3g.20gb"):
        assert set(streams[resource].latest.values()) == {"Healthy"}, resource
    events(gpu["uuid"], 94)  # on the whole GPU: every MIG device of it
    for resource in RESOURCES[1:]:
        streams[resource].until(all_health("Unhealthy"), f"{resource} is Unhealthy", 10)
    assert set(streams["nvidia.com/gpu"].latest.values()) == {"Healthy"}


@pytest.mark.parametrize("health, xid, critical", [
    ("health:\n  criticalXids: [48, 79]\n", 79, True),
    ("health:\n  criticalXids: [48]\n", 79, False),
    ("health:\n  ignoredXids: [79]\n", 79, False),
    ("health:\n  ignoredXids: []\n", 13, True),  # NVIDIA's application XIDs count once not ignored
])  # fmt: skip
def test_the_critical_xids_are_configured(api, host, kubelet, start, watches, events, health, xid, critical):
    plugin = start(MIXED + health)
    kubelet.wait_for(4, plugin)
    stream = watches(api, plugin, "nvidia.com/gpu")
    stream.until(all_health("Healthy"), "every device is Healthy")
    xid_ready(plugin)
    gpu = host["gpus"][2]
    events(gpu["uuid"], xid)
    if critical:
        devices = stream.until(lambda d: d[gpu["uuid"]] == "Unhealthy", "the GPU is Unhealthy", 10)
        assert [i for i, h in devices.items() if h == "Unhealthy"] == [gpu["uuid"]]
    else:
        wait_for_output(plugin, f"XID {xid} on {gpu['uuid']}: not critical here")
        assert set(stream.latest.values()) == {"Healthy"}
