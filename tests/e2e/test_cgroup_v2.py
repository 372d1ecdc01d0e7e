"""cgroup v2 through the hook: a container whose cgroup filters devices with an eBPF program (as
runc does on v2 hosts) gets its GPU allowed, and a failing hook leaves the original program.

This host is hybrid, so the container is put in a fresh cgroup under /sys/fs/cgroup/unified and
the configuration says `cgroups: v2`; opening a char node of major 195 (no driver here) gives
ENXIO when the cgroup allows it and EPERM when it denies it.
"""

import io
import json
import os
import subprocess
import sys
import time

import pytest
from hookcheck import config_with, remove_cgroup

from oci_gpu_hook.errors import HookError
from oci_gpu_hook.start import prestart
from oci_gpu_hook.start.linux import bpf
from oci_gpu_hook.toolkit import containers

UNIFIED = "/sys/fs/cgroup/unified"
DENY_ALL = [bpf.mov64_imm(bpf.R0, 0), bpf.exit_insn()]

# The container (run under unshare --mount): makes its rootfs a mount point (as runc does), moves
# itself into its cgroup, says so, waits for the hook, then opens two device nodes in its rootfs
# and prints the errno names.
OPENER = r"""
import errno, os, subprocess, sys
cgroup, rootfs, *nodes = sys.argv[1:]
subprocess.run(["mount", "--bind", rootfs, rootfs], check=True)
with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
print("ready", flush=True)
for line in sys.stdin:
    result = []
    for node in nodes:
        try:
            os.close(os.open(os.path.join(rootfs, node.lstrip("/")), os.O_RDONLY))
            result.append("OK")
        except OSError as e:
            result.append(errno.errorcode[e.errno])
    print(" ".join(result), flush=True)
"""


def attach_deny_all(cgroup):
    prog = bpf.load_program(b"".join(i.encode() for i in DENY_ALL))
    fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        bpf.attach_program(fd, prog, 2)  # BPF_F_ALLOW_MULTI, as runc attaches
        return bpf.query_programs(fd)[1]
    finally:
        os.close(fd)
        os.close(prog)


def programs(cgroup):
    fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return bpf.query_programs(fd)[1]
    finally:
        os.close(fd)


@pytest.fixture
def container(tmp_path, simulated_host, require):
    require("root", "unshare", "busybox", "gcc")
    if not os.path.isdir(UNIFIED):
        pytest.fail(f"cgroup2 is not mounted at {UNIFIED}")
    host = simulated_host(gpus=2)
    cgroup = os.path.join(UNIFIED, f"ocigpu-v2-{os.getpid()}-{time.monotonic_ns()}")
    os.mkdir(cgroup)
    proc = None
    try:  # whatever fails from here, the cgroup (and its program) goes
        original = attach_deny_all(cgroup)
        bundle = containers.make_bundle(
            str(tmp_path / "bundle"), args=["true"], env={"NVIDIA_VISIBLE_DEVICES": "0"}, config_file=None
        )
        config = config_with(host, tmp_path, "cgroups: v2\n")
        gpu0 = f"/dev/nvidia{host['gpus'][0]['minor']}"
        # Nodes made by hand inside the rootfs: one with GPU 0's numbers (what the device program says
        # of the requested GPU, whether or not the hook's mount is there) and one of a GPU not asked for.
        for name, gpu in (("nvidia-same", 0), ("nvidia-other", 1)):
            node = os.path.join(bundle, "rootfs", "dev", name)
            os.mknod(node, 0o20666, os.makedev(195, host["gpus"][gpu]["minor"]))
        script = tmp_path / "opener.py"
        script.write_text(OPENER)
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", sys.executable, "-I", str(script), cgroup,
             os.path.join(bundle, "rootfs"), gpu0, "/dev/nvidia-same", "/dev/nvidia-other"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stdout.readline().strip() == "ready"
        state = json.dumps({"ociVersion": "1.0.2", "id": "v2", "status": "creating", "pid": proc.pid,
                            "bundle": bundle})  # fmt: skip

        def probe():
            proc.stdin.write("go\n")
            proc.stdin.flush()
            return proc.stdout.readline().split()

        yield state, config, cgroup, original, probe
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        remove_cgroup(cgroup)


def test_hook_allows_the_gpu_in_a_v2_device_program(container):
    state, config, cgroup, original, probe = container
    assert probe() == ["ENOENT", "EPERM", "EPERM"]  # no GPU node yet; the deny-all program is enforced
    assert prestart.run(config, stdin=io.BytesIO(state.encode())) == 0
    # the requested GPU reaches the (absent) driver: allowed; the other GPU is still denied
    assert probe() == ["ENXIO", "ENXIO", "EPERM"]
    assert len(programs(cgroup)) == len(original) and programs(cgroup) != original


def test_failed_hook_leaves_the_original_program(container, monkeypatch):
    state, config, cgroup, original, probe = container
    from oci_gpu_hook.start import plan as plan_module

    real = plan_module.build_plan

    def plan_failing_after_device_rules(*args):
        built = real(*args)
        rules = [i for i, op in enumerate(built.operations, 1) if isinstance(op, plan_module.DeviceRule)]
        monkeypatch.setenv("OCI_GPU_HOOK_FAULT_AT", str(rules[-1] + 1))
        return built

    monkeypatch.setattr("oci_gpu_hook.start.plan.build_plan", plan_failing_after_device_rules)
    with pytest.raises(HookError, match="injected fault"):
        prestart.run(config, stdin=io.BytesIO(state.encode()))
    assert programs(cgroup) == original
    assert probe() == ["ENOENT", "EPERM", "EPERM"]  # the mount is gone and the GPU denied again


def test_what_every_process_of_the_hook_imports_on_v2(container, tmp_path):
    """The start path's import rule on a v2 cgroup: the apply child loads bpf.py and nothing that
    the start path avoids (test_start_path_imports.py holds the rule and the v1 run)."""
    from test_start_path_imports import FORBIDDEN, loaded_by_every_process

    state, config, cgroup, original, probe = container
    # Warm caches first, as on a node that has run a GPU container: the inventory cache and the
    # compiled settings (a cold start may load json and NVML's child by design). Only the hook
    # keeps compiled settings, so they are made as its first start makes them.
    out = subprocess.run([*containers.hook_command(config), "inventory", "refresh"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    warm = "import sys; from oci_gpu_hook.start import settings; settings.load(sys.argv[1], cache=True)"
    out = subprocess.run([sys.executable, "-I", "-c", warm, config], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    modules = loaded_by_every_process(["--config", config, "prestart"], state, str(tmp_path / "imports"))
    assert not {m.split(".")[0] for m in modules} & FORBIDDEN, modules
    assert "oci_gpu_hook.start.linux.bpf" in modules  # it took the v2 path
    assert probe() == ["ENXIO", "ENXIO", "EPERM"]
