"""Carry out a plan inside the container, all or nothing: the parent's side of two processes.

start() forks a single-threaded child (applier.py) as soon as the container is known to want
GPUs: while this process finds the inventory and builds the plan, the child loads what mounting
needs, joins the container's mount namespace and checks it (on another CPU when there is one).
send() hands it the plan, or abort() tells it there is none; result() waits for its verdict.
The child rolls every change back itself before it reports a failure; the parent only waits
and relays, and kills it if it outlives the deadline.
"""

from __future__ import annotations

import _signal as signal  # the C core of signal: the same calls, without its enum wrappers (~5 ms)
import marshal
import os

from oci_gpu_hook.errors import Exit, HookError

FAULT_ENV = "OCI_GPU_HOOK_FAULT_AT"  # tests: fail the Nth operation (set only in the hook's own env)
_GRACE_SECONDS = 5.0


class ApplyError(HookError):
    exit_code = Exit.APPLY


class DeadlineExceeded(ApplyError):
    pass


def on_deadline(signum, frame):
    raise DeadlineExceeded("the hook's deadline passed; every change was rolled back")


class Child:
    """The applier child, started; exactly one of send() and abort() follows, then result()
    (abort waits by itself)."""

    def __init__(self, state, spec, settings, budget=None):
        if state.pid is None:
            raise ApplyError("the OCI state has no pid: the runtime must run the hook at prestart or createRuntime")
        self.seconds = settings.deadline_seconds if budget is None else budget.remaining()
        if self.seconds <= 0:
            raise DeadlineExceeded("the hook's deadline passed before the container was changed; nothing was done")
        plan_read, self.plan_fd = os.pipe()
        self.report_fd, report_write = os.pipe()
        try:
            self.pid = os.fork()
        except OSError as e:
            for fd in (plan_read, self.plan_fd, self.report_fd, report_write):
                os.close(fd)
            raise ApplyError(f"cannot start the hook's child: {e.strerror}") from None
        if self.pid == 0:  # the child: never returns into the caller's code
            code = 1
            try:
                os.close(self.plan_fd)
                os.close(self.report_fd)
                from oci_gpu_hook.start import applier

                report = applier.run(plan_read, state, spec, settings, self.seconds)
                code = 0 if report["ok"] else 1
                os.write(report_write, marshal.dumps(report))  # plain data, between two copies of this program
            finally:
                os._exit(code)
        os.close(plan_read)
        os.close(report_write)

    def send(self, plan) -> None:
        """The plan's operations, as (type name, field values): marshal carries plain data only."""
        data = memoryview(marshal.dumps([(type(op).__name__, op._values()) for op in plan.operations]))
        try:
            while data:
                data = data[os.write(self.plan_fd, data) :]
        except BrokenPipeError:
            pass  # the child stopped already (its deadline, a failed check): result() says why
        finally:
            os.close(self.plan_fd)
            self.plan_fd = None

    def abort(self) -> None:
        """No plan after all: the child undoes nothing (it changed nothing) and exits."""
        if self.plan_fd is not None:
            os.close(self.plan_fd)
            self.plan_fd = None
        try:
            self._read_report(None)
        except ApplyError:
            pass

    def result(self, meanwhile=None) -> dict:
        """The child's report once it has finished, or ApplyError (after its rollback).
        meanwhile: called while the child works (work that needs no result of it, done on
        another CPU); what it raises is the caller's, after the child is waited for."""
        report, failed_meanwhile = self._read_report(meanwhile)
        if not report["ok"]:
            failures = report["undo_failures"]
            error = ApplyError(report["error"] + (f" (rollback incomplete: {'; '.join(failures)})" if failures else ""))
            error.exit_code = report["exit_code"]
            error.undo_failures = report["undo_failures"]
            raise error
        if failed_meanwhile is not None:
            raise failed_meanwhile
        return report

    def _read_report(self, meanwhile):
        # The child has the deadline; the parent waits that long plus a grace for its rollback.
        signal.signal(signal.SIGALRM, on_deadline)
        signal.setitimer(signal.ITIMER_REAL, self.seconds + _GRACE_SECONDS)
        failed_meanwhile = None
        try:
            if meanwhile is not None:
                try:
                    meanwhile()
                except DeadlineExceeded:
                    raise  # the parent's own deadline: the child is killed below
                except Exception as e:  # noqa: BLE001 - the child is waited for first, whatever happened
                    failed_meanwhile = e
            chunks = []
            while True:
                chunk = os.read(self.report_fd, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
            os.waitpid(self.pid, 0)
        except DeadlineExceeded:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            raise ApplyError("the hook's child did not finish in time and was killed; its changes may remain") from None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            os.close(self.report_fd)
        try:
            return marshal.loads(b"".join(chunks)), failed_meanwhile
        except (EOFError, ValueError, TypeError):
            raise ApplyError("the hook's child died without a report") from None


def start(state, spec, settings, budget=None) -> Child:
    """Fork the applier child for this container (it gets what is left of the hook's budget:
    budget.Budget; all of deadline_seconds without one)."""
    return Child(state, spec, settings, budget)


def apply(plan, state, spec, settings, budget=None, meanwhile=None) -> dict:
    """Apply a plan made already: start, send, result."""
    child = start(state, spec, settings, budget)
    child.send(plan)
    return child.result(meanwhile)
