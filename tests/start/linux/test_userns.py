"""start/linux/userns.py: how the hook tells a user namespace (rootless podman) from the host,
and whom it then trusts as root: asked of real namespaces (a process that unshares its own, as
uid 65534), not of a uid_map written for the test."""

import json
import os
import shutil
import tempfile

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
    top = tempfile.mkdtemp(prefix="oci-gpu-hook-userns-", dir="/tmp")  # pytest's tmp_path is root's alone
    try:
        os.chmod(top, 0o755)
        config = os.path.join(top, "config.yaml")
        with open(config, "w") as f:
            f.write("cgroups: auto\n")
        os.chmod(config, 0o644)  # root's, as a host's configuration is
        done = run_as_nobody(["-c", IN_A_USER_NAMESPACE, config], capture_output=True, text=True)
    finally:
        shutil.rmtree(top)
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
