"""The commands for people (click). One module per command; heavy imports stay inside commands.

Errors: commands raise HookError; hook.main turns it into one line and an exit status. Click's
own usage errors are shown the click way and exit 2.
"""

import click

from oci_gpu_hook import __version__


class Context:
    """What every command may need: the settings, loaded on first use."""

    def __init__(self, config: str):
        self.config = config
        self._settings = None

    @property
    def settings(self):
        if self._settings is None:
            from oci_gpu_hook.start import settings

            self._settings = settings.load(self.config)
        return self._settings


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    metavar="FILE",
    help="Configuration file (default: $OCI_GPU_HOOK_CONFIG, else /etc/oci-gpu-hook/config.yaml).",
)
@click.version_option(__version__, prog_name="oci-gpu-hook")
@click.pass_context
def cli(ctx, config):
    """Give OCI containers NVIDIA GPUs: the prestart hook and its host toolkit."""
    ctx.obj = Context(config)


def _register():
    from oci_gpu_hook.cli import (
        cdi,
        demo,
        doctor,
        info,
        install,
        inventory,
        node,
        plan,
        runtime,
        simulate,
        toolkit,
        validate,
    )

    commands = (demo.demo, info.info, inventory.inventory, plan.plan, runtime.prestart, runtime.create_runtime,
                runtime.start_server,
                simulate.simulate, cdi.cdi, cdi.ldcache_refresh, doctor.doctor, install.install, install.uninstall,
                validate.validate, node.exporter, node.labels, node.watchdog, node.device_plugin,
                toolkit.toolkit)  # fmt: skip
    for command in commands:
        cli.add_command(command)


_register()


def main(argv) -> int:
    try:
        result = cli.main(args=argv, prog_name="oci-gpu-hook", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        return 1
    return result if isinstance(result, int) else 0
