"""What the suite compares of the host before and after, without taking in another user's: what a
test harness owns (Footprint), and the host's /dev (dev_entries, dev_changes).

A harness (a CRI-O, a containerd with a kubelet, a cluster: criocheck, kubeletcheck, kubecheck)
compares and undoes only what its Footprint holds, each part found by what it is and never by a
name pattern: a pattern takes in another user of the machine (another run of the suite, a
helper's cluster, docker's chains), fails the teardown on their account, or kills their programs.
- Its processes: it starts its daemons in a cgroup of its own (a child of this process's cgroup in
  the hierarchy that tracks processes without controlling them), and what they start stays there
  however it daemonizes (containerd's shims, CRI-O's conmon); its containers' processes are in the
  cgroup parents it owns.
- Its mounts: those under its private directories.
- Its cgroups: its own and the cgroup parents it made.
- Its iptables chains, by name (their changes since it began).
A process is killed by pid: pinned by a pidfd and found in the footprint's cgroups again before the
signal, since a pid can name another process by then. A mount is unmounted without MNT_DETACH: a
lazy unmount of a busy mount succeeds and hides the leak that keeps it busy; a busy one is raised
with what holds it.
"""

from __future__ import annotations

import errno
import itertools
import os
import signal
import stat
import subprocess
import time

from oci_gpu_hook.start.linux import _linux, cgroups, mountinfo

_FOOTPRINTS: list = []  # every footprint made in this process: owned_state() looks at them all
_NUMBERS = itertools.count(1)


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _comm_and_state(pid: int) -> tuple:
    """(command name, state letter) of pid, or (None, None) once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None, None
    # The name is in parentheses and may hold any character, ")" included: the last ")" ends it.
    return text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split(" ", 1)[0]


def hierarchies() -> list:
    """Where each cgroup hierarchy is mounted (v1 controllers, named ones, the unified one)."""
    return [m.mountpoint for m in mountinfo.read() if m.fstype in ("cgroup", "cgroup2")]


def _tracking_parent() -> str:
    """This process's cgroup in the hierarchy a harness's cgroup is made in: the unified one (on
    cgroup v2 alone or beside v1; a cgroup that holds a process, as this one does, enables no
    controller for its children), else v1's named systemd one, which has no controller. Either
    way its processes keep every limit this process runs under."""
    with open("/proc/self/cgroup") as f:
        text = f.read()
    with open("/proc/self/mountinfo") as f:
        mounts = f.read()
    path = cgroups.v2_path(text, mounts)
    if path:
        return path
    for line in text.splitlines():
        _, controllers, relative = line.split(":", 2)
        if controllers == "name=systemd":
            for m in mountinfo.parse(mounts):
                if m.fstype == "cgroup" and "name=systemd" in m.super_options and _inside(relative, m.root):
                    return os.path.normpath(os.path.join(m.mountpoint, os.path.relpath(relative, m.root)))
    raise RuntimeError("no cgroup hierarchy to track a harness's processes in (neither cgroup2 nor name=systemd)")


class Footprint:
    """What one harness has on the host. directories: its private directories (the mounts under
    them are its own); chains: prefixes of the names of the iptables chains it owns. Made before
    the harness starts anything: the chains are compared with what they were then."""

    def __init__(self, name: str, directories=(), chains=()):
        self.name = f"oci-gpu-hook-{name}-{os.getpid()}-{next(_NUMBERS)}"
        self.directories = [os.path.realpath(str(d)) for d in directories]
        self.chains = tuple(chains)
        self.cgroup = None  # its own, made by the first popen()
        self.cgroup_parents: list = []  # absolute cgroup directories of its containers
        self._chains_before = self._chain_rules()
        _FOOTPRINTS.append(self)

    def own_cgroup_parent(self, relative: str, only_new: bool = False) -> None:
        """The cgroup parent relative (to each hierarchy's root) is its own, in every hierarchy, or
        (only_new) in those where it does not exist yet: one that was there is someone else's."""
        for top in hierarchies():
            path = os.path.join(top, relative.strip("/"))
            if not (only_new and os.path.isdir(path)) and path not in self.cgroup_parents:
                self.cgroup_parents.append(path)

    # --- processes -----------------------------------------------------------------------------

    def popen(self, argv, **kwargs) -> subprocess.Popen:
        """Popen(argv) started in the footprint's cgroup: the shell that joins it execs argv, so the
        pid is argv's, and nothing argv starts can leave it but by a cgroup write of its own."""
        if self.cgroup is None:
            self.cgroup = os.path.join(_tracking_parent(), self.name)
            os.makedirs(self.cgroup, exist_ok=True)
        join = 'echo $$ > "$0" && exec "$@"'
        return subprocess.Popen(["sh", "-c", join, os.path.join(self.cgroup, "cgroup.procs"), *argv], **kwargs)

    def _cgroup_dirs(self) -> list:
        return ([self.cgroup] if self.cgroup else []) + self.cgroup_parents

    def _members(self) -> list:
        """(pid, command name, the cgroup.procs file that lists it) of each live process in its
        cgroups; zombies, gone but for their exit status (the reaper may be slow), left out."""
        found = []
        for top in self._cgroup_dirs():
            for directory, _, _ in os.walk(top):
                procs = os.path.join(directory, "cgroup.procs")
                try:
                    with open(procs) as f:
                        pids = [int(p) for p in f.read().split()]
                except FileNotFoundError:
                    continue  # removed meanwhile
                for pid in pids:
                    comm, state = _comm_and_state(pid)
                    if state not in (None, "Z"):
                        found.append((pid, comm, procs))
        return found

    def pids(self) -> dict:
        """{pid: command name} of its live processes."""
        return {pid: comm for pid, comm, _ in self._members()}

    def kill(self, timeout: float = 15) -> None:
        """SIGKILL every process in its cgroups, by pid, until none is left."""
        deadline = time.monotonic() + timeout
        while True:
            members = self._members()
            if not members:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: processes that SIGKILL did not end: {_named(members)}")
            for pid, _, procs in members:
                _kill_if_listed(pid, procs)
            time.sleep(0.05)

    # --- mounts and cgroups ----------------------------------------------------------------------

    def mounts(self) -> list:
        """Mount points under its directories, in mountinfo order (one mounted twice is there twice)."""
        return [m.mountpoint for m in mountinfo.read() if any(_inside(m.mountpoint, d) for d in self.directories)]

    def unmount(self, busy_for: float = 5) -> None:
        """Unmount every mount under its directories, deepest (then latest) first, without
        MNT_DETACH; raises for one still busy after busy_for seconds, naming what holds it."""
        for _ in range(10000):
            points = self.mounts()
            if not points:
                return
            unmount(max(reversed(points), key=lambda p: p.count("/")), busy_for)
        raise RuntimeError(f"{self.name}: mounts keep appearing under {self.directories}")

    def remove_cgroups(self) -> None:
        from hookcheck import remove_cgroup  # raises for one it cannot remove

        for top in self._cgroup_dirs():
            for directory, _, _ in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
                remove_cgroup(directory)

    # --- iptables ------------------------------------------------------------------------------

    def _owns_chain(self, name) -> bool:
        return bool(self.chains and name and name.startswith(self.chains))

    def _chain_rules(self) -> list:
        """The iptables-save lines (IPv4 and IPv6, every table) of its chains: each chain, its rules
        and the rules that jump or go to it; counters left out."""
        if not self.chains:
            return []
        lines = []
        for program in ("iptables-save", "ip6tables-save"):
            table = None  # a missing or failing program fails here: an empty list would pass any leak
            for line in subprocess.run([program], capture_output=True, text=True, check=True).stdout.splitlines():
                words = line.split()
                if line.startswith("*"):
                    table = line[1:]
                elif line.startswith(":") and self._owns_chain(words[0][1:]):
                    lines.append(f"{program} {table} {words[0]}")
                elif line.startswith("-A "):
                    targets = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("-j", "-g", "--jump", "--goto")]
                    if self._owns_chain(words[1]) or any(self._owns_chain(t) for t in targets):
                        lines.append(f"{program} {table} {line}")
        return sorted(lines)

    def chain_changes(self) -> list:
        before, after = set(self._chains_before), set(self._chain_rules())
        return sorted([f"added: {line}" for line in after - before] + [f"removed: {line}" for line in before - after])

    # --- all of it -----------------------------------------------------------------------------

    def state(self) -> dict:
        """What it has on the host now; every list empty when it has nothing."""
        return {
            "processes": sorted(f"{comm} (pid {pid})" for pid, comm in self.pids().items()),
            "mounts": self.mounts(),
            "cgroups": [d for d in self._cgroup_dirs() if os.path.isdir(d)],
            "iptables": self.chain_changes(),
        }

    def leftovers(self) -> dict:
        return {what: found for what, found in self.state().items() if found}

    def close(self) -> None:
        """Kill its processes, unmount its mounts and remove its cgroups, each step tried whatever
        the last did; raises what failed and whatever it still has (its chains are compared, not
        removed: it would not know whose rule it removed)."""
        errors = []
        for step in (self.kill, self.unmount, self.remove_cgroups):
            try:
                step()
            except Exception as e:  # the next step must still run
                errors.append(f"{step.__name__}: {e}")
        left = self.leftovers()
        if left:
            errors.append(f"still there: {left}")
        if errors:
            raise AssertionError(f"{self.name} left the host changed: " + "; ".join(errors))


def owned_state() -> dict:
    """The state of every footprint this process made, merged: what a test compares around a
    harness (before it is made and after it is closed, each list is empty)."""
    merged = {"processes": [], "mounts": [], "cgroups": [], "iptables": []}
    for footprint in _FOOTPRINTS:
        for what, found in footprint.state().items():
            merged[what] += found
    return merged


def _named(members) -> str:
    return ", ".join(f"{comm} (pid {pid})" for pid, comm, _ in members)


def _kill_if_listed(pid: int, procs: str) -> None:
    """SIGKILL pid if, pinned by a pidfd, it is still listed in procs (the pid may be reused)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return  # gone
    try:
        try:
            with open(procs) as f:
                listed = str(pid) in f.read().split()
        except FileNotFoundError:
            return
        if listed:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)


def unmount(path: str, busy_for: float = 5) -> None:
    """umount2(path, 0): no MNT_DETACH. Busy (EBUSY) is tried again for busy_for seconds (a killed
    process lets go of its files a moment after the signal), then raised with what holds it."""
    deadline = time.monotonic() + busy_for
    while True:
        try:
            _linux.umount2(path, 0)
            return
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.ENOENT) and path not in [m.mountpoint for m in mountinfo.read()]:
                return  # gone meanwhile (with the mount it was under)
            if e.errno != errno.EBUSY:
                raise RuntimeError(f"umount {path}: {os.strerror(e.errno)}") from None
            if time.monotonic() > deadline:
                held = "; ".join(holders(path)) or "no process found here (one in another mount namespace?)"
                raise RuntimeError(f"umount {path}: busy; held by {held}") from None
            time.sleep(0.05)


def holders(path: str) -> list:
    """'pid (name): what' for each process whose working directory, root, executable, an open file
    or a mapped file lies under path."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        uses = []
        for what in ("cwd", "root", "exe"):
            try:
                if _inside(os.readlink(f"/proc/{entry}/{what}"), path):
                    uses.append(what)
            except OSError:
                pass
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                if _inside(os.readlink(f"/proc/{entry}/fd/{fd}"), path):
                    uses.append(f"fd {fd}")
            except OSError:
                pass
        try:
            with open(f"/proc/{entry}/maps") as f:
                if any(_inside(line.split(None, 5)[-1].strip(), path) for line in f if line.count(" ") >= 5):
                    uses.append("a mapped file")
        except OSError:
            pass
        if uses:
            found.append(f"{entry} ({_comm_and_state(int(entry))[0]}): {', '.join(uses[:4])}")
    return found


# --- the host's /dev ------------------------------------------------------------------------------


def _describe(st: os.stat_result, path: str) -> str:
    mode = st.st_mode
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        kind = "char" if stat.S_ISCHR(mode) else "block"
        return f"{kind} {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    if stat.S_ISLNK(mode):
        return f"link -> {os.readlink(path)}"
    if stat.S_ISDIR(mode):
        return "directory"
    return {stat.S_IFREG: "file", stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket"}.get(stat.S_IFMT(mode), "other")


def dev_entries(top: str = "/dev") -> dict:
    """{path relative to top: 'char 195:255', 'block 7:0', 'link -> target', 'directory', ...} of
    everything in top's own filesystem. The contents of another filesystem mounted below it
    (devpts's /dev/pts, the tmpfs of /dev/shm, mqueue, hugetlbfs) are left out, its mount point
    kept: they hold objects of running programs (terminals, POSIX shared memory, semaphores and
    message queues, huge pages) that any process on the machine makes and removes, not nodes."""
    device = os.lstat(top).st_dev
    found = {}
    for directory, dirs, files in os.walk(top):
        for name in sorted(dirs + files):
            path = os.path.join(directory, name)
            try:
                st = os.lstat(path)
                found[os.path.relpath(path, top)] = _describe(st, path)
            except FileNotFoundError:
                continue  # gone meanwhile: compared at the next look
            if name in dirs and st.st_dev != device:
                dirs.remove(name)
    return found


def _kernel_devname(kind: str, numbers: str, sys_dev: str):
    """The kernel's name (DEVNAME) of a registered device, or None when none has these numbers."""
    try:
        with open(os.path.join(sys_dev, kind, numbers, "uevent")) as f:
            fields = dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)
    except OSError:
        return None
    return fields.get("DEVNAME")


def _kernels(relative: str, description: str, appeared: bool, entries: dict, sys_dev: str) -> bool:
    """Whether the kernel made (appeared) or removed this entry with its device: devtmpfs makes a
    node when a device is registered (a loop device attached, a module loaded, whoever did it) and
    removes it when it goes; udev links such a node in block/, char/ and disk/. A node counts as
    the kernel's only if a device with its type and numbers is registered under its very name (or,
    for one that went, no longer registered): one a program made with mknod never is."""
    kind, _, rest = description.partition(" ")
    if kind in ("char", "block"):
        name = _kernel_devname(kind, rest, sys_dev)
        return name == relative if appeared else name is None
    if relative.split("/", 1)[0] in ("block", "char", "disk") and relative.count("/"):
        if description == "directory":
            return True
        if kind == "link":
            target = os.path.normpath(os.path.join(os.path.dirname(relative), rest.partition("-> ")[2]))
            node = entries.get(target, "")
            return node.startswith(("char ", "block ")) and _kernels(target, node, appeared, entries, sys_dev)
    return False


def dev_changes(before: dict, after: dict, sys_dev: str = "/sys/dev") -> list:
    """What changed between two dev_entries, one line each ('nvidiactl: char 195:255 appeared'),
    but for what the kernel made or removed with a device (_kernels)."""
    changes = []
    for relative in sorted(set(before) | set(after)):
        old, new = before.get(relative), after.get(relative)
        if old == new:
            continue
        if old is None:
            if not _kernels(relative, new, True, after, sys_dev):
                changes.append(f"{relative}: {new} appeared")
        elif new is None:
            if not _kernels(relative, old, False, before, sys_dev):
                changes.append(f"{relative}: {old} went")
        else:
            changes.append(f"{relative}: {old} became {new}")
    return changes
