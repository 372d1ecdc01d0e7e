"""Fixtures of the simulator's tests."""

import subprocess

import pytest


@pytest.fixture
def sleepers():
    """Factory: a live process (sleep 60) for the control file to report on a device; killed after
    the test."""
    started = []

    def start():
        proc = subprocess.Popen(["sleep", "60"])
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()
