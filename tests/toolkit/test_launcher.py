"""The launcher: what every install way runs (the RPM's program, install's, Docker's hook program)."""

import json
import os
import subprocess
import sys

import pytest

from oci_gpu_hook.toolkit import containers, install, launcher

# Stands in for the package: says how the launcher started Python and what it was handed.
PROBE_HOOK = """import sys
def main(options=()):
    import json
    print(json.dumps({"site": "site" in sys.modules, "no_site": sys.flags.no_site, "isolated": sys.flags.isolated,
                      "path": sys.path, "options": list(options), "argv": sys.argv[1:]}))
    return 3
"""


def write(path, text, mode=0o755):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return str(path)


@pytest.fixture
def probe_package(tmp_path):
    parent = tmp_path / "site-packages"
    (parent / "oci_gpu_hook").mkdir(parents=True)
    (parent / "oci_gpu_hook" / "__init__.py").write_text("")
    (parent / "oci_gpu_hook" / "hook.py").write_text(PROBE_HOOK)
    return str(parent)


def test_the_launcher_starts_python_isolated_without_site_and_appends_the_package(tmp_path, probe_package):
    program = write(tmp_path / "oci-gpu-hook", launcher.text(sys.executable, probe_package, ["--config", "/c.yaml"]))
    env = {"PYTHONPATH": str(tmp_path / "elsewhere"), "PYTHONSTARTUP": "/nonexistent", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([program, "prestart"], capture_output=True, text=True, env=env)
    assert out.returncode == 3, out.stderr
    seen = json.loads(out.stdout)
    assert seen["no_site"] and seen["isolated"] and not seen["site"]
    assert seen["path"][-1] == probe_package  # after the standard library: nothing beside it shadows a module
    assert str(tmp_path / "elsewhere") not in seen["path"]
    assert seen["options"] == ["--config", "/c.yaml"] and seen["argv"] == ["prestart"]


def test_launcher_text_refuses_what_a_shebang_cannot_carry():
    with pytest.raises(launcher.LauncherError, match="absolute path without spaces"):
        launcher.text("/opt/my python/bin/python3", "/usr/lib/python3.9/site-packages")
    with pytest.raises(launcher.LauncherError, match="absolute path without spaces"):
        launcher.text("python3", "/usr/lib/python3.9/site-packages")
    with pytest.raises(launcher.LauncherError, match="too long for a '#!' line"):
        launcher.text("/" + "d" * 300 + "/python3", "/usr/lib/python3.9/site-packages")


def test_is_launcher_tells_a_launcher_from_a_console_script(tmp_path):
    ours = write(tmp_path / "ours", launcher.text("/usr/bin/python3", "/usr/lib/python3.9/site-packages"))
    pips = write(tmp_path / "pips", "#!/usr/bin/python3\nimport re\nimport sys\nfrom oci_gpu_hook.hook import main\n")
    assert launcher.is_launcher(ours)
    assert not launcher.is_launcher(pips) and not launcher.is_launcher(str(tmp_path / "missing"))


def test_this_installs_launcher_runs_the_cli_and_a_non_gpu_start(tmp_path):
    """The real package: the CLI gets its dependencies back through site; a runtime's non-GPU
    start returns 0 at once. Both from an empty environment, as a runtime gives it."""
    program = write(tmp_path / "oci-gpu-hook", launcher.for_this_install())
    version = subprocess.run([program, "--version"], capture_output=True, text=True, env={}, cwd="/")
    assert version.returncode == 0 and "oci-gpu-hook" in version.stdout, version.stderr
    bundle = containers.make_bundle(str(tmp_path / "bundle"), args=["true"], env={}, config_file=None)
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": os.getpid(), "bundle": bundle})
    start = subprocess.run([program, "prestart"], input=state, capture_output=True, text=True, env={}, cwd="/")
    assert (start.returncode, start.stdout, start.stderr) == (0, "", "")
    # A failing start still says its one line (stderr is flushed before the process's fast exit).
    bad = subprocess.run([program, "prestart"], input="{", capture_output=True, text=True, env={}, cwd="/")
    assert bad.returncode != 0 and bad.stderr.startswith("oci-gpu-hook: ") and bad.stderr.count("\n") == 1


def test_untrusted_interpreter_or_package_is_refused(tmp_path, require, probe_package):
    require("root")
    os.chmod(tmp_path, 0o755)
    os.chown(probe_package, 65534, 65534)
    with pytest.raises(launcher.LauncherError, match=r"owned by uid 65534|others than root can change") as e:
        launcher.check_trusted(sys.executable, probe_package)
    assert "root's alone" in e.value.message and "\n" not in e.value.message
    os.chown(probe_package, 0, 0)
    os.chmod(probe_package, 0o775)  # group-writable: someone else could put a module there
    with pytest.raises(launcher.LauncherError, match="writable by others than root"):
        launcher.check_trusted(sys.executable, probe_package)
    os.chmod(probe_package, 0o755)
    launcher.check_trusted(sys.executable, probe_package)  # root's alone: accepted


def test_install_writes_the_launcher_when_no_rpm_put_one_in_place(tmp_path, monkeypatch):
    monkeypatch.setattr(install, "INSTALLED_PATH", str(tmp_path / "usr-bin-oci-gpu-hook"))
    assert install.hook_command() == [launcher.LAUNCHER]
    root = str(tmp_path / "root")
    os.mkdir(root)
    install.install(root, ("podman", "docker"), install.hook_command() + ["--config", "/etc/gpu.yaml"],
                    prefilter=False)  # fmt: skip
    program = root + launcher.LAUNCHER
    assert os.stat(program).st_mode & 0o777 == 0o755 and launcher.is_launcher(program)
    with open(program) as f:
        assert f.read() == install.launcher_text()
    with open(os.path.join(root, "etc/containers/oci/hooks.d/oci-gpu-hook.json")) as f:
        hook = json.load(f)["hook"]
    assert hook["path"] == launcher.LAUNCHER
    assert hook["args"] == ["oci-gpu-hook", "--config", "/etc/gpu.yaml", "prestart"]
    assert launcher.is_launcher(root + install.DOCKER_HOOK)  # Docker's program: a launcher too
    install.uninstall(root)
    assert not os.path.exists(program)
    # An RPM's launcher in place: it is the one runtimes run, and install writes none.
    write(install.INSTALLED_PATH, launcher.text("/usr/bin/python3", "/usr/lib/python3.9/site-packages"))
    assert install.hook_command() == [install.INSTALLED_PATH]


def test_install_puts_the_prefilter_in_front_of_the_launcher(tmp_path, monkeypatch, require):
    """With a C compiler: runtimes run the compiled pre-filter at the launcher's path, and it runs
    the launcher written beside it; uninstall removes both."""
    require("gcc")
    monkeypatch.setattr(install, "INSTALLED_PATH", str(tmp_path / "usr-bin-oci-gpu-hook"))
    root = str(tmp_path / "root")
    os.mkdir(root)
    lines = install.install(root, ("podman",), install.hook_command())  # a compiler is there: the default
    program, python = root + launcher.LAUNCHER, root + launcher.PYTHON_LAUNCHER
    assert f"wrote {program}" in lines and f"wrote {python}" in lines
    with open(program, "rb") as f:
        data = f.read()
    assert data.startswith(b"\x7fELF") and launcher.PYTHON_LAUNCHER.encode() + b"\0" in data
    assert launcher.is_launcher(python) and os.stat(program).st_mode & 0o777 == 0o755
    assert install.install(root, ("podman",), install.hook_command()) == []  # built the same again: nothing to do
    install.uninstall(root)
    assert not os.path.exists(program) and not os.path.exists(python)


def test_a_gpu_start_through_the_launcher_compiles_a_new_configuration(tmp_path, live_container):
    """The first start after the configuration changed needs YAML and jsonschema, which live
    with the installed dependencies that -S leaves out: the start path adds them then."""
    state, bundle, pid, cgroup, host = live_container({"NVIDIA_VISIBLE_DEVICES": "0"})
    config = str(tmp_path / "fresh.yaml")
    with open(f"{host['root']}/config.yaml") as f, open(config, "w") as out:
        out.write(f.read() + "# changed: never compiled\n")
    program = write(tmp_path / "oci-gpu-hook", launcher.for_this_install())
    start = subprocess.run([program, "--config", config, "prestart"], input=state, capture_output=True, text=True,
                           env={}, cwd="/")  # fmt: skip
    assert (start.returncode, start.stderr) == (0, ""), start.stderr
    with open(f"/proc/{pid}/mountinfo") as f:
        assert "/dev/nvidia" in f.read()


@pytest.fixture
def venv(tmp_path, require):
    """A real venv (no pip: nothing fetched) with a stand-in yaml package and a .pth file in its
    site-packages, all root's: what a pip install into a venv leaves."""
    require("root")
    os.chmod(tmp_path, 0o755)
    path = tmp_path / "venv"
    subprocess.run([sys.executable, "-I", "-m", "venv", "--without-pip", str(path)], check=True,
                   executable=os.path.realpath(getattr(sys, "_base_executable", sys.executable)))  # fmt: skip
    (site_packages,) = path.glob("lib/python3.*/site-packages")
    (site_packages / "yaml").mkdir()
    (site_packages / "yaml" / "__init__.py").write_text("")
    (site_packages / "extra.pth").write_text(f"{path / 'extra'}\n{path / 'open' / 'missing'}\n")
    (path / "extra").mkdir()
    (path / "open").mkdir()  # holds a sys.path entry that does not exist (yet)
    return path, site_packages


@pytest.mark.parametrize(
    "target, change",
    [("pyvenv.cfg", "chmod"),  # its `home =` picks the standard library that runs as root
     ("site-packages/yaml/__init__.py", "chown"),  # imported by the node services and the CLI
     ("site-packages/yaml", "chmod"),
     ("site-packages/extra.pth", "chown"),  # site runs it, and puts its directory on sys.path
     ("extra", "chown"),  # that directory
     ("site-packages", "chown"),
     ("open", "chmod")],  # whoever can write it can make the missing entry, ahead of site-packages' .pth order
    ids=["pyvenv.cfg", "module", "package", "pth", "pth-directory", "site-packages", "missing-entry"],
)  # fmt: skip
def test_everything_the_launched_process_loads_must_be_roots_alone(venv, probe_package, target, change):
    path, site_packages = venv
    python = str(path / "bin" / "python")
    launcher.check_trusted(python, probe_package)  # root's alone: accepted
    inside, _, rest = target.partition("/")
    changed = str(site_packages / rest) if inside == "site-packages" else str(path / target)
    if change == "chown":
        os.chown(changed, 65534, 65534)
        words = "owned by uid 65534"
    else:
        os.chmod(changed, os.stat(changed).st_mode | 0o002)
        words = "writable by others than root"
    with pytest.raises(launcher.LauncherError) as e:
        launcher.check_trusted(python, probe_package)
    assert e.value.message.startswith(changed) and words in e.value.message and "\n" not in e.value.message
    assert "everything they import must be root's alone" in e.value.message


def test_what_check_trusted_walks_is_what_the_interpreter_imports_from(venv):
    """The import path is asked of the interpreter (site run, as the CLI runs it): the venv's
    site-packages and the .pth file's directory are on it; the venv's bin/ is not."""
    path, site_packages = venv
    entries = launcher._import_path(str(path / "bin" / "python"))
    assert str(site_packages) in entries and str(path / "extra") in entries
    assert str(path / "bin") not in entries
