"""`oci-gpu-hook install` / `uninstall`: wire the hook into the host's container runtimes.

What install writes, under --root (default /):

| file | for |
|---|---|
| /etc/containers/oci/hooks.d/oci-gpu-hook.json | podman and CRI-O (see docs/toolkit.md for why /etc) |
| /etc/crio/crio.conf.d/50-oci-gpu-hook.conf | CRI-O, when its hooks_dir lacks the directory above: that list plus it |
| /etc/containerd/oci-gpu-hook-base-spec.json | containerd's CRI plugin (--runtime containerd): its spec + the hook |
| /etc/containerd/conf.d/oci-gpu-hook.toml | ... the CRI section naming that base spec (toolkit/containerd.py) |
| /etc/containerd/config.toml | ... one line importing the drop-in, first (uninstall removes it); the file, when none |
| /etc/containers/containers.conf.d/50-oci-gpu-hook.conf | podman, when its hooks_dir lacks it: that list plus it |
| /etc/oci-gpu-hook/config.yaml | the default configuration, only when there is none |
| /etc/systemd/system/oci-gpu-hook-refresh.{service,path} (+ wants links) | refresh at boot, on ld.so.cache change |
| /etc/udev/rules.d/71-oci-gpu-hook.rules | ... and when the nvidia kernel modules load |
| /usr/local/libexec/oci-gpu-hook/oci-gpu-hook | what runtimes run (no RPM's): the pre-filter, or the launcher |
| /usr/local/libexec/oci-gpu-hook/oci-gpu-hook-python | the launcher the pre-filter runs (with the pre-filter only) |
| /usr/bin/nvidia-container-runtime-hook | Docker's `--gpus`: the launcher (with the start server, the pre-filter) |
| /usr/local/libexec/oci-gpu-hook/nvidia-container-runtime-hook-python | ... the launcher that pre-filter runs |
| /etc/systemd/system/oci-gpu-hook-{exporter,labels,watchdog}.service (+ wants) | node services (--node-services) |
| /etc/systemd/system/oci-gpu-hook-device-plugin.service (+ wants) | Kubernetes nodes (--device-plugin) |
| /etc/systemd/system/oci-gpu-hook-start.{socket,service} (+ wants) | the start server (with the pre-filter) |
| /usr/local/libexec/oci-gpu-hook/oci-gpu-hook-start-server | ... what its service runs (its SELinux domain's entry) |
| /etc/systemd/system/sockets.target.wants/oci-gpu-hook-start.socket | ... only that link, to the RPM's units |
| /var/lib/oci-gpu-hook/install-manifest.json | what install created, with checksums |

The pre-filter (toolkit/prefilter.py) is compiled here, where a C compiler is found and builds it
(--prefilter to require it, --no-prefilter never); otherwise runtimes run the launcher itself.
Docker's program is a pre-filter of its own, which runs a launcher of its own: dockerd passes only
`prestart`, so that launcher is the one that carries the --config.
It offers each start it would hand to Python to the start server (start/server.py) first, where one
listens. The server's socket and service units are installed and enabled wherever the pre-filter
is (--start-server to require them, --no-start-server never): systemd listens from boot, starts
the server at the first GPU start, and every fault of it leaves the start to Python within the
pre-filter's short wait (docs/performance.md). The pre-filter is the same with and without them.

Every path under the root is resolved as the tree itself resolves it (toolkit/tree.py): a link in
an image tree is followed inside it, never out of it into the build host's own directories.

Every string written into a unit, a udev rule or CRI-O's TOML is escaped for that format, so that
it reads back as itself and can never end its line or open a section of its own.

Idempotent: a file whose content is already right is not touched. uninstall removes exactly what
the manifest lists, and only while each file still has the checksum install gave it (a file an
administrator changed is kept, with a warning), then the directories install created, if empty.
It removes what names a program (hooks.d, containerd's files, units, Docker's program) before the
programs, and a link install replaces is replaced in one rename: a container starting meanwhile
finds the hook whole or not at all.
A file install did not write (an administrator's own) is never replaced. The one exception is
NVIDIA's nvidia-container-runtime-hook, and only with --replace-nvidia-hook: it is moved aside
(to DOCKER_HOOK_SAVED) and uninstall puts it back.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import sys

from oci_gpu_hook.errors import Exit, HookError
from oci_gpu_hook.start import files, prefilter_rule, settings
from oci_gpu_hook.start.inventory import host_path
from oci_gpu_hook.start.linux.sources import HostSources, UntrustedSource
from oci_gpu_hook.toolkit import bundle, containerd, launcher, runtime_config
from oci_gpu_hook.toolkit.runtime_config import TomlUnavailable
from oci_gpu_hook.toolkit.tree import Tree, TreeError

INSTALLED_PATH = "/usr/bin/oci-gpu-hook"
HOOKS_D_DIR = "/etc/containers/oci/hooks.d"
PACKAGE_HOOKS_D_DIR = "/usr/share/containers/oci/hooks.d"
HOOKS_D_FILE = f"{HOOKS_D_DIR}/oci-gpu-hook.json"
CRIO_DROPIN = "/etc/crio/crio.conf.d/50-oci-gpu-hook.conf"
PODMAN_DROPIN = "/etc/containers/containers.conf.d/50-oci-gpu-hook.conf"
CONFIG_FILE = settings.DEFAULT_PATH
UNIT_DIR = "/etc/systemd/system"
# Where a package's units are (the RPM's %{_unitdir}): UNIT_DIR's units of the same name shadow them.
PACKAGE_UNIT_DIR = "/usr/lib/systemd/system"
SERVICE = "oci-gpu-hook-refresh.service"
PATH_UNIT = "oci-gpu-hook-refresh.path"
UDEV_RULE = "/etc/udev/rules.d/71-oci-gpu-hook.rules"
EXPORTER_SERVICE = "oci-gpu-hook-exporter.service"
LABELS_SERVICE = "oci-gpu-hook-labels.service"
WATCHDOG_SERVICE = "oci-gpu-hook-watchdog.service"
DEVICE_PLUGIN_SERVICE = "oci-gpu-hook-device-plugin.service"
START_SOCKET = "oci-gpu-hook-start.socket"
START_SERVICE = "oci-gpu-hook-start.service"
LABELS_WATCH_SECONDS = 60
# Docker's --gpus runs the program of this name, which dockerd looks up on its PATH when it starts
# (NVIDIA's container toolkit installs it at this path).
DOCKER_HOOK = "/usr/bin/nvidia-container-runtime-hook"
DOCKER_HOOK_SAVED = "/usr/bin/nvidia-container-runtime-hook.saved-by-oci-gpu-hook"
DOCKER_HOOK_MARKER = "# Written by `oci-gpu-hook install --runtime docker`"
# Where Docker's program is the compiled pre-filter: the launcher it hands GPU starts to (those it
# does not offer to the start server, or the server does not take). One of its own, beside the
# others, since it puts install's --config before the `prestart` dockerd passes.
DOCKER_LAUNCHER = "/usr/local/libexec/oci-gpu-hook/nvidia-container-runtime-hook-python"
# The start server's service runs a launcher of its own, not the hook's program: it is the one
# file the SELinux module labels (oci_gpu_hook_start_exec_t, selinux/oci_gpu_hook.fc), the entry
# point of the server's domain, so that only the server enters that domain and every start a
# runtime runs itself stays in the runtime's. PACKAGE_START_LAUNCHER: the RPM's, which the same
# file contexts name.
START_LAUNCHER = "/usr/local/libexec/oci-gpu-hook/oci-gpu-hook-start-server"
PACKAGE_START_LAUNCHER = "/usr/libexec/oci-gpu-hook/oci-gpu-hook-start-server"
MANIFEST = "/var/lib/oci-gpu-hook/install-manifest.json"
# The programs that other files install writes name (hooks.d, containerd's base spec, units, a
# pre-filter naming its launcher), and the configuration they read, in the order uninstall removes
# them: after everything else, each after what runs it.
PROGRAMS_REMOVED_LAST = (launcher.LAUNCHER, launcher.PYTHON_LAUNCHER, DOCKER_LAUNCHER, START_LAUNCHER, CONFIG_FILE)
# What each runtime reads only when it starts, of what install writes: a change to one of these
# is what asks for its restart (toolkit/restart.py).
RUNTIME_FILES = {"crio": (CRIO_DROPIN,), "containerd": (containerd.CONFIG, containerd.DROPIN, containerd.BASE_SPEC)}
# LAUNCHER's value where it is a link into a bundle: relative, so that it resolves alike in an
# image tree, from the host, and inside a chroot of the host.
BUNDLES_LINK = os.path.relpath(bundle.BUNDLES_DIR, os.path.dirname(launcher.LAUNCHER))
# Bundles install keeps: the one runtimes run, and the one before it, which starts that read the
# link before an upgrade may still be running from; older ones go at the next install.
BUNDLES_KEPT = 2
# The environment every runtime gives the hook (hooks.d, CDI hooks, test bundles): the one list.
HOOK_ENV = ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C"]
HOOK_TIMEOUT = 10


class InstallError(HookError):
    exit_code = Exit.INSTALL


def hook_command() -> list:
    """argv prefix that runs this program from a runtime: the RPM's /usr/bin/oci-gpu-hook when it
    is a launcher or a pre-filter in front of one, else the one install writes for this
    interpreter and package (any other way, a pip console script included, would start every
    container slower: launcher.py)."""
    from oci_gpu_hook.toolkit import prefilter

    ours = launcher.is_launcher(INSTALLED_PATH) or prefilter.is_prefilter(INSTALLED_PATH)
    if ours and os.access(INSTALLED_PATH, os.X_OK):
        return [INSTALLED_PATH]
    return [launcher.LAUNCHER]


def installed_command() -> list:
    """What a CDI spec's hook runs: the launcher when one is in place, else this interpreter with
    the package (a spec generated before install, or by tests)."""
    prefix = hook_command()
    return prefix if os.access(prefix[0], os.X_OK) else interpreter_command()


def interpreter_command() -> list:
    """This interpreter running this package, isolated (-I): what tests and the demo put in
    their bundles, so that the code under test runs rather than an installed copy."""
    return [sys.executable, "-I", "-m", "oci_gpu_hook"]


# --- contents -----------------------------------------------------------------------------------


def hook_args(argv_prefix, *rest) -> list:
    """argv for a runtime's hook entry: argv[0] is the program's own name when it is installed."""
    args = list(argv_prefix) + list(rest)
    if os.path.basename(args[0]) == "oci-gpu-hook":
        args[0] = "oci-gpu-hook"
    return args


def hooks_d_document(argv_prefix) -> dict:
    return {
        "version": "1.0.0",
        "hook": {
            "path": argv_prefix[0],
            "args": hook_args(argv_prefix, "prestart"),
            "env": list(HOOK_ENV),
            "timeout": HOOK_TIMEOUT,
        },
        "when": {"always": True},
        "stages": ["prestart"],
    }


def hooks_d_text(argv_prefix) -> str:
    return json.dumps(hooks_d_document(argv_prefix), indent=2) + "\n"


def write_hooks_dir(directory: str, argv_prefix) -> str:
    """A hooks.d directory (for podman --hooks-dir) holding oci-gpu-hook.json, the document install
    writes, for argv_prefix; returns the directory. Built in code: an installed copy of the
    package has no hooks.d/ file beside it."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "oci-gpu-hook.json"), "w") as f:
        f.write(hooks_d_text(argv_prefix))
    return directory


def hooks_dir_dropin_text(runtime: str, table: tuple, dirs, source) -> str:
    """The drop-in that adds the administrators' hooks directory to the list a runtime (CRI-O's
    crio.conf.d, podman's containers.conf.d) reads now: their drop-ins replace lists, so it holds
    that whole list, in its order, with ours last, as hooks_dir in table (its keys, outermost
    first). The list comes from the administrators' files, and an entry may hold any character (a
    quote, a backslash, a newline): runtime_config.dump_toml writes each as a TOML string that
    reads back as exactly itself, and the source's name, a file name, is made printable for its
    comment line."""
    from oci_gpu_hook.errors import printable

    document = {"hooks_dir": list(dirs)}
    for key in reversed(table):
        document = {key: document}
    try:
        body = runtime_config.dump_toml(document)
    except TomlUnavailable as e:
        raise InstallError(f"{e}: cannot write {runtime} drop-in") from None
    where = f"hooks_dir in {printable(source)}" if source else f"{runtime} default"
    return (
        f"# Written by `oci-gpu-hook install`: {runtime} hooks_dir did not include the administrators'\n"
        "# directory, where the GPU hook's hooks.d file is. A drop-in's list replaces the list before\n"
        f"# it, so this is that list ({where}) with it added.\n"
        "# Removed by `oci-gpu-hook uninstall`.\n" + body
    )


def crio_dropin_text(dirs, source) -> str:
    return hooks_dir_dropin_text("CRI-O's", ("crio", "runtime"), dirs, source)


def crio_dropin(root: str):
    """The Entry for CRI-O's drop-in, or None when CRI-O already reads the administrators' hooks
    directory. The list is CRI-O's own as it stands without our drop-in (runtime_config.py)."""
    try:
        dirs, source = runtime_config.crio_hooks_dirs(root, without=CRIO_DROPIN)
    except (runtime_config.ConfigFileError, runtime_config.TomlUnavailable) as e:
        raise InstallError(f"{e}: cannot tell which hooks directories CRI-O reads") from None
    if HOOKS_D_DIR in dirs:
        return None
    if source is not None and source > CRIO_DROPIN:  # read after ours, so its list would replace ours
        raise InstallError(f"{host_path(root, source)}: sets CRI-O's hooks_dir after {CRIO_DROPIN} would, without "
                           f"{HOOKS_D_DIR}: add {HOOKS_D_DIR} to that list, then run install again")  # fmt: skip
    return Entry(CRIO_DROPIN, crio_dropin_text(dirs + [HOOKS_D_DIR], source))


def podman_dropin_text(dirs, source) -> str:
    return hooks_dir_dropin_text("podman's", ("engine",), dirs, source)


def podman_builtin_hooks_dirs(root: str):
    """The hooks directories the podman installed reads when no file sets hooks_dir: its own
    answer on this host (versions differ); for an image tree, or with no podman to ask, None
    (runtime_config's documented default)."""
    if root != "/":
        return None
    try:
        return runtime_config.podman_effective_hooks_dirs(builtin=True)
    except (runtime_config.PodmanUnavailable, runtime_config.ConfigFileError):
        return None


def podman_dropin(root: str):
    """The Entry for podman's drop-in, or None when podman already reads the administrators' hooks
    directory. The list is podman's own as it stands without our drop-in (runtime_config.py)."""
    try:
        dirs, source = runtime_config.podman_hooks_dirs(root, without=PODMAN_DROPIN,
                                                        default=podman_builtin_hooks_dirs(root))  # fmt: skip
    except (runtime_config.ConfigFileError, runtime_config.TomlUnavailable) as e:
        raise InstallError(f"{e}: cannot tell which hooks directories podman reads") from None
    if HOOKS_D_DIR in dirs:
        return None
    # A drop-in read after ours (by name) would replace our list; the files before it we replace.
    if source is not None and os.path.dirname(source) == runtime_config.PODMAN_DROPIN_DIR and source > PODMAN_DROPIN:
        raise InstallError(f"{host_path(root, source)}: sets podman's hooks_dir after {PODMAN_DROPIN} would, "
                           f"without {HOOKS_D_DIR}: add it to that list, then run install again")  # fmt: skip
    return Entry(PODMAN_DROPIN, podman_dropin_text(dirs + [HOOKS_D_DIR], source))


def _options(argv_prefix) -> list:
    """The options in an argv prefix (its --config), after the program: a launcher's path, or
    the interpreter command tests use."""
    program = interpreter_command()
    return list(argv_prefix[len(program) :] if argv_prefix[: len(program)] == program else argv_prefix[1:])


def docker_hook_text(argv_prefix, behind_prefilter: bool = False) -> str:
    """The program dockerd runs as `nvidia-container-runtime-hook prestart` for `docker run --gpus`:
    a launcher of this install (no shell in front of it), with argv_prefix's options;
    behind_prefilter: the one at DOCKER_LAUNCHER, which the pre-filter in that program's place runs."""
    who = f"the pre-filter at {DOCKER_HOOK} runs this" if behind_prefilter else "dockerd runs the program of this name"
    note = (
        f"{DOCKER_HOOK_MARKER}: {who}\n"
        "# (found on its PATH when it starts) for `docker run --gpus`; it gives the container its GPUs\n"
        "# with oci-gpu-hook. Removed by `oci-gpu-hook uninstall`.\n"
    )
    return launcher.for_this_install(_options(argv_prefix), note)


def launcher_text() -> str:
    return launcher.for_this_install(note="# Written by `oci-gpu-hook install`. Removed by `oci-gpu-hook uninstall`.\n")


def start_launcher_text() -> str:
    """START_LAUNCHER: the launcher of this install, as the hook's, with a note of what it is for."""
    note = (
        f"# Written by `oci-gpu-hook install`: what {START_SERVICE} runs. SELinux\n"
        "# labels it oci_gpu_hook_start_exec_t, so the start server runs in its own domain\n"
        "# (docs/selinux.md). Removed by `oci-gpu-hook uninstall`.\n"
    )
    return launcher.for_this_install(note=note)


def config_text(accept_volume_mounts: bool = False) -> str:
    """The configuration install writes where there is none. accept_volume_mounts: GPUs come from
    the device plugin's volume-mounts answer, and an unprivileged container cannot choose its own
    with NVIDIA_VISIBLE_DEVICES (what the node pod's device plugin answers: docs/kubernetes.md)."""
    chosen = (
        "# The device plugin's volume-mounts answer, and not the variable from unprivileged\n"
        "# containers (install --accept-volume-mounts; docs/kubernetes.md):\n"
        "accept_envvar_when_unprivileged: false\n"
        "accept_volume_mounts: true\n"
        if accept_volume_mounts
        else ""
    )
    return (
        "# oci-gpu-hook configuration (docs/configuration.md). Every key is optional; the\n"
        "# defaults apply to a host with the NVIDIA driver installed in /.\n"
        "#\n"
        + chosen
        + "# supported_capabilities: [all]\n"
        + ("" if accept_volume_mounts else "# accept_envvar_when_unprivileged: true\n# accept_volume_mounts: false\n")
        + "# cgroups: auto\n"
        "# deadline_seconds: 8\n"
        "# logging:\n"
        "#   level: info\n"
        "#   file: /var/log/oci-gpu-hook.log\n" + ("" if accept_volume_mounts else "{}\n")
    )


def service_text(argv_prefix) -> str:
    command = " ".join(_systemd_quote(a) for a in list(argv_prefix) + ["inventory", "refresh"])
    return (
        "# Written by `oci-gpu-hook install`.\n"
        "[Unit]\n"
        "Description=Refresh the oci-gpu-hook inventory cache (NVIDIA driver, GPUs, device nodes)\n"
        "After=systemd-modules-load.service nvidia-persistenced.service\n"
        "ConditionPathExists=/proc/driver/nvidia/version\n"
        "\n"
        "[Service]\n"
        "Type=oneshot\n"
        f"ExecStart={command}\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def path_unit_text() -> str:
    # procfs has no inotify, so the driver's kernel side is watched by the udev rule; the path
    # unit catches a user-space driver change, which always ends with ldconfig.
    return (
        "# Written by `oci-gpu-hook install`.\n"
        "[Unit]\n"
        "Description=Refresh the oci-gpu-hook inventory cache when the driver libraries change\n"
        "\n"
        "[Path]\n"
        "PathChanged=/etc/ld.so.cache\n"
        f"Unit={SERVICE}\n"
        "\n"
        "[Install]\n"
        "WantedBy=paths.target\n"
    )


def udev_rule_text() -> str:
    return (
        "# Written by `oci-gpu-hook install`: refresh the GPU inventory cache when an NVIDIA kernel\n"
        "# module is loaded (driver installed, updated or reloaded).\n"
        'ACTION=="add", SUBSYSTEM=="module", KERNEL=="nvidia|nvidia_uvm|nvidia_modeset", '
        f'TAG+="systemd", ENV{{SYSTEMD_WANTS}}+="{SERVICE}"\n'
    )


def node_service_text(argv_prefix, description: str, *args: str, flag: str = "--node-services",
                      after: str = "") -> str:  # fmt: skip
    """A node service's unit: a long-running command, restarted when it fails, after the inventory
    refresh (so that it starts with a fresh inventory)."""
    command = " ".join(_systemd_quote(a) for a in list(argv_prefix) + list(args))
    return (
        f"# Written by `oci-gpu-hook install {flag}`.\n"
        "[Unit]\n"
        f"Description={description}\n"
        f"After=network-online.target {SERVICE}{' ' + after if after else ''}\n"
        "\n"
        "[Service]\n"
        f"ExecStart={command}\n"
        "Restart=on-failure\n"
        "RestartSec=5\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


# The RPM's preset file, which enables the start server's socket on install (RHEL's own presets end in
# "disable *"; an administrator's file of a lower number, or `systemctl disable`, overrides it).
START_PRESET = "50-oci-gpu-hook.preset"
START_PRESET_TEXT = f"# Shipped by the oci-gpu-hook RPM: GPU starts from a warm process.\nenable {START_SOCKET}\n"

# The first line of the start server's units, as install writes them and as the RPM ships them
# (rpm/oci-gpu-hook.spec writes its units with these functions, not a copy of their text).
START_UNITS_BY_INSTALL = "Written by `oci-gpu-hook install` (--no-start-server: not)."
START_UNITS_BY_PACKAGE = (f"Shipped by the oci-gpu-hook RPM, enabled on install by its preset ({START_PRESET}): "
                          f"`systemctl disable --now {START_SOCKET}` turns it off.")  # fmt: skip


START_WATCHDOG_SECONDS = 10
START_NICE = -10


def start_socket_text(note: str = START_UNITS_BY_INSTALL) -> str:
    """The start server's socket unit: systemd listens from boot and starts the server on the first
    offer (a pre-filter that finds nothing listening gives its start to Python instead)."""
    return (
        f"# {note}\n"
        "[Unit]\n"
        "Description=oci-gpu-hook start server socket (GPU container starts from a warm process)\n"
        "\n"
        "[Socket]\n"
        f"ListenSequentialPacket={prefilter_rule.START_SERVER_SOCKET}\n"
        # Root's alone: the server takes only root's offers, and the pre-filter only offers as root.
        "SocketUser=root\n"
        "SocketGroup=root\n"
        "SocketMode=0600\n"
        "DirectoryMode=0755\n"
        "Backlog=128\n"
        f"Service={START_SERVICE}\n"
        "\n"
        "[Install]\n"
        "WantedBy=sockets.target\n"
    )


def start_service_text(argv_prefix, note: str = START_UNITS_BY_INSTALL) -> str:
    """The start server's service, running argv_prefix (the server's own launcher, START_LAUNCHER
    or the RPM's PACKAGE_START_LAUNCHER, with the hook's options). KillMode=process: stopping or
    restarting the server (an upgrade) signals the server alone; a worker that is giving a
    container its GPUs finishes that start (or rolls it back) instead of being killed half-way. No
    sandboxing options: each worker joins a container's mount namespace from the host's, and one
    of systemd's own would stand between."""
    command = " ".join(_systemd_quote(a) for a in list(argv_prefix) + [prefilter_rule.START_SERVER])
    return (
        f"# {note}\n"
        "[Unit]\n"
        "Description=oci-gpu-hook start server (GPU container starts from a warm process)\n"
        f"Requires={START_SOCKET}\n"
        f"After={START_SOCKET} {SERVICE}\n"
        "\n"
        "[Service]\n"
        f"ExecStart={command}\n"
        "KillMode=process\n"
        "Restart=on-failure\n"
        "RestartSec=1\n"
        # A server that stops looping (stopped, hung) is killed, and socket activation starts a
        # new one for the next offer; meanwhile each start goes to Python after the pre-filter's
        # short wait (start/server.py, _Watchdog).
        f"WatchdogSec={START_WATCHDOG_SECONDS}\n"
        "NotifyAccess=main\n"
        # Ahead of other work: under load (48 starts at once on 2 CPUs) a server at the runtimes'
        # priority answers "taken" after the pre-filter's 250 ms wait, and the start goes to a
        # cold Python. A worker drops back to nice 0 once it has the start (start/server.py).
        f"Nice={START_NICE}\n"
        # A worker the kernel kills for memory (its container's start goes to Python or fails
        # alone) must not take the server down with it: systemd's default would stop the unit.
        "OOMPolicy=continue\n"
    )


_SYSTEMD_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._-=:,+@")


def _systemd_quote(arg: str) -> str:
    """arg as one word of a unit's command line that systemd reads back as exactly arg. Inside
    quotes systemd still expands `%` (unit specifiers) and `$` (environment variables), so both are
    doubled; it reads C escapes there, so the quote and the backslash are escaped; and a newline
    would end the setting (what follows could be a setting or section of its own), so every
    control character is written as \\xHH."""
    if arg and all(c in _SYSTEMD_PLAIN for c in arg):
        return arg
    out = []
    for c in arg:
        if c in '"\\':
            out.append("\\" + c)
        elif c in "%$":
            out.append(c + c)
        elif c < " " or c == "\x7f":
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


class Entry:
    """One thing install makes: a file with content, or a symlink with a value.

    set_aside: where another program's file at path goes when install is told to replace it
    (uninstall moves it back); without one, a file install did not write is never replaced."""

    def __init__(self, path: str, content: str | bytes | None = None, link: str | None = None, only_if_absent=False,
                 mode: int = 0o644, set_aside: str | None = None, edit: str | None = None):  # fmt: skip
        self.path, self.content, self.link, self.only_if_absent = path, content, link, only_if_absent
        # edit: the administrators' file gets this first line (content: the file with it), which
        # uninstall removes (the manifest's "edited"); the file itself never becomes install's.
        self.mode, self.set_aside, self.edit = mode, set_aside, edit

    @property
    def checksum(self) -> str:
        if self.link is not None:
            return "link:" + self.link
        data = self.content if isinstance(self.content, bytes) else self.content.encode()
        return "sha256:" + hashlib.sha256(data).hexdigest()


def launcher_entries(with_prefilter: bool) -> list:
    """What runtimes run: the launcher; or, with_prefilter, the compiled pre-filter in its place and
    the launcher beside it, for what the pre-filter hands on (toolkit/prefilter.py), offered to
    the start server first where one listens.

    Run from a bundle (toolkit/bundle.py), what runtimes run is a link to the bundle's own
    pre-filter (or launcher): an upgrade to another bundle is then one rename, after which every
    start runs the new bundle, and every start that began in the old one ends in it."""
    running = bundle.running()
    if running is not None:
        target = bundle.PREFILTER if with_prefilter else bundle.LAUNCHER
        return [Entry(launcher.LAUNCHER, link=f"{BUNDLES_LINK}/{running}/{target}")]
    if not with_prefilter:
        return [Entry(launcher.LAUNCHER, launcher_text(), mode=0o755)]
    from oci_gpu_hook.toolkit import prefilter

    program = prefilter.build_bytes(launcher.PYTHON_LAUNCHER, start_server=prefilter_rule.START_SERVER_SOCKET)
    return [Entry(launcher.PYTHON_LAUNCHER, launcher_text(), mode=0o755),
            Entry(launcher.LAUNCHER, program, mode=0o755)]  # fmt: skip


def docker_entries(argv_prefix, with_prefilter: bool) -> list:
    """Docker's program: the launcher, with argv_prefix's options; or, with_prefilter, the compiled
    pre-filter in its place, built to run that launcher at DOCKER_LAUNCHER and to offer each start
    to the start server first (with the same options), where one listens. dockerd runs the program
    only for `--gpus` (a plain `docker run` gets no hook), so the starts it sees ask for GPUs and go
    on, to the server or the launcher: the gain is the server's, whose warm worker saves the
    interpreter's start and the imports. Without one the pre-filter would only cost an exec more,
    so planned() asks for it only with the start server."""
    if not with_prefilter:
        return [Entry(DOCKER_HOOK, docker_hook_text(argv_prefix), mode=0o755, set_aside=DOCKER_HOOK_SAVED)]
    from oci_gpu_hook.toolkit import prefilter

    options = _options(argv_prefix)
    program = prefilter.build_bytes(DOCKER_LAUNCHER, options, start_server=prefilter_rule.START_SERVER_SOCKET)
    # The launcher first: the pre-filter is never in place without what it runs.
    return [Entry(DOCKER_LAUNCHER, docker_hook_text(argv_prefix, behind_prefilter=True), mode=0o755),
            Entry(DOCKER_HOOK, program, mode=0o755, set_aside=DOCKER_HOOK_SAVED)]  # fmt: skip


def planned(runtimes, argv_prefix, node_services: bool = False, device_plugin: bool = False, root: str = "/",
            with_prefilter: bool = False, start_server: bool = False,
            accept_volume_mounts: bool = False) -> list:  # fmt: skip
    entries = []
    if argv_prefix[0] == launcher.LAUNCHER:
        entries += launcher_entries(with_prefilter)
    if "podman" in runtimes or "crio" in runtimes:
        entries.append(Entry(HOOKS_D_FILE, hooks_d_text(argv_prefix)))
    if "podman" in runtimes:
        entries += [e for e in [podman_dropin(root)] if e is not None]
    if "crio" in runtimes:
        entries += [e for e in [crio_dropin(root)] if e is not None]
    if "containerd" in runtimes:
        entries += containerd_entries(root, argv_prefix)
    if "docker" in runtimes:
        entries += docker_entries(argv_prefix, with_prefilter and start_server)
    entries.append(Entry(CONFIG_FILE, config_text(accept_volume_mounts), only_if_absent=True))
    entries += [
        Entry(f"{UNIT_DIR}/{SERVICE}", service_text(argv_prefix)),
        Entry(f"{UNIT_DIR}/{PATH_UNIT}", path_unit_text()),
        Entry(f"{UNIT_DIR}/multi-user.target.wants/{SERVICE}", link=f"../{SERVICE}"),
        Entry(f"{UNIT_DIR}/paths.target.wants/{PATH_UNIT}", link=f"../{PATH_UNIT}"),
        Entry(UDEV_RULE, udev_rule_text()),
    ]
    if node_services:
        for unit, text in (
            (EXPORTER_SERVICE, node_service_text(argv_prefix, "oci-gpu-hook GPU metrics for Prometheus", "exporter")),
            (LABELS_SERVICE, node_service_text(argv_prefix, "oci-gpu-hook GPU labels for NFD", "labels", "--watch",
                                               str(LABELS_WATCH_SECONDS))),
            (WATCHDOG_SERVICE, node_service_text(argv_prefix, "oci-gpu-hook GPU memory limits on shared GPUs",
                                                 "watchdog")),
        ):  # fmt: skip
            entries.append(Entry(f"{UNIT_DIR}/{unit}", text))
            entries.append(Entry(f"{UNIT_DIR}/multi-user.target.wants/{unit}", link=f"../{unit}"))
    if device_plugin:
        # After the kubelet: the plugin registers through its socket (and registers again by
        # itself when the kubelet restarts).
        text = node_service_text(argv_prefix, "oci-gpu-hook Kubernetes device plugin", "device-plugin",
                                 flag="--device-plugin", after="kubelet.service")  # fmt: skip
        entries.append(Entry(f"{UNIT_DIR}/{DEVICE_PLUGIN_SERVICE}", text))
        entries.append(Entry(f"{UNIT_DIR}/multi-user.target.wants/{DEVICE_PLUGIN_SERVICE}",
                             link=f"../{DEVICE_PLUGIN_SERVICE}"))  # fmt: skip
    if start_server:
        entries += start_server_entries(root, argv_prefix)
    return entries


# What `systemctl enable` writes for the start server's socket, and what install writes for it.
START_SOCKET_LINK = f"{UNIT_DIR}/sockets.target.wants/{START_SOCKET}"


def start_server_command(argv_prefix) -> list:
    """What the start server's service runs: its own launcher with the hook's options."""
    return [START_LAUNCHER] + _options(argv_prefix)


def start_server_entries(root: str, argv_prefix) -> list:
    """The start server's units and the link that starts its socket at boot. Where runtimes run the
    RPM's program and the RPM ships the units (PACKAGE_UNIT_DIR), only the link, to the package's
    socket (what `systemctl enable` writes): copies in UNIT_DIR would shadow the package's units,
    so that an upgrade's were never read. The package's service is the one install would write
    even with a --config: the server reads no configuration (each worker runs the hook with the
    hook entry's own arguments)."""
    link = START_SOCKET_LINK
    if argv_prefix[0] == INSTALLED_PATH:
        with Tree(root) as tree:
            packaged = all(os.path.isfile(tree.resolve(f"{PACKAGE_UNIT_DIR}/{unit}"))
                           for unit in (START_SOCKET, START_SERVICE))  # fmt: skip
            # Enabled already, by the package's preset or an administrator (`systemctl enable`
            # writes its own spelling of the path, /lib/... on Debian): theirs, not install's
            # to write or to remove.
            linked = tree.resolve(link)
            unit = tree.resolve(f"{PACKAGE_UNIT_DIR}/{START_SOCKET}")
            enabled = packaged and os.path.exists(linked) and os.path.samefile(linked, unit)
        if enabled:
            return []
        if packaged:
            return [Entry(link, link=f"{PACKAGE_UNIT_DIR}/{START_SOCKET}")]
    # The launcher first: the service never runs without it.
    return [Entry(START_LAUNCHER, start_launcher_text(), mode=0o755),
            Entry(f"{UNIT_DIR}/{START_SOCKET}", start_socket_text()),
            Entry(f"{UNIT_DIR}/{START_SERVICE}", start_service_text(start_server_command(argv_prefix))),
            Entry(link, link=f"../{START_SOCKET}")]  # fmt: skip


def containerd_entries(root: str, argv_prefix) -> list:
    """The base spec, the drop-in naming it, and config.toml importing the drop-in (a line added
    to the administrators' file, or the file itself where there is none): toolkit/containerd.py."""
    try:
        with Tree(root) as tree:
            config_text, created, dropin, spec = containerd.plan(tree, hooks_d_document(argv_prefix)["hook"])
    except (containerd.ContainerdError, TomlUnavailable) as e:
        raise InstallError(str(e)) from None
    except OSError as e:
        raise InstallError(f"{root}: {e.strerror}") from None
    edit = None if created else containerd.IMPORT_LINE
    return [Entry(containerd.BASE_SPEC, spec), Entry(containerd.DROPIN, dropin),
            Entry(containerd.CONFIG, config_text, edit=edit)]  # fmt: skip


# --- the manifest -------------------------------------------------------------------------------


def _installable_paths() -> set:
    """Every path install can write (with any options): all a manifest may name."""
    # Not "podman" or "crio": planning for them reads the host's runtime configuration and asks
    # podman, and their paths are named here anyway.
    entries = planned(("docker",), [launcher.LAUNCHER], node_services=True, device_plugin=True, start_server=True)
    return {e.path for e in entries} | {HOOKS_D_FILE, CRIO_DROPIN, PODMAN_DROPIN, launcher.PYTHON_LAUNCHER,
                                        DOCKER_LAUNCHER, containerd.BASE_SPEC, containerd.DROPIN,
                                        containerd.CONFIG}  # fmt: skip


def _edited_ok(edited) -> bool:
    """The manifest's "edited": only the one line install adds to containerd's config.toml."""
    return edited in ({}, {containerd.CONFIG: containerd.IMPORT_LINE})


MANIFEST_LIMIT = 1 << 20  # what install writes is a few KiB


def _read_manifest(tree: Tree) -> dict:
    """The manifest, trusted only as far as install could have written it: uninstall removes and
    moves what it names, as root. So the file must be root's alone in directories only root can
    change (as install's destinations), and name only paths install writes, the directories
    above them, and NVIDIA's program set aside; anything else is refused, with one line. It is
    the tree's own file (tree.entry: never reached through a link out of the tree), and a file:
    install never writes it as a link, so a link there is refused rather than followed."""
    path = tree.entry(MANIFEST)
    if not os.path.lexists(path):
        return {"format": 1, "files": {}, "directories": []}
    if os.path.islink(path):
        raise InstallError(f"{path}: a symlink, where install writes its manifest as a file; not trusted (remove "
                           "it, and what it lists, by hand)")  # fmt: skip
    sources = HostSources()
    try:
        # path has no link in it (tree.entry, and its last component is none): the descriptor
        # checked is the file read.
        fd = sources.open(path, "file")
        try:
            data = files.read_bounded(f"/proc/self/fd/{fd}", MANIFEST_LIMIT)
        finally:
            os.close(fd)
        if len(data) > MANIFEST_LIMIT:
            raise ValueError(f"over {MANIFEST_LIMIT} bytes")
        doc = json.loads(data)
    except FileNotFoundError:
        return {"format": 1, "files": {}, "directories": []}
    except UntrustedSource as e:
        raise InstallError(f"{e}: the install manifest says what uninstall removes, so it must be root's alone; "
                           "remove it to start over") from None  # fmt: skip
    except (OSError, ValueError) as e:
        raise InstallError(f"{path}: unreadable install manifest ({e}); remove it to start over") from None
    finally:
        sources.close()
    if not isinstance(doc, dict) or doc.get("format") != 1:
        raise InstallError(f"{path}: not an oci-gpu-hook install manifest of format 1")
    doc.setdefault("files", {})
    doc.setdefault("directories", [])
    known = _installable_paths()
    parents = {os.path.dirname(p) for p in known | {MANIFEST}} | {bundle.BUNDLES_DIR}
    parents |= {d for p in set(parents) for d in _ancestors(p)}
    files_ok = isinstance(doc["files"], dict) and all(
        k in known and isinstance(v, str) for k, v in doc["files"].items()
    )
    dirs_ok = isinstance(doc["directories"], list) and all(d in parents for d in doc["directories"])
    saved_ok = doc.get("saved", {}) in ({}, {DOCKER_HOOK: DOCKER_HOOK_SAVED})
    bundles = doc.get("bundles", [])
    bundles_ok = isinstance(bundles, list) and all(isinstance(b, str) and bundle.is_id(b) for b in bundles)
    restart_ok = isinstance(doc.get("restart", []), list) and set(doc.get("restart", [])) <= set(RUNTIME_FILES)
    module_ok = _module_record_ok(doc.get("selinux_module"))
    if not (files_ok and dirs_ok and saved_ok and bundles_ok and restart_ok and module_ok
            and _edited_ok(doc.get("edited", {}))):  # fmt: skip
        raise InstallError(f"{path}: names paths install never writes; not trusted (remove it, and what it "
                           "lists, by hand)")  # fmt: skip
    return doc


def _module_record_ok(record) -> bool:
    """The manifest's record of the SELinux module install loaded (_load_selinux_module): uninstall
    runs `semodule -r` on what it names, so only the one module, at install's own priority."""
    from oci_gpu_hook.toolkit import policy_module

    if record is None:
        return True
    return (isinstance(record, dict) and set(record) == {"policy", "priority", "sha256"}
            and record["priority"] == policy_module.PRIORITY
            and record["policy"] in policy_module.FLAVOUR_OF_POLICY
            and isinstance(record["sha256"], str) and len(record["sha256"]) == 64)  # fmt: skip


def _ancestors(path: str) -> list:
    found = []
    while path not in ("/", ""):
        found.append(path)
        path = os.path.dirname(path)
    return found


def _write_text(path: str, text: str | bytes, mode: int = 0o644) -> None:
    files.write_atomically(path, text if isinstance(text, bytes) else text.encode(), mode)


# More than anything install writes (the pre-filter is the largest, some KiB): a file larger is
# not one of install's, and is never read whole.
CURRENT_LIMIT = 16 << 20


def _current(path: str):
    """The checksum of what is at path now, or None when nothing is. An image's author chooses
    what is at each destination under --root (an 8 GiB sparse file there was read whole into
    memory): only a regular file up to CURRENT_LIMIT is read, anything else is "other", never
    install's."""
    if os.path.islink(path):
        return "link:" + os.readlink(path)
    if not os.path.lexists(path):
        return None
    if not os.path.isfile(path):  # by stat: a device node there is never opened
        return "other"
    try:
        data = files.read_bounded(path, CURRENT_LIMIT, nofollow=True, regular=True)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ELOOP):  # only root could have swapped it since
            return "other"
        raise
    if len(data) > CURRENT_LIMIT:
        return "other"
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _makedirs(tree: Tree, directory: str, created: list) -> None:
    """Create directory (a path of the tree) and its missing parents, recording each one (by its
    path in the tree). The missing ones are the last components of tree.directory's answer, which
    has no link in it: nothing here is followed."""
    missing = []
    place, current = tree.directory(directory), directory
    while not os.path.isdir(place):
        missing.append((place, current))
        place, current = os.path.dirname(place), os.path.dirname(current)
    for place, path in reversed(missing):
        os.mkdir(place, 0o755)
        os.chmod(place, 0o755)
        if path not in created:
            created.append(path)


def _check_destinations(tree: Tree, entries, directories=()) -> None:
    """Refuse, before writing anything, a destination that anyone but root could change: what
    install writes there is run as root (the launcher, Docker's program), or says what runs as
    root (hooks.d, units, CRI-O's drop-in, the configuration, the manifest uninstall trusts). So
    each directory it writes into, or the part of it that exists, and every directory above it
    must be root's and writable by no one else, checked as the hook checks its mount sources;
    and a file already at a destination must be root's and writable by no one else.

    Each directory is resolved inside the tree here, first (a link that leads out of it or
    nowhere is refused: tree.py), and the directories checked are those resolved places, which
    have no link in them: once they are root's alone, only root can change what the place
    strings install then acts on (tree.entry, _makedirs) lead to. directories: the ones uninstall
    removes, whose parents it acts in."""
    why = "install writes what runtimes run as root under it, so it and every directory above it"
    places = {os.path.dirname(e.path) for e in entries} | {os.path.dirname(MANIFEST)}
    places |= {os.path.dirname(d) for d in directories}
    with _root_only() as check:
        for directory in sorted(places):
            check(tree.directory(directory), "dir", why)
    for entry in entries:
        path = tree.entry(entry.path)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode) or (st.st_uid == 0 and not st.st_mode & 0o022):
            continue
        owner = f"owned by uid {st.st_uid}" if st.st_uid != 0 else "writable by others than root"
        raise InstallError(f"{path}: {owner}; runtimes act on it as root: make it root's alone (or remove it) "
                           "and run install again")  # fmt: skip


def _check_configuration(tree: Tree, argv_prefix) -> None:
    """A --config that install writes into what runtimes run must name a file only root can
    change (or, while it does not exist yet, a place where only root can make it): whoever
    changes it decides what containers get and which files the hook and node services write.
    The file checked is the one the tree's programs will open (its links followed inside it)."""
    if "--config" in argv_prefix[:-1]:
        with _root_only() as check:
            check(tree.resolve(argv_prefix[argv_prefix.index("--config") + 1]), "file",
                  "the configuration decides what containers get, so it and every directory above it")  # fmt: skip


def _check_text(argv_prefix) -> None:
    """Every argument goes into the hooks.d file, the units and the launcher: each must be text
    that reads back as itself there (a file name that is not UTF-8 would not)."""
    for arg in argv_prefix:
        try:
            arg.encode()
        except UnicodeEncodeError:
            raise InstallError(f"{arg}: not UTF-8 text; runtimes and systemd would read another name") from None


class _root_only:
    """check(path, kind, why): InstallError unless path (or where it would be made) is a place
    only root can change (HostSources.open_place, the hook's own rule for its host sources)."""

    def __enter__(self):
        self.sources = HostSources()
        return self.check

    def __exit__(self, *exc):
        self.sources.close()

    def check(self, path: str, kind: str, why: str) -> None:
        try:
            os.close(self.sources.open_place(path, kind))
        except UntrustedSource as e:
            raise InstallError(f"{e}: {why} must be root's and writable by no one else") from None
        except OSError as e:
            raise InstallError(f"{path}: {e.strerror}") from None


# --- install / uninstall ------------------------------------------------------------------------


def install(root: str, runtimes, argv_prefix=None, replace_nvidia_hook: bool = False, node_services: bool = False,
            device_plugin: bool = False, prefilter: bool | None = None, warn=None,
            start_server: bool | None = None, restart: str = "none",
            accept_volume_mounts: bool = False) -> list:  # fmt: skip
    """Install for the runtimes; returns lines saying what happened (nothing changed: none).
    replace_nvidia_hook: move another program's file aside where an entry allows it (the one
    is NVIDIA's nvidia-container-runtime-hook; uninstall restores it) instead of refusing.
    prefilter: put the compiled pre-filter where runtimes run the launcher, and as Docker's program
    (True: or fail; False: never; None: where a C compiler is found and builds it, else the
    launcher, and warn(line), when given, hears why). start_server: the start server's units too,
    which only a pre-filter offers starts to (True: or fail; False: never; None: wherever runtimes
    run a pre-filter that offers to its socket). restart: restart.MODES; other than "none", each
    runtime whose configuration files this install changed is restarted (toolkit/restart.py).
    accept_volume_mounts: the configuration written where there is none (config_text)."""
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise InstallError(f"{root}: no such directory")
    _check_restart(root, restart)
    with _locked(root):
        with _tree(root) as tree:
            before = _read_manifest(tree)
            lines = _install(tree, runtimes, argv_prefix, replace_nvidia_hook, node_services, device_plugin,
                             prefilter, warn, start_server, accept_volume_mounts)  # fmt: skip
            after = _read_manifest(tree)
        if restart != "none":
            lines += _restart_changed(root, before, after, restart)
    if "podman" in runtimes and root == "/" and warn is not None:
        _check_podman_reads(warn)
    return lines


def _check_offers(tree: Tree, argv_prefix, entries, runtimes=()) -> None:
    """--start-server: what runtimes run must be a pre-filter (only it offers starts to the server):
    the one this install writes, or the RPM's /usr/bin/oci-gpu-hook. For Docker alone, its own
    program, which install builds as a pre-filter with the start server (docker_entries)."""
    from oci_gpu_hook.toolkit import prefilter

    if set(runtimes) == {"docker"} and any(e.path == DOCKER_HOOK and isinstance(e.content, bytes) for e in entries):
        return

    program = next((e.content for e in entries if e.path == argv_prefix[0] and isinstance(e.content, bytes)), None)
    if program is not None and prefilter.MARKER in program:
        return
    link = next((e.link for e in entries if e.path == argv_prefix[0] and e.link is not None), None)
    if link is not None and link.endswith("/" + bundle.PREFILTER):
        target = tree.entry(os.path.normpath(os.path.join(os.path.dirname(argv_prefix[0]), link)))
        if prefilter.offers_to(target) == prefilter_rule.START_SERVER_SOCKET:
            return
    if program is None and prefilter.is_prefilter(tree.entry(argv_prefix[0])):
        # One built without the units' socket (an RPM from before the start server) offers the
        # server nothing: the units would run a server no start ever reaches.
        if prefilter.offers_to(tree.entry(argv_prefix[0])) == prefilter_rule.START_SERVER_SOCKET:
            return
        raise InstallError(f"--start-server: {tree.shown(argv_prefix[0])} is a pre-filter built without the start "
                           f"server's socket ({prefilter_rule.START_SERVER_SOCKET}), so it would offer the server no "
                           "start: upgrade the package that installed it")  # fmt: skip
    raise InstallError(f"--start-server: runtimes run {argv_prefix[0]}, which is not the pre-filter, and only "
                       "the pre-filter offers starts to the server (install --prefilter builds it, with a C "
                       "compiler)")  # fmt: skip


def _check_podman_reads(warn) -> None:
    """Ask the podman installed whether it now reads the hooks.d directory: a file or setting
    this podman reads that install does not know (another version's, $CONTAINERS_CONF) shows
    here rather than as a container without its GPU."""
    try:
        dirs = runtime_config.podman_effective_hooks_dirs()
    except runtime_config.PodmanUnavailable:
        return
    except runtime_config.ConfigFileError as e:
        warn(f"{e}: cannot tell which hooks directories podman reads (oci-gpu-hook doctor checks it)")
        return
    if HOOKS_D_DIR not in dirs:
        warn(f"podman reads hooks from {', '.join(dirs) or 'no directory'}, without {HOOKS_D_DIR}: add it to "
             "containers.conf's hooks_dir (oci-gpu-hook doctor checks it)")  # fmt: skip


@contextlib.contextmanager
def _locked(root: str):
    """One install, uninstall or bundle placement at a time on a tree (two toolkit pods during a
    DaemonSet's rolling update, an administrator's install meanwhile): an exclusive flock on the
    tree's root directory, which exists whatever install has made, and which nothing else of
    the host's locks. Only the outermost call takes it: a second descriptor of the same process
    would wait on the first."""
    import fcntl

    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise InstallError(f"{root}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _tree(root: str):
    """The tree at root, whose paths install and uninstall resolve inside it (tree.py); a path
    that does not resolve inside it is an InstallError, before anything is written."""
    try:
        tree = Tree(root)
    except OSError as e:
        raise InstallError(f"{root}: {e.strerror}") from None
    try:
        yield tree
    except TreeError as e:
        raise InstallError(str(e)) from None
    finally:
        tree.close()


def _install(tree: Tree, runtimes, argv_prefix, replace_nvidia_hook, node_services, device_plugin, prefilter,
             warn, start_server=None, accept_volume_mounts=False) -> list:  # fmt: skip
    root = tree.root

    def plan(*args):
        return planned(*args, accept_volume_mounts=accept_volume_mounts)

    argv_prefix = list(argv_prefix or hook_command())
    _check_text(argv_prefix)
    manifest = _read_manifest(tree)
    before = json.dumps(manifest, sort_keys=True)
    written, directories = manifest["files"], manifest["directories"]
    asked = start_server  # None: the server wherever the pre-filter offers it starts
    running = bundle.running()
    if running is not None:
        if "docker" in runtimes:
            raise InstallError("--runtime docker: not from a bundle (Docker's program is compiled for each install); "
                               "install the package, or run install from it")  # fmt: skip
        if prefilter is None:
            prefilter = True  # the bundle carries its pre-filter: nothing to compile
    if prefilter is None:
        from oci_gpu_hook.toolkit import prefilter as prefilter_module

        # Asked for nothing: a compiler that is there but cannot build here (no C library headers,
        # say) leaves the launcher, as no compiler does; the pre-filter only saves time, so that
        # is a warning and never a failed install.
        prefilter = prefilter_module.compiler() is not None
        try:
            entries = plan(runtimes, argv_prefix, node_services, device_plugin, root, prefilter, asked is not False)
        except prefilter_module.PrefilterError as e:
            if asked:
                raise InstallError(f"--start-server: the pre-filter offers starts to the server, and it cannot be "
                                   f"built here: {e}") from None  # fmt: skip
            if warn is not None:
                warn(f"the pre-filter could not be built ({e}): runtimes run the launcher, and GPU starts run in "
                     "Python (no start server)")  # fmt: skip
            prefilter, asked = False, False
            entries = plan(runtimes, argv_prefix, node_services, device_plugin, root, False)
    else:
        entries = plan(runtimes, argv_prefix, node_services, device_plugin, root, prefilter, asked is not False)
    if asked is not False:
        try:
            _check_offers(tree, argv_prefix, entries, runtimes)
        except InstallError:
            if asked:
                raise
            # By default only where a pre-filter offers it starts: without one the units would
            # run a server no start reaches.
            entries = plan(runtimes, argv_prefix, node_services, device_plugin, root, prefilter, False)
    if any(e.path in (launcher.LAUNCHER, DOCKER_HOOK, DOCKER_LAUNCHER, START_LAUNCHER) for e in entries):
        launcher.check_trusted()  # what runs as root at every start must be root's alone
    _check_destinations(tree, entries)
    _check_configuration(tree, argv_prefix)
    # Refuse before writing anything: a file we did not write is the administrator's.
    for entry in entries:
        path = tree.entry(entry.path)
        now = _current(path)
        if now is None or entry.only_if_absent or now == entry.checksum:
            continue
        if entry.path in written or entry.edit is not None:
            continue
        if entry.set_aside is not None:
            if not replace_nvidia_hook:
                raise InstallError(f"{path}: another {os.path.basename(path)} (NVIDIA's?) is installed; "
                                   "install --runtime docker --replace-nvidia-hook puts oci-gpu-hook's in its place "
                                   "(uninstall puts this one back)")  # fmt: skip
            if os.path.lexists(tree.entry(entry.set_aside)):
                raise InstallError(f"{tree.entry(entry.set_aside)}: exists; move it away first")
            continue
        raise InstallError(f"{path}: exists and was not written by oci-gpu-hook install; "
                           "move it away (or merge it by hand) and run install again")  # fmt: skip
    lines = []
    try:
        if running is not None and root == "/":
            # Before any file: its one file context names the start server's launcher, labelled
            # below; and a module that cannot be loaded leaves nothing written.
            lines += _load_selinux_module(tree, manifest, running)
        for entry in entries:
            path = tree.entry(entry.path)
            now = _current(path)
            if now == entry.checksum:
                continue
            if entry.edit is not None:
                _write_text(path, entry.content, stat.S_IMODE(os.stat(path).st_mode))  # the file's own mode
                manifest.setdefault("edited", {})[entry.path] = entry.edit
                lines.append(f"added to {path}: {entry.edit.strip()}")
                continue
            if now is not None and entry.set_aside is not None and entry.path not in written:
                # Another program's file (checked above: replacing it was asked for): aside.
                os.rename(path, tree.entry(entry.set_aside))  # the same directory: atomic
                manifest.setdefault("saved", {})[entry.path] = entry.set_aside
                lines.append(f"moved {path} to {tree.entry(entry.set_aside)}")
                now = None
            if now is not None:
                if entry.only_if_absent:
                    continue  # the administrator's configuration stays
                if written.get(entry.path) != now:
                    lines.append(f"kept {path}: changed since install wrote it")
                    continue
            _makedirs(tree, os.path.dirname(entry.path), directories)
            if entry.link is not None:
                _link_atomically(entry.link, path)
            else:
                _write_text(path, entry.content, entry.mode)
            written[entry.path] = entry.checksum
            lines.append(f"{'updated' if now is not None else 'wrote'} {path}")
        if root == "/" and any(e.path == START_LAUNCHER for e in entries):
            lines += _label_as_the_policy_says(tree.entry(START_LAUNCHER))
        if root == "/" and running is not None:
            lines += _label_as_the_policy_says(tree.entry(bundle.directory(running)), recursive=True)
        if running is not None:
            lines += _keep_bundles(tree, manifest, running)
    finally:
        if json.dumps(manifest, sort_keys=True) != before:
            _makedirs(tree, os.path.dirname(MANIFEST), directories)
            _write_text(tree.entry(MANIFEST), json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return lines


def _link_atomically(value: str, path: str) -> None:
    """Make path a symlink to value in one rename: whoever resolves path while install replaces a
    link there finds the old link or the new one, never nothing (a start that ran the program
    between an unlink and a symlink would fail)."""
    spare = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.link")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(spare)  # one a killed install left
    os.symlink(value, spare)
    try:
        os.rename(spare, path)  # the same directory: atomic, and it replaces a link or a file
    except OSError:
        os.unlink(spare)
        raise


# selinux_restorecon(3)'s flags (selinux/restorecon.h): into directories, and no digest of the
# policy's file contexts written onto them (an xattr of ours that uninstall would leave behind).
RESTORECON_RECURSE = 0x00008
RESTORECON_SKIP_DIGEST = 0x08000


def _label_as_the_policy_says(path: str, recursive: bool = False) -> list:
    """Give path (recursive: and all under it) the label the loaded policy's file contexts name,
    as `restorecon [-R] PATH` does (its type; selinux_restorecon(3)). A file install writes gets
    its directory's label (usr_t under /usr/local), and only the module's file context makes
    START_LAUNCHER the entry point of the start server's domain. A bundle the toolkit placed
    was copied from the image, whose directories' labels copytree copied too (a container's
    file type, on the host). Every install does it, so that install run again after the module
    was loaded or removed puts the label right. Returns the line saying so when a label
    changed; nothing on a host without SELinux (libselinux is not even loaded there)."""
    from oci_gpu_hook.start.linux import labels

    if not labels.selinux_enabled():
        return []
    import ctypes

    def labelled() -> dict:
        found = {path: _label_of(path)}
        for here, dirs, names in os.walk(path) if recursive else ():
            for name in [*dirs, *names]:
                found[os.path.join(here, name)] = _label_of(os.path.join(here, name))
        return found

    before = labelled()
    flags = RESTORECON_RECURSE | RESTORECON_SKIP_DIGEST if recursive else 0
    try:
        failed = ctypes.CDLL("libselinux.so.1", use_errno=True).selinux_restorecon(os.fsencode(path), flags) != 0
        why = os.strerror(ctypes.get_errno())
    except (OSError, AttributeError) as e:  # no libselinux, or one before selinux_restorecon (2.5)
        failed, why = True, str(e)
    if failed:
        raise InstallError(f"{path}: cannot give it the label the SELinux policy names ({why}); "
                           f"`restorecon {'-R ' if recursive else ''}{path}` does it")  # fmt: skip
    after = labelled()
    changed = [p for p in after if after[p] != before.get(p)]
    if not changed:
        return []
    if not recursive:
        return [f"labelled {path} {after[path]}"]
    return [f"labelled {len(changed)} files under {path} as the SELinux policy names"]


def _load_selinux_module(tree: Tree, manifest: dict, running: str) -> list:
    """Where SELinux is enabled, load the policy module the running bundle carries for the host's
    policy (toolkit/policy_module.py), at its own priority, unless the store already holds that
    build there; recorded in the manifest, so that uninstall removes it. A host whose policy the
    bundle has no module for is refused, unless a module is loaded already (the RPM's, an
    administrator's): what it lacks is then theirs to give."""
    from oci_gpu_hook.start.linux import labels
    from oci_gpu_hook.toolkit import policy_module

    if not labels.selinux_enabled():
        return []
    try:
        with open(tree.entry(policy_module.SELINUX_CONFIG)) as f:
            config = f.read()
    except FileNotFoundError:
        config = None
    except OSError as e:
        raise InstallError(f"{policy_module.SELINUX_CONFIG}: {e.strerror}") from None
    policy = policy_module.policy_type(config)
    try:
        path = policy_module.chosen(policy, policy_module.carried(tree.entry(bundle.directory(running))))
    except policy_module.ModuleError as e:
        there = policy_module.loaded_at(policy, tree.root) if policy else []
        if there:
            return [f"kept SELinux module {policy_module.MODULE} at priority {there[-1]}, loaded by another: {e}"]
        raise InstallError(str(e)) from None
    record = {"policy": policy, "priority": policy_module.PRIORITY, "sha256": policy_module.digest(path)}
    if manifest.get("selinux_module") == record and policy_module.PRIORITY in policy_module.loaded_at(
        policy, tree.root
    ):
        return []
    try:
        policy_module.load(path)
    except policy_module.ModuleError as e:
        raise InstallError(f"the SELinux module for policy {policy!r}: {e}") from None
    manifest["selinux_module"] = record
    return [f"loaded SELinux module {policy_module.MODULE} into policy {policy} at priority "
            f"{policy_module.PRIORITY} ({os.path.relpath(path, bundle.directory(running))})"]  # fmt: skip


def _remove_selinux_module(tree: Tree, manifest: dict) -> list:
    """Remove the module install loaded (the manifest's record), unless a process still runs in
    one of its domains: the kernel would leave it unlabeled_t, its GPU and files denied. Either
    way the record goes, written at once, so that uninstall run again after a later failure
    does not remove it twice or keep a record of a module it no longer answers for."""
    import time

    from oci_gpu_hook.toolkit import policy_module

    record = manifest.pop("selinux_module")
    lines = []
    if policy_module.PRIORITY in policy_module.loaded_at(record["policy"], tree.root):
        # The start server is being stopped (--stop-units asks systemd, which does not wait for
        # the job): its processes end within the hook's timeout. A GPU container's do not.
        deadline = time.monotonic() + UNINSTALL_WAIT
        in_use = policy_module.domains_in_use()
        while policy_module.START_DOMAIN in in_use.values() and time.monotonic() < deadline:
            time.sleep(0.2)
            in_use = policy_module.domains_in_use()
        if in_use:
            pids = list(in_use)
            shown = " ".join(map(str, pids[:5])) + (" ..." if len(pids) > 5 else "")
            lines.append(f"kept SELinux module {policy_module.MODULE}: processes {shown} run in its domains; "
                         f"`semodule -X {policy_module.PRIORITY} -r {policy_module.MODULE}` once they "
                         "ended")  # fmt: skip
        else:
            try:
                policy_module.remove()
            except policy_module.ModuleError as e:
                raise InstallError(f"the SELinux module install loaded: {e}") from None
            lines.append(f"removed SELinux module {policy_module.MODULE} (priority {policy_module.PRIORITY})")
    _write_text(tree.entry(MANIFEST), json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return lines


def _label_of(path: str) -> str | None:
    try:
        return os.getxattr(path, "security.selinux", follow_symlinks=False).rstrip(b"\0").decode(errors="replace")
    except OSError:
        return None


def _unedit(path: str, line: str) -> str:
    """Remove the line install added first in path, leaving the file as it was; what uninstall says.

    path is the tree's own entry (tree.entry: no link before its last component), and the file
    is read only if it is one: install edits a file, never a link (containerd.plan refuses one),
    so a link there is the tree's author's, and followed it would read the build host's own
    config.toml (from the host's /) into the tree. Not blocking: a FIFO there would hang uninstall."""
    modes = []
    try:
        data = files.read_bounded(path, CURRENT_LIMIT, nofollow=True, regular=True,
                                  check=lambda st: modes.append(stat.S_IMODE(st.st_mode)))  # fmt: skip
    except FileNotFoundError:
        return ""
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"kept {path}: a symlink, where install edited a file"
        if e.errno == errno.EINVAL:  # read_bounded's "not a regular file"
            return f"kept {path}: not a file, where install edited one"
        raise
    mode = modes[0]
    if len(data) > CURRENT_LIMIT:
        return f"kept {path}: larger than {CURRENT_LIMIT >> 20} MiB, not a file install edited"
    if not data.startswith(line.encode()):
        return f"kept {path}: its first line is no longer the one install added ({line.strip()})"
    _write_text(path, data[len(line.encode()) :], mode)
    return f"removed from {path}: {line.strip()}"


def units_to_start(root: str, node_services: bool = False, device_plugin: bool = False) -> list:
    """What to start once install wrote its units (what its closing `then:` line tells a user to
    start): the refresh units, the node services asked for, and the start server's socket where
    it is enabled."""
    units = [PATH_UNIT, SERVICE]
    if node_services:
        units += [EXPORTER_SERVICE, LABELS_SERVICE, WATCHDOG_SERVICE]
    if device_plugin:
        units.append(DEVICE_PLUGIN_SERVICE)
    with _tree(root) as tree:
        if os.path.lexists(tree.entry(START_SOCKET_LINK)):
            units.append(START_SOCKET)
    return units


def start_units(units, address: str | None = None, bus: bool = False, restart=()) -> list:
    """Reload systemd and start units, as `systemctl daemon-reload && systemctl start UNITS` (and
    `udevadm control --reload`, for install's rule), through systemd's private socket; a line
    saying so. restart: units to restart where they run (`systemctl try-restart`): the start
    server, whose launcher this install changed, would otherwise serve the old code until it
    stops. Where systemd does not run the host, nothing to start: a line saying that. address,
    bus: another socket than systemd's (systemd_manager.manage's)."""
    import shutil

    from oci_gpu_hook.toolkit import systemd_manager as systemd

    if address is None and not os.path.isdir("/run/systemd/system"):  # sd_booted(3)'s test
        return [f"systemd does not run this host: {' '.join(units)} not started"]
    try:
        systemd.manage([("Reload", None)] + [("TryRestartUnit", unit) for unit in restart]
                       + [("StartUnit", unit) for unit in units], address, bus)  # fmt: skip
    except (systemd.SystemdError, OSError) as e:
        raise InstallError(f"systemd did not start {' '.join(units)}: {e}") from None
    lines = [f"restarted {' '.join(restart)} where it ran"] if restart else []
    lines.append(f"started {' '.join(units)} (systemd reloaded)")
    udevadm = shutil.which("udevadm")
    if udevadm is not None and address is None:
        import subprocess

        done = subprocess.run([udevadm, "control", "--reload"], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)  # fmt: skip
        lines.append("udev rules reloaded" if done.returncode == 0 else
                     f"udevadm control --reload failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")  # fmt: skip
    return lines


def _units_written(manifest: dict) -> list:
    """The units install wrote (the manifest's files in UNIT_DIR that are units, not links)."""
    return sorted(os.path.basename(path) for path, checksum in manifest.get("files", {}).items()
                  if os.path.dirname(path) == UNIT_DIR and not checksum.startswith("link:"))  # fmt: skip


def _manage_units(calls, said: str, address: str | None, bus: bool) -> list:
    """systemd_manager.manage(calls), and the line said; where systemd does not run the host, nothing."""
    from oci_gpu_hook.toolkit import systemd_manager as systemd

    if not calls:
        return []
    if address is None and not os.path.isdir("/run/systemd/system"):
        return []
    try:
        systemd.manage(calls, address, bus)
    except (systemd.SystemdError, OSError) as e:
        raise InstallError(f"systemd: {e}") from None
    return [said]


def _check_restart(root: str, restart: str) -> None:
    from oci_gpu_hook.toolkit import restart as restart_module

    if restart not in restart_module.MODES:
        raise InstallError(f"--restart {restart}: not one of {', '.join(restart_module.MODES)}")
    if restart != "none" and root != "/":
        raise InstallError(f"--restart: only when installing into / (a runtime runs from {root}?)")


def uninstall(root: str, restart: str = "none", stop_units: bool = False, address: str | None = None,
              bus: bool = False) -> list:  # fmt: skip
    """Remove what install wrote; restart: as install's, between removing what the runtimes read
    and the programs it names, so that a runtime never runs a hook it still has after its
    program is gone (containerd keeps its base spec until it restarts). stop_units: first stop
    the units install wrote (systemd would otherwise go on running them, a path unit starting
    a program that is gone), and reload systemd once they are removed; address, bus: as
    start_units's."""
    root = os.path.abspath(root)
    _check_restart(root, restart)
    if stop_units and root != "/":
        raise InstallError(f"--stop-units: only when uninstalling from / (not {root})")
    if not os.path.isdir(root):
        return []
    if stop_units:
        with _tree(root) as tree:
            units = _units_written(_read_manifest(tree))
        lines = _manage_units([("StopUnit", unit) for unit in units], f"stopped {' '.join(units)}", address, bus)
        lines += uninstall(root, restart)
        return lines + _manage_units([("Reload", None)], "systemd reloaded", address, bus)
    between = None
    if restart != "none":
        from oci_gpu_hook.toolkit import restart as restart_module

        def between(manifest: dict) -> list:
            lines = []
            for runtime in restart_module.changed(manifest, {}, RUNTIME_FILES):
                lines += restart_module.restart(runtime, restart)
            return lines

    with _locked(root), _tree(root) as tree:
        return _uninstall(tree, between)


def _restart_changed(root: str, before: dict, after: dict, mode: str) -> list:
    """Restart each runtime whose start-time files this install changed, and each one an earlier
    install changed and could not restart (the manifest's "restart": a runtime that did not
    restart then would otherwise never read what it was given, since a second install changes
    nothing). Each is recorded there before it is restarted, and cleared once it was."""
    from oci_gpu_hook.toolkit import restart as restart_module

    pending = [r for r in after.get("restart", []) if r in RUNTIME_FILES]
    due = restart_module.changed(before, after, RUNTIME_FILES)
    due += [r for r in pending if r not in due]
    if not due:
        return []
    with _tree(root) as tree:
        _record_pending_restarts(tree, due)
    lines = []
    for i, runtime in enumerate(due):
        lines += restart_module.restart(runtime, mode)
        with _tree(root) as tree:
            _record_pending_restarts(tree, due[i + 1 :])
    return lines


def _record_pending_restarts(tree: Tree, runtimes) -> None:
    manifest = _read_manifest(tree)
    if sorted(manifest.get("restart", [])) == sorted(runtimes):
        return
    if runtimes:
        manifest["restart"] = list(runtimes)
    else:
        manifest.pop("restart", None)
    _write_text(tree.entry(MANIFEST), json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _uninstall(tree: Tree, between=None) -> list:
    manifest_path = tree.entry(MANIFEST)
    if not os.path.lexists(manifest_path):
        return []
    manifest = _read_manifest(tree)
    # Each directory uninstall removes or moves entries in must be root's alone, as for install;
    # every place is resolved inside the tree there, before anything is removed.
    _check_destinations(tree, [Entry(p) for p in list(manifest["files"]) + list(manifest.get("saved", {}))
                               + list(manifest.get("edited", {}))], manifest["directories"])  # fmt: skip
    lines = []
    if manifest.get("selinux_module") is not None and tree.root == "/":
        # First: a module that cannot be removed leaves everything else as it was. A container
        # asking for gpu_container_t from here on is refused, as on a host without the module.
        lines += _remove_selinux_module(tree, manifest)
    # What names a program goes before the program (install wrote them the other way round), so
    # that no runtime, unit or pre-filter is ever left pointing at a program already gone: a
    # container started while uninstall runs gets the hook or no hook, never a missing program.
    files_ = sorted(manifest["files"].items(), key=lambda kv: kv[0], reverse=True)
    named = [kv for kv in files_ if kv[0] not in PROGRAMS_REMOVED_LAST]
    programs = sorted((kv for kv in files_ if kv[0] in PROGRAMS_REMOVED_LAST),
                      key=lambda kv: PROGRAMS_REMOVED_LAST.index(kv[0]))  # fmt: skip
    lines += _remove_unchanged(tree, named)
    for relative, line in sorted(manifest.get("edited", {}).items()):
        said = _unedit(tree.entry(relative), line)
        lines += [said] if said else []
    for relative, saved in sorted(manifest.get("saved", {}).items()):
        path, saved_path = tree.entry(relative), tree.entry(saved)
        if not os.path.lexists(saved_path):
            continue
        if os.path.lexists(path):
            lines.append(f"kept {saved_path}: {path} is still there (changed since install wrote it)")
            continue
        os.rename(saved_path, path)
        lines.append(f"restored {path}")
    if between is not None:
        lines += between(manifest)  # uninstall run again after a failure here removes the rest
    lines += _remove_unchanged(tree, programs)
    lines += _remove_bundles(tree, manifest.get("bundles", []))
    os.unlink(manifest_path)
    for relative in sorted(manifest["directories"], key=lambda p: p.count("/"), reverse=True):
        place = tree.entry(relative)  # a link there (install never made one) is not followed: ENOTDIR
        try:
            os.rmdir(place)
        except FileNotFoundError:
            pass
        except OSError as e:
            lines.append(f"kept {place}: {'not empty' if e.errno == errno.ENOTEMPTY else e.strerror}")
    return lines


def _remove_unchanged(tree: Tree, recorded) -> list:
    """Remove each (path, checksum) that still has the checksum install gave it."""
    lines = []
    for relative, checksum in recorded:
        path = tree.entry(relative)
        now = _current(path)
        if now is None:
            continue
        if now != checksum:
            lines.append(f"kept {path}: changed since install wrote it")
            continue
        os.unlink(path)
        lines.append(f"removed {path}")
    return lines


# ---- bundles (toolkit/bundle.py) -----------------------------------------------------------------


def place_bundle(root: str, source: str) -> list:
    """Copy the bundle at source (a directory named by its id) into root's BUNDLES_DIR, whole or
    not at all: copied beside its place into a directory of its own (mkdtemp: two placements at
    once never share one), checked to be that bundle (its digest, its launcher and pre-filter
    naming it), flushed to disk, then renamed into place. Recorded in the install manifest, with
    the directories made for it, so that uninstall removes them. A bundle already there under
    that id is checked the same way and kept. Python's bytecode (__pycache__) is not copied.
    What the cluster's toolkit does before it runs that bundle's install on the host."""
    import shutil
    import tempfile

    bundle_id = os.path.basename(os.path.normpath(source))
    why = not_the_bundle(source, bundle_id)
    if why:
        raise InstallError(f"{source}: not a whole bundle ({why})")
    root = os.path.abspath(root)
    with _locked(root), _tree(root) as tree:
        manifest = _read_manifest(tree)
        before = json.dumps(manifest, sort_keys=True)
        place = bundle.directory(bundle_id)
        _check_destinations(tree, [Entry(place)], [bundle.BUNDLES_DIR])
        lines = []
        try:
            _makedirs(tree, bundle.BUNDLES_DIR, manifest["directories"])
            final = tree.entry(place)
            if os.path.islink(final) or (os.path.lexists(final) and not_the_bundle(final, bundle_id)):
                raise InstallError(f"{final}: there, and not bundle {bundle_id}: remove it, then install again")
            if not os.path.lexists(final):
                spare = tempfile.mkdtemp(prefix=f".{bundle_id}.", dir=tree.entry(bundle.BUNDLES_DIR))
                try:
                    copy = os.path.join(spare, bundle_id)
                    shutil.copytree(source, copy, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
                    why = not_the_bundle(copy, bundle_id)
                    if why:
                        raise InstallError(f"{source}: copied to {copy}, and not whole there ({why})")
                    _flush(copy)  # every file on disk before the name that says the bundle is whole
                    os.rename(copy, final)
                    _flush_directory(os.path.dirname(final))
                finally:
                    shutil.rmtree(spare)
                lines.append(f"wrote {final}")
            if bundle_id not in manifest.setdefault("bundles", []):
                manifest["bundles"].append(bundle_id)
        finally:
            if json.dumps(manifest, sort_keys=True) != before:
                _makedirs(tree, os.path.dirname(MANIFEST), manifest["directories"])
                _write_text(tree.entry(MANIFEST), json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return lines


def not_the_bundle(top: str, bundle_id: str) -> str | None:
    """Why top is not the whole bundle bundle_id (None when it is): a name that is not an id, a
    digest that is not its name, a launcher or a pre-filter that do not run that bundle's own."""
    from oci_gpu_hook.toolkit import prefilter

    if not bundle.is_id(bundle_id):
        return f"{bundle_id!r} is not a bundle's id"
    if bundle.identity(top) != bundle_id:
        return "its files do not have the digest its name says"
    here = bundle.directory(bundle_id)
    if launcher.named(os.path.join(top, bundle.LAUNCHER)) != (f"{here}/{bundle.PYTHON}", f"{here}/{bundle.SITE}"):
        return f"its {bundle.LAUNCHER} is not that bundle's launcher"
    program = os.path.join(top, bundle.PREFILTER)
    if not prefilter.is_prefilter(program) or prefilter.runs(program) != f"{here}/{bundle.LAUNCHER}":
        return f"its {bundle.PREFILTER} is not a pre-filter running that bundle's launcher"
    return None


def _flush(top: str) -> None:
    """fsync every file and directory under top (itself included)."""
    for here, _, names in os.walk(top):
        for name in names:
            path = os.path.join(here, name)
            if not os.path.islink(path):
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _flush_directory(here)


def _flush_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _keep_bundles(tree: Tree, manifest: dict, running: str) -> list:
    """Record the bundle install runs from as the newest, and remove the recorded ones older than
    the BUNDLES_KEPT newest, except one that a process maps or that a file of install's still
    names (what runtimes run, or the start server's launcher, kept because an administrator
    changed it)."""
    bundles = [b for b in manifest.setdefault("bundles", []) if b != running] + [running]
    named = _bundles_named(tree)
    lines, kept = [], bundles[-BUNDLES_KEPT:]
    for old in bundles[:-BUNDLES_KEPT]:
        place = tree.entry(bundle.directory(old))
        users = _mapping(place)
        if users or old in named:
            kept.insert(0, old)
            lines.append(f"kept {place}: " + (f"in use by pid {users[0]}" if users else "a file of install's names it"))
            continue
        lines += _remove_bundle(tree, old)
    manifest["bundles"] = [b for b in bundles if b in kept]
    return lines


def _bundles_named(tree: Tree) -> set:
    """The ids of the bundles that what runtimes run (LAUNCHER's link) or the start server's
    launcher (its interpreter) lead into."""
    found = set()
    prefix = bundle.BUNDLES_DIR + "/"
    try:
        value = os.readlink(tree.entry(launcher.LAUNCHER))
        found.add(os.path.normpath(os.path.join(os.path.dirname(launcher.LAUNCHER), value)))
    except OSError:
        pass
    named = launcher.named(tree.entry(START_LAUNCHER))
    if named is not None:
        found.add(named[0])
    return {p[len(prefix) :].split("/")[0] for p in found if p.startswith(prefix)}


UNINSTALL_WAIT = 2 * HOOK_TIMEOUT  # seconds: a start that maps a bundle ends within the hook's timeout


def _remove_bundles(tree: Tree, bundle_ids) -> list:
    """Uninstall's last step: each recorded bundle, once no process but this one maps it (a start
    that began with it ends within the hook's timeout; waited for up to UNINSTALL_WAIT)."""
    import time

    lines = []
    deadline = time.monotonic() + UNINSTALL_WAIT
    for bundle_id in bundle_ids:
        place = tree.entry(bundle.directory(bundle_id))
        while True:
            users = [pid for pid in _mapping(place) if pid != os.getpid()]
            if not users or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if users:
            lines.append(f"kept {place}: in use by pid {users[0]} (remove it once that process ends)")
            continue
        lines += _remove_bundle(tree, bundle_id)
    return lines


def _mapping(place: str) -> list:
    """The pids of the processes that run from the bundle at place: whose program is its
    pre-filter, its python3 or its loader (which is the program of every process its python3
    starts). Compared by device and inode, through /proc/PID/exe, which leads to the file whatever
    mount namespace or root the process has: a path in /proc/PID/maps is written from the
    reader's view, and a start on the host is seen from the toolkit's pod."""
    from oci_gpu_hook.start import digits

    programs = set()
    candidates = [os.path.join(place, bundle.PREFILTER), os.path.join(place, bundle.PYTHON)]
    try:
        candidates += [os.path.join(place, bundle.LIBRARIES, n) for n in os.listdir(os.path.join(place,
                       bundle.LIBRARIES)) if n.startswith("ld-")]  # fmt: skip
    except OSError:
        pass
    for path in candidates:
        try:
            st = os.stat(path)
            programs.add((st.st_dev, st.st_ino))
        except OSError:
            continue
    found = []
    for pid in (p for p in os.listdir("/proc") if digits.is_decimal(p)):
        try:
            st = os.stat(f"/proc/{pid}/exe")
        except OSError:
            continue  # gone, a kernel thread, or not ours to look at
        if (st.st_dev, st.st_ino) in programs:
            found.append(int(pid))
    return found


def _remove_bundle(tree: Tree, bundle_id: str) -> list:
    """Remove a recorded bundle (rmtree never follows a link out of it)."""
    import shutil

    place = tree.entry(bundle.directory(bundle_id))
    if not os.path.lexists(place):
        return []
    if os.path.islink(place) or not os.path.isdir(place):
        return [f"kept {place}: not a directory, where install placed a bundle"]
    shutil.rmtree(place)
    return [f"removed {place}"]
