"""`oci-gpu-hook ldcache-refresh`: the createContainer hook that generated CDI specs name.

Runs on every start of a container that asks for a CDI GPU device, so it takes the same fast
path as prestart (hook.py dispatches here without loading click): parse the few options itself,
read the OCI state on stdin, create the driver's symlinks in the rootfs and refresh the
container's ld.so.cache with the host's ldconfig, confined as prestart confines it.
"""

from __future__ import annotations

import sys

from oci_gpu_hook.errors import UsageError
from oci_gpu_hook.start.prefilter_rule import LDCACHE_REFRESH as COMMAND


def parse_args(argv) -> tuple[list[str], list[tuple[str, str]]]:
    """(directories, [(path, value)]) from `--dir DIR` and `--link PATH=VALUE` (also `--dir=DIR`,
    `--link=PATH=VALUE`), each repeatable; anything else is a usage error."""
    directories, links = [], []
    argv = list(argv)
    while argv:
        word = argv.pop(0)
        name, eq, value = word.partition("=")
        if name not in ("--dir", "--link"):
            raise UsageError(f"{COMMAND}: unexpected argument {word!r} (expected --dir DIR or --link PATH=VALUE)")
        if not eq:
            if not argv:
                raise UsageError(f"{COMMAND}: {name} needs a value")
            value = argv.pop(0)
        if name == "--dir":
            if not value.startswith("/"):
                raise UsageError(f"--dir {value!r}: expected an absolute path inside the container")
            directories.append(value)
        else:
            path, sep, target = value.partition("=")
            if not sep or not path.startswith("/") or not target:
                raise UsageError(f"--link {value!r}: expected /PATH=VALUE")
            links.append((path, target))
    return directories, links


def run(argv, stdin=None) -> int:
    from oci_gpu_hook.start import spec, state
    from oci_gpu_hook.start.linux import labels, ldconfig
    from oci_gpu_hook.start.linux.rootfs import Rootfs, UndoLog

    directories, links = parse_args(argv)
    stdin = sys.stdin.buffer if stdin is None else stdin
    container = state.parse(stdin.read(state.MAX_STATE_BYTES + 1))
    config = spec.load(container.bundle)
    try:
        rootfs = Rootfs(config.rootfs, labels.labeler_for(config.mount_label))
    except OSError as e:
        raise ldconfig.LdconfigError(f"{config.rootfs}: cannot open the container's rootfs: {e.strerror}") from None
    undo = UndoLog()
    try:
        for path, value in links:
            try:
                rootfs.ensure_symlink(path, value, undo)
            except OSError as e:
                message = f"{path}: cannot create the symlink in the container: {e.strerror}"
                raise ldconfig.LdconfigError(message) from None
        if directories:
            ldconfig.refresh(rootfs, directories, undo)
        undo.commit()
    except BaseException:
        undo.rollback()
        raise
    finally:
        undo.close()
        rootfs.close()
    return 0
