"""Discovery on a simulated host: the DRM nodes of each GPU, found through udev's by-path links."""

import os

from oci_gpu_hook.start import settings
from oci_gpu_hook.start.discover import discover, read_dri_nodes, read_imex_channels, read_mig_devices
from oci_gpu_hook.start.driver import DRM_MAJOR, IMEX_CHANNELS_DIR
from oci_gpu_hook.toolkit.simulate import simulate


def test_each_gpu_lists_its_card_and_render_node(simulated_host):
    host = simulated_host(gpus=2)
    inventory = discover(settings.load(f"{host['root']}/config.yaml"), use_nvml=False)
    for gpu in inventory.gpus:
        assert [(n.path, n.major, n.minor, n.problem) for n in gpu.dri] == [
            (f"/dev/dri/card{gpu.index + 1}", DRM_MAJOR, gpu.index + 1, None),
            (f"/dev/dri/renderD{128 + gpu.index}", DRM_MAJOR, 128 + gpu.index, None),
        ]


def test_a_by_path_link_that_leads_elsewhere_is_not_used(tmp_path, require):
    """Only ../card<N> and ../renderD<N> naming a char 226 node in /dev/dri count: a link to
    another node (here the GPU's own /dev/nvidia node) or a missing driver gives nothing."""
    require("root", "gcc")
    host = simulate(str(tmp_path / "host"), gpus=1)
    config = settings.load(f"{host['root']}/config.yaml")
    bus = host["gpus"][0]["bus_id"]
    by_path = f"{host['root']}/dev/dri/by-path/pci-{bus}"
    os.unlink(f"{by_path}-card")
    os.symlink(f"../../nvidia{host['gpus'][0]['minor']}", f"{by_path}-card")
    os.unlink(f"{host['root']}/dev/dri/renderD128")
    os.mknod(f"{host['root']}/dev/dri/renderD128", 0o20666, os.makedev(1, 3))  # /dev/null's numbers
    assert read_dri_nodes(config, bus) == ()


def test_links_resolve_inside_the_driver_root(tmp_path):
    """Debian's SONAME links go through absolute /etc/alternatives links; in a driver root other
    than / they must land inside it, never on the host's own files (issue 26, defect 2)."""
    from oci_gpu_hook.start.discover import resolve_in_root

    root = tmp_path / "driver"
    (root / "usr/lib/nvidia/current").mkdir(parents=True)
    (root / "etc/alternatives").mkdir(parents=True)
    (root / "usr/lib/nvidia/current/libcuda.so.550").write_text("")
    os.symlink("libcuda.so.550", root / "usr/lib/nvidia/current/libcuda.so.1")
    os.symlink("/usr/lib/nvidia/current/libcuda.so.1", root / "etc/alternatives/libcuda")
    os.symlink("/etc/alternatives/libcuda", root / "usr/lib/libcuda.so.1")
    os.symlink("../../../../../../etc/passwd", root / "usr/lib/escape")
    os.symlink("loop", root / "usr/lib/loop")
    assert resolve_in_root(str(root), "/usr/lib/libcuda.so.1") == f"{root}/usr/lib/nvidia/current/libcuda.so.550"
    assert resolve_in_root(str(root), "/usr/lib/escape") == f"{root}/etc/passwd"  # .. stops at the root
    assert resolve_in_root(str(root), "/usr/lib/loop") is None
    assert resolve_in_root("/", "/usr/lib/../lib") == os.path.realpath("/usr/lib")


OTHER_DIGITS = ("\u00b9", "\u0663", "\uff12")  # '¹' (int() refuses it), '٣' and '２' (int() reads 3 and 2)


def test_imex_channels_are_named_in_ascii_digits(tmp_path):
    """channel¹ made int() raise out of discovery, and channel٣ was taken for channel 3."""
    channels = tmp_path / IMEX_CHANNELS_DIR.lstrip("/")
    channels.mkdir(parents=True)
    for name in ["channel7"] + [f"channel{d}" for d in OTHER_DIGITS]:
        (channels / name).write_text("")  # not a device node: its check's problem, not its number's
    found = read_imex_channels(settings.Settings(dev_root=str(tmp_path)), major=511)
    assert list(found) == ["7"]


def test_mig_instances_are_named_in_ascii_digits(tmp_path):
    """gi¹ made int() raise out of discovery, and gi٣ was read as GPU instance 3."""
    mig = tmp_path / "proc/driver/nvidia/capabilities/gpu0/mig"
    for gi, ci in [("1", "0")] + [(d, "0") for d in OTHER_DIGITS] + [("1", d) for d in OTHER_DIGITS]:
        (mig / f"gi{gi}" / f"ci{ci}").mkdir(parents=True, exist_ok=True)
        (mig / f"gi{gi}" / "access").write_text("DeviceFileMinor: 12\n")
        (mig / f"gi{gi}" / f"ci{ci}" / "access").write_text("DeviceFileMinor: 13\n")
    found = read_mig_devices(settings.Settings(proc_root=str(tmp_path), dev_root=str(tmp_path)), 0, 511, None)
    assert [(m.gi, m.ci) for m in found] == [(1, 0)]
