"""`install --runtime containerd` (toolkit/containerd.py), as a user runs it: in a mount namespace
of the test's own, with writable overlays over /etc, /usr/local and /var/lib, so that install,
containerd and doctor read and write the real default paths (/etc/containerd/config.toml) and the
host stays as it was. What containerd makes of the result is containerd's own answer
(`containerd config dump`), never a table."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import hookcheck
import pytest

from oci_gpu_hook.toolkit import containerd, install
from oci_gpu_hook.toolkit.runtime_config import dump_toml, load_toml

CRI = containerd.CRI
# The administrators' own config.toml: CRI settings of theirs, which containerd would reset to its
# defaults if a drop-in held base_runtime_spec alone (an imported plugin section replaces the whole).
USER_CONFIG = f"""\
version = 2
# the administrators' comment, kept byte for byte
[plugins."{CRI}"]
  sandbox_image = "example.org/pause:9"
  [plugins."{CRI}".cni]
    bin_dir = "/opt/site/cni"
  [plugins."{CRI}".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."{CRI}".containerd.runtimes.runc.options]
      SystemdCgroup = true
"""

# Runs inside the namespace: snapshot /etc/containerd, install as a user would, ask containerd and
# doctor, uninstall, snapshot again; prints one JSON document.
INSIDE = r"""
import json, subprocess, sys
sys.path.insert(0, sys.argv[1])
import hookcheck
cli, config, out = [sys.executable, "-I", "-m", "oci_gpu_hook"], sys.argv[2], {}
def run(*argv):
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=120)
    return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
out["before"] = hookcheck.tree("/etc/containerd", contents=True)
out["install"] = run(*cli, "--config", config, "install", "--runtime", "containerd", "--no-prefilter")
out["again"] = run(*cli, "--config", config, "install", "--runtime", "containerd", "--no-prefilter")
out["dump"] = run("containerd", "config", "dump")
out["doctor"] = run(*cli, "--config", config, "doctor")
out["uninstall"] = run(*cli, "uninstall")
out["after"] = hookcheck.tree("/etc/containerd", contents=True)
out["doctor_after"] = run(*cli, "--config", config, "doctor")
print(json.dumps(out))
"""


def in_private_etc(tmp_path, config_toml: str | None, python: str, *args: str) -> dict:
    """Run python (with args) in a mount namespace whose /etc, /usr/local and /var/lib are writable
    overlays (their upper layers on a tmpfs of its own), with /etc/containerd/config.toml holding
    config_toml (None: no config.toml); returns its JSON output."""
    upper = tmp_path / "overlays"
    upper.mkdir()
    setup = f'mount -t tmpfs -o mode=0755 oci-gpu-hook-test "{upper}" && '
    for d in ("/etc", "/usr/local", "/var/lib"):
        setup += (f'mkdir -p "{upper}/u{d}" "{upper}/w{d}" && mount -t overlay oci-gpu-hook-test '
                  f'-o "lowerdir={d},upperdir={upper}/u{d},workdir={upper}/w{d}" {d} && ')  # fmt: skip
    setup += "mkdir -p /etc/containerd && rm -f /etc/containerd/config.toml && "
    if config_toml is not None:
        (tmp_path / "user-config.toml").write_text(config_toml)
        setup += f'cp "{tmp_path}/user-config.toml" /etc/containerd/config.toml && '
    script = setup + 'exec "$0" -I -c "$@"'
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, sys.executable,
                           python, *args], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def hook_config(tmp_path) -> str:
    path = tmp_path / "hook-config.yaml"
    path.write_text("{}\n")
    return str(path)


@pytest.mark.parametrize("config_toml", [USER_CONFIG, None], ids=["administrators-config", "no-config"])
def test_install_wires_the_cri_plugin_and_uninstall_restores_the_config(tmp_path, require, config_toml):
    """After `install --runtime containerd`, containerd itself (config dump, reading the default
    /etc/containerd/config.toml) runs every CRI runtime from the base spec, whose prestart hook is
    ours; the administrators' CRI settings stay in effect; doctor says PASS. After uninstall,
    /etc/containerd is byte for byte (and mode for mode) what it was, and doctor says FAIL."""
    require("root", "unshare", "containerd", "ctr")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = hook_config(tmp_path)
    out = in_private_etc(tmp_path, config_toml, INSIDE, tests, config)
    assert out["install"]["rc"] == 0, out["install"]
    assert out["again"]["rc"] == 0 and "nothing to do" in out["again"]["stdout"], out["again"]
    assert out["dump"]["rc"] == 0, out["dump"]
    dumped = load_toml(out["dump"]["stdout"])
    cri = dumped["plugins"][CRI]
    assert cri["containerd"]["runtimes"]["runc"]["base_runtime_spec"] == containerd.BASE_SPEC
    assert containerd.DROPIN in dumped["imports"]
    if config_toml is not None:  # what the administrators set is still what containerd runs with
        assert cri["sandbox_image"] == "example.org/pause:9" and cri["cni"]["bin_dir"] == "/opt/site/cni"
        assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True
    doctor = [line for line in out["doctor"]["stdout"].splitlines() if line.split()[1:2] == ["containerd"]]
    assert len(doctor) == 1 and doctor[0].startswith("PASS") and containerd.BASE_SPEC in doctor[0], out["doctor"]
    assert out["uninstall"]["rc"] == 0, out["uninstall"]
    assert out["after"] == out["before"]
    doctor = [line for line in out["doctor_after"]["stdout"].splitlines() if line.split()[1:2] == ["containerd"]]
    assert len(doctor) == 1 and doctor[0].startswith("FAIL"), out["doctor_after"]


# Inside the namespace: install, then print the base spec and whether each step worked.
SPEC_INSIDE = r"""
import json, subprocess, sys
cli, config = [sys.executable, "-I", "-m", "oci_gpu_hook"], sys.argv[1]
p = subprocess.run(cli + ["--config", config, "install", "--runtime", "containerd", "--no-prefilter"],
                   capture_output=True, text=True, timeout=120)
spec = json.load(open("/etc/containerd/oci-gpu-hook-base-spec.json")) if p.returncode == 0 else None
default = json.loads(subprocess.run(["ctr", "oci", "spec"], capture_output=True, text=True, check=True).stdout)
print(json.dumps({"rc": p.returncode, "stderr": p.stderr, "spec": spec, "default": default}))
"""


def test_the_base_spec_is_containerds_default_with_the_hook(tmp_path, require):
    """The base spec replaces containerd's default spec for every CRI container: it must be that
    default (`ctr oci spec`, this containerd's own) and the hook, nothing else."""
    require("root", "unshare", "containerd", "ctr")
    config = hook_config(tmp_path)
    out = in_private_etc(tmp_path, USER_CONFIG, SPEC_INSIDE, config)
    assert out["rc"] == 0, out["stderr"]
    spec, default = out["spec"], out["default"]
    hooks = spec.pop("hooks")
    assert spec == default
    (hook,) = hooks["prestart"]
    assert hook["args"][-3:] == ["--config", config, "prestart"] and hook["path"] == install.hook_command()[0]
    assert hook["env"] == install.HOOK_ENV and hook["timeout"] == install.HOOK_TIMEOUT


REFUSE_INSIDE = r"""
import json, subprocess, sys
cli = [sys.executable, "-I", "-m", "oci_gpu_hook"]
before = open("/etc/containerd/config.toml", "rb").read()
p = subprocess.run(cli + ["install", "--runtime", "containerd", "--no-prefilter"], capture_output=True, text=True,
                   timeout=120)
import os
import stat
print(json.dumps({"rc": p.returncode, "stderr": p.stderr, "same": open("/etc/containerd/config.toml", "rb").read()
                  == before, "manifest": os.path.exists("/var/lib/oci-gpu-hook/install-manifest.json"),
                  "dropin": os.path.exists("/etc/containerd/conf.d")}))
"""


@pytest.mark.parametrize(
    "config_toml, says",
    [
        ('imports = ["/etc/containerd/site.d/*.toml"]\nversion = 2\n', "has imports of its own"),
        ("[grpc]\naddress = '/run/x.sock'\n", "config version 1"),
        (
            f'version = 2\n[plugins."{CRI}".containerd.runtimes.runc]\nbase_runtime_spec = "/etc/site-spec.json"\n',
            "already has base_runtime_spec /etc/site-spec.json",
        ),
        (f'version = 2\ndisabled_plugins = ["{CRI}"]\n', "disabled_plugins"),
        ("version = 2\n[plugins\n", "not valid TOML"),
    ],
    ids=["own-imports", "version-1", "own-base-spec", "cri-disabled", "invalid-toml"],
)
def test_a_config_install_cannot_wire_is_refused_with_one_line(tmp_path, require, config_toml, says):
    """Where the drop-in would not take effect, or would drop what the administrators set, install
    says so in one line and writes nothing (config.toml untouched, no manifest)."""
    require("root", "unshare", "containerd", "ctr")
    out = in_private_etc(tmp_path, config_toml, REFUSE_INSIDE)
    assert out["rc"] == install.InstallError.exit_code, out
    assert out["stderr"].count("\n") == 1 and says in out["stderr"], out["stderr"]
    assert out["same"] and not out["manifest"] and not out["dropin"], out


def test_the_drop_in_reads_back_as_containerds_own_section(require):
    """dump_toml (tomli-w) writes what containerd dumped (tables, empty ones too, strings, numbers,
    booleans, arrays, keys that need quoting) as TOML that reads back as exactly the same document."""
    require("containerd")
    dumped = containerd.dump()
    cri = dumped["plugins"][CRI]
    cri["registry"]["mirrors"] = {"docker.io": {"endpoint": ['https://a"b\\c\n']}}
    document = {"version": 2, "plugins": {CRI: cri}}
    assert load_toml(dump_toml(document)) == document


def test_a_manifest_naming_another_edit_is_refused(tmp_path, hook_cli):
    """uninstall edits config.toml only to remove the one line install adds: a manifest naming any
    other line, or another file, is not trusted."""
    root = tmp_path / "root"
    manifest = root / install.MANIFEST.lstrip("/")
    manifest.parent.mkdir(parents=True)
    for edited in ({containerd.CONFIG: "version = 3\n"}, {"/etc/passwd": containerd.IMPORT_LINE}):
        manifest.write_text(json.dumps({"format": 1, "files": {}, "directories": [], "edited": edited}))
        out = hook_cli("uninstall", "--root", str(root))
        assert out.returncode == install.InstallError.exit_code and "not trusted" in out.stderr, out.stderr
        assert manifest.exists()


def test_install_into_an_image_tree_and_out_again(tmp_path, hook_cli, require):
    """--root: the tree's config.toml is what is read and edited (none there: install writes one);
    uninstall leaves the tree as it was. A config.toml that is a link is refused (edited in place it
    would become a file)."""
    require("root", "containerd", "ctr")
    root = tmp_path / "image"
    (root / "etc" / "containerd").mkdir(parents=True)
    before = hookcheck.tree(str(root), contents=True)
    out = hook_cli("install", "--root", str(root), "--runtime", "containerd", "--no-prefilter")
    assert out.returncode == 0, out.stderr
    assert (root / containerd.CONFIG.lstrip("/")).read_text() == containerd.CREATED_CONFIG
    dropin = load_toml((root / containerd.DROPIN.lstrip("/")).read_text())
    assert dropin["plugins"][CRI]["containerd"]["runtimes"]["runc"]["base_runtime_spec"] == containerd.BASE_SPEC
    out = hook_cli("uninstall", "--root", str(root))
    assert out.returncode == 0, out.stderr
    assert hookcheck.tree(str(root), contents=True) == before
    (root / "etc" / "containerd" / "site.toml").write_text(USER_CONFIG)
    os.symlink("site.toml", root / containerd.CONFIG.lstrip("/"))
    out = hook_cli("install", "--root", str(root), "--runtime", "containerd", "--no-prefilter")
    assert out.returncode == install.InstallError.exit_code and "a symlink" in hookcheck.one_clear_line(out.stderr)
    assert os.path.islink(root / containerd.CONFIG.lstrip("/"))


@pytest.mark.parametrize("case", ["spec-is-a-device", "spec-links-out", "config-links-out"])
def test_doctor_reads_an_image_trees_containerd_files_inside_it(tmp_path, require, case):
    """doctor --root DIR read containerd's config.toml and its base spec by joining strings: a
    device node there (/dev/zero's numbers: read until memory ran out; here one no driver has,
    which only an open can tell) or a link out of the tree (the build host's own files) was what
    it read. Now both are read inside the tree, regular files only, bounded (tree.read)."""
    require("root", "containerd")
    root, host = str(tmp_path / "root"), tmp_path / "host"
    os.makedirs(root + "/etc/containerd")
    host.mkdir()
    spec = {"hooks": {"prestart": [{"path": "/usr/bin/oci-gpu-hook", "args": ["oci-gpu-hook", "prestart"]}]}}
    (host / "spec.json").write_text(json.dumps(spec))
    runc = f'[plugins."{containerd.CRI}".containerd.runtimes.runc]'
    (host / "config.toml").write_text(f'version = 2\n{runc}\nruntime_type = "io.containerd.runc.v2"\n'
                                      'base_runtime_spec = "/spec.json"\n')  # fmt: skip
    if case == "config-links-out":
        os.symlink(str(host / "config.toml"), root + containerd.CONFIG)
        os.symlink("/x", root + "/spec.json")  # were the host's config read, its spec would be found
        os.makedirs(root + "/usr/bin")
    else:
        with open(root + containerd.CONFIG, "w") as f:
            f.write((host / "config.toml").read_text())
        if case == "spec-is-a-device":
            os.mknod(root + "/spec.json", 0o644 | stat.S_IFCHR, os.makedev(511, 0))
        else:
            os.symlink(str(host / "spec.json"), root + "/spec.json")
    status, summary, _ = containerd.hook_verdict(root)
    assert status == "FAIL", summary
    if case == "config-links-out":
        # Inside the tree the link leads nowhere: containerd's defaults, no base spec.
        assert "with no base_runtime_spec" in summary, summary
    elif case == "spec-is-a-device":
        assert "not a regular file" in summary, summary
    else:
        assert "No such file or directory" in summary, summary


# Inside the namespace: install; then the administrators set CRI settings of their own in
# config.toml; containerd and doctor are asked; install again; asked again.
CHANGED_INSIDE = r"""
import json, subprocess, sys
from oci_gpu_hook.toolkit.runtime_config import dump_toml, load_toml
cli, config, settings = [sys.executable, "-I", "-m", "oci_gpu_hook"], sys.argv[1], json.loads(sys.argv[2])
CRI = "io.containerd.grpc.v1.cri"
def run(*argv):
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=120)
    return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
def containerd_line():  # the check's line and the fix's below it
    lines = run(*cli, "--config", config, "doctor")["stdout"].splitlines()
    return ["\n".join(lines[i : i + 2]) for i, line in enumerate(lines) if line.split()[1:2] == ["containerd"]]
def in_force():
    cri = load_toml(run("containerd", "config", "dump")["stdout"])["plugins"][CRI]
    return {key: cri[key] for key in settings}
out = {"install": run(*cli, "--config", config, "install", "--runtime", "containerd", "--no-prefilter")}
out["doctor_installed"] = containerd_line()
text = open("/etc/containerd/config.toml").read()
header = f'[plugins."{CRI}"]\n'
added = "".join(f"  {key} = true\n" for key in settings)
with open("/etc/containerd/config.toml", "w") as f:
    f.write(text.replace(header, header + added, 1))
out["in_force_changed"] = in_force()
out["doctor_changed"] = containerd_line()
out["again"] = run(*cli, "--config", config, "install", "--runtime", "containerd", "--no-prefilter")
out["in_force_again"] = in_force()
out["doctor_again"] = containerd_line()
print(json.dumps(out))
"""


def test_cri_settings_added_after_install_are_watched_by_doctor(tmp_path, require):
    """Issue 46, item 6: containerd replaces the CRI plugin's whole section with the drop-in's, a
    copy of config.toml's as install found it. CRI settings the administrators add to config.toml
    afterwards are not what containerd runs with, and doctor said PASS. Now doctor says FAIL,
    naming them, with install as the fix; install again writes the drop-in afresh, and they hold."""
    require("root", "unshare", "containerd", "ctr")
    config = hook_config(tmp_path)
    added = ["enable_selinux", "restrict_oom_score_adj", "device_ownership_from_security_context"]
    out = in_private_etc(tmp_path, USER_CONFIG, CHANGED_INSIDE, config, json.dumps(added))
    assert out["install"]["rc"] == 0 and out["again"]["rc"] == 0, out
    (installed,) = out["doctor_installed"]
    assert installed.startswith("PASS"), out
    # containerd itself: the drop-in's frozen copy overrides what config.toml now says (K1).
    assert out["in_force_changed"] == dict.fromkeys(added, False), out
    (changed,) = out["doctor_changed"]
    assert changed.startswith("FAIL") and all(key in changed for key in added), out
    assert containerd.DROPIN in changed and "oci-gpu-hook install --runtime containerd" in changed, out
    assert out["in_force_again"] == dict.fromkeys(added, True), out
    (again,) = out["doctor_again"]
    assert again.startswith("PASS"), out
