"""The simulated host, built for real (root, gcc, ldconfig) and read back with real tools."""

import glob
import json
import os
import stat
import subprocess
import sys

import pytest

from oci_gpu_hook.errors import SimulateError
from oci_gpu_hook.start import driver
from oci_gpu_hook.toolkit.simulate import remove_host, simulate


def smi(root, *args):
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": f"{root}/usr/lib64"}
    return subprocess.run([f"{root}/usr/bin/nvidia-smi", *args], capture_output=True, text=True, env=env)


def test_nvidia_smi_lists_gpus_and_follows_device_nodes(tmp_path, require):
    require("root", "gcc")
    host = simulate(str(tmp_path / "s"), gpus=4)
    root = host["root"]
    out = smi(root, "-L")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == [f"GPU {g['index']}: NVIDIA A100-SXM4-40GB (UUID: {g['uuid']})" for g in host["gpus"]]
    os.unlink(f"{root}/dev/nvidia2")
    out = smi(root, "-L")
    remaining = [g for g in host["gpus"] if g["minor"] != 2]
    assert out.stdout.splitlines() == [
        f"GPU {i}: NVIDIA A100-SXM4-40GB (UUID: {g['uuid']})" for i, g in enumerate(remaining)
    ]


def test_nvidia_smi_table_shows_versions(simulated_host):
    host = simulated_host(gpus=2)
    out = smi(host["root"])
    assert out.returncode == 0, out.stderr
    assert "Driver Version: 550.54.15" in out.stdout and "CUDA Version: 12.4" in out.stdout


def test_mig_devices_indented_under_their_gpu(simulated_host):
    host = simulated_host(gpus=3, mig=[1])
    out = smi(host["root"], "-L").stdout.splitlines()
    gpu1 = host["gpus"][1]
    at = out.index(f"GPU 1: NVIDIA A100-SXM4-40GB (UUID: {gpu1['uuid']})")
    for i, mig in enumerate(gpu1["mig"]):
        assert out[at + 1 + i] == f"  MIG {mig['profile']:<11} Device {i:2d}: (UUID: {mig['uuid']})"
    assert out[at + 4].startswith("GPU 2:")


def test_device_nodes_have_driver_numbers(simulated_host):
    host = simulated_host(gpus=3, mig=[1], scramble_minors=True)
    root = host["root"]

    def rdev(path):
        st = os.lstat(f"{root}{path}")
        assert stat.S_ISCHR(st.st_mode), path
        return os.major(st.st_rdev), os.minor(st.st_rdev)

    for gpu in host["gpus"]:
        assert rdev(f"/dev/nvidia{gpu['minor']}") == (195, gpu["minor"])
    assert rdev("/dev/nvidiactl") == (195, 255)
    assert rdev("/dev/nvidia-modeset") == (195, 254)
    assert rdev("/dev/nvidia-uvm") == (host["uvm_major"], 0)
    assert rdev("/dev/nvidia-uvm-tools") == (host["uvm_major"], 1)
    devices = open(f"{root}/proc/devices").read()
    assert f"{host['uvm_major']} nvidia-uvm" in devices and f"{host['caps_major']} nvidia-caps" in devices
    for mig in host["gpus"][1]["mig"]:
        for minor in (mig["gi_cap_minor"], mig["ci_cap_minor"]):
            assert rdev(f"/dev/nvidia-caps/nvidia-cap{minor}") == (host["caps_major"], minor)


def test_procfs_files_as_the_driver_writes_them(simulated_host):
    host = simulated_host(gpus=3, mig=[1], scramble_minors=True)
    root, nv = host["root"], f"{host['root']}/proc/driver/nvidia"
    assert "Kernel Module  550.54.15" in open(f"{nv}/version").read()
    assert "ModifyDeviceFiles: 1" in open(f"{nv}/params").read()
    for gpu in host["gpus"]:
        info = open(f"{nv}/gpus/{gpu['bus_id']}/information").read()
        assert f"GPU UUID: \t {gpu['uuid']}" in info and f"Device Minor: \t {gpu['minor']}" in info
    gpu = host["gpus"][1]
    for mig in gpu["mig"]:
        base = f"{nv}/capabilities/gpu{gpu['minor']}/mig/gi{mig['gi']}"
        assert f"DeviceFileMinor: {mig['gi_cap_minor']}\n" in open(f"{base}/access").read()
        assert f"DeviceFileMinor: {mig['ci_cap_minor']}\n" in open(f"{base}/ci{mig['ci']}/access").read()
        minors = open(f"{root}/proc/driver/nvidia-caps/mig-minors").read().splitlines()
        assert f"gpu{gpu['minor']}/gi{mig['gi']}/access {mig['gi_cap_minor']}" in minors


def test_ld_so_cache_lists_every_library_with_its_soname(simulated_host):
    host = simulated_host(gpus=2)
    root, version = host["root"], host["driver_version"]
    out = subprocess.run(["ldconfig", "-p", "-C", f"{root}/etc/ld.so.cache"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    entries = {}  # (name, 64-bit?) -> path
    for line in out.stdout.splitlines()[1:]:
        name, _, rest = line.strip().partition(" (")
        flags, _, path = rest.partition(") => ")
        entries[(name, "x86-64" in flags)] = path
    for lib in host["libraries"]:
        if lib["prefix"] == driver.VDPAU_PREFIX:
            # VDPAU's backend lives in vdpau/, which is not in ld.so.conf (as the .run installs it)
            assert (lib["soname"], True) not in entries
            assert os.path.islink(f"{root}/usr/lib64/vdpau/{lib['soname']}")
            continue
        # SONAME link in the cache points into the host-relative lib dir, at a real ELF file
        path = entries[(lib["soname"], True)]
        assert path == f"/usr/lib64/{lib['soname']}"
        real = os.path.realpath(f"{root}{path}")
        assert os.path.basename(real) == f"{lib['prefix']}.{version}"
        assert open(real, "rb").read(4) == b"\x7fELF"
        if lib["lib32"] and host["lib32"]:
            assert entries[(lib["soname"], False)] == f"/usr/lib/{lib['soname']}"


def test_32bit_libraries_built_where_gcc_can(simulated_host, require):
    require("gcc-m32")
    host = simulated_host(gpus=2)
    assert host["lib32"]
    elf = open(f"{host['root']}/usr/lib/libcuda.so.{host['driver_version']}", "rb").read(5)
    assert elf == b"\x7fELF\x01"  # ELFCLASS32


def test_driver_programs_firmware_sockets_and_config_files(simulated_host):
    host = simulated_host(gpus=2)
    root, version = host["root"], host["driver_version"]
    for tool in driver.BINARIES["utility"] + driver.BINARIES["compute"]:
        assert os.access(f"{root}/usr/bin/{tool}", os.X_OK)
    out = subprocess.run([f"{root}/usr/bin/nvidia-debugdump"], capture_output=True, text=True)
    assert out.stdout.startswith("nvidia-debugdump: simulated") and version in out.stdout
    assert os.path.isfile(f"{root}/lib/firmware/nvidia/{version}/gsp_ga10x.bin")
    assert stat.S_ISSOCK(os.lstat(f"{root}/var/run/nvidia-persistenced/socket").st_mode)
    # The configuration and data files the .run installer puts in place, and nothing that names a
    # library the simulator does not build (the EGL GBM and Wayland platform files: issue 26).
    expected = {"/usr/share/glvnd/egl_vendor.d/10_nvidia.json", "/etc/vulkan/icd.d/nvidia_icd.json",
                "/etc/vulkan/implicit_layer.d/nvidia_layers.json", "/etc/OpenCL/vendors/nvidia.icd",
                "/usr/share/nvidia/nvoptix.bin"}  # fmt: skip
    every = {p for paths in driver.CONFIG_FILES.values() for p in paths}
    assert {p for p in every if os.path.exists(f"{root}{p}")} == expected
    for path in expected:
        text = open(f"{root}{path}").read()
        if path.endswith(".json"):
            json.loads(text)


def abi_tag(path):
    """readelf's ABI tag line of an ELF file, or None."""
    out = subprocess.run(["readelf", "-n", path], capture_output=True, text=True, check=True).stdout
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith("OS:")]
    return lines[0] if lines else None


def test_libnvidia_tls_carries_the_abi_note(simulated_host, require):
    """As on a real driver (libnvidia-container refuses a libnvidia-tls without it)."""
    require("readelf")
    host = simulated_host(gpus=2)
    version = host["driver_version"]
    assert abi_tag(f"{host['root']}/usr/lib64/libnvidia-tls.so.{version}") == "OS: Linux, ABI: 2.3.99"
    assert abi_tag(f"{host['root']}/usr/lib64/libcuda.so.{version}") is None
    lib32 = f"{host['root']}/usr/lib/libnvidia-tls.so.{version}"
    if os.path.exists(lib32):
        assert abi_tag(lib32) == "OS: Linux, ABI: 2.3.99"


def test_dri_card_and_render_nodes_with_by_path_links(simulated_host):
    host = simulated_host(gpus=2)
    root = host["root"]
    assert "226 drm" in open(f"{root}/proc/devices").read().split("Block devices:")[0]
    for gpu in host["gpus"]:
        card, render = f"card{gpu['index'] + 1}", f"renderD{128 + gpu['index']}"
        for name, minor in ((card, gpu["index"] + 1), (render, 128 + gpu["index"])):
            st = os.stat(f"{root}/dev/dri/{name}")
            assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (226, minor)
        by_path = f"{root}/dev/dri/by-path/pci-{gpu['bus_id']}"
        assert os.readlink(f"{by_path}-card") == f"../{card}"
        assert os.readlink(f"{by_path}-render") == f"../{render}"


def test_config_points_the_hook_at_the_host(simulated_host, hook_cli):
    host = simulated_host(gpus=2)
    out = hook_cli("--config", f"{host['root']}/config.yaml", "info")
    assert out.returncode == 0, out.stderr
    assert "NVRM version:   550.54.15" in out.stdout
    for gpu in host["gpus"]:
        assert f"GPU UUID:       {gpu['uuid']}" in out.stdout


def test_rebuild_replaces_the_host_and_remove_removes_it(tmp_path, require):
    require("root", "gcc")
    target = tmp_path / "s"
    first = simulate(str(target), gpus=2)
    (target / "dev" / "nvidia1").unlink()
    second = simulate(str(target), gpus=3, driver_version="535.104.05")
    assert len(second["gpus"]) == 3 and os.path.exists(target / "dev" / "nvidia1")
    assert first["gpus"][0]["uuid"] != second["gpus"][0]["uuid"]
    assert sorted(os.listdir(tmp_path)) == ["s"]  # no staging or old copies left behind
    remove_host(str(target))
    assert os.listdir(tmp_path) == []


def test_refuses_to_replace_or_remove_a_foreign_directory(tmp_path, require):
    require("root", "gcc")
    foreign = tmp_path / "data"
    foreign.mkdir()
    (foreign / "precious").write_text("keep")
    with pytest.raises(SimulateError, match="not empty and is not a simulated host"):
        simulate(str(foreign), gpus=1)
    with pytest.raises(SimulateError, match="not a simulated host"):
        remove_host(str(foreign))
    assert (foreign / "precious").read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == ["data"]


def test_cli_errors_are_one_line(tmp_path, hook_cli, require):
    require("root")
    out = hook_cli("simulate", str(tmp_path / "missing-parent" / "s"))
    assert out.returncode != 0
    assert out.stderr.splitlines() == [
        f"oci-gpu-hook: {tmp_path}/missing-parent/s: the parent directory {tmp_path}/missing-parent does not exist"
    ]
    out = hook_cli("simulate", str(tmp_path / "s"), "--gpus", "99")
    assert out.stderr.splitlines() == ["oci-gpu-hook: --gpus 99: the simulated host holds 1 to 16 GPUs"]
    out = hook_cli("simulate", str(tmp_path / "s"), "--vgpu", "550.54.16")
    assert out.stderr.splitlines() == [
        "oci-gpu-hook: --vgpu '550.54.16': expected VERSION,BRANCH of the vGPU host's driver, such as "
        "550.54.16,r551_40 (each 1 to 10 of A-Z a-z 0-9 . _ -)"
    ]
    out = hook_cli("simulate", str(tmp_path / "s"), "--graphics", "2")
    assert out.stderr.splitlines() == ["oci-gpu-hook: --graphics 2: no such GPU (the host has GPUs 0 to 1)"]


def test_non_root_is_told_to_use_root(tmp_path, run_as_nobody):
    tmp_path.chmod(0o777)
    out = run_as_nobody(
        ["-m", "oci_gpu_hook", "simulate", str(tmp_path / "s")],
        modules=("oci_gpu_hook", "click"),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 7
    assert out.stderr == "oci-gpu-hook: simulate needs root: it creates device nodes with mknod (run it as root)\n"
    assert not os.path.exists(tmp_path / "s")


def test_a_gcc_that_compiles_but_cannot_link_32_bit_gives_a_64_bit_host(tmp_path, monkeypatch, require):
    """Without gcc-multilib, `gcc -m32 -c` works and every 32-bit link fails (no crti.o): the probe
    links, so simulate builds the 64-bit host and says why there is no 32-bit one (issue 26)."""
    require("root", "gcc")
    from oci_gpu_hook.toolkit.simulate import build, simulate

    wrapper = tmp_path / "gcc"
    wrapper.write_text('#!/bin/sh\ncase " $* " in *" -m32 "*) case " $* " in *" -c "*) ;; *)\n'
                       '  echo "/usr/bin/ld: cannot find crti.o: No such file or directory" >&2; exit 1;; esac;; esac\n'
                       f'exec {build.find_tool("gcc")} "$@"\n')  # fmt: skip
    wrapper.chmod(0o755)
    real_find_tool = build.find_tool
    monkeypatch.setattr(build, "find_tool", lambda name: str(wrapper) if name == "gcc" else real_find_tool(name))
    summary = simulate(str(tmp_path / "host"), gpus=1)
    assert summary["lib32"] is False
    assert os.path.exists(f"{tmp_path}/host/usr/lib64/libcuda.so.{summary['driver_version']}")
    assert not glob.glob(f"{tmp_path}/host/usr/lib/*.so.*")


def test_topology_reaches_nvml_and_sysfs_as_described(simulated_host, require):
    """NVML's common ancestor and NVLink answers, and sysfs's numa_node, against simulated-host.json."""
    require("pynvml")
    host = simulated_host(gpus=4, pcie_switches="0+2,1+3", nvlinks="0+2")
    root = host["root"]
    code = (
        "import ctypes, json, sys\n"
        "ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)\n"
        "import pynvml as N\n"
        "N.nvmlInit()\n"
        "h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(4)]\n"
        "print(json.dumps({'ancestor': [[N.nvmlDeviceGetTopologyCommonAncestor(a, b) for b in h] for a in h],\n"
        "                  'links': [[N.nvmlDeviceGetNvLinkState(a, link) for link in range(2)] for a in h]}))\n"
    )
    lib = f"{root}/usr/lib64/libnvidia-ml.so.1"
    out = subprocess.run([sys.executable, "-c", code, lib], capture_output=True, text=True, timeout=60, check=True)
    seen = json.loads(out.stdout)
    gpus = host["gpus"]

    def level(a, b):
        if a is b:
            return 0
        if a["pcie_switch"] == b["pcie_switch"]:
            return 10
        return 40 if a["numa_node"] == b["numa_node"] else 50

    assert seen["ancestor"] == [[level(a, b) for b in gpus] for a in gpus]
    assert seen["ancestor"][0][2] == seen["ancestor"][1][3] == 10  # the option's switches
    assert seen["links"] == [[1 if n < len(g["nvlink_peers"]) else 0 for n in range(2)] for g in gpus]
    assert [list(g["nvlink_peers"]) for g in gpus] == [[2], [], [0], []]
    for gpu in gpus:
        device = os.path.join(root, "sys/bus/pci/devices", gpu["bus_id"])
        with open(os.path.join(device, "numa_node")) as f:
            assert int(f.read()) == gpu["numa_node"]
        assert os.path.islink(device)


def test_sysfs_shows_each_gpu_as_a_pci_function(simulated_host):
    """Each GPU's sysfs directory holds what GFD's PCI readers read, in the kernel's formats:
    vendor, device, class, numa_node, resource (13 lines of three fields), and config, its
    configuration space whole (4096 bytes, root's to write, as the kernel's is), whose class code
    and ids agree with the text attributes and the host's description."""
    host = simulated_host(gpus=2, graphics=[1], vgpu_host_driver=("550.54.16", "r551_40"))
    for gpu in host["gpus"]:
        device = os.path.join(host["root"], "sys/bus/pci/devices", gpu["bus_id"])
        text = {name: open(os.path.join(device, name)).read() for name in ("vendor", "device", "class", "resource")}
        with open(os.path.join(device, "config"), "rb") as f:
            space = f.read()
        assert len(space) == 4096 and stat.S_IMODE(os.stat(os.path.join(device, "config")).st_mode) == 0o644
        assert stat.S_IMODE(os.stat(os.path.join(device, "resource")).st_mode) == 0o444
        assert text["class"] == f"0x{space[0x0B]:02x}{space[0x0A]:02x}{space[0x09]:02x}\n"
        assert int(text["class"], 16) == gpu["pci_class"] == (0x030000 if gpu["index"] == 1 else 0x030200)
        assert (text["vendor"], text["device"]) == (
            f"0x{space[1]:02x}{space[0]:02x}\n",
            f"0x{space[3]:02x}{space[2]:02x}\n",
        )
        assert [len(line.split(" ")) for line in text["resource"].splitlines()] == [3] * 13
        assert b"VF" in space[0x40:0x100] and b"550.54.16" in space and b"r551_40" in space
