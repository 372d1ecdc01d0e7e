"""Fuzzing what the outside world hands the hook: the OCI state (stdin), config.json and the
image's env, through the same functions the hook runs (state.parse, spec.parse, may_ask_for_gpus,
request.parse_request, plan.build_plan). Only the hook's own errors (HookError: one line, an exit
status) may come out; anything else would reach the user as an 'internal error'.

10,000 cases per run (hypothesis, no example database, no deadline), in-process: seconds.
"""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oci_gpu_hook.errors import HookError
from oci_gpu_hook.start import plan, prestart, request, spec, state
from oci_gpu_hook.start.settings import Settings

EXAMPLES = 2500  # per test; four tests: 10,000 cases
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip

json_scalars = st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=40)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6,
)


def _maybe(strategy):
    """The expected shape, or any JSON value in its place."""
    return strategy | json_values


# --- the OCI state ------------------------------------------------------------------------------

state_docs = st.fixed_dictionaries(
    {},
    optional={
        "ociVersion": _maybe(st.sampled_from(["1.0.2", "1.2.0", "1.0.0-rc1", "2.0.0", "1.0", "", "1.0.2-\x00"])),
        "id": _maybe(st.text(max_size=30)),
        "status": _maybe(st.sampled_from(["creating", "created", "running"])),
        "pid": _maybe(st.integers(-5, 1 << 23)),
        "bundle": _maybe(st.sampled_from(["/b", "b", "", "/b\x00c", "/" + "x" * 300])),
        "annotations": _maybe(st.dictionaries(st.text(max_size=10), st.text(max_size=10) | json_values, max_size=3)),
    },
)


def _encodings(doc):
    text = json.dumps(doc, allow_nan=True)
    data = text.encode()
    return st.sampled_from([data, data[: len(data) // 2], data + b"\xff", b"\xef" + data[1:]])


@FUZZ
@given(st.binary(max_size=300) | state_docs.flatmap(_encodings) | json_values.map(lambda v: json.dumps(v).encode()))
def test_state_parse(data):
    try:
        parsed = state.parse(data)
    except state.StateError as e:
        assert "\n" not in e.message
        return
    assert parsed.bundle.startswith("/") and "\0" not in parsed.bundle
    assert parsed.pid is None or 0 < parsed.pid < 1 << 22
    assert parsed.id and len(parsed.id) <= 1024


# --- config.json and the image's env -------------------------------------------------------------

device_ids = st.sampled_from(["0", "1", "7", "1:0", "0:9", "all", "none", "void", "GPU-", "MIG-", "", " ", ",",
                              "0000:07:00.0", "07:00.0", "zz:00.0", "MIG-GPU-abc/1/0", "-1", "1e3", "٣"])  # fmt: skip
device_lists = st.lists(device_ids | st.text(string.printable, max_size=12), max_size=8).map(",".join)
env_values = (
    device_lists
    | st.text(max_size=60)
    | st.sampled_from(
        ["cuda>=12.0", "cuda>=99.0 brand=tesla", "arch=8.0", "compute,utility", "all", "graphics,display"]
    )
)
ENV_NAMES = ["NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_REQUIRE_CUDA", "NVIDIA_REQUIRE_ARCH",
             "NVIDIA_DISABLE_REQUIRE", "NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_MIG_MONITOR_DEVICES", "CUDA_VERSION",
             "CUDA_MPS_PIPE_DIRECTORY", "NVIDIA_REQUIRE_JETPACK", "PATH", "LD_PRELOAD"]  # fmt: skip
envs = st.dictionaries(st.sampled_from(ENV_NAMES) | st.text(max_size=8), env_values, max_size=6)
env_lists = envs.map(lambda env: [f"{k}={v}" for k, v in env.items()]) | st.lists(json_values, max_size=4)

VOLUME = "/var/run/nvidia-container-devices/"
cdi_values = device_lists.map(lambda v: v.replace("0", "nvidia.com/gpu=0"))
config_docs = st.fixed_dictionaries(
    {},
    optional={
        "root": _maybe(st.fixed_dictionaries({"path": _maybe(st.sampled_from(["rootfs", "/r", "", "a\x00b"]))},
                                             optional={"readonly": json_values})),
        "process": _maybe(st.fixed_dictionaries({}, optional={
            "env": env_lists,
            "capabilities": _maybe(st.fixed_dictionaries({}, optional={
                "bounding": st.lists(st.sampled_from(["CAP_SYS_ADMIN", "CAP_KILL"]) | json_scalars, max_size=3)})),
        })),
        "mounts": _maybe(st.lists(st.fixed_dictionaries({}, optional={
            "destination": _maybe(st.sampled_from([VOLUME + "0", "/x", VOLUME + "all", VOLUME + "../0",
                                                   "/var/run/./nvidia-container-devices/0", VOLUME + "1/",
                                                   "//var/run//nvidia-container-devices/1", VOLUME + ".", VOLUME])),
            "source": _maybe(st.sampled_from(["/dev/null", "/x"])), "type": _maybe(st.just("bind"))}), max_size=3)),
        "annotations": _maybe(st.dictionaries(st.sampled_from(["cdi.k8s.io/gpu", "x"]) | st.text(max_size=8),
                                              cdi_values | json_values, max_size=2)),
        "linux": _maybe(st.fixed_dictionaries({}, optional={"mountLabel": json_values, "devices": _maybe(st.lists(
            st.fixed_dictionaries({}, optional={"path": _maybe(st.sampled_from(["/dev/nvidia0", "", "/dev//x/"])),
                                                "type": _maybe(st.sampled_from(["c", "u", "b"])),
                                                "major": _maybe(st.sampled_from([195, True, -1, 1 << 70, 1.5])),
                                                "minor": _maybe(st.sampled_from([0, 255, False, "0"]))}),
            max_size=3))})),
    },
)  # fmt: skip

SETTINGS = [Settings(), Settings(accept_volume_mounts=True, accept_envvar_when_unprivileged=False),
            Settings(supported_capabilities=("utility",), disable_require=True)]  # fmt: skip


@FUZZ
@given(config_docs | json_values, st.sampled_from(SETTINGS))
def test_config_json_to_request(doc, hook_settings):
    """config.json -> Spec -> 'could this be a GPU container?' -> GpuRequest."""
    try:
        parsed = spec.parse(doc, "/bundle")
    except state.StateError:
        return
    could = prestart.may_ask_for_gpus(parsed)
    try:
        gpu_request = request.parse_request(parsed, hook_settings)
    except HookError as e:
        assert "\n" not in e.message
        return
    if gpu_request is not None:
        assert could, "a request from a container the fast path would have let go"
        assert gpu_request.capabilities <= frozenset(hook_settings.supported_capabilities)


@FUZZ
@given(st.binary(max_size=400) | config_docs.map(lambda d: json.dumps(d).encode()))
def test_config_json_bytes(data):
    """The whole of spec.load's parsing: bytes -> JSON -> Spec."""
    try:
        spec.parse(state.load_json(data, "config.json", spec.MAX_CONFIG_BYTES), "/bundle")
    except state.StateError as e:
        assert "\n" not in e.message


@pytest.fixture(scope="module")
def inventory(simulated_host):
    from oci_gpu_hook.start import inventory_cache, settings

    host = simulated_host(gpus=2, mig=[1])
    return inventory_cache.load(settings.load(f"{host['root']}/config.yaml"))


def test_env_to_plan(inventory):
    """The image's env all the way to a plan against a real (simulated) host inventory."""
    layouts = [plan.LibraryLayout.for_rootfs(False), plan.LibraryLayout.for_rootfs(True)]

    @FUZZ
    @given(envs, st.booleans(), st.sampled_from(layouts))
    def check(env, privileged, layout):
        parsed = spec.Spec("/r", env, frozenset({"CAP_SYS_ADMIN"} if privileged else ()), (), {}, None)
        try:
            gpu_request = request.parse_request(parsed, Settings())
            if gpu_request is None:
                return
            built = plan.build_plan(gpu_request, inventory, layout)
        except HookError as e:
            assert "\n" not in e.message
            return
        # Each target is made once; a Remount changes what an earlier operation made there.
        made = [op.target for op in built.operations if hasattr(op, "target") and not isinstance(op, plan.Remount)]
        assert len(made) == len(set(made))
        remounted = [op.target for op in built.operations if isinstance(op, plan.Remount)]
        assert set(remounted) <= set(made)
        assert all(t.startswith("/") and "/../" not in t + "/" for t in made)

    check()
