"""The program's entry point: the runtime runs it on every container start.

Standard library only at import time. Commands a runtime calls take the fast path here; any
other command loads the click CLI (cli/) on demand. Whatever happens, the user sees one line on
stderr and an exit status, never a traceback (OCI_GPU_HOOK_DEBUG=1 shows one for bug reports).

The launchers (toolkit/launcher.py) start Python with -S: the runtime's commands need only the
standard library and this package, and the site module (with whatever .pth files the host's
packages installed) would cost every container start milliseconds. The CLI's commands need the
installed dependencies, so they run site first.
"""

from __future__ import annotations

import os
import sys

from oci_gpu_hook.errors import Exit, exit_status_of
from oci_gpu_hook.start.prefilter_rule import (
    LDCACHE_REFRESH,
    RUNTIME_COMMANDS,
    START_SERVER,
    is_runtime_command,
    split_config,
)

INTERNAL_ERROR_EXIT = Exit.INTERNAL


def run(argv, as_program: bool = False) -> int:
    """as_program: this process was started to run this command (its time budget counts from the
    process's start); False when a caller runs it in-process (its budget starts now)."""
    config, rest = split_config(argv)
    if is_runtime_command(argv):
        from oci_gpu_hook.start.prestart import run as prestart

        return prestart(config, since_process_start=as_program)
    if rest and rest[0] == LDCACHE_REFRESH and not {"-h", "--help"} & set(rest):
        from oci_gpu_hook.start import ldcache_refresh

        return ldcache_refresh.run(rest[1:])
    if rest and rest[0] == START_SERVER and (len(rest) == 1 or (len(rest) == 3 and rest[1] == "--socket")):
        # Without click: each worker is a fork of this process, and a smaller process forks faster.
        from oci_gpu_hook.start import server

        return server.main(rest[2] if len(rest) == 3 else None)
    from oci_gpu_hook.start import with_site_packages

    with_site_packages()  # a launcher's -S: the dependencies' directories are site's to add
    from oci_gpu_hook.cli import main as cli_main

    return cli_main(argv)


def _on_start_path(argv) -> bool:
    """A command a runtime runs for each container (the hook, and the CDI spec's ld cache hook)."""
    rest = split_config(argv)[1]
    return bool(rest) and rest[0] in (*RUNTIME_COMMANDS, LDCACHE_REFRESH)


def main(argv=None, options=()) -> int:
    """argv None: this process runs the program (sys.argv); options: arguments a launcher puts
    before the user's (its --config).

    A runtime's command started as a program ends with os._exit once its output is flushed:
    everything it opened is closed by then, and the interpreter's own teardown of the modules it
    loaded would add milliseconds to every container start."""
    as_program = argv is None
    argv = list(options) + list(sys.argv[1:] if argv is None else argv)
    fast_exit = as_program and _on_start_path(argv)
    if fast_exit:
        # No cyclic garbage collection in a process that lives milliseconds and makes no cycles
        # it needs freed: each collection walks every object (~3 ms of a GPU start in all, in
        # `make bench`), and in the children it forks it would also copy the pages it touches.
        import gc

        gc.disable()
    code = _main(argv, as_program)
    if fast_exit:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    return code


def _main(argv, as_program: bool) -> int:
    return exit_status_of(lambda: run(argv, as_program))


if __name__ == "__main__":
    sys.exit(main())
