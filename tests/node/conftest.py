"""Fixtures shared by the node services' tests: a simulated host with a MIG GPU and its inventory
(a module that needs another host defines its own `host`)."""

import pytest

from oci_gpu_hook.start import inventory_cache
from oci_gpu_hook.start import settings as settings_module


@pytest.fixture(scope="module")
def host(simulated_host, require):
    """4 GPUs, the last one in MIG mode (profiles 1g.5gb, 2g.10gb, 3g.20gb)."""
    require("root", "gcc", "pynvml")
    return simulated_host(gpus=4, mig=[3])


@pytest.fixture(scope="module")
def inventory(host):
    return inventory_cache.load(settings_module.load(f"{host['root']}/config.yaml"))
