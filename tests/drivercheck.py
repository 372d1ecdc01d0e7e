"""NVIDIA's real driver user space (550.163.01, from Debian's non-free section, fetched by
../shared/tools/nvidia-driver/fetch.sh and cached per machine), laid out as real hosts have it:

- `rhel`: the .run installer's and RHEL's layout: every library in one directory (/usr/lib64),
  VDPAU's backend in its vdpau/ subdirectory, programs in /usr/bin, RHEL's Vulkan file names;
- `debian`: Debian's own tree, with the absolute /etc/alternatives links its maintainer script
  makes (every SONAME link in the library directory, nvidia-smi, VDPAU, OptiX's data file);
- `container`: the .run layout as a driver container mounts it, its SONAME links absolute.

Every layout is a driver root other than / (links must resolve inside it), with its ld.so.cache
made by the host's ldconfig -r. Device nodes and /proc/driver/nvidia come from the simulator.

NVIDIA's libraries, run as root, make the device nodes they miss themselves: NVML's init, with no
kernel module, mknods /dev/nvidiactl (char 195:255) in the /dev it sees. Anything that may run
them (runc, whose prestart hook asks NVML; info, plan, cdi generate) runs through
run_with_private_dev, where /dev is a tmpfs of its own; never where /dev is the host's.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

from kubeletcheck import shared_tool

VERSION = "550.163.01"
MULTIARCH = "usr/lib/x86_64-linux-gnu"
LAYOUTS = ("rhel", "debian", "container")


def tree() -> str:
    """The extracted packages (Debian's layout, no maintainer scripts run)."""
    return shared_tool("nvidia-driver")


def _place(source: str, target: str) -> None:
    """A hard link where the filesystems allow (the files are hundreds of MB), else a copy."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def library_files(source: str) -> list:
    """The real files (not links) of every driver library in the tree."""
    found = []
    for directory in (f"{source}/{MULTIARCH}", f"{source}/{MULTIARCH}/nvidia/current"):
        for path in sorted(glob.glob(f"{directory}/*.so*")):
            if not os.path.islink(path) and os.path.isfile(path):
                found.append(path)
    return found


def sonames(source: str) -> dict:
    """{library file name: its SONAME}, from the tree's links (libcuda.so.1 -> libcuda.so.V)."""
    names = {}
    for directory in (f"{source}/{MULTIARCH}", f"{source}/{MULTIARCH}/nvidia/current"):
        for path in glob.glob(f"{directory}/*.so.*"):
            if os.path.islink(path) and not os.readlink(path).startswith("/"):
                names[os.readlink(path)] = os.path.basename(path)
    return names


def _ldconfig(root: str, libdir: str) -> None:
    with open(f"{root}/etc/ld.so.conf", "w") as f:
        f.write(f"/{libdir}\n")
    subprocess.run(["ldconfig", "-r", root], check=True, capture_output=True)


def _common(source: str, root: str, share_vulkan: bool, rhel_names: bool) -> None:
    """Programs, firmware and configuration files of the .run and RHEL layouts."""
    programs = {"usr/lib/nvidia/current/nvidia-smi": "usr/bin/nvidia-smi",
                "usr/bin/nvidia-persistenced": "usr/bin/nvidia-persistenced",
                "usr/bin/nvidia-cuda-mps-control": "usr/bin/nvidia-cuda-mps-control",
                "usr/sbin/nvidia-cuda-mps-server": "usr/bin/nvidia-cuda-mps-server"}  # fmt: skip
    for old, new in programs.items():
        _place(f"{source}/{old}", f"{root}/{new}")
    for firmware in glob.glob(f"{source}/usr/lib/firmware/nvidia/{VERSION}/*"):
        _place(firmware, f"{root}/lib/firmware/nvidia/{VERSION}/{os.path.basename(firmware)}")
    vulkan = "usr/share/vulkan" if share_vulkan else "etc/vulkan"
    icd = "nvidia_icd.x86_64.json" if rhel_names else "nvidia_icd.json"
    configs = {"usr/share/vulkan/icd.d/nvidia_icd.json": f"{vulkan}/icd.d/{icd}",
               "usr/share/vulkan/implicit_layer.d/nvidia_layers.json": f"{vulkan}/implicit_layer.d/nvidia_layers.json",
               "usr/share/glvnd/egl_vendor.d/10_nvidia.json": "usr/share/glvnd/egl_vendor.d/10_nvidia.json",
               "etc/OpenCL/vendors/nvidia.icd": "etc/OpenCL/vendors/nvidia.icd",
               f"{MULTIARCH}/nvidia/current/nvoptix.bin": "usr/share/nvidia/nvoptix.bin"}  # fmt: skip
    for old, new in configs.items():
        _place(f"{source}/{old}", f"{root}/{new}")


def _run_layout(source: str, root: str, absolute_links: bool, rhel_names: bool) -> None:
    lib = "usr/lib64"
    names = sonames(source)
    for path in library_files(source):
        name = os.path.basename(path)
        sub = "vdpau/" if name.startswith("libvdpau_nvidia.so.") else ""
        _place(path, f"{root}/{lib}/{sub}{name}")
        soname = names.get(name)
        if soname and soname != name:
            value = f"/{lib}/{sub}{name}" if absolute_links else name
            os.symlink(value, f"{root}/{lib}/{sub}{soname}")
    os.makedirs(f"{root}/{lib}/gbm", exist_ok=True)
    os.symlink("../libnvidia-allocator.so.1", f"{root}/{lib}/gbm/nvidia-drm_gbm.so")
    os.makedirs(f"{root}/etc", exist_ok=True)
    _common(source, root, share_vulkan=rhel_names, rhel_names=rhel_names)
    _ldconfig(root, lib)


def _debian_layout(source: str, root: str) -> None:
    """The tree as dpkg unpacks it, plus what nvidia-alternative's maintainer script links."""
    for directory, _, names in os.walk(source):
        relative = os.path.relpath(directory, source)
        if relative.startswith("usr/share/doc"):
            continue
        for name in names:
            path = os.path.join(directory, name)
            target = os.path.join(root, relative, name)
            if os.path.islink(path):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.symlink(os.readlink(path), target)
            else:
                _place(path, target)
    current = f"/{MULTIARCH}/nvidia/current"

    def alternative(link: str, name: str, value: str) -> None:
        os.makedirs(os.path.dirname(f"{root}{link}"), exist_ok=True)
        os.makedirs(f"{root}/etc/alternatives", exist_ok=True)
        os.symlink(f"/etc/alternatives/{name}", f"{root}{link}")
        os.symlink(value, f"{root}/etc/alternatives/{name}")

    for path in sorted(glob.glob(f"{root}{current}/*.so.[0-9]")):
        soname = os.path.basename(path)
        if soname.startswith("libvdpau_nvidia"):
            alternative(f"/{MULTIARCH}/vdpau/{soname}", f"nvidia--{soname}-x86_64-linux-gnu", f"{current}/{soname}")
        else:
            alternative(f"/{MULTIARCH}/{soname}", f"nvidia--{soname}-x86_64-linux-gnu", f"{current}/{soname}")
    alternative(f"/{MULTIARCH}/gbm/nvidia-drm_gbm.so", "nvidia--nvidia-drm_gbm.so-x86_64-linux-gnu",
                f"{current}/nvidia-drm_gbm.so")  # fmt: skip
    alternative("/usr/bin/nvidia-smi", "nvidia--nvidia-smi", "/usr/lib/nvidia/current/nvidia-smi")
    alternative("/usr/share/nvidia/nvoptix.bin", "nvidia--nvoptix.bin", f"{current}/nvoptix.bin")
    _ldconfig(root, MULTIARCH)


def make_layout(kind: str, root: str) -> str:
    """The real driver laid out as kind (LAYOUTS) at root; returns root."""
    source = tree()
    os.makedirs(root)
    if kind == "debian":
        _debian_layout(source, root)
    else:
        _run_layout(source, root, absolute_links=kind == "container", rhel_names=kind == "rhel")
    return root


# What a program may need of /dev, with the numbers every Linux gives them (devices.txt).
PRIVATE_DEV_NODES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9),
                     "tty": (5, 0)}  # fmt: skip


def run_with_private_dev(argv, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(argv) in a mount namespace of its own (private propagation: nothing mounted
    there reaches the host's) where /dev is a new tmpfs holding only PRIVATE_DEV_NODES and the
    /proc/self/fd links: whatever argv makes in /dev goes with the namespace."""
    nodes = " && ".join(f"mknod -m 666 /dev/{name} c {major} {minor}"
                        for name, (major, minor) in PRIVATE_DEV_NODES.items())  # fmt: skip
    setup = (
        f"mount -t tmpfs -o mode=755,nosuid oci-gpu-hook-dev /dev && {nodes} && ln -s /proc/self/fd /dev/fd"
        ' && ln -s fd/0 /dev/stdin && ln -s fd/1 /dev/stdout && ln -s fd/2 /dev/stderr && exec "$@"'
    )
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", setup, "sh", *argv],
                          **kwargs)  # fmt: skip


def runc_run(bundle: str, container_id: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`runc run` of the bundle (its prestart hook included) where /dev is private, then `runc delete`."""
    runc = shutil.which("runc")
    try:
        return run_with_private_dev([runc, "run", "--bundle", bundle, container_id], capture_output=True, text=True,
                                    timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip
    finally:
        subprocess.run([runc, "delete", "--force", container_id], capture_output=True)


def config_text(driver_root: str, host_root: str, state: str) -> str:
    """The hook's configuration: the real driver's files, the simulator's nodes and procfs."""
    return (f"driver_root: {driver_root}\ndev_root: {host_root}\nproc_root: {host_root}\n"
            f"inventory_cache: {state}/inventory-cache.json\nrecords_directory: {state}/containers\n"
            f"logging:\n  level: info\n  file: {state}/hook.log\n")  # fmt: skip
