"""GPU memory limits: the accepted forms, the smallest-wins rule, the shared-GPU cap, and every
bad value refused with one line naming where it came from."""

import pytest

from oci_gpu_hook.errors import RequestError
from oci_gpu_hook.start import memory_limit as ml
from oci_gpu_hook.start.inventory import GpuInfo, MigDevice
from oci_gpu_hook.start.plan import SelectedDevice
from oci_gpu_hook.start.spec import Mount

GIB, MIB = 1 << 30, 1 << 20


@pytest.mark.parametrize(
    "text, expected",
    [("512MiB", ("bytes", 512 * MIB)), ("4GiB", ("bytes", 4 * GIB)), ("1.5GiB", ("bytes", 3 * GIB // 2)),
     ("4gib", ("bytes", 4 * GIB)), (" 4 Gi ", ("bytes", 4 * GIB)), ("100Mi", ("bytes", 100 * MIB)),
     ("25%", ("share", 0.25)), ("100%", ("share", 1.0)), ("0.5%", ("share", 0.005))],
)  # fmt: skip
def test_accepted_forms(text, expected):
    assert ml.parse(text, "X") == expected


@pytest.mark.parametrize(
    "text, words",
    [("0MiB", "above zero"), ("-1GiB", "above zero"), ("0%", "above zero"), ("-5%", "above zero"),
     ("101%", "exceed 100%"), ("12", "expected a size"), ("4GB", "expected a size"), ("abc", "expected a size"),
     ("1e3MiB", "expected a size"), ("GiB", "expected a size"), ("１２MiB", "expected a size"),
     ("4 GiB 4", "expected a size"), ("nan%", "expected a size"), ("\\x1b[31m5GiB", "expected a size"),
     ("--5GiB", "expected a size"), ("-.GiB", "expected a size"), ("\u0663GiB", "expected a size")],
)  # fmt: skip
def test_refused_forms_say_where_and_why(text, words):
    with pytest.raises(RequestError) as e:
        ml.parse(text, ml.ENV)
    assert words in e.value.message and e.value.message.startswith(ml.ENV + "=") and "\n" not in e.value.message


def _gpu(uuid="GPU-1", memory=40 * GIB, mig=()):
    node = None
    return GpuInfo(index=0, minor=0, uuid=uuid, bus_id="0000:07:00.0", model="m", node=node, memory_total=memory,
                   mig=mig)  # fmt: skip


def _mig(memory=5 * GIB):
    return MigDevice(index=0, gi=13, ci=0, uuid="MIG-1", gi_cap=None, ci_cap=None, gi_access="", ci_access="",
                     profile="1g.5gb", memory_total=memory)  # fmt: skip


def test_no_limit_without_a_declaration_or_a_shared_gpu():
    devices = (SelectedDevice(_gpu()),)
    assert ml.resolve({}, {}, None, 1, devices) is None
    assert ml.resolve({}, {}, "8GiB", 1, devices) is None  # the cap applies to shared GPUs only


def test_per_device_bytes_and_the_smallest_wins():
    devices = (SelectedDevice(_gpu("GPU-1")), SelectedDevice(_gpu("GPU-2"), _mig()))
    assert ml.resolve({ml.ENV: "25%"}, {}, None, 1, devices) == {"GPU-1": 10 * GIB, "MIG-1": 5 * GIB // 4}
    both = ml.resolve({ml.ENV: "4GiB"}, {ml.ANNOTATION: "2GiB"}, None, 1, devices[:1])
    assert both == {"GPU-1": 2 * GIB}  # the pod's annotation is lower: it wins
    assert ml.resolve({ml.ENV: "1GiB"}, {ml.ANNOTATION: "2GiB"}, None, 1, devices[:1]) == {"GPU-1": GIB}


def test_the_shared_gpu_cap_cannot_be_raised_by_the_container():
    devices = (SelectedDevice(_gpu()),)
    assert ml.resolve({}, {}, ml.PER_REPLICA, 4, devices) == {"GPU-1": 10 * GIB}
    assert ml.resolve({ml.ENV: "30GiB"}, {}, ml.PER_REPLICA, 4, devices) == {"GPU-1": 10 * GIB}
    assert ml.resolve({ml.ENV: "1GiB"}, {}, ml.PER_REPLICA, 4, devices) == {"GPU-1": GIB}
    assert ml.resolve({}, {}, "6GiB", 2, devices) == {"GPU-1": 6 * GIB}


def test_a_limit_larger_than_the_device_is_refused():
    with pytest.raises(RequestError) as e:
        ml.resolve({ml.ENV: "6GiB"}, {}, None, 1, (SelectedDevice(_gpu(), _mig()),))
    assert e.value.message == f"{ml.ENV}: GPU memory limit 6144 MiB is larger than MIG-1's 5120 MiB"


def test_a_configured_cap_larger_than_a_device_is_the_devices_memory():
    devices = (SelectedDevice(_gpu()), SelectedDevice(_gpu("GPU-2"), _mig()))
    assert ml.resolve({}, {}, "8GiB", 2, devices) == {"GPU-1": 8 * GIB, "MIG-1": 5 * GIB}
    assert ml.resolve({ml.ENV: "4GiB"}, {}, "48GiB", 2, devices[:1]) == {"GPU-1": 4 * GIB}


def test_a_limit_below_one_mib_is_refused():
    with pytest.raises(RequestError) as e:
        ml.resolve({ml.ENV: "0.0000001MiB"}, {}, None, 1, (SelectedDevice(_gpu()),))
    assert "the least is 1 MiB" in e.value.message


def test_a_percentage_needs_the_devices_memory():
    with pytest.raises(RequestError) as e:
        ml.resolve({ml.ENV: "50%"}, {}, None, 1, (SelectedDevice(_gpu(memory=None)),))
    assert "NVML did not report" in e.value.message
    assert ml.resolve({ml.ENV: "1GiB"}, {}, None, 1, (SelectedDevice(_gpu(memory=None)),)) == {"GPU-1": GIB}


def test_a_bad_annotation_names_the_annotation():
    with pytest.raises(RequestError) as e:
        ml.resolve({}, {ml.ANNOTATION: "lots"}, None, 1, (SelectedDevice(_gpu()),))
    assert e.value.message.startswith(f"annotation {ml.ANNOTATION}='lots'")


# ---- the device plugin's channel: a mount at MOUNT_DIR/<limit> ---------------------------------


def _mount(destination, source="/dev/null"):
    return Mount(destination=destination, source=source, type="bind")


def test_a_mount_in_the_limit_directory_is_a_limit():
    devices = (SelectedDevice(_gpu()),)
    assert ml.MOUNT_DIR == "/var/run/oci-gpu-hook/gpu-memory-limit"
    assert ml.resolve({}, {}, None, 1, devices, [_mount(f"{ml.MOUNT_DIR}/4GiB")]) == {"GPU-1": 4 * GIB}
    assert ml.resolve({}, {}, None, 1, devices, (_mount(f"{ml.MOUNT_DIR}/25%"),)) == {"GPU-1": 10 * GIB}
    mig = (SelectedDevice(_gpu(), _mig()),)
    assert ml.resolve({}, {}, None, 1, mig, [_mount(f"{ml.MOUNT_DIR}/33.3333%")]) == {"MIG-1": int(5 * GIB * 0.333333)}


@pytest.mark.parametrize(
    "destination",
    ["/var/run/oci-gpu-hook/gpu-memory-limit", "/var/run/oci-gpu-hook/gpu-memory-limit/", "/var/run/oci-gpu-hook",
     "/var/run/oci-gpu-hook/gpu-memory-limit/4GiB/x", "/run/oci-gpu-hook/gpu-memory-limit/4GiB",
     "/var/run/nvidia-container-devices/4GiB", "/var/run/oci-gpu-hook/gpu-memory-limit/..",
     "/var/run/oci-gpu-hook/gpu-memory-limit/4GiB/..", "var/run/oci-gpu-hook/gpu-memory-limit-x/4GiB"],
)  # fmt: skip
def test_other_mounts_are_not_limits(destination):
    assert ml.mounted_limits([_mount(destination)]) == []
    assert ml.resolve({}, {}, None, 1, (SelectedDevice(_gpu()),), [_mount(destination)]) is None


@pytest.mark.parametrize(
    "destination",
    ["//var/run/./oci-gpu-hook/gpu-memory-limit/4GiB", "/var/run/oci-gpu-hook/gpu-memory-limit/4GiB/",
     "/var/run/oci-gpu-hook//gpu-memory-limit/./4GiB", "var/run/oci-gpu-hook/gpu-memory-limit/4GiB",
     "/var/run/oci-gpu-hook/x/../gpu-memory-limit/4GiB"],
)  # fmt: skip
def test_normalised_mount_paths_count(destination):
    """The runtime mounts at the normalised path, so the hook reads it the same way."""
    assert ml.mounted_limits([_mount(destination)]) == [("4GiB", f"mount {ml.MOUNT_DIR}/4GiB")]
    assert ml.resolve({}, {}, None, 1, (SelectedDevice(_gpu()),), [_mount(destination)]) == {"GPU-1": 4 * GIB}


def test_the_smallest_of_env_annotation_and_mount_wins():
    devices = (SelectedDevice(_gpu()),)
    plugin = [_mount(f"{ml.MOUNT_DIR}/25%")]  # 10 GiB of 40
    # a pod's larger variable (it comes after the plugin's) cannot raise the plugin's mount
    assert ml.resolve({ml.ENV: "30GiB"}, {}, None, 1, devices, plugin) == {"GPU-1": 10 * GIB}
    assert ml.resolve({ml.ENV: "100%"}, {ml.ANNOTATION: "50%"}, None, 1, devices, plugin) == {"GPU-1": 10 * GIB}
    # a smaller one lowers it
    assert ml.resolve({ml.ENV: "2GiB"}, {}, None, 1, devices, plugin) == {"GPU-1": 2 * GIB}
    assert ml.resolve({}, {ml.ANNOTATION: "1GiB"}, None, 1, devices, plugin) == {"GPU-1": GIB}
    # two mounts (the pod may add one of its own): the smaller
    both = plugin + [_mount(f"{ml.MOUNT_DIR}/6GiB")]
    assert ml.resolve({}, {}, None, 1, devices, both) == {"GPU-1": 6 * GIB}
    # and the node's cap for shared GPUs still applies beside them
    assert ml.resolve({}, {}, "4GiB", 2, devices, plugin) == {"GPU-1": 4 * GIB}


def test_the_mount_source_does_not_matter():
    devices = (SelectedDevice(_gpu()),)
    assert ml.resolve({}, {}, None, 1, devices, [_mount(f"{ml.MOUNT_DIR}/1GiB", "/etc/hostname")]) == {"GPU-1": GIB}


@pytest.mark.parametrize("value, words", [("lots", "expected a size"), ("0GiB", "above zero"), ("150%", "exceed 100%"),
                                          ("4GB", "expected a size"), ("4 GiB 4", "expected a size")])  # fmt: skip
def test_a_bad_mounted_value_names_the_mount(value, words):
    with pytest.raises(RequestError) as e:
        ml.resolve({}, {}, None, 1, (SelectedDevice(_gpu()),), [_mount(f"{ml.MOUNT_DIR}/{value}")])
    assert e.value.message.startswith(f"mount {ml.MOUNT_DIR}/{value}={value!r}: "), e.value.message
    assert words in e.value.message and "\n" not in e.value.message


def test_a_bad_mounted_value_with_control_characters_is_shown_safely():
    with pytest.raises(RequestError) as e:
        ml.resolve({}, {}, None, 1, (SelectedDevice(_gpu()),), [_mount(f"{ml.MOUNT_DIR}/\x1b[31m4GiB")])
    assert "\x1b" not in e.value.message and e.value.message.startswith(f"mount {ml.MOUNT_DIR}/\\x1b[31m4GiB=")


def test_a_mounted_limit_larger_than_the_device_is_refused_naming_the_mount():
    with pytest.raises(RequestError) as e:
        ml.resolve({}, {}, None, 1, (SelectedDevice(_gpu(), _mig()),), [_mount(f"{ml.MOUNT_DIR}/8GiB")])
    assert e.value.message == f"mount {ml.MOUNT_DIR}/8GiB: GPU memory limit 8192 MiB is larger than MIG-1's 5120 MiB"


def test_no_devices_no_limit_even_with_a_mount():
    assert ml.resolve({}, {}, None, 1, (), [_mount(f"{ml.MOUNT_DIR}/4GiB")]) is None
