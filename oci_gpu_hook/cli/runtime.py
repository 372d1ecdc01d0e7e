"""`oci-gpu-hook prestart` / `createRuntime`: listed here for --help; the runtime's calls take the
stdlib-only fast path in hook.py and never reach click."""

import click


@click.command(name="prestart")
@click.pass_obj
def prestart(obj):
    """Run as the OCI prestart hook: read the OCI state on stdin and give the container its GPUs.

    Also accepted as `createRuntime`. Exits 0 at once for a container that asks for no GPU.
    """
    from oci_gpu_hook.start.prestart import run

    return run(obj.config)


create_runtime = click.Command("createRuntime", callback=prestart.callback, params=[], hidden=True,
                               help=prestart.help)  # fmt: skip
