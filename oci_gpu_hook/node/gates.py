"""The validation gates' verdicts on this node (issue 47), in the order the cluster's rollout
passes them:
- toolkit: the hook is installed, and a real GPU container, started through the node's own
  runtime, got exactly the GPU it asked for;
- plugin: a pod that asked the scheduler for one GPU got exactly one, and ran on it.
Each verdict is pending, passed or failed, with why and the fix when failed.

Whoever runs the rollout writes them (write); the device plugin reads them each round, when told
to follow them (`device-plugin --gate FILE`). It serves and registers nothing until the toolkit
gate first passes, so the node advertises no GPU on a hook that does not work. And while gate
toolkit has failed, every device is Unhealthy with that gate's line: the kubelet lowers
allocatable to 0, and nothing new is scheduled onto a node whose hook stopped working. Pods that
run keep their GPUs. (A failed gate plugin withdraws nothing: its next pod could not be placed.)

The file is root's alone (settings.write_trusted): a verdict decides whether pods get GPUs here.
One the plugin cannot trust or read counts as no verdict: pending before the first pass, and a
failure after it, so that a broken or forged file never advertises GPUs.
"""

from __future__ import annotations

import json
import os
import time

GATES_FILE = "gates.json"
ORDER = ("toolkit", "plugin")
STATES = ("pending", "passed", "failed")
LIMIT = 1 << 16


def gates_path(records_directory: str) -> str:
    """Beside the hook's records, as the plugin's health file: the one place the node pod's
    containers and the host share."""
    return os.path.join(os.path.dirname(os.path.abspath(records_directory)), GATES_FILE)


def verdict(state: str, why: str | None = None, fix: str | None = None) -> dict:
    if state not in STATES:
        raise ValueError(f"{state!r}: not a gate's state ({', '.join(STATES)})")
    return {"state": state, "why": why, "fix": fix, "at": time.time()}


def write(path: str, verdicts: dict) -> None:
    """The verdicts {gate: verdict(...)} (any gate of ORDER left out is pending). Raises OSError."""
    from oci_gpu_hook.start.settings import write_trusted

    unknown = set(verdicts) - set(ORDER)
    if unknown:
        raise ValueError(f"{', '.join(sorted(unknown))}: not a gate ({', '.join(ORDER)})")
    doc = {"format": 1, "gates": {g: verdicts.get(g) or verdict("pending") for g in ORDER}}
    # The hook's run directory, root's: made as the hook makes it where no start has yet.
    os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o755, exist_ok=True)
    write_trusted(path, json.dumps(doc, sort_keys=True).encode())


def read(path: str) -> dict:
    """{gate: verdict} from path; every gate pending when there is no file. ValueError when the
    file is there and not one to trust (not root's alone, not the format write makes)."""
    from oci_gpu_hook.start.settings import read_trusted

    try:
        data = read_trusted(path, LIMIT)
    except FileNotFoundError:
        return {g: verdict("pending") for g in ORDER}
    except OSError as e:
        raise ValueError(f"{path}: unreadable ({e.strerror})") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    try:
        doc = json.loads(data)
        gates = doc["gates"]
        if doc.get("format") != 1 or set(gates) != set(ORDER):
            raise ValueError
        for g in ORDER:
            if gates[g]["state"] not in STATES or not all(isinstance(gates[g].get(k), (str, type(None)))
                                                          for k in ("why", "fix")):  # fmt: skip
                raise ValueError
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path}: not a gates file of format 1") from None
    return {g: gates[g] for g in ORDER}


def failed(verdicts: dict) -> str | None:
    """The first failed gate's line, or None."""
    return next((line(g, verdicts[g]) for g in ORDER if verdicts[g]["state"] == "failed"), None)


def line(gate: str, verdict: dict) -> str:
    """One gate's verdict in one line: `gate NAME failed: WHY (fix: FIX)`, `gate NAME passed`."""
    if verdict["state"] != "failed":
        return f"gate {gate} {verdict['state']}"
    return f"gate {gate} failed: {verdict['why'] or 'no reason given'}" + (
        f" (fix: {verdict['fix']})" if verdict["fix"] else "")  # fmt: skip


def holding(verdicts: dict) -> str | None:
    """The line of the first gate that has not passed (what keeps gate (d), the labels and the
    exporter, waiting), or None once every gate passed."""
    return next((line(g, verdicts[g]) for g in ORDER if verdicts[g]["state"] != "passed"), None)


def toolkit_passed(verdicts: dict) -> bool:
    return verdicts["toolkit"]["state"] == "passed"
