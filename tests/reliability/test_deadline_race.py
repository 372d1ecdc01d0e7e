"""The deadline's SIGALRM arriving while apply is already failing for another reason.

The timer is one-shot and the handler raises where Python next checks for signals. An operation
that fails just as the deadline passes has its exception's handler start, and the alarm can be
run before that handler's first statement (which disarms the timer) has finished: the
DeadlineExceeded then left the handler before the rollback, the journal was closed as if all was
undone, and the hook said "every change was rolled back" with the mounts, files and device rules
still in place. The moment is forced here with a tracer (the narrowest point: the signal is a real
one, sent to the hook's own process at that line); the kernel can pick the same moment on any
start whose failure falls at its deadline."""

from __future__ import annotations

import os
import signal
import sys

import hookcheck

from oci_gpu_hook.errors import Exit
from oci_gpu_hook.start import apply

ENV = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "utility,compute"}


def test_the_deadline_as_an_operation_fails_still_rolls_everything_back(live_container, capsys, monkeypatch):
    container = live_container(ENV)
    state, bundle, pid, cgroup, host = container
    failing, fired = [], []

    def local(frame, event, arg):
        # The first line run after the operation's error reached _carry_out: its handler's first.
        if event == "exception" and not failing:
            failing.append(arg[0])
        elif event == "line" and failing and not fired:
            fired.append(frame.f_lineno)
            os.kill(os.getpid(), signal.SIGALRM)  # the deadline, as the handler starts
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code is apply._carry_out.__code__ else None

    monkeypatch.setenv(apply.FAULT_ENV, "20")  # operation 20 fails (the hook reads its own environment)
    before = hookcheck.observe(container)
    sys.settrace(tracer)
    try:
        result = hookcheck.run_hook_in_process(f"{host['root']}/config.yaml", state, capsys)
    finally:
        sys.settrace(None)
    after = hookcheck.observe(container)
    assert fired and failing[0] is apply.ApplyError, ("the alarm was not sent as the injected fault was handled",
                                                      failing)  # fmt: skip
    line = hookcheck.one_clear_line(result.stderr)
    assert result.returncode == Exit.APPLY, (result.returncode, line)
    assert "rollback incomplete" not in line, line
    hookcheck.assert_rolled_back(before, after)
    assert os.listdir(f"{host['root']}/pending") == [], "a journal was left though everything was undone"
