"""install / uninstall under --root: byte-identical round trip, idempotence, administrators' files."""

import json
import os
import stat
import subprocess
import sys

import hookcheck
import jsonschema
import pytest

from oci_gpu_hook.errors import HookError
from oci_gpu_hook.toolkit import install, launcher

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREFIX = ["/usr/bin/oci-gpu-hook"]


def snapshot(root):
    """Everything about a tree that install could change: types, modes, contents, link values,
    and file modification times."""
    return hookcheck.tree(root, contents=True, times=True)


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "root"
    (root / "etc/containers").mkdir(parents=True)
    (root / "etc/containers/policy.json").write_text("{}\n")
    (root / "var").mkdir()
    return str(root)


@pytest.mark.parametrize("runtimes", [("podman",), ("crio",), ("podman", "crio", "runc"), ("runc",)])
def test_install_then_uninstall_leaves_the_tree_byte_identical(root, runtimes):
    before = snapshot(root)
    assert install.install(root, runtimes, PREFIX)
    assert snapshot(root) != before
    assert install.uninstall(root)
    assert snapshot(root) == before


def test_install_twice_changes_nothing_the_second_time(root):
    install.install(root, ("podman", "crio"), PREFIX)
    first = snapshot(root)
    assert install.install(root, ("podman", "crio"), PREFIX) == []
    assert snapshot(root) == first


def test_what_install_writes(root):
    install.install(root, ("crio",), PREFIX)
    hooks = json.load(open(os.path.join(root, "etc/containers/oci/hooks.d/oci-gpu-hook.json")))
    shipped = json.load(open(os.path.join(REPO, "hooks.d", "oci-gpu-hook.json")))
    schema = json.load(open(os.path.join(REPO, "oci_gpu_hook", "schemas", "oci-hooks.schema.json")))
    jsonschema.validate(hooks, schema)
    assert hooks == shipped  # the shipped file, pointed at /usr/bin/oci-gpu-hook
    dropin = open(os.path.join(root, "etc/crio/crio.conf.d/50-oci-gpu-hook.conf")).read()
    assert "[crio.runtime]" in dropin and '"/etc/containers/oci/hooks.d"' in dropin
    service = open(os.path.join(root, "etc/systemd/system/oci-gpu-hook-refresh.service")).read()
    assert "ExecStart=/usr/bin/oci-gpu-hook inventory refresh" in service and "Type=oneshot" in service
    assert os.readlink(os.path.join(root, "etc/systemd/system/paths.target.wants/oci-gpu-hook-refresh.path")) == (
        "../oci-gpu-hook-refresh.path"
    )
    rule = open(os.path.join(root, "etc/udev/rules.d/71-oci-gpu-hook.rules")).read()
    assert 'SUBSYSTEM=="module"' in rule and "oci-gpu-hook-refresh.service" in rule
    from oci_gpu_hook.start import settings

    settings.parse(open(os.path.join(root, "etc/oci-gpu-hook/config.yaml")).read(), "config.yaml")  # valid


def test_an_existing_configuration_is_kept_and_never_removed(root):
    os.makedirs(os.path.join(root, "etc/oci-gpu-hook"))
    config = os.path.join(root, "etc/oci-gpu-hook/config.yaml")
    with open(config, "w") as f:
        f.write("cgroups: v2\n")
    before = snapshot(root)
    install.install(root, ("podman",), PREFIX)
    assert open(config).read() == "cgroups: v2\n"
    install.uninstall(root)
    assert snapshot(root) == before


def test_the_configuration_for_the_device_plugins_answer(root):
    """--accept-volume-mounts (the toolkit DaemonSet's install): where there is no configuration,
    the one written takes GPUs from the volume-mounts answer the node pod's device plugin gives,
    and not from the variable in unprivileged containers; one already there is kept."""
    from oci_gpu_hook.start import settings

    install.install(root, ("crio",), PREFIX, accept_volume_mounts=True)
    path = os.path.join(root, "etc/oci-gpu-hook/config.yaml")
    loaded = settings.parse(open(path).read(), "config.yaml")
    assert (loaded.accept_volume_mounts, loaded.accept_envvar_when_unprivileged) == (True, False)
    install.uninstall(root)
    assert not os.path.exists(path)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write("cgroups: v2\n")
    install.install(root, ("crio",), PREFIX, accept_volume_mounts=True)
    assert open(path).read() == "cgroups: v2\n"


def test_an_administrators_hooks_file_is_never_replaced(root):
    path = os.path.join(root, "etc/containers/oci/hooks.d/oci-gpu-hook.json")
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write("{}\n")
    before = snapshot(root)
    with pytest.raises(HookError, match="was not written by oci-gpu-hook install"):
        install.install(root, ("podman",), PREFIX)
    assert snapshot(root) == before


def test_uninstall_keeps_a_file_changed_since_install(root):
    install.install(root, ("podman",), PREFIX)
    unit = os.path.join(root, "etc/systemd/system/oci-gpu-hook-refresh.service")
    with open(unit, "a") as f:
        f.write("# local change\n")
    lines = install.uninstall(root)
    assert any(line.startswith("kept") and unit in line for line in lines)
    assert os.path.exists(unit) and not os.path.exists(os.path.join(root, "etc/oci-gpu-hook/config.yaml"))
    assert install.uninstall(root) == []  # nothing recorded any more


def test_cli_install_and_uninstall(root, hook_cli):
    out = hook_cli("install", "--root", root, "--runtime", "podman")
    assert out.returncode == 0, out.stderr
    assert "wrote" in out.stdout
    again = hook_cli("install", "--root", root, "--runtime", "podman")
    assert again.returncode == 0 and "nothing to do" in again.stdout
    hooks = json.load(open(os.path.join(root, "etc/containers/oci/hooks.d/oci-gpu-hook.json")))
    assert os.path.isabs(hooks["hook"]["path"]) and hooks["hook"]["args"][-1] == "prestart"
    gone = hook_cli("uninstall", "--root", root)
    assert gone.returncode == 0 and "removed" in gone.stdout
    broken = hook_cli("install", "--root", os.path.join(root, "missing"))
    assert broken.returncode != 0 and broken.stderr.count("\n") == 1 and "Traceback" not in broken.stderr


def test_a_hooks_dir_of_its_own_holds_what_install_writes(root, tmp_path):
    """validate's (and the demo's) temporary hooks.d directory: the same document, built in code,
    so an installed copy of the package, which has no hooks.d/ beside it, can make one."""
    install.install(root, ("podman",), PREFIX)
    directory = install.write_hooks_dir(str(tmp_path / "hooks.d"), PREFIX)
    with open(os.path.join(directory, "oci-gpu-hook.json")) as f:
        written = f.read()
    with open(os.path.join(root, "etc/containers/oci/hooks.d/oci-gpu-hook.json")) as f:
        assert written == f.read()
    assert json.loads(written) == json.load(open(os.path.join(REPO, "hooks.d", "oci-gpu-hook.json")))


NVIDIAS_HOOK = b"#!/bin/sh\n# stands in for NVIDIA's nvidia-container-runtime-hook\nexit 0\n"


def test_docker_round_trip_and_the_program(root):
    """Without the pre-filter (--no-prefilter, or no compiler): Docker's program is the launcher."""
    before = snapshot(root)
    lines = install.install(root, ("docker",), PREFIX + ["--config", "/etc/gpu/config.yaml"], prefilter=False)
    program = root + install.DOCKER_HOOK
    assert f"wrote {program}" in lines
    assert os.stat(program).st_mode & 0o777 == 0o755
    text = open(program).read()
    # A launcher of this install itself, no shell in front of it (toolkit/launcher.py).
    assert text.startswith(f"#!{sys.executable} -IS\n") and install.DOCKER_HOOK_MARKER in text
    assert launcher.is_launcher(program)
    assert text.rstrip().endswith("sys.exit(main(options=['--config', '/etc/gpu/config.yaml']))")
    assert not os.path.lexists(root + install.DOCKER_LAUNCHER)
    assert install.install(root, ("docker",), PREFIX + ["--config", "/etc/gpu/config.yaml"], prefilter=False) == []
    install.uninstall(root)
    assert snapshot(root) == before


def test_docker_program_is_the_prefilter_in_front_of_a_launcher_of_its_own(root, require):
    """With a compiler and the start server (the default): dockerd runs the compiled pre-filter (no interpreter
    of its own; it offers the start to the start server), which runs a launcher of Docker's own
    carrying the --config (dockerd passes only `prestart`); both in the manifest, both removed by
    uninstall. Without the start server, the launcher itself (the pre-filter would only add an exec:
    every start dockerd runs the program for asks for a GPU)."""
    require("gcc")
    from oci_gpu_hook.start import prefilter_rule
    from oci_gpu_hook.toolkit import prefilter

    before = snapshot(root)
    argv_prefix = PREFIX + ["--config", "/etc/gpu/config.yaml"]
    install.install(root, ("docker",), argv_prefix, prefilter=True, start_server=False)
    program, python = root + install.DOCKER_HOOK, root + install.DOCKER_LAUNCHER
    assert launcher.is_launcher(program) and not os.path.lexists(python)
    install.uninstall(root)
    assert snapshot(root) == before
    lines = install.install(root, ("docker",), argv_prefix, prefilter=True)  # the start server by default
    assert f"wrote {program}" in lines and f"wrote {python}" in lines
    assert lines.index(f"wrote {python}") < lines.index(f"wrote {program}")  # never one without the other
    assert prefilter.is_prefilter(program) and prefilter.runs(program) == install.DOCKER_LAUNCHER
    with open(program, "rb") as f:
        data = f.read()
    # It offers starts to the start server, with the launcher's options first.
    assert prefilter.offers_to(program) == prefilter_rule.START_SERVER_SOCKET and b"/etc/gpu/config.yaml\0" in data
    text = open(python).read()
    assert launcher.is_launcher(python) and text.startswith(f"#!{sys.executable} -IS\n")
    assert install.DOCKER_HOOK_MARKER in text and install.DOCKER_HOOK in text
    assert text.rstrip().endswith("sys.exit(main(options=['--config', '/etc/gpu/config.yaml']))")
    assert os.stat(program).st_mode & 0o777 == os.stat(python).st_mode & 0o777 == 0o755
    with open(root + install.MANIFEST) as f:
        assert {install.DOCKER_HOOK, install.DOCKER_LAUNCHER} <= set(json.load(f)["files"])
    assert install.install(root, ("docker",), argv_prefix, prefilter=True, start_server=True) == []  # the same
    lines = install.uninstall(root)
    assert f"removed {program}" in lines and f"removed {python}" in lines
    assert snapshot(root) == before


def test_docker_prefilter_takes_dockerds_command_line(root, require):
    """dockerd runs `nvidia-container-runtime-hook prestart` (nothing else: moby's nvidia driver),
    and install's options are the launcher's, so that command line is a runtime's for the
    pre-filter: a container that asks for no GPU is answered by it (exit 0, nothing said), and a
    command line that is not dockerd's goes to the launcher (which is not there under this root)."""
    require("gcc")
    import prefilter_corpus

    install.install(root, ("docker",), PREFIX + ["--config", "/etc/gpu/config.yaml"], prefilter=True,
                    start_server=True)  # fmt: skip
    bundle = os.path.join(root, "bundle")
    os.mkdir(bundle)
    with open(os.path.join(bundle, "config.json"), "wb") as f:
        f.write(prefilter_corpus.config_bytes(prefilter_corpus.config()))
    data = prefilter_corpus.expanded(prefilter_corpus.STATE, bundle)

    def run(*args):
        return subprocess.run(["nvidia-container-runtime-hook", *args], executable=root + install.DOCKER_HOOK,
                              input=data, capture_output=True, env={"PATH": "/usr/bin:/bin"}, timeout=30)  # fmt: skip

    done = run("prestart")
    assert (done.returncode, done.stdout, done.stderr) == (0, b"", b"")
    if not os.path.lexists(install.DOCKER_LAUNCHER):  # this host's own, from a real install: it would run
        done = run("--config", "/etc/gpu/config.yaml", "prestart")  # the options twice: not dockerd's
        assert done.returncode == 70 and f"cannot run {install.DOCKER_LAUNCHER}".encode() in done.stderr, done


def test_the_docker_program_hands_over_its_arguments(root):
    """What dockerd runs (`nvidia-container-runtime-hook prestart`) reaches the hook's own command
    line: shown here with --version, which needs no container, run from an empty environment (the
    launcher; the pre-filter runs it at its host path, not under this root)."""
    install.install(root, ("docker",), install.interpreter_command(), prefilter=False)
    out = subprocess.run([root + install.DOCKER_HOOK, "--version"], capture_output=True, text=True, env={},
                         cwd="/")  # fmt: skip
    assert out.returncode == 0 and "oci-gpu-hook" in out.stdout, out.stderr


def plant_nvidias_hook(root):
    os.makedirs(root + "/usr/bin")
    with open(root + install.DOCKER_HOOK, "wb") as f:
        f.write(NVIDIAS_HOOK)
    os.chmod(root + install.DOCKER_HOOK, 0o755)


def test_nvidias_program_is_never_replaced_unless_told(root):
    plant_nvidias_hook(root)
    before = snapshot(root)
    with pytest.raises(HookError, match="--replace-nvidia-hook") as e:
        install.install(root, ("docker",), PREFIX)
    assert "\n" not in e.value.message
    assert snapshot(root) == before  # refused before writing anything


def docker_program_is_ours(root) -> bool:
    """Whether Docker's program under root is install's: the launcher, or the pre-filter running
    Docker's launcher."""
    from oci_gpu_hook.toolkit import prefilter

    program = root + install.DOCKER_HOOK
    if prefilter.runs(program) == install.DOCKER_LAUNCHER:
        program = root + install.DOCKER_LAUNCHER
    with open(program, "rb") as f:
        return install.DOCKER_HOOK_MARKER.encode() in f.read()


@pytest.mark.parametrize("with_prefilter", [False, True], ids=["launcher", "prefilter"])
def test_replacing_nvidias_program_and_uninstall_restores_it(root, with_prefilter, require):
    if with_prefilter:
        require("gcc")
    plant_nvidias_hook(root)
    before = snapshot(root)
    lines = install.install(root, ("docker",), PREFIX, replace_nvidia_hook=True, prefilter=with_prefilter,
                            start_server=with_prefilter)  # fmt: skip
    assert f"moved {root + install.DOCKER_HOOK} to {root + install.DOCKER_HOOK_SAVED}" in lines
    assert open(root + install.DOCKER_HOOK_SAVED, "rb").read() == NVIDIAS_HOOK
    assert docker_program_is_ours(root)
    assert os.path.lexists(root + install.DOCKER_LAUNCHER) == with_prefilter
    lines = install.uninstall(root)
    assert f"restored {root + install.DOCKER_HOOK}" in lines
    assert snapshot(root) == before  # NVIDIA's file back, byte for byte, with its mode and mtime


def test_docker_program_upgraded_to_the_prefilter_keeps_nvidias_aside(root, require):
    """An install whose Docker program was the launcher (an older one, or --no-prefilter), in
    NVIDIA's program's place, installed again with the pre-filter: the program becomes the
    pre-filter, NVIDIA's stays aside, and uninstall removes both of install's files and puts it back."""
    require("gcc")
    plant_nvidias_hook(root)
    before = snapshot(root)
    install.install(root, ("docker",), PREFIX, replace_nvidia_hook=True, prefilter=False)
    lines = install.install(root, ("docker",), PREFIX, prefilter=True, start_server=True)
    assert lines[:2] == [f"wrote {root + install.DOCKER_LAUNCHER}", f"updated {root + install.DOCKER_HOOK}"], lines
    assert docker_program_is_ours(root) and open(root + install.DOCKER_HOOK_SAVED, "rb").read() == NVIDIAS_HOOK
    lines = install.uninstall(root)
    assert f"restored {root + install.DOCKER_HOOK}" in lines
    assert snapshot(root) == before


def test_node_services_round_trip_and_units(root):
    before = snapshot(root)
    lines = install.install(root, ("podman",), PREFIX, node_services=True)
    units = os.path.join(root, "etc/systemd/system")
    exporter = open(os.path.join(units, "oci-gpu-hook-exporter.service")).read()
    labels = open(os.path.join(units, "oci-gpu-hook-labels.service")).read()
    assert "ExecStart=/usr/bin/oci-gpu-hook exporter\n" in exporter and "Restart=on-failure" in exporter
    assert "ExecStart=/usr/bin/oci-gpu-hook labels --watch 60\n" in labels
    for unit in ("oci-gpu-hook-exporter.service", "oci-gpu-hook-labels.service"):
        assert os.readlink(os.path.join(units, "multi-user.target.wants", unit)) == f"../{unit}"
        assert any(line.endswith(unit) for line in lines)
    assert install.install(root, ("podman",), PREFIX, node_services=True) == []
    assert install.uninstall(root)
    assert snapshot(root) == before


def test_node_services_are_not_installed_unless_asked(root):
    install.install(root, ("podman",), PREFIX)
    assert not os.path.exists(os.path.join(root, "etc/systemd/system/oci-gpu-hook-exporter.service"))


# ---- where install writes: root's alone, all the way up -----------------------------------------

NOBODY = 65534


@pytest.mark.parametrize(
    "directory, change",
    [("usr/local/libexec/oci-gpu-hook", "chown"),  # the launcher's: nobody would replace it
     ("usr/local", "chmod"),  # a parent on the way, group-writable
     ("etc/containers/oci/hooks.d", "chown"),  # what podman and CRI-O run
     ("etc/systemd/system", "chmod"),  # units that systemd runs as root
     ("var/lib/oci-gpu-hook", "chown"),  # the manifest uninstall acts on
     ("", "chmod")],  # the root itself
    ids=["launcher-dir", "parent", "hooks.d", "units", "manifest", "root"],
)  # fmt: skip
def test_install_refuses_a_destination_others_can_change(root, hook_cli, require, monkeypatch, directory, change):
    """A local user who can write the launcher's directory (or any directory above it, or the
    hooks.d, units or manifest directories) gets root at the next container start: install
    refuses with one line and writes nothing."""
    require("root")
    path = os.path.join(root, directory)
    os.makedirs(path, exist_ok=True)
    if change == "chown":
        os.chown(path, NOBODY, NOBODY)
    else:
        os.chmod(path, 0o775)
    before = snapshot(root)
    monkeypatch.setattr(install, "INSTALLED_PATH", os.path.join(root, "no-rpm"))  # install writes the launcher
    with pytest.raises(HookError) as e:
        install.install(root, ("podman", "crio", "docker"), install.hook_command(), node_services=True)
    assert e.value.message.startswith(f"{path.rstrip('/')}: ") and "\n" not in e.value.message
    assert "must be root's and writable by no one else" in e.value.message
    assert snapshot(root) == before
    out = hook_cli("install", "--root", root, "--runtime", "podman")
    assert out.returncode == install.InstallError.exit_code and out.stderr.count("\n") == 1, out.stderr
    assert "Traceback" not in out.stderr and snapshot(root) == before


def test_install_refuses_a_planted_file_others_can_change(root, require):
    """A file already at a destination, in a directory of root's, that another user owns: it
    could be rewritten after install checked it."""
    require("root")
    hooks_d = os.path.join(root, "etc/containers/oci/hooks.d")
    os.makedirs(hooks_d)
    planted = os.path.join(hooks_d, "oci-gpu-hook.json")
    with open(planted, "w") as f:
        f.write(install.hooks_d_text(PREFIX))  # even with the very content install would write
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(HookError, match=f"^{planted}: owned by uid {NOBODY}; runtimes act on it as root"):
        install.install(root, ("podman",), PREFIX)
    os.chown(planted, 0, 0)
    os.chmod(planted, 0o666)
    with pytest.raises(HookError, match="writable by others than root"):
        install.install(root, ("podman",), PREFIX)
    os.chmod(planted, 0o644)
    install.install(root, ("podman",), PREFIX)  # root's alone: taken as install's own


# ---- CRI-O's hooks_dir, checked against what the real CRI-O merges ------------------------------

ADMINS = install.HOOKS_D_DIR
OPENSHIFT = "/run/containers/oci/hooks.d"  # where operators put their hooks on OpenShift


def _crio_file(root, path, dirs):
    full = root + path
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        f.write("[crio.runtime]\n" + (f"hooks_dir = {json.dumps(dirs)}\n" if dirs is not None else ""))


def _doctor_crio(root):
    from oci_gpu_hook.start import settings
    from oci_gpu_hook.toolkit import doctor

    return doctor.Doctor(settings.Settings(), root).check_crio()


@pytest.mark.parametrize(
    "files, dropin",
    [({"/etc/crio/crio.conf": ["/opt/a", "/opt/b", "/opt/c"]}, True),
     ({"/etc/crio/crio.conf": ["/opt/a", ADMINS, "/opt/c"]}, False),
     ({"/etc/crio/crio.conf": ["/opt/a"], "/etc/crio/crio.conf.d/10-openshift.conf": [OPENSHIFT, "/opt/b"]}, True),
     ({"/etc/crio/crio.conf.d/10-openshift.conf": [ADMINS, OPENSHIFT]}, False),
     ({}, True),
     ({"/etc/crio/crio.conf": None}, True)],
    ids=["three-in-crio.conf", "ours-already-listed", "a-drop-in-sets-it", "a-drop-in-lists-ours", "no-files",
         "no-hooks-dir"],
)  # fmt: skip
def test_crio_keeps_every_hooks_dir_it_had_and_reads_ours(root, require, files, dropin):
    """CRI-O does not merge lists: a drop-in's hooks_dir replaces the list. install adds the
    administrators' directory to the list CRI-O reads now (crio.conf, the drop-ins in order, else
    its default), writes nothing when it is there, and uninstall leaves CRI-O as it was: each
    checked in what the real `crio config` merges."""
    import criocheck

    require("root")
    for path, dirs in files.items():
        _crio_file(root, path, dirs)
    before = criocheck.hooks_dirs(root)
    tree = snapshot(root)
    install.install(root, ("crio",), PREFIX)
    after = criocheck.hooks_dirs(root)
    assert os.path.exists(root + install.CRIO_DROPIN) == dropin
    assert after == (before + [ADMINS] if dropin else before)  # every directory kept, in its order
    status, summary, _ = _doctor_crio(root)
    assert status == "PASS" and f"CRI-O reads hooks from {', '.join(after)} (" in summary, summary
    assert f"{ADMINS}/oci-gpu-hook.json is among them, run at createRuntime" in summary
    assert install.install(root, ("crio",), PREFIX) == []  # again: nothing to change
    install.uninstall(root)
    assert criocheck.hooks_dirs(root) == before and snapshot(root) == tree


def test_a_drop_in_read_after_ours_that_leaves_ours_out_is_refused(root, require):
    import criocheck

    require("root")
    late = "/etc/crio/crio.conf.d/99-late.conf"
    _crio_file(root, late, [OPENSHIFT])
    tree = snapshot(root)
    with pytest.raises(HookError) as e:
        install.install(root, ("crio",), PREFIX)
    assert e.value.message.startswith(f"{root}{late}: sets CRI-O's hooks_dir after {install.CRIO_DROPIN} would")
    assert snapshot(root) == tree
    status, summary, _ = _doctor_crio(root)
    assert status == "FAIL" and summary.startswith(f"CRI-O reads hooks from {OPENSHIFT} (hooks_dir in {late})")
    assert criocheck.hooks_dirs(root) == [OPENSHIFT]  # what doctor said is what CRI-O does


def test_every_file_below_crio_conf_d_counts_in_crio_s_order(root, require):
    """CRI-O reads every file below crio.conf.d, whatever its suffix, subdirectories where their
    names fall: the list it ends with is the one install and doctor see."""
    import criocheck

    from oci_gpu_hook.toolkit import runtime_config

    require("root")
    _crio_file(root, "/etc/crio/crio.conf.d/20-no-suffix", ["/opt/no-suffix"])
    _crio_file(root, "/etc/crio/crio.conf.d/30-sub/10.conf", ["/opt/sub"])
    _crio_file(root, "/etc/crio/crio.conf.d/25.conf", ["/opt/25"])
    assert runtime_config.crio_hooks_dirs(root) == (["/opt/sub"], "/etc/crio/crio.conf.d/30-sub/10.conf")
    assert criocheck.hooks_dirs(root) == ["/opt/sub"]


def test_crio_s_built_in_hooks_dir_is_the_one_install_assumes(root, require):
    import criocheck

    from oci_gpu_hook.toolkit import runtime_config

    require("root")
    assert criocheck.config(root, "--default")["crio"]["runtime"]["hooks_dir"] == list(
        runtime_config.CRIO_DEFAULT_HOOKS_DIRS
    )


# Entries an administrator's hooks_dir can hold (issue 36, 4): each must come back as itself.
ODD_HOOKS_DIRS = ['/opt/"quoted"', "/opt/back\\slash", "/opt/new\nline", "/opt/tab\tand\u2028",
                  '"]\n[crio.runtime.runtimes.evil]\nruntime_path = "/tmp/evil"\n#', "/opt/'''", "/opt/é"]  # fmt: skip
# More that TOML allows only escaped (`crio config` prints these in Go's syntax, not TOML's, so
# they are checked with tomllib alone).
CONTROL_HOOKS_DIRS = ["/opt/del\x7f", "/opt/esc\x1b", "/opt/nul\x00"]
ODD_SOURCE = "/etc/crio/crio.conf.d/10-a\nb]\n[crio.runtime.runtimes.evil]\nruntime_path = 'evil'\n#"


def test_the_crio_drop_in_reads_back_as_the_list_it_was_given():
    """TOML read as CRI-O reads it (tomllib, the same grammar): the list is exactly the entries
    given, whatever they hold (a quote, a backslash, a newline, a table of their own), and the
    source's name, written in a comment, can neither end the comment nor add anything."""
    from oci_gpu_hook.toolkit import runtime_config

    for source in (None, "/etc/crio/crio.conf", ODD_SOURCE, "/etc/crio/crio.conf.d/not-utf-8-\udcff"):
        dirs = ODD_HOOKS_DIRS + CONTROL_HOOKS_DIRS + [ADMINS]
        text = install.crio_dropin_text(dirs, source)
        text.encode()  # what install writes: UTF-8
        assert runtime_config.load_toml(text) == {"crio": {"runtime": {"hooks_dir": dirs}}}


def test_without_tomli_w_a_drop_in_is_refused_with_one_line(monkeypatch):
    """tomli-w writes the runtimes' TOML (a dependency a distribution's Python may lack): where it
    is not installed, install says so in one line rather than failing with an ImportError."""
    monkeypatch.setitem(sys.modules, "tomli_w", None)  # an import of it fails, as where it is absent
    for text in (install.crio_dropin_text, install.podman_dropin_text):
        with pytest.raises(install.InstallError) as e:
            text([ADMINS], None)
        assert "needs tomli-w" in e.value.message and "\n" not in e.value.message, e.value.message


def test_crio_reads_back_every_hooks_dir_entry_through_the_drop_in(root, require):
    """The real `crio config` merging crio.conf (hooks_dir entries with a quote, a backslash, a
    newline, and one that would close the list and open [crio.runtime.runtimes.evil]), a drop-in of
    that odd name which sets the list (its name goes into ours as a comment), and install's drop-in:
    CRI-O reads exactly those entries plus ours, and no runtime of the entries' making."""
    import criocheck

    require("root")
    _crio_file(root, "/etc/crio/crio.conf", ["/ignored/by/the/drop-in/below"])
    _crio_file(root, ODD_SOURCE, ODD_HOOKS_DIRS)
    assert criocheck.hooks_dirs(root) == ODD_HOOKS_DIRS  # CRI-O reads that file, name and all
    install.install(root, ("crio",), PREFIX)
    assert criocheck.hooks_dirs(root) == ODD_HOOKS_DIRS + [ADMINS]
    assert "evil" not in criocheck.config(root)["crio"]["runtime"].get("runtimes", {})
    os.unlink(root + ODD_SOURCE)  # now crio.conf's list, from the comment's other source
    install.install(root, ("crio",), PREFIX)
    assert criocheck.hooks_dirs(root) == ["/ignored/by/the/drop-in/below", ADMINS]


def _systemd_commands(unit_text: str, tmp_path) -> dict:
    """{setting: [argv, ...]} of every command systemd itself reads in a unit (ExecStart=, and any
    other Exec*= a bad escape might have let in): systemd-analyze verify loads the unit and, at
    debug level, dumps each command line with its words quoted in C style."""
    import re

    path = tmp_path / "oci-gpu-hook-quoting-test.service"
    path.write_text(unit_text)
    done = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True,
                          env={**os.environ, "SYSTEMD_LOG_LEVEL": "debug"}, timeout=60)  # fmt: skip
    commands, setting = {}, None
    for line in (done.stdout + done.stderr).splitlines():
        found = re.match(r"\s*-> (Exec\w+):$", line)
        if found:
            setting = found.group(1)
        elif setting and line.strip().startswith("Command Line: "):
            commands.setdefault(setting, []).append(_c_words(line.strip()[len("Command Line: ") :]))
    return commands


def _c_words(line: str) -> list:
    """Words as systemd's dump writes them (bare, or in double quotes with C escapes), then as the
    command runs: systemd replaces "$$" with "$" and "${NAME}" with the variable's value (shown
    here as <$NAME>) when it starts the command."""
    import re

    escapes = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}
    words, i = [], 0
    while i < len(line):
        if line[i] == " ":
            i += 1
            continue
        if line[i] != '"':
            end = line.find(" ", i)
            end = len(line) if end < 0 else end
            words.append(line[i:end])
            i = end
            continue
        i, word = i + 1, []
        while line[i] != '"':
            c = line[i]
            if c == "\\":
                c, i = line[i + 1], i + 1
                if c in escapes:
                    c = escapes[c]
                elif c == "x":
                    c, i = chr(int(line[i + 1 : i + 3], 16)), i + 2
                elif c.isdigit():
                    c, i = chr(int(line[i : i + 3], 8)), i + 2
            word.append(c)
            i += 1
        words.append(re.sub(r"\$\$|\$\{(\w+)\}", lambda m: f"<${m.group(1)}>" if m.group(1) else "$", "".join(word)))
        i += 1
    return words


@pytest.mark.parametrize(
    "config",
    ['/etc/gpu/a"b\\c\nExecStartPre=/bin/false\n[Install]\x01é\t;', "/etc/gpu/%n ${HOME} $$ $PATH.yaml"],
    ids=["a-line-of-its-own", "specifiers-and-variables"],
)
@pytest.mark.parametrize("unit", ["refresh", "node-service"])
def test_systemd_reads_back_every_word_of_a_units_command(tmp_path, require, unit, config):
    """A --config path goes into the units' ExecStart=: whatever it holds (a quote, a backslash,
    a newline followed by a setting of its own, systemd's % specifiers and $ variables), the
    command systemd reads and runs is exactly the words install meant, and there is no other."""
    require("systemd-analyze")
    prefix = ["/usr/bin/oci-gpu-hook", "--config", config]
    if unit == "refresh":
        text, args = install.service_text(prefix), ["inventory", "refresh"]
    else:
        text, args = install.node_service_text(prefix, "d", "labels", "--watch", "60"), ["labels", "--watch", "60"]
    assert _systemd_commands(text, tmp_path) == {"ExecStart": [prefix + args]}


def _forge_manifest(root, doc, owner=0):
    path = os.path.join(root, install.MANIFEST.lstrip("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f)
    os.chown(path, owner, owner)
    return path


@pytest.mark.parametrize("case", ["outside-the-root", "not-installs-path", "saved-elsewhere", "a-stray-directory",
                                  "a-users-manifest"])  # fmt: skip
def test_uninstall_acts_only_on_what_install_could_have_written(root, tmp_path, require, case):
    """uninstall removes and moves, as root, what the manifest names: a manifest naming anything
    else (a path outside the root, a file install never writes, NVIDIA's program set aside to
    somewhere else), or one another user could have written, is refused, and nothing changes."""
    require("root")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "pub.txt").write_text("keep me\n")
    checksum = "sha256:" + __import__("hashlib").sha256(b"keep me\n").hexdigest()
    doc = {"format": 1, "files": {}, "directories": []}
    if case == "outside-the-root":
        doc["files"]["/../victim/pub.txt"] = checksum
    elif case == "not-installs-path":
        doc["files"]["/etc/passwd"] = checksum
    elif case == "saved-elsewhere":
        doc["saved"] = {"/etc/ld.so.preload": "/../victim/pub.txt"}
    elif case == "a-stray-directory":
        doc["directories"] = ["/../victim"]
    path = _forge_manifest(root, doc, owner=65534 if case == "a-users-manifest" else 0)
    before, outside = snapshot(root), snapshot(str(victim))
    with pytest.raises(HookError) as e:
        install.uninstall(root)
    assert e.value.message.startswith(path) and "\n" not in e.value.message
    assert snapshot(root) == before and snapshot(str(victim)) == outside


@pytest.mark.parametrize("change", ["chown", "chmod", "parent"])
def test_a_configuration_others_can_change_is_not_wired_in(root, tmp_path, require, change):
    """install writes --config into the hooks.d file and the units: a file another user could edit
    would decide what every container gets."""
    require("root")
    directory = os.path.join(root, "etc/gpu")  # --config names a path of the tree install writes into
    os.makedirs(directory)
    config = os.path.join(directory, "config.yaml")
    with open(config, "w") as f:
        f.write("{}\n")
    if change == "chown":
        os.chown(config, 65534, 65534)
    elif change == "chmod":
        os.chmod(config, 0o666)
    else:
        os.chmod(directory, 0o777)
    before = snapshot(root)
    with pytest.raises(HookError, match="the configuration decides what containers get"):
        install.install(root, ("podman",), PREFIX + ["--config", "/etc/gpu/config.yaml"])
    assert snapshot(root) == before
    os.chown(config, 0, 0)
    os.chmod(config, 0o644)
    os.chmod(directory, 0o755)
    assert install.install(root, ("podman",), PREFIX + ["--config", "/etc/gpu/config.yaml"])  # root's alone


# ---- --root: every path resolved inside the tree --------------------------------------------------

# Each kind of directory install writes into, as a link an image layer unpacked by root can hold in
# its place, and the runtimes that make install write there.
TREE_DIRECTORIES = [
    ("etc/systemd", ("podman",)),  # the units and their .wants links
    ("etc/containers", ("podman",)),  # the hooks.d file
    ("etc/crio", ("crio",)),  # CRI-O's drop-in (and crio.conf, which install reads)
    ("etc/udev", ("podman",)),  # the udev rule
    ("etc/oci-gpu-hook", ("podman",)),  # the default configuration
    ("usr/local/libexec", ("podman",)),  # the launcher
    ("var/lib", ("podman",)),  # the manifest
    ("usr/bin", ("docker",)),  # Docker's program
]


def _host_stand_in(tmp_path, directory):
    """A directory standing for the build host's own (the test never touches the real one), with
    a file of its own in it: what install must leave exactly as it is."""
    host = tmp_path / "host" / directory
    host.mkdir(parents=True)
    (host / "the-hosts-own").write_text("keep me\n")
    return str(host)


def _link(root, directory, target, relative=False):
    """A link at root/directory (in place of what is there) to target."""
    import shutil

    path = os.path.join(root, directory)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    os.symlink(os.path.relpath(target, os.path.dirname(path)) if relative else target, path)
    return path


@pytest.mark.parametrize("form", ["absolute", "relative"])
@pytest.mark.parametrize("directory, runtimes", TREE_DIRECTORIES, ids=[d for d, _ in TREE_DIRECTORIES])
def test_install_never_follows_a_trees_link_out_of_it(root, tmp_path, hook_cli, require, directory, runtimes, form):
    """Issue 36, 1: a root-owned link in an image tree (DIR/etc/systemd -> /etc/systemd, as any
    layer unpacked by root may hold) made install write the build host's own hooks.d file, units
    and .wants links. Every path is resolved inside the tree now: a link whose target is not in
    the tree (an absolute one, or one that climbs out with ..) leads nowhere, and install refuses
    with one line, writing nothing in the tree and nothing where the link points."""
    require("root")
    if directory == "usr/local/libexec":
        assert install.hook_command() == [launcher.LAUNCHER]  # install writes the launcher there
    host = _host_stand_in(tmp_path, directory)
    link = _link(root, directory, host, relative=form == "relative")
    before, host_before = snapshot(root), snapshot(str(tmp_path / "host"))
    args = [a for r in runtimes for a in ("--runtime", r)]
    out = hook_cli("install", "--root", root, *args, "--no-prefilter")
    assert out.returncode == install.InstallError.exit_code, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"oci-gpu-hook: {link}: a symlink to "), out.stderr
    assert "leads nowhere inside" in out.stderr
    assert snapshot(str(tmp_path / "host")) == host_before and snapshot(root) == before


def test_the_issues_own_tree_leaves_the_hosts_etc_alone(root, tmp_path, require):
    """The tree of the report itself: DIR/etc/systemd -> /etc/systemd and DIR/etc/containers ->
    /etc/containers. Inside the tree each link is its own path, a loop: install refuses with one
    line. Run in a mount namespace of its own with an empty tmpfs over each of the host's two
    directories, so that even an install that followed the links would write only there; what
    it wrote there is listed before the namespace goes."""
    require("root", "unshare")
    targets = [d for d in ("/etc/systemd", "/etc/containers") if os.path.isdir(d)]
    assert targets, "neither /etc/systemd nor /etc/containers on this host"
    for target in targets:
        _link(root, target.lstrip("/"), target)
    before = snapshot(root)
    listing = tmp_path / "written-on-the-host"
    script = "; ".join(f"mount -t tmpfs -o mode=0755 oci-gpu-hook-test {t}" for t in targets) + (
        '; "$0" -I -m oci_gpu_hook install --root "$1" --runtime podman --runtime crio --no-prefilter; rc=$?; '
        f'find {" ".join(targets)} -mindepth 1 > "$2"; exit $rc'
    )
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, sys.executable, root,
                          str(listing)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == install.InstallError.exit_code, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "too many levels of symbolic links" in out.stderr.lower(), out.stderr
    assert listing.read_text() == "" and snapshot(root) == before


def _sha256(data: bytes) -> str:
    import hashlib

    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("case", ["units-link-out", "manifest-directory-links-out", "manifest-is-a-link"])
def test_uninstall_never_follows_a_trees_link_out_of_it(root, tmp_path, hook_cli, require, case):
    """Issue 36, 1: uninstall trusted a tree's manifest (any layer's root 0644 file) and removed a
    unit file outside the tree through DIR/etc/systemd -> /etc/systemd, then its directory. Now the
    manifest is the tree's own file, and what it names is resolved inside the tree: a link out of
    it is refused with one line, before anything is removed, in the tree or where it points."""
    require("root")
    unit = install.UNIT_DIR + "/" + install.SERVICE
    doc = {"format": 1, "files": {unit: _sha256(b"keep me\n")}, "directories": [install.UNIT_DIR]}
    if case == "units-link-out":
        host = _host_stand_in(tmp_path, "etc/systemd")
        os.makedirs(os.path.join(host, "system"))
        with open(os.path.join(host, "system", install.SERVICE), "w") as f:
            f.write("keep me\n")
        link = _link(root, "etc/systemd", host)
        _forge_manifest(root, doc)
    else:
        # The tree's own unit, which a manifest from outside the tree names.
        os.makedirs(root + install.UNIT_DIR)
        with open(root + unit, "w") as f:
            f.write("keep me\n")
        host = _host_stand_in(tmp_path, "var/lib/oci-gpu-hook")
        with open(os.path.join(host, "install-manifest.json"), "w") as f:
            json.dump(doc, f)
        if case == "manifest-directory-links-out":
            link = _link(root, "var/lib/oci-gpu-hook", host)
        else:
            os.makedirs(os.path.dirname(root + install.MANIFEST))
            link = _link(root, install.MANIFEST.lstrip("/"), os.path.join(host, "install-manifest.json"))
    before, host_before = snapshot(root), snapshot(str(tmp_path / "host"))
    out = hook_cli("uninstall", "--root", root)
    assert out.returncode == install.InstallError.exit_code, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"oci-gpu-hook: {link}: a symlink"), out.stderr
    assert snapshot(str(tmp_path / "host")) == host_before and snapshot(root) == before


@pytest.mark.parametrize("case", ["links-out", "links-inside", "a-fifo"])
def test_uninstall_edits_only_the_trees_own_config_toml(root, tmp_path, hook_cli, require, case):
    """The manifest's one edit (containerd's config.toml, its first line) was made through a link
    at the tree's config.toml: uninstall read the file it points to, from the build host's own /
    (its registry credentials, say), and wrote it into the tree without the line. install never
    edits a link (containerd.plan refuses one), so uninstall edits only the tree's own file and
    keeps anything else, with one line; a FIFO there hung it."""
    from oci_gpu_hook.toolkit import containerd

    require("root")
    secret = containerd.IMPORT_LINE + 'password = "the build host\'s own"\n'
    host = _host_stand_in(tmp_path, "etc/containerd")
    with open(os.path.join(host, "config.toml"), "w") as f:
        f.write(secret)
    config = root + containerd.CONFIG
    os.makedirs(os.path.dirname(config))
    if case == "links-out":
        os.symlink(os.path.join(host, "config.toml"), config)
    elif case == "links-inside":
        with open(root + "/etc/containerd/real.toml", "w") as f:
            f.write(secret)
        os.symlink("/etc/containerd/real.toml", config)
    else:
        os.mkfifo(config)
    _forge_manifest(root, {"format": 1, "files": {}, "directories": [],
                           "edited": {containerd.CONFIG: containerd.IMPORT_LINE}})  # fmt: skip
    before, host_before = snapshot(root), snapshot(str(tmp_path / "host"))
    out = hook_cli("uninstall", "--root", root)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert f"kept {config}: " in out.stdout, out.stdout
    assert snapshot(str(tmp_path / "host")) == host_before  # never read, never written

    def kept(tree):  # all but the manifest uninstall removed, and its directory
        return {k: v for k, v in tree.items() if "oci-gpu-hook" not in k}

    assert kept(snapshot(root)) == kept(before)


@pytest.mark.parametrize(
    "runtime, path",
    [
        ("containerd", "/etc/containerd/config.toml"),
        ("crio", "/etc/crio/crio.conf"),
        ("crio", "/etc/crio/crio.conf.d/10-site.conf"),
        ("podman", "/etc/containers/containers.conf"),
        ("podman", "/etc/containers/containers.conf.d/10-site.conf"),
    ],
)
@pytest.mark.parametrize("kind", ["device", "too-large"])
def test_install_opens_only_a_regular_file_of_the_tree_and_reads_it_bounded(root, hook_cli, require, runtime, path,
                                                                             kind):  # fmt: skip
    """A layer unpacked by root can hold a device node where a runtime's configuration is: install
    opened it as root to read it (a watchdog's numbers arm the watchdog on open; with /dev/zero's,
    containerd's config.toml was read until memory ran out), and read a file of any size whole.
    The device here has a number no driver has, so that opening it fails (ENXIO): only an open
    can tell. Now the place is never opened unless it is a regular file, and at most
    tree.MAX_READ bytes are read: one line, nothing written."""
    from oci_gpu_hook.toolkit import tree

    require("root")
    full = root + path
    os.makedirs(os.path.dirname(full), exist_ok=True)
    if kind == "device":
        os.mknod(full, 0o644 | stat.S_IFCHR, os.makedev(511, 0))
    else:
        with open(full, "wb") as f:
            f.truncate(tree.MAX_READ + 1)  # sparse: NULs, valid UTF-8
    before = snapshot(root)
    out = hook_cli("install", "--root", root, "--runtime", runtime, "--no-prefilter")
    assert out.returncode == install.InstallError.exit_code, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    why = "not a regular file" if kind == "device" else f"larger than {tree.MAX_READ} bytes"
    assert out.stderr.startswith(f"oci-gpu-hook: {full}: unreadable ({why})"), out.stderr
    assert snapshot(root) == before


def test_a_huge_file_at_a_destination_is_never_read_whole(root, require):
    """install compares what is at each destination with what it writes: an image's sparse file of
    gigabytes there was read whole into memory (MemoryError under this limit; the build host's memory
    without one). Now at most install.CURRENT_LIMIT bytes are read: not install's file, one line."""
    import resource

    from oci_gpu_hook.toolkit.containers import hook_command

    require("root")
    os.makedirs(root + install.HOOKS_D_DIR)
    with open(root + install.HOOKS_D_FILE, "wb") as f:
        f.truncate(3 << 30)  # more than the memory the CLI is given
    before = hookcheck.tree(root, times=True)  # not the contents: reading them takes long
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # noqa: E731
    out = subprocess.run([*hook_command(), "install", "--root", root, "--no-prefilter"], capture_output=True,
                         text=True, timeout=300, preexec_fn=limit)  # fmt: skip
    assert out.returncode == install.InstallError.exit_code, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "exists and was not written by oci-gpu-hook install" in out.stderr
    assert hookcheck.tree(root, times=True) == before


def test_install_reads_the_trees_crio_configuration_not_the_hosts(root, tmp_path, require):
    """install copies the hooks_dir list CRI-O reads into its drop-in: a tree's crio.conf that
    links out of the tree must not make it read (and so copy) the build host's. Inside the tree
    that link leads nowhere, as CRI-O in the image would find: no crio.conf, CRI-O's default."""
    import criocheck

    require("root")
    host = _host_stand_in(tmp_path, "etc/crio")
    _crio_file(host, "/crio.conf", ["/the/hosts/own/hooks.d"])
    os.makedirs(os.path.join(root, "etc/crio/crio.conf.d"))
    _link(root, "etc/crio/crio.conf", os.path.join(host, "crio.conf"))
    host_before = snapshot(str(tmp_path / "host"))
    install.install(root, ("crio",), PREFIX)
    with open(root + install.CRIO_DROPIN) as f:
        assert "/the/hosts/own" not in f.read()
    os.unlink(os.path.join(root, "etc/crio/crio.conf"))  # what CRI-O reads: the drop-in alone
    assert criocheck.hooks_dirs(root) == ["/usr/share/containers/oci/hooks.d", ADMINS]
    assert snapshot(str(tmp_path / "host")) == host_before


def test_the_runtimes_configuration_is_read_inside_the_tree(root, tmp_path):
    """What doctor and install read of podman's and CRI-O's configuration under a root: each file
    as the image finds it, its links followed inside the tree, never to the build host's."""
    from oci_gpu_hook.toolkit import runtime_config

    host = _host_stand_in(tmp_path, "etc")
    with open(os.path.join(host, "containers.conf"), "w") as f:
        f.write('[engine]\nhooks_dir = ["/the/hosts/own"]\n')
    _crio_file(host, "/crio.conf", ["/the/hosts/own"])
    _link(root, "etc/containers/containers.conf", os.path.join(host, "containers.conf"))
    _link(root, "etc/crio", host)
    assert runtime_config.podman_hooks_dirs(root) == (list(runtime_config.PODMAN_DEFAULT_HOOKS_DIRS), None)
    assert runtime_config.crio_hooks_dirs(root) == (list(runtime_config.CRIO_DEFAULT_HOOKS_DIRS), None)
    # A link that stays inside the tree, absolute as in the image, is followed there.
    os.makedirs(os.path.join(root, "usr/share/crio"))
    _crio_file(root, "/usr/share/crio/crio.conf", ["/the/images/own"])
    os.unlink(os.path.join(root, "etc/crio"))
    _link(root, "etc/crio/crio.conf", "/usr/share/crio/crio.conf")
    assert runtime_config.crio_hooks_dirs(root) == (["/the/images/own"], "/etc/crio/crio.conf")


@pytest.mark.parametrize("form", ["relative", "absolute"])
def test_a_trees_links_that_stay_inside_it_keep_working(root, tmp_path, hook_cli, require, form):
    """Links an image means (etc/systemd -> ../usr/lib/systemd; usr/local -> /opt/local, absolute
    as the image reads it): install writes where the image will look, inside the tree, and
    uninstall leaves the tree byte-identical. (Targets of names this host lacks: an install that
    followed the absolute links on the host could not write there.)"""
    require("root")
    for directory in ("usr/lib/systemd-of-the-image", "opt/local-of-the-image", "usr/bin"):
        os.makedirs(os.path.join(root, directory))
    if form == "relative":
        _link(root, "etc/systemd", os.path.join(root, "usr/lib/systemd-of-the-image"), relative=True)
        _link(root, "usr/local", os.path.join(root, "opt/local-of-the-image"), relative=True)
    else:
        _link(root, "etc/systemd", "/usr/lib/systemd-of-the-image")
        _link(root, "usr/local", "/opt/local-of-the-image")
    _link(root, "bin", "usr/bin")
    before = snapshot(root)
    out = hook_cli("install", "--root", root, "--runtime", "podman", "--runtime", "crio", "--runtime", "docker",
                   "--no-prefilter", "--node-services")  # fmt: skip
    assert out.returncode == 0, out.stderr
    units = os.path.realpath(os.path.join(root, "usr/lib/systemd-of-the-image/system"))
    assert os.path.isfile(os.path.join(units, install.SERVICE)), out.stdout
    assert os.readlink(os.path.join(units, "multi-user.target.wants", install.SERVICE)) == f"../{install.SERVICE}"
    assert launcher.is_launcher(os.path.join(root, "opt/local-of-the-image/libexec/oci-gpu-hook/oci-gpu-hook"))
    assert f"wrote {units}/{install.SERVICE}" in out.stdout.splitlines()
    again = hook_cli("install", "--root", root, "--runtime", "podman", "--runtime", "crio", "--runtime", "docker",
                     "--no-prefilter", "--node-services")  # fmt: skip
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr
    gone = hook_cli("uninstall", "--root", root)
    assert gone.returncode == 0 and f"removed {units}/{install.SERVICE}" in gone.stdout, gone.stdout + gone.stderr
    assert snapshot(root) == before


# ---- podman's hooks_dir, checked against what the real podman merges -----------------------------

PACKAGES = "/usr/share/containers/oci/hooks.d"
# Entries that TOML, podman's list and its --help's CSV must each keep as they are.
ODD = ['/opt/gpu "hooks", d', "/opt/back\\slash", "/opt/new\nline"]


def podman_reads(root):
    """The hooks directories the real podman reads with the tree's containers.conf files in place of
    the host's (a private mount namespace; /usr/share/containers empty where the tree has none),
    in podman's own words (`podman --help`, runtime_config.podman_effective_hooks_dirs)."""
    mounts = []
    for directory in ("/etc/containers", "/usr/share/containers"):
        source = root + directory
        mounts.append(f"mount --bind {source} {directory}" if os.path.isdir(source)
                      else f"mount -t tmpfs -o mode=0755 podman-reads {directory}")  # fmt: skip
    code = ("import json; from oci_gpu_hook.toolkit import runtime_config as r; "
            "print(json.dumps(r.podman_effective_hooks_dirs()))")  # fmt: skip
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", " && ".join(mounts) +
                          ' && exec "$0" -I -c "$1"', sys.executable, code], capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _podman_file(root, path, dirs):
    full = root + path
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        f.write("[engine]\n" + (f"hooks_dir = {json.dumps(dirs)}\n" if dirs is not None else ""))


@pytest.mark.parametrize(
    "files, dropin",
    [({}, True),
     ({"/etc/containers/containers.conf": ["/opt/a", *ODD]}, True),
     ({"/etc/containers/containers.conf": ["/opt/a", ADMINS]}, False),
     ({"/usr/share/containers/containers.conf": [PACKAGES, "/opt/pkg"],
       "/etc/containers/containers.conf.d/10-site.conf": [OPENSHIFT, PACKAGES]}, True),
     ({"/etc/containers/containers.conf.d/10-site.conf": ["/opt/a"],
       "/etc/containers/containers.conf.d/20-not-conf.toml": ["/opt/not-read"]}, True),
     ({"/etc/containers/containers.conf": []}, True),
     ({"/etc/containers/containers.conf": None}, True)],
    ids=["no-files", "odd-entries", "ours-already-listed", "drop-in-over-packages", "only-conf-suffix", "empty-list",
         "no-hooks-dir"],
)  # fmt: skip
def test_podman_keeps_every_hooks_dir_it_had_and_reads_ours(root, require, files, dropin):
    """podman's containers.conf files replace lists as CRI-O's do: install adds the administrators'
    directory to the list podman reads now (its files in its order, else its default), writes
    nothing when it is there, and uninstall leaves podman as it was: each checked in what the real
    podman merges."""
    from oci_gpu_hook.toolkit import runtime_config

    require("root", "podman", "unshare")
    for path, dirs in files.items():
        _podman_file(root, path, dirs)
    before = podman_reads(root)
    assert runtime_config.podman_hooks_dirs(root)[0] == before  # read as podman reads it
    tree = snapshot(root)
    install.install(root, ("podman",), PREFIX)
    assert os.path.exists(root + install.PODMAN_DROPIN) == dropin
    after = podman_reads(root)
    assert after == (before + [ADMINS] if dropin else before)  # every directory kept, in its order
    assert install.install(root, ("podman",), PREFIX) == []  # again: nothing to change
    install.uninstall(root)
    assert podman_reads(root) == before and snapshot(root) == tree


def test_a_podman_drop_in_read_after_ours_that_leaves_ours_out_is_refused(root):
    late = "/etc/containers/containers.conf.d/99-late.conf"
    _podman_file(root, late, [OPENSHIFT])
    _podman_file(root, "/usr/share/containers/containers.conf", [PACKAGES])  # read before: replaced, fine
    tree = snapshot(root)
    with pytest.raises(HookError) as e:
        install.install(root, ("podman",), PREFIX)
    assert e.value.message.startswith(f"{root}{late}: sets podman's hooks_dir after {install.PODMAN_DROPIN} would")
    assert "\n" not in e.value.message and snapshot(root) == tree


def test_podman_s_append_marker_adds_to_the_list_before(root):
    """podman 5 (containers/common 0.57+): a list ending with {append = true} adds to the one before."""
    from oci_gpu_hook.toolkit import runtime_config

    os.makedirs(root + "/etc/containers/containers.conf.d")
    with open(root + "/etc/containers/containers.conf.d/10-more.conf", "w") as f:
        f.write('[engine]\nhooks_dir = ["/opt/more", {append = true}]\n')
    dirs, source = runtime_config.podman_hooks_dirs(root)
    assert (dirs, source) == ([PACKAGES, "/opt/more"], "/etc/containers/containers.conf.d/10-more.conf")


def _rpm_start_server(root, socket=True, units=True):
    """What the RPM puts in a tree for the start server (rpm/oci-gpu-hook.spec): /usr/bin/oci-gpu-hook,
    the pre-filter built as the spec builds it (socket: with the start server's socket, as from
    this version on), and units: the two units in /usr/lib/systemd/system, as the spec writes them."""
    from oci_gpu_hook.start import prefilter_rule
    from oci_gpu_hook.toolkit import prefilter

    os.makedirs(root + "/usr/bin")
    prefilter.build(root + install.INSTALLED_PATH, "/usr/libexec/oci-gpu-hook/oci-gpu-hook-python",
                    start_server=prefilter_rule.START_SERVER_SOCKET if socket else None)  # fmt: skip
    if units:
        os.makedirs(root + install.PACKAGE_UNIT_DIR)
        with open(f"{root}{install.PACKAGE_UNIT_DIR}/{install.START_SOCKET}", "w") as f:
            f.write(install.start_socket_text(install.START_UNITS_BY_PACKAGE))
        with open(f"{root}{install.PACKAGE_UNIT_DIR}/{install.START_SERVICE}", "w") as f:
            f.write(install.start_service_text([install.PACKAGE_START_LAUNCHER], install.START_UNITS_BY_PACKAGE))


def _is_enabled(root, unit):
    """systemd's own answer, offline, for the tree: enabled, disabled, or its error."""
    done = subprocess.run(["systemctl", f"--root={root}", "is-enabled", unit], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    return (done.stdout + done.stderr).strip()


@pytest.mark.parametrize("config", [None, "/etc/oci-gpu-hook/other.yaml"], ids=["default", "config"])
def test_start_server_on_an_rpm_host_enables_the_packages_units(root, require, config):
    """On a host where the RPM ships the start server's units, install --start-server enables them,
    as `systemctl enable` does (one link to the package's socket), and writes no copies in
    /etc/systemd/system: those would shadow the package's units, whose next version an upgrade
    installs. With a --config too: the server reads none (each worker runs the hook's own
    arguments). uninstall removes the link, leaving the package's units as they were."""
    require("root", "gcc", "systemctl")
    _rpm_start_server(root)
    before = snapshot(root)
    assert _is_enabled(root, install.START_SOCKET) == "disabled"
    prefix = PREFIX + (["--config", config] if config else [])
    lines = install.install(root, ("runc",), prefix, start_server=True)
    link = f"{root}{install.UNIT_DIR}/sockets.target.wants/{install.START_SOCKET}"
    assert f"wrote {link}" in lines
    assert os.readlink(link) == f"{install.PACKAGE_UNIT_DIR}/{install.START_SOCKET}"
    assert _is_enabled(root, install.START_SOCKET) == "enabled"
    for unit in (install.START_SOCKET, install.START_SERVICE):
        assert not os.path.lexists(f"{root}{install.UNIT_DIR}/{unit}"), unit
    # The very link systemd's own enable makes, in a copy of the tree before install.
    copy = os.path.join(os.path.dirname(root), "enabled-by-systemctl")
    subprocess.run(["cp", "-a", root, copy], check=True)
    os.unlink(copy + link[len(root) :])
    subprocess.run(["systemctl", f"--root={copy}", "enable", install.START_SOCKET], capture_output=True, check=True)
    assert os.readlink(copy + link[len(root) :]) == os.readlink(link)
    assert install.install(root, ("runc",), prefix, start_server=True) == []  # again: nothing to change
    install.uninstall(root)
    assert _is_enabled(root, install.START_SOCKET) == "disabled"
    assert snapshot(root) == before


def test_start_server_without_the_packages_units_writes_its_own(root, require):
    """/usr/bin/oci-gpu-hook a pre-filter but no units shipped beside it: install writes its own."""
    require("root", "gcc", "systemctl")
    _rpm_start_server(root, units=False)
    install.install(root, ("runc",), PREFIX, start_server=True)
    with open(f"{root}{install.UNIT_DIR}/{install.START_SERVICE}") as f:
        assert f.read() == install.start_service_text([install.START_LAUNCHER])
    assert launcher.is_launcher(root + install.START_LAUNCHER)
    link = f"{root}{install.UNIT_DIR}/sockets.target.wants/{install.START_SOCKET}"
    assert os.readlink(link) == f"../{install.START_SOCKET}"
    assert _is_enabled(root, install.START_SOCKET) == "enabled"


def test_the_start_server_runs_a_launcher_of_its_own(root, require, tmp_path):
    """The server's service runs its own launcher, never the hook's program: that file alone is
    the entry point of the server's SELinux domain (selinux/oci_gpu_hook.fc), so a start a runtime
    runs itself stays in the runtime's domain. It is a launcher of this install, its own file
    (not a link, which would share the label), root's and 0755; systemd reads the service's
    command as that launcher with the hook's options; it runs; uninstall removes it."""
    require("root", "gcc", "systemd-analyze")
    from oci_gpu_hook.toolkit import prefilter

    before = snapshot(root)
    prefix = [launcher.LAUNCHER, "--config", "/etc/gpu/config.yaml"]
    lines = install.install(root, ("runc",), prefix, prefilter=True, start_server=True)
    server = root + install.START_LAUNCHER
    assert f"wrote {server}" in lines
    assert lines.index(f"wrote {server}") < lines.index(f"wrote {root}{install.UNIT_DIR}/{install.START_SERVICE}")
    with open(server) as f:
        text = f.read()
    assert launcher.is_launcher(server) and text.startswith(f"#!{sys.executable} -IS\n") and "main()" in text
    assert install.START_SERVICE in text and "oci_gpu_hook_start_exec_t" in text
    st = os.lstat(server)
    assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == 0 and st.st_mode & 0o777 == 0o755
    # The hook's program, which runtimes run, is another file: the pre-filter, then its launcher.
    assert prefilter.is_prefilter(root + launcher.LAUNCHER) and launcher.is_launcher(root + launcher.PYTHON_LAUNCHER)
    assert install.START_LAUNCHER not in (launcher.LAUNCHER, launcher.PYTHON_LAUNCHER)
    with open(f"{root}{install.UNIT_DIR}/{install.START_SERVICE}") as f:
        unit = f.read()
    assert _systemd_commands(unit, tmp_path) == {"ExecStart": [[install.START_LAUNCHER, *prefix[1:], "start-server"]]}
    done = subprocess.run([server, "--version"], capture_output=True, text=True, env={}, cwd="/", timeout=60)
    assert done.returncode == 0 and "oci-gpu-hook" in done.stdout, done.stderr
    assert install.install(root, ("runc",), prefix, prefilter=True, start_server=True) == []  # again: nothing
    assert f"removed {server}" in install.uninstall(root)
    assert snapshot(root) == before


def test_start_server_refuses_a_prefilter_that_offers_no_start(root, require):
    """A pre-filter built without the start server's socket (an RPM from before it) would never
    offer the server a start: install --start-server says so in one line and writes nothing."""
    require("root", "gcc")
    _rpm_start_server(root, socket=False)
    before = snapshot(root)
    with pytest.raises(HookError) as e:
        install.install(root, ("runc",), PREFIX, start_server=True)
    assert e.value.message.startswith(f"--start-server: {root}{install.INSTALLED_PATH} is a pre-filter built "
                                      "without the start server's socket")  # fmt: skip
    assert "\n" not in e.value.message and snapshot(root) == before


def test_the_start_server_is_installed_by_default_wherever_the_prefilter_is(root, require, monkeypatch):
    """Asked for nothing, install puts the start server's units and their link in place wherever
    runtimes run the pre-filter it builds (which is what offers the server its starts);
    --no-start-server writes none; and where no pre-filter can be built (no compiler), none
    either, and no error: the units would run a server no start reaches."""
    require("root", "gcc", "systemctl")
    from oci_gpu_hook.start import prefilter_rule
    from oci_gpu_hook.toolkit import prefilter

    units = [f"{install.UNIT_DIR}/{install.START_SOCKET}", f"{install.UNIT_DIR}/{install.START_SERVICE}",
             install.START_SOCKET_LINK, install.START_LAUNCHER]  # fmt: skip
    before = snapshot(root)
    install.install(root, ("runc",), [launcher.LAUNCHER])
    assert prefilter.offers_to(root + launcher.LAUNCHER) == prefilter_rule.START_SERVER_SOCKET
    assert all(os.path.lexists(root + path) for path in units), units
    assert _is_enabled(root, install.START_SOCKET) == "enabled"
    with open(f"{root}{install.UNIT_DIR}/{install.START_SERVICE}") as f:
        assert "\nOOMPolicy=continue\n" in f.read()  # a worker killed for memory leaves the server up
    install.uninstall(root)
    assert snapshot(root) == before

    install.install(root, ("runc",), [launcher.LAUNCHER], start_server=False)
    assert prefilter.is_prefilter(root + launcher.LAUNCHER)  # the pre-filter still, with no units
    assert not [path for path in units if os.path.lexists(root + path)]
    install.uninstall(root)

    monkeypatch.setenv("CC", "no-such-compiler-here")
    warned = []
    install.install(root, ("runc",), [launcher.LAUNCHER], warn=warned.append)
    assert launcher.is_launcher(root + launcher.LAUNCHER) and warned == []
    assert not [path for path in units if os.path.lexists(root + path)]
    install.uninstall(root)
    assert snapshot(root) == before


def test_uninstall_removes_what_names_a_program_before_the_program(root, require):
    """A container started while uninstall runs gets the hook or none, never a hooks.d entry (or a
    unit, or Docker's pre-filter) naming a program already gone: every file that names one of
    install's programs goes first, then each program after whatever runs it, the reverse of the
    order install writes them in."""
    require("gcc")
    plant_nvidias_hook(root)
    before = snapshot(root)
    install.install(root, ("crio", "podman", "docker"), [launcher.LAUNCHER], replace_nvidia_hook=True,
                    prefilter=True, start_server=True)  # fmt: skip
    lines = install.uninstall(root)
    said = [line.split(" ", 1)[1][len(root) :] for line in lines if line.startswith(("removed /", "restored /"))]
    programs = [p for p in said if p in install.PROGRAMS_REMOVED_LAST]
    assert programs == list(install.PROGRAMS_REMOVED_LAST), said  # each after what runs it
    first_program = said.index(programs[0])
    assert set(said[:first_program]) >= {install.HOOKS_D_FILE, install.CRIO_DROPIN, install.DOCKER_HOOK,
                                         f"{install.UNIT_DIR}/{install.START_SERVICE}"}, said  # fmt: skip
    assert said[first_program:] == programs, said
    assert snapshot(root) == before


def test_a_link_install_replaces_is_never_missing(tmp_path):
    """install replaces a link (a unit's wants link whose target changed) in one rename: a reader
    resolving it all the while never finds nothing there, and no spare is left beside it."""
    path = str(tmp_path / "link")
    os.symlink("a", path)
    # The reader says it is reading before the swaps start, and counts its reads: a reader that
    # started late would show nothing.
    reader = subprocess.Popen([sys.executable, "-c", (
        "import os, sys\n"
        "missing = reads = 0\n"
        "os.readlink(sys.argv[1])\n"
        "print('reading', flush=True)\n"
        "while not os.path.exists(sys.argv[1] + '.stop'):\n"
        "    reads += 1\n"
        "    try:\n"
        "        os.readlink(sys.argv[1])\n"
        "    except FileNotFoundError:\n"
        "        missing += 1\n"
        "print(missing, reads)\n"), path], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert reader.stdout.readline() == "reading\n"
        for i in range(3000):
            install._link_atomically("ab"[i % 2], path)
    finally:
        open(path + ".stop", "w").close()
        out, _ = reader.communicate(timeout=30)
    missing, reads = map(int, out.split())
    assert missing == 0 and reads >= 100, (missing, reads)
    assert os.readlink(path) == "b" and sorted(os.listdir(tmp_path)) == ["link", "link.stop"]


def test_start_units_is_only_for_an_install_into_the_root(root, hook_cli):
    """--start-units acts on the running systemd: refused for a tree, before anything is written."""
    before = snapshot(root)
    out = hook_cli("install", "--root", root, "--start-units")
    assert out.returncode == 2 and "--start-units: only when installing into /" in out.stderr, out.stderr
    assert snapshot(root) == before
