"""Fixtures for the toolkit commands (cdi, doctor, install, validate)."""

import pytest


@pytest.fixture
def fresh_host(tmp_path, require):
    """A simulated host of its own (2 GPUs, GPU 1 in MIG mode), for tests that break it."""

    def make(**options):
        require("root", "gcc")
        from oci_gpu_hook.toolkit.simulate import simulate

        options = {"gpus": 2, "mig": [1], **options}
        return simulate(str(tmp_path / "host"), **options)

    return make
