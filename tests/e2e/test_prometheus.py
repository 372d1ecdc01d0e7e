"""Debian's Prometheus server scrapes the exporter while real runc containers run with the hook
on a simulated host whose NVML values the test sets: the framebuffer-used series of each pod is
the value set for that pod's GPU, and a deleted container's labels are gone at the next scrape.
The server gets its own port, configuration and data directory, and is stopped by its pid."""

import os
import time

import pytest
from hookcheck import runc_delete, runc_detached
from servicecheck import Exporter, Prometheus

from oci_gpu_hook.node.scrape_server import REUSE_SECONDS
from oci_gpu_hook.toolkit import containers
from oci_gpu_hook.toolkit.simulate import control

MIB = 1 << 20


@pytest.fixture
def stack(simulated_host, require, tmp_path):
    require("root", "gcc", "runc", "busybox", "pynvml", "prometheus")
    host = simulated_host(gpus=2)
    exporter = Exporter(f"{host['root']}/config.yaml", tmp_path)
    prometheus = Prometheus(tmp_path, f"127.0.0.1:{exporter.port}")
    started = []
    yield host, prometheus, started
    for name in started:
        runc_delete(name)
    prometheus.stop()
    exporter.stop()
    control.clear(host["root"])


def pod(tmp_path, host, started, name: str, gpu: int) -> str:
    container_id = f"ocigpu-prom-{os.getpid()}-{name}"
    bundle = containers.make_bundle(
        str(tmp_path / name), args=["busybox", "sleep", "600"], env={"NVIDIA_VISIBLE_DEVICES": str(gpu)},
        config_file=f"{host['root']}/config.yaml",
        annotations={"io.kubernetes.cri.sandbox-name": name, "io.kubernetes.cri.sandbox-namespace": "ml",
                     "io.kubernetes.cri.container-name": "trainer"},
    )  # fmt: skip
    started.append(container_id)
    runc_detached(bundle, container_id)
    return container_id


def test_framebuffer_used_by_pod_from_a_real_prometheus(stack, tmp_path):
    host, prometheus, started = stack
    gpu0, gpu1 = host["gpus"]
    control.write(host["root"], {gpu0["uuid"]: {"memory_used": 1111 * MIB}, gpu1["uuid"]: {"memory_used": 2222 * MIB}})
    pod(tmp_path, host, started, "pod-a", 0)
    b = pod(tmp_path, host, started, "pod-b", 1)

    (series,) = prometheus.wait_for('DCGM_FI_DEV_FB_USED{pod="pod-b"}')
    assert float(series["value"][1]) == 2222
    labels = series["metric"]
    assert (labels["UUID"], labels["gpu"], labels["namespace"], labels["container"]) == (gpu1["uuid"], "1", "ml",
                                                                                         "trainer")  # fmt: skip
    (series,) = prometheus.wait_for('DCGM_FI_DEV_FB_USED{pod="pod-a"}')
    assert float(series["value"][1]) == 1111 and series["metric"]["UUID"] == gpu0["uuid"]

    runc_delete(b)
    deleted = time.time()
    # The first scrape that starts once a page rendered before the deletion can no longer be
    # reused (scrape_server.REUSE_SECONDS) already lacks pod-b's labels.
    prometheus.wait_for(f'timestamp(up{{job="gpu"}}) > {deleted + REUSE_SECONDS + 0.05}')
    assert prometheus.query('DCGM_FI_DEV_FB_USED{pod="pod-b"}') == []
    (series,) = prometheus.query('DCGM_FI_DEV_FB_USED{gpu="1"}')
    assert "pod" not in series["metric"] and float(series["value"][1]) == 2222
    assert [s["metric"]["pod"] for s in prometheus.query('DCGM_FI_DEV_FB_USED{pod!=""}')] == ["pod-a"]
