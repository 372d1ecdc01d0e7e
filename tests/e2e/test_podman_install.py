"""`oci-gpu-hook install --runtime podman` as a user runs it, then plain `podman run` (no
--hooks-dir): the podman installed reads the hooks directories its own configuration and version
give it (Debian 12's podman 4.3.1: /usr/share/containers/oci/hooks.d alone), and must run the hook.

Each case runs in a private mount namespace (tests/privatehost.py) with overlays over /etc,
/usr/share/containers, /usr/local and /var/lib, so podman reads its real default files and the
host is untouched; only podman's storage (storage.conf in the overlaid /etc) and state
directories are the test's own. uninstall must leave the configuration byte for byte as it was,
and doctor's verdict must agree with what the container got (root, podman, runc, busybox, gcc,
unshare).
"""

import json
import os
import re

import pytest
from hookcheck import listed_uuids
from privatehost import run

from oci_gpu_hook.toolkit import containers, install

IMAGE = "localhost/ocigpu-podman-install:test"
CONFIG_TREES = ["/etc", "/usr/share/containers", "/usr/local", "/var/lib/oci-gpu-hook"]
# A site's own hooks directory, named with what TOML and podman's list must keep as it is.
SITE_HOOKS = '/etc/site/gpu "hooks", d'


def doctor_line(result) -> str:
    lines = [line for line in result["stdout"].splitlines() if line.split()[1:2] == ["hooks-d"]]
    assert len(lines) == 1, result["stdout"] + result["stderr"]
    return lines[0]


@pytest.fixture(scope="module")
def host(simulated_host, require, tmp_path_factory):
    require("root", "podman", "runc", "busybox", "gcc", "unshare")
    host = simulated_host(gpus=4, mig=[2], scramble_minors=True)
    rootfs = containers.make_rootfs(str(tmp_path_factory.mktemp("podman-install") / "rootfs"))
    return host, rootfs


@pytest.mark.parametrize("site", [False, True], ids=["podman's defaults", "containers.conf sets hooks_dir"])
def test_install_then_plain_podman_run_gives_exactly_the_gpu(host, site, tmp_path):
    host, rootfs = host
    work = str(tmp_path)
    cli = containers.hook_command(f"{host['root']}/config.yaml")
    podman_run = ["podman", "run", "--rm", *containers.PODMAN_RUN_OPTIONS, "-e", "NVIDIA_VISIBLE_DEVICES=1", IMAGE,
                  "nvidia-smi", "-L"]  # fmt: skip
    storage = f'[storage]\ndriver = "vfs"\ngraphroot = "{work}/storage"\nrunroot = "{work}/run"\n'
    setup = [{"write": "/etc/containers/storage.conf", "text": storage}]
    if site:
        # The site's list (its own directory first) and a hook there that leaves a mark.
        conf = f'[engine]\nhooks_dir = [{json.dumps(SITE_HOOKS)}, "/usr/share/containers/oci/hooks.d"]\n'
        hook = {"version": "1.0.0", "hook": {"path": "/bin/sh", "args": ["sh", "-c", f"touch {work}/site-hook-ran"]},
                "when": {"always": True}, "stages": ["prestart"]}  # fmt: skip
        setup += [{"write": "/etc/containers/containers.conf", "text": conf},
                  {"write": f"{SITE_HOOKS}/site.json", "text": json.dumps(hook)}]  # fmt: skip
    steps = (
        setup
        + [
            {"run": ["sh", "-c", f'tar -C "$0" -cf - . | podman import - {IMAGE}', rootfs]},
            # What install wrote before it asked podman: the hooks.d file alone, which this podman
            # does not read; doctor must say so (it said PASS).
            {"write": install.HOOKS_D_FILE, "text": install.hooks_d_text(cli)},
            {"run": [*cli, "doctor"]},
            {"run": ["rm", install.HOOKS_D_FILE]},
            {"tree": CONFIG_TREES},  # before
            {"run": [*cli, "doctor"]},
            {"run": podman_run},
            {"run": [*cli, "install", "--runtime", "podman"]},
            {"run": [*cli, "doctor"]},
            {"run": podman_run},
            {"run": ["podman", "--log-level=debug", *podman_run[1:]]},  # podman names what it reads
            {"run": [*cli, "uninstall"]},
            {"tree": CONFIG_TREES},  # after
            {"run": [*cli, "doctor"]},
            {"run": podman_run},
        ]
    )
    r = run(work, ["/etc", "/usr/share/containers", "/usr/local", "/var/lib"], steps,
            tmpfs=["/run/libpod", "/run/containers"])[len(setup) :]  # fmt: skip
    imported, _, doctor_unread, _, before, doctor_before, run_before, installed, doctor_after, run_after = r[:10]
    debug, gone, after, doctor_gone, run_gone = r[10:]
    assert imported["rc"] == 0, imported["stderr"]
    line = doctor_line(doctor_unread)
    assert line.startswith("FAIL") and "oci-gpu-hook install --runtime podman" in doctor_unread["stdout"], line
    # Before: podman reads no hooks.d file of ours, the container gets no GPU, doctor says so.
    assert run_before["rc"] != 0 and "nvidia-smi" in run_before["stderr"], run_before
    assert doctor_line(doctor_before).startswith("FAIL"), doctor_before["stdout"]
    # Installed: exactly GPU 1, and doctor agrees.
    assert installed["rc"] == 0, installed
    assert run_after["rc"] == 0, run_after["stderr"]
    assert listed_uuids(run_after["stdout"], ("GPU",)) == [host["gpus"][1]["uuid"]]
    assert "warning" not in installed["stderr"], installed  # install asked podman what it now reads
    assert doctor_line(doctor_after).startswith("PASS"), doctor_after["stdout"]
    # What podman read, in its own words (logrus quotes the message as Go does: JSON reads it).
    read = [json.loads(f'"{m}"') for m in re.findall(r'msg="reading hooks from ((?:[^"\\]|\\.)*)"', debug["stderr"])]
    assert read == ([SITE_HOOKS] if site else []) + ["/usr/share/containers/oci/hooks.d", install.HOOKS_D_DIR]
    assert os.path.exists(f"{work}/site-hook-ran") == site  # the site's hook still runs
    # Uninstalled: the configuration byte for byte as it was; no GPU again, and doctor says so.
    assert gone["rc"] == 0, gone
    assert after == before
    assert run_gone["rc"] != 0 and "nvidia-smi" in run_gone["stderr"], run_gone
    assert doctor_line(doctor_gone).startswith("FAIL"), doctor_gone["stdout"]
