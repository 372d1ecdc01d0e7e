"""The OCI state the runtime writes on the hook's stdin: which container, where its bundle is.

Untrusted size and shape are bounded here; everything after works on a checked ContainerState.
"""

from __future__ import annotations

import os

from oci_gpu_hook.errors import Exit, HookError
from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.start import jsonio
from oci_gpu_hook.start.digits import is_decimal

MAX_STATE_BYTES = 1 << 20


class StateError(HookError):
    """The OCI state on stdin is unusable."""

    exit_code = Exit.STATE


class ContainerState(Frozen):
    """Which container, where its bundle is (a Frozen: this module is on every container's start
    path, where dataclasses would cost more than the rest of a non-GPU start)."""

    __slots__ = ("oci_version", "id", "status", "pid", "bundle", "annotations")
    oci_version: str
    id: str
    status: str
    pid: int | None
    bundle: str
    annotations: dict


def supported_oci_version(version: str) -> bool:
    """runtime-spec 1.x.y (with an optional -suffix); a 2.x state may mean anything, so it is
    refused rather than guessed at."""
    core = version.split("-", 1)[0].split(".")
    return len(core) == 3 and core[0] == "1" and all(is_decimal(p) for p in core)


def load_json(data: bytes, what: str, limit: int):
    """JSON from untrusted bytes: bounded size, one-line errors for every way it can be bad."""
    if len(data) > limit:
        raise StateError(f"{what} is larger than {limit} bytes")
    try:
        return jsonio.loads(data)
    except RecursionError:
        raise StateError(f"{what} is nested too deeply") from None
    except UnicodeDecodeError:
        raise StateError(f"{what} is not valid UTF-8") from None
    except ValueError as e:
        raise StateError(f"{what} is not valid JSON: {e.args[0] if e.args else e}") from None


def parse(data: bytes) -> ContainerState:
    doc = load_json(data, "the OCI state on stdin", MAX_STATE_BYTES)
    if not isinstance(doc, dict):
        raise StateError("the OCI state on stdin is not a JSON object")

    def field(name, kind, required=True):
        value = doc.get(name)
        if value is None and not required:
            return None
        if not isinstance(value, kind) or isinstance(value, bool):
            raise StateError(f"the OCI state on stdin has no valid '{name}'")
        return value

    oci_version = field("ociVersion", str)
    if not supported_oci_version(oci_version):
        raise StateError(f"the OCI state has ociVersion {oci_version[:40]!r}; supported: 1.x.y")
    container_id = field("id", str)
    if not container_id or len(container_id) > 1024 or "\0" in container_id:
        raise StateError("the OCI state on stdin has no valid 'id'")
    status = field("status", str)
    bundle = field("bundle", str)
    if not os.path.isabs(bundle) or "\0" in bundle:
        raise StateError(f"the OCI state's bundle {bundle[:200]!r} is not an absolute path")
    pid = field("pid", int, required=False)
    if pid is not None and not 0 < pid < 1 << 22:
        raise StateError(f"the OCI state's pid {pid} is not a valid process id")
    annotations = doc.get("annotations") or {}
    if not isinstance(annotations, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()
    ):
        raise StateError("the OCI state's 'annotations' is not a map of strings")
    return ContainerState(oci_version, container_id, status, pid, bundle, annotations)
