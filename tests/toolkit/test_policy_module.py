"""The SELinux module a bundle carries, and install loading it into its host's policy (issue 47):
toolkit/policy_module.py, install.py's _load_selinux_module and _remove_policy_module.

What is real: the module, compiled by deploy/build-image.py's own step with Debian's headers, and
semodule linking it into Debian's whole default policy, the store this machine's
selinux-policy-default made (/var/lib/selinux/default), seen in a mount namespace of the test's own
whose /etc, /var/lib and /usr/local are overlays (tests/privatehost.py): the host's store is never
changed. What stands in: the kernel's answer that SELinux is enabled (labels.selinux_enabled),
which no machine here gives (the node VM's scenario toolkit_selinux_module runs it all for real).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import privatehost
import pytest

from oci_gpu_hook.errors import HookError
from oci_gpu_hook.toolkit import bundle, install, policy_module
from oci_gpu_hook.toolkit.tree import Tree

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLE_ID = "0123456789abcdef"
DEBIAN_STORE = "/var/lib/selinux/default"


def builder():
    """deploy/build-image.py, imported (its name is not a module's)."""
    spec = importlib.util.spec_from_file_location("build_image", os.path.join(REPO, "deploy", "build-image.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def debian_module(tmp_path_factory, require):
    """The bundle's selinux/ as the image builder makes it on this machine: Debian's flavour."""
    require("make", "m4", "checkmodule", "semodule_package", "/usr/share/selinux/devel/Makefile")
    top = tmp_path_factory.mktemp("bundle")
    assert builder().selinux_modules(str(top)) == ["debian"]
    path = top / policy_module.DIRECTORY / "debian" / f"{policy_module.MODULE}.pp"
    assert path.is_file()
    return str(path)


@pytest.fixture(scope="module")
def container_module(tmp_path_factory, require):
    """Debian's container policy module, which Debian ships as source only: a host that runs
    containers under SELinux has it loaded (the node VM's base image does it the same way)."""
    require("tar", "zstd", "/usr/src/selinux-policy-src.tar.zst")
    work = tmp_path_factory.mktemp("container")
    members = [f"selinux-policy-src/policy/modules/services/container.{ext}" for ext in ("te", "fc")]
    subprocess.run(["tar", "--zstd", "-xf", "/usr/src/selinux-policy-src.tar.zst", "-C", str(work), *members],
                   check=True)  # fmt: skip
    source = work / "selinux-policy-src/policy/modules/services"
    out = subprocess.run(["make", "-f", "/usr/share/selinux/devel/Makefile", "container.pp"], cwd=source,
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return str(source / "container.pp")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("SELINUX=enforcing\nSELINUXTYPE=targeted\n", "targeted"),
        ('# SELINUXTYPE=mls\nSELINUXTYPE = "default"\n', "default"),
        ("SELINUXTYPE=mls\nSELINUXTYPE=targeted\n", "targeted"),  # the last one, as libselinux reads it
        ("SELINUX=enforcing\n", None),
        (None, None),
    ],
)
def test_the_policy_is_read_from_selinux_config(text, expected):
    assert policy_module.policy_type(text) == expected


def test_the_module_is_chosen_by_the_hosts_policy_family_or_refused_in_one_line(tmp_path):
    for flavour in ("debian", "rhel"):
        (tmp_path / "selinux" / flavour).mkdir(parents=True)
        (tmp_path / "selinux" / flavour / "oci_gpu_hook.pp").write_bytes(flavour.encode())
    modules = policy_module.carried(str(tmp_path))
    assert modules == {f: str(tmp_path / "selinux" / f / "oci_gpu_hook.pp") for f in ("debian", "rhel")}
    assert policy_module.chosen("targeted", modules) == modules["rhel"]
    assert policy_module.chosen("default", modules) == modules["debian"]
    refusals = {
        "mls": (None, "policy 'mls'"),
        None: (None, "names no SELINUXTYPE"),
        "targeted": ({"debian": modules["debian"]}, "built without the module for it"),
    }
    for policy, (given, words) in refusals.items():
        with pytest.raises(policy_module.ModuleError) as e:
            policy_module.chosen(policy, modules if given is None else given)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_store_says_at_which_priorities_the_module_is_loaded(tmp_path):
    for priority in ("100", "300", "400"):
        os.makedirs(tmp_path / f"var/lib/selinux/targeted/active/modules/{priority}/container")
    os.makedirs(tmp_path / "var/lib/selinux/targeted/active/modules/300/oci_gpu_hook")
    os.makedirs(tmp_path / "var/lib/selinux/targeted/active/modules/400/oci_gpu_hook")
    assert policy_module.loaded_at("targeted", str(tmp_path)) == [300, 400]
    assert policy_module.loaded_at("default", str(tmp_path)) == []


def test_processes_in_the_modules_domains_are_found(tmp_path):
    contexts = {
        "1": "system_u:system_r:init_t:s0",
        "20": "system_u:system_r:gpu_container_t:s0:c1,c2",
        "31": "system_u:system_r:oci_gpu_hook_start_t:s0",
        "40": "system_u:system_r:container_t:s0:c3,c4",
    }
    for pid, context in contexts.items():
        (tmp_path / pid / "attr").mkdir(parents=True)
        (tmp_path / pid / "attr" / "current").write_bytes(context.encode() + b"\0")
    (tmp_path / "self").mkdir()
    (tmp_path / "55").mkdir()  # gone meanwhile: no attr/current
    assert policy_module.domains_in_use(str(tmp_path)) == {20: "gpu_container_t", 31: "oci_gpu_hook_start_t"}


def test_a_policy_the_bundle_has_no_module_for_is_refused_before_anything_is_written(tmp_path, mocker):
    root = tmp_path / "host"
    (root / "etc/selinux").mkdir(parents=True)
    (root / "etc/selinux/config").write_text("SELINUX=enforcing\nSELINUXTYPE=mls\n")
    (root / bundle.BUNDLES_DIR.lstrip("/") / BUNDLE_ID / "selinux/debian").mkdir(parents=True)
    (root / bundle.BUNDLES_DIR.lstrip("/") / BUNDLE_ID / "selinux/debian/oci_gpu_hook.pp").write_bytes(b"pp")
    mocker.patch("oci_gpu_hook.start.linux.labels.selinux_enabled", return_value=True)  # the kernel's answer
    semodule = mocker.patch.object(policy_module, "_semodule")
    manifest = {}
    tree = Tree(str(root))
    try:
        with pytest.raises(HookError) as e:
            install._load_selinux_module(tree, manifest, BUNDLE_ID)
        assert "policy 'mls'" in str(e.value) and "by hand" in str(e.value), str(e.value)
        # A module someone else loaded (the RPM's at 200) is theirs: kept, said, not refused.
        os.makedirs(root / "var/lib/selinux/mls/active/modules/200/oci_gpu_hook")
        (line,) = install._load_selinux_module(tree, manifest, BUNDLE_ID)
        assert line.startswith("kept SELinux module oci_gpu_hook at priority 200, loaded by another"), line
    finally:
        tree.close()
    assert manifest == {} and not semodule.called


def test_a_manifest_naming_another_module_or_priority_is_not_trusted():
    good = {"policy": "targeted", "priority": 300, "sha256": "0" * 64}
    assert install._module_record_ok(good) and install._module_record_ok(None)
    for bad in ({**good, "priority": 200}, {**good, "policy": "mls"}, {**good, "module": "container"},
                {**good, "sha256": "x"}, ["oci_gpu_hook"]):  # fmt: skip
        assert not install._module_record_ok(bad), bad


INSIDE = r"""
import json, os, sys
from unittest import mock
from oci_gpu_hook.toolkit import bundle, install, policy_module
from oci_gpu_hook.toolkit.tree import Tree
module, bundle_id = sys.argv[1:3]
top = os.path.join(bundle.directory(bundle_id), "selinux", "debian")
os.makedirs(top)
with open(module, "rb") as f, open(os.path.join(top, "oci_gpu_hook.pp"), "wb") as out:
    out.write(f.read())
os.makedirs(os.path.dirname(install.MANIFEST), exist_ok=True)

def listing():
    return sorted(os.listdir("/var/lib/selinux/default/active/modules/100")), policy_module.loaded_at("default")

said, manifest = {"before": listing()}, {"format": 1, "files": {}, "directories": []}
try:
    policy_module.load("/etc/hostname")  # not a module: semodule's own words, in one line
except policy_module.ModuleError as e:
    said["not_a_module"] = str(e)
with mock.patch("oci_gpu_hook.start.linux.labels.selinux_enabled", return_value=True):
    tree = Tree("/")
    said["load"] = install._load_selinux_module(tree, manifest, bundle_id)
    said["loaded"] = listing()
    said["record"] = dict(manifest["selinux_module"])
    said["again"] = install._load_selinux_module(tree, manifest, bundle_id)
    with open(install.MANIFEST, "w") as f:
        json.dump(manifest, f)
    with mock.patch.object(policy_module, "domains_in_use", return_value={4242: "gpu_container_t"}):
        said["in_use"] = install._remove_selinux_module(tree, dict(manifest))
    said["still"] = listing()
    # The start server, stopping: waited for, then the module goes.
    stopping = [{7: "oci_gpu_hook_start_t"}, {7: "oci_gpu_hook_start_t"}, {}]
    with mock.patch.object(policy_module, "domains_in_use", side_effect=stopping) as asked:
        said["remove"] = install._remove_selinux_module(tree, manifest)
    said["asked"] = asked.call_count
    said["after"] = listing()
    with open(install.MANIFEST) as f:
        said["manifest"] = json.load(f)
print(json.dumps(said))
"""


def test_install_loads_the_bundles_module_into_the_hosts_policy_once_and_uninstall_removes_it(
    debian_module, container_module, tmp_path, require
):
    """In Debian's whole default policy: install's load links the bundle's module at priority 300
    (the modules of priority 100 untouched); install again with the same build runs no semodule;
    a process in gpu_container_t keeps the module, said in one line; a start server still
    stopping is waited for; then uninstall removes it, and the store holds what it held before."""
    require("root", "unshare", "semodule", os.path.join(DEBIAN_STORE, "active", "modules", "100", "base"))
    work = tmp_path / "work"
    work.mkdir()
    env = {**privatehost.USER_ENV, "PYTHONPATH": REPO}
    steps = [
        {"run": ["semodule", "-X", "100", "-i", container_module], "env": privatehost.USER_ENV},
        {"run": [sys.executable, "-c", INSIDE, debian_module, BUNDLE_ID], "env": env},
    ]
    container, result = privatehost.run(str(work), ["/etc", "/var/lib", "/usr/local"], steps)
    assert container["rc"] == 0, container["stderr"]
    assert result["rc"] == 0, result["stderr"]
    said = json.loads(result["stdout"])
    modules_100, at = said["before"]
    assert "base" in modules_100 and 300 not in at
    assert said["load"] == ["loaded SELinux module oci_gpu_hook into policy default at priority 300 "
                            "(selinux/debian/oci_gpu_hook.pp)"]  # fmt: skip
    assert said["loaded"] == [modules_100, sorted(at + [300])]
    assert said["record"] == {"policy": "default", "priority": 300, "sha256": policy_module.digest(debian_module)}
    assert said["again"] == []
    assert said["in_use"] and said["in_use"][0].startswith("kept SELinux module oci_gpu_hook: processes 4242 "), said
    assert said["still"] == said["loaded"]
    assert said["remove"] == ["removed SELinux module oci_gpu_hook (priority 300)"] and said["asked"] == 3
    assert said["after"] == said["before"]
    refused = said["not_a_module"]
    assert refused.startswith("semodule -X 300 -i /etc/hostname: ") and "\n" not in refused, refused
    assert "selinux_module" not in said["manifest"]
