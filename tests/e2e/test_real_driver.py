"""NVIDIA's real driver files (550.163.01) through the hook into real runc containers, in three
layouts (tests/drivercheck.py), with device nodes and /proc/driver/nvidia from the simulator:
every mounted driver library finds the driver libraries it needs, the real libcuda answers
cuDriverGetVersion and cuInit, the real nvidia-smi fails as it does without a kernel module, and
each capability brings its configuration and data files. info, plan and cdi generate list exactly
the driver's files. No GPU and no kernel module: NVML answers "Driver Not Loaded", and the hook
works from procfs and the device nodes (issue 26). Everything that may run NVIDIA's code runs where
/dev is private (drivercheck.run_with_private_dev): the real NVML makes /dev/nvidiactl itself."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import drivercheck
import leftovers
import pytest

from oci_gpu_hook.start import driver
from oci_gpu_hook.start.linux import arch
from oci_gpu_hook.toolkit import containers

CAPABILITIES = ["compute", "utility", "graphics", "video", "display", "ngx", "all"]
# What the real libraries need of the system besides libc (glibc's split libraries, libgcc_s);
# X11's libraries are the image's to bring, and are not checked here.
SYSTEM_LIBRARIES = ("libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libgcc_s.so.1", "libutil.so.1")
PROBE = r"""
#include <dlfcn.h>
#include <stdio.h>
int main(void) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!cuda) { printf("dlopen failed: %s\n", dlerror()); return 2; }
    int (*get_version)(int *) = (int (*)(int *))dlsym(cuda, "cuDriverGetVersion");
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(cuda, "cuInit");
    int version = 0;
    int status = get_version(&version);
    printf("cuDriverGetVersion %d %d\n", status, version);
    printf("cuInit %d\n", init(0));
    return 0;
}
"""
CONFIGS = {
    "graphics": ("/usr/share/glvnd/egl_vendor.d/10_nvidia.json", "/usr/share/nvidia/nvoptix.bin"),
    "compute": ("/etc/OpenCL/vendors/nvidia.icd",),
}
VULKAN = {"rhel": "/usr/share/vulkan/icd.d/nvidia_icd.x86_64.json", "debian": "/usr/share/vulkan/icd.d/nvidia_icd.json",
          "container": "/etc/vulkan/icd.d/nvidia_icd.json"}  # fmt: skip


@pytest.fixture(scope="module")
def real(tmp_path_factory, simulated_host, require):
    """{layout: config path}: each layout of the real driver, its own state directory."""
    require("root", "runc", "busybox", "gcc", "ldconfig")
    host = simulated_host(gpus=1, driver_version=drivercheck.VERSION)
    top = tmp_path_factory.mktemp("real-driver")
    configs = {}
    for kind in drivercheck.LAYOUTS:
        root = drivercheck.make_layout(kind, str(top / kind))
        state = top / f"{kind}-state"
        state.mkdir()
        config = top / f"{kind}.yaml"
        config.write_text(drivercheck.config_text(root, host["root"], str(state)))
        configs[kind] = str(config)
    yield configs
    # The hook keeps a compiled copy of each configuration under /run/oci-gpu-hook: gone with them.
    leftovers.remove_compiled_settings(leftovers.RUN_DIR, str(top))
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="module")
def real_names():
    """(every driver library file name, every driver SONAME) of the real tree."""
    source = drivercheck.tree()
    files = {os.path.basename(p) for p in drivercheck.library_files(source)}
    return files, files | set(drivercheck.sonames(source).values())


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    directory = tmp_path_factory.mktemp("probe")
    (directory / "probe.c").write_text(PROBE)
    subprocess.run(["gcc", "-O2", "-o", str(directory / "cuda-probe"), str(directory / "probe.c")], check=True)
    return str(directory / "cuda-probe")


def _rootfs_extras(bundle: str, debian: bool, probe: str) -> str:
    """The system libraries the driver's need, and the probe; returns the image's library dir."""
    entry = arch.current()
    libdir = (entry.multiarch if debian else entry.lib64).lstrip("/")
    rootfs = os.path.join(bundle, "rootfs")
    for name in SYSTEM_LIBRARIES:
        for directory in (entry.multiarch.replace("/usr", "", 1), entry.multiarch, "/lib64", "/usr/lib64"):
            if os.path.exists(os.path.join(directory, name)):
                shutil.copy2(os.path.realpath(os.path.join(directory, name)), os.path.join(rootfs, libdir, name))
                break
    shutil.copy2(probe, os.path.join(rootfs, "usr/bin/cuda-probe"))
    return "/" + libdir


def run_in_container(tmp_path, config, capabilities, layout, probe):
    debian = layout == "debian"
    bundle = str(tmp_path / "bundle")
    containers.make_bundle(bundle, rootfs_debian=debian, args=["true"], config_file=config,
                           env={"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": capabilities})  # fmt: skip
    libdir = _rootfs_extras(bundle, debian, probe)
    paths = " ".join(p for files in CONFIGS.values() for p in files) + " " + " ".join(VULKAN.values())
    script = (
        f"for f in {libdir}/*.so.{drivercheck.VERSION} {libdir}/vdpau/*.so.{drivercheck.VERSION}; do "
        f'[ -e "$f" ] || continue; echo "== $f"; {arch.current().loader} --list "$f" 2>&1; done; '
        f'echo "== files"; for p in {paths}; do [ -e "$p" ] && echo "present $p"; done; '
        'echo "== probe"; cuda-probe; echo "== smi"; nvidia-smi 2>&1; echo "smi-rc=$?"'
    )
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": capabilities}
    containers.write_config(bundle, args=["sh", "-c", script], config_file=config, env=env)
    return drivercheck.runc_run(bundle, f"ocigpu-real-{os.getpid()}-{layout}"), libdir


def _sections(stdout: str) -> dict:
    sections, name = {}, None
    for line in stdout.splitlines():
        if line.startswith("== "):
            name = line[3:]
            sections[name] = []
        elif name is not None:
            sections[name].append(line)
    return sections


def test_the_real_nvml_makes_its_control_node_where_it_runs_and_the_host_dev_stays(require):
    """Why everything here runs with a private /dev: NVML's init, as root and with no kernel module,
    mknods /dev/nvidiactl (char 195:255) in the /dev it sees; run where /dev is private, the node
    is made there and goes with it, and the host's /dev is as it was."""
    import hostcheck

    require("root", "unshare", "pynvml")
    library = f"{drivercheck.tree()}/{drivercheck.MULTIARCH}/nvidia/current/libnvidia-ml.so.1"
    before = hostcheck.dev_entries()
    script = f"{sys.executable} -I -m oci_gpu_hook.start.nvml {library}; ls -ln /dev/nvidiactl"
    done = drivercheck.run_with_private_dev(["sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert "Driver Not Loaded" in done.stderr, done.stderr
    assert re.fullmatch(r"crw-rw-rw- +1 0 +0 +195, +255 .* /dev/nvidiactl", done.stdout.strip()), done.stdout
    assert hostcheck.dev_changes(before, hostcheck.dev_entries()) == []


@pytest.mark.parametrize("capabilities", CAPABILITIES)
@pytest.mark.parametrize("layout", drivercheck.LAYOUTS)
def test_each_capability_gets_a_working_driver_stack(tmp_path, real, real_names, probe, layout, capabilities):
    out, libdir = run_in_container(tmp_path, real[layout], capabilities, layout, probe)
    assert out.returncode == 0, out.stderr[-3000:]
    sections = _sections(out.stdout)
    files, driver_names = real_names
    mounted = {os.path.basename(k) for k in sections if k.startswith("/")}
    assert mounted, out.stdout[-3000:]
    assert mounted <= files  # nothing invented
    for library in (k for k in sections if k.startswith("/")):
        missing = [m.group(1) for m in re.finditer(r"^\s*(\S+) => not found", "\n".join(sections[library]), re.M)]
        assert not [name for name in missing if name in driver_names], (library, missing)
    caps = driver.parse_capabilities(capabilities)  # with what each implies (video: compute)
    present = {line.split(" ", 1)[1] for line in sections["files"]}
    expected = {p for cap, paths in CONFIGS.items() if cap in caps for p in paths}
    expected |= {VULKAN[layout]} if "graphics" in caps else set()
    assert present == expected
    if "compute" in caps:
        assert sections["probe"] == ["cuDriverGetVersion 0 12040", "cuInit 100"]
        assert f"libnvidia-gpucomp.so.{drivercheck.VERSION}" in mounted
    if "utility" in caps:
        smi = "\n".join(sections["smi"])
        assert "couldn't communicate with the NVIDIA driver" in smi and "smi-rc=9" in smi, smi
    if "graphics" in caps:
        # libnvidia-glcore and -eglcore NEED libnvidia-gpucomp, which compute lists (defect 1).
        assert {f"libnvidia-glcore.so.{drivercheck.VERSION}", f"libnvidia-gpucomp.so.{drivercheck.VERSION}"} <= mounted
    if "video" in caps:
        assert f"{libdir}/vdpau/libvdpau_nvidia.so.{drivercheck.VERSION}" in sections


@pytest.mark.parametrize("layout", drivercheck.LAYOUTS)
def test_info_plan_and_cdi_list_exactly_the_real_drivers_files(tmp_path, real, real_names, layout):
    """Every library of the real driver, in any layout and through any link: none missing, none
    invented (libnvidia-api.so.1 is a library no capability lists: NVAPI, for Wine)."""
    files, _ = real_names
    expected = files - {"libnvidia-api.so.1"}
    run = containers.hook_command(real[layout])
    private = drivercheck.run_with_private_dev  # NVML runs in each of these
    info = json.loads(private(run + ["info", "--json"], capture_output=True, text=True, check=True).stdout)
    listed = {os.path.basename(f["path"]) for f in info["files"] if f["kind"] == "library"}
    assert listed == expected
    assert info["nvml"] is False and "Driver Not Loaded" in info["nvml_error"]
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "all"}
    bundle = containers.make_bundle(str(tmp_path / "b"), args=["true"], config_file=None, env=env)
    planned = private(run + ["plan", "--json", "--bundle", bundle], capture_output=True, text=True)
    assert planned.returncode == 0, planned.stderr
    binds = [op for op in json.loads(planned.stdout)["operations"] if op.get("op") == "BindMount"]
    assert {os.path.basename(op["target"]) for op in binds if ".so" in op["target"]} == expected
    spec = tmp_path / "spec.json"
    cdi = private(run + ["cdi", "generate", "--capabilities", "all", "--output", str(spec)], capture_output=True,
                  text=True)  # fmt: skip
    assert cdi.returncode == 0, cdi.stderr
    mounts = [m for d in [json.loads(spec.read_text())["containerEdits"]] for m in d.get("mounts", [])]
    assert {os.path.basename(m["containerPath"]) for m in mounts if ".so" in m["containerPath"]} == expected


def test_the_simulator_builds_the_real_drivers_libraries_with_their_needs(simulated_host, real_names):
    """The simulated 550 ships what the real 550.163.01 ships, library for library, each with the
    driver libraries it NEEDs (its stubs need nothing else but libc); docs/simulate.md says where
    the simulator differs otherwise (nvidia-debugdump, the .run layout, 32-bit copies)."""
    from oci_gpu_hook.start import elf

    host = simulated_host(gpus=1, driver_version=drivercheck.VERSION)
    files, driver_names = real_names
    simulated = {}
    for directory in ("usr/lib64", "usr/lib64/vdpau"):
        for path in glob.glob(f"{host['root']}/{directory}/lib*.so*"):
            if not os.path.islink(path):
                simulated[os.path.basename(path)] = path
    assert set(simulated) == files
    real = {os.path.basename(p): p for p in drivercheck.library_files(drivercheck.tree())}
    for name in sorted(files):
        needs = [set(n for n in elf.read_dynamic(paths[name])[1] if n in driver_names) for paths in (simulated, real)]
        assert needs[0] == needs[1], name
