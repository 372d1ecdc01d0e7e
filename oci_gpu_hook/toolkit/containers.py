"""Running real containers with the hook wired in: for `demo`, `validate`, the bench and the tests.

A minimal rootfs (busybox-static, plus the host's
glibc loader and libc so dynamically linked programs such as nvidia-smi run) and an OCI bundle
whose prestart hook is this program; runc and podman runs of them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence

from oci_gpu_hook.errors import PrerequisiteError
from oci_gpu_hook.start.linux import arch
from oci_gpu_hook.toolkit import install

BUSYBOX = "/bin/busybox"
APPLETS = ("sh", "ls", "cat", "echo", "head", "grep", "test", "stat", "readlink", "mount", "true", "false", "dd", "wc")
DEFAULT_CAPS = ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]


def _libc_dirs(entry: arch.Architecture) -> tuple[str, ...]:
    """Where the host's libc.so.6 may be: Debian's multiarch directories (/lib and /usr/lib), then
    RHEL's."""
    return (entry.multiarch.replace("/usr", "", 1), entry.multiarch, "/lib64", "/usr/lib64")


def _host_libc() -> str:
    for directory in _libc_dirs(arch.current()):
        path = os.path.join(directory, "libc.so.6")
        if os.path.exists(path):
            return os.path.realpath(path)
    raise PrerequisiteError("the host's libc.so.6 was not found")


def make_rootfs(path: str, debian: bool = False) -> str:
    """A minimal rootfs at path; Debian-like (multiarch dirs, /etc/debian_version) or not."""
    if not os.path.exists(BUSYBOX):
        raise PrerequisiteError(f"{BUSYBOX} is missing (on Debian: apt-get install busybox-static)")
    for d in ("bin", "etc", "dev", "proc", "sys", "tmp", "lib64", "usr/bin"):
        os.makedirs(os.path.join(path, d), exist_ok=True)
    shutil.copy2(BUSYBOX, os.path.join(path, "bin/busybox"))
    for applet in APPLETS:
        link = os.path.join(path, "bin", applet)
        if not os.path.lexists(link):
            os.symlink("busybox", link)
    entry = arch.current()  # this machine's loader and library directory (the hook's own layout)
    libdir = (entry.multiarch if debian else entry.lib64).lstrip("/")
    os.makedirs(os.path.join(path, libdir), exist_ok=True)
    shutil.copy2(_host_libc(), os.path.join(path, libdir, "libc.so.6"))
    loader = os.path.join(path, entry.loader.lstrip("/"))
    os.makedirs(os.path.dirname(loader), exist_ok=True)
    shutil.copy2(os.path.realpath(entry.loader), loader)
    if debian:
        with open(os.path.join(path, "etc/debian_version"), "w") as f:
            f.write("12.0\n")
    with open(os.path.join(path, "etc/passwd"), "w") as f:
        f.write("root:x:0:0:root:/:/bin/sh\n")
    return path


def docker_archive(rootfs: str, path: str, name: str, cmd: Sequence[str], env: Sequence[str] = ()) -> str:
    """A docker-archive tarball (manifest.json, the image's config, one layer) of rootfs, files
    owned by root, named name, running cmd: what `ctr images import` and `podman load` take, so
    that no registry is needed. Returns path."""
    import hashlib
    import io
    import platform
    import tarfile

    def as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        for entry in sorted(os.listdir(rootfs)):
            tar.add(os.path.join(rootfs, entry), arcname=entry, filter=as_root)
    layer_bytes = layer.getvalue()
    diff_id = hashlib.sha256(layer_bytes).hexdigest()
    machine = platform.machine()
    config = {
        "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine),
        "os": "linux",
        "config": {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", *env], "Cmd": list(cmd), "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
        "history": [{"created_by": "oci_gpu_hook.toolkit.containers.docker_archive"}],
    }
    config_bytes = json.dumps(config).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": [name], "Layers": [f"{diff_id}/layer.tar"]}]
    with tarfile.open(path, "w") as archive:
        for member, data in ((config_name, config_bytes), (f"{diff_id}/layer.tar", layer_bytes),
                             ("manifest.json", json.dumps(manifest).encode())):  # fmt: skip
            info = tarfile.TarInfo(member)
            info.size = len(data)
            info.mode = 0o644
            archive.addfile(info, io.BytesIO(data))
    return path


def hook_command(config_file: str | None = None) -> list[str]:
    """argv prefix of the hook in bundles and hooks.d files made here: this interpreter and this
    copy of the package (not an installed one), with --config when one is given."""
    return install.interpreter_command() + (["--config", config_file] if config_file else [])


def make_config(
    args: Sequence[str],
    env: dict[str, str],
    config_file: str | None,
    caps: Sequence[str] = DEFAULT_CAPS,
    hook_env: Sequence[str] = tuple(install.HOOK_ENV),
    readonly: bool = True,
    with_hook: bool = True,
    mount_label: str | None = None,
    annotations: dict[str, str] | None = None,
) -> dict:
    """config.json for runc: like `runc spec`, with our prestart hook and a deny-all device cgroup."""
    hook_args = hook_command(config_file) + ["prestart"]
    config = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(args),
            "env": ["PATH=/usr/bin:/bin"] + [f"{k}={v}" for k, v in env.items()],
            "cwd": "/",
            "capabilities": {k: list(caps) for k in ("bounding", "effective", "permitted", "ambient")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs", "readonly": readonly},
        "hostname": "gpu",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
            },
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
            },
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]},
        ],
        "linux": {
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        },
    }
    if mount_label:
        config["linux"]["mountLabel"] = mount_label
    if annotations:
        config["annotations"] = dict(annotations)
    if with_hook:
        config["hooks"] = {"prestart": [{"path": hook_args[0], "args": hook_args, "env": list(hook_env),
                                         "timeout": install.HOOK_TIMEOUT}]}  # fmt: skip
    return config


def make_bundle(path: str, rootfs_debian: bool = False, **config_options) -> str:
    os.makedirs(path, exist_ok=True)
    make_rootfs(os.path.join(path, "rootfs"), debian=rootfs_debian)
    write_config(path, **config_options)
    return path


def write_config(bundle: str, **config_options) -> None:
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(make_config(**config_options), f, indent=2)


def hold_namespace(rootfs: str, seconds: int = 600) -> subprocess.Popen:
    """A process standing for a container at prestart, as runc leaves it: its own mount namespace
    (private propagation) in which the rootfs is bind-mounted onto itself; returned once ready."""
    script = 'mount --bind "$1" "$1" && echo ready && exec sleep "$2"'
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", rootfs,
                             str(seconds)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)  # fmt: skip
    if proc.stdout.readline() != b"ready\n":
        proc.kill()
        proc.wait()
        raise PrerequisiteError(f"cannot make a mount namespace holding {rootfs} (unshare, mount)")
    return proc


def runc_run(bundle: str, container_id: str, timeout: float = 60) -> subprocess.CompletedProcess:
    runc = shutil.which("runc")
    if runc is None:
        raise PrerequisiteError("runc is not installed (on Debian: apt-get install runc)")
    try:
        return subprocess.run([runc, "run", "--bundle", bundle, container_id], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip
    finally:
        subprocess.run([runc, "delete", "--force", container_id], capture_output=True)


def runc_detached(bundle: str, container_id: str, timeout: float = 60) -> int:
    """Start a container that keeps running (`runc run --detach`); returns its init pid. The caller
    removes it with runc_delete."""
    runc = shutil.which("runc")
    if runc is None:
        raise PrerequisiteError("runc is not installed (on Debian: apt-get install runc)")
    # The container inherits runc's stdio: a pipe there would stay open as long as it runs.
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.run([runc, "run", "--detach", "--bundle", bundle, container_id], stdout=subprocess.DEVNULL,
                              stderr=errors, timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip
        if proc.returncode != 0:
            runc_delete(container_id)
            errors.seek(0)
            message = errors.read().decode(errors="replace").strip()
            raise PrerequisiteError(f"runc run --detach {container_id}: {message}")
    state = subprocess.run([runc, "state", container_id], capture_output=True, text=True, timeout=timeout)
    return json.loads(state.stdout)["pid"]


def runc_delete(container_id: str) -> None:
    subprocess.run(["runc", "delete", "--force", container_id], capture_output=True, timeout=60)


# podman run options besides the image: limits of the container's own (some hosts' and sandboxes'
# hard limits are below podman's defaults, and runc then fails), no network.
PODMAN_RUN_OPTIONS = ["--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
# What the demo and the tests run podman with: runc, as the runc bundles are run.
PODMAN_OPTIONS = ["--runtime", "runc"] + PODMAN_RUN_OPTIONS


def write_hooks_dir(directory: str, config_file: str | None) -> str:
    """A hooks.d directory with the document `install` writes, pointed at this installation."""
    return install.write_hooks_dir(directory, hook_command(config_file))


def podman_image(rootfs: str, tag: str) -> str:
    """Import a rootfs directory as a podman image (no registry is needed)."""
    tar = subprocess.Popen(["tar", "-C", rootfs, "-cf", "-", "."], stdout=subprocess.PIPE)
    subprocess.run(["podman", "import", "-", tag], stdin=tar.stdout, check=True, capture_output=True)
    tar.wait()
    return tag


def podman_run(hooks_dir: str | None, image: str, args: Sequence[str], env: dict[str, str],
               timeout: float = 120, options: Sequence[str] = (), oci_runtime: str | None = "runc",
               ) -> subprocess.CompletedProcess:  # fmt: skip
    """oci_runtime: the OCI runtime podman uses (None: podman's own default)."""
    argv = ["podman"] + (["--hooks-dir", hooks_dir] if hooks_dir else [])
    argv += (["--runtime", oci_runtime] if oci_runtime else []) + ["run", "--rm"] + PODMAN_RUN_OPTIONS
    argv += list(options)
    for key, value in env.items():
        argv += ["-e", f"{key}={value}"]
    return subprocess.run(argv + [image, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)  # fmt: skip
