"""`oci-gpu-hook doctor`: is this host ready for GPU containers? One line per check, with a fix.

Each check is PASS, WARN or FAIL and stands alone: a broken host gives the FAIL that names what
is broken, and checks that depend on it say they were not run (WARN) instead of failing too.
Host facts come from the configured roots (driver_root, dev_root, proc_root), so a simulated host
is checked like a real one; installed files (hooks.d, CRI-O, systemd, SELinux store) are looked
up under `root` (/ unless --root says otherwise).
"""

from __future__ import annotations

import glob
import json
import os

from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.start import files
from oci_gpu_hook.start.digits import decimal, is_decimal
from oci_gpu_hook.start.inventory import host_path
from oci_gpu_hook.toolkit import launcher, runtime_config
from oci_gpu_hook.toolkit.runtime_config import ConfigFileError

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
ORDER = {PASS: 0, WARN: 1, FAIL: 2}
EXIT_STATUS = {PASS: 0, WARN: 1, FAIL: 2}
KEY_LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1")
PERSISTENCED_SOCKET = "/var/run/nvidia-persistenced/socket"
HOOK_FILE_NAME = "oci-gpu-hook.json"
REFRESH_SERVICE = "/etc/systemd/system/oci-gpu-hook-refresh.service"
SELINUX_BOOLEANS = ("container_use_xserver_devices", "container_use_devices")


class Check(Frozen):
    __slots__ = ("id", "status", "summary", "fix")
    _defaults = {"fix": None}
    id: str
    status: str
    summary: str
    fix: str | None


def worst(checks) -> str:
    return max((c.status for c in checks), key=ORDER.get, default=PASS)


class NotChecked(Exception):
    """A check that depends on something already reported broken."""


class Doctor:
    def __init__(self, settings, root: str = "/", config_error: str | None = None,
                 mountinfo: str = "/proc/self/mountinfo"):  # fmt: skip
        self.settings = settings
        self.root = os.path.abspath(root)
        self.config_error = config_error
        self.mountinfo = mountinfo
        self.selinuxfs = host_path(self.root, "/sys/fs/selinux")
        self._driver_version = None
        self._majors = None

    # --- shared facts ---------------------------------------------------------------------------

    def driver_version(self) -> str:
        from oci_gpu_hook.errors import InventoryError
        from oci_gpu_hook.start.discover import read_driver_version

        if self.config_error:
            raise NotChecked("not checked: the configuration is invalid")
        if self._driver_version is None:
            try:
                self._driver_version = read_driver_version(self.settings)
            except InventoryError:
                raise NotChecked("not checked: the NVIDIA driver is not loaded") from None
        return self._driver_version

    def majors(self) -> dict:
        from oci_gpu_hook.errors import InventoryError
        from oci_gpu_hook.start.discover import read_majors

        self.driver_version()
        if self._majors is None:
            try:
                self._majors = read_majors(self.settings)
            except InventoryError as e:
                raise NotChecked(f"not checked: {e}") from None
        return self._majors

    def ld_cache(self):
        from oci_gpu_hook.errors import InventoryError
        from oci_gpu_hook.start import ldcache

        if self.config_error:
            raise NotChecked("not checked: the configuration is invalid")
        path = host_path(self.settings.driver_root, "/etc/ld.so.cache")
        if not os.path.exists(path):
            return path, None
        try:
            return path, ldcache.read(path)
        except InventoryError:
            return path, None

    # --- the checks -----------------------------------------------------------------------------

    def run(self) -> list:
        checks = []
        for name in ("config", "driver", "uvm", "device_nodes", "persistence", "ldcache", "libraries",
                     "inventory_cache", "hooks_d", "rootless", "crio", "containerd", "docker", "cgroups", "selinux",
                     "selinux_policy", "refresh_units", "start_server", "exporter", "labels", "watchdog",
                     "device_plugin", "gates", "bundle"):  # fmt: skip
            check_id = name.replace("_", "-")
            try:
                status, summary, fix = getattr(self, f"check_{name}")()
            except NotChecked as e:
                status, summary, fix = WARN, str(e), None
            except runtime_config.TomlUnavailable as e:
                status, summary, fix = WARN, f"not checked: {e}", None
            if status != PASS and name in NODE_UNITS:
                summary += systemd_says(self.root, NODE_UNITS[name])
            checks.append(Check(check_id, status, summary, fix))
        return checks

    def check_config(self):
        if self.config_error:
            return FAIL, self.config_error, "correct the file (docs/configuration.md lists every key)"
        return PASS, f"configuration: {self.settings.source or 'built-in defaults'}", None

    def check_driver(self):
        from oci_gpu_hook.errors import InventoryError
        from oci_gpu_hook.start.discover import read_driver_version

        if self.config_error:
            raise NotChecked("not checked: the configuration is invalid")
        try:
            version = read_driver_version(self.settings)
        except InventoryError as e:
            return FAIL, f"NVIDIA driver: {e}", "install the driver and load it (modprobe nvidia)"
        return PASS, f"NVIDIA driver {version} is loaded", None

    def check_uvm(self):
        if "nvidia-uvm" in self.majors():
            return PASS, f"nvidia-uvm is loaded (major {self._majors['nvidia-uvm']})", None
        return (FAIL, "nvidia-uvm is not loaded (/proc/devices): CUDA containers cannot start",
                "nvidia-modprobe -u -c=0 (or modprobe nvidia-uvm)")  # fmt: skip

    def expected_nodes(self):
        """[(what, DeviceNode)] the hook would mount, checked against procfs's numbers."""
        from oci_gpu_hook.start import driver
        from oci_gpu_hook.start.discover import check_node, read_mig_devices, read_procfs_gpus

        majors = self.majors()
        dev = self.settings.dev_root
        nodes = [("nvidiactl", check_node(dev, "/dev/nvidiactl", driver.NVIDIA_MAJOR, driver.NVIDIACTL_MINOR))]
        if "nvidia-uvm" in majors:
            for name, minor in (("nvidia-uvm", driver.UVM_MINOR), ("nvidia-uvm-tools", driver.UVM_TOOLS_MINOR)):
                nodes.append((name, check_node(dev, f"/dev/{name}", majors["nvidia-uvm"], minor)))
        gpus = read_procfs_gpus(self.settings)
        for index, info in enumerate(gpus):
            minor = info["minor"]
            nodes.append((f"GPU {index}", check_node(dev, f"/dev/nvidia{minor}", driver.NVIDIA_MAJOR, minor)))
            for mig in read_mig_devices(self.settings, minor, majors.get("nvidia-caps"), None):
                nodes.append((f"MIG {index}:{mig.index}", mig.gi_cap))
                nodes.append((f"MIG {index}:{mig.index}", mig.ci_cap))
        return gpus, nodes

    def check_device_nodes(self):
        from oci_gpu_hook.errors import InventoryError

        try:
            gpus, nodes = self.expected_nodes()
        except InventoryError as e:
            return FAIL, f"device nodes: {e}", "reload the NVIDIA driver (or nvidia-modprobe) so procfs is complete"
        bad = [f"{node.path} ({what}) {node.problem}" for what, node in nodes if node.problem]
        if bad:
            more = f" and {len(bad) - 2} more" if len(bad) > 2 else ""
            return (FAIL, f"device nodes do not match /proc: {'; '.join(bad[:2])}{more}",
                    "recreate them: nvidia-modprobe -c <minor> (or the driver's udev rules); "
                    "a node with wrong numbers must be removed first")  # fmt: skip
        if not gpus:
            return WARN, "the driver lists no GPUs in /proc/driver/nvidia/gpus", "check lspci and dmesg for the GPUs"
        return PASS, f"{len(nodes)} device nodes match /proc ({len(gpus)} GPU(s))", None

    def check_persistence(self):
        self.driver_version()
        if os.path.exists(host_path(self.settings.driver_root, PERSISTENCED_SOCKET)):
            return PASS, "nvidia-persistenced is running (persistence mode)", None
        return (WARN, "nvidia-persistenced is not running: every GPU container start re-initialises the GPUs "
                "(seconds each)", "systemctl enable --now nvidia-persistenced")  # fmt: skip

    def check_ldcache(self):
        path, entries = self.ld_cache()
        fix = "run ldconfig on the host (the driver installer should have)"
        if entries is None:
            return FAIL, f"{path}: missing or unreadable", fix
        names = {e.name for e in entries if e.word_size == 64}
        missing = [name for name in KEY_LIBRARIES if name not in names]
        if missing:
            return FAIL, f"{path} lacks the driver libraries {', '.join(missing)}", fix
        return PASS, f"{path} lists the driver libraries", None

    def check_libraries(self):
        from oci_gpu_hook.start import driver

        version = self.driver_version()
        path, entries = self.ld_cache()
        if entries is None:
            raise NotChecked("not checked: no ld.so.cache")
        prefixes = {p for names in driver.LIBRARIES.values() for p in names}
        found = {}
        for entry in entries:
            prefix = entry.name.split(".so", 1)[0] + ".so"
            if prefix not in prefixes or entry.word_size != 64 or entry.name in found:
                continue
            real = os.path.basename(os.path.realpath(host_path(self.settings.driver_root, entry.path)))
            found[entry.name] = real[len(prefix) + 1 :] if real.startswith(prefix + ".") else "unknown"
        wrong = sorted(f"{name} is {v}" for name, v in found.items() if v != version)
        if wrong:
            key = [w for w in wrong if w.split(" ")[0] in KEY_LIBRARIES] or wrong
            return (FAIL, f"driver/library version mismatch: {'; '.join(key[:2])}, the kernel driver is {version}",
                    "install the driver's user-space libraries of the loaded module's version, or reboot into "
                    "the module that matches them")  # fmt: skip
        if not found:
            raise NotChecked("not checked: ld.so.cache lists no driver libraries")
        return PASS, f"{len(found)} driver libraries match the kernel driver {version}", None

    def check_inventory_cache(self):
        from oci_gpu_hook.start import inventory_cache
        from oci_gpu_hook.start.settings import read_trusted

        self.driver_version()
        path = self.settings.inventory_cache
        fix = "oci-gpu-hook inventory refresh"
        try:
            # As the hook reads it: a cache the hook would ignore is no cache.
            doc = json.loads(read_trusted(path, inventory_cache.MAX_BYTES))
        except FileNotFoundError:
            return WARN, f"{path}: no inventory cache yet (the first GPU container builds it)", fix
        except OSError as e:  # ELOOP: a symbolic link, which the hook does not follow
            return FAIL, f"{path}: unreadable inventory cache ({e.strerror}; the hook rediscovers every time)", fix
        except ValueError as e:
            return FAIL, f"{path}: unusable inventory cache ({e}; the hook rediscovers every time)", fix
        if not isinstance(doc, dict) or doc.get("format") != inventory_cache.FORMAT:
            return FAIL, f"{path}: not an inventory cache of this version", fix
        if doc.get("fingerprint") != inventory_cache.fingerprint(self.settings):
            return (FAIL, f"{path}: stale: the driver, GPUs, device nodes or ld.so.cache changed since it was "
                    "written (the next GPU container pays for rebuilding it)", fix)  # fmt: skip
        error = (doc.get("inventory") or {}).get("nvml_error")
        if error:
            from oci_gpu_hook.errors import printable
            from oci_gpu_hook.start.nvml import advice

            return (WARN, f"{path}: built while NVML failed ({printable(str(error))}): containers get their GPUs, "
                    "but requirements on the CUDA version or brand hold unchecked, and MIG devices cannot be "
                    "named by UUID", f"{advice(str(error))}; then {fix}")  # fmt: skip
        return PASS, f"{path} is fresh", None

    def hooks_d_file(self):
        """(path of the file podman would use, the directories it reads). ConfigFileError when
        containers.conf cannot be read as podman reads it. On the host itself, the podman
        installed is asked (runtime_config.podman_effective_hooks_dirs: its version's files and
        default, as it merges them); under --root, or with no podman, its files are read."""
        try:
            if self.root != "/":
                raise runtime_config.PodmanUnavailable("a tree")
            dirs = runtime_config.podman_effective_hooks_dirs()
        except runtime_config.PodmanUnavailable:
            dirs, _ = runtime_config.podman_hooks_dirs(self.root)
        for directory in reversed(dirs):  # a later directory masks an earlier one
            path = host_path(self.root, f"{directory}/{HOOK_FILE_NAME}")
            if os.path.lexists(path):
                return path, directory, dirs
        return None, None, dirs

    def check_hooks_d(self):
        try:
            path, _, dirs = self.hooks_d_file()
        except ConfigFileError as e:
            return FAIL, f"{e} (podman cannot read its configuration)", "correct the file"
        fix = "oci-gpu-hook install"
        if path is None:
            where = ", ".join(dirs)
            return (FAIL, f"no hooks.d file {HOOK_FILE_NAME} in {where or 'no directory'} (the hooks directories "
                    "podman reads): podman never runs the hook", "oci-gpu-hook install --runtime podman")  # fmt: skip
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            return FAIL, f"{path}: unreadable ({e})", fix
        import jsonschema

        from oci_gpu_hook.start.settings import SCHEMAS_DIR

        with open(os.path.join(SCHEMAS_DIR, "oci-hooks.schema.json")) as f:
            schema = json.load(f)
        error = next(iter(jsonschema.Draft7Validator(schema).iter_errors(doc)), None)
        if error is not None:
            return FAIL, f"{path}: not a valid hooks.d file: {error.message}", fix
        hook = doc["hook"]["path"]
        if not (os.access(host_path(self.root, hook), os.X_OK) or (self.root != "/" and os.access(hook, os.X_OK))):
            return FAIL, f"{path}: the hook {hook} is not an executable (runtimes ignore the file)", fix
        if "prestart" not in doc["hook"].get("args", []) or "prestart" not in doc["stages"]:
            return FAIL, f"{path}: does not run `oci-gpu-hook prestart` at prestart", fix
        return (PASS, f"{path} runs {hook} at prestart (podman reads hooks from {', '.join(dirs)}; CRI-O runs it at "
                "createRuntime, the same moment)", None)  # fmt: skip

    def check_rootless(self):
        """Rootless podman runs the hook as the user who runs podman (docs/toolkit.md): the hook's
        program, what it starts and its configuration must be open to every user, or that user's
        GPU containers fail to start. Asked of the kernel, not of file modes: the hook is started
        as uid 65534 (no groups) on a container that asks for no GPU, as runc starts it."""
        users = subordinate_users(host_path(self.root, "/etc/subuid"))
        if not users:
            return PASS, "no user has subordinate uids (/etc/subuid): no rootless podman containers here", None
        if self.root != "/":
            raise NotChecked("not checked: under --root (a user runs the hook only on this host)")
        try:
            path = self.hooks_d_file()[0]
            with open(path) as f:
                hook = json.load(f)["hook"]
            argv, env = [hook["path"], *hook.get("args", [])[1:]], hook.get("env", [])
        except (ConfigFileError, OSError, ValueError, TypeError, KeyError):
            raise NotChecked("not checked: podman runs no valid hook (see hooks-d)") from None
        who = f"rootless podman containers ({', '.join(users[:3])}{', ...' if len(users) > 3 else ''})"
        fix = ("install the package where every user may read it (pip install as root outside a 0700 "
               "directory), then oci-gpu-hook install --runtime podman")  # fmt: skip
        closed = [p for p in (path, self.settings.source) if p and closed_to_others(p)]
        if closed:
            where = closed_to_others(closed[0])
            return FAIL, f"{who} get no GPU: {where} is closed to other users, and podman reads {closed[0]}", fix
        programs = [argv]
        python = argv[0] + "-python"  # the compiled pre-filter starts this launcher (install.launcher_entries)
        if not launcher.is_launcher(argv[0]) and launcher.is_launcher(python):
            programs.append([python, *argv[1:]])
        for program in programs:
            problem = runs_as_nobody(program, env)
            if problem:
                # Which directory is in the way, where the launcher says what it starts.
                targets = launcher.named(program[0]) or ()
                where = next(filter(None, (closed_to_others(t) for t in targets)), None)
                problem += f" ({where} is closed to other users)" if where else ""
                return FAIL, f"{who} get no GPU: as uid {NOBODY} (no groups), {program[0]} {problem}", fix
        return PASS, f"{who}: the hook starts as uid {NOBODY} (no groups), as a user's podman starts it", None

    def check_crio(self):
        crio_dir, crio = host_path(self.root, "/etc/crio"), host_path(self.root, "/usr/bin/crio")
        if not (os.path.isdir(crio_dir) or os.path.exists(crio)):
            return PASS, "CRI-O is not installed: nothing to check", None
        try:
            dirs, source = runtime_config.crio_hooks_dirs(self.root)
        except ConfigFileError as e:
            return (FAIL, f"{e} (CRI-O cannot read its configuration)",
                    "correct the file, then systemctl restart crio")  # fmt: skip
        where = f"hooks_dir in {source}" if source else "its default"
        read = f"CRI-O reads hooks from {', '.join(dirs) or 'no directory'} ({where})"
        present = [d for d in dirs if os.path.lexists(host_path(self.root, f"{d}/{HOOK_FILE_NAME}"))]
        if not present:
            return (FAIL, f"{read}; none of them holds {HOOK_FILE_NAME}",
                    "oci-gpu-hook install --runtime crio, then systemctl restart crio")  # fmt: skip
        return PASS, f"{read}; {present[-1]}/{HOOK_FILE_NAME} is among them, run at createRuntime", None

    def check_containerd(self):
        from oci_gpu_hook.toolkit import containerd

        if not (os.path.isdir(host_path(self.root, "/etc/containerd"))
                or os.path.exists(host_path(self.root, "/usr/bin/containerd"))):  # fmt: skip
            return PASS, "containerd is not installed: nothing to check", None
        return containerd.hook_verdict(self.root)

    def docker_program(self) -> str | None:
        """The nvidia-container-runtime-hook dockerd runs for `--gpus`: the first on its PATH
        (DOCKER_PATH); None where there is none."""
        from oci_gpu_hook.toolkit.install import DOCKER_HOOK

        candidates = (f"{d}/{os.path.basename(DOCKER_HOOK)}" for d in DOCKER_PATH)
        return next((p for p in candidates if os.path.lexists(host_path(self.root, p))), None)

    def docker_installed(self) -> bool:
        return any(os.path.exists(host_path(self.root, f"{d}/dockerd")) for d in DOCKER_PATH)

    def check_docker(self):
        from oci_gpu_hook.toolkit.install import DOCKER_HOOK_MARKER

        if not self.docker_installed():
            return PASS, "Docker is not installed: nothing to check", None
        fix = "oci-gpu-hook install --runtime docker, then systemctl restart docker"
        path = self.docker_program()
        if path is None:
            return WARN, "no nvidia-container-runtime-hook on dockerd's PATH: `docker run --gpus` fails", fix
        if not os.access(host_path(self.root, path), os.X_OK):
            return FAIL, f"{path} is not executable: `docker run --gpus` fails", fix
        try:
            head = files.read_bounded(host_path(self.root, path), 4096)
        except OSError as e:
            return FAIL, f"{path}: unreadable ({e.strerror})", fix
        if DOCKER_HOOK_MARKER.encode() in head:
            return PASS, f"{path} runs oci-gpu-hook for `docker run --gpus` (restart dockerd after installing it)", None
        # install's pre-filter in the program's place: it is ours when the launcher it runs is.
        from oci_gpu_hook.toolkit import prefilter

        hands_to = prefilter.runs(host_path(self.root, path))
        if hands_to is None:
            replace = "oci-gpu-hook install --runtime docker --replace-nvidia-hook, then systemctl restart docker"
            return WARN, f"{path} is not oci-gpu-hook's (NVIDIA's?): `docker run --gpus` runs that", replace
        try:
            behind = files.read_bounded(host_path(self.root, hands_to), 4096)
        except OSError as e:
            return FAIL, f"{path} is oci-gpu-hook's pre-filter, and {hands_to}, which it runs, is unreadable " \
                         f"({e.strerror}): `docker run --gpus` fails", fix  # fmt: skip
        if DOCKER_HOOK_MARKER.encode() not in behind or not os.access(host_path(self.root, hands_to), os.X_OK):
            return FAIL, f"{path} is oci-gpu-hook's pre-filter, and {hands_to}, which it runs, is not the launcher " \
                         "install writes for it: `docker run --gpus` fails", fix  # fmt: skip
        return PASS, (f"{path} runs oci-gpu-hook for `docker run --gpus` (the pre-filter, then {hands_to}; restart "
                      "dockerd after installing it)"), None  # fmt: skip

    def check_start_server(self):
        """Where install --start-server (or the RPM's units) set it up: it answers on its socket,
        serves the code that is installed (not a version that kept running through an upgrade),
        and the pre-filters runtimes run (the hooks.d file's hook, and Docker's program where it is
        oci-gpu-hook's) offer it starts with that code's identity. Then, as warnings: what systemd
        says of its units (start_units_say), and the starts that fell back to Python since it
        started, by its own counts (fallbacks). Asking starts the server where systemd listens
        for it, as the next GPU start would."""
        from oci_gpu_hook.start import prefilter_rule, server
        from oci_gpu_hook.toolkit.install import PACKAGE_UNIT_DIR, START_SERVICE, START_SOCKET, UNIT_DIR

        units = [host_path(self.root, f"{d}/{START_SOCKET}") for d in (UNIT_DIR, PACKAGE_UNIT_DIR)]
        if not any(os.path.exists(u) for u in units):
            return PASS, "the start server is not installed (install --start-server): GPU starts run in Python", None
        enabled = os.path.lexists(host_path(self.root, f"{UNIT_DIR}/sockets.target.wants/{START_SOCKET}"))
        if not enabled:
            return (PASS, "the start server's units are installed, not enabled: GPU starts run in Python",
                    f"systemctl enable --now {START_SOCKET}")  # fmt: skip
        if self.root != "/":
            return PASS, f"the start server is enabled ({START_SOCKET}); not asked under --root", None
        installed = server.code_identity()
        restart = f"systemctl restart {START_SERVICE}"
        try:
            status = server.ask_status(prefilter_rule.START_SERVER_SOCKET)
        except OSError as e:
            summary = (f"the start server does not answer on {prefilter_rule.START_SERVER_SOCKET} ({e.strerror or e}): "
                       "every GPU start runs in Python")  # fmt: skip
            units_say = self.start_units_say()
            if units_say:
                return WARN, f"{summary}; {'; '.join(s for s, _ in units_say)}", units_say[0][1]
            return (WARN, f"{summary}{systemd_says(self.root, START_SERVICE)}",
                    f"systemctl start {START_SOCKET}; journalctl -u {START_SERVICE} says why")  # fmt: skip
        serving = status["identity"]
        if serving != installed:
            return (FAIL, f"the start server runs code {serving}, not the installed {installed} (an upgrade since it "
                    "started): it takes no start, and each runs in Python", restart)  # fmt: skip
        serves = _serves(installed)
        verdicts = self.offering_programs(installed)
        failed = next((v for _, v in verdicts if v[0] == FAIL), None)
        if failed is not None:
            return failed
        offered = [program for program, v in verdicts if v[0] == PASS]
        warnings = [v[1:] for _, v in verdicts if v[0] == WARN]
        if not verdicts:
            return (WARN, f"{serves}; no hooks.d file names a hook, and Docker's program is not oci-gpu-hook's",
                    OFFER_FIX)  # fmt: skip
        warnings += self.start_units_say()
        fell_back = fallbacks(status)
        if fell_back:
            warnings.append((fell_back, f"journalctl -u {START_SERVICE} says why (its `taken too late` and "
                                        "`cannot fork` lines)"))  # fmt: skip
        if warnings:
            fixes = dict.fromkeys(fix for _, fix in warnings)
            return WARN, f"{serves}; {'; '.join(s for s, _ in warnings)}", "; ".join(fixes)
        since = ""
        if "served" in status and "up" in status:
            since = f"; since it started {status['up']} s ago it served {status['served']} start(s)"
        offers = "offers" if len(offered) == 1 else "offer"
        return PASS, f"{serves}, and {' and '.join(offered)} {offers} it every GPU start{since}", None

    def offering_programs(self, installed: str) -> list:
        """[(program, (status, summary, fix))] for each pre-filter that should offer the start
        server, which serves the installed code, its starts: the hook the hooks.d file names, and
        Docker's program where it is oci-gpu-hook's (the pre-filter, or the launcher, which offers
        none). FAIL for one that offers no start, or offers as another version or code (an install
        from before an upgrade): its starts all run in Python. Docker's launcher alone is a WARN:
        `docker run --gpus` works, from Python, as install wrote it without the start server."""
        from oci_gpu_hook.start import server
        from oci_gpu_hook.toolkit import prefilter
        from oci_gpu_hook.toolkit.install import DOCKER_HOOK_MARKER

        programs = []
        try:
            path, _, _ = self.hooks_d_file()
        except ConfigFileError:
            path = None
        if path is not None:
            try:
                with open(path) as f:
                    programs.append((json.load(f)["hook"]["path"], False))
            except (OSError, ValueError, KeyError, TypeError):
                pass
        docker = self.docker_program() if self.docker_installed() else None
        if docker is not None:
            try:
                marked = DOCKER_HOOK_MARKER.encode() in files.read_bounded(host_path(self.root, docker), 4096)
            except OSError:
                marked = False
            if marked or prefilter.runs(host_path(self.root, docker)) is not None:
                programs.append((docker, True))
        wanted = server.version_line(installed)
        found = []
        for program, dockers in programs:
            offers = prefilter.offers_as(host_path(self.root, program))
            named = f"{program} (Docker's program)" if dockers else program
            if offers is None and dockers:
                verdict = WARN, f"{named} offers it no start: `docker run --gpus` starts in Python", DOCKER_OFFER_FIX
            elif offers is None:
                verdict = FAIL, f"{_serves(installed)}, but {named} offers it no start", OFFER_FIX
            elif offers != wanted:
                verdict = (FAIL, f"{named} offers starts as {offers!r}, the server takes {wanted!r}: each start runs "
                           "in Python", OFFER_FIX)  # fmt: skip
            else:
                verdict = PASS, "", None
            found.append((named, verdict))
        return found

    def start_units_say(self) -> list:
        """start_units_say() of the units as the running systemd has them ([] where it cannot be asked)."""
        from oci_gpu_hook.toolkit.install import START_SERVICE, START_SOCKET

        return start_units_say(unit_state(self.root, START_SOCKET), unit_state(self.root, START_SERVICE))

    def check_exporter(self):
        """Runs: its /metrics answers at the configured address."""
        import urllib.request

        from oci_gpu_hook.node.exporter import parse_listen
        from oci_gpu_hook.toolkit.install import EXPORTER_SERVICE

        if not _node_unit_installed(self.root, EXPORTER_SERVICE):
            return PASS, "the exporter is not installed (install --node-services): nothing to check", None
        listen = self.settings.node.exporter_listen
        host, port = parse_listen(listen)
        host = host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/metrics"
        fix = f"systemctl start {EXPORTER_SERVICE}; journalctl -u {EXPORTER_SERVICE} says why it stopped"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read(1 << 22).decode(errors="replace")
        except OSError as e:
            return FAIL, f"the exporter does not answer at {url}: {getattr(e, 'reason', e)}", fix
        if "oci_gpu_hook_gpu_facts_stale 1" in text.splitlines():
            return WARN, f"the exporter answers at {url}, but NVML fails: its GPU facts are stale", fix
        return PASS, f"the exporter answers at {url}", None

    def check_labels(self):
        """Runs: the feature file holds the labels of the host as it is now."""
        from oci_gpu_hook.errors import HookError
        from oci_gpu_hook.node import features
        from oci_gpu_hook.start import inventory_cache
        from oci_gpu_hook.toolkit.install import LABELS_SERVICE

        if not _node_unit_installed(self.root, LABELS_SERVICE):
            return PASS, "the NFD labels are not installed (install --node-services): nothing to check", None
        if self.config_error:
            raise NotChecked("not checked: the configuration is invalid")
        path = self.settings.node.features_file
        fix = f"systemctl start {LABELS_SERVICE}; journalctl -u {LABELS_SERVICE} says why it stopped"
        try:
            wanted = features.render(features.for_node(self.settings, inventory_cache.load(self.settings)))
        except HookError as e:
            return FAIL, f"no labels can be made: {e.message}", fix
        try:
            with open(path) as f:
                current = f.read()
        except OSError as e:
            return FAIL, f"{path}: {e.strerror}: NFD gets no GPU labels", fix
        if current != wanted:
            return WARN, f"{path} does not describe the host as it is now (is the labels service running?)", fix
        return PASS, f"{path} holds the node's {len(wanted.splitlines())} GPU labels", None

    def check_watchdog(self):
        """Runs: a process of this program's watchdog command is there."""
        from oci_gpu_hook.toolkit.install import WATCHDOG_SERVICE

        if not _node_unit_installed(self.root, WATCHDOG_SERVICE):
            return PASS, "the watchdog is not installed (install --node-services): nothing to check", None
        running = service_processes("watchdog")
        if not running:
            return (
                FAIL,
                "the watchdog is not running: GPU memory limits are not enforced",
                (f"systemctl start {WATCHDOG_SERVICE}; journalctl -u {WATCHDOG_SERVICE} says why it stopped"),
            )
        return PASS, f"the watchdog runs (pid {', '.join(map(str, running))})", None

    def check_bundle(self):
        """Where install ran from a bundle (what runtimes run is a link into one): that bundle is
        there and whole, and the install manifest records it."""
        from oci_gpu_hook.toolkit import bundle, install, launcher

        link = host_path(self.root, launcher.LAUNCHER)
        try:
            value = os.readlink(link)
        except OSError:
            return PASS, "not installed from a bundle: nothing to check", None
        target = os.path.normpath(os.path.join(os.path.dirname(launcher.LAUNCHER), value))
        fix = "oci-gpu-hook toolkit install again (the node image's pod does it when it starts)"
        if not target.startswith(bundle.BUNDLES_DIR + "/"):
            return FAIL, f"{link} leads to {target}, not into a bundle in {bundle.BUNDLES_DIR}", fix
        bundle_id = target[len(bundle.BUNDLES_DIR) + 1 :].split("/")[0]
        top = host_path(self.root, bundle.directory(bundle_id))
        if not os.path.isdir(top):
            return FAIL, f"{link} leads into bundle {bundle_id}, which is not there: no start can run the hook", fix
        try:
            why = install.not_the_bundle(top, bundle_id)
        except (bundle.BundleError, OSError) as e:  # a FIFO, a device node, an unreadable file in it
            why = str(e)
        if why:
            return FAIL, f"{top}: not the whole bundle {bundle_id} ({why})", fix
        try:
            with open(host_path(self.root, install.MANIFEST)) as f:
                manifest = json.load(f)
            recorded = manifest.get("bundles", []) if isinstance(manifest, dict) else []
        except (OSError, ValueError):
            recorded = []
        if bundle_id not in recorded:
            return WARN, f"bundle {bundle_id} is not in {install.MANIFEST}: uninstall would leave it", fix
        return PASS, f"runtimes run bundle {bundle_id}, whole ({len(recorded)} bundle(s) recorded)", None

    def check_gates(self):
        """The validation gates' verdicts (node/gates.py), where a rollout wrote them: the first
        failed gate's line and fix, as the device plugin withdraws the node's GPUs for it."""
        from oci_gpu_hook.node import gates

        if self.config_error:
            raise NotChecked("not checked: the configuration is invalid")
        path = gates.gates_path(self.settings.records_path)
        if not os.path.lexists(path):
            return PASS, f"no validation gates on this node ({path}): nothing to check", None
        try:
            verdicts = gates.read(path)
        except ValueError as e:
            return (FAIL, f"the validation gates' verdicts cannot be trusted: {e}",
                    f"remove {path}; the rollout writes it again")  # fmt: skip
        failed = next((name for name in gates.ORDER if verdicts[name]["state"] == "failed"), None)
        if failed is not None:  # whatever came before it: the device plugin withdraws the GPUs for it
            v = verdicts[failed]
            return FAIL, f"gate {failed} failed: {v['why'] or 'no reason given'}", v["fix"]
        for name in gates.ORDER:
            if verdicts[name]["state"] == "pending":
                later = gates.ORDER[gates.ORDER.index(name) :]
                return (
                    WARN,
                    f"gates pending: {', '.join(later)} (the device plugin offers GPUs once toolkit passed)",
                    None,
                )
        return PASS, f"gates passed: {', '.join(gates.ORDER)}", None

    def check_device_plugin(self):
        """Runs, with a configuration that fits this node and the hook's settings, and serves a
        socket in the kubelet's directory for each resource it offers."""
        from oci_gpu_hook.errors import HookError
        from oci_gpu_hook.node.plugin import config as plugin_config
        from oci_gpu_hook.node.plugin import resources as plugin_resources
        from oci_gpu_hook.node.plugin.server import socket_name
        from oci_gpu_hook.start import inventory_cache
        from oci_gpu_hook.toolkit.install import DEVICE_PLUGIN_SERVICE

        if not _node_unit_installed(self.root, DEVICE_PLUGIN_SERVICE):
            return PASS, "the device plugin is not installed (install --device-plugin): nothing to check", None
        if self.config_error:
            raise NotChecked("not checked: the configuration is invalid")
        node = self.settings.node
        fix = f"systemctl start {DEVICE_PLUGIN_SERVICE}; journalctl -u {DEVICE_PLUGIN_SERVICE} says why it stopped"
        try:
            config = plugin_config.load(node.device_plugin_config, node)
            resources = plugin_resources.resources(inventory_cache.load(self.settings), config,
                                                   node.device_plugin_config or "node settings")  # fmt: skip
        except HookError as e:
            return FAIL, f"the device plugin cannot start: {e.message}", "fix node.device_plugin_config"
        # What the hook needs to read each answer (pods are unprivileged). CDI answers are the
        # runtime's to apply (CRI-O, containerd 1.7+), so they need no hook setting.
        off = []
        if "volume-mounts" in config.list_strategies and not self.settings.accept_volume_mounts:
            off.append("accept_volume_mounts is false (volume-mounts)")
        if config.list_strategies == ("envvar",) and not self.settings.accept_envvar_when_unprivileged:
            off.append("accept_envvar_when_unprivileged is false (envvar)")
        if off:
            return (FAIL, f"the device plugin answers Allocate with {', '.join(config.list_strategies)}, but the "
                          f"hook's {'; '.join(off)}: pods would not get their GPUs",
                    "change flags.plugin.deviceListStrategy or the hook's setting")  # fmt: skip
        if not service_processes("device-plugin"):
            return FAIL, "the device plugin is not running: the kubelet offers no GPUs", fix
        missing = [
            r.name for r in resources if not os.path.exists(os.path.join(node.kubelet_socket_dir, socket_name(r.name)))
        ]
        if missing:
            return (
                WARN,
                f"the device plugin runs but serves no socket for {', '.join(missing)} (is the kubelet up?)",
                fix,
            )
        return PASS, f"the device plugin offers {', '.join(r.name for r in resources)} to the kubelet", None

    def check_cgroups(self):
        if self.config_error:
            raise NotChecked("not checked: the configuration is invalid")
        try:
            with open(self.mountinfo) as f:
                text = f.read()
        except OSError as e:
            return WARN, f"{self.mountinfo}: {e.strerror}", None
        from oci_gpu_hook.start.linux.cgroups import mounted_hierarchies

        v1_devices, v2 = mounted_hierarchies(text)
        host = "v1" if v1_devices else ("v2" if v2 else "none")
        shown = {"v1": "cgroup v1 devices controller" + (" (hybrid)" if v2 else ""), "v2": "cgroup v2 (unified)",
                 "none": "no device cgroup"}[host]  # fmt: skip
        wanted = self.settings.cgroups
        if wanted == "off":
            return (
                WARN,
                f"{shown}; cgroups: off: the hook grants no device access (right only for rootless "
                "or when something else allows the GPU nodes)",
                "set cgroups: auto for rootful containers",
            )
        if host == "none":
            return FAIL, "no device cgroup is mounted: the hook cannot grant device access", "set cgroups: off"
        mode = host if wanted == "auto" else wanted
        if mode != host:
            return (FAIL, f"cgroups: {wanted} is configured but the host has the {shown}: device access would be "
                    "granted where runc does not look", "set cgroups: auto")  # fmt: skip
        if mode == "v2" and os.geteuid() != 0:
            return WARN, f"{shown}: eBPF device programs need root", "run the runtime (and the hook) as root"
        how = "devices.allow" if mode == "v1" else "eBPF device programs"
        return PASS, f"{shown}: the hook manages device access ({how})", None

    def selinux_mode(self) -> str:
        from oci_gpu_hook.start.linux import labels

        if not labels.selinux_enabled():
            return "disabled"
        try:
            with open(os.path.join(self.selinuxfs, "enforce")) as f:
                return "enforcing" if f.read().strip() == "1" else "permissive"
        except OSError:
            return "enforcing"

    def check_selinux(self):
        mode = self.selinux_mode()
        if mode == "disabled":
            return PASS, "SELinux is disabled: nothing to check", None
        if mode == "permissive":
            return (WARN, "SELinux is permissive: denials are logged, not enforced",
                    "check GPU containers work, then setenforce 1 (and SELINUX=enforcing)")  # fmt: skip
        return PASS, "SELinux is enforcing", None

    def check_selinux_policy(self):
        mode = self.selinux_mode()
        if mode == "disabled":
            return PASS, "SELinux is disabled: no policy needed", None
        module = glob.glob(host_path(self.root, "/var/lib/selinux/*/active/modules/*/oci_gpu_hook"))
        on = []
        for name in SELINUX_BOOLEANS:
            try:
                with open(os.path.join(self.selinuxfs, "booleans", name)) as f:
                    if f.read().split()[:1] == ["1"]:
                        on.append(name)
            except OSError:
                pass
        if module:
            return PASS, "the oci_gpu_hook module is installed (run GPU containers as gpu_container_t)", None
        if on:
            return PASS, f"boolean {on[0]} is on: confined containers may use the GPU nodes", None
        status = FAIL if mode == "enforcing" else WARN
        return (status, "neither the oci_gpu_hook module nor a container device boolean: confined containers "
                "cannot open /dev/nvidia*", "dnf install oci-gpu-hook-selinux (label=type:gpu_container_t), or "
                "setsebool -P container_use_xserver_devices on")  # fmt: skip

    def check_refresh_units(self):
        if os.path.exists(host_path(self.root, REFRESH_SERVICE)):
            from oci_gpu_hook.toolkit.install import PATH_UNIT, SERVICE

            path, service = unit_state(self.root, PATH_UNIT), unit_state(self.root, SERVICE)
            if path is None:  # no systemd to ask (a container, a chroot, --root)
                return PASS, "the inventory refresh units are installed", None
            if path["ActiveState"] != "active":
                return (WARN, f"the inventory refresh units are installed, but systemd has {PATH_UNIT} "
                        f"{path['ActiveState']} ({path['SubState']}): a driver change does not refresh the cache",
                        f"systemctl daemon-reload && systemctl enable --now {PATH_UNIT}")  # fmt: skip
            if service and service["Result"] not in ("success", ""):
                return (WARN, f"the last inventory refresh failed ({SERVICE}: {service['Result']})",
                        f"journalctl -u {SERVICE} says why")  # fmt: skip
            return (PASS, f"the inventory refresh units are installed; systemd watches /etc/ld.so.cache ({PATH_UNIT} "
                    "active)", None)  # fmt: skip
        return (WARN, "no oci-gpu-hook-refresh.service: the first GPU container after a driver change rebuilds "
                "the cache", "oci-gpu-hook install")  # fmt: skip


# The checks of the node services, and their units (install.py's names): a failing one says what
# systemd says of its unit.
NODE_UNITS = {name: f"oci-gpu-hook-{name.replace('_', '-')}.service"
              for name in ("exporter", "labels", "watchdog", "device_plugin")}  # fmt: skip
UNIT_PROPERTIES = ("LoadState", "ActiveState", "SubState", "Result", "NRestarts")


def unit_state(root: str, unit: str) -> dict | None:
    """{property: value} of UNIT_PROPERTIES as the running systemd has them, or None where there is
    no systemd to ask: a --root other than /, a host whose PID 1 is not systemd (no
    /run/systemd/system), no systemctl, or no answer in 10 s."""
    import shutil
    import subprocess

    systemctl = shutil.which("systemctl")
    if os.path.realpath(root) != "/" or not os.path.isdir("/run/systemd/system") or not systemctl:
        return None
    try:
        done = subprocess.run([systemctl, "show", "--property=" + ",".join(UNIT_PROPERTIES), "--", unit],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    state = dict.fromkeys(UNIT_PROPERTIES, "")
    state.update(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return state


def _serves(installed: str) -> str:
    return f"the start server serves the installed code ({installed})"


OFFER_FIX = "oci-gpu-hook install --start-server (builds the pre-filter for the installed code)"
DOCKER_OFFER_FIX = "oci-gpu-hook install --runtime docker --start-server, then systemctl restart docker"
# A start server service's Result that says why its last run ended, where that is worth a warning.
START_SERVICE_RESULTS = {"watchdog": "systemd's watchdog (it stopped looping)", "oom-kill": "the OOM killer"}


def start_units_say(socket: dict | None, service: dict | None) -> list:
    """What systemd's state of the start server's socket and service (unit_state's properties;
    None where systemd cannot be asked) says is wrong, as warnings: [(summary, fix)]. A socket
    unit that is not active listens for no offer (a failed one, after its trigger or its
    service's start limit was hit, stays so until reset); a service killed by the watchdog or
    the OOM killer, or restarted at all, lost the starts it was taking then."""
    from oci_gpu_hook.toolkit.install import START_SERVICE, START_SOCKET

    found = []
    if socket is not None and socket["LoadState"] != "loaded":
        found.append((f"systemd has {START_SOCKET} {socket['LoadState'] or 'unknown'}",
                      f"systemctl daemon-reload && systemctl enable --now {START_SOCKET}"))  # fmt: skip
    elif socket is not None and socket["ActiveState"] != "active":
        reset = f"systemctl reset-failed {START_SOCKET} {START_SERVICE} && systemctl start {START_SOCKET}"
        found.append((f"systemd has {START_SOCKET} {socket['ActiveState']} ({socket['SubState']}, result "
                      f"{socket['Result']}): nothing listens for offers, and every GPU start runs in Python",
                      reset))  # fmt: skip
    if service is not None:
        journal = f"journalctl -u {START_SERVICE} says why"
        if service["Result"] in START_SERVICE_RESULTS:
            found.append((f"its last run was ended by {START_SERVICE_RESULTS[service['Result']]} ({START_SERVICE}: "
                          f"result {service['Result']})", journal))  # fmt: skip
        restarts = decimal(service["NRestarts"]) or 0
        if restarts:
            found.append((f"systemd restarted it {restarts} time(s) ({START_SERVICE}: NRestarts={restarts})", journal))
    return found


def fallbacks(status: dict) -> str | None:
    """The starts a server's counts (server.ask_status) say fell back to Python for the server's
    own want (taken too late, no worker, too many waiting), as a summary; None where none did,
    or where the server counts nothing (one from before the counts)."""
    parts = [(status.get("late", 0), "taken too late"), (status.get("no_worker", 0), "without a worker"),
             (status.get("too_many", 0), "with too many connections waiting")]  # fmt: skip
    total = sum(n for n, _ in parts)
    if not total:
        return None
    said = ", ".join(f"{n} {why}" for n, why in parts if n)
    return f"{total} start(s) fell back to Python since the server started {status.get('up', '?')} s ago ({said})"


def systemd_says(root: str, unit: str) -> str:
    """What systemd says of a unit, to follow a failing check's summary ("" where it cannot be asked)."""
    state = unit_state(root, unit)
    if state is None:
        return ""
    if state["LoadState"] != "loaded":
        return f" (systemd: {unit} is {state['LoadState'] or 'unknown'}; systemctl daemon-reload?)"
    restarts = f", restarts: {state['NRestarts']}" if state["NRestarts"] not in ("", "0") else ""
    return f" (systemd: {unit} is {state['ActiveState']} ({state['SubState']}), result {state['Result']}{restarts})"


# Where dockerd (and so the program it looks for) is found: the PATH of docker.service.
DOCKER_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def service_processes(command: str, proc: str = "/proc") -> list:
    """Pids whose command line runs this program's command (watchdog, device-plugin): started as
    oci-gpu-hook (a console script, the launcher), as `python -m oci_gpu_hook`, or as the Python
    launcher the pre-filter hands over to (`python -IS .../oci-gpu-hook-python COMMAND`: what a
    unit install wrote runs as, wherever a C compiler built the pre-filter)."""
    names = (b"oci-gpu-hook", os.path.basename(launcher.PYTHON_LAUNCHER).encode())
    found = []
    for name in os.listdir(proc):
        if not is_decimal(name):
            continue
        try:
            with open(f"{proc}/{name}/cmdline", "rb") as f:
                argv = f.read(8192).split(b"\0")
        except OSError:
            continue
        program = any(a.endswith(names) or a == b"oci_gpu_hook" for a in argv)
        if program and command.encode() in argv:
            found.append(int(name))
    return sorted(found)


def _node_unit_installed(root: str, unit: str) -> bool:
    from oci_gpu_hook.toolkit.install import UNIT_DIR

    return os.path.exists(host_path(root, f"{UNIT_DIR}/{unit}"))


NOBODY = 65534  # owns nothing: it may use only what every user may


def subordinate_users(path: str) -> list:
    """The users /etc/subuid gives uid ranges: those who can run rootless podman."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read(1 << 20).splitlines()
    except OSError:
        return []
    users = [line.split(":", 1)[0] for line in lines if line.strip() and not line.startswith("#") and ":" in line]
    return list(dict.fromkeys(users))


def closed_to_others(path: str) -> str | None:
    """The first directory on path's way that other users cannot enter, or path itself when
    they cannot read it; None when they can."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    while True:
        try:
            if not os.stat(directory).st_mode & 0o001:
                return f"{directory} (mode {os.stat(directory).st_mode & 0o7777:04o})"
        except OSError:
            return directory
        if directory == "/":
            break
        directory = os.path.dirname(directory)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return path
    return None if mode & 0o004 else f"{path} (mode {mode & 0o7777:04o})"


def runs_as_nobody(argv, env) -> str | None:
    """What goes wrong when argv (a hook) runs as NOBODY on the OCI state of a bundle that asks
    for no GPU (its start path: interpreter, package, pre-filter); None when it exits 0."""
    import shutil
    import subprocess
    import tempfile

    bundle = tempfile.mkdtemp(prefix="oci-gpu-hook-doctor-", dir="/tmp")  # not TMPDIR: it may be private
    try:
        os.chmod(bundle, 0o755)
        os.mkdir(os.path.join(bundle, "rootfs"), 0o755)
        with open(os.path.join(bundle, "config.json"), "w") as f:
            json.dump({"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "process": {"env": [], "args": ["true"]}}, f)
        os.chmod(os.path.join(bundle, "config.json"), 0o644)
        state = json.dumps({"ociVersion": "1.0.2", "id": "oci-gpu-hook-doctor", "status": "creating",
                            "pid": os.getpid(), "bundle": bundle})  # fmt: skip
        user = {} if os.geteuid() != 0 else {"user": NOBODY, "group": NOBODY, "extra_groups": []}
        try:
            done = subprocess.run(argv, input=state.encode(), capture_output=True, cwd="/", timeout=60,
                                  env=dict(e.split("=", 1) for e in env if "=" in e), **user)  # fmt: skip
        except (OSError, subprocess.SubprocessError) as e:
            return f"cannot start: {getattr(e, 'strerror', None) or e}"
        if done.returncode != 0:
            lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
            return f"fails (exit status {done.returncode}): {lines[-1][-200:] if lines else 'no message'}"
        return None
    finally:
        shutil.rmtree(bundle, ignore_errors=True)


def run(settings, root: str = "/", config_error: str | None = None, **options) -> list:
    return Doctor(settings, root, config_error, **options).run()
