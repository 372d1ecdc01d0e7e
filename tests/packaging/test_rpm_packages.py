"""The two RPMs `make rpm` builds: their files, scriptlets, dependencies, rpmlint, and the packaged
policy module installed (at priority 200, as its %post does) into a throw-away policy store."""

import json
import os
import re
import subprocess
import sys

import yaml

SITELIB = "/usr/lib/python3.9/site-packages"  # RHEL 9's system python3
PYTHON_LAUNCHER = "/usr/libexec/oci-gpu-hook/oci-gpu-hook-python"
MAIN_PATHS = {
    "/usr/bin/oci-gpu-hook",
    PYTHON_LAUNCHER,
    f"{SITELIB}/oci_gpu_hook/start/csrc/prefilter.c",
    f"{SITELIB}/oci_gpu_hook/__init__.py",
    f"{SITELIB}/oci_gpu_hook/hook.py",
    f"{SITELIB}/oci_gpu_hook/schemas/config.schema.json",
    f"{SITELIB}/oci_gpu_hook/toolkit/simulate/csrc/nvml.c",
    f"{SITELIB}/oci_gpu_hook-0.1.0.dist-info/METADATA",
    f"{SITELIB}/oci_gpu_hook-0.1.0.dist-info/entry_points.txt",
    "/usr/share/containers/oci/hooks.d/oci-gpu-hook.json",
    "/etc/oci-gpu-hook",
    "/etc/oci-gpu-hook/config.yaml",
    "/usr/share/doc/oci-gpu-hook-0.1.0/README.md",
    "/usr/share/doc/oci-gpu-hook-0.1.0/selinux.md",
    "/usr/share/doc/oci-gpu-hook-0.1.0/deploy.md",
    "/usr/share/doc/oci-gpu-hook-0.1.0/configuration.md",
}
SELINUX_PATHS = {
    "/usr/share/selinux/packages/targeted/oci_gpu_hook.pp.bz2",
    "/usr/share/selinux/devel/include/distributed/oci_gpu_hook.if",
    "/usr/share/doc/oci-gpu-hook-selinux-0.1.0/selinux.md",
}
MAIN_REQUIRES = {
    "python3",
    "python3-click",
    "python3-pyyaml",
    "python3-jsonschema",
    "python3-libselinux",
    "python(abi) = 3.9",
}
SELINUX_REQUIRES = {"selinux-policy-targeted", "container-selinux", "policycoreutils", "libselinux-utils"}


def rpm_query(*args):
    return subprocess.run(["rpm", "-qp", *args], capture_output=True, text=True, check=True).stdout


def test_main_package_files(rpms):
    files = set(rpm_query("-l", rpms["main"]).split())
    assert MAIN_PATHS <= files, sorted(MAIN_PATHS - files)
    assert not [f for f in files if "__pycache__" in f or f.endswith((".pp", ".pp.bz2"))]


def test_selinux_package_files(rpms):
    files = set(rpm_query("-l", rpms["selinux"]).split())
    assert files == SELINUX_PATHS | {"/usr/share/doc/oci-gpu-hook-selinux-0.1.0"}, files


def test_the_hook_package_is_per_architecture_and_the_module_noarch(rpms):
    machine = subprocess.run(["rpm", "--eval", "%{_arch}"], capture_output=True, text=True).stdout.strip()
    assert rpm_query("--qf", "%{ARCH}", rpms["main"]) == machine  # the compiled pre-filter
    assert rpm_query("--qf", "%{ARCH}", rpms["selinux"]) == "noarch"


def test_config_is_noreplace_and_hook_executable(rpms):
    listing = rpm_query("--qf", "[%{FILEFLAGS:fflags} %{FILEMODES:perms} %{FILENAMES}\n]", rpms["main"])
    entries = {line.split()[-1]: line.split()[:-1] for line in listing.splitlines() if line.strip()}
    flags, _mode = entries["/etc/oci-gpu-hook/config.yaml"]
    assert "c" in flags and "n" in flags  # %config(noreplace)
    assert entries["/usr/bin/oci-gpu-hook"][-1] == "-rwxr-xr-x"
    assert entries[PYTHON_LAUNCHER][-1] == "-rwxr-xr-x"


def test_selinux_scriptlets_install_and_remove_at_priority_200(rpms):
    scripts = rpm_query("--scripts", rpms["selinux"])
    post = scripts.split("postinstall scriptlet")[1].split("postuninstall scriptlet")[0]
    postun = scripts.split("postuninstall scriptlet")[1]
    assert re.search(
        r"semodule .*-s targeted .*-X 200 .*-i /usr/share/selinux/packages/targeted/oci_gpu_hook\.pp\.bz2", post
    ), post
    assert re.search(r"\$1 -eq 0", postun) and re.search(r"semodule .*-X 200 .*-r oci_gpu_hook", postun), postun
    assert "scriptlet" not in rpm_query("--scripts", rpms["main"])  # the hook package needs none


def test_requires_name_rhel9_packages(rpms):
    main = set(rpm_query("--requires", rpms["main"]).splitlines())
    assert MAIN_REQUIRES <= main, sorted(MAIN_REQUIRES - main)
    recommends = rpm_query("--recommends", rpms["main"])
    assert "python3dist(nvidia-ml-py)" in recommends and "oci-gpu-hook-selinux" in recommends
    assert "python3-tomli" in recommends
    selinux = set(rpm_query("--requires", rpms["selinux"]).splitlines())
    assert SELINUX_REQUIRES <= selinux, sorted(SELINUX_REQUIRES - selinux)


def test_packaged_files_match_the_tree(rpms, pk, tmp_path):
    root = pk.extract_rpm(rpms["main"], str(tmp_path / "main"))
    for packaged, source in (
        ("usr/share/containers/oci/hooks.d/oci-gpu-hook.json", "hooks.d/oci-gpu-hook.json"),
        ("etc/oci-gpu-hook/config.yaml", "rpm/config.yaml"),
        (f"{SITELIB[1:]}/oci_gpu_hook/hook.py", "oci_gpu_hook/hook.py"),
    ):
        with open(os.path.join(root, packaged), "rb") as a, open(os.path.join(pk.repo, source), "rb") as b:
            assert a.read() == b.read(), packaged
    with open(os.path.join(root, "usr/share/containers/oci/hooks.d/oci-gpu-hook.json")) as f:
        assert json.load(f)["hook"]["path"] == "/usr/bin/oci-gpu-hook"


def test_packaged_console_script_runs(rpms, pk, tmp_path):
    root = pk.extract_rpm(rpms["main"], str(tmp_path / "main"))
    script = os.path.join(root, PYTHON_LAUNCHER[1:])
    with open(script) as f:
        assert f.readline() == "#!/usr/bin/python3 -IS\n"  # the launcher (toolkit/launcher.py)
    from oci_gpu_hook.toolkit import launcher, prefilter

    with open(script) as f:
        assert f.read() == launcher.text("/usr/bin/python3", SITELIB)
    # /usr/bin/oci-gpu-hook: the pre-filter, built to run that launcher.
    program = os.path.join(root, "usr/bin/oci-gpu-hook")
    assert prefilter.is_prefilter(program)
    with open(program, "rb") as f:
        assert prefilter.MARKER + PYTHON_LAUNCHER.encode() + b"\0" in f.read()
    env = dict(os.environ, PYTHONPATH=os.path.join(root, SITELIB[1:]))
    proc = subprocess.run([sys.executable, script, "--version"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and "0.1.0" in proc.stdout, proc


def test_default_config_validates_with_every_key_uncommented(pk, tmp_path):
    from oci_gpu_hook.start import settings

    source = os.path.join(pk.repo, "rpm", "config.yaml")
    assert settings.load(source).source == source
    with open(source) as f:
        text = f.read()
    uncommented = re.sub(r"^#(?=[a-z_]+:)", "", text, flags=re.M)
    assert yaml.safe_load(uncommented).keys() >= {"driver_root", "cgroups", "supported_capabilities", "logging"}
    path = tmp_path / "config.yaml"
    path.write_text(uncommented)
    loaded = settings.load(str(path))
    assert loaded == settings.Settings(source=str(path))  # the commented values are the defaults


def test_versions_agree(pk):
    from oci_gpu_hook import __version__

    with open(os.path.join(pk.repo, "rpm", "oci-gpu-hook.spec")) as f:
        spec_version = re.search(r"^Version:\s*(\S+)", f.read(), re.M).group(1)
    with open(os.path.join(pk.repo, "pyproject.toml")) as f:
        project_version = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M).group(1)
    assert spec_version == project_version == __version__


def test_rpmlint_reports_no_errors(rpms, pk):
    proc = subprocess.run(
        [
            "rpmlint",
            "-c",
            os.path.join(pk.repo, "rpm", "rpmlint.toml"),
            rpms["main"],
            rpms["selinux"],
            os.path.join(pk.repo, "rpm", "oci-gpu-hook.spec"),
        ],
        capture_output=True,
        text=True,
    )
    summary = re.search(r"(\d+) errors, (\d+) warnings", proc.stdout)
    assert summary and summary.group(1) == "0", proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_packaged_module_installs_into_a_store_at_priority_200(rpms, pk, policy_build, tmp_path):
    root = pk.extract_rpm(rpms["selinux"], str(tmp_path / "selinux"))
    packaged = os.path.join(root, "usr/share/selinux/packages/targeted/oci_gpu_hook.pp.bz2")
    store = str(tmp_path / "store")
    policy = pk.add_module(policy_build["base_root"], store, packaged, 200)
    listing = pk.run(["semodule", "-p", store, "-s", "default", "--list-modules=full"]).stdout
    assert re.search(r"^200\s+oci_gpu_hook\s+pp", listing, re.M), listing
    out = pk.run(
        ["sesearch", "-A", "-s", "gpu_container_t", "-t", "xserver_misc_device_t", "-c", "chr_file", policy]
    ).stdout
    assert "map" in out and "ioctl" in out, out
    # and it comes out again, as the %postun does it
    pk.run(["semodule", "-p", store, "-s", "default", "-n", "-X", "200", "-r", "oci_gpu_hook"])
    listing = pk.run(["semodule", "-p", store, "-s", "default", "--list-modules=full"]).stdout
    assert "oci_gpu_hook" not in listing
