"""`oci-gpu-hook toolkit install|uninstall`: from the node image, onto its host (toolkit/host.py)."""

import os

import click

_HOST_ROOT_HELP = "Where the host's root is mounted (the node pod mounts it at /host)."


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
@click.pass_obj
def install(obj, host_root, runtimes):
    """Place this image's bundle on the host, and run its `install --runtime ...` there, chrooted
    into the host's root. --config, when given, is a path on the host."""
    from oci_gpu_hook.toolkit import host

    options = ["--config", os.path.normpath(obj.config)] if obj.config else []
    for line in host.install(host_root, runtimes, options):
        click.echo(line)
    return 0


@toolkit.command("uninstall")
@click.option("--host-root", default="/host", show_default=True, type=click.Path(file_okay=False),
              help=_HOST_ROOT_HELP)  # fmt: skip
def uninstall(host_root):
    """Run `uninstall` on the host, chrooted into its root: every file install wrote there,
    the bundles included."""
    from oci_gpu_hook.toolkit import host

    for line in host.uninstall(host_root):
        click.echo(line)
    return 0
