"""Reliability tests report measurements (wall times) at the end of the run, in their own section."""

import pytest

_MEASURED = []


@pytest.fixture
def report_measurement():
    """report_measurement(line): shown under 'reliability measurements' after the test summary."""
    return _MEASURED.append


def pytest_terminal_summary(terminalreporter):
    if _MEASURED:
        terminalreporter.section("reliability measurements")
        for line in _MEASURED:
            terminalreporter.write_line(line)
