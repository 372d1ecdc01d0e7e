"""`oci-gpu-hook install --runtime docker` as a user runs it, then a plain `dockerd` and a plain
`docker run --gpus 1`: dockerd reads its configuration where it reads it (/etc/docker/daemon.json)
and finds nvidia-container-runtime-hook on its own PATH, in /usr/bin where install writes it; no
test-only flag or PATH (tests/dockercheck.HostDockerd: a private mount namespace with overlays,
so the host's files are untouched). uninstall leaves /etc, /usr/local and /usr/bin as they were
(root, runc, busybox, gcc, dockerd, docker, unshare).
"""

from dockercheck import HostDockerd
from hookcheck import listed_uuids

from oci_gpu_hook.toolkit import containers, install


def test_install_then_plain_docker_run_gpus_gives_exactly_the_gpu(simulated_host, require, tmp_path):
    require("root", "runc", "busybox", "gcc", "dockerd", "docker", "unshare")
    host = simulated_host(gpus=4, mig=[2])
    rootfs = containers.make_rootfs(str(tmp_path / "rootfs"))
    cli = containers.hook_command(f"{host['root']}/config.yaml")
    with HostDockerd(str(tmp_path), cli, rootfs, "localhost/ocigpu-docker-install:test") as daemon:
        out = daemon.client.run("1", "nvidia-smi -L", daemon.tag)
    assert daemon.before["install"]["rc"] == 0, daemon.before["install"]
    assert f"wrote {install.DOCKER_HOOK}" in daemon.before["install"]["stdout"]
    assert out.returncode == 0, out.stderr
    assert listed_uuids(out.stdout) == [host["gpus"][0]["uuid"]]
    assert (
        daemon.after["uninstall"]["rc"] == 0 and f"removed {install.DOCKER_HOOK}" in daemon.after["uninstall"]["stdout"]
    )
    # dockerd's own key aside (it writes one when it starts), the configuration is as it was.
    for state in (daemon.before, daemon.after):
        state["tree"]["/etc"].pop("docker/key.json", None)
    assert daemon.after["tree"] == daemon.before["tree"] and daemon.after["usr/bin"] == daemon.before["usr/bin"]
