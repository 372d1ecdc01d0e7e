"""Whether the hook runs with the host's privilege, or inside a user namespace with none.

Rootless podman runs its OCI hooks in the user's user namespace: the hook is root there (uid 0
maps to the user), and nothing more. It may bind-mount in the container's mount namespace, which
that user namespace owns, but not write the container's device cgroup, nor root's directories.
The hook sees this from its own uid_map, with no setting to flip (docs/toolkit.md: rootless
podman), and then does what an unprivileged process may do (apply.py, prestart.py).

In such a namespace the host's root is not mapped: files of the host's root show as owned by
the overflow uid, as do those of every other user outside the namespace. root_uid() is the owner
the start path's ownership checks take as root's there (sources.py for mount sources,
settings.py for the configuration; docs/security.md: rootless podman).
Standard library only: this is on the start path.
"""

from __future__ import annotations

import os

_INITIAL = (0, 0, 4294967295)  # the initial user namespace maps every uid to itself
_OVERFLOW_UID = "/proc/sys/kernel/overflowuid"
_cached: dict = {}


def uid_map(path: str = "/proc/self/uid_map") -> list:
    """[(inside, outside, count)] of this process's user namespace."""
    with open(path) as f:
        return [tuple(int(x) for x in line.split()) for line in f if len(line.split()) == 3]


def unprivileged() -> bool:
    """Whether this process is in a user namespace other than the host's (rootless podman): its
    root there is no root of the host's. A kernel without user namespaces has no uid_map: the
    host's."""
    if "unprivileged" not in _cached:
        try:
            _cached["unprivileged"] = uid_map() != [_INITIAL]
        except OSError:
            _cached["unprivileged"] = False
    return _cached["unprivileged"]


def host_uid(inside: int, mapping) -> int | None:
    """The host's uid of uid inside of this namespace; None when it is not mapped."""
    for start, outside, count in mapping:
        if start <= inside < start + count:
            return outside + inside - start
    return None


def root_uid() -> int:
    """The uid the host's root has as this process sees file owners: 0 on the host; in a user
    namespace that maps it, what it maps to; else the overflow uid (65534 by default)."""
    if "root" not in _cached:
        uid = 0
        if unprivileged():
            uid = None
            for start, outside, count in uid_map():
                if outside <= 0 < outside + count:
                    uid = start - outside
            if uid is None:
                try:
                    with open(_OVERFLOW_UID) as f:
                        uid = int(f.read().strip())
                except (OSError, ValueError):
                    uid = 65534
        _cached["root"] = uid
    return _cached["root"]


def user() -> str:
    """Who the hook runs for, in words, for its log: 'uid 1000 (the user namespace's root)'."""
    try:
        uid = host_uid(os.geteuid(), uid_map())
    except OSError:
        uid = None
    return f"host uid {uid}" if uid is not None else "a user"
