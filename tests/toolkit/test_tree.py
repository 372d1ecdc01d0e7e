"""The tree install acts in: paths resolved inside it, as the image resolves them (openat2
RESOLVE_IN_ROOT, and rootfs.py's own walk where openat2 is missing)."""

import os

import pytest

from oci_gpu_hook.start.linux import rootfs
from oci_gpu_hook.toolkit.tree import Tree, TreeError


@pytest.fixture(params=["openat2", "walk"])
def tree(request, tmp_path, monkeypatch):
    """A tree with the links images hold, resolved by openat2 or by the walk kernels before 5.6 get."""
    if request.param == "walk":
        monkeypatch.setattr(rootfs, "_openat2_works", False)
    root = tmp_path / "root"
    for directory in ("usr/lib/systemd", "usr/bin", "run", "etc", "opt/local"):
        (root / directory).mkdir(parents=True)
    os.symlink("usr/lib", root / "lib")  # relative, inside
    os.symlink("/run", root / "var-run")  # absolute: the image's /run, never the host's
    os.symlink("../../../../../../../../opt/local", root / "usr/local")  # climbs: stops at the root
    os.symlink("/etc/loop", root / "etc/loop")  # its own path inside the tree
    os.symlink(str(tmp_path / "host"), root / "etc/systemd")  # a host path the tree does not have
    (tmp_path / "host").mkdir()
    with Tree(str(root)) as t:
        yield t, str(root)


def test_links_are_followed_inside_the_tree(tree):
    t, root = tree
    assert t.directory("/lib/systemd") == f"{root}/usr/lib/systemd"
    assert t.directory("/var-run/oci-gpu-hook") == f"{root}/run/oci-gpu-hook"  # not there yet: a place
    assert t.directory("/usr/local/libexec/oci-gpu-hook") == f"{root}/opt/local/libexec/oci-gpu-hook"
    assert t.resolve("/") == root


def test_an_entry_is_its_own_last_component(tree):
    """install replaces or removes what is at the path: a link there is not followed."""
    t, root = tree
    assert t.entry("/lib/systemd/x.service") == f"{root}/usr/lib/systemd/x.service"
    assert t.entry("/lib") == f"{root}/lib"


def test_a_link_that_leads_nowhere_inside_the_tree_is_refused_by_name(tree, tmp_path):
    t, root = tree
    with pytest.raises(TreeError) as e:
        t.directory("/etc/systemd/system")
    assert str(e.value).startswith(f"{root}/etc/systemd: a symlink to {tmp_path}/host, which leads nowhere inside")
    assert os.listdir(tmp_path / "host") == []


def test_a_link_that_loops_inside_the_tree_is_refused(tree):
    t, root = tree
    with pytest.raises(TreeError, match="too many levels of symbolic links"):
        t.directory("/etc/loop/x")


def test_a_file_on_the_way_is_refused(tree):
    t, root = tree
    with open(f"{root}/usr/bin/tool", "w"):
        pass
    with pytest.raises(TreeError, match="not a directory"):
        t.directory("/usr/bin/tool")
    with pytest.raises(TreeError, match="not a directory"):
        t.entry("/usr/bin/tool/x")


def test_reads_follow_links_inside_the_tree(tree):
    t, root = tree
    with open(f"{root}/run/file", "w") as f:
        f.write("the image's\n")
    fd = t.open("/var-run/file", os.O_RDONLY)
    with os.fdopen(fd) as f:
        assert f.read() == "the image's\n"
