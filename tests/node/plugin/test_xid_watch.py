"""Which XIDs make a device Unhealthy (xid_watch.policy): the configuration's health keys and
NVIDIA's DP_DISABLE_HEALTHCHECKS / DP_ENABLE_HEALTHCHECKS, with NVIDIA's meanings. (The thread
itself, on the simulated NVML's events: tests/node/plugin/test_supervisor.py and tests/e2e.)"""

import threading
import time

import pytest

from oci_gpu_hook.errors import ConfigError
from oci_gpu_hook.node.nvml_reader import DriverChanged
from oci_gpu_hook.node.plugin import config as plugin_config
from oci_gpu_hook.node.plugin import xid_watch


def critical(doc, environ=None, xids=(13, 31, 48, 63, 64, 79, 94, 95, 109, 119)):
    policy = xid_watch.policy(plugin_config.parse(doc, "p.yaml"), environ or {})
    return [x for x in xids if policy.is_critical(x)], policy.off


@pytest.mark.parametrize("doc, environ, want, off", [
    # NVIDIA's default: every XID but the application ones (13, 31, 43, 45, 68, 109).
    ({}, {}, [48, 63, 64, 79, 94, 95, 119], False),
    ({"health": {"criticalXids": [79, 48]}}, {}, [48, 79], False),
    ({"health": {"criticalXids": [79, 13]}}, {}, [79], False),  # still ignored
    ({"health": {"ignoredXids": [79]}}, {}, [13, 31, 48, 63, 64, 94, 95, 109, 119], False),
    ({"health": {"criticalXids": []}}, {}, [], True),
    ({}, {"DP_DISABLE_HEALTHCHECKS": "xids"}, [], True),
    ({}, {"DP_DISABLE_HEALTHCHECKS": "all"}, [], True),
    ({}, {"DP_DISABLE_HEALTHCHECKS": "79, 48,junk"}, [63, 64, 94, 95, 119], False),
    # Digits that are not ASCII are malformed entries, skipped: "¹" raised ValueError out of the
    # plugin's start (issue 52, item 3), and "٤٨" was read as XID 48.
    ({}, {"DP_DISABLE_HEALTHCHECKS": "13,¹"}, [48, 63, 64, 79, 94, 95, 119], False),
    ({}, {"DP_DISABLE_HEALTHCHECKS": "79,¹,٤٨"}, [48, 63, 64, 94, 95, 119], False),
    ({}, {"DP_ENABLE_HEALTHCHECKS": "¹³,٣١"}, [48, 63, 64, 79, 94, 95, 119], False),
    ({}, {"DP_DISABLE_HEALTHCHECKS": "all", "DP_ENABLE_HEALTHCHECKS": "79"}, [79], False),
    ({}, {"DP_ENABLE_HEALTHCHECKS": "13"}, [13, 48, 63, 64, 79, 94, 95, 119], False),
    ({}, {"DP_ENABLE_HEALTHCHECKS": "all"}, [13, 31, 48, 63, 64, 79, 94, 95, 109, 119], False),
])  # fmt: skip
def test_critical_xids(doc, environ, want, off):
    assert critical({"version": "v1", **doc}, environ) == (want, off)


@pytest.mark.parametrize("health, words", [
    ({"criticalXids": "some"}, "health.criticalXids"),
    ({"criticalXids": [0]}, "health.criticalXids"),
    ({"ignoredXids": "13"}, "health.ignoredXids"),
    ({"ignoredXids": [True]}, "health.ignoredXids"),
    ({"xids": [79]}, "health"),
])  # fmt: skip
def test_bad_health_keys_are_one_line(health, words):
    with pytest.raises(ConfigError) as e:
        plugin_config.parse({"version": "v1", "health": health}, "p.yaml")
    assert e.value.message.startswith(f"p.yaml: {words}") and "\n" not in e.value.message, e.value.message


def test_the_policy_says_what_counts():
    policy = xid_watch.policy(plugin_config.parse({"version": "v1"}, "p"), {"DP_ENABLE_HEALTHCHECKS": "13"})
    assert policy.describe() == "critical: every XID but 31, 43, 45, 68, 109, and 13"


@pytest.mark.parametrize("failure", [
    DriverChanged("the NVIDIA driver changed (550.54.15 -> 555.42.02): starting again to load its NVML"),
    RuntimeError("a defect\nover two lines"),
], ids=["driver-changed", "defect"])  # fmt: skip
def test_what_marking_an_xid_raises_is_one_line_and_the_watch_goes_on(host, inventory, failure):
    """The thread caught only NvmlError: DriverChanged from the plugin's health check (which an
    XID runs at once), or any defect there, ended the thread with a traceback, and no XID after it
    was ever seen. On the simulated NVML's events, in this process as the plugin runs it."""
    import nvmlevents

    from oci_gpu_hook.node.nvml_reader import NvmlReader

    uuid = host["gpus"][0]["uuid"]
    said, reported, uncaught = [], [], []

    def report(event):
        reported.append(event.xid)
        if len(reported) == 1:
            raise failure

    xids = xid_watch.policy(plugin_config.parse({"version": "v1"}, "p"), {})
    hook, threading.excepthook = threading.excepthook, uncaught.append
    watch = xid_watch.XidWatch(NvmlReader(inventory).path, [uuid], xids, report, said.append).start()
    try:
        assert watch.ready.wait(30), said
        nvmlevents.inject_xid(host["root"], uuid, 79)
        nvmlevents.inject_xid(host["root"], uuid, 48)
        deadline = time.monotonic() + 30  # a hang guard
        while len(reported) < 2 and watch.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = watch.thread.is_alive()
    finally:
        watch.stop()
        threading.excepthook = hook
        nvmlevents.clear_events(host["root"])
    assert (reported, alive, uncaught) == ([79, 48], True, [])
    (line,) = [s for s in said if "XID 79" in s]
    assert line.startswith(f"XID 79 on {uuid}: marking it Unhealthy: ") and "\n" not in line, line
    assert ("RuntimeError: a defect over two lines" if isinstance(failure, RuntimeError) else str(failure)) in line
