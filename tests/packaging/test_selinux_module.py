"""The oci_gpu_hook SELinux module, compiled and linked into a throw-away copy of Debian's policy,
then queried with setools: gpu_container_t is container_t plus the GPU devices, and nothing else."""

import os
import re
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


def test_start_server_domain_may_tell_systemd_of_a_scope(pk, policy_build, tmp_path):
    """The start server (install --start-server) runs where systemd puts a program with no domain
    of its own: install's program under /usr/local/libexec is usr_t, and refpolicy has no
    transition from init_t for usr_t, so on Debian the server and its workers are init_t (the node
    VM's start_server scenario saw that). A worker tells systemd the GPU nodes of the container's
    scope (SetUnitProperties), which systemd checks as system:start on its own label (a transient
    unit has none): the runtime's unconfined_t has it, Debian's init_t not, and systemd refused
    every served start's DeviceAllow= (a daemon-reload would then take the GPU away). The module
    adds that one permission to init_t, and nothing else on it."""
    base, gpu = policy_build["base_policy"], policy_build["gpu_policy"]
    assert "start" in sesearch_perms(base, "unconfined_t", "init_t", "system")  # the runtime's domain
    before = sesearch_perms(base, "init_t", "init_t", "system")
    assert "start" not in before
    assert sesearch_perms(gpu, "init_t", "init_t", "system") - before == {"start"}
    cil = pk.module_cil(policy_build["module"], str(tmp_path))
    assert re.findall(r"\(allow init_t [^\n]*", cil) == ["(allow init_t init_t (system (start)))"]


def test_module_labels_no_host_files(pk):
    with open(os.path.join(pk.selinux_dir, f"{pk.module}.fc")) as f:
        entries = [line for line in f if line.strip() and not line.lstrip().startswith("#")]
    assert entries == []


def cil_perms(cil, source, target, tclass):
    """Permissions the module's CIL allows source on target:tclass (every rule that names them)."""
    found = set()
    for perms in re.findall(rf"\(allow {source} {target} \({tclass} \(([^)]*)\)\)\)", cil):
        found.update(perms.split())
    return found


def test_module_compiles_against_rhel_targeted_policy_with_container_selinux(pk, rhel_headers, tmp_path):
    """The RHEL/Fedora branch of the .te against the real thing: Fedora's targeted policy headers
    with container-selinux's interfaces (../shared/tools/selinux-rhel), compiled with their own
    Makefile as RHEL's selinux-policy-devel does. Its container_domain_template requires only the
    types of container.te itself, so a module that does not require container_file_t first fails
    there (`unknown type container_file_t`), whatever a stand-in header says."""
    makefile = os.path.join(rhel_headers, "Makefile")
    module = pk.build_module(
        pk.selinux_dir, str(tmp_path / "build"), pk.module, rhel_headers, makefile, ("NAME=refpolicy",)
    )
    cil = pk.module_cil(module, str(tmp_path))
    # the RHEL branch was taken: container-selinux attributes, none of Debian's
    assert "(typeattributeset svirt_sandbox_domain (gpu_container_t ))" in cil
    assert "(typeattributeset container_net_domain (gpu_container_t ))" in cil
    assert "container_system_domain" not in cil
    assert cil_perms(cil, DOMAIN, "container_file_t", "file") >= {"entrypoint", "read", "execute"}
    assert {"open", "read", "write", "ioctl", "map"} <= cil_perms(cil, DOMAIN, GPU_DEVICE, "chr_file")
    for target in DRIVER_FILE_TYPES:  # read and execute at most, as on Debian
        assert not cil_perms(cil, DOMAIN, target, "file") & MODIFY_PERMS, target
    # the domain is declared here, MCS-constrained, and nothing is said of container_t
    assert "(type gpu_container_t)" in cil
    assert "(typeattributeset mcs_constrained_type (gpu_container_t ))" in cil
    assert not re.search(r"\(allow container_t ", cil)
    # the start server's rule is Debian's alone: Fedora's init_t has every system permission on itself
    assert not re.search(r"\(allow init_t ", cil)


def test_hook_domain_runs_ldconfig_in_its_own_domain(policy_build):
    """The hook runs the host's ldconfig with no_new_privs, asking for its own domain first
    (ldconfig._stay_in_own_domain) instead of the default transition to ldconfig_t, which
    no_new_privs refuses with a denial. On Debian the hook runs in unconfined_t (runc started from
    an administrator's shell stays there): that domain has the default transition, and it is
    allowed exactly what the hook does instead (setexec, and execute_no_trans of ldconfig). The
    module adds no way around no_new_privs to ldconfig_t."""
    policy = policy_build["gpu_policy"]
    transitions = subprocess.run(
        ["sesearch", "-T", "-s", "unconfined_t", "-t", "ldconfig_exec_t", "-c", "process", policy],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "ldconfig_t" in transitions
    assert "setexec" in sesearch_perms(policy, "unconfined_t", "unconfined_t", "process")
    assert {"execute", "execute_no_trans"} <= sesearch_perms(policy, "unconfined_t", "ldconfig_exec_t", "file")
    assert not sesearch_perms(policy, "unconfined_t", "ldconfig_t", "process2")
    assert not sesearch_perms(policy, "container_engine_t", "ldconfig_t", "process2")
    nnp = [
        subprocess.run(
            ["sesearch", "-A", "-t", "ldconfig_t", "-c", "process2", searched],
            capture_output=True,
            text=True,
            check=True,
        ).stdout  # fmt: skip
        for searched in (policy, policy_build["base_policy"])
    ]
    assert nnp[0] == nnp[1]  # the module adds none (init_t has its own, from the base policy)
