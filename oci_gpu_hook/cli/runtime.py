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


@click.command(name="start-server")
@click.option("--socket", "socket_path", metavar="PATH",
              help="Listen here, when systemd passes no socket (default /run/oci-gpu-hook/start.sock: the path "
                   "`install` builds into the pre-filter).")  # fmt: skip
def start_server(socket_path):
    """Serve GPU starts from a warm process, for the pre-filter that `install` built.

    The pre-filter offers each start it would hand to Python; a worker forked from this process runs
    the hook for it, with the configuration the hook's entry names, so that a start pays for no
    interpreter and no imports. Runs until SIGTERM (oci-gpu-hook-start.socket starts it under
    systemd); without it, starts go to Python as before.
    """
    from oci_gpu_hook.start import server

    return server.main(socket_path)
