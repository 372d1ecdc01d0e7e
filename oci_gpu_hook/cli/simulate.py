"""`oci-gpu-hook simulate`: build or remove a simulated GPU host."""

import click


@click.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--gpus", type=int, default=2, show_default=True, help="Number of GPUs (1-16).")
@click.option("--driver-version", default="550.54.15", show_default=True, help="Simulated driver version.")
@click.option("--cuda-version", default="12.4", show_default=True, help="CUDA version the driver reports.")
@click.option(
    "--mig",
    "mig",
    type=int,
    multiple=True,
    metavar="GPU_INDEX",
    help="Put this GPU in MIG mode with three instances (repeatable).",
)
@click.option("--model", default="a100", show_default=True, help="GPU model: a100, h100, l4 or t4.")
@click.option(
    "--scramble-minors",
    is_flag=True,
    help="Give device minors in reverse bus order, so minor != NVML index (as on some real hosts).",
)
@click.option(
    "--pcie-switches",
    metavar="A+B,...",
    help="GPUs that share a PCIe switch, e.g. 0+2,1+3 (default: pairs in bus order, 0+1,2+3,...).",
)
@click.option("--nvlink", "nvlinks", default="", metavar="A+B,...", help="GPU pairs joined by NVLink, e.g. 0+1,2+3.")
@click.option(
    "--numa-nodes",
    metavar="N,N,...",
    help="The NUMA node of each GPU (default: the first half of the switches on node 0, the rest on 1).",
)
@click.option(
    "--graphics",
    type=int,
    multiple=True,
    metavar="GPU_INDEX",
    help="Put this GPU in display mode: a VGA controller's PCI class (repeatable).",
)
@click.option(
    "--vgpu",
    metavar="VERSION,BRANCH",
    help="Make the host a vGPU guest whose host driver has this version and branch, e.g. 550.54.16,r551_40.",
)
@click.option("--remove", is_flag=True, help="Remove the simulated host at DIRECTORY instead.")
def simulate(directory, gpus, driver_version, cuda_version, mig, model, scramble_minors, pcie_switches, nvlinks,
             numa_nodes, graphics, vgpu, remove):  # fmt: skip
    """Build a simulated GPU host in DIRECTORY (needs root and gcc).

    The directory gets dev/ with real device nodes, proc/ with the driver's files, the driver's
    libraries (real ELF files with real SONAMEs), programs including a working nvidia-smi, an
    ld.so.cache made by ldconfig, and config.yaml, so that
    `oci-gpu-hook --config DIRECTORY/config.yaml COMMAND` treats it as the host.
    Running it again rebuilds the host in place.
    """
    from oci_gpu_hook.toolkit.simulate import remove_host
    from oci_gpu_hook.toolkit.simulate import simulate as build

    if remove:
        remove_host(directory)
        click.echo(f"removed the simulated host at {directory}")
        return
    summary = build(
        directory,
        gpus=gpus,
        driver_version=driver_version,
        cuda_version=cuda_version,
        mig=sorted(set(mig)),
        model=model,
        scramble_minors=scramble_minors,
        pcie_switches=pcie_switches,
        nvlinks=nvlinks,
        numa_nodes=numa_nodes,
        graphics=sorted(set(graphics)),
        vgpu_host_driver=None if vgpu is None else tuple(vgpu.split(",")),
    )
    root = summary["root"]
    click.echo(
        f"simulated GPU host at {root}: {len(summary['gpus'])} GPU(s), driver {driver_version}, "
        f"CUDA {cuda_version}"
        + ("" if summary["lib32"] else " (no 32-bit libraries: gcc cannot link with -m32; gcc-multilib would)")
    )
    for gpu in summary["gpus"]:
        mig_note = f", MIG: {len(gpu['mig'])} instances" if gpu["mig"] else ""
        click.echo(f"  GPU {gpu['index']}: /dev/nvidia{gpu['minor']} {gpu['bus_id']} {gpu['uuid']}{mig_note}")
    click.echo(f"try: LD_LIBRARY_PATH={root}/usr/lib64 {root}/usr/bin/nvidia-smi -L")
    click.echo(f"     oci-gpu-hook --config {root}/config.yaml info")
