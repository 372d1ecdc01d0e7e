"""`oci-gpu-hook demo` (what `make demo` runs): a real runc container, then podman's, on a simulated
host; it leaves its directory for a look and nothing else on the host (issue 52, item 9)."""

import json
import os
import subprocess

import leftovers
from hookcheck import listed_uuids

from oci_gpu_hook.start import settings


def test_the_demo_shows_its_gpu_and_leaves_nothing_but_its_directory(tmp_path, hook_cli, require):
    require("root", "gcc", "runc", "busybox", "podman")
    directory = tmp_path / "demo"
    out = hook_cli("demo", "--dir", str(directory), "--devices", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    # runc's container and podman's each list the one GPU asked for, as the simulator made it
    with open(directory / "host" / "simulated-host.json") as f:
        gpu1 = json.load(f)["gpus"][1]["uuid"]
    assert listed_uuids(out.stdout) == [gpu1, gpu1], out.stdout
    assert sorted(os.listdir(directory)) == ["bundle", "hooks.d", "host"]
    # the hook's compiled copy of the demo's configuration (in the host's /run/oci-gpu-hook)
    config = str(directory / "host" / "config.yaml")
    compiled = os.path.join(leftovers.RUN_DIR, os.path.basename(settings.compiled_path(config)))
    assert not os.path.exists(compiled)
    images = subprocess.run(["podman", "images", "-q", "localhost/oci-gpu-hook-demo"], capture_output=True, text=True)
    assert (images.returncode, images.stdout) == (0, "")
