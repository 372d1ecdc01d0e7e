import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from oci_gpu_hook.errors import RequestError
from oci_gpu_hook.start.request import parse_request
from oci_gpu_hook.start.settings import Settings
from oci_gpu_hook.start.spec import Mount, Spec

DEFAULT = Settings()


def spec(env=None, caps=(), mounts=(), annotations=None):
    return Spec(
        rootfs="/r",
        env=dict(env or {}),
        bounding_capabilities=frozenset(caps),
        mounts=tuple(mounts),
        annotations=dict(annotations or {}),
        mount_label=None,
    )


def request(env=None, settings=DEFAULT, **kw):
    return parse_request(spec(env, **kw), settings)


# --- NVIDIA_VISIBLE_DEVICES ---------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "", "   ", "void", "0,void", " , "])
def test_not_a_gpu_container(value):
    env = {} if value is None else {"NVIDIA_VISIBLE_DEVICES": value}
    assert request(env) is None


@pytest.mark.parametrize(
    "value, devices",
    [
        ("none", ()),
        ("all", ("all",)),
        ("ALL", ("all",)),
        ("0,all", ("0", "all")),  # ids before "all" stay, to be checked against the host
        ("0", ("0",)),
        (" 0 , 2 ,, 0", ("0", "2")),
        ("GPU-3b9521e4-f0b2-520f-8ee3-2dbc4ee49933", ("GPU-3b9521e4-f0b2-520f-8ee3-2dbc4ee49933",)),
        ("0000:3b:00.0,00000000:07:00.0", ("0000:3b:00.0", "00000000:07:00.0")),
        ("MIG-6fbeaf3d-3d05-5ec2-87fd-8838b345216f", ("MIG-6fbeaf3d-3d05-5ec2-87fd-8838b345216f",)),
        ("1:0", ("1:0",)),
        ("MIG-GPU-3b9521e4-f0b2-520f-8ee3-2dbc4ee49933/1/0", ("MIG-GPU-3b9521e4-f0b2-520f-8ee3-2dbc4ee49933/1/0",)),
    ],
)
def test_device_list_forms(value, devices):
    r = request({"NVIDIA_VISIBLE_DEVICES": value})
    assert r.devices == devices and r.source == "env"


@pytest.mark.parametrize("bad", ["gpu0", "0,foo", "1:x", "-1", "GPU-", "/dev/nvidia0"])
def test_bad_device_id_is_one_line_naming_variable_value_and_accepted(bad):
    with pytest.raises(RequestError) as e:
        request({"NVIDIA_VISIBLE_DEVICES": bad})
    text = str(e.value)
    assert text.startswith(f"NVIDIA_VISIBLE_DEVICES={bad}: ") and ": unknown device (accepted: all, none" in text


def test_too_many_ids_is_refused_quickly():
    value = ",".join(str(i) for i in range(10000))
    with pytest.raises(RequestError, match="10000 device ids; at most 1024"):
        request({"NVIDIA_VISIBLE_DEVICES": value})


def test_huge_value_is_refused():
    with pytest.raises(RequestError, match="longer than"):
        request({"NVIDIA_VISIBLE_DEVICES": "0" * (1 << 20)})


# --- capabilities -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, caps",
    [
        (None, {"utility", "compute"}),
        ("", {"utility", "compute"}),
        ("utility", {"utility"}),
        ("video", {"video", "compute"}),
        ("display", {"display", "graphics"}),
        ("all", {"compute", "compat32", "graphics", "utility", "video", "display", "ngx"}),
        ("compute, utility,", {"compute", "utility"}),
    ],
)
def test_capabilities(value, caps):
    env = {"NVIDIA_VISIBLE_DEVICES": "0"}
    if value is not None:
        env["NVIDIA_DRIVER_CAPABILITIES"] = value
    assert request(env).capabilities == caps


def test_capabilities_limited_to_supported():
    s = Settings(supported_capabilities=("utility", "compute"))
    r = request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "all"}, settings=s)
    assert r.capabilities == {"utility", "compute"}


def test_unknown_capability():
    with pytest.raises(
        RequestError, match=r"NVIDIA_DRIVER_CAPABILITIES=compute,gpu: unknown capability 'gpu' \(accepted"
    ):
        request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,gpu"})


# --- legacy images, privilege, other sources ----------------------------------------------------


def test_legacy_image_gets_all_gpus_all_capabilities_and_a_cuda_requirement():
    r = request({"CUDA_VERSION": "10.2.89"})
    assert r.devices == ("all",) and r.source == "legacy-image"
    assert "compat32" in r.capabilities and "graphics" in r.capabilities
    assert "cuda>=10.2" in r.requirements.describe()


def test_empty_require_cuda_is_still_legacy():
    assert request({"CUDA_VERSION": "11.0.3", "NVIDIA_REQUIRE_CUDA": ""}).source == "legacy-image"


def test_image_with_require_cuda_is_not_legacy():
    assert request({"CUDA_VERSION": "12.4.1", "NVIDIA_REQUIRE_CUDA": "cuda>=12.4"}) is None


def test_unprivileged_env_refused_when_configured():
    s = Settings(accept_envvar_when_unprivileged=False)
    assert request({"NVIDIA_VISIBLE_DEVICES": "all"}, settings=s) is None
    assert request({"NVIDIA_VISIBLE_DEVICES": "all"}, settings=s, caps=["CAP_SYS_ADMIN"]).devices == ("all",)


def test_volume_mounts_give_the_device_list():
    s = Settings(accept_envvar_when_unprivileged=False, accept_volume_mounts=True)
    mounts = [
        Mount("/var/run/nvidia-container-devices/GPU-3b9521e4-f0b2-520f-8ee3-2dbc4ee49933", "/dev/null", "bind"),
        Mount("/var/run/nvidia-container-devices/1", "/dev/null", "bind"),
        Mount("/var/run/nvidia-container-devices/2", "/etc/passwd", "bind"),  # not /dev/null: ignored
        Mount("/var/run/elsewhere/3", "/dev/null", "bind"),
    ]
    r = request({"NVIDIA_VISIBLE_DEVICES": "all"}, settings=s, mounts=mounts)
    assert r.devices == ("GPU-3b9521e4-f0b2-520f-8ee3-2dbc4ee49933", "1") and r.source == "volume-mounts"


def test_volume_mounts_at_unnormalised_paths_reach_the_request_past_the_fast_path():
    """The fast path (prestart) and the request read the same rule: a volume mount named
    /var/run/./nvidia-container-devices/0 once made the fast path let the container go."""
    from oci_gpu_hook.start import prestart
    from oci_gpu_hook.start.spec import Spec

    s = Settings(accept_envvar_when_unprivileged=False, accept_volume_mounts=True)
    for destination in ("/var/run/./nvidia-container-devices/0", "//var/run//nvidia-container-devices/0/"):
        mounts = (Mount(destination, "/dev/null", "bind"),)
        assert prestart.may_ask_for_gpus(Spec("/r", {}, frozenset(), mounts, {}, None)), destination
        assert request({}, settings=s, mounts=list(mounts)).devices == ("0",), destination
    for destination in ("/var/run/nvidia-container-devices", "/var/run/nvidia-container-devices/0/.."):
        mounts = (Mount(destination, "/dev/null", "bind"),)
        assert not prestart.may_ask_for_gpus(Spec("/r", {}, frozenset(), mounts, {}, None)), destination


def test_volume_mounts_ignored_unless_enabled():
    mounts = [Mount("/var/run/nvidia-container-devices/1", "/dev/null", "bind")]
    assert request({"NVIDIA_VISIBLE_DEVICES": "0"}, mounts=mounts).devices == ("0",)


def test_cdi_annotations_name_devices_of_our_kind_when_enabled():
    annotations = {"cdi.k8s.io/nvidia-device-plugin_uid": "nvidia.com/gpu=0,nvidia.com/gpu=2,other.com/x=1"}
    r = request({}, annotations=annotations, settings=Settings(accept_cdi_annotations=True))
    assert r.devices == ("0", "2") and r.source == "cdi-annotation"
    # off by default: a runtime with CDI injects those devices itself
    assert request({}, annotations=annotations) is None


def test_a_cdi_request_is_its_devices_and_capabilities_alone_at_both_ends_of_a_spec():
    """A request of devices a CDI spec gives, as the runtime's start reads it (OCI_GPU_HOOK_CDI_DEVICE_*
    variables) and as `cdi generate` builds the spec's edits: whatever else the image says
    (requirements, MIG flags, IMEX channels, MPS), no requirement is checked and nothing but the
    devices and the supported capabilities is asked for."""
    from oci_gpu_hook.start.request import CDI_SPEC, RUNTIME_CDI, cdi_request
    from oci_gpu_hook.toolkit import cdi

    image = {"OCI_GPU_HOOK_CDI_DEVICE_nvidia_com_gpu_0": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=99.0",
             "NVIDIA_DRIVER_CAPABILITIES": "all", "NVIDIA_MIG_CONFIG_DEVICES": "all", "NVIDIA_IMEX_CHANNELS": "0",
             "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps"}  # fmt: skip
    settings = Settings(supported_capabilities=("compute", "utility"))
    started = request(image, settings=settings, caps=["CAP_SYS_ADMIN"])
    generated = cdi._request(["0"], frozenset({"compute", "graphics", "utility"}), settings)
    for r, source, caps in ((started, RUNTIME_CDI, {"utility"}), (generated, CDI_SPEC, {"compute", "utility"})):
        assert (r.devices, r.source, r.capabilities) == (("0",), source, frozenset(caps))
        assert r.disable_require and r.requirements.describe() == "none"
        assert not (r.mig_config or r.mig_monitor or r.imex_channels or r.notes)
    assert started.privileged and started.mps_pipe_directory is None
    assert started == cdi_request(("0",), RUNTIME_CDI, {"utility"}, settings, True, origins=started.origins)
    assert generated == cdi_request(["0"], CDI_SPEC, {"compute", "graphics", "utility"}, settings,
                                    mps_pipe_directory=generated.mps_pipe_directory)  # fmt: skip


def test_privileged_mig_config_and_monitor():
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_MIG_CONFIG_DEVICES": "all", "NVIDIA_MIG_MONITOR_DEVICES": "all"}
    r = request(env, caps=["CAP_SYS_ADMIN"])
    assert r.mig_config and r.mig_monitor and r.privileged


@pytest.mark.parametrize(
    "env, caps, message",
    [
        ({"NVIDIA_MIG_CONFIG_DEVICES": "all"}, [], "NVIDIA_MIG_CONFIG_DEVICES=all: only privileged containers"),
        ({"NVIDIA_MIG_MONITOR_DEVICES": "0"}, ["CAP_SYS_ADMIN"], "NVIDIA_MIG_MONITOR_DEVICES=0: unsupported value"),
    ],
)
def test_mig_config_monitor_errors(env, caps, message):
    with pytest.raises(RequestError, match=message):
        request(dict(env, NVIDIA_VISIBLE_DEVICES="0"), caps=caps)


def test_mps_pipe_directory_only_from_the_allow_list():
    assert request({"NVIDIA_VISIBLE_DEVICES": "0"}).mps_pipe_directory == "/tmp/nvidia-mps"
    r = request({"NVIDIA_VISIBLE_DEVICES": "0", "CUDA_MPS_PIPE_DIRECTORY": "/etc"})
    assert r.mps_pipe_directory is None and "CUDA_MPS_PIPE_DIRECTORY=/etc ignored" in r.notes[0]
    s = Settings(mps_pipe_directories=("/run/mps",))
    r = request({"NVIDIA_VISIBLE_DEVICES": "0", "CUDA_MPS_PIPE_DIRECTORY": "/run/mps/"}, settings=s)
    assert r.mps_pipe_directory == "/run/mps"


def test_mps_pipe_directory_the_runtime_mounted_is_left_alone_without_a_note():
    """The device plugin's MPS answer mounts the daemon's pipe directory itself (issue 39, item 3)."""
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe"}
    r = parse_request(spec(env, mounts=(Mount("/mps/nvidia.com/gpu/pipe", "/run/nvidia/mps/nvidia.com/gpu/pipe",
                                              "bind"),)), DEFAULT)  # fmt: skip
    assert (r.mps_pipe_directory, r.notes) == (None, ())
    assert request(env).notes and "ignored: not in mps_pipe_directories" in request(env).notes[0]


def test_disable_require_from_env_or_settings():
    assert request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DISABLE_REQUIRE": "true"}).disable_require
    assert request({"NVIDIA_VISIBLE_DEVICES": "0"}, settings=Settings(disable_require=True)).disable_require
    assert not request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DISABLE_REQUIRE": "nope"}).disable_require


_env_keys = st.sampled_from(
    [
        "NVIDIA_VISIBLE_DEVICES",
        "NVIDIA_DRIVER_CAPABILITIES",
        "NVIDIA_REQUIRE_CUDA",
        "NVIDIA_REQUIRE_X",
        "CUDA_VERSION",
        "NVIDIA_DISABLE_REQUIRE",
        "NVIDIA_MIG_CONFIG_DEVICES",
        "CUDA_MPS_PIPE_DIRECTORY",
        "OTHER",
    ]
)


@hsettings(max_examples=300)
@given(st.dictionaries(_env_keys, st.text(max_size=60)), st.booleans())
def test_request_parsing_raises_only_request_error(env, privileged):
    try:
        request(env, caps=["CAP_SYS_ADMIN"] if privileged else [])
    except RequestError:
        pass


# ---- IMEX channels (issue 39, item 4) ----------------------------------------------------------------


def test_imex_channels_from_the_variable_under_the_visible_devices_rules():
    gpu = {"NVIDIA_VISIBLE_DEVICES": "0"}
    assert request({**gpu, "NVIDIA_IMEX_CHANNELS": "3, 0,3"}).imex_channels == (3, 0)
    assert request({**gpu, "NVIDIA_IMEX_CHANNELS": "All"}).imex_channels == ("all",)
    assert request({**gpu, "NVIDIA_IMEX_CHANNELS": "none"}).imex_channels == ()
    assert request(gpu).imex_channels == ()
    assert request({"NVIDIA_IMEX_CHANNELS": "0"}) is None  # not a GPU container: nothing at all
    strict = Settings(accept_envvar_when_unprivileged=False, accept_volume_mounts=True)
    mounts = (Mount("/var/run/nvidia-container-devices/0", "/dev/null", "bind"),)
    env = {**gpu, "NVIDIA_IMEX_CHANNELS": "all"}
    assert parse_request(spec(env, mounts=mounts), strict).imex_channels == ()  # an unprivileged pod's own
    assert parse_request(spec(env, caps=("CAP_SYS_ADMIN",), mounts=mounts), strict).imex_channels == ("all",)
    imex = mounts + (Mount("/var/run/nvidia-container-devices/imex/2", "/dev/null", "bind"),
                     Mount("/var/run/nvidia-container-devices/imex/5", "/etc/passwd", "bind"))  # fmt: skip
    assert parse_request(spec(env, mounts=imex), strict).imex_channels == (2,)


@pytest.mark.parametrize("value", ["x", "-1", "2048", "0x1", "1e3"])
def test_imex_channels_refused_as_one_line(value):
    with pytest.raises(RequestError) as e:
        request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": value})
    assert e.value.message.startswith(f"NVIDIA_IMEX_CHANNELS={value}: ") and "not an IMEX channel" in e.value.message
