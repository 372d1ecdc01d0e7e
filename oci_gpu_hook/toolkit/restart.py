"""Restart a container runtime whose configuration install or uninstall changed
(`install --restart`, `uninstall --restart`; the cluster's toolkit always asks for it).

CRI-O and containerd read what install writes for them (CRI-O's drop-in; containerd's config.toml,
drop-in and base spec) only when they start, and containerd keeps the base spec it read until
then. Only a changed file asks for a restart: the hooks.d file alone does not (CRI-O watches its
hooks directories; podman is no daemon), and an upgrade that only points the launcher's link at
another bundle changes nothing a runtime reads.

The running runtime is found from its own socket, where its configuration says it serves
(containerd's [grpc] address, as `containerd config dump` merges it; CRI-O's [crio.api] listen):
the process at the other end of a connection (SO_PEERCRED) is the one serving. Modes:
- systemd: the unit that process runs in (its cgroup) is restarted through systemd's private
  socket, as `systemctl restart UNIT` would;
- signal: SIGTERM to it, for a supervisor that starts it again (runit, s6, a test's loop);
- auto: systemd where the host runs it and the runtime is one of its units; else an error that
  says to restart it by hand.
Each waits until another process serves the socket. A runtime that is not running has nothing
to restart: it reads the change when it starts. A socket systemd itself holds (socket activation:
pid 1) is refused: restart the service yourself.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import time

from oci_gpu_hook.errors import Exit, HookError

MODES = ("none", "auto", "systemd", "signal")
WAIT = 120.0  # seconds for a runtime to serve again (CRI-O reads its storage; containerd its plugins)


class RestartError(HookError):
    exit_code = Exit.INSTALL


def changed(before: dict, after: dict, files_by_runtime: dict) -> list:
    """The runtimes (keys of files_by_runtime, in its order) one of whose files the install
    manifests before and after record differently: written, changed or removed, or edited."""
    found = []
    for runtime, paths in files_by_runtime.items():
        for manifest_key in ("files", "edited"):
            if any(before.get(manifest_key, {}).get(p) != after.get(manifest_key, {}).get(p) for p in paths):
                found.append(runtime)
                break
    return found


def socket_of(runtime: str) -> str:
    """Where the runtime serves its API, as its configuration on this host says."""
    if runtime == "crio":
        from oci_gpu_hook.toolkit import runtime_config

        try:
            return runtime_config.crio_listen("/")
        except runtime_config.ConfigFileError as e:
            raise RestartError(f"crio: {e}") from None
    from oci_gpu_hook.toolkit import containerd

    try:
        config = containerd.dump(config_file=containerd.CONFIG if os.path.exists(containerd.CONFIG) else None)
    except containerd.ContainerdError as e:
        raise RestartError(f"containerd: {e}") from None
    address = config.get("grpc", {}).get("address")
    if not isinstance(address, str) or not address:
        raise RestartError("containerd: its configuration names no [grpc] address")
    return address


def serving(path: str) -> int | None:
    """The pid of the process that accepts connections at the Unix socket path, or None when none
    does (no socket, or nothing listening)."""
    found = _peer(path)
    return None if found is None else found[0]


def _peer(path: str) -> tuple | None:
    """(pid, uid) of the process listening at path, or None. The pid is as this process's PID
    namespace sees it: 0 when the listener is in one it cannot see (a toolkit pod without the
    host's PID namespace), which restart refuses."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    try:
        sock.connect(path)
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return pid, uid
    except (FileNotFoundError, ConnectionRefusedError, socket.timeout):
        return None
    except OSError as e:
        raise RestartError(f"{path}: cannot ask who serves it ({e.strerror})") from None
    finally:
        sock.close()


def unit_of(pid: int) -> str | None:
    """The systemd service pid runs in (unit_in its /proc/PID/cgroup), or None."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return unit_in(f.read())
    except OSError:
        return None


def unit_in(cgroups: str) -> str | None:
    """The service a /proc/PID/cgroup names: the last component of the systemd hierarchy's path
    (name=systemd on cgroup v1 and hybrid hosts, else the unified one), when it is a .service."""
    paths = {}
    for line in cgroups.splitlines():
        hierarchy, _, path = line.partition(":")[2].partition(":")
        paths[hierarchy] = path
    name = os.path.basename(paths.get("name=systemd", paths.get("", "")))
    return name if name.endswith(".service") and len(name) > len(".service") else None


def restart(runtime: str, mode: str, path: str | None = None) -> list:
    """Restart the runtime by mode; lines saying what was done. path: its socket, where the
    caller knows it (else socket_of)."""
    path = path or socket_of(runtime)
    peer = _peer(path)
    if peer is None:
        return [f"{runtime} is not running (nothing serves {path}): it reads the change when it starts"]
    pid, uid = peer
    if pid <= 0 or not os.path.isdir(f"/proc/{pid}"):
        # Not a process this one can name: signalled as it is, kill(0) would reach our own group.
        raise RestartError(f"{runtime}: {path} is served by a process outside this PID namespace: not restarted "
                           "(the toolkit needs the host's PID namespace, hostPID)")  # fmt: skip
    if uid != 0:
        # Not the runtime (which runs as root): whoever could listen there is not to be signalled,
        # nor their service restarted, on a configuration file's word.
        raise RestartError(f"{runtime}: {path} is served by pid {pid} of uid {uid}, not root's runtime: not restarted")
    if pid == 1:
        raise RestartError(f"{runtime}: {path} is held by PID 1 (socket activation): restart the service yourself")
    unit = unit_of(pid)
    if mode == "auto":
        if unit is None or not os.path.isdir("/run/systemd/system"):
            raise RestartError(f"{runtime} (pid {pid}) is not a systemd service: restart it yourself to read what "
                               "install changed (or --restart signal, where a supervisor starts it again)")  # fmt: skip
        mode = "systemd"
    if mode == "systemd":
        from oci_gpu_hook.toolkit import systemd_manager as systemd

        if unit is None:
            raise RestartError(f"{runtime} (pid {pid}) runs in no systemd service: restart it yourself")
        try:
            systemd.restart_unit(unit)
        except (systemd.SystemdError, OSError) as e:
            raise RestartError(f"{runtime}: systemd did not restart {unit}: {e}") from None
    elif mode == "signal":
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass  # gone already: what matters is the next one serving
    else:
        raise RestartError(f"--restart {mode}: not one of {', '.join(MODES)}")
    now = _next_serving(path, pid)
    how = f"systemd restarted {unit}" if mode == "systemd" else "SIGTERM"
    return [f"restarted {runtime}: pid {pid}, then pid {now} ({how})"]


def _next_serving(path: str, old: int) -> int:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        now = serving(path)
        if now is not None and now != old:
            return now
        time.sleep(0.1)
    raise RestartError(f"nothing new served {path} within {WAIT:.0f} s of the restart (pid {old} before)")
