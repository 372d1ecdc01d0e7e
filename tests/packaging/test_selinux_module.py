"""The oci_gpu_hook SELinux module, compiled and linked into a throw-away copy of Debian's policy,
then queried with setools: gpu_container_t is container_t plus the GPU devices, and nothing else."""

import os
import re
import shutil
import subprocess

DOMAIN = "gpu_container_t"
GPU_DEVICE = "xserver_misc_device_t"
DEVICE_PERMS = {"open", "read", "write", "ioctl", "map", "getattr", "append", "lock"}
DRIVER_FILE_TYPES = ("lib_t", "textrel_shlib_t", "ld_so_t", "bin_t", "xserver_exec_t")
# What reading and executing a file may take; anything else on a driver file type would be a change.
READ_EXEC_PERMS = {
    "getattr",
    "open",
    "read",
    "map",
    "execute",
    "execute_no_trans",
    "ioctl",
    "lock",
    "search",
    "execmod",
}
MODIFY_PERMS = {
    "write",
    "append",
    "unlink",
    "rename",
    "setattr",
    "relabelfrom",
    "relabelto",
    "create",
    "link",
    "add_name",
    "remove_name",
    "reparent",
    "rmdir",
    "mounton",
}


def sesearch_perms(policy, source, target, tclass):
    """Permissions sesearch lists for source -> target:tclass (unconditional and conditional)."""
    out = subprocess.run(
        ["sesearch", "-A", "-s", source, "-t", target, "-c", tclass, policy], capture_output=True, text=True, check=True
    ).stdout
    perms = set()
    for line in out.splitlines():
        m = re.search(r":\s*\S+\s+(\{[^}]*\}|\S+);", line)
        if m:
            perms.update(m.group(1).strip("{} ").split())
    return perms


def by_target(rules):
    found = {}
    for target, tclass, perm, _cond in rules:
        found.setdefault((target, tclass), set()).add(perm)
    return found


def peer_normalized(rules, peer):
    """Rules with the other domain of the pair renamed PEER, so the two sets compare rule for rule."""
    return {("PEER" if target == peer else target, tclass, perm, cond) for target, tclass, perm, cond in rules}


def test_gpu_domain_uses_nvidia_device_nodes(policy_build):
    perms = sesearch_perms(policy_build["gpu_policy"], DOMAIN, GPU_DEVICE, "chr_file")
    assert {"open", "read", "write", "ioctl", "map"} <= perms, perms


def test_stock_container_t_cannot_use_nvidia_device_nodes(policy_build):
    # The boolean path (container_use_devices) is the alternative; unconditionally it is denied.
    assert not sesearch_perms(policy_build["base_policy"], "container_t", GPU_DEVICE, "chr_file")


def test_gpu_domain_reads_and_executes_driver_files(rules):
    allowed = by_target(r for r in rules["gpu_container_t"] if not r[3])
    for target in ("lib_t", "textrel_shlib_t"):
        assert {"open", "read", "getattr", "map", "execute"} <= allowed.get((target, "file"), set()), target
    for target in ("bin_t", "xserver_exec_t"):
        assert {"open", "read", "getattr", "execute", "execute_no_trans"} <= allowed.get((target, "file"), set()), (
            target
        )


def test_gpu_domain_cannot_modify_driver_files(rules):
    allowed = by_target(rules["gpu_container_t"])  # booleans included: no setting may allow it either
    for target in DRIVER_FILE_TYPES:
        for tclass in ("file", "lnk_file", "dir"):
            bad = allowed.get((target, tclass), set()) & MODIFY_PERMS
            assert not bad, f"{DOMAIN} may {sorted(bad)} {target}:{tclass}"


def test_gpu_domain_uses_no_other_device_type(policy_build, rules):
    devices = subprocess.run(
        ["seinfo", "-a", "device_node", "-x", policy_build["gpu_policy"]], capture_output=True, text=True, check=True
    ).stdout.split()[1:]
    assert GPU_DEVICE in devices and len(devices) > 20
    gpu = by_target(rules["gpu_container_t"])
    stock = by_target(rules["container_t"])
    for device in devices:
        if device == GPU_DEVICE:
            continue
        for tclass in ("chr_file", "blk_file"):
            extra = gpu.get((device, tclass), set()) - stock.get((device, tclass), set())
            assert not extra, f"{DOMAIN} gained {sorted(extra)} on {device}:{tclass}"


def test_gpu_domain_is_container_t_plus_gpu_devices_only(rules):
    gpu = peer_normalized(rules["gpu_container_t"], "container_t")
    stock = peer_normalized(rules["container_t"], DOMAIN)
    missing = stock - gpu
    assert not missing, f"container_t may do what {DOMAIN} may not: {sorted(missing)[:20]}"
    for target, tclass, perm, cond in sorted(gpu - stock):
        if target == GPU_DEVICE and tclass == "chr_file":
            assert perm in DEVICE_PERMS and not cond, (target, tclass, perm, cond)
        else:
            assert target in DRIVER_FILE_TYPES and perm in READ_EXEC_PERMS and not cond, (target, tclass, perm, cond)


def test_stock_container_t_gains_nothing(rules):
    gained = rules["container_t"] - rules["base_container_t"]
    assert not gained, sorted(gained)[:20]
    assert rules["container_t"] == rules["base_container_t"]


def test_container_engine_may_start_gpu_containers(policy_build):
    policy = policy_build["gpu_policy"]
    assert "transition" in sesearch_perms(policy, "container_engine_t", DOMAIN, "process")
    assert {"nnp_transition", "nosuid_transition"} <= sesearch_perms(policy, "container_engine_t", DOMAIN, "process2")
    # the container's first program comes from its image, labelled container_file_t
    assert "entrypoint" in sesearch_perms(policy, DOMAIN, "container_file_t", "file")


def test_gpu_domain_is_mcs_constrained_and_in_system_r(policy_build):
    policy = policy_build["gpu_policy"]
    constrained = subprocess.run(
        ["seinfo", "-a", "mcs_constrained_type", "-x", policy], capture_output=True, text=True, check=True
    ).stdout.split()
    assert DOMAIN in constrained and "container_t" in constrained
    roles = subprocess.run(
        ["seinfo", "-r", "system_r", "-x", policy], capture_output=True, text=True, check=True
    ).stdout.split()
    assert DOMAIN in roles


def test_module_labels_no_host_files(pk):
    with open(os.path.join(pk.selinux_dir, f"{pk.module}.fc")) as f:
        entries = [line for line in f if line.strip() and not line.lstrip().startswith("#")]
    assert entries == []


def test_module_compiles_against_rhel_two_argument_template(pk, policy_build):
    """The RHEL/Fedora branch of the .te, compiled with container-selinux-shaped headers (a stand-in
    container.if with the two-argument template), checked to be the branch that was taken."""
    work = os.path.join(policy_build["work"], "rhel")
    headers = os.path.join(work, "include")
    shutil.copytree(pk.devel_include, headers, copy_function=os.symlink)
    os.unlink(os.path.join(headers, "services", "container.if"))
    shutil.copy(os.path.join(pk.here, "rhel_headers", "container.if"), os.path.join(headers, "services"))
    build = os.path.join(work, "build")
    pk.build_module(pk.selinux_dir, build, pk.module, headerdir=headers)
    with open(os.path.join(build, "tmp", f"{pk.module}.tmp")) as f:
        expanded = f.read()
    assert "svirt_sandbox_domain" in expanded and "virt_sandbox_use_sys_admin" in expanded
    assert "container_system_domain" not in expanded
