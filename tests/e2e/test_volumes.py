"""A user's volumes: nothing of a GPU container's start outlives it there (issue 38).

Host directories bind-mounted into a real runc container where the hook would otherwise create
its mount points and files (/lib/firmware for the GSP firmware, /etc/OpenCL for nvidia.icd): the
hook leaves them as they are (saying so in its log record), the container still starts with its
GPU, and after the container is gone each host directory is byte for byte what it was.
"""

import json
import os
import subprocess

import pytest
from hookcheck import listed_uuids, tree

from oci_gpu_hook.toolkit import containers

pytestmark = pytest.mark.host(gpus=2, mig=[], needs=("runc", "busybox"))

VOLUMES = {"/lib/firmware": "firmware", "/etc/OpenCL": "opencl"}


def _volume(top, name: str, with_nvidia_dir: bool) -> str:
    """A user's host directory with something of the user's in it (and, for one, the directory the
    hook would create inside, so that the refusal is one level down too)."""
    path = os.path.join(top, name)
    os.makedirs(path)
    with open(os.path.join(path, "users-file"), "w") as f:
        f.write(f"the user's own {name} data\n")
    if with_nvidia_dir:
        os.mkdir(os.path.join(path, "nvidia"))
    return path


def _log(host) -> list:
    with open(f"{host['root']}/hook.log") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("nested", [False, True], ids=["empty-volume", "volume-with-nvidia-dir"])
def test_the_hook_creates_nothing_in_a_users_volume(tmp_path, host, nested):
    volumes = {dest: _volume(str(tmp_path / "host"), name, nested) for dest, name in VOLUMES.items()}
    before = {dest: tree(path, contents=True, times=True) for dest, path in volumes.items()}
    xattrs_before = {dest: _xattrs(path) for dest, path in volumes.items()}
    bundle = containers.make_bundle(
        str(tmp_path / "bundle"), args=["sh", "-c", "nvidia-smi -L; ls -A /lib/firmware /etc/OpenCL"],
        env={"NVIDIA_VISIBLE_DEVICES": "1", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"},
        config_file=f"{host['root']}/config.yaml",
    )  # fmt: skip
    with open(os.path.join(bundle, "config.json")) as f:
        config = json.load(f)
    config["mounts"] += [
        {"destination": dest, "type": "bind", "source": path, "options": ["rbind", "rw"]}
        for dest, path in volumes.items()
    ]
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(config, f)
    log_before = len(_log(host)) if os.path.exists(f"{host['root']}/hook.log") else 0

    out = containers.runc_run(bundle, f"ocigpu-{os.getpid()}-volumes")  # run, then deleted

    assert out.returncode == 0, out.stderr
    assert listed_uuids(out.stdout) == [host["gpus"][1]["uuid"]]
    # Inside, the volumes show the user's files alone, and after the container is gone the host's
    # directories are what they were: names, modes, owners, contents, times, labels.
    assert "nvidia.icd" not in out.stdout and "vendors" not in out.stdout, out.stdout
    for dest, path in volumes.items():
        assert tree(path, contents=True, times=True) == before[dest], dest
        assert _xattrs(path) == xattrs_before[dest], dest
    # The log record says what was left undone, and why.
    start = [e for e in _log(host)[log_before:] if e["message"] == "GPU devices configured"]
    assert len(start) == 1, start
    skipped = " | ".join(start[0]["skipped"])
    for dest in VOLUMES:
        assert f"{dest} is a volume from the host" in skipped, skipped


def test_a_tmpfs_of_the_container_is_still_used(tmp_path, host):
    """The container's own tmpfs (here /etc/OpenCL, as `--tmpfs` would make it) dies with it: the
    hook puts nvidia.icd there as in the rootfs."""
    bundle = containers.make_bundle(
        str(tmp_path / "bundle"), args=["cat", "/etc/OpenCL/vendors/nvidia.icd"],
        env={"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"},
        config_file=f"{host['root']}/config.yaml",
    )  # fmt: skip
    with open(os.path.join(bundle, "config.json")) as f:
        config = json.load(f)
    config["mounts"].append({"destination": "/etc/OpenCL", "type": "tmpfs", "source": "tmpfs", "options": ["mode=755"]})
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(config, f)
    out = containers.runc_run(bundle, f"ocigpu-{os.getpid()}-tmpfs")
    assert out.returncode == 0, out.stderr
    assert "libnvidia-opencl.so.1" in out.stdout


def _xattrs(top: str) -> dict:
    """Every extended attribute under top (security.selinux among them, where it is written)."""
    found = {}
    for directory, dirs, files in os.walk(top):
        for name in [""] + dirs + files:
            path = os.path.join(directory, name) if name else directory
            found[path] = {
                key: os.getxattr(path, key, follow_symlinks=False) for key in os.listxattr(path, follow_symlinks=False)
            }
    return found


def test_a_host_tmpfs_bound_whole_is_a_volume_too(tmp_path, host):
    """A tmpfs of the host's (mounted in the runtime's namespace, here a private copy of the host's
    made for runc and the hook) bound whole at /etc/OpenCL: mountinfo's root is '/', as for the
    container's own tmpfs, but it outlives the container: the hook creates nothing there."""
    shared = tmp_path / "host-tmpfs"
    shared.mkdir()
    bundle = containers.make_bundle(
        str(tmp_path / "bundle"), args=["sh", "-c", "nvidia-smi -L; ls -A /etc/OpenCL"],
        env={"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"},
        config_file=f"{host['root']}/config.yaml",
    )  # fmt: skip
    with open(os.path.join(bundle, "config.json")) as f:
        config = json.load(f)
    config["mounts"].append({"destination": "/etc/OpenCL", "type": "bind", "source": str(shared), "options": ["rbind"]})
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(config, f)
    name = f"ocigpu-{os.getpid()}-hosttmpfs"
    # In a private mount namespace (the host's table stays as it is): the tmpfs, runc in it, and
    # after the container, the tmpfs's contents.
    script = (
        f'mount -t tmpfs -o mode=755 vol "{shared}" && echo mine > "{shared}/users-file" && '
        f'runc run --bundle "{bundle}" {name} </dev/null; rc=$?; runc delete --force {name} 2>/dev/null; '
        f'echo "--after--"; ls -A "{shared}"; exit $rc'
    )
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    inside, after = out.stdout.split("--after--")
    assert listed_uuids(inside) == [host["gpus"][0]["uuid"]]
    assert "vendors" not in inside and after.split() == ["users-file"], out.stdout
