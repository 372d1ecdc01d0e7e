"""Write a simulated GPU host to disk: procfs files, device nodes, driver files, ld.so.cache.

The host is assembled in a staging directory beside the target and swapped in at the end, so a
failed or interrupted build leaves the previous host (or nothing) behind, never half of one.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import stat
import subprocess
import tempfile

from oci_gpu_hook.errors import PrerequisiteError, SimulateError
from oci_gpu_hook.start import driver, procfs
from oci_gpu_hook.start.inventory import host_path
from oci_gpu_hook.start.linux import mountinfo
from oci_gpu_hook.toolkit.simulate import model, pci
from oci_gpu_hook.toolkit.simulate.model import SimulatedHost

MARKER = "simulated-host.json"
# NFD's features.d of the simulated host: `labels` with its configuration writes here, not into
# the machine's own /etc/kubernetes/node-feature-discovery.
FEATURES_FILE = "etc/kubernetes/node-feature-discovery/features.d/oci-gpu-hook"
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
LIB64_DIR = "usr/lib64"
LIB32_DIR = "usr/lib"
BIN_DIR = "usr/bin"
# Programs the simulation builds run with this environment only: nothing from the caller's
# environment (CFLAGS, LD_PRELOAD, ...) may change what gets built.
_TOOL_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


def find_tool(name: str) -> str:
    for directory in _TOOL_ENV["PATH"].split(":"):
        path = os.path.join(directory, name)
        if os.access(path, os.X_OK):
            return path
    raise PrerequisiteError(f"simulate needs {name}, which is not installed (on Debian: apt-get install {name})")


def _run(argv: list[str], what: str) -> None:
    result = subprocess.run(argv, env=_TOOL_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        lines = result.stdout.strip().splitlines() or ["(no output)"]
        # Compilers open with context lines ("In function ..."); the error line says what broke.
        first = next((line for line in lines if "error" in line.lower()), lines[0])
        raise SimulateError(f"{what} failed: {first}")


def is_simulated_host(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER)) and not os.path.islink(os.path.join(path, MARKER))


def used_char_majors(proc_devices: str = "/proc/devices") -> list[int]:
    try:
        with open(proc_devices) as f:
            text = f.read()
    except OSError:
        return []
    return [major for major, _name in procfs.parse_char_devices(text)]


def _check_target(target: str) -> None:
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise SimulateError(f"{target}: the parent directory {parent} does not exist")
    if os.path.islink(target) or (os.path.exists(target) and not os.path.isdir(target)):
        raise SimulateError(f"{target}: exists and is not a directory; refusing to replace it")
    if os.path.isdir(target) and os.listdir(target) and not is_simulated_host(target):
        raise SimulateError(f"{target}: directory is not empty and is not a simulated host; refusing to replace it")
    _check_no_mounts(target)


def _check_no_mounts(target: str) -> None:
    # Removing a tree with a live mount inside would delete the mounted files' contents.
    prefix = target.rstrip("/") + "/"
    for mount in mountinfo.read():
        if mount.mountpoint == target or mount.mountpoint.startswith(prefix):
            raise SimulateError(f"{target}: {mount.mountpoint} is mounted inside it; unmount it first")


def _write(root: str, relpath: str, data: str | bytes, mode: int = 0o644) -> None:
    path = os.path.join(root, relpath)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    os.chmod(path, mode)


def _mknod(root: str, relpath: str, major: int, minor: int, mode: int = 0o666) -> None:
    path = os.path.join(root, relpath)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mknod(path, stat.S_IFCHR | mode, os.makedev(major, minor))
    os.chmod(path, mode)  # mknod is subject to the umask


# --- procfs -------------------------------------------------------------------------------------


def proc_devices_text(host: SimulatedHost) -> str:
    chars = [
        (1, "mem"),
        (4, "/dev/vc/0"),
        (4, "tty"),
        (5, "/dev/tty"),
        (5, "/dev/console"),
        (5, "/dev/ptmx"),
        (7, "vcs"),
        (10, "misc"),
        (13, "input"),
        (136, "pts"),
        (driver.DRM_MAJOR, "drm"),
        (driver.NVIDIA_MAJOR, "nvidia"),
        (driver.NVIDIA_MAJOR, "nvidia-modeset"),
        (host.uvm_major, "nvidia-uvm"),
        (host.caps_major, "nvidia-caps"),
    ]
    if host.imex_major:
        chars.append((host.imex_major, driver.IMEX_MAJOR_NAME))
    lines = ["Character devices:"] + [f"{major:3d} {name}" for major, name in sorted(chars)]
    lines += ["", "Block devices:", "  7 loop", "  8 sd", "259 blkext", ""]
    return "\n".join(lines)


def version_text(host: SimulatedHost) -> str:
    return (
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {host.driver_version}  Thu Feb 22 01:44:30 UTC 2024\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )


PARAMS_TEXT = """ResmanDebugLevel: 4294967295
RmLogonRC: 1
ModifyDeviceFiles: 1
DeviceFileUID: 0
DeviceFileGID: 0
DeviceFileMode: 438
InitializeSystemMemoryAllocations: 1
UsePageAttributeTable: 4294967295
EnableMSI: 1
EnablePCIeGen3: 0
MemoryPoolSize: 0
KMallocHeapMaxSize: 0
VMallocHeapMaxSize: 0
IgnoreMMIOCheck: 0
EnableStreamMemOPs: 0
EnableUserNUMAManagement: 1
NvLinkDisable: 0
RmProfilingAdminOnly: 1
PreserveVideoMemoryAllocations: 0
EnableS0ixPowerManagement: 0
DynamicPowerManagement: 3
RegisterPCIDriver: 1
EnablePCIERelaxedOrderingMode: 0
EnableResizableBar: 0
EnableGpuFirmware: 18
EnableGpuFirmwareLogs: 2
RmNvlinkBandwidth: ""
EnableDbgBreakpoint: 0
OpenRmEnableUnsupportedGpus: 0
DmaRemapPeerMmio: 1
RegistryDwords: ""
RegistryDwordsPerDevice: ""
RmMsg: ""
GpuBlacklist: ""
TemporaryFilePath: ""
ExcludedGpus: ""
"""


def information_text(gpu: model.Gpu, irq: int) -> str:
    return (
        f"Model: \t\t {gpu.model.name}\n"
        f"IRQ:   \t\t {irq}\n"
        f"GPU UUID: \t {gpu.uuid}\n"
        "Video BIOS: \t 92.00.25.00.08\n"
        "Bus Type: \t PCIe\n"
        "DMA Size: \t 47 bits\n"
        "DMA Mask: \t 0x7fffffffffff\n"
        f"Bus Location: \t {gpu.bus_id}\n"
        f"Device Minor: \t {gpu.minor}\n"
        "GPU Excluded:\t No\n"
    )


def cap_access_text(minor: int, mode: int = 0o444) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"


def mig_minors_text(host: SimulatedHost) -> str:
    lines = [f"config {driver.MIG_CONFIG_CAP_MINOR}", f"monitor {driver.MIG_MONITOR_CAP_MINOR}"]
    for gpu_minor in sorted(g.minor for g in host.gpus):
        for gi in range(driver.MIG_MAX_GPU_INSTANCES):
            lines.append(f"gpu{gpu_minor}/gi{gi}/access {driver.mig_gi_cap_minor(gpu_minor, gi)}")
            for ci in range(driver.MIG_MAX_COMPUTE_INSTANCES):
                lines.append(f"gpu{gpu_minor}/gi{gi}/ci{ci}/access {driver.mig_ci_cap_minor(gpu_minor, gi, ci)}")
    return "\n".join(lines) + "\n"


def write_procfs(root: str, host: SimulatedHost) -> None:
    nv = "proc/driver/nvidia"
    _write(root, "proc/devices", proc_devices_text(host), 0o444)
    _write(root, f"{nv}/version", version_text(host), 0o444)
    _write(root, f"{nv}/params", PARAMS_TEXT, 0o444)
    _write(root, f"{nv}/registry", 'Binary: ""\n', 0o444)
    _write(root, f"{nv}/capabilities/mig/config", cap_access_text(driver.MIG_CONFIG_CAP_MINOR, 0o400), 0o444)
    _write(root, f"{nv}/capabilities/mig/monitor", cap_access_text(driver.MIG_MONITOR_CAP_MINOR), 0o444)
    _write(root, "proc/driver/nvidia-caps/mig-minors", mig_minors_text(host), 0o444)
    for gpu in host.gpus:
        _write(root, f"{nv}/gpus/{gpu.bus_id}/information", information_text(gpu, 40 + gpu.index), 0o444)
        _write(root, f"{nv}/gpus/{gpu.bus_id}/registry", 'Binary: ""\n', 0o444)
        for mig in gpu.mig:
            gi_dir = f"{nv}/capabilities/gpu{gpu.minor}/mig/gi{mig.gi}"
            _write(root, f"{gi_dir}/access", cap_access_text(mig.gi_cap_minor), 0o444)
            _write(root, f"{gi_dir}/ci{mig.ci}/access", cap_access_text(mig.ci_cap_minor), 0o444)


def write_sysfs(root: str, host: SimulatedHost) -> None:
    """The GPUs' PCI devices in sysfs, where NVIDIA's device plugin (and ours) read the NUMA node,
    and GFD (and `labels`) the GPU mode and the vGPU capability: /sys/bus/pci/devices/<bus id>
    links into /sys/devices, each GPU below the downstream port of its PCIe switch, under one host
    bridge per switch; the attributes in the kernel's formats and modes (pci.py)."""
    for gpu in host.gpus:
        bridge = f"pci{gpu.bus_id[:4]}:{0xE0 + gpu.pcie_switch:02x}"
        port = f"{gpu.bus_id[:4]}:{0xE0 + gpu.pcie_switch:02x}:01.0"
        device = f"sys/devices/{bridge}/{port}/{gpu.bus_id}"
        model = gpu.model
        _write(root, f"{device}/numa_node", f"{gpu.numa_node}\n", 0o444)
        _write(root, f"{device}/vendor", f"0x{model.pci_device_id & 0xFFFF:04x}\n", 0o444)
        _write(root, f"{device}/device", f"0x{model.pci_device_id >> 16:04x}\n", 0o444)
        _write(root, f"{device}/subsystem_vendor", f"0x{model.pci_subsystem_id & 0xFFFF:04x}\n", 0o444)
        _write(root, f"{device}/subsystem_device", f"0x{model.pci_subsystem_id >> 16:04x}\n", 0o444)
        _write(root, f"{device}/revision", f"0x{pci.REVISION:02x}\n", 0o444)
        _write(root, f"{device}/class", f"0x{gpu.pci_class:06x}\n", 0o444)
        _write(root, f"{device}/resource", pci.resource_text(host, gpu), 0o444)
        _write(root, f"{device}/config", pci.config_space(host, gpu), 0o644)
        link = os.path.join(root, "sys/bus/pci/devices", gpu.bus_id)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(os.path.join(root, device), os.path.dirname(link)), link)


def write_devices(root: str, host: SimulatedHost) -> None:
    for gpu in host.gpus:
        _mknod(root, f"dev/nvidia{gpu.minor}", driver.NVIDIA_MAJOR, gpu.minor)
    _mknod(root, "dev/nvidiactl", driver.NVIDIA_MAJOR, driver.NVIDIACTL_MINOR)
    _mknod(root, "dev/nvidia-modeset", driver.NVIDIA_MAJOR, driver.NVIDIA_MODESET_MINOR)
    _mknod(root, "dev/nvidia-uvm", host.uvm_major, driver.UVM_MINOR)
    _mknod(root, "dev/nvidia-uvm-tools", host.uvm_major, driver.UVM_TOOLS_MINOR)
    caps = [(driver.MIG_CONFIG_CAP_MINOR, 0o400), (driver.MIG_MONITOR_CAP_MINOR, 0o444)]
    caps += [(m, 0o444) for g in host.gpus for i in g.mig for m in (i.gi_cap_minor, i.ci_cap_minor)]
    for minor, mode in caps:
        _mknod(root, f"dev/nvidia-caps/nvidia-cap{minor}", host.caps_major, minor, mode)
    if host.imex_major:
        for channel in host.imex_channels:  # IMEX channel n: minor n, mode 0666 as the driver makes it
            _mknod(root, f"{driver.IMEX_CHANNELS_DIR.lstrip('/')}/channel{channel}", host.imex_major, channel)
    # DRM: card1.. (card0 is the BMC's display on a server), renderD128.., and udev's links by PCI
    # address, where discovery looks for them.
    by_path = host_path(root, driver.DRI_BY_PATH)
    os.makedirs(by_path, exist_ok=True)
    for gpu in host.gpus:
        card, render = f"card{gpu.index + 1}", f"renderD{128 + gpu.index}"
        _mknod(root, f"dev/dri/{card}", driver.DRM_MAJOR, gpu.index + 1, 0o660)
        _mknod(root, f"dev/dri/{render}", driver.DRM_MAJOR, 128 + gpu.index, 0o666)
        os.symlink(f"../{card}", os.path.join(by_path, f"pci-{gpu.bus_id}-card"))
        os.symlink(f"../{render}", os.path.join(by_path, f"pci-{gpu.bus_id}-render"))


# --- driver files -------------------------------------------------------------------------------


def sim_host_header(host: SimulatedHost) -> str:
    """The C header that bakes this host's data into the simulated NVML (see csrc/sim_types.h)."""

    def c_str(s: str) -> str:
        return json.dumps(s)  # JSON string escaping is valid C for these ASCII strings

    out = ['#include "sim_types.h"']
    out.append(f"#define SIM_ROOT {c_str(host.root)}")
    out.append(f"#define SIM_DRIVER_VERSION {c_str(host.driver_version)}")
    out.append(f"#define SIM_NVML_VERSION {c_str('12.' + host.driver_version)}")
    out.append(f"#define SIM_CUDA_VERSION {host.cuda_version_int}")
    out.append(f"#define SIM_CAPS_MAJOR {host.caps_major}")
    # A vGPU guest's NVML reports its GPUs in vGPU mode, with a licence to report (1: a guest)
    out.append(f"#define SIM_VGPU_GUEST {0 if host.vgpu_host_driver is None else 1}")
    out.append("static const struct sim_gi_profile GI_PROFILES[] = {")
    for p in model.MIG_PROFILES:
        out.append(
            f"    {{{c_str(p.name)}, {p.id}, {p.slices}, {p.instances}, {p.multiprocessors}, {p.copy_engines}, "
            f"{p.decoders}, {p.encoders}, {p.jpegs}, {p.ofas}, {p.memory_mib}, {p.placement_size}}},"
        )
    out.append("};")
    for gpu in host.gpus:
        if gpu.mig:
            out.append(f"static const struct sim_mig SIM_MIG_{gpu.index}[] = {{")
            for m in gpu.mig:
                out.append(
                    f"    {{{m.gi}, {m.ci}, {c_str(m.uuid)}, {c_str(m.profile)}, {m.gi_cap_minor}, "
                    f"{m.ci_cap_minor}, {m.memory_total}ULL}},"
                )
            out.append("};")
    out.append(f"#define SIM_N_GPUS {len(host.gpus)}")
    out.append("static const struct sim_gpu SIM_GPUS[SIM_N_GPUS] = {")
    for gpu in host.gpus:
        m = gpu.model
        domain, bus, rest = gpu.bus_id.split(":")
        device = int(rest.split(".")[0], 16)
        mig = f"SIM_MIG_{gpu.index}" if gpu.mig else "0"
        out.append(
            f"    {{{c_str(m.name)}, {driver.BRANDS.index(m.brand)}, {c_str(gpu.uuid)}, "
            f"{c_str(model.nvml_bus_id(gpu.bus_id))}, {int(domain, 16)}, {int(bus, 16)}, {device}, "
            f"{m.pci_device_id:#x}, {m.pci_subsystem_id:#x}, {gpu.minor}, {m.compute_capability[0]}, "
            f"{m.compute_capability[1]}, {m.memory_total}ULL, {(512 << 20)}ULL, 0, 0, "
            f"{1 if gpu.mig else 0}, {len(gpu.mig)}, {mig}, {1 if m.hbm else 0}}},"
        )
    out.append("};")
    out += topology_header_lines(host)
    return "\n".join(out) + "\n"


def topology_header_lines(host: SimulatedHost) -> list[str]:
    """SIM_TOPOLOGY (csrc/sim_types.h): each GPU's switch, NUMA node and NVLink peers."""
    out = ["static const struct sim_topology SIM_TOPOLOGY[SIM_N_GPUS] = {"]
    for gpu in host.gpus:
        peers = ", ".join(str(p) for p in gpu.nvlink_peers) or "0"
        out.append(f"    {{{gpu.pcie_switch}, {gpu.numa_node}, {len(gpu.nvlink_peers)}, {{{peers}}}}},")
    out.append("};")
    return out


def _compile_driver(root: str, host: SimulatedHost, workdir: str, lib32: bool) -> None:
    gcc = find_tool("gcc")
    version = host.driver_version
    with open(os.path.join(workdir, "sim_host.h"), "w") as f:
        f.write(sim_host_header(host))
    include = ["-I", workdir, "-I", CSRC]
    cflags = ["-O2", "-Wall", "-Wextra", "-Werror"]
    lib64, lib32_dir, bindir = (os.path.join(root, d) for d in (LIB64_DIR, LIB32_DIR, BIN_DIR))
    for d in (lib64, lib32_dir, bindir):
        os.makedirs(d, exist_ok=True)

    # One stub object per word size, linked once per library with that library's SONAME. Real
    # driver libraries need libc, and ldconfig classifies a library by that (libc6 vs plain ELF).
    needs_libc = ["-Wl,--no-as-needed", "-lc"]
    stub64 = os.path.join(workdir, "stub64.o")
    stub32 = os.path.join(workdir, "stub32.o")
    _run([gcc, *cflags, "-fPIC", "-c", "-o", stub64, os.path.join(CSRC, "driver_stub.c")], "compiling the library stub")
    # libnvidia-tls also carries the ELF ABI note a real one has (csrc/abi_tag.c).
    abi64, abi32 = os.path.join(workdir, "abi64.o"), os.path.join(workdir, "abi32.o")
    _run([gcc, *cflags, "-fPIC", "-c", "-o", abi64, os.path.join(CSRC, "abi_tag.c")], "compiling the ABI note")
    if lib32:
        _run(
            [gcc, "-m32", *cflags, "-fPIC", "-c", "-o", stub32, os.path.join(CSRC, "driver_stub.c")],
            "compiling the 32-bit library stub",
        )
        _run([gcc, "-m32", *cflags, "-fPIC", "-c", "-o", abi32, os.path.join(CSRC, "abi_tag.c")],
             "compiling the 32-bit ABI note")  # fmt: skip
    nvml = os.path.join(lib64, f"libnvidia-ml.so.{version}")
    jobs = [
        [
            gcc,
            *cflags,
            "-fPIC",
            "-shared",
            *include,
            "-Wl,-soname,libnvidia-ml.so.1",
            "-o",
            nvml,
            os.path.join(CSRC, "nvml.c"),
        ],
    ]

    def library_path(directory: str, lib) -> str:
        # VDPAU's backend lives in <libdir>/vdpau/, where its loader looks (not in ld.so.conf).
        sub = driver.VDPAU_DIR if lib.prefix == driver.VDPAU_PREFIX else ""
        return os.path.join(directory, sub, f"{lib.prefix}.{version}")

    # Libraries are linked in waves, each after the ones it NEEDs (model.NEEDS, the real driver's
    # edges), which are given to the linker by path: DT_NEEDED then names their SONAMEs.
    by_prefix = {lib.prefix: lib for lib in host.libraries}

    def depth(prefix: str) -> int:
        return max((1 + depth(n) for n in model.NEEDS.get(prefix, ())), default=0)

    waves: list = [[] for _ in range(1 + max(depth(p) for p in by_prefix))]
    for lib in host.libraries:
        tls = lib.prefix == "libnvidia-tls.so"
        for directory, m32, stub, abi in ((lib64, [], stub64, abi64), (lib32_dir, ["-m32"], stub32, abi32)):
            if m32 and not (lib.lib32 and lib32) or (not m32 and lib.prefix == "libnvidia-ml.so"):
                continue
            needed = [library_path(directory, by_prefix[n]) for n in model.NEEDS.get(lib.prefix, ())]
            out = library_path(directory, lib)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            objects = [stub] + ([abi] if tls else [])
            waves[depth(lib.prefix)].append([gcc, *m32, "-shared", f"-Wl,-soname,{lib.soname}", "-o", out, *objects,
                                 *needs_libc, *needed])  # fmt: skip
    for name in model.UNVERSIONED_LIBRARIES:
        waves[0].append([gcc, "-shared", f"-Wl,-soname,{name}", "-o", os.path.join(lib64, name), stub64, *needs_libc])
    for tool in driver.BINARIES["utility"] + driver.BINARIES["compute"]:
        if tool not in ("nvidia-smi", "nvidia-cuda-mps-control"):
            jobs.append(
                [
                    gcc,
                    *cflags,
                    *include,
                    f'-DTOOL_NAME="{tool}"',
                    "-o",
                    os.path.join(bindir, tool),
                    os.path.join(CSRC, "driver_tool.c"),
                ]
            )
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for wave in [jobs + waves[0]] + waves[1:]:
            for future in [
                pool.submit(_run, argv, f"building {os.path.basename(argv[argv.index('-o') + 1])}") for argv in wave
            ]:
                future.result()
    for directory in (lib64, lib32_dir):  # ldconfig does not look in vdpau/: its SONAME link by hand
        backend = os.path.join(directory, driver.VDPAU_DIR, f"{driver.VDPAU_PREFIX}.{version}")
        if os.path.exists(backend):
            os.symlink(os.path.basename(backend), os.path.join(os.path.dirname(backend), "libvdpau_nvidia.so.1"))
    # The MPS control program with the real one's interface (stdin commands, -d): csrc/mps_control.c.
    _run([gcc, *cflags, *include, "-o", os.path.join(bindir, "nvidia-cuda-mps-control"),
          os.path.join(CSRC, "mps_control.c")], "building nvidia-cuda-mps-control")  # fmt: skip
    # nvidia-smi loads NVML with dlopen, as the real one does (no NEEDED entry: csrc/nvml_dlopen.c).
    _run([gcc, *cflags, *include, "-o", os.path.join(bindir, "nvidia-smi"), os.path.join(CSRC, "nvidia-smi.c"),
          os.path.join(CSRC, "nvml_dlopen.c"), "-ldl"], "building nvidia-smi")  # fmt: skip
    # The development links the .run installer creates next to the SONAME links.
    os.symlink("libcuda.so.1", os.path.join(lib64, "libcuda.so"))
    os.symlink("libnvidia-ml.so.1", os.path.join(lib64, "libnvidia-ml.so"))


def _can_build_32bit(workdir: str) -> bool:
    """Whether gcc can link 32-bit shared libraries: a compile alone succeeds without gcc-multilib,
    and every 32-bit link then fails (no crti.o), so the probe links one, against libc as the
    stubs are."""
    probe = os.path.join(workdir, "probe32.so")
    result = subprocess.run(
        [find_tool("gcc"), "-m32", "-fPIC", "-shared", "-o", probe, os.path.join(CSRC, "driver_stub.c"),
         "-Wl,--no-as-needed", "-lc"],
        env=_TOOL_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return result.returncode == 0


def write_driver_files(root: str, host: SimulatedHost, workdir: str) -> bool:
    """Build libraries and programs, then the ld.so.cache; returns whether 32-bit libraries were built."""
    lib32 = _can_build_32bit(workdir)
    _compile_driver(root, host, workdir, lib32)
    _write(root, "etc/ld.so.conf", f"/{LIB64_DIR}\n/{LIB32_DIR}\n")
    # ldconfig -r chroots into the host: the cache then holds host-relative paths, as on a real
    # host, and it creates the SONAME links itself.
    _run([find_tool("ldconfig"), "-r", root], "ldconfig")
    fw = f"lib/firmware/nvidia/{host.driver_version}"
    for name in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        _write(root, f"{fw}/{name}", f"simulated GSP firmware {host.driver_version} {name}\n", 0o444)
    for sock in driver.IPC_SOCKETS["utility"][:1]:
        path = os.path.join(root, sock.lstrip("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mknod(path, stat.S_IFSOCK | 0o777)
    egl = '{\n    "file_format_version" : "1.0.0",\n    "ICD" : {\n        "library_path" : "%s"\n    }\n}\n'
    vulkan_icd = (
        '{\n    "file_format_version" : "1.0.0",\n    "ICD": {\n        "library_path": "libGLX_nvidia.so.0",\n'
        '        "api_version" : "1.3.277"\n    }\n}\n'
    )
    vulkan_layer = (
        '{\n    "file_format_version" : "1.0.0",\n    "layer": {\n        "name": "VK_LAYER_NV_optimus",\n'
        '        "type": "INSTANCE",\n        "library_path": "libGLX_nvidia.so.0",\n'
        '        "api_version" : "1.3.277",\n        "implementation_version" : "1",\n'
        '        "description" : "NVIDIA Optimus layer"\n    }\n}\n'
    )
    # As the .run installer lays them out; the EGL GBM and Wayland platform files are left out:
    # they name libraries of other packages (egl-gbm, egl-wayland), which are not simulated.
    contents = {
        "/usr/share/glvnd/egl_vendor.d/10_nvidia.json": egl % "libEGL_nvidia.so.0",
        "/etc/vulkan/icd.d/nvidia_icd.json": vulkan_icd,
        "/etc/vulkan/implicit_layer.d/nvidia_layers.json": vulkan_layer,
        "/etc/OpenCL/vendors/nvidia.icd": "libnvidia-opencl.so.1\n",
        "/usr/share/nvidia/nvoptix.bin": f"simulated OptiX data {host.driver_version}\n",
    }
    for path, text in contents.items():
        _write(root, path.lstrip("/"), text)
    return lib32


def config_text(target: str) -> str:
    return (
        "# oci-gpu-hook configuration for the simulated GPU host in this directory.\n"
        f"# Use it with: oci-gpu-hook --config {target}/config.yaml <command>\n"
        f"driver_root: {json.dumps(target)}\n"
        f"dev_root: {json.dumps(target)}\n"
        f"proc_root: {json.dumps(target)}\n"
        f"inventory_cache: {json.dumps(target + '/inventory-cache.json')}\n"
        f"records_directory: {json.dumps(target + '/containers')}\n"
        "node:\n"
        f"  features_file: {json.dumps(target + '/' + FEATURES_FILE)}\n"
        f"  sys_root: {json.dumps(target)}\n"
        "logging:\n"
        "  level: info\n"
        f"  file: {json.dumps(target + '/hook.log')}\n"
    )


# --- the whole host -----------------------------------------------------------------------------


def build_host(host: SimulatedHost) -> dict:
    """Create (or safely replace) the simulated host at host.root; returns a summary."""
    target = host.root
    if os.geteuid() != 0:
        raise PrerequisiteError("simulate needs root: it creates device nodes with mknod (run it as root)")
    find_tool("gcc")
    find_tool("ldconfig")
    _check_target(target)
    parent, name = os.path.split(target)
    staging = tempfile.mkdtemp(prefix=f".{name}.building-", dir=parent)
    workdir = tempfile.mkdtemp(prefix="oci-gpu-hook-simulate-")
    old = None
    try:
        os.chmod(staging, 0o755)
        write_procfs(staging, host)
        write_devices(staging, host)
        write_sysfs(staging, host)
        _write(staging, "sys/class/dmi/id/product_name", host.machine + "\n", 0o444)
        lib32 = write_driver_files(staging, host, workdir)
        _write(staging, "config.yaml", config_text(target))
        os.makedirs(os.path.join(staging, os.path.dirname(FEATURES_FILE)))
        summary = dict(host.to_json(), lib32=lib32)
        _write(staging, MARKER, json.dumps(summary, indent=2) + "\n")
        if os.path.isdir(target):
            old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.rename(target, os.path.join(old, name))
        os.rename(staging, target)
        return summary
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if old is not None and not os.path.exists(target):
            os.rename(os.path.join(old, name), target)
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def remove_host(target: str) -> None:
    target = os.path.abspath(target)
    if not os.path.lexists(target):
        raise SimulateError(f"{target}: no such directory")
    if os.path.islink(target) or not is_simulated_host(target):
        raise SimulateError(f"{target}: not a simulated host (no {MARKER}); refusing to remove it")
    _check_no_mounts(target)
    shutil.rmtree(target)
