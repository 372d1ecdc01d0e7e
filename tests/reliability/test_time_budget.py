"""One time budget for the whole hook (deadline_seconds, from the process's start): a stale
inventory cache with an NVML that hangs fails the start within the budget, with one line and
nothing changed, instead of running into the runtime's hook timeout.

No test here times the hook (how long a start takes is `make bench`'s): they assert what the
budget makes the hook do, which holds however loaded the machine is.
"""

import os
import re
import subprocess
import sys
import time
import types

import hookcheck
import pytest

from oci_gpu_hook.start import budget as budget_module
from oci_gpu_hook.start import inventory_cache
from oci_gpu_hook.start.budget import Budget

NVML_CHILD = b"from oci_gpu_hook.start.nvml import _main"  # in the command line of nvml.query's child

HANG = r"""
#include <unistd.h>
__attribute__((constructor)) static void hang(void) { sleep(120); }
int nvmlInit_v2(void) { return 0; }
"""


@pytest.fixture
def hanging_nvml(live_container, tmp_path, require):
    require("gcc")
    container = live_container({"NVIDIA_VISIBLE_DEVICES": "0"}, host_options={"gpus": 1})
    host = container[4]
    library = f"{host['root']}/usr/lib64/libnvidia-ml.so.{host['driver_version']}"
    saved = tmp_path / "libnvidia-ml.saved"
    cache = f"{host['root']}/inventory-cache.json"
    os.rename(library, saved)
    try:  # the simulated host is shared: its NVML comes back whatever fails
        source = tmp_path / "hang.c"
        source.write_text(HANG)
        subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libnvidia-ml.so.1", "-o", library, str(source)],
                       check=True)  # fmt: skip
        if os.path.exists(cache):
            os.unlink(cache)  # stale: the next GPU start must rediscover, with NVML
        yield container
    finally:
        os.replace(saved, library)
        if os.path.exists(cache):
            os.unlink(cache)


def nvml_children(host_root: str) -> list[int]:
    """Pids of nvml.query's child processes asking an NVML under host_root (the hung one sleeps
    in its constructor for 120 s unless it is killed)."""
    prefix = host_root.encode() + b"/"
    return [pid for pid, argv in hookcheck.command_lines().items()
            if NVML_CHILD in b" ".join(argv) and any(a.startswith(prefix) for a in argv)]  # fmt: skip


def test_a_hung_nvml_on_a_stale_cache_fails_within_the_budget(hanging_nvml, tmp_path):
    """The hook gives NVML only what the 3 s budget leaves after the apply reserve (not NVML's own
    20 s default), gives up with its deadline message, kills the hung NVML child instead of waiting
    for it, and leaves everything as it was."""
    state, bundle, pid, cgroup, host = hanging_nvml
    config = f"{host['root']}/config.yaml"
    with open(config) as f:
        assert "deadline_seconds" not in f.read()
    config_3s = hookcheck.config_with(host, tmp_path, "deadline_seconds: 3\n")
    before = hookcheck.observe(hanging_nvml)
    assert nvml_children(host["root"]) == []
    try:  # the hung NVML sleeps 120 s: a hook that waited for it is still running at 60 s
        out = hookcheck.run_hook(config_3s, state, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the hook was still running after 60 s: it waited for the hung NVML, not for its budget")
    after = hookcheck.observe(hanging_nvml)
    assert out.returncode != 0
    line = hookcheck.one_clear_line(out.stderr.decode())
    assert "NVML" in line and "did not answer" in line and "inventory refresh" in line, line
    # NVML was asked under the budget's deadline: what 3 s leave after the apply reserve, no more.
    given = float(re.search(r"did not answer within ([0-9.]+) s", line).group(1))
    most = 3 - min(inventory_cache.APPLY_RESERVE, 3 / 4)
    assert inventory_cache.MIN_NVML_SECONDS <= given <= most, f"NVML was given {given} s of a 3 s budget: {line}"
    assert nvml_children(host["root"]) == [], "the hung NVML child outlived the hook"
    hookcheck.assert_rolled_back(before, after)
    assert not os.path.exists(f"{host['root']}/inventory-cache.json")


def test_no_time_left_for_nvml_is_said_clearly(hanging_nvml, monkeypatch):
    """A budget with too little left for NVML after the apply reserve: refused at once, without
    discovering the inventory or asking NVML at all."""
    from oci_gpu_hook.errors import InventoryError
    from oci_gpu_hook.start import discover, nvml, settings

    asked = []

    def refuse(name):
        def called(*args, **kwargs):
            asked.append(name)
            raise AssertionError(f"{name} was called with no time left for NVML")

        return called

    monkeypatch.setattr(discover, "discover", refuse("discover"))
    monkeypatch.setattr(nvml, "query", refuse("nvml.query"))
    host = hanging_nvml[4]
    hook_settings = settings.load(f"{host['root']}/config.yaml")
    with pytest.raises(InventoryError, match="leaves no time to ask NVML; run `oci-gpu-hook inventory refresh`"):
        inventory_cache.load(hook_settings, Budget(2.0, age=1.8))
    assert asked == []
    assert not os.path.exists(hook_settings.inventory_cache)


def test_the_budget_counts_from_the_process_start():
    """Run as a program, the budget is what is left after the process's own age (its start-up
    and the 0.3 s sleep included), read from the kernel's start time of the process."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    probe = (f"import sys; sys.path.insert(0, {repo!r}); import time; time.sleep(0.3); "
             "from oci_gpu_hook.start.budget import process_age, Budget; "
             "before = process_age(); remaining = Budget(10.0).remaining(); after = process_age(); "
             "print(before, remaining, after)")  # fmt: skip
    started = time.monotonic()
    young = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, check=True)
    lived = time.monotonic() - started
    before, remaining, after = (float(v) for v in young.stdout.split())
    assert 0.3 <= before <= after  # the sleep counts, and the age only grows
    # Its own age, not the machine's uptime: no more than this side saw it live (the kernel keeps
    # the start time in clock ticks, so the age may read up to one tick long).
    assert after <= lived + 1 / os.sysconf("SC_CLK_TCK")
    # Budget(10.0) was made and read between the two ages: what it left is 10 s less the age then.
    assert 10.0 - after - 1e-6 <= remaining <= 10.0 - before + 1e-6


def test_the_budget_counts_down_from_what_is_spent(monkeypatch):
    """In-process callers: age=0.0 starts the budget now, age=9.0 leaves 1 s of 10; the rest runs
    down with the monotonic clock (a fake one here)."""
    now = [100.0]
    clock = types.SimpleNamespace(monotonic=lambda: now[0], clock_gettime=time.clock_gettime,
                                  CLOCK_BOOTTIME=time.CLOCK_BOOTTIME)  # fmt: skip
    monkeypatch.setattr(budget_module, "time", clock)
    fresh = Budget(10.0, age=0.0)
    assert fresh.remaining() == 10.0
    assert Budget(10.0, age=9.0).remaining() == 1.0
    now[0] += 2.5
    assert fresh.remaining() == 7.5
    now[0] += 8.0
    assert fresh.remaining() == -0.5  # past the deadline: less than nothing left
