"""`oci-gpu-hook validate`: start a small container per GPU with the hook and check what it sees."""

import os

import click


@click.command(name="validate")
@click.option("--runtime", type=click.Choice(["runc", "podman"]), default="runc", show_default=True,
              help="Start containers with runc (hook in config.json) or podman (hook from a hooks.d dir).")  # fmt: skip
@click.option("--oci-runtime", metavar="NAME",
              help="With --runtime podman: the OCI runtime podman uses (a name such as crun or runc, or a "
              "path); default: the one podman is configured with.")  # fmt: skip
@click.pass_obj
def validate(obj, runtime, oci_runtime):
    """For every GPU, run nvidia-smi -L in a container that asks for that GPU (and, on a real GPU
    host, a CUDA sample if one is installed); one PASS/FAIL line per GPU. Exit status 1 when any
    GPU fails. Needs root, runc (or podman) and busybox-static."""
    from oci_gpu_hook.toolkit import validate as validate_module

    if oci_runtime is not None and runtime != "podman":
        raise click.UsageError("--oci-runtime goes with --runtime podman (runc is the OCI runtime itself)")
    config_file = os.path.abspath(obj.config) if obj.config else None
    results = validate_module.run(obj.settings, config_file, runtime, oci_runtime=oci_runtime,
                                  on_result=lambda r: click.echo(r.line()))  # fmt: skip
    failed = sum(not r.ok for r in results)
    click.echo(f"validate: {len(results) - failed} of {len(results)} GPU(s) passed")
    return 1 if failed else 0
