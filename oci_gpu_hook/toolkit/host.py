"""`oci-gpu-hook toolkit install|uninstall`: the hook put on its host from the node image (issue 47).

Run from the node image's bundle (toolkit/bundle.py) with the host's root mounted at a directory
(`/host` in the node pod). Two steps:
1. the bundle is placed on the host, whole or not at all (install.place_bundle);
2. that copy's own CLI runs chrooted into the host's root: `install` or `uninstall` there is what
   an administrator would type at the host's shell, so it reads the host's runtime configuration,
   asks the host's containerd and podman, labels by the host's SELinux policy, and writes paths
   that name the bundle where it stays once the image is gone.
A chroot and not the host's mount namespace (`nsenter -t 1 -m`): the directory given is the host,
whatever PID 1 is (a test's private tree, a node VM's). The child gets a fixed environment.
"""

from __future__ import annotations

import os
import subprocess

from oci_gpu_hook.errors import Exit, HookError
from oci_gpu_hook.toolkit import bundle
from oci_gpu_hook.toolkit import install as install_module

ENVIRONMENT = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
# install relabels and asks runtimes; uninstall removes a bundle of some thousand files and the
# SELinux module, then waits for systemd's reload (up to systemd_manager.RELOAD_TIMEOUT). Both are
# hang guards: in the node VM under qemu's TCG, with a control plane beside it, one install (the
# module loaded, systemd asked) took over 280 s. Under the toolkit pod's grace period (600 s,
# deploy/kubernetes/25-toolkit.yaml), so that an uninstall on removal ends before the kubelet kills
# the pod's processes.
TIMEOUT = 540


class HostError(HookError):
    exit_code = Exit.INSTALL


def install(host_root: str, runtimes, options=(), restart: str = "auto") -> list:
    """Place the running bundle on the host and install the hook there for runtimes, restarting
    a runtime whose configuration changed (restart: toolkit/restart.py's mode); options go before
    the command (the host's --config). Returns the lines both steps said."""
    running = _running()
    lines = install_module.place_bundle(host_root, bundle.directory(running))
    argv = [
        *options,
        "install",
        *(a for r in runtimes for a in ("--runtime", r)),
        "--restart",
        restart,
        "--start-units",
        # What the node pod's device plugin answers (deploy/kubernetes/20-configmap.yaml).
        "--accept-volume-mounts",
    ]
    return lines + _on_host(host_root, running, argv)


def uninstall(host_root: str, restart: str = "auto") -> list:
    """Uninstall from the host with the running bundle's copy there (placed first where it is not:
    uninstall then removes it with the others the manifest records), restarting the runtimes
    whose configuration it takes back before it removes the programs."""
    running = _running()
    lines = install_module.place_bundle(host_root, bundle.directory(running))
    argv = ["uninstall", "--restart", restart, "--stop-units"]
    return [line for line in lines if not line.startswith("wrote ")] + _on_host(host_root, running, argv)


def _running() -> str:
    running = bundle.running()
    if running is None:
        raise HostError("toolkit: runs from the node image's bundle (deploy/build-image.py), not from this install")
    return running


def _on_host(host_root: str, bundle_id: str, argv: list) -> list:
    root = os.path.abspath(host_root)

    def enter():
        os.chroot(root)
        os.chdir("/")

    command = [f"{bundle.directory(bundle_id)}/{bundle.LAUNCHER}", *argv]
    try:
        done = subprocess.run(command, preexec_fn=enter, env=ENVIRONMENT, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise HostError(f"{root}: {' '.join(argv)} on the host took over {TIMEOUT} s") from None
    except OSError as e:
        raise HostError(f"{root}: cannot run the bundle there: {e.filename or command[0]}: {e.strerror}") from None
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise HostError(f"{root}: {' '.join(argv)} on the host failed: {said}")
    return done.stdout.splitlines()
