"""Faults while the hook works: the host's driver files, device nodes, NVML, ldconfig, a full
filesystem in the rootfs, a device cgroup that refuses a rule, the deadline. Each must end with one
clear line, a non-zero exit and a full rollback: the container's mount table, rootfs tree and device
rules as before, the host's mount table untouched (tests/hookcheck.py).

The faults are real mechanisms (a removed file, a node with other numbers, a tmpfs out of inodes
or blocks, a read-only bind mount, a v1 devices cgroup whose parent denies the device, a procfs
file that blocks like a hung driver's), on a simulated host built for each test, since they
break it.
"""

from __future__ import annotations

import json
import os
import signal
import stat

import hookcheck
import pytest

INVENTORY, CGROUP, LDCONFIG, APPLY = 4, 9, 10, 11


@pytest.fixture
def private_host(tmp_path, require):
    """A simulated host of this test's own (the faults damage it), with its inventory cached."""
    require("root", "gcc")
    from oci_gpu_hook.start import inventory_cache, settings
    from oci_gpu_hook.toolkit.simulate import simulate

    host = simulate(str(tmp_path / "host"), gpus=2, mig=[1])
    inventory_cache.refresh(settings.load(f"{host['root']}/config.yaml"))
    return host


@pytest.fixture
def container(live_container, private_host):
    """A live container whose host is the private one."""
    state, bundle, pid, cgroup, _ = live_container({"NVIDIA_VISIBLE_DEVICES": "0,1:0"})
    return state, bundle, pid, cgroup, private_host


def config_of(host, extra: str = "") -> str:
    path = f"{host['root']}/config.yaml"
    if extra:
        with open(path, "a") as f:
            f.write(extra)
    return path


def fails_cleanly(container, code: int, words: str, config: str | None = None, in_process=None) -> str:
    """Run the hook; it must fail with one line holding words, exit code, and roll back fully."""
    state, bundle, pid, cgroup, host = container
    before = hookcheck.observe(container)
    if in_process is None:
        out = hookcheck.run_hook(config or config_of(host), state, timeout=60)
        returncode, stderr = out.returncode, out.stderr
    else:
        result = hookcheck.run_hook_in_process(config or config_of(host), state, in_process)
        returncode, stderr = result.returncode, result.stderr
    after = hookcheck.observe(container)
    line = hookcheck.one_clear_line(stderr)
    assert returncode == code, (returncode, line)
    assert words in line, line
    assert "rollback incomplete" not in line, line
    hookcheck.assert_rolled_back(before, after)
    hookcheck.assert_contained(before, after, os.path.join(bundle, "rootfs"))
    return line


def test_a_driver_library_missing(container):
    state, bundle, pid, cgroup, host = container
    os.unlink(f"{host['root']}/usr/lib64/libcuda.so.{host['driver_version']}")  # the cache still lists it
    fails_cleanly(container, APPLY, "missing on the host (run `oci-gpu-hook inventory refresh`)")


def test_a_device_node_with_the_wrong_numbers(container):
    """A node replaced after the inventory was cached: the fingerprint sees it, discovery marks it."""
    state, bundle, pid, cgroup, host = container
    node = f"{host['root']}/dev/nvidia0"
    os.unlink(node)
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(195, 77))
    fails_cleanly(container, INVENTORY, "/dev/nvidia0")


def test_a_device_node_changed_between_plan_and_apply(container, tmp_path):
    """The same, after the plan was made: apply checks each node's numbers before mounting it, and
    rolls back the devices already mounted."""
    from oci_gpu_hook.start import apply, inventory_cache, request, settings, spec
    from oci_gpu_hook.start import state as state_module
    from oci_gpu_hook.start.plan import LibraryLayout, build_plan

    state, bundle, pid, cgroup, host = container
    hook_settings = settings.load(config_of(host))
    parsed_state = state_module.parse(state.encode())
    parsed_spec = spec.load(bundle)
    plan = build_plan(request.parse_request(parsed_spec, hook_settings), inventory_cache.load(hook_settings),
                      LibraryLayout.for_rootfs(False))  # fmt: skip
    node = f"{host['root']}/dev/nvidia0"
    os.unlink(node)
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(195, 77))
    before = hookcheck.observe(container)
    with pytest.raises(apply.ApplyError) as raised:
        apply.apply(plan, parsed_state, parsed_spec, hook_settings)
    after = hookcheck.observe(container)
    assert "not char device 195:0 (the host's device node changed)" in raised.value.message
    assert not getattr(raised.value, "undo_failures", None)
    assert before.container_mounts == after.container_mounts and before.rules == after.rules
    hookcheck.assert_rolled_back(before, after)


def _remove_nvml(host):
    for name in os.listdir(f"{host['root']}/usr/lib64"):
        if name.startswith("libnvidia-ml.so"):
            os.unlink(f"{host['root']}/usr/lib64/{name}")


def test_nvml_missing(container, hook_cli):
    """No libnvidia-ml: `inventory refresh` says so in the inventory (nvml: false), and the hook
    still configures the container from procfs and the device nodes."""
    state, bundle, pid, cgroup, host = container
    _remove_nvml(host)
    out = hook_cli("--config", config_of(host), "inventory", "refresh")
    assert out.returncode == 0, out.stderr
    info = hook_cli("--config", config_of(host), "info", "--json")
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["nvml"] is False
    out = hookcheck.run_hook(config_of(host), state)
    assert out.returncode == 0, out.stderr
    assert "c 195:0 rw" in hookcheck.device_rules(cgroup)


def test_nvml_failing(container, hook_cli):
    """A libnvidia-ml that cannot be loaded (as after a driver upgrade without a reboot, or with no
    kernel module: NVML answers with an error). What procfs and the device nodes say does not wait
    for NVML (issue 26): `inventory refresh` writes the cache and warns with one line naming NVML
    and what to do; the hook (no cache) gives the container its GPUs; doctor says what is missing."""
    state, bundle, pid, cgroup, host = container
    library = f"{host['root']}/usr/lib64/libnvidia-ml.so.{host['driver_version']}"
    with open(library, "wb") as f:
        f.write(b"\x7fELF, but not really\n")
    out = hook_cli("--config", config_of(host), "inventory", "refresh")
    assert out.returncode == 0, out.stderr
    warning = hookcheck.one_clear_line(out.stderr)
    assert warning.startswith("oci-gpu-hook: warning: NVML"), warning
    assert "MIG UUIDs are unknown until NVML answers" in warning, warning
    doctor = hook_cli("--config", config_of(host), "doctor")
    (line,) = [li for li in doctor.stdout.splitlines() if "inventory-cache" in li]
    assert line.startswith("WARN") and "built while NVML failed" in line, line
    os.unlink(f"{host['root']}/inventory-cache.json")
    done = hookcheck.run_hook(config_of(host), state, timeout=60)
    assert done.returncode == 0, done.stderr
    with open(f"/proc/{pid}/mountinfo") as f:
        assert "/dev/nvidia0 " in f.read()


def test_ldconfig_failing_on_a_read_only_etc(container):
    state, bundle, pid, cgroup, host = container
    etc = os.path.join(bundle, "rootfs/etc")
    # OpenCL's ICD file (compute's) goes under /etc too: there already, it is mounted over, and
    # only the ld cache, which must be written, meets the read-only /etc.
    os.makedirs(os.path.join(etc, "OpenCL/vendors"))
    open(os.path.join(etc, "OpenCL/vendors/nvidia.icd"), "w").close()
    hookcheck.in_container(pid, "mount", "--bind", etc, etc)
    hookcheck.in_container(pid, "mount", "-o", "remount,bind,ro", etc)
    fails_cleanly(container, LDCONFIG, "cannot install /etc/ld.so.cache in the container: Read-only file system")


def test_no_ldconfig_on_the_host(container, monkeypatch, capsys):
    from oci_gpu_hook.start.linux import ldconfig

    monkeypatch.setattr(ldconfig, "LDCONFIG_PATHS", ("/nonexistent/ldconfig",))
    fails_cleanly(container, LDCONFIG, "the host has no ldconfig", in_process=capsys)


def fill_a_tmpfs_over(container, directory: str, options: str, fill: str) -> None:
    """A full filesystem at the rootfs' directory, in the container's mount namespace: a tmpfs of
    `options` mounted over it, then filled by the shell command fill ($1: the directory)."""
    state, bundle, pid, cgroup, host = container
    path = os.path.join(bundle, "rootfs", directory)
    hookcheck.in_container(pid, "mount", "-t", "tmpfs", "-o", options, "tmpfs", path)
    hookcheck.in_container(pid, "sh", "-c", fill, "sh", path)


def test_library_directory_out_of_inodes(container):
    """A full filesystem at the library directory: no room for the empty files mounts need."""
    every_inode = 'i=0; while touch "$1/fill$i" 2>/dev/null; do i=$((i+1)); done'
    fill_a_tmpfs_over(container, "usr/lib64", "size=64k,nr_inodes=16", every_inode)
    fails_cleanly(container, APPLY, "No space left on device")


def test_etc_out_of_space_for_the_ld_cache(container):
    """A full /etc: every mount is made, then the new ld.so.cache does not fit; all is undone."""
    fill_a_tmpfs_over(container, "etc", "size=8k", 'cat /dev/zero > "$1/fill" 2>/dev/null; true')
    fails_cleanly(container, LDCONFIG, "cannot install /etc/ld.so.cache in the container: No space left on device")


def test_device_cgroup_refuses_the_rule(container):
    """The container's v1 devices cgroup lies below one that denies everything: writing the allow
    rule fails (EPERM); the device mounted before it is unmounted again."""
    state, bundle, pid, cgroup, host = container
    child = os.path.join(cgroup, "inner")
    os.mkdir(child)
    try:
        with open(os.path.join(child, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        line = fails_cleanly((state, bundle, pid, child, host), CGROUP, "devices.allow")
        assert "Operation not permitted" in line
    finally:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        os.rmdir(child)


def test_deadline_passing_mid_way(container, tmp_path, monkeypatch, capsys, require):
    """A step that hangs (here ldconfig, the last one, so every mount and the /proc/driver/nvidia
    tmpfs are already made): the deadline (1 s) fires and everything is rolled back.
    (Host sources are checked to be regular files, so a FIFO can no longer stand in for a hung
    driver file; a hung program can.)"""
    require("gcc")
    import subprocess

    from oci_gpu_hook.start.linux import ldconfig

    state, bundle, pid, cgroup, host = container
    os.makedirs(os.path.join(bundle, "rootfs/proc/driver/nvidia"))  # a procfs with the driver's directory
    source = tmp_path / "hang.c"
    source.write_text("#include <unistd.h>\nint main(void) { sleep(30); return 0; }\n")
    hang = tmp_path / "ldconfig"
    subprocess.run(["gcc", "-static", "-o", str(hang), str(source)], check=True)
    monkeypatch.setattr(ldconfig, "LDCONFIG_PATHS", (str(hang),))
    config = config_of(host, "deadline_seconds: 1\n")
    fails_cleanly(container, APPLY, "deadline passed", config=config, in_process=capsys)


def test_the_deadline_between_a_mount_and_its_undo_record(container, monkeypatch, capsys):
    """SIGALRM raised right after a mount(2) returns, before its undo is recorded: held back until
    the record is made, so the rollback still unmounts it."""
    from oci_gpu_hook.start.linux import _linux

    real_mount = _linux.mount
    fired = []

    def mount_then_alarm(source, target, fstype, flags, data=None):
        real_mount(source, target, fstype, flags, data)
        if flags & _linux.MS_BIND and not flags & _linux.MS_REMOUNT and not fired:
            fired.append(target)
            os.kill(os.getpid(), signal.SIGALRM)  # the deadline, at the worst moment

    monkeypatch.setattr(_linux, "mount", mount_then_alarm)
    fails_cleanly(container, APPLY, "deadline passed", in_process=capsys)
