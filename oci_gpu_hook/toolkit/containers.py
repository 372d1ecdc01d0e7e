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


def runc_run(bundle: str, container_id: str, timeout: float = 60) -> subprocess.CompletedProcess:
    runc = shutil.which("runc")
    if runc is None:
        raise PrerequisiteError("runc is not installed (on Debian: apt-get install runc)")
    try:
        return subprocess.run([runc, "run", "--bundle", bundle, container_id], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip
    finally:
        subprocess.run([runc, "delete", "--force", container_id], capture_output=True)


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
