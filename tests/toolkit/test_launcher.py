"""The launcher: what every install way runs (the RPM's program, install's, Docker's hook program)."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig

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
    message = refused_once_not_roots_alone(python, probe_package, changed, change)
    assert "everything they import must be root's alone" in message


def refused_once_not_roots_alone(python: str, probe_package, changed: str, change: str) -> str:
    """check_trusted's one-line refusal, naming the path first, once `changed` is made another
    user's (chown) or writable by all (chmod)."""
    if change == "chown":
        os.chown(changed, 65534, 65534)
        words = "owned by uid 65534"
    else:
        os.chmod(changed, os.stat(changed).st_mode | 0o002)
        words = "others than root"  # "writable by ...", or of a directory "... can change"
    with pytest.raises(launcher.LauncherError) as e:
        launcher.check_trusted(python, probe_package)
    message = e.value.message
    assert message.startswith(changed + ":") and words in message and "\n" not in message
    return message


@pytest.mark.parametrize("change", ["chown", "chmod"])
def test_a_users_pth_file_never_runs_as_root_at_install(venv, probe_package, tmp_path, change):
    """site executes a .pth file's `import` lines: asking the interpreter for its import path with
    site must come only after the site-packages directories and their .pth files were checked."""
    path, site_packages = venv
    mark = tmp_path / "ran-as-root"
    planted = site_packages / "zz-user.pth"
    planted.write_text(f"import os; open({str(mark)!r}, 'w').close()\n")
    if change == "chown":
        os.chown(planted, 65534, 65534)
    else:
        os.chmod(planted, 0o666)
    with pytest.raises(launcher.LauncherError) as e:
        launcher.check_trusted(str(path / "bin" / "python"), probe_package)
    assert e.value.message.startswith(str(planted))
    assert not mark.exists()  # refused before site ran it


@pytest.mark.parametrize("where", ["encodings/__init__.py", "json/__init__.py"])
def test_a_users_standard_library_module_never_runs_as_root_at_install(tmp_path, probe_package, require, where):
    """Python imports encodings from its standard library as it starts, even with -I -S, and the
    first question check_trusted asks it imports json: a module there that a user could change
    ran as root, and only then was the standard library found and refused. An interpreter with
    its own standard library (a source build's --prefix, pyenv, conda): that library, found as
    Python's start finds it (lib/python3.X/os.py), is checked before the interpreter first runs."""
    require("root")
    os.chmod(tmp_path, 0o755)
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    shutil.copy2(base, prefix / "bin" / version)
    stdlib = prefix / "lib" / version
    shutil.copytree(sysconfig.get_paths()["stdlib"], stdlib, symlinks=True,
                    ignore=shutil.ignore_patterns("site-packages", "dist-packages", "__pycache__"))  # fmt: skip
    mark = tmp_path / "ran-as-root"
    planted = stdlib / where
    with open(planted, "a") as f:  # os is set up before encodings; open() is not, in encodings
        f.write(f"\nimport os as _o\n_o.close(_o.open({str(mark)!r}, _o.O_CREAT | _o.O_WRONLY, 0o644))\n")
    os.chown(planted, 65534, 65534)
    with pytest.raises(launcher.LauncherError) as e:
        launcher.check_trusted(str(prefix / "bin" / version), probe_package)
    assert e.value.message.startswith(str(planted)), e.value.message
    assert not mark.exists()  # refused before Python ran it


def test_what_check_trusted_walks_is_what_the_interpreter_imports_from(venv):
    """The import path is asked of the interpreter (site run, as the CLI runs it): the venv's
    site-packages and the .pth file's directory are on it; the venv's bin/ is not."""
    path, site_packages = venv
    entries = launcher._import_path(str(path / "bin" / "python"))
    assert str(site_packages) in entries and str(path / "extra") in entries
    assert str(path / "bin") not in entries


# An interpreter built with --enable-shared (pyenv, conda, most source builds): Python's own
# main linked against libpython, which the loader finds through the program's RUNPATH. It also
# NEEDs a small library whose constructor leaves a mark: the mark says that the interpreter ran.
SHARED_MAIN = """int Py_BytesMain(int argc, char **argv);
void ran(void);
int main(int argc, char **argv) { ran(); return Py_BytesMain(argc, argv); }
"""
MARKING_LIBRARY = """#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void mark(void) {
    int fd = open(MARK, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) { (void)!write(fd, "x", 1); close(fd); }
}
void ran(void) {}
"""


@pytest.fixture
def shared_venv(venv, require, tmp_path):
    """The venv with its bin/python replaced by a real --enable-shared interpreter: RUNPATH
    $ORIGIN/../early (empty), $ORIGIN/../opt/lib (opt empty), $ORIGIN/../lib, where libpython (a
    copy of the system's) and libmark are; all root's."""
    require("gcc")
    path, site_packages = venv
    libpython = os.path.join(sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("INSTSONAME") or "")
    if not os.path.isfile(libpython):
        require(libpython)  # Debian's libpython3.x (python3-dev), Fedora's python3-libs
    lib = path / "lib"
    shutil.copy(libpython, lib / os.path.basename(libpython))
    mark = tmp_path / "mark"
    (tmp_path / "mark.c").write_text(f'#define MARK "{mark}"\n' + MARKING_LIBRARY)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib / "libmark.so"), str(tmp_path / "mark.c")], check=True)
    (tmp_path / "main.c").write_text(SHARED_MAIN)
    for name in ("python", "python3", f"python3.{sys.version_info[1]}"):
        if os.path.lexists(path / "bin" / name):
            os.unlink(path / "bin" / name)
    python = str(path / "bin" / "python")
    subprocess.run(["gcc", "-o", python, str(tmp_path / "main.c"), "-Wl,--no-as-needed", str(lib / "libmark.so"),
                    str(lib / os.path.basename(libpython)), "-Wl,--enable-new-dtags",
                    "-Wl,-rpath,$ORIGIN/../early:$ORIGIN/../opt/lib:$ORIGIN/../lib"], check=True)  # fmt: skip
    (path / "early").mkdir()
    (path / "opt").mkdir()
    ran = subprocess.run([python, "-I", "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                         env={}, cwd="/")  # fmt: skip
    assert ran.stdout.strip() == str(path) and mark.exists(), ran.stderr  # it is a working interpreter
    mark.unlink()
    return path, python, lib / os.path.basename(libpython), mark


@pytest.mark.parametrize(
    "target, change",
    [("libpython", "chown"),  # the case: the one file, a local user's
     ("libpython", "chmod"),
     ("lib/libmark.so", "chown"),
     ("lib", "chmod"),  # where the loader finds libpython
     ("early", "chmod"),  # searched before lib: a user's libpython there would win
     ("opt", "chown")],  # opt/lib does not exist yet: whoever owns opt can make it, ahead of lib
    ids=["libpython-owner", "libpython-writable", "needed", "library-directory", "earlier-runpath",
         "missing-runpath"],
)  # fmt: skip
def test_a_shared_interpreter_s_libraries_must_be_roots_alone(shared_venv, probe_package, target, change):
    """Refused before the interpreter first runs: the mark of its library's constructor stays absent."""
    path, python, libpython, mark = shared_venv
    launcher.check_trusted(python, probe_package)  # root's alone: accepted
    mark.unlink()
    changed = str(libpython) if target == "libpython" else str(path / target)
    message = refused_once_not_roots_alone(python, probe_package, changed, change)
    assert "root's alone" in message
    assert not mark.exists()  # nothing of it ran as root


def test_install_refuses_a_shared_interpreter_whose_libpython_is_a_user_s(shared_venv, tmp_path, monkeypatch):
    """install returns no success and writes nothing: the launcher would run a user's library as
    root at the next GPU container start."""
    path, python, libpython, mark = shared_venv
    os.chown(libpython, 65534, 65534)
    monkeypatch.setattr(sys, "executable", python)  # the interpreter install writes into the launcher
    monkeypatch.setattr(install, "INSTALLED_PATH", str(tmp_path / "usr-bin-oci-gpu-hook"))
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(launcher.LauncherError, match=f"^{libpython}: owned by uid 65534"):
        install.install(str(root), ("podman",), install.hook_command(), prefilter=False)
    assert list(root.iterdir()) == [] and not mark.exists()


@pytest.mark.parametrize("target", ["deps/libdep.so.1", "deps/libdeeper.so.1", "deps"],
                         ids=["needed", "needed-of-needed", "directory"])  # fmt: skip
def test_an_extension_module_s_libraries_must_be_roots_alone(venv, probe_package, require, tmp_path, target):
    """conda's layout: an extension module in site-packages NEEDs a library from lib/, outside the
    import path, through its RPATH $ORIGIN/../../deps; that library NEEDs another, found through
    the extension's RPATH, which the loader passes on."""
    require("gcc")
    path, site_packages = venv
    deps = path / "lib" / "deps"
    deps.mkdir()
    (tmp_path / "empty.c").write_text("int nothing;\n")

    def link(out, *args):
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(tmp_path / "empty.c"), "-Wl,--no-as-needed",
                        *args], check=True)  # fmt: skip

    link(deps / "libdeeper.so.1", "-Wl,-soname,libdeeper.so.1")
    link(deps / "libdep.so.1", "-Wl,-soname,libdep.so.1", str(deps / "libdeeper.so.1"))
    extension = site_packages / f"ext{sysconfig.get_config_var('EXT_SUFFIX')}"
    link(extension, str(deps / "libdep.so.1"), "-Wl,--disable-new-dtags", "-Wl,-rpath,$ORIGIN/../../deps")
    python = str(path / "bin" / "python")
    launcher.check_trusted(python, probe_package)  # root's alone: accepted
    changed = str(path / "lib" / target)
    if target == "deps":
        os.chmod(changed, 0o777)
    else:
        os.chown(changed, 65534, 65534)
    with pytest.raises(launcher.LauncherError) as e:
        launcher.check_trusted(python, probe_package)
    assert e.value.message.startswith(changed + ":") and "root's alone" in e.value.message


def test_what_the_hook_s_start_maps_must_be_roots_alone(tmp_path, probe_package, require):
    """What no ELF file names (a library the hook's imports dlopen() by path) is found in the maps
    of a start as a runtime makes it: here root's library, in a directory anyone can write."""
    require("root", "gcc")
    os.chmod(tmp_path, 0o755)
    shared = tmp_path / "shared"
    shared.mkdir()
    (tmp_path / "empty.c").write_text("int nothing;\n")
    library = shared / "libloaded.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(tmp_path / "empty.c")], check=True)
    with open(os.path.join(probe_package, "oci_gpu_hook", "hook.py"), "a") as f:
        f.write(f"import ctypes\nctypes.CDLL({str(library)!r})\n")
    launcher.check_trusted(sys.executable, probe_package)  # root's alone: accepted
    os.chmod(shared, 0o777)  # writable by all, not sticky: the file can be replaced
    with pytest.raises(launcher.LauncherError, match=f"^{shared}: a directory that others than root can change"):
        launcher.check_trusted(sys.executable, probe_package)
