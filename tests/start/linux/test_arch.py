"""oci_gpu_hook/start/linux/arch.py: the x86_64 and aarch64 tables (system call numbers, library layouts), the
source check the RPM's %check runs, and the one line an unknown machine gets at a GPU start."""

import ast
import json
import os
import re

import hookcheck
import pytest

import oci_gpu_hook
from oci_gpu_hook.errors import Exit, PrerequisiteError
from oci_gpu_hook.start import plan, request, spec
from oci_gpu_hook.start.inventory import DeviceNode, DriverFile, Inventory
from oci_gpu_hook.start.linux import _linux, arch
from oci_gpu_hook.start.settings import Settings
from oci_gpu_hook.toolkit import containers

PACKAGE = os.path.dirname(os.path.abspath(oci_gpu_hook.__file__))
REPO = os.path.dirname(PACKAGE)
LINUX = os.path.join("start", "linux", "_linux.py")

# From the kernel: arch/x86/entry/syscalls/syscall_64.tbl, and for aarch64 the generic table
# include/uapi/asm-generic/unistd.h (arch/arm64 has no table of its own for 64-bit tasks).
KERNEL = {
    "x86_64": {"pivot_root": 155, "bpf": 321, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
               "fsmount": 432, "pidfd_open": 434, "openat2": 437, "mount_setattr": 442, "timer_create": 222,
               "timer_settime": 223, "timer_delete": 226},
    "aarch64": {"pivot_root": 41, "bpf": 280, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
                "fsmount": 432, "pidfd_open": 434, "openat2": 437, "mount_setattr": 442, "timer_create": 107,
                "timer_settime": 110, "timer_delete": 111},
}  # fmt: skip

# Where the kernel's uapi headers (linux-libc-dev, kernel-headers) keep the same numbers.
HEADERS = {
    "x86_64": ("/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "/usr/include/asm/unistd_64.h"),
    "aarch64": ("/usr/include/asm-generic/unistd.h",),
}


def test_both_tables_hold_the_kernels_numbers():
    assert set(arch.ARCHITECTURES) == set(KERNEL)
    for machine, numbers in KERNEL.items():
        assert arch.ARCHITECTURES[machine].syscalls == numbers, machine
        assert set(numbers) == set(arch.SYSCALL_NAMES)


@pytest.mark.parametrize("machine", sorted(HEADERS))
def test_numbers_agree_with_the_installed_kernel_headers(machine):
    found = [path for path in HEADERS[machine] if os.path.exists(path)]
    if not found:
        message = f"no {machine} uapi header here ({', '.join(HEADERS[machine])})"
        # This machine's own header comes with gcc (libc6-dev, linux-libc-dev): a missing
        # prerequisite, which CI must not skip. Another architecture's is seldom installed.
        if machine == os.uname().machine and os.environ.get("OCI_GPU_HOOK_REQUIRE_ALL") == "1":
            pytest.fail(message + " (OCI_GPU_HOOK_REQUIRE_ALL=1)", pytrace=False)
        pytest.skip(message)
    with open(found[0]) as f:
        defined = {name: int(nr) for name, nr in re.findall(r"^#define __NR_(\w+)\s+(\d+)\s*$", f.read(), re.M)}
    assert {name: defined.get(name) for name in arch.SYSCALL_NAMES} == arch.ARCHITECTURES[machine].syscalls


def test_layouts():
    layout = plan.LibraryLayout.for_rootfs
    assert layout(True, "x86_64") == plan.LibraryLayout("/usr/lib/x86_64-linux-gnu", "/usr/lib/i386-linux-gnu")
    assert layout(False, "x86_64") == plan.LibraryLayout("/usr/lib64", "/usr/lib")
    assert layout(True, "aarch64") == plan.LibraryLayout("/usr/lib/aarch64-linux-gnu", None)
    assert layout(False, "aarch64") == plan.LibraryLayout("/usr/lib64", None)
    assert arch.ARCHITECTURES["aarch64"].loader == "/lib/ld-linux-aarch64.so.1"
    assert arch.ARCHITECTURES["x86_64"].loader == "/lib64/ld-linux-x86-64.so.2"
    # The default is this machine's entry.
    assert layout(True) == layout(True, os.uname().machine)


def _inventory() -> Inventory:
    node = DeviceNode("/dev/nvidiactl", 195, 255)
    files = (
        DriverFile("compute", "library", "/usr/lib64/libcuda.so.550.54.15", "libcuda.so.1"),
        DriverFile("compute", "library32", "/usr/lib/libcuda.so.550.54.15", "libcuda.so.1"),
    )
    controls = {"nvidiactl": node, "nvidia-uvm": DeviceNode("/dev/nvidia-uvm", 511, 0),
                "nvidia-uvm-tools": DeviceNode("/dev/nvidia-uvm-tools", 511, 1)}  # fmt: skip
    return Inventory("550.54.15", "12.4", False, "/", "/", "/", {"nvidia-frontend": 195}, (), controls, {}, files)


@pytest.mark.parametrize("debian", [True, False])
def test_aarch64_plan_places_no_32bit_library(debian):
    env = {"NVIDIA_VISIBLE_DEVICES": "none", "NVIDIA_DRIVER_CAPABILITIES": "compute,compat32"}
    container = spec.Spec("/r", env, frozenset({"CAP_SYS_ADMIN"}), (), {}, None)
    gpu_request = request.parse_request(container, Settings())
    assert "compat32" in gpu_request.capabilities

    def libraries(machine):
        built = plan.build_plan(gpu_request, _inventory(), plan.LibraryLayout.for_rootfs(debian, machine))
        refresh = [op for op in built.operations if isinstance(op, plan.RefreshLdcache)]
        libs = {op.source for op in built.operations if isinstance(op, plan.BindMount) and "libcuda" in op.source}
        return libs, refresh[0].directories

    sources, directories = libraries("x86_64")
    assert sources == {"/usr/lib64/libcuda.so.550.54.15", "/usr/lib/libcuda.so.550.54.15"} and len(directories) == 2
    sources, directories = libraries("aarch64")
    assert sources == {"/usr/lib64/libcuda.so.550.54.15"}
    assert directories == (("/usr/lib/aarch64-linux-gnu",) if debian else ("/usr/lib64",))


def test_unknown_machine_is_one_clear_line():
    with pytest.raises(arch.UnsupportedArchitecture) as caught:
        plan.LibraryLayout.for_rootfs(True, "riscv64")
    error = caught.value
    assert isinstance(error, PrerequisiteError) and error.exit_code == Exit.PREREQUISITE
    assert "\n" not in error.message
    assert "'riscv64'" in error.message and "x86_64 and aarch64" in error.message


def test_unknown_machine_stops_every_syscall_number(monkeypatch):
    monkeypatch.setattr(arch, "MACHINE", "ppc64le")
    for name in arch.SYSCALL_NAMES:
        with pytest.raises(arch.UnsupportedArchitecture, match="'ppc64le'"):
            _linux._nr(name)
    with pytest.raises(arch.UnsupportedArchitecture):
        plan.LibraryLayout.for_rootfs(False)


def _run_prestart(tmp_path, capsys, env):
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    containers.write_config(str(bundle), args=["true"], env=env, config_file=None)
    config = tmp_path / "config.yaml"
    config.write_text(f"logging:\n  file: {tmp_path / 'hook.log'}\n  syslog: false\n")
    state = json.dumps({"ociVersion": "1.0.2", "id": "arch", "status": "creating", "pid": os.getpid(),
                        "bundle": str(bundle)})  # fmt: skip
    return hookcheck.run_hook_in_process(str(config), state, capsys)


def test_unknown_machine_fails_a_gpu_start_with_one_line(tmp_path, capsys, monkeypatch):
    """hook.main, in-process, as on a riscv64 host: one 'oci-gpu-hook: ' line, exit 7, before
    the rootfs or the cgroup is touched. The inventory is stubbed: this host has no driver."""
    from oci_gpu_hook.start import inventory_cache

    monkeypatch.setattr(arch, "MACHINE", "riscv64")
    monkeypatch.setattr(inventory_cache, "load", lambda *args, **kwargs: _inventory())
    result = _run_prestart(tmp_path, capsys, {"NVIDIA_VISIBLE_DEVICES": "all"})
    line = hookcheck.one_clear_line(result.stderr)
    assert result.returncode == Exit.PREREQUISITE, line
    assert line.startswith("oci-gpu-hook: unsupported architecture 'riscv64': "), line
    assert os.listdir(tmp_path / "bundle" / "rootfs") == []


def test_unknown_machine_leaves_other_containers_alone(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(arch, "MACHINE", "riscv64")
    result = _run_prestart(tmp_path, capsys, {"PATH": "/bin"})
    assert (result.returncode, result.stderr) == (0, "")


# --- what the RPM's %check proves, and that it would catch a gap -----------------------------------


def test_verify_passes():
    arch.verify()


def test_verify_catches_a_missing_number(monkeypatch):
    numbers = dict(arch.ARCHITECTURES["aarch64"].syscalls)
    del numbers["bpf"]
    monkeypatch.setitem(arch.ARCHITECTURES, "aarch64", arch.ARCHITECTURES["aarch64"].replace(syscalls=numbers))
    with pytest.raises(AssertionError, match="aarch64"):
        arch.verify()


def test_verify_catches_a_name_missing_from_the_list(monkeypatch):
    monkeypatch.setattr(arch, "SYSCALL_NAMES", tuple(n for n in arch.SYSCALL_NAMES if n != "openat2"))
    with pytest.raises(AssertionError):
        arch.verify()


def _calls(path):
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def test_every_syscall_in_the_package_takes_its_number_from_the_table():
    """No module but _linux.py calls syscall(2), and each of its calls is syscall(_nr("<a name in
    SYSCALL_NAMES>"), ...): no number is written anywhere else."""
    used = set()
    for directory, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            where = os.path.relpath(path, PACKAGE)
            for call in _calls(path):
                func = call.func
                if isinstance(func, ast.Attribute) and func.attr == "syscall":
                    assert where == LINUX, f"{where}:{call.lineno}: syscall() outside _linux.py"
                    first = call.args[0]
                    assert isinstance(first, ast.Call) and getattr(first.func, "id", None) == "_nr", call.lineno
                elif isinstance(func, ast.Name) and func.id == "_nr":
                    assert where == LINUX, f"{where}:{call.lineno}"
                    (arg,) = call.args
                    assert isinstance(arg, ast.Constant) and arg.value in arch.SYSCALL_NAMES, call.lineno
                    used.add(arg.value)
    assert used == set(arch.SYSCALL_NAMES)


def test_the_rpm_check_runs_verify():
    with open(os.path.join(REPO, "rpm", "oci-gpu-hook.spec")) as f:
        text = f.read()
    check = text.split("\n%check\n", 1)[1].split("\n%", 1)[0]
    assert "from oci_gpu_hook.start.linux import arch; arch.verify()" in check
    assert "BuildArch:      noarch" in text
