"""start/linux/userns.py: how the hook tells a user namespace (rootless podman) from the host,
and whom it then trusts as root: asked of real namespaces (a process that unshares its own, as
uid 65534), not of a uid_map written for the test."""

import json
import os

import pytest
import usercheck

from oci_gpu_hook.start import settings
from oci_gpu_hook.start.linux import userns

# Run as nobody: a new user namespace where nobody is root, as rootless podman maps its user, and
# the host's root is not mapped. Then the trust checks of the start path, on root's files.
IN_A_USER_NAMESPACE = """
import json, os, sys
from oci_gpu_hook.start.linux import _linux, userns, sources
from oci_gpu_hook.start import settings
outer = os.geteuid()
_linux.unshare(0x10000000)  # CLONE_NEWUSER
with open("/proc/self/uid_map", "w") as f:  # as rootless podman maps the user: root in there
    f.write(f"0 {outer} 1")
assert os.geteuid() == 0
out = {"unprivileged": userns.unprivileged(), "root": userns.root_uid(), "passwd": os.stat("/etc/passwd").st_uid}
s = sources.HostSources()
os.close(s.open("/etc/passwd", "file"))  # root's file, through root's directories: trusted
out["config"] = len(settings.read_config_file(sys.argv[1]))
print(json.dumps(out))
"""


def test_the_host_is_no_user_namespace(require):
    require("root")
    assert userns.uid_map() == [(0, 0, 4294967295)]
    assert not userns.unprivileged()
    assert userns.root_uid() == 0


def test_in_a_user_namespace_root_is_the_overflow_uid(run_as_nobody):
    with usercheck.shared_directory("oci-gpu-hook-userns-") as top:  # as /etc is: root's alone, open to all
        config = os.path.join(top, "config.yaml")
        with open(config, "w") as f:
            f.write("cgroups: auto\n")
        os.chmod(config, 0o644)  # root's, as a host's configuration is
        done = run_as_nobody(["-c", IN_A_USER_NAMESPACE, config], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    with open("/proc/sys/kernel/overflowuid") as f:
        overflow = int(f.read())
    assert got == {"unprivileged": True, "root": overflow, "passwd": overflow, "config": len("cgroups: auto\n")}


def test_host_uid_follows_the_map():
    mapping = [(0, 1000, 1), (1, 100000, 65536)]
    assert userns.host_uid(0, mapping) == 1000
    assert userns.host_uid(65536, mapping) == 165535
    assert userns.host_uid(65537, mapping) is None


# In a user namespace as rootless podman makes it, the mount-source walk on entries of a directory
# every user may write (/tmp, where the default MPS pipe directory /tmp/nvidia-mps lies).
IN_A_STICKY_DIRECTORY = """
import json, os, sys
from oci_gpu_hook.start.linux import _linux, sources
outer = os.geteuid()
_linux.unshare(0x10000000)  # CLONE_NEWUSER
with open("/proc/self/uid_map", "w") as f:
    f.write(f"0 {outer} 1")
out = {}
for name in sys.argv[1:]:
    s = sources.HostSources()
    try:
        os.close(s.open(name, "dir"))
        out[name] = "used"
    except sources.UntrustedSource as e:
        out[name] = e.why
    finally:
        s.close()
print(json.dumps(out))
"""


def test_a_users_entry_in_a_sticky_directory_is_not_taken_for_roots_in_a_user_namespace(run_as_nobody):
    """Another local user makes /tmp/nvidia-mps (or a symlink there) before root's MPS daemon does.
    On the host the walk sees their uid and skips it; in a rootless hook's user namespace it shows
    as the overflow uid, as root's own files do, and was mounted into the user's GPU containers as
    their MPS pipe directory (the other user's sockets answering their CUDA clients). An entry of
    a directory every user may write has an owner that cannot be told there: it is not used."""
    from oci_gpu_hook.start.linux import sources

    # The sticky directory is the test's own, as /tmp is: not /tmp itself, whose mode is the
    # machine's (1777 on Debian, 0755 in some sandboxes), and where solid_dir could not lie.
    with usercheck.shared_directory("oci-gpu-hook-userns-") as top:
        sticky = os.path.join(top, "tmp")  # as /tmp is
        os.mkdir(sticky)
        os.chmod(sticky, 0o1777)
        users, link, roots, solid = (os.path.join(sticky, n) for n in ("users", "link", "roots", "solid"))
        os.mkdir(users, 0o755)
        os.chown(users, 1001, 1001)  # another local user's
        os.symlink(users, link)
        os.lchown(link, 1001, 1001)
        os.mkdir(roots, 0o755)  # root's own: in the user namespace, it looks the same
        solid_dir = os.path.join(top, "solid")  # in a directory only root may write: used there too
        os.mkdir(solid_dir, 0o755)
        host = sources.HostSources()
        try:
            with pytest.raises(sources.UntrustedSource, match="owned by uid 1001"):
                host.open(users, "dir")
        finally:
            host.close()
        done = run_as_nobody(["-c", IN_A_STICKY_DIRECTORY, users, link, roots, solid_dir], capture_output=True,
                             text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got[solid_dir] == "used"
    why = "in a directory others may write, whose entries' owners a user namespace cannot tell from root"
    assert got == {users: why, link: why, roots: why, solid_dir: "used"}


# In a user namespace as rootless podman makes it: which configuration files are taken as root's,
# and which files the hook keeps (compiled settings, the inventory cache) it trusts.
WHOSE_CONFIGURATION = """
import json, os, sys
from oci_gpu_hook.errors import ConfigError
from oci_gpu_hook.start import settings
from oci_gpu_hook.start.linux import _linux
outer = os.geteuid()
_linux.unshare(0x10000000)  # CLONE_NEWUSER
with open("/proc/self/uid_map", "w") as f:
    f.write(f"0 {outer} 1")
out = {"config": {}, "kept": {}}
kept, configs = json.loads(sys.argv[1]), sys.argv[2:]
for path in configs:
    try:
        settings.read_config_file(path)
        out["config"][path] = "used"
    except ConfigError as e:
        out["config"][path] = str(e)
for path in kept:
    out["kept"][path] = settings.trusted(os.stat(path))
print(json.dumps(out))
"""


def test_a_configuration_is_taken_as_roots_in_a_user_namespace_only_from_roots_directories(run_as_nobody):
    """Issue 46, item 8: in a rootless hook's user namespace root, every other user outside it and
    the host's nobody all show as the overflow uid. Another user's file in a directory every user
    may write (or any file in a directory others may write) passed read_config_file as root's, and
    any file of theirs settings.trusted, which the compiled settings and the inventory cache must
    pass. Now a file that shows as root's is taken only at the end of directories no one else may
    write (the mount sources' walk), the user's own file anywhere, and nothing but the user's own
    is trusted as a file the hook keeps."""
    other = 23456  # another local user's uid: not mapped in the namespace, as root is not
    with usercheck.shared_directory("oci-gpu-hook-userns-") as top:
        made = {}

        def directory(name, mode, uid=0):
            path = os.path.join(top, name)
            os.mkdir(path)
            os.chmod(path, mode)
            os.chown(path, uid, uid)
            return path

        def config(where, name, uid):
            path = made[name] = os.path.join(where, name)
            with open(path, "w") as f:
                f.write("cgroups: auto\n")
            os.chmod(path, 0o644)
            os.chown(path, uid, uid)
            return path

        sticky = directory("tmp", 0o1777)  # as /tmp is
        config(sticky, "theirs-in-tmp.yaml", other)
        config(sticky, "roots-in-tmp.yaml", 0)
        config(sticky, "own-in-tmp.yaml", 65534)  # the user's own: root in the namespace
        config(directory("open", 0o777), "roots-in-open.yaml", 0)
        config(directory("group", 0o775), "roots-in-group.yaml", 0)
        config(top, "roots.yaml", 0)
        config(directory("theirs", 0o755, other), "theirs-in-theirs.yaml", other)
        kept = {"roots": made["roots.yaml"], "hooks": os.path.join(top, "hooks.json"), "own": made["own-in-tmp.yaml"]}
        with open(kept["hooks"], "w") as f:
            f.write("{}")
        os.chmod(kept["hooks"], 0o644)
        os.chown(kept["hooks"], settings.CACHE_UID, 0)  # as the host's hook keeps its files
        done = run_as_nobody(["-c", WHOSE_CONFIGURATION, json.dumps(list(kept.values())), *made.values()],
                             capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    words = "is not root's as far as this user namespace can tell"
    refused = {name for name, path in made.items() if words in got["config"][path]}
    used = {name for name, path in made.items() if got["config"][path] == "used"}
    assert refused == {"theirs-in-tmp.yaml", "roots-in-tmp.yaml", "roots-in-open.yaml", "roots-in-group.yaml"}, got
    # What is left (docs/security.md, rootless podman): a directory of another user's that none
    # but they may write shows as root's here, and so does their file in it.
    assert used == {"own-in-tmp.yaml", "roots.yaml", "theirs-in-theirs.yaml"}, got
    assert got["kept"] == {kept["roots"]: False, kept["hooks"]: False, kept["own"]: True}
    assert all("\n" not in message for message in got["config"].values())
