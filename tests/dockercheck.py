"""A dockerd of its own (Debian's docker.io): HostDockerd (at the end) for the tests, as a host runs
it after `oci-gpu-hook install --runtime docker`, and Dockerd for the bench (bench/docker.py).

Dockerd: dockerd registers GPU support when it finds `nvidia-container-runtime-hook` on its PATH at start;
`oci-gpu-hook install --runtime docker` writes that program (under a --root of the caller's own,
whose usr/bin the caller puts first on dockerd's PATH). The daemon gets its own socket, data root,
exec root, pid file and cgroup parent, the vfs storage driver, and no iptables, masquerading or
bridge. close() stops it by pid and puts back what it changed on the host: /etc/docker (its trust
key), the net sysctls it sets (ip_forward) and its cgroups; it asserts the sysctls and cgroups are
back. Importable from any test (pytest puts tests/ on sys.path for its conftest.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from hookcheck import remove_cgroup

DOCKERD = "/usr/sbin/dockerd"
DOCKER = "/usr/bin/docker"  # Debian's client, the daemon's own version (not another on the PATH)
SYSCTL_DIRS = ("/proc/sys/net/ipv4", "/proc/sys/net/ipv6/conf/all", "/proc/sys/net/ipv6/conf/default",
               "/proc/sys/net/bridge")  # fmt: skip
PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def sysctls() -> dict:
    """Every writable setting under the directories dockerd touches, by path."""
    found = {}
    for directory in SYSCTL_DIRS:
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if os.path.isfile(path) and os.stat(path).st_mode & 0o200:
                try:
                    with open(path) as f:
                        found[path] = f.read()
                except OSError:
                    pass
    return found


def cgroup_dirs(name: str) -> list:
    """The cgroup name in every hierarchy: /sys/fs/cgroup/<controller>/name (v1, hybrid) and
    /sys/fs/cgroup/name (pure v2)."""
    paths = [os.path.join("/sys/fs/cgroup", name)] + [os.path.join(d.path, name) for d in os.scandir("/sys/fs/cgroup")]
    return [p for p in paths if os.path.isdir(p)]


class Docker:
    """The client of the daemon under work. Its options are on its command line, not in its
    environment, so that argv() alone runs it (the bench times it as a plain process)."""

    def __init__(self, work: str):
        self.socket = os.path.join(work, "docker.sock")
        self.config = os.path.join(work, "client")
        self.env = {"PATH": PATH}

    def argv(self, *args) -> list:
        return [DOCKER, "--config", self.config, "-H", f"unix://{self.socket}", *args]

    def __call__(self, *args, timeout=180, check=False, **kwargs):
        stdin = kwargs.pop("stdin", subprocess.DEVNULL)
        out = subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout, env=self.env,
                             stdin=stdin, **kwargs)  # fmt: skip
        if check:
            assert out.returncode == 0, out.stderr
        return out

    def run_args(self, gpus) -> list:
        """`docker run`'s arguments before the image: removed when it exits, no network, limits of
        its own (some hosts' hard limits are below Docker's defaults, and runc then fails); gpus:
        the --gpus value, None for none."""
        args = ["run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
        return args + (["--gpus", gpus] if gpus is not None else [])

    def run(self, gpus, script, image):
        return self(*self.run_args(gpus), image, "sh", "-c", script)


class Dockerd:
    """dockerd under work with program_dir first on its PATH, started by start() (or `with`) and
    stopped by close(); client: its Docker."""

    def __init__(self, work: str, program_dir: str):
        self.work = work
        self.program_dir = program_dir
        self.client = Docker(work)
        self.parent = f"ocigpu-docker-{os.getpid()}"
        self.daemon: subprocess.Popen | None = None
        self.log = None
        self.images: list[str] = []
        self._before: dict | None = None

    def __enter__(self) -> Dockerd:
        return self.start()

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close()

    def start(self, timeout: float = 90) -> Dockerd:
        assert not cgroup_dirs(self.parent)
        self._before = {
            "etc_docker": os.path.exists("/etc/docker"),
            # Fixed paths dockerd and its containerd shims use whatever their roots: the plugin
            # socket directory and the shims' socket directory.
            "run_dirs": {d: os.path.exists(d) for d in ("/run/docker", "/run/containerd")},
            "key": os.path.exists("/etc/docker/key.json"),
            "sysctls": sysctls(),
        }
        work = self.work
        self.log = open(os.path.join(work, "dockerd.log"), "w")
        with open(f"{work}/daemon.json", "w") as f:  # before dockerd reads it
            f.write("{}\n")
        try:
            self.daemon = subprocess.Popen(
                [DOCKERD, "--host", f"unix://{self.client.socket}", "--data-root", f"{work}/data", "--exec-root",
                 f"{work}/exec", "--pidfile", f"{work}/docker.pid", "--iptables=false", "--ip-masq=false",
                 "--bridge=none", "--storage-driver=vfs", f"--cgroup-parent=/{self.parent}", "--config-file",
                 f"{work}/daemon.json"],
                env={"PATH": f"{self.program_dir}:{PATH}"}, stdout=self.log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
            deadline = time.monotonic() + timeout
            while self.client("version", timeout=30).returncode != 0:  # ready when it answers
                assert self.daemon.poll() is None, self.log_tail()
                assert time.monotonic() < deadline, self.log_tail()
                time.sleep(0.2)
        except BaseException:
            self.close()
            raise
        return self

    def log_tail(self) -> str:
        with open(self.log.name) as f:
            return f.read()[-3000:]

    def import_image(self, rootfs: str, tag: str) -> str:
        """Import a rootfs directory as the image tag (no registry is needed); close() removes it."""
        tar = subprocess.Popen(["tar", "-C", rootfs, "-cf", "-", "."], stdout=subprocess.PIPE)
        self.images.append(tag)
        self.client("import", "-", tag, stdin=tar.stdout, check=True)
        assert tar.wait() == 0
        return tag

    def close(self) -> None:
        before, self._before = self._before, None
        if before is None:
            return
        if self.daemon is not None:
            for tag in self.images:
                self.client("rmi", "-f", tag)
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()
        self.log.close()
        # What dockerd changed on the host, put back.
        for path, value in before["sysctls"].items():
            with open(path) as f:
                now = f.read()
            if now != value:
                with open(path, "w") as f:
                    f.write(value)
        if not before["key"] and os.path.exists("/etc/docker/key.json"):
            os.unlink("/etc/docker/key.json")
        if not before["etc_docker"] and os.path.isdir("/etc/docker") and not os.listdir("/etc/docker"):
            os.rmdir("/etc/docker")
        subprocess.run(["rm", "-rf", "--one-file-system", f"{self.work}/data", f"{self.work}/exec"], check=False)
        for directory, existed in before["run_dirs"].items():
            if not existed:
                subprocess.run(["rm", "-rf", "--one-file-system", directory], check=False)
        # Last: a cgroup the kernel keeps busy for a moment must not stop the steps above.
        for directory in sorted(cgroup_dirs(self.parent), key=len, reverse=True):
            for sub in sorted((e.path for e in os.scandir(directory) if e.is_dir()), reverse=True):
                remove_cgroup(sub)
            remove_cgroup(directory)
        assert sysctls() == before["sysctls"]
        assert not cgroup_dirs(self.parent)


class HostDockerd:
    """dockerd as a host runs it, after `oci-gpu-hook install --runtime docker` as a user runs it,
    without touching the host: a private mount namespace (privatehost.Session) with overlays over
    /etc, /usr/bin, /usr/local, /var/lib and /run; install (cli: the CLI's argv prefix, its
    --config) writes /usr/bin/nvidia-container-runtime-hook there, and dockerd starts with no flags
    and its own PATH, its settings (the socket, roots, cgroup parent of work's own, no iptables or
    bridge, vfs) in /etc/docker/daemon.json, where it reads them. The image (rootfs, as tag) is
    imported; client: its Docker, from outside the namespace (the socket is under work). Leaving
    the `with` stops dockerd, runs `oci-gpu-hook uninstall` and puts back what dockerd changed
    outside the namespace (net sysctls, its cgroups). before/after: the steps' results (install's,
    trees of TREES) before dockerd starts and after uninstall.

    The start server's directory (prefilter_rule.START_SERVER_SOCKET's) is a private tmpfs, so that no
    server of the host's takes these starts; start_server: install is run as users run it (the start
    server is its default; without, with --no-start-server), and a server listens there, started
    before dockerd with the command its unit runs (the CLI's argv prefix, start-server) at the
    unit's priority, its log in server_log."""

    TREES = ["/etc", "/usr/local", "/var/lib/oci-gpu-hook"]

    def __init__(self, work: str, cli: list, rootfs: str, tag: str, start_server: bool = False):
        import startservercheck
        from privatehost import Session

        from oci_gpu_hook.start import prefilter_rule

        os.makedirs(work, exist_ok=True)
        # The socket dockerd's containerd makes under exec/ must fit a socket address (108 bytes).
        assert len(f"{work}/exec/containerd/containerd.sock.ttrpc") < 108, f"{work}: too long for its sockets"
        self.client, self.tag = Docker(work), tag
        self.parent = f"ocigpu-docker-{os.getpid()}-{os.path.basename(work)}"
        settings = {"hosts": [f"unix://{self.client.socket}"], "data-root": f"{work}/data",
                    "exec-root": f"{work}/exec", "pidfile": f"{work}/docker.pid", "iptables": False,
                    "ip-masq": False, "bridge": "none", "storage-driver": "vfs",
                    "cgroup-parent": f"/{self.parent}"}  # fmt: skip
        import json

        trees = [{"tree": self.TREES}, {"tree": ["/usr/bin"], "contents": False}]
        run_dir = os.path.dirname(prefilter_rule.START_SERVER_SOCKET)
        self.server_log = f"{work}/daemon0.log"  # privatehost's log of the first daemon step
        server = [
            {"run": ["mkdir", "-p", "-m", "0755", run_dir]},
            {
                "daemon": startservercheck.as_its_unit_runs([*cli, prefilter_rule.START_SERVER]),
                "ready": ["grep", "-q", "listening on", self.server_log],
            },
        ]
        steps = [{"write": "/etc/docker/daemon.json", "text": json.dumps(settings)}, *trees,
                 {"run": [*cli, "install", "--runtime", "docker", *([] if start_server else ["--no-start-server"])]},
                 *(server if start_server else []),
                 {"daemon": [DOCKERD], "ready": self.client.argv("version")},
                 {"run": ["sh", "-c", 'tar -C "$0" -cf - . | "$@"', rootfs,
                          *self.client.argv("import", "-", tag)]}]  # fmt: skip
        final = [{"run": [*cli, "uninstall"]}, *trees]
        self.session = Session(work, ["/etc", "/usr/bin", "/usr/local", "/var/lib", "/run"], steps, final,
                               tmpfs=[run_dir])  # fmt: skip
        self.before = self.after = None

    def __enter__(self) -> HostDockerd:
        self._sysctls = sysctls()
        try:
            self.session.__enter__()
        except BaseException:
            self._put_back()
            raise
        _, tree, usr_bin, installed, *_, started, imported = self.session.ready
        assert started["rc"] == 0 and imported["rc"] == 0, (started, imported)
        self.before = {"install": installed, "tree": tree, "usr/bin": usr_bin}
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.client("rmi", "-f", self.tag)
            self.session.__exit__(*exc)
        finally:
            self._put_back()
        uninstalled, tree, usr_bin = self.session.results[-3:]
        self.after = {"uninstall": uninstalled, "tree": tree, "usr/bin": usr_bin}

    def _put_back(self) -> None:
        for path, value in self._sysctls.items():  # dockerd sets some (ip_forward)
            with open(path) as f:
                now = f.read()
            if now != value:
                with open(path, "w") as f:
                    f.write(value)
        for directory in sorted(cgroup_dirs(self.parent), key=len, reverse=True):
            for sub in sorted((e.path for e in os.scandir(directory) if e.is_dir()), reverse=True):
                remove_cgroup(sub)
            remove_cgroup(directory)
        assert sysctls() == self._sysctls and not cgroup_dirs(self.parent)
