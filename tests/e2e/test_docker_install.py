"""`oci-gpu-hook install --runtime docker` as a user runs it, then a plain `dockerd` and a plain
`docker run --gpus 1`: dockerd reads its configuration where it reads it (/etc/docker/daemon.json)
and finds nvidia-container-runtime-hook on its own PATH, in /usr/bin where install writes it; no
test-only flag or PATH (tests/dockercheck.HostDockerd: a private mount namespace with overlays,
so the host's files are untouched). uninstall leaves /etc, /usr/local and /usr/bin as they were
(root, runc, busybox, gcc, dockerd, docker, unshare).

Installed as users install it (and gcc), with the start server by default, install's program there
is the compiled pre-filter, which
runs a launcher of its own (install.DOCKER_LAUNCHER); with the start server listening (started as
its unit would start it, on the socket the pre-filter offers to, a private tmpfs here), the start
is the server's worker's: its log records say "via": "start server". With --no-start-server, the
program is the launcher itself (no "via").
"""

import json

import pytest
from dockercheck import HostDockerd
from hookcheck import listed_uuids

from oci_gpu_hook.toolkit import containers, install


@pytest.mark.parametrize("start_server", [False, True], ids=["no start server", "start server (default)"])
def test_install_then_plain_docker_run_gpus_gives_exactly_the_gpu(simulated_host, require, tmp_path, start_server):
    require("root", "runc", "busybox", "gcc", "dockerd", "docker", "unshare")
    host = simulated_host(gpus=4, mig=[2])
    rootfs = containers.make_rootfs(str(tmp_path / "rootfs"))
    cli = containers.hook_command(f"{host['root']}/config.yaml")
    cidfile = str(tmp_path / "cid")
    with HostDockerd(str(tmp_path), cli, rootfs, "localhost/ocigpu-docker-install:test", start_server) as daemon:
        client = daemon.client
        out = client(*client.run_args("1"), "--cidfile", cidfile, daemon.tag, "nvidia-smi", "-L")
    assert daemon.before["install"]["rc"] == 0, daemon.before["install"]
    wrote = daemon.before["install"]["stdout"]
    assert f"wrote {install.DOCKER_HOOK}" in wrote, wrote
    # The pre-filter with its own launcher behind it only with the start server (install.docker_entries).
    assert (f"wrote {install.DOCKER_LAUNCHER}" in wrote) == start_server, wrote
    assert out.returncode == 0, out.stderr
    assert listed_uuids(out.stdout) == [host["gpus"][0]["uuid"]]
    # The hook's records of this start: configured, by the server's worker or by the launcher.
    with open(cidfile) as f:
        container = f.read().strip()
    with open(f"{host['root']}/hook.log") as f:
        entries = [e for e in map(json.loads, f) if e["container"] == container]
    assert [e["message"] for e in entries] == ["GPU devices configured"], entries
    assert entries[0].get("via") == ("start server" if start_server else None), entries
    if start_server:
        with open(daemon.server_log) as f:
            log = f.read()
        assert "not taken" not in log and "Traceback" not in log, log
    removed = daemon.after["uninstall"]["stdout"]
    assert daemon.after["uninstall"]["rc"] == 0, daemon.after["uninstall"]
    assert f"removed {install.DOCKER_HOOK}" in removed
    assert (f"removed {install.DOCKER_LAUNCHER}" in removed) == start_server, removed
    # dockerd's own key aside (it writes one when it starts), the configuration is as it was.
    for state in (daemon.before, daemon.after):
        state["tree"]["/etc"].pop("docker/key.json", None)
    assert daemon.after["tree"] == daemon.before["tree"] and daemon.after["usr/bin"] == daemon.before["usr/bin"]
