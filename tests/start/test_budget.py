"""start/budget.py's no_deadline_between: the deadline's SIGALRM held back for a step that must
not be cut in two, delivered on leaving; nested, the outer step stays whole."""

from __future__ import annotations

import signal

import pytest

from oci_gpu_hook.start.budget import no_deadline_between


@pytest.fixture
def alarms():
    """SIGALRM raises Alarm here, as the hook's deadline raises its own error."""

    class Alarm(Exception):
        pass

    def raise_alarm(*_):
        raise Alarm

    before = signal.signal(signal.SIGALRM, raise_alarm)
    try:
        yield Alarm
    finally:
        signal.signal(signal.SIGALRM, before)


def test_an_alarm_inside_is_delivered_on_leaving(alarms):
    reached = []
    with pytest.raises(alarms):
        with no_deadline_between():
            signal.raise_signal(signal.SIGALRM)
            reached.append("the step's end")
    assert reached == ["the step's end"]
    assert signal.SIGALRM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_leaving_an_inner_one_keeps_the_outer_one_whole(alarms):
    reached = []
    with pytest.raises(alarms):
        with no_deadline_between():
            with no_deadline_between():
                signal.raise_signal(signal.SIGALRM)
            reached.append("after the inner one")  # not cut by the alarm: the outer one holds it
    assert reached == ["after the inner one"]
    assert signal.SIGALRM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
