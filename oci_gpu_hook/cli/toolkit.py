"""`oci-gpu-hook toolkit install|uninstall`: from the node image, onto its host (toolkit/host.py)."""

import os

import click

from oci_gpu_hook.cli.install import RESTART_MODES

_HOST_ROOT_HELP = "Where the host's root is mounted (the node pod mounts it at /host)."
_RESTART_HELP = ("How to restart CRI-O or containerd when what they read at start changed (install's --restart): "
                 "auto asks systemd, and fails where the runtime is not its service; signal sends SIGTERM, for "
                 "a supervisor that starts it again; none leaves it to you.")  # fmt: skip


def _api_options(command):
    for option in reversed([
        click.option("--api-server", metavar="URL",
                     help="The API server (default: the pod's, from KUBERNETES_SERVICE_HOST and _PORT)."),
        click.option("--token-file", metavar="FILE", help="A bearer token (default: the pod's service account token)."),
        click.option("--ca-file", metavar="FILE", help="The API server's CA (default: the pod's service account CA)."),
    ]):  # fmt: skip
        command = option(command)
    return command


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


@toolkit.command("report")
@click.option("--node", required=True, help="The Node to report on (in a pod: spec.nodeName, from the downward API).")
@click.option("--namespace", default="default", show_default=True, help="Where the events go.")
@_api_options
@click.pass_obj
def report(obj, node, namespace, api_server, token_file, ca_file):
    """Say the validation gates' verdicts (gates.json beside the hook's records) on the Node: a
    label per gate, the GPUHookReady condition, and an event for each verdict that changed."""
    from oci_gpu_hook.errors import PrerequisiteError
    from oci_gpu_hook.node import gate_report, gates
    from oci_gpu_hook.node.kubeapi import Client

    path = gates.gates_path(obj.settings.records_path)
    client = Client.from_environment(api_server, token_file, ca_file)
    try:
        verdicts, untrusted = gates.read(path), None
    except ValueError as e:  # the device plugin withdraws the GPUs for it: the Node says so
        verdicts, untrusted = None, f"the gates' verdicts cannot be trusted: {e}"
    for line in gate_report.report(client, node, verdicts, namespace, untrusted):
        click.echo(line)
    if untrusted:
        raise PrerequisiteError(untrusted)
    return 0


@toolkit.command("validate")
@click.option("--gate", type=click.Choice(["toolkit", "plugin"]), default="toolkit", show_default=True,
              help="toolkit: the node's runtime gives a pod the GPU it asks for through the hook; plugin: a pod that "
                   "asks the scheduler for one GPU gets one of the node's.")  # fmt: skip
@click.option("--node", required=True, help="The Node to validate (in a pod: spec.nodeName).")
@click.option("--image", required=True, help="The node image, which the validation pod runs (its own, in a pod).")
@click.option("--gpu", metavar="UUID", help="Gate toolkit: the GPU to ask for (default: this node's last).")
@click.option("--resource", default="nvidia.com/gpu", show_default=True, help="Gate plugin: the resource to ask for.")
@click.option("--namespace", default="oci-gpu-hook", show_default=True, help="Where the validation pod runs.")
@click.option("--timeout", type=click.FloatRange(min=5, max=3600), default=120.0, show_default=True,
              help="Seconds the validation pod may take.")  # fmt: skip
@click.option(
    "--host-network",
    is_flag=True,
    help="Run the validation pod in the node's network: for a cluster with no pod network (no CNI).",
)
@_api_options
@click.pass_obj
def validate(obj, gate, node, image, gpu, resource, namespace, timeout, host_network, api_server, token_file,
             ca_file):  # fmt: skip
    """Run a validation gate with a pod on the node (toolkit: started by the node's runtime,
    asking for one GPU as the device plugin's volume-mounts answer does, must get exactly it;
    plugin: asking the scheduler for one GPU, must get one of the node's). The verdict goes to
    the gates' file (beside the hook's records); one line says it."""
    from oci_gpu_hook.errors import PrerequisiteError
    from oci_gpu_hook.node import gate_validation, gates
    from oci_gpu_hook.node.kubeapi import Client
    from oci_gpu_hook.start import inventory_cache

    inventory = inventory_cache.load(obj.settings)
    known, whole = gate_validation.gpus(inventory)
    if not known or (gate == "toolkit" and not (gpu or whole)):
        raise PrerequisiteError("this node has no GPU to validate with (--gpu names one)")
    client = Client.from_environment(api_server, token_file, ca_file)
    gates_file = gates.gates_path(obj.settings.records_path)
    click.echo(gate_validation.validate(client, gate, node, namespace, image, gates_file, known,
                                        gpu or (whole[-1] if whole else None), resource, timeout,
                                        host_network))  # fmt: skip
    return 0


@toolkit.command("rollout")
@click.option("--node", required=True, help="This pod's Node (spec.nodeName, from the downward API).")
@click.option("--pod", metavar="NAME",
              help="This pod's name (metadata.name, from the downward API): on SIGTERM, uninstall when its DaemonSet "
                   "is gone or being deleted. Without it, the hook stays.")  # fmt: skip
@click.option("--image", required=True, help="The node image, which the validation pods run (this pod's own).")
@click.option("--install/--no-install", default=True, show_default=True,
              help="Install the hook on the host each round (--no-install: it came another way, the RPM; the gates "
                   "still run, and removal uninstalls nothing).")  # fmt: skip
@click.option(
    "--runtime",
    type=click.Choice(["auto", "containerd", "crio"]),
    default="auto",
    show_default=True,
    help="The node's runtime; auto: the one its kubelet reports (the Node's containerRuntimeVersion).",
)
@click.option("--host-root", default="/host", show_default=True, type=click.Path(file_okay=False),
              help=_HOST_ROOT_HELP)  # fmt: skip
@click.option("--restart", default="auto", show_default=True, type=click.Choice(RESTART_MODES), help=_RESTART_HELP)
@click.option("--namespace", default="oci-gpu-hook", show_default=True,
              help="Where the validation pods run and the events go: this pod's.")  # fmt: skip
@click.option("--interval", type=click.FloatRange(min=10), default=300.0, show_default=True,
              help="Seconds between rounds.")  # fmt: skip
@click.option("--timeout", type=click.FloatRange(min=5, max=3600), default=120.0, show_default=True,
              help="Seconds a validation pod may take.")  # fmt: skip
@click.option(
    "--host-network",
    is_flag=True,
    help="Run the validation pods in the node's network: for a cluster with no pod network (no CNI).",
)
@click.option("--once", is_flag=True, help="One round, then exit (no uninstall).")
@_api_options
@click.pass_obj
def rollout(obj, node, pod, image, install, runtime, host_root, restart, namespace, interval, timeout, host_network,
            once, api_server, token_file, ca_file):  # fmt: skip
    """What the toolkit DaemonSet runs on each GPU node (deploy/kubernetes/25-toolkit.yaml): every
    round, install the hook on the host for the node's runtime, then gate toolkit, gate plugin once
    toolkit passed, and report on the Node. On SIGTERM, uninstall from the host when the DaemonSet
    is gone or being deleted (not on a rolling update). --config is this pod's configuration (its
    view of the host's driver and records); the host's hook keeps its own."""
    from oci_gpu_hook.node import gates
    from oci_gpu_hook.node.kubeapi import Client
    from oci_gpu_hook.node.rollout import Rollout, validation_selinux_type
    from oci_gpu_hook.start import inventory_cache
    from oci_gpu_hook.toolkit import host

    def install_step(name):
        return host.install(host_root, [name], (), restart)

    def uninstall_step(restarting):
        return host.uninstall(host_root, restart if restarting else "none")

    client = Client.from_environment(api_server, token_file, ca_file)
    Rollout(client, node, namespace, None if once else pod, image, gates.gates_path(obj.settings.records_path),
            lambda: inventory_cache.load(obj.settings), install_step if install else None,
            uninstall_step if install else None, lambda line: click.echo(line, nl=True),
            None if runtime == "auto" else runtime, timeout, host_network,
            validation_selinux_type(host_root)).run(interval, once)  # fmt: skip
    return 0


@toolkit.command("workload", hidden=True)
def workload():
    """What the validation pod runs: the GPUs nvidia-smi lists and the GPU device nodes this
    container sees, as JSON (also its termination message)."""
    import json

    from oci_gpu_hook.node import gate_validation

    click.echo(json.dumps(gate_validation.workload()))
    return 0
