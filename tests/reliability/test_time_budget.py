"""One time budget for the whole hook (deadline_seconds, from the process's start): a stale
inventory cache with an NVML that hangs fails the start within the budget, with one line and
nothing changed, instead of running into the runtime's hook timeout."""

import os
import subprocess
import sys
import time

import hookcheck
import pytest

from oci_gpu_hook.start.budget import Budget

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


def test_a_hung_nvml_on_a_stale_cache_fails_within_the_budget(hanging_nvml, tmp_path):
    state, bundle, pid, cgroup, host = hanging_nvml
    config = f"{host['root']}/config.yaml"
    with open(config) as f:
        assert "deadline_seconds" not in f.read()
    config_3s = hookcheck.config_with(host, tmp_path, "deadline_seconds: 3\n")
    before = hookcheck.observe(hanging_nvml)
    started = time.monotonic()
    out = hookcheck.run_hook(config_3s, state, timeout=60)
    took = time.monotonic() - started
    after = hookcheck.observe(hanging_nvml)
    assert out.returncode != 0
    line = hookcheck.one_clear_line(out.stderr.decode())
    assert "NVML" in line and "did not answer" in line and "inventory refresh" in line, line
    assert took < 3 + 1.5, f"the hook took {took:.1f} s with a 3 s budget"  # (1.5 s: killing NVML's child)
    hookcheck.assert_rolled_back(before, after)
    assert not os.path.exists(f"{host['root']}/inventory-cache.json")


def test_no_time_left_for_nvml_is_said_clearly(hanging_nvml):
    """A budget with too little left for NVML after the apply reserve: refused at once."""
    from oci_gpu_hook.errors import InventoryError
    from oci_gpu_hook.start import inventory_cache, settings

    host = hanging_nvml[4]
    hook_settings = settings.load(f"{host['root']}/config.yaml")
    started = time.monotonic()
    with pytest.raises(InventoryError, match="leaves no time to ask NVML; run `oci-gpu-hook inventory refresh`"):
        inventory_cache.load(hook_settings, Budget(2.0, age=1.8))
    assert time.monotonic() - started < 1.0


def test_the_budget_counts_from_the_process_start():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    probe = (f"import sys; sys.path.insert(0, {repo!r}); import time; time.sleep(0.3); "
             "from oci_gpu_hook.start.budget import process_age, Budget; "
             "print(process_age(), Budget(10.0).remaining())")
    young = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, check=True)
    age, remaining = (float(v) for v in young.stdout.split())
    assert 0.3 <= age < 5.0  # its start-up and the sleep count
    assert 10.0 - age - 0.1 < remaining <= 10.0 - 0.3
    assert Budget(10.0, age=9.0).remaining() <= 1.0
    assert 9.9 < Budget(10.0, age=0.0).remaining() <= 10.0  # in-process callers: it starts now
