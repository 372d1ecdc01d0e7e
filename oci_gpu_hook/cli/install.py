"""`oci-gpu-hook install` / `uninstall`: hooks.d file, CRI-O drop-in, default config, refresh units."""

import os

import click

_ROOT_HELP = "Install into this directory tree instead of / (image builds, tests)."
# toolkit/restart.py's modes (not imported here: the CLI's start imports no toolkit module).
RESTART_MODES = ("none", "auto", "systemd", "signal")
_RESTART_HELP = ("Restart CRI-O or containerd when what they read at start changed: through systemd, by SIGTERM "
                 "for a supervisor that starts it again, or auto (systemd's service, else an error); none "
                 "leaves it to you.")  # fmt: skip


@click.command()
@click.option("--runtime", "runtimes", multiple=True,
              type=click.Choice(["podman", "crio", "containerd", "runc", "docker"]),
              help="Runtime to wire the hook into (repeatable; default podman).")  # fmt: skip
@click.option("--replace-nvidia-hook", is_flag=True,
              help="With --runtime docker: move NVIDIA's nvidia-container-runtime-hook aside (uninstall "
                   "restores it) instead of refusing.")  # fmt: skip
@click.option("--node-services", is_flag=True,
              help="Also install systemd units for the exporter, the NFD labels and the watchdog "
                   "(docs/monitoring.md, docs/watchdog.md).")  # fmt: skip
@click.option(
    "--device-plugin",
    is_flag=True,
    help="Also install a systemd unit for the Kubernetes device plugin (docs/kubernetes.md).",
)
@click.option("--prefilter/--no-prefilter", default=None,
              help="Put the compiled pre-filter where runtimes run the hook, so that containers that cannot "
                   "ask for a GPU start without Python (docs/performance.md). Default: where a C compiler "
                   "is found and builds it (one that cannot leaves the launcher, with a warning).")  # fmt: skip
@click.option("--start-server/--no-start-server", default=None,
              help="Install and enable the start server's systemd socket and service: GPU containers then "
                   "start from a warm process instead of a new interpreter (docs/performance.md). Default: "
                   "wherever runtimes run the pre-filter, which is what offers it starts (--start-server "
                   "fails without one).")  # fmt: skip
@click.option("--accept-volume-mounts", is_flag=True,
              help="The configuration install writes where there is none takes GPUs from the device plugin's "
                   "volume-mounts answer, and not from NVIDIA_VISIBLE_DEVICES in unprivileged containers "
                   "(accept_volume_mounts: true, accept_envvar_when_unprivileged: false), as the node pod's "
                   "device plugin answers (docs/kubernetes.md). An existing configuration is left as it "
                   "is.")  # fmt: skip
@click.option("--root", default="/", show_default=True, type=click.Path(file_okay=False), help=_ROOT_HELP)
@click.option("--restart", default="none", show_default=True, type=click.Choice(RESTART_MODES),
              help=_RESTART_HELP)  # fmt: skip
@click.option("--start-units", is_flag=True,
              help="Reload systemd and start the units install wrote (the refresh units, the node services asked "
                   "for, the start server's socket), instead of saying to; nothing where systemd does not run "
                   "the host.")  # fmt: skip
@click.pass_obj
def install(obj, runtimes, root, replace_nvidia_hook, node_services, device_plugin, prefilter, start_server,
            accept_volume_mounts, restart, start_units):  # fmt: skip
    """Install the hook's hooks.d file (and a CRI-O drop-in; for Docker's --gpus, the
    nvidia-container-runtime-hook program), a default configuration, and the systemd units and
    udev rule that refresh the inventory cache when the driver changes.

    Idempotent; everything written is listed in /var/lib/oci-gpu-hook/install-manifest.json for
    `uninstall`."""
    from oci_gpu_hook.toolkit import install as install_module

    if start_units and os.path.abspath(root) != "/":
        raise click.UsageError("--start-units: only when installing into /")
    runtimes = tuple(runtimes) or ("podman",)
    prefix = install_module.hook_command()
    if obj.config:
        prefix = prefix + ["--config", os.path.abspath(obj.config)]
    lines = install_module.install(root, runtimes, prefix, replace_nvidia_hook, node_services, device_plugin,
                                   prefilter, warn=_warn, start_server=start_server, restart=restart,
                                   accept_volume_mounts=accept_volume_mounts)  # fmt: skip
    for line in lines:
        click.echo(line)
    if not lines:
        click.echo("nothing to do: already installed")
    if "runc" in runtimes:
        click.echo(f"runc reads no hooks.d: add the hook to each config.json (docs/cli.md, prestart): "
                   f"path {prefix[0]}, args {prefix + ['prestart']}")  # fmt: skip
    if "docker" in runtimes and lines:
        click.echo("then restart dockerd: it looks for nvidia-container-runtime-hook when it starts "
                   "(systemctl restart docker)")  # fmt: skip
    restarts = "".join(f" && systemctl restart {r}" for r in ("crio", "containerd")
                       if r in runtimes and restart == "none")  # fmt: skip
    if lines and os.path.abspath(root) == "/" and start_units:
        # A start server running the launcher install just changed would serve the old code.
        changed = [install_module.START_SERVICE] if f"updated {install_module.START_LAUNCHER}" in lines else []
        units = install_module.units_to_start(root, node_services, device_plugin)
        for line in install_module.start_units(units, restart=changed):
            click.echo(line)
        if restarts:
            click.echo("then: " + restarts[len(" && ") :])
    elif lines and os.path.abspath(root) == "/":
        click.echo("then: systemctl daemon-reload && systemctl start oci-gpu-hook-refresh.path "
                   "oci-gpu-hook-refresh.service && udevadm control --reload" + restarts
                   + (f" && systemctl start {install_module.EXPORTER_SERVICE} {install_module.LABELS_SERVICE} "
                      f"{install_module.WATCHDOG_SERVICE}" if node_services else "")
                   + (f" && systemctl start {install_module.DEVICE_PLUGIN_SERVICE}" if device_plugin
                      else "")
                   + (f" && systemctl start {install_module.START_SOCKET}"
                      if os.path.lexists(install_module.START_SOCKET_LINK) else ""))  # fmt: skip
    return 0


def _warn(line: str) -> None:
    click.echo(f"oci-gpu-hook: warning: {line}", err=True)


@click.command()
@click.option("--root", default="/", show_default=True, type=click.Path(file_okay=False), help=_ROOT_HELP)
@click.option("--restart", default="none", show_default=True, type=click.Choice(RESTART_MODES),
              help=_RESTART_HELP + " Done after what the runtimes read is removed, before the programs.")  # fmt: skip
@click.option("--stop-units", is_flag=True,
              help="Stop the units install wrote before removing them, and reload systemd after; nothing where "
                   "systemd does not run the host.")  # fmt: skip
def uninstall(root, restart, stop_units):
    """Remove exactly what `install` wrote (files changed since are kept, with a note)."""
    from oci_gpu_hook.toolkit import install as install_module

    lines = install_module.uninstall(root, restart, stop_units)
    for line in lines:
        click.echo(line)
    if not lines:
        click.echo("nothing to do: not installed")
    return 0
