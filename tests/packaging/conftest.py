"""Fixtures for the SELinux module and the RPMs. Everything is built once per session, in temp dirs.

The policy store is a throw-away one under a temp root (semodule -p ROOT), never the host's: first
Debian's whole default policy plus the container module Debian ships only as source ("base"), then
copies of it with oci_gpu_hook added ("gpu": the module built from selinux/; the RPM test adds the
packaged one). setools runs under Debian's /usr/bin/python3 (policy_rules.py), the one Python that
can import it.
"""

import json
import os
import shutil
import subprocess
import types

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SELINUX_DIR = os.path.join(REPO, "selinux")
MODULE = "oci_gpu_hook"
DEVEL_MAKEFILE = "/usr/share/selinux/devel/Makefile"
DEVEL_INCLUDE = "/usr/share/selinux/devel/include"
POLICY_SRC = "/usr/src/selinux-policy-src.tar.zst"
DEBIAN_MODULES = "/usr/share/selinux/default"
SYSTEM_PYTHON = "/usr/bin/python3"  # the Python that has setools (python3-setools)
PP_TO_CIL = "/usr/libexec/selinux/hll/pp"  # policycoreutils: module package -> CIL

POLICY_TOOLS = ("make", "checkmodule", "semodule_package", "semodule", "sesearch", "seinfo", "bzip2", "zstd")
RPM_TOOLS = ("make", "rpmbuild", "rpm", "rpm2archive", "rpmlint", "tar")


def run(cmd, **kwargs):
    """Run a command; on failure, fail the test with its output (not a bare CalledProcessError)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def _need_policy_sources(require):
    require(*POLICY_TOOLS)
    paths = (DEVEL_MAKEFILE, POLICY_SRC, os.path.join(DEBIAN_MODULES, "base.pp.bz2"), SYSTEM_PYTHON)
    missing = [path for path in paths if not os.path.exists(path)]
    if missing:  # the same rule as `require`: skip, or fail under OCI_GPU_HOOK_REQUIRE_ALL=1 (CI)
        message = f"needs {', '.join(missing)} (scripts/setup-host.sh installs them)"
        if os.environ.get("OCI_GPU_HOOK_REQUIRE_ALL") == "1":
            pytest.fail(message + " (OCI_GPU_HOOK_REQUIRE_ALL=1)", pytrace=False)
        pytest.skip(message)


def build_module(source_dir, work_dir, name, headerdir=None, makefile=DEVEL_MAKEFILE, make_args=()):
    """Compile NAME.pp with the devel Makefile in a copy of source_dir's NAME.{te,if,fc}."""
    os.makedirs(work_dir)
    for ext in ("te", "if", "fc"):
        src = os.path.join(source_dir, f"{name}.{ext}")
        if os.path.exists(src):
            shutil.copy(src, work_dir)
    cmd = ["make", "-f", makefile, *make_args, f"{name}.pp"]
    if headerdir:
        cmd.append(f"HEADERDIR={headerdir}")
    run(cmd, cwd=work_dir)
    return os.path.join(work_dir, f"{name}.pp")


def make_store(root, modules):
    """A policy store under root with Debian's default modules plus `modules`; returns policy.33."""
    policy_dir = os.path.join(root, "etc/selinux/default/policy")
    os.makedirs(policy_dir)
    os.makedirs(os.path.join(root, "etc/selinux/default/contexts/files"))
    os.makedirs(os.path.join(root, "var/lib/selinux"))
    shutil.copy("/etc/selinux/semanage.conf", os.path.join(root, "etc/selinux/semanage.conf"))
    with open(os.path.join(root, "etc/selinux/config"), "w") as f:
        f.write("SELINUX=permissive\nSELINUXTYPE=default\n")
    others = sorted(p for p in os.listdir(DEBIAN_MODULES) if p.endswith(".pp.bz2") and p != "base.pp.bz2")
    run(
        ["semodule", "-p", root, "-s", "default", "-n", "-X", "100", "-i", "base.pp.bz2", *others, *modules],
        cwd=DEBIAN_MODULES,
    )
    return os.path.join(policy_dir, "policy.33")


def add_module(base_root, root, module, priority):
    """Copy the store at base_root to root and install one more module at priority."""
    shutil.copytree(base_root, root, symlinks=True)
    run(["semodule", "-p", root, "-s", "default", "-n", "-X", str(priority), "-i", module])
    return os.path.join(root, "etc/selinux/default/policy/policy.33")


def policy_rules(policy, *domains):
    """{domain: set of (target, class, perm, condition)}, attributes expanded (see policy_rules.py)."""
    proc = run([SYSTEM_PYTHON, os.path.join(HERE, "policy_rules.py"), policy, *domains])
    return {domain: {tuple(rule) for rule in rules} for domain, rules in json.loads(proc.stdout).items()}


@pytest.fixture(scope="session")
def policy_build(tmp_path_factory, require):
    """Our module and Debian's container module, compiled; the base store and the gpu store linked."""
    _need_policy_sources(require)
    work = tmp_path_factory.mktemp("policy")
    ours = build_module(SELINUX_DIR, str(work / "ours"), MODULE)

    src = work / "src"
    src.mkdir()
    members = [f"selinux-policy-src/policy/modules/services/container.{ext}" for ext in ("te", "fc")]
    run(["tar", "--zstd", "-xf", POLICY_SRC, "-C", str(src), *members])
    # Only the .te and .fc: Debian's headers already define container.if, a copy would clash.
    container = build_module(
        str(src / "selinux-policy-src/policy/modules/services"), str(work / "container"), "container"
    )

    base_root = str(work / "base-root")
    base_policy = make_store(base_root, [container])
    gpu_policy = add_module(base_root, str(work / "gpu-root"), ours, 100)
    return {
        "work": str(work),
        "module": ours,
        "base_root": base_root,
        "base_policy": base_policy,
        "gpu_policy": gpu_policy,
    }


@pytest.fixture(scope="session")
def rhel_headers(require):
    """The RHEL family's policy headers (Fedora's targeted policy with container-selinux's
    interfaces), built offline once per machine by ../shared/tools/selinux-rhel (toolbuild.py)."""
    require("root", "make", "m4", "checkmodule", "semodule_package", PP_TO_CIL)
    from kubeletcheck import shared_tool

    return shared_tool("selinux-rhel")


def module_cil(module, work_dir):
    """The CIL text of a compiled module package (the HLL converter semodule itself uses)."""
    out = os.path.join(work_dir, "module.cil")
    run([PP_TO_CIL, module, out])
    with open(out) as f:
        return f.read()


@pytest.fixture(scope="session")
def rules(policy_build):
    """Expanded allow rules: container_t and gpu_container_t with our module, container_t without."""
    with_module = policy_rules(policy_build["gpu_policy"], "container_t", "gpu_container_t")
    without = policy_rules(policy_build["base_policy"], "container_t")
    return {
        "container_t": with_module["container_t"],
        "gpu_container_t": with_module["gpu_container_t"],
        "base_container_t": without["container_t"],
    }


@pytest.fixture(scope="session")
def rpms(tmp_path_factory, require):
    """`make rpm` into a temp topdir; returns {"main": path, "selinux": path, "topdir": dir}."""
    require(*RPM_TOOLS)
    _need_policy_sources(require)
    topdir = tmp_path_factory.mktemp("rpmbuild")
    run(["make", "-s", "rpm", f"RPM_TOPDIR={topdir}"], cwd=REPO)
    found = {}
    for arch in os.listdir(topdir / "RPMS"):  # noarch for the module, the machine's for the hook
        for name in os.listdir(topdir / "RPMS" / arch):
            key = "selinux" if name.startswith("oci-gpu-hook-selinux-") else "main"
            found[key] = str(topdir / "RPMS" / arch / name)
    assert sorted(found) == ["main", "selinux"], found
    found["topdir"] = str(topdir)
    return found


def extract_rpm(path, dest):
    """Unpack an RPM's payload under dest (Debian has no cpio: rpm2archive | tar)."""
    os.makedirs(dest, exist_ok=True)
    with open(path, "rb") as rpm:
        archive = subprocess.run(["rpm2archive", "-"], stdin=rpm, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-xzf", "-", "-C", dest], input=archive, check=True)
    return dest


@pytest.fixture(scope="session")
def pk():
    """The helpers above, for the test modules (test files here do not import each other)."""
    return types.SimpleNamespace(
        run=run,
        extract_rpm=extract_rpm,
        add_module=add_module,
        build_module=build_module,
        module_cil=module_cil,
        policy_rules=policy_rules,
        repo=REPO,
        selinux_dir=SELINUX_DIR,
        module=MODULE,
        devel_include=DEVEL_INCLUDE,
        here=HERE,
    )
