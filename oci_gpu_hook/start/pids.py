"""Which process a pid is: a pid names one process only together with its start time, because
the kernel hands pids out again. Standard library only (the hook records its container's init
process with it; the node services check a record against the live process before acting)."""

from __future__ import annotations

import os


def start_ticks(pid, proc: str = "/proc") -> int | None:
    """The process's start time (clock ticks since boot, field 22 of /proc/<pid>/stat); None when
    there is no such process, when it has exited and waits to be reaped (a zombie runs nothing:
    a container whose init is one is gone), or when procfs cannot say."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            data = f.read(4096)
        # The command name, in parentheses, may hold spaces and parentheses: split after the last.
        fields = data.rsplit(b")", 1)[1].split()
        if fields[0] in (b"Z", b"X"):
            return None
        return int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def is_same_process(pid: int, ticks: int, proc: str = "/proc") -> bool:
    """pid is still the process that started at ticks (not gone, not a new one on a reused pid)."""
    return ticks is not None and start_ticks(pid, proc) == ticks


def ticks_per_second() -> int:
    return os.sysconf("SC_CLK_TCK")
