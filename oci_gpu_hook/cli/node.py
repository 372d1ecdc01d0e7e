"""The node services' commands: `exporter` (Prometheus metrics), `labels` (NFD features),
`watchdog` (GPU memory limits) and `device-plugin` (Kubernetes). See docs/monitoring.md,
docs/watchdog.md and docs/kubernetes.md."""

import click


@click.command()
@click.option("--listen", metavar="HOST:PORT",
              help="Address to serve /metrics on (default: node.exporter_listen, :9400).")  # fmt: skip
@click.option("--gate", metavar="FILE",
              help="The validation gates' file (the toolkit's gates.json): /ready answers 503 until every gate "
                   "in it passed.")  # fmt: skip
@click.pass_obj
def exporter(obj, listen, gate):
    """Serve GPU metrics for Prometheus (DCGM exporter names), labelled with the container, pod
    and namespace holding each device, and the hook's own counters. Runs until stopped."""
    from oci_gpu_hook.node import exporter as exporter_module

    settings = obj.settings
    listen = listen or settings.node.exporter_listen
    exporter_module.parse_listen(listen)  # a bad address says so before NVML starts
    return exporter_module.run(settings, listen, gate)


@click.command()
@click.option("--output", metavar="FILE", help="Feature file to write (default: node.features_file); - prints.")
@click.option("--watch", metavar="SECONDS", type=click.FloatRange(min=1.0),
              help="Keep running: rewrite the file whenever the driver or GPUs change.")  # fmt: skip
@click.option("--heartbeat", metavar="FILE",
              help="With --watch: touch FILE after every round, for a liveness probe.")  # fmt: skip
@click.option("--cached-inventory", is_flag=True,
              help="Take the inventory from inventory_cache as the node's other services keep it, never from "
                   "the host itself (for a labels process that sees neither the driver nor /dev).")  # fmt: skip
@click.option("--prepare-for", metavar="GID", type=click.IntRange(min=1),
              help="As root, before labels runs as a user of group GID: make the feature file's directory (a "
                   "hidden one of its own in NFD's features.d) writable by GID, link the file's name in "
                   "features.d to it, and exit.")  # fmt: skip
@click.pass_obj
def labels(obj, output, watch, heartbeat, cached_inventory, prepare_for):
    """Write the node's GPU labels (GPU feature discovery names) for NFD's local source."""
    from oci_gpu_hook.errors import UsageError
    from oci_gpu_hook.node import features
    from oci_gpu_hook.start import inventory_cache

    settings = obj.settings
    if output == "-" and watch:
        raise UsageError("--watch writes a file: it cannot be used with --output -")
    if heartbeat and not watch:
        raise UsageError("--heartbeat needs --watch: a single run has no rounds to beat")
    if prepare_for is not None:
        if output == "-" or watch or cached_inventory:
            raise UsageError("--prepare-for prepares the feature file's directory and exits: it takes only --output")
        link = features.prepare(output or settings.node.features_file, prepare_for)
        click.echo(f"{link}: prepared for group {prepare_for}")
        return 0
    if output == "-":
        inventory = features.cached_inventory(settings) if cached_inventory else inventory_cache.load(settings)
        click.echo(features.render(features.for_node(settings, inventory)), nl=False)
        return 0
    output = output or settings.node.features_file
    if watch:
        from oci_gpu_hook.node import say

        features.watch(settings, output, watch, lambda m: say("labels", m), heartbeat=heartbeat,
                       cached=cached_inventory)  # fmt: skip
        return 0
    changed = features.refresh(settings, output, cached_inventory)
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
@click.option("--heartbeat", metavar="FILE", help="Touch FILE after every scan, for a liveness probe.")
@click.pass_obj
def watchdog(obj, interval, policy, grace, dry_run, once, heartbeat):
    """Enforce GPU memory limits on shared GPUs: kill (or report) the GPU processes of a container
    that uses more than its limit (docs/watchdog.md). Runs until stopped."""
    from oci_gpu_hook.node import watchdog as watchdog_module

    node = obj.settings.node
    interval = interval if interval is not None else node.watchdog_interval
    grace = grace if grace is not None else node.watchdog_grace
    return watchdog_module.run(obj.settings, interval, policy or node.watchdog_policy, grace, dry_run, once,
                               heartbeat)  # fmt: skip


@click.command("device-plugin")
@click.option("--config-file", metavar="FILE",
              help="The plugin's configuration (NVIDIA's version: v1 format; default: "
                   "node.device_plugin_config, else node.mig_strategy and node.replicas).")  # fmt: skip
@click.option(
    "--socket-dir", metavar="DIR", help="The kubelet's device-plugins directory (default: node.kubelet_socket_dir)."
)
@click.option("--interval", metavar="SECONDS", type=click.FloatRange(min=0.2, max=3600), default=5.0,
              show_default=True, help="Seconds between health checks and kubelet-restart checks.")  # fmt: skip
@click.option("--check", is_flag=True, help="Check the configuration against this node, print what would be "
                                            "offered, and exit.")  # fmt: skip
@click.option("--gate", metavar="FILE",
              help="Follow the validation gates' verdicts in FILE (the cluster's toolkit writes them, beside the "
                   "hook's records): offer nothing until the toolkit gate passes, and withdraw every device "
                   "while gate toolkit has failed (docs/kubernetes.md).")  # fmt: skip
@click.pass_obj
def device_plugin(obj, config_file, socket_dir, interval, check, gate):
    """Offer the node's GPUs to the kubelet as nvidia.com/gpu (and nvidia.com/gpu.shared,
    nvidia.com/mig-<profile>), through the device plugin API. Runs until stopped."""
    from oci_gpu_hook.node.plugin import config as plugin_config
    from oci_gpu_hook.node.plugin import resources

    settings = obj.settings
    node = settings.node
    config = plugin_config.load(config_file or node.device_plugin_config, node)
    where = plugin_config.source(config_file or node.device_plugin_config)
    if check:
        from oci_gpu_hook.node.plugin import allocation, mps
        from oci_gpu_hook.start import inventory_cache

        inventory = inventory_cache.load(settings)
        channels = allocation.imex_nodes(config, inventory, where)  # a required one missing: refused
        for resource in resources.resources(inventory, config, where):
            limit = f", memory limit {resource.memory_limit} each" if resource.memory_limit else ""
            if resource.mps_root:  # the daemon's program must be there, and what it will be told
                mps.control_program(inventory)
                limit += f", MPS ({mps.pipe_dir(resource.mps_root, resource.name)}): " + "; ".join(
                    mps.daemon_commands(resource)
                )
            count = len(resource.devices)
            click.echo(f"{resource.name}: {count} device{'' if count == 1 else 's'}{limit}")
            for device in resource.devices:
                click.echo(f"  {device.id}")
        if config.imex_channels:
            given = ", ".join(str(n) for n, _ in channels) or "none (the host has none of those configured)"
            click.echo(f"IMEX channels: {given}")
        return 0
    from oci_gpu_hook.node.plugin import supervisor

    return supervisor.run(settings, config, socket_dir or node.kubelet_socket_dir, interval, where, gate)
