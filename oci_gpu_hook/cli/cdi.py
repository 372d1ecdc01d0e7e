"""`oci-gpu-hook cdi generate`: a CDI spec from the hook's inventory and policy; and
`oci-gpu-hook ldcache-refresh`: the createContainer hook such a spec names."""

import click

from oci_gpu_hook.start import ldcache_refresh as ldcache_refresh_command


@click.group()
def cdi():
    """Container Device Interface: GPUs for runtimes that read CDI specs, without the hook."""


@cdi.command()
@click.option("--output", "-o", metavar="FILE", help="Write the spec to FILE, atomically (default: print it).")
@click.option("--format", "fmt", type=click.Choice(["yaml", "json"]),
              help="Output format (default: json for a FILE ending in .json, else yaml).")  # fmt: skip
@click.option("--vendor-class", "kind", default="nvidia.com/gpu", show_default=True,
              help="The CDI kind (vendor/class).")  # fmt: skip
@click.option("--capabilities", default="utility,compute", show_default=True,
              help="Driver capabilities the spec's containers get (as NVIDIA_DRIVER_CAPABILITIES).")  # fmt: skip
@click.option("--no-cache", is_flag=True, help="Discover the host now instead of using the inventory cache.")
@click.option("--parents", is_flag=True, help="Make --output's missing directories (else a missing one is an error).")
@click.pass_obj
def generate(obj, output, fmt, kind, capabilities, no_cache, parents):
    """Write a CDI spec with every GPU (by index and UUID), every MIG device and `all`."""
    from oci_gpu_hook.start import inventory_cache
    from oci_gpu_hook.start.discover import discover
    from oci_gpu_hook.toolkit import cdi as cdi_module

    kind = cdi_module.parse_kind(kind)
    caps = cdi_module.parse_capabilities(capabilities)
    settings = obj.settings
    inventory = discover(settings) if no_cache else inventory_cache.load(settings)
    spec = cdi_module.build_spec(inventory, settings, kind, caps)
    cdi_module.validate(spec)
    fmt = cdi_module.format_for(output, fmt)
    text = cdi_module.dump(spec, fmt)
    if output is None:
        click.echo(text, nl=False)
        return 0
    for other in cdi_module.other_specs_with_kind(kind, output):
        click.echo(f"oci-gpu-hook: warning: {other} also defines {kind}: runtimes reject devices defined twice "
                   "at the same priority (/var/run/cdi wins over /etc/cdi); keep one", err=True)  # fmt: skip
    cdi_module.write_atomically(output, text, parents)
    names = len(spec["devices"])
    click.echo(f"{output}: CDI {spec['cdiVersion']}, kind {kind}, {names} devices "
               f"({len(inventory.gpus)} GPU(s), driver {inventory.driver_version})", err=True)  # fmt: skip
    return 0


@click.command(name=ldcache_refresh_command.COMMAND)
@click.option("--dir", "directories", multiple=True, metavar="DIR",
              help="Library directory inside the container to add to its ld.so.cache (repeatable).")  # fmt: skip
@click.option("--link", "links", multiple=True, metavar="PATH=VALUE",
              help="Symlink to create in the container first (repeatable); an image's own file is kept.")  # fmt: skip
def ldcache_refresh(directories, links):
    """The createContainer hook of generated CDI specs: read the OCI state on stdin, create the
    driver's symlinks in the container's rootfs and refresh its ld.so.cache with the host's
    ldconfig (confined to the rootfs). The runtime's calls take the stdlib-only fast path in
    hook.py and never reach click; this entry is for --help."""
    argv = [f"--dir={d}" for d in directories] + [f"--link={link}" for link in links]
    return ldcache_refresh_command.run(argv)
