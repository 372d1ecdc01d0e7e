"""install / uninstall under --root: byte-identical round trip, idempotence, administrators' files."""

import json
import os
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
    before = snapshot(root)
    lines = install.install(root, ("docker",), PREFIX + ["--config", "/etc/gpu/config.yaml"])
    program = root + install.DOCKER_HOOK
    assert f"wrote {program}" in lines
    assert os.stat(program).st_mode & 0o777 == 0o755
    text = open(program).read()
    # A launcher of this install itself, no shell in front of it (toolkit/launcher.py).
    assert text.startswith(f"#!{sys.executable} -IS\n") and install.DOCKER_HOOK_MARKER in text
    assert launcher.is_launcher(program)
    assert text.rstrip().endswith("sys.exit(main(options=['--config', '/etc/gpu/config.yaml']))")
    assert install.install(root, ("docker",), PREFIX + ["--config", "/etc/gpu/config.yaml"]) == []
    install.uninstall(root)
    assert snapshot(root) == before


def test_the_docker_program_hands_over_its_arguments(root):
    """What dockerd runs (`nvidia-container-runtime-hook prestart`) reaches the hook's own command
    line: shown here with --version, which needs no container, run from an empty environment."""
    install.install(root, ("docker",), [sys.executable, "-I", "-m", "oci_gpu_hook"])
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


def test_replacing_nvidias_program_and_uninstall_restores_it(root):
    plant_nvidias_hook(root)
    before = snapshot(root)
    lines = install.install(root, ("docker",), PREFIX, replace_nvidia_hook=True)
    assert f"moved {root + install.DOCKER_HOOK} to {root + install.DOCKER_HOOK_SAVED}" in lines
    assert open(root + install.DOCKER_HOOK_SAVED, "rb").read() == NVIDIAS_HOOK
    assert install.DOCKER_HOOK_MARKER in open(root + install.DOCKER_HOOK).read()
    lines = install.uninstall(root)
    assert f"restored {root + install.DOCKER_HOOK}" in lines
    assert snapshot(root) == before  # NVIDIA's file back, byte for byte, with its mode and mtime


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
