"""`oci-gpu-hook toolkit install|uninstall`: from the node image, onto its host (toolkit/host.py)."""

import os

import click

from oci_gpu_hook.cli.install import RESTART_MODES

_HOST_ROOT_HELP = "Where the host's root is mounted (the node pod mounts it at /host)."
_RESTART_HELP = ("How to restart CRI-O or containerd when what they read at start changed (install's --restart): "
                 "auto asks systemd, and fails where the runtime is not its service; signal sends SIGTERM, for "
                 "a supervisor that starts it again; none leaves it to you.")  # fmt: skip


@click.group()
def toolkit():
    """Put the hook on the host from the node image (docs/deploy.md): its bundle, then `install`
    run on the host by that bundle."""


@toolkit.command("install")
@click.option("--host-root", default="/host", show_default=True, type=click.Path(file_okay=False),
              help=_HOST_ROOT_HELP)  # fmt: skip
@click.option("--runtime", "runtimes", multiple=True, required=True,
              type=click.Choice(["podman", "crio", "containerd", "runc"]),
              help="Runtime to wire the hook into on the host (repeatable).")  # fmt: skip
@click.option("--restart", default="auto", show_default=True, type=click.Choice(RESTART_MODES), help=_RESTART_HELP)
@click.pass_obj
def install(obj, host_root, runtimes, restart):
    """Place this image's bundle on the host, and run its `install --runtime ...` there, chrooted
    into the host's root. --config, when given, is a path on the host."""
    from oci_gpu_hook.toolkit import host

    options = ["--config", os.path.normpath(obj.config)] if obj.config else []
    for line in host.install(host_root, runtimes, options, restart):
        click.echo(line)
    return 0


@toolkit.command("uninstall")
@click.option("--host-root", default="/host", show_default=True, type=click.Path(file_okay=False),
              help=_HOST_ROOT_HELP)  # fmt: skip
@click.option("--restart", default="auto", show_default=True, type=click.Choice(RESTART_MODES), help=_RESTART_HELP)
def uninstall(host_root, restart):
    """Run `uninstall` on the host, chrooted into its root: every file install wrote there,
    the bundles included."""
    from oci_gpu_hook.toolkit import host

    for line in host.uninstall(host_root, restart):
        click.echo(line)
    return 0
