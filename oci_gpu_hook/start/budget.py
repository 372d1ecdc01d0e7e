"""The hook's one time budget: `deadline_seconds`, counted from the moment the runtime started
the hook's process, so that interpreter start-up, reading the state and config.json, rebuilding a
stale inventory (NVML included), the plan, every mount and ldconfig all fit inside it. The
runtime's own hook timeout (10 s in hooks.d) must be larger; past the budget the hook rolls
back and fails with one line instead of being killed half-way. Standard library only.
"""

from __future__ import annotations

import _signal as signal  # signal without its enum wrappers: 4.6 ms less per cold start (docs/performance.md)
import time

from oci_gpu_hook.start import pids


def process_age(pid="self") -> float:
    """Seconds since this process (or pid) started, by the kernel's clock (0.0 if procfs cannot say)."""
    ticks = pids.start_ticks(pid)
    if ticks is None:
        return 0.0
    return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / pids.ticks_per_second())


class Budget:
    def __init__(self, seconds: float, age: float | None = None):
        """age: how much of it is spent already; None: the process's age (the hook run as a
        program). A caller that runs the hook in-process passes 0.0: its budget starts now."""
        if age is None:
            age = process_age()
        self.seconds = seconds
        self.end = time.monotonic() + seconds - age

    def remaining(self) -> float:
        return self.end - time.monotonic()


class no_deadline_between:
    """Holds the deadline's SIGALRM back for a step that must not be cut in two: a change and the
    record of its undo (raised between the two, the change would stay with nothing to undo it), a
    child reaped and forgotten (a pid forgotten late could be killed after another process got
    it). A signal that came meanwhile is delivered on leaving. Nests: leaving an inner one keeps
    what the outer one holds back."""

    _ALARM = {signal.SIGALRM}

    def __enter__(self):
        self._before = signal.pthread_sigmask(signal.SIG_BLOCK, self._ALARM)

    def __exit__(self, *exc):
        signal.pthread_sigmask(signal.SIG_SETMASK, self._before)
        return False
