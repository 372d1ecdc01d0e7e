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
# What the start server's service runs: a launcher of its own, its SELinux domain's entry point.
START_LAUNCHER = "/usr/libexec/oci-gpu-hook/oci-gpu-hook-start-server"
START_SOCKET = "/usr/lib/systemd/system/oci-gpu-hook-start.socket"  # the start server's units (%{_unitdir})
START_SERVICE = "/usr/lib/systemd/system/oci-gpu-hook-start.service"
START_PRESET = "/usr/lib/systemd/system-preset/50-oci-gpu-hook.preset"  # enables the socket (%{_presetdir})
MAIN_PATHS = {
    "/usr/bin/oci-gpu-hook",
    PYTHON_LAUNCHER,
    START_LAUNCHER,
    f"{SITELIB}/oci_gpu_hook/start/csrc/prefilter.c",
    f"{SITELIB}/oci_gpu_hook/__init__.py",
    f"{SITELIB}/oci_gpu_hook/hook.py",
    f"{SITELIB}/oci_gpu_hook/schemas/config.schema.json",
    f"{SITELIB}/oci_gpu_hook/toolkit/simulate/csrc/nvml.c",
    f"{SITELIB}/oci_gpu_hook-0.1.0.dist-info/METADATA",
    f"{SITELIB}/oci_gpu_hook-0.1.0.dist-info/entry_points.txt",
    "/usr/share/containers/oci/hooks.d/oci-gpu-hook.json",
    START_SOCKET,
    START_SERVICE,
    START_PRESET,
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
    assert entries[PYTHON_LAUNCHER][-1] == entries[START_LAUNCHER][-1] == "-rwxr-xr-x"
    assert entries[START_SOCKET] == entries[START_SERVICE] == ["-rw-r--r--"]  # no flags: not %config


def test_selinux_scriptlets_install_and_remove_at_priority_200(rpms):
    scripts = rpm_query("--scripts", rpms["selinux"])
    post = scripts.split("postinstall scriptlet")[1].split("postuninstall scriptlet")[0]
    postun = scripts.split("postuninstall scriptlet")[1]
    assert re.search(
        r"semodule .*-s targeted .*-X 200 .*-i /usr/share/selinux/packages/targeted/oci_gpu_hook\.pp\.bz2", post
    ), post
    assert re.search(r"\$1 -eq 0", postun) and re.search(r"semodule .*-X 200 .*-r oci_gpu_hook", postun), postun


def test_selinux_scriptlets_relabel_the_start_servers_launcher(rpms):
    """The module's one file context is the hook package's start server launcher. That package's
    files may be laid down, in the same transaction, before the module is loaded, so the module's
    package relabels the launcher once the transaction is done; on its removal it relabels it
    again, after the module is gone (a type no longer in the policy would leave it unlabeled_t, a
    program systemd could not run). Each only where the file and restorecon are, never failing."""
    found = scriptlets(rpms["selinux"])
    relabel = f"restorecon {START_LAUNCHER} || :"
    assert relabel in found["posttrans"], found
    postun = found["postuninstall"]
    assert postun.index("-r oci_gpu_hook") < postun.index(relabel), postun
    assert re.search(r"if \[ \$1 -eq 0 \]; then\n(.*\n)*.*" + re.escape(relabel), postun), postun
    for text in (found["posttrans"], postun):
        line = next(line for line in text.splitlines() if relabel in line)
        assert f"[ -e {START_LAUNCHER} ] && command -v restorecon" in line, line


def scriptlets(rpm) -> dict:
    """{"postinstall": text, "preuninstall": text, ...}: an RPM's scriptlets, as rpm shows them."""
    parts = re.split(r"^(\w+) scriptlet \(using [^)]*\):$", rpm_query("--scripts", rpm), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_start_server_is_enabled_on_install_stopped_on_removal_and_restarted_on_upgrade(rpms):
    """The hook package's scriptlets, as Debian's rpm builds them (the spec's stand-ins for the
    systemd macros): a first install applies the preset to the socket, as RHEL's %systemd_post does
    (an upgrade applies nothing: what the administrator chose stays), and starts nothing; removing
    stops and disables both units; an upgrade restarts a running server, so that it runs the new
    code (the socket stays open: starts offered meanwhile wait for it)."""
    found = scriptlets(rpms["main"])
    assert sorted(found) == ["postinstall", "postuninstall", "preuninstall"], found
    post = found["postinstall"]
    preset = r"if \[ \$1 -eq 1 \] .*\n\s+systemctl --no-reload preset oci-gpu-hook-start.socket \|\| :"
    assert re.search(preset, post), post
    verbs = re.findall(r"^\s*systemctl (?:--\S+ )*(\S+)", post, flags=re.M)
    assert verbs == ["preset", "daemon-reload"], post  # nothing started
    preun = found["preuninstall"]
    assert re.search(r"\$1 -eq 0", preun), preun  # removal, not the old package's half of an upgrade
    assert "disable --now oci-gpu-hook-start.socket oci-gpu-hook-start.service" in preun, preun
    postun = found["postuninstall"]
    assert re.search(r"if \[ \$1 -ge 1 \]; then\s+systemctl try-restart oci-gpu-hook-start.service\b", postun), postun
    for text in found.values():  # each systemctl call only where systemd is, and never failing the transaction
        assert all(line.rstrip().endswith("|| :") for line in text.splitlines() if "systemctl " in line
                   and "command -v" not in line), text  # fmt: skip


def test_start_server_units_are_installs_own_and_its_preset_enables_them(rpms, pk, tmp_path, require):
    """The units are the ones install writes (toolkit/install.py, the one place their text is):
    the socket at the path the pre-filter offers to, the service running the packaged program.
    The package ships no link, only its preset file: systemd's own tool, run on the package's
    files, says "disabled" until the preset is applied, and "enabled" after, even beside RHEL's
    policy, whose last preset file disables everything it does not name."""
    require("systemctl")
    from oci_gpu_hook.start import prefilter_rule
    from oci_gpu_hook.toolkit import install

    root = pk.extract_rpm(rpms["main"], str(tmp_path / "main"))
    with open(os.path.join(root, START_SOCKET[1:])) as f:
        socket_unit = f.read()
    with open(os.path.join(root, START_SERVICE[1:])) as f:
        service_unit = f.read()
    with open(os.path.join(root, START_PRESET[1:])) as f:
        preset = f.read()
    assert f"\nListenSequentialPacket={prefilter_rule.START_SERVER_SOCKET}\n" in socket_unit
    assert f"\nExecStart={START_LAUNCHER} start-server\n" in service_unit
    assert "\nOOMPolicy=continue\n" in service_unit
    assert socket_unit == install.start_socket_text(install.START_UNITS_BY_PACKAGE)
    assert service_unit == install.start_service_text([START_LAUNCHER], install.START_UNITS_BY_PACKAGE)
    assert preset == install.START_PRESET_TEXT and os.path.basename(START_PRESET) == install.START_PRESET
    assert install.PACKAGE_START_LAUNCHER == START_LAUNCHER  # the path the module's file context names
    files = rpm_query("-l", rpms["main"]).split()
    assert not [f for f in files if re.search(r"\.(wants|requires)/", f)], files
    # RHEL 9's own last word (systemd's 99-default-disable.preset), which ours must come before.
    rhel = os.path.join(os.path.dirname(os.path.join(root, START_PRESET[1:])), "99-default-disable.preset")
    with open(rhel, "w") as f:
        f.write("disable *\n")

    def is_enabled():
        done = subprocess.run(["systemctl", f"--root={root}", "is-enabled", "oci-gpu-hook-start.socket"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        return (done.stdout + done.stderr).strip()

    assert is_enabled() == "disabled"
    pk.run(["systemctl", f"--root={root}", "preset", "oci-gpu-hook-start.socket", "oci-gpu-hook-start.service"])
    assert is_enabled() == "enabled"


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
    # The start server's launcher: the same launcher, its own file (its label is its own).
    server = os.path.join(root, START_LAUNCHER[1:])
    with open(server) as f:
        assert "oci_gpu_hook_start_exec_t" in f.read()
    assert launcher.named(server) == ("/usr/bin/python3", SITELIB)
    assert os.stat(server).st_ino != os.stat(script).st_ino and not os.path.islink(server)
    # /usr/bin/oci-gpu-hook: the pre-filter, built to run that launcher.
    program = os.path.join(root, "usr/bin/oci-gpu-hook")
    assert prefilter.is_prefilter(program)
    with open(program, "rb") as f:
        assert prefilter.MARKER + PYTHON_LAUNCHER.encode() + b"\0" in f.read()
    from oci_gpu_hook.start import prefilter_rule

    assert prefilter.offers_to(program) == prefilter_rule.START_SERVER_SOCKET  # built as install builds it
    env = dict(os.environ, PYTHONPATH=os.path.join(root, SITELIB[1:]))
    for launcher_file in (script, server):
        proc = subprocess.run([sys.executable, launcher_file, "--version"], capture_output=True, text=True, env=env)
        assert proc.returncode == 0 and "0.1.0" in proc.stdout, proc


def test_installed_package_enables_the_start_server_and_keeps_an_administrators_no(rpms, tmp_path, require):
    """The package installed for real (rpm -i, its scriptlets run) on a host of the test's own: a
    private mount namespace with overlays over /etc, /usr and /var/lib (tests/privatehost.py), and
    an rpm database of its own. The preset enables the socket (the one link `systemctl enable`
    makes); `oci-gpu-hook install` then adds no copies in /etc/systemd/system to shadow the
    package's units, and its uninstall leaves the package's link; an administrator's `systemctl
    disable` survives an upgrade; removing the package disables it, and /etc/systemd/system is
    then as it was."""
    require("root", "rpm", "systemctl", "unshare")
    from privatehost import run

    from oci_gpu_hook.toolkit import containers

    rpm, cli = ["rpm", "--dbpath", str(tmp_path / "rpmdb")], containers.hook_command()
    unit = "oci-gpu-hook-start.socket"
    link = f"/etc/systemd/system/sockets.target.wants/{unit}"
    steps = [
        {"tree": ["/etc/systemd/system"]},
        {"run": [*rpm, "--initdb"]},
        {"run": [*rpm, "-i", "--nodeps", rpms["main"]]},
        {"run": ["systemctl", "is-enabled", unit]},
        {"run": ["readlink", link]},
        {"run": [*cli, "install", "--runtime", "runc"]},
        {"run": ["ls", "/etc/systemd/system"]},
        {"run": [*cli, "uninstall"]},
        {"run": ["systemctl", "is-enabled", unit]},
        {"run": ["systemctl", "disable", unit]},
        {"run": [*rpm, "-U", "--replacepkgs", "--nodeps", rpms["main"]]},
        {"run": ["systemctl", "is-enabled", unit]},
        {"run": ["systemctl", "enable", unit]},
        {"run": [*rpm, "-e", "oci-gpu-hook"]},
        {"run": ["ls", "-a", os.path.dirname(link)]},
        {"tree": ["/etc/systemd/system"]},
    ]
    work = tmp_path / "host"
    work.mkdir()
    (before, _initdb, installed, fresh, value, install, listing, uninstall, after_uninstall, _disable, upgraded,
     after_upgrade, _enable, removed, wants, after) = run(str(work), ["/etc", "/usr", "/var/lib"], steps)  # fmt: skip
    for done in (installed, install, uninstall, upgraded, removed):
        assert done["rc"] == 0, done
    assert fresh["stdout"].strip() == "enabled", (fresh, installed)  # the preset, on first install
    # systemctl's own spelling of the package's unit (Debian's is under /lib, a link to /usr/lib).
    assert value["stdout"].strip() in (START_SOCKET, START_SOCKET.replace("/usr/lib/", "/lib/")), value
    assert "oci-gpu-hook-start" not in listing["stdout"], (listing, install)  # no copies shadowing the package's
    assert after_uninstall["stdout"].strip() == "enabled", (after_uninstall, uninstall)  # the package's link stays
    assert after_upgrade["stdout"].strip() == "disabled", (after_upgrade, upgraded)  # the administrator's choice
    assert unit not in wants["stdout"].split(), (wants, removed)  # removal disabled it
    assert after == before


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
