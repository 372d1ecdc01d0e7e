"""What an NVIDIA driver installation consists of: the facts every other module looks up.

Capabilities and the files each brings, device numbers, IPC sockets and config files, as the
NVIDIA container stack defines them, so that images and pod specs written for it behave the
same here. Pure data; no I/O.
"""

# Driver capabilities a container can ask for in NVIDIA_DRIVER_CAPABILITIES.
CAPABILITIES = ("compute", "compat32", "graphics", "utility", "video", "display", "ngx")
DEFAULT_CAPABILITIES = ("utility", "compute")

# A capability that implies others: video needs the CUDA libraries, display the GL ones.
IMPLIED_CAPABILITIES = {"video": ("compute",), "display": ("graphics",)}


class UnknownCapability(ValueError):
    """args[0]: the entry that names no capability. Callers turn it into their own one line."""


def parse_capabilities(value: str) -> frozenset:
    """The capabilities a comma-separated list names ("all": every one; empty entries and spaces
    around names are ignored), with those they imply. The one parser: the hook reads
    NVIDIA_DRIVER_CAPABILITIES and `cdi generate` reads --capabilities with it."""
    asked = set()
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        if entry == "all":
            asked.update(CAPABILITIES)
        elif entry in CAPABILITIES:
            asked.add(entry)
        else:
            raise UnknownCapability(entry)
    for capability in list(asked):
        asked.update(IMPLIED_CAPABILITIES.get(capability, ()))
    return frozenset(asked)


# Library name prefixes per capability; a cache entry matches when its name is the prefix plus
# ".<driver version>" (libraries of another driver version stay out).
LIBRARIES = {
    "utility": ("libnvidia-ml.so", "libnvidia-cfg.so", "libnvidia-nscq.so"),
    "compute": (
        "libcuda.so",
        "libcudadebugger.so",
        "libnvidia-opencl.so",
        "libnvidia-gpucomp.so",
        "libnvidia-ptxjitcompiler.so",
        "libnvidia-fatbinaryloader.so",
        "libnvidia-allocator.so",
        "libnvidia-compiler.so",
        "libnvidia-pkcs11.so",
        "libnvidia-pkcs11-openssl3.so",
        "libnvidia-nvvm.so",
    ),
    "video": ("libvdpau_nvidia.so", "libnvidia-encode.so", "libnvidia-opticalflow.so", "libnvcuvid.so"),
    "graphics": (
        "libnvidia-eglcore.so",
        "libnvidia-glcore.so",
        "libnvidia-tls.so",
        "libnvidia-glsi.so",
        "libnvidia-fbc.so",
        "libnvidia-ifr.so",
        "libnvidia-rtcore.so",
        "libnvoptix.so",
        "libGLX_nvidia.so",
        "libEGL_nvidia.so",
        "libGLESv2_nvidia.so",
        "libGLESv1_CM_nvidia.so",
        "libnvidia-glvkspirv.so",
        "libnvidia-cbl.so",
    ),
    "ngx": ("libnvidia-ngx.so",),
}

BINARIES = {
    "utility": ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced"),
    "compute": ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"),
}

# IPC endpoints: host paths, mounted at the same path, skipped when absent.
IPC_SOCKETS = {
    "utility": ("/var/run/nvidia-persistenced/socket", "/var/run/nvidia-fabricmanager/socket"),
}
MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"

# Configuration and data files the driver's libraries look for at fixed paths, per capability,
# wherever real layouts put them: the .run installer (/etc/vulkan), Debian's and RHEL's packages
# (/usr/share/vulkan, RHEL's nvidia_icd.x86_64.json), OptiX's data file. Each is mounted at its own
# path; a JSON file that names a library (library_path) only when the driver has that library.
# NVIDIA's own hook never injects them, which breaks Vulkan, EGL and OptiX.
CONFIG_FILES = {
    "graphics": (
        "/usr/share/glvnd/egl_vendor.d/10_nvidia.json",
        "/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json",
        "/usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json",
        "/etc/vulkan/icd.d/nvidia_icd.json",
        "/etc/vulkan/icd.d/nvidia_icd.x86_64.json",
        "/usr/share/vulkan/icd.d/nvidia_icd.json",
        "/usr/share/vulkan/icd.d/nvidia_icd.x86_64.json",
        "/etc/vulkan/implicit_layer.d/nvidia_layers.json",
        "/usr/share/vulkan/implicit_layer.d/nvidia_layers.json",
        "/usr/share/nvidia/nvoptix.bin",
    ),
    # OpenCL is compute: the ICD loader finds libnvidia-opencl through this file.
    "compute": ("/etc/OpenCL/vendors/nvidia.icd",),
}
# VDPAU's loader looks for backends in <libdir>/vdpau/, which is not in ld.so.conf: the driver
# installs its backend there, and the hook mounts it there.
VDPAU_DIR = "vdpau"
VDPAU_PREFIX = "libvdpau_nvidia.so"

# Device numbers. The "nvidia" major is fixed; nvidia-uvm and nvidia-caps are dynamic and must
# be read from /proc/devices.
NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
NVIDIA_MODESET_MINOR = 254
PROC_DEVICES_NAMES = ("nvidia", "nvidia-uvm", "nvidia-caps", "nvidia-caps-imex-channels")
# IMEX channels: /dev/nvidia-caps-imex-channels/channel<n>, minor n, major from /proc/devices.
IMEX_MAJOR_NAME = "nvidia-caps-imex-channels"
IMEX_CHANNELS_DIR = "/dev/nvidia-caps-imex-channels"
IMEX_MAX_CHANNEL = 2047  # the driver makes 2048 (NVreg_ImexChannelCount's default)
UVM_MINOR = 0
UVM_TOOLS_MINOR = 1

# /dev/nvidia-caps minors of the MIG capabilities, as /proc/driver/nvidia-caps/mig-minors lists
# them: config 1, monitor 2, then per GPU minor 15 GPU instances of (1 access + 8 compute
# instances) minors each.
# DRM (nvidia-drm): the kernel's fixed major for card and render nodes, and where udev names them
# by PCI address.
DRM_MAJOR = 226
DRI_BY_PATH = "/dev/dri/by-path"

MIG_CONFIG_CAP_MINOR = 1
MIG_MONITOR_CAP_MINOR = 2
MIG_MAX_GPU_INSTANCES = 15
MIG_MAX_COMPUTE_INSTANCES = 8


def mig_gi_cap_minor(gpu_minor: int, gi: int) -> int:
    return (
        3 + gpu_minor * MIG_MAX_GPU_INSTANCES * (1 + MIG_MAX_COMPUTE_INSTANCES) + gi * (1 + MIG_MAX_COMPUTE_INSTANCES)
    )


def mig_ci_cap_minor(gpu_minor: int, gi: int, ci: int) -> int:
    return mig_gi_cap_minor(gpu_minor, gi) + 1 + ci


# NVML's nvmlBrandType_t, by value; NVIDIA_REQUIRE_BRAND compares against these names.
BRANDS = (
    "Unknown",
    "Quadro",
    "Tesla",
    "NVS",
    "GRID",
    "GeForce",
    "TITAN",
    "VApps",
    "VPC",
    "VCS",
    "VWS",
    "CloudGaming",
    "QuadroRTX",
    "NvidiaRTX",
    "Nvidia",
    "GeForceRTX",
    "TitanRTX",
)
