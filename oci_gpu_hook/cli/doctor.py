"""`oci-gpu-hook doctor`: check the host for GPU containers; one line per check, with a fix."""

import json

import click


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON: {checks: [{id, status, summary, fix}], worst}.")
@click.option("--root", default="/", show_default=True, type=click.Path(file_okay=False),
              help="Look for installed files (hooks.d, CRI-O, systemd, SELinux store) under this tree.")  # fmt: skip
@click.pass_obj
def doctor(obj, as_json, root):
    """Check the driver, device nodes, libraries, caches, runtime wiring, cgroups and SELinux.

    Exit status: 0 when every check passes, 1 when the worst is a WARN, 2 when any FAILs."""
    from oci_gpu_hook.errors import ConfigError
    from oci_gpu_hook.start.settings import Settings
    from oci_gpu_hook.toolkit import doctor as doctor_module

    try:
        settings, error = obj.settings, None
    except ConfigError as e:
        settings, error = Settings(), e.message
    checks = doctor_module.run(settings, root, error)
    worst = doctor_module.worst(checks)
    if as_json:
        doc = {"checks": [c.to_json() for c in checks], "worst": worst}
        click.echo(json.dumps(doc, indent=2))
    else:
        width = max(len(c.id) for c in checks)
        for c in checks:
            click.echo(f"{c.status}  {c.id:{width}}  {c.summary}")
            if c.fix and c.status != doctor_module.PASS:
                click.echo(f"      {'':{width}}  fix: {c.fix}")
        counts = {s: sum(c.status == s for c in checks) for s in (doctor_module.PASS, doctor_module.WARN,
                                                                   doctor_module.FAIL)}  # fmt: skip
        click.echo(f"{counts['PASS']} passed, {counts['WARN']} warnings, {counts['FAIL']} failed")
    return doctor_module.EXIT_STATUS[worst]
