"""The node services' commands: `exporter` (Prometheus metrics) and `labels` (NFD features).
See docs/monitoring.md."""

import click


@click.command()
@click.option("--listen", metavar="HOST:PORT",
              help="Address to serve /metrics on (default: node.exporter_listen, :9400).")  # fmt: skip
@click.pass_obj
def exporter(obj, listen):
    """Serve GPU metrics for Prometheus (DCGM exporter names), labelled with the container, pod
    and namespace holding each device, and the hook's own counters. Runs until stopped."""
    from oci_gpu_hook.node import exporter as exporter_module

    settings = obj.settings
    listen = listen or settings.node.exporter_listen
    exporter_module.parse_listen(listen)  # a bad address says so before NVML starts
    return exporter_module.run(settings, listen)


@click.command()
@click.option("--output", metavar="FILE", help="Feature file to write (default: node.features_file); - prints.")
@click.option("--watch", metavar="SECONDS", type=click.FloatRange(min=1.0),
              help="Keep running: rewrite the file whenever the driver or GPUs change.")  # fmt: skip
@click.pass_obj
def labels(obj, output, watch):
    """Write the node's GPU labels (GPU feature discovery names) for NFD's local source."""
    import sys

    from oci_gpu_hook.node import features
    from oci_gpu_hook.start import inventory_cache

    settings = obj.settings
    if output == "-" and watch:
        from oci_gpu_hook.errors import UsageError

        raise UsageError("--watch writes a file: it cannot be used with --output -")
    if output == "-":
        inventory = inventory_cache.load(settings)
        click.echo(features.render(features.compute(inventory, settings.node.mig_strategy, settings.node.replicas)),
                   nl=False)  # fmt: skip
        return 0
    output = output or settings.node.features_file
    if watch:
        features.watch(settings, output, watch, lambda m: print(f"oci-gpu-hook labels: {m}", file=sys.stderr,
                                                                   flush=True))  # fmt: skip
        return 0
    changed = features.refresh(settings, output)
    click.echo(f"{output}: {'written' if changed else 'unchanged'}")
    return 0


@click.command()
@click.option("--interval", metavar="SECONDS", type=click.FloatRange(min=0.1, max=3600),
              help="Seconds between scans (default: node.watchdog_interval, 1).")  # fmt: skip
@click.option("--policy", type=click.Choice(["kill", "warn"]),
              help="Over the limit: kill the container's GPU processes, or only warn "
                   "(default: node.watchdog_policy).")  # fmt: skip
@click.option("--grace", metavar="SECONDS", type=click.FloatRange(min=0, max=3600),
              help="How long a container may stay over its limit before the kill "
                   "(default: node.watchdog_grace).")  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Say what would be killed; kill nothing.")
@click.option("--once", is_flag=True, help="Scan once and exit.")
@click.pass_obj
def watchdog(obj, interval, policy, grace, dry_run, once):
    """Enforce GPU memory limits on shared GPUs: kill (or report) the GPU processes of a container
    that uses more than its limit (docs/watchdog.md). Runs until stopped."""
    from oci_gpu_hook.node import watchdog as watchdog_module

    node = obj.settings.node
    interval = interval if interval is not None else node.watchdog_interval
    grace = grace if grace is not None else node.watchdog_grace
    return watchdog_module.run(obj.settings, interval, policy or node.watchdog_policy, grace, dry_run, once)
