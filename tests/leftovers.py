"""What a test leaves on the host outside its own directories, looked at before and after each test
module by conftest.py (issue 52, item 9), so that a module that leaves one fails, with what it
left:
- /run/oci-gpu-hook: the compiled settings a hook keeps of each configuration it read
  (settings.compiled_path), which outlive a configuration that lay in a directory the test made
  and removed (one outside pytest's directories, as /tmp/ogh-start-* or /srv/oci-gpu-hook-*), and
  any other file the hook keeps there (records, journals, the inventory cache, a socket);
- the host's configuration places that `install` and `cdi generate` write: /etc/cdi, the hooks.d
  directories, containers.conf.d, crio.conf.d, containerd's drop-ins, systemd units, the default
  configuration, install's manifest, the launchers, the labels' feature file, the device
  plugins' sockets; and the files install edits in place (containerd's config.toml, ...);
- root's podman images and containers, and runc's containers (/run/runc);
- /var/cache/oci-gpu-hook-*, but for the tools' caches the suite keeps on purpose
  (tests/toolbuild.py), and /var/log/oci-gpu-hook*.

A test may use all of these, in a private mount namespace with overlays (tests/privatehost.py) or
on the host, if it removes what it made. Compiled settings of configurations under pytest's own
directories are the session's to remove (conftest.py: they are kept as long as those
directories), and compiled settings whose configuration is gone are garbage: the check removes
those it finds as well as naming them. The rest it only names.

Several runs of the suite may share a host. What one run finds is another run's when its name
carries the pid of another live pytest (the suite names its images and containers with
os.getpid()); a dangling compiled settings file of another run made meanwhile is still taken for
this one's (it cannot be told apart): rerun the module alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import toolbuild

from oci_gpu_hook.start import files, settings

RUN_DIR = settings.RUN_DIR  # read at import: in-process tests point settings.RUN_DIR elsewhere
# directory: the prefix of the names looked at in it ("": every name)
PLACES = {
    RUN_DIR: "",
    "/run/runc": "",
    "/etc/cdi": "",
    "/run/cdi": "",
    "/etc/containers/oci/hooks.d": "",
    "/usr/share/containers/oci/hooks.d": "",
    "/etc/containers/containers.conf.d": "",
    "/etc/crio/crio.conf.d": "",
    "/etc/containerd/conf.d": "",
    "/etc/containerd": "oci-gpu-hook",
    "/etc/systemd/system": "oci-gpu-hook",
    "/etc/udev/rules.d": "",
    "/etc/oci-gpu-hook": "",
    "/var/lib/oci-gpu-hook": "",
    "/usr/local/libexec/oci-gpu-hook": "",
    "/usr/local/bin": "",
    "/usr/bin": "nvidia-container-runtime-hook",
    "/etc/kubernetes/node-feature-discovery/features.d": "",
    "/var/lib/kubelet/device-plugins": "",
    "/var/log": "oci-gpu-hook",
    "/var/cache": "oci-gpu-hook",
}
# Files install edits in place rather than adds beside: compared by inode, size and mtime.
EDITED = ("/etc/containerd/config.toml", "/etc/containers/containers.conf", "/etc/crio/crio.conf",
          "/etc/docker/daemon.json", "/etc/subuid", "/etc/subgid", "/etc/passwd", "/etc/group")  # fmt: skip
# The caches the suite keeps on purpose, once per machine (tests/toolbuild.py: the shared tools,
# the node VM's base image and its last runs).
KEPT = {toolbuild.cache(tool) for tool in toolbuild.TOOLS}
# State directories their program makes at its first run on any host, and which hold nothing of a
# run once its containers and configurations are gone: their entries are looked at, not them.
MADE_BY_THEIR_PROGRAM = (RUN_DIR, "/run/runc")
COMPILED = re.compile(r"^settings_.*\.json$")


def compiled_source(path: str) -> str | None:
    """The configuration file a compiled settings file in RUN_DIR was made from, as it records
    it; None for anything else (another of the hook's files, one that does not parse, a link)."""
    if not COMPILED.match(os.path.basename(path)):
        return None
    try:
        doc = json.loads(files.read_bounded(path, settings.MAX_CONFIG_BYTES, nofollow=True, regular=True))
    except (OSError, ValueError):
        return None
    source = doc.get("path") if isinstance(doc, dict) else None
    # Its name must be the one the hook gives that source: the name alone does not say where the
    # path's directories end (pytest-12_x/ and pytest-12/x_ read alike).
    if isinstance(source, str) and os.path.basename(settings.compiled_path(source)) == os.path.basename(path):
        return source
    return None


def remove_compiled_settings(run_dir: str, directory: str) -> list:
    """Remove the compiled settings in run_dir that hooks kept for configuration files under
    directory, and only those: another run's files, the host's own hook's and anything else stay.
    Returns the paths removed."""
    inside = os.path.join(os.path.abspath(directory), "")
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        path = os.path.join(run_dir, name)
        source = compiled_source(path)
        if source is not None and source.startswith(inside):
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue  # gone meanwhile
            removed.append(path)
    return removed


def remove_directory(top: str) -> None:
    """Remove a directory a test made outside pytest's own (/tmp/ogh-start-*, /srv/oci-gpu-hook-*),
    with the compiled settings that hooks kept of the configurations in it."""
    remove_compiled_settings(RUN_DIR, top)
    shutil.rmtree(top)


def _entries(directory: str, prefix: str):
    """{name: (inode, mtime)} of directory's entries whose name starts with prefix; None when
    directory is not there."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return None
    found = {}
    for name in names:
        if name.startswith(prefix):
            try:
                st = os.lstat(os.path.join(directory, name))
            except FileNotFoundError:
                continue  # gone meanwhile
            found[name] = (st.st_ino, st.st_mtime_ns)
    return found


def _identity(path: str):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _podman(*args: str):
    """{id: name} from a `podman ... --format '{{.ID}} NAME'` listing of root's store; None where
    it cannot be had (no podman, not root, podman failed or hung on its lock)."""
    if os.geteuid() != 0:
        return None
    try:
        out = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return dict(line.partition(" ")[::2] for line in out.stdout.splitlines() if line.strip())


def snapshot(places: dict = PLACES, edited=EDITED, podman: bool = True) -> dict:
    """What of the host the check compares, as it is now."""
    return {
        "places": {directory: _entries(directory, prefix) for directory, prefix in places.items()},
        "edited": {path: _identity(path) for path in edited},
        "images": _podman("images", "--noheading", "--format", "{{.ID}} {{.Repository}}:{{.Tag}}") if podman else None,
        "containers": _podman("ps", "-a", "--noheading", "--format", "{{.ID}} {{.Names}}") if podman else None,
    }


def _another_runs(name: str, own: int) -> bool:
    """Whether name carries the pid of another live pytest (and not this one's)."""
    numbers = [int(n) for n in re.findall(r"[0-9]{3,}", name)]
    if own in numbers:
        return False
    for pid in numbers:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"pytest" in f.read():
                    return True
        except OSError:
            continue
    return False


def left(before: dict, after: dict, run_dir: str = RUN_DIR, own: int | None = None) -> list:
    """What appeared between two snapshots and is this run's to answer for, one line each; the
    dangling compiled settings among them are removed."""
    own = os.getpid() if own is None else own
    found = []
    for directory, now in after["places"].items():
        was = before["places"].get(directory)
        if now is None:
            continue
        if was is None and directory not in KEPT and directory not in MADE_BY_THEIR_PROGRAM:
            found.append(f"{directory}: made")
        was = was or {}
        for name in sorted(now):
            path = os.path.join(directory, name)
            if directory == run_dir and COMPILED.match(name):
                if now[name] != was.get(name):  # made or rewritten meanwhile
                    found += _compiled_left(path)
            elif name not in was and path not in KEPT and not _another_runs(name, own):
                found.append(f"{path}: made")
    for path, now in after["edited"].items():
        if now != before["edited"].get(path):
            found.append(f"{path}: {'changed' if now else 'removed'}")
    for kind, remove in (("images", "podman rmi"), ("containers", "podman rm")):
        if before[kind] is None or after[kind] is None:
            continue
        for ident, name in sorted(after[kind].items()):
            if ident not in before[kind] and not _another_runs(name, own):
                found.append(f"podman's {kind[:-1]} {name}: made ({remove} -f {ident})")
    return found


def _compiled_left(path: str) -> list:
    """A compiled settings file whose configuration is gone: removed, and named."""
    source = compiled_source(path)
    if source is None or os.path.exists(source):
        return []
    try:
        os.unlink(path)
    except FileNotFoundError:
        return []
    return [f"{path}: the compiled settings of {source}, which is gone (removed now)"]
