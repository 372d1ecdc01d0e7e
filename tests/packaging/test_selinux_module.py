"""The oci_gpu_hook SELinux module, compiled and linked into a throw-away copy of Debian's policy,
then queried with setools: gpu_container_t is container_t plus the GPU devices, and nothing else."""

import os
import re
import subprocess

DOMAIN = "gpu_container_t"
GPU_DEVICE = "xserver_misc_device_t"
DEVICE_PERMS = {"open", "read", "write", "ioctl", "map", "getattr", "append", "lock"}
# The start server's domain and the type of its launcher, its entry point.
START_DOMAIN = "oci_gpu_hook_start_t"
START_EXEC = "oci_gpu_hook_start_exec_t"
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
    """Nothing on any type the policy has without the module. On the start server's two new types
    container_t has what the base policy's attributes give every domain on a daemon's program
    (chronyd_exec_t) and on an unconfined daemon domain (initrc_t), nothing more."""
    gained = rules["container_t"] - rules["base_container_t"]
    assert not {r for r in gained if r[0] not in (START_DOMAIN, START_EXEC)}, sorted(gained)[:20]

    def on(target):
        return {r[1:] for r in rules["container_t"] if r[0] == target}

    assert on(START_EXEC) == on("chronyd_exec_t") and on(START_DOMAIN) == on("initrc_t")
    assert on(START_DOMAIN) <= {("association", "recvfrom", ""), ("peer", "recv", ""), ("tcp_socket", "recvfrom", "")}


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


def test_the_start_server_has_a_domain_of_its_own_and_init_t_gains_nothing(pk, policy_build, tmp_path):
    """The start server (install --start-server) used to run where systemd puts a program with no
    domain of its own: init_t on Debian (install's program is usr_t, with no transition from
    init_t), and the module widened init_t with system:start on itself, which a worker needs to
    tell systemd the GPU nodes of a container's scope (SetUnitProperties; a transient unit has no
    label, so systemd checks its own). Now systemd enters oci_gpu_hook_start_t from the server's
    launcher (oci_gpu_hook_start_exec_t), and only from it: the domain is unconfined, as the
    runtime's own domain that runs the hook without a server (unconfined_t) is, plus exactly the
    two of systemd's permissions on init_t a worker uses: status (it reads the scope's device
    properties first; init_t had it on itself) and start. init_t's rules on itself are what they
    are without the module, and the module writes no rule for init_t but those that make the new
    domain a daemon of its."""
    base, gpu = policy_build["base_policy"], policy_build["gpu_policy"]
    transitions = subprocess.run(["sesearch", "-T", "-t", START_EXEC, "-c", "process", gpu], capture_output=True,
                                 text=True, check=True).stdout  # fmt: skip
    sources = set(re.findall(rf"^type_transition (\S+) {START_EXEC}:process {START_DOMAIN};$", transitions, re.M))
    assert "init_t" in sources and sources <= {"init_t", "initrc_t"}, transitions  # systemd, an init script
    assert "entrypoint" in sesearch_perms(gpu, START_DOMAIN, START_EXEC, "file")
    unconfined = subprocess.run(["seinfo", "-a", "unconfined_domain_type", "-x", gpu], capture_output=True, text=True,
                                check=True).stdout.split()  # fmt: skip
    assert START_DOMAIN in unconfined and "unconfined_t" in unconfined
    assert {"start", "status"} <= sesearch_perms(base, "unconfined_t", "init_t", "system")  # the runtime's has them
    assert sesearch_perms(gpu, START_DOMAIN, "init_t", "system") == {"start", "status"}
    # init_t on itself: exactly as without the module (no system:start)
    on_itself = [subprocess.run(["sesearch", "-A", "-s", "init_t", "-t", "init_t", policy], capture_output=True,
                                text=True, check=True).stdout for policy in (base, gpu)]  # fmt: skip
    assert on_itself[0] == on_itself[1]
    assert "start" not in sesearch_perms(gpu, "init_t", "init_t", "system")
    cil = pk.module_cil(policy_build["module"], str(tmp_path))
    # init_t's rules in the module are on the new types alone (init_daemon_domain's: the transition,
    # the daemon's socket); of systemd's own permissions (class system) it grants status and start
    assert set(re.findall(r"\(allow init_t (\S+) ", cil)) == {START_DOMAIN, START_EXEC}, cil
    granted = re.findall(r"\(allow (\S+) init_t \(system \(([^)]*)\)\)\)", cil)
    assert sorted(granted) == [(START_DOMAIN, "start"), (START_DOMAIN, "status")], granted
    # The runtimes' pre-filter offers starts on the server's socket, which systemd labels with the
    # server's domain: unconfined_t may connect to it, and so may Debian's confined
    # container_engine_t, which could while the socket was init_t.
    for runtime in ("unconfined_t", "container_engine_t"):
        assert "connectto" in sesearch_perms(base, runtime, "init_t", "unix_stream_socket"), runtime
        assert "connectto" in sesearch_perms(gpu, runtime, START_DOMAIN, "unix_stream_socket"), runtime


def _file_contexts(pk) -> list:
    """(path regex, file type option, context) of each line of the module's .fc."""
    with open(os.path.join(pk.selinux_dir, f"{pk.module}.fc")) as f:
        return [tuple(line.split()) for line in f if line.strip() and not line.lstrip().startswith("#")]


def test_module_labels_only_the_start_servers_launcher(pk):
    """No host file is relabelled (the device nodes and driver files keep the base policy's labels):
    the one file context is the start server's launcher, where install writes it and where the RPM
    ships it, a plain file, the entry point of the server's domain. The hook's programs, which
    runtimes run, are not named, so a start without the server stays in the runtime's domain."""
    from oci_gpu_hook.toolkit import install, launcher

    entries = _file_contexts(pk)
    assert entries and all(len(e) == 3 and e[1] == "--" for e in entries), entries
    assert {e[2] for e in entries} == {f"gen_context(system_u:object_r:{START_EXEC},s0)"}, entries

    def named(path):
        return [e for e in entries if re.fullmatch(e[0], path)]

    assert [len(named(p)) for p in (install.START_LAUNCHER, install.PACKAGE_START_LAUNCHER)] == [1, 1]
    for path in (launcher.LAUNCHER, launcher.PYTHON_LAUNCHER, install.INSTALLED_PATH, install.DOCKER_HOOK,
                 install.DOCKER_LAUNCHER, "/usr/libexec/oci-gpu-hook/oci-gpu-hook-python", "/dev/nvidia0",
                 "/dev/nvidiactl", "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/bin/nvidia-smi"):  # fmt: skip
        assert not named(path), path


def test_the_linked_policy_labels_the_launcher_and_nothing_of_the_hook(policy_build, require):
    """What restorecon and rpm would set, asked of the linked policy's file contexts (where the base
    policy's own entries compete): the server's launcher gets the entry point's type, the hook's
    programs keep the base policy's labels."""
    require("selabel_lookup")
    from oci_gpu_hook.toolkit import install, launcher

    root = os.path.dirname(os.path.dirname(policy_build["gpu_policy"]))
    contexts = os.path.join(root, "contexts", "files", "file_contexts")

    def label(path):
        out = subprocess.run(["selabel_lookup", "-b", "file", "-k", path, "-t", str(0o100000), "-f", contexts],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        return out.strip().split(":")[-2]

    assert label(install.START_LAUNCHER) == label(install.PACKAGE_START_LAUNCHER) == START_EXEC
    assert label(launcher.LAUNCHER) == label(launcher.PYTHON_LAUNCHER) == "usr_t"
    assert label(install.INSTALLED_PATH) == label("/usr/libexec/oci-gpu-hook/oci-gpu-hook-python") == "bin_t"


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
    # the start server's domain: entered from its launcher, unconfined (every system permission on
    # every domain there, so no rule of Debian's for init_t), and init_t given nothing on itself
    assert f"(typetransition initrc_domain {START_EXEC} process {START_DOMAIN})" in cil
    assert f"(typeattributeset unconfined_domain_type ({START_DOMAIN} ))" in cil
    assert not re.search(r"\(allow \S+ init_t ", cil) and not re.search(r"\(allow init_t init_t ", cil)


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
