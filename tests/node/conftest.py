"""Fixtures shared by the node services' tests: the inventory of the module's simulated host (the
`host` fixture of tests/conftest.py, with each module's `host` marker)."""

import pytest

from oci_gpu_hook.start import inventory_cache
from oci_gpu_hook.start import settings as settings_module
from oci_gpu_hook.toolkit.simulate import control


@pytest.fixture(scope="module")
def inventory(host):
    return inventory_cache.load(settings_module.load(f"{host['root']}/config.yaml"))


@pytest.fixture
def fresh_nvml_values(host):
    """For modules whose tests set the host's live NVML values (simulate.control): cleared after
    each test (pytestmark's usefixtures)."""
    yield
    control.clear(host["root"])
