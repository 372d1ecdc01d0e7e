"""Carry out a plan inside the container, all or nothing.

The hook's own (single-threaded) process joins the container's mount namespace (through a pidfd,
so a recycled pid cannot redirect it), performs the operations in plan order, and records an undo
action for each change. Any error, or the deadline passing, rolls every change back in reverse
order; then the process returns to its own mount namespace, root and working directory, and
reports. (Until issue 41 a forked child did this and the parent relayed its verdict: the fork,
its copy-on-write faults and the reaping cost every GPU start about 2 ms, docs/performance.md.)
"""

from __future__ import annotations

import _signal as signal  # signal without its enum wrappers: 4.6 ms less per cold start (docs/performance.md)
import errno
import os
import stat
import time

from oci_gpu_hook.errors import Exit, HookError
from oci_gpu_hook.start.budget import no_deadline_between
from oci_gpu_hook.start.digits import decimal
from oci_gpu_hook.start.linux import _linux, cgroups, labels, ldconfig, mountinfo, userns
from oci_gpu_hook.start.linux.journal import Journal, journal_directory
from oci_gpu_hook.start.linux.rootfs import ForeignMount, MountGuard, Rootfs, UndoLog
from oci_gpu_hook.start.linux.rootfs import mount_id as _mount_id
from oci_gpu_hook.start.linux.sources import HostSources, UntrustedSource
from oci_gpu_hook.start.plan import (
    BindMount,
    CopyFile,
    DeviceRule,
    MountDevice,
    MountTmpfs,
    Operation,
    Plan,
    RefreshLdcache,
    Remount,
    Symlink,
    WriteFile,
)
from oci_gpu_hook.start.settings import Settings
from oci_gpu_hook.start.spec import Spec
from oci_gpu_hook.start.state import ContainerState

FAULT_ENV = "OCI_GPU_HOOK_FAULT_AT"  # tests: fail the Nth operation (set only in the hook's own env)
# After the deadline, the rollback's own time; then the kernel kills the hook (_arm_kill).
_GRACE_SECONDS = 5.0


class ApplyError(HookError):
    exit_code = Exit.APPLY


class DeadlineExceeded(ApplyError):
    pass


def _fd_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


# What a bind remount sets or clears of a mount's own flags (the kernel's user-settable ones but
# the atime flags, which a remount that names none keeps).
_BIND_ATTRS = (
    _linux.MOUNT_ATTR_RDONLY | _linux.MOUNT_ATTR_NOSUID | _linux.MOUNT_ATTR_NODEV | _linux.MOUNT_ATTR_NOEXEC
    | _linux.MOUNT_ATTR_NOSYMFOLLOW
)  # fmt: skip
_setattr_works = None  # unknown until tried; False before Linux 5.12, or where seccomp refuses it


def _restrict(mounted: int, flags) -> None:
    """The hook's new bind mount open at mounted: exactly flags among ro, nosuid, nodev and
    noexec, as a bind remount leaves it, and private. One mount_setattr through the descriptor
    (one system call, no /proc/self/fd walk: ~1 ms of an 8-GPU start's hundred binds); where the
    kernel has none, the remount and the propagation change, onto /proc/self/fd/N."""
    global _setattr_works
    if _setattr_works is not False:
        attrs = _linux.mount_attrs(flags)
        try:
            _linux.mount_setattr(mounted, attrs, False, _BIND_ATTRS & ~attrs, _linux.MS_PRIVATE)
            _setattr_works = True
            return
        except OSError as e:
            if _setattr_works or e.errno not in (errno.ENOSYS, errno.EPERM):
                raise
            _setattr_works = False  # EPERM of a real refusal: the remount below says it again
    _linux.mount(None, _fd_path(mounted), None, _linux.MS_REMOUNT | _linux.MS_BIND | _linux.mount_flags(flags))
    _linux.mount(None, _fd_path(mounted), None, _linux.MS_PRIVATE)


class Applier:
    """Executes operations against the rootfs (in the container's mount namespace), keeps the undo log."""

    def __init__(self, plan: Plan, state: ContainerState, spec: Spec, settings: Settings, rootfs: Rootfs):
        self.plan = plan
        self.state = state
        self.spec = spec
        self.settings = settings
        self.rootfs = rootfs
        self.undo = UndoLog()
        self.sources = HostSources()
        self.undo.on_close.append(self.sources.close)
        self._mounts: dict[str, int] = {}  # target -> descriptor of the hook's mount there
        self.skipped: list[str] = []
        self.left: list[str] = []  # what was left to the runtime and why (rootless: the cgroup rules)
        self._skipped_trees: list[str] = []
        self._cgroup_dir: str | None = None
        self._cgroup_mode: str | None = None
        self._v2_done = False
        self._v1_list: str | None = None  # devices.list as it was before the first rule
        self.allowed: list = []  # (major, minor, access) the hook added to the cgroup: systemd is told
        self._ldcache = None  # ldconfig.Refresh under way while the plan's later operations run
        self.timings: dict[str, float] = {}  # milliseconds, for the log record (docs/performance.md)
        fault, _, how = os.environ.get(FAULT_ENV, "").partition(":")
        self.fault_at = decimal(fault)
        self.fault_kill = how == "kill"  # N:kill: SIGKILL the child there, as a runtime's timeout would

    def run(self) -> None:
        if any(isinstance(op, DeviceRule) for op in self.plan.operations):
            # Found before the first mount: the container's mountinfo, which says where its
            # cgroup is, grows with every mount the hook makes.
            self._cgroup()
        for number, op in enumerate(self.plan.operations, 1):
            if self.fault_at == number:
                if self.fault_kill:
                    os.kill(os.getpid(), signal.SIGKILL)  # the hook itself, as the runtime would
                raise ApplyError(f"operation {number} ({op.describe()}): injected fault")
            target = getattr(op, "target", None)
            if target and any(target == t or target.startswith(t + "/") for t in self._skipped_trees):
                self.skipped.append(op.describe())
                continue
            try:
                getattr(self, "do_" + type(op).__name__)(op)
            except ForeignMount as e:
                # A user's volume where the hook would create: left as it is (nothing of this start
                # may outlive the container there), and so is whatever would go inside the target.
                self.skipped.append(f"{op.describe()}: not done: {e.filename}: {e.strerror}")
                if target:
                    self._skipped_trees.append(target)
            except OSError as e:
                raise ApplyError(f"{op.describe()}: {e.strerror or e}") from None
        if self._ldcache is not None:
            waited = time.perf_counter()
            self.skipped.extend(self._ldcache.finish())
            done = time.perf_counter()
            self.timings["ldconfig_wait"] = (done - waited) * 1e3  # what the overlap did not hide
            self.timings["ldconfig"] = (done - self._ldcache.started) * 1e3

    # --- mounts -------------------------------------------------------------------------------

    def _mount_on(self, target: str, target_fd: int, mount, parent=None) -> int:
        """Run mount() onto target_fd; returns a descriptor of the new mount, whose unmount is in
        the undo log before anything else can fail.

        The new mount is found as its name in the parent directory's descriptor, taken before
        mounting, never by walking the path again: a rootfs that changes meanwhile (a directory
        swapped for a symlink) could make a second walk fail, and the mount would stay behind.
        parent: (descriptor kept in the undo log, name) where the caller has them already."""
        if parent is None:
            parent_path, name = os.path.split(target.rstrip("/"))
            parent_fd = self.undo.keep_fd(self.rootfs.open(parent_path or "/"))
        else:
            parent_fd, name = parent
        entry, got = os.stat(name, dir_fd=parent_fd, follow_symlinks=False), os.fstat(target_fd)
        if (entry.st_dev, entry.st_ino) != (got.st_dev, got.st_ino):
            raise ApplyError(f"{target}: the rootfs changed while the hook was mounting (a race?)")
        where = f"{_fd_path(parent_fd)}/{name}"  # the topmost mount on that entry: ours
        flags = _linux.MNT_DETACH | _linux.UMOUNT_NOFOLLOW
        with no_deadline_between():
            mount()
            self.undo.add(f"unmount {target}", lambda: _linux.umount2(where, flags))
        if stat.S_ISDIR(got.st_mode):  # it may cover a directory the rootfs remembers resolving
            self.rootfs.forget_directories()
        mounted = self.undo.keep_fd(os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd))
        self._mounts[target] = mounted
        return mounted

    def _bind(self, source_fd: int, src, target_fd: int, op, parent=None) -> None:
        """Bind the host file open at source_fd (checked by HostSources; src its stat) onto
        target_fd (in parent: see _mount_on)."""
        mounted = self._mount_on(
            op.target,
            target_fd,
            lambda: _linux.mount(_fd_path(source_fd), _fd_path(target_fd), None, _linux.MS_BIND),
            parent,
        )
        got = os.fstat(mounted)
        if (src.st_dev, src.st_ino) != (got.st_dev, got.st_ino):
            raise ApplyError(f"{op.target}: the mounted file is not {op.source} (the rootfs changed during the mount)")
        _restrict(mounted, op.flags)

    def _bind_new(self, source, op, directory: bool, device=None) -> None:
        """Bind source, (descriptor, stat) from HostSources, onto op.target, a target made (if
        missing) with the source's mode."""
        source_fd, src = source
        mode = stat.S_IMODE(src.st_mode)
        if directory:
            parent, fd = None, self.rootfs.ensure_dir(op.target, self.undo)
        else:
            parent_fd, name, fd = self.rootfs.ensure_target_in(op.target, mode, self.undo, device=device)
            parent = parent_fd, name
        try:
            self._bind(source_fd, src, fd, op, parent)
        finally:
            os.close(fd)

    def _source(self, op, kind: str):
        """The checked host source of op, (descriptor, stat), or None when an optional one is
        absent or untrusted (skipped, and said in the log record); a required one that fails
        stops the start."""
        try:
            return self.sources.open_stat(op.source, kind)
        except FileNotFoundError:
            if getattr(op, "optional", False):
                self.skipped.append(op.describe())
                return None
            raise ApplyError(f"{op.source}: missing on the host (run `oci-gpu-hook inventory refresh`)") from None
        except UntrustedSource as e:
            if getattr(op, "optional", False):
                self.skipped.append(f"{op.describe()}: not used: {e.why}")
                return None
            raise ApplyError(f"{e}: refusing to mount it into containers") from None

    def do_MountDevice(self, op: MountDevice) -> None:
        source = self._source(op, "char")
        try:
            st = source[1]
            if (os.major(st.st_rdev), os.minor(st.st_rdev)) != (op.major, op.minor):
                raise ApplyError(f"{op.source}: not char device {op.major}:{op.minor} (the host's device node changed)")
            self._bind_new(source, op, False, device=(op.major, op.minor))
        finally:
            os.close(source[0])

    def do_BindMount(self, op: BindMount) -> None:
        source = self._source(op, op.kind)
        if source is not None:
            try:
                self._bind_new(source, op, op.kind == "dir")
            finally:
                os.close(source[0])

    def do_MountTmpfs(self, op: MountTmpfs) -> None:
        try:
            fd = self.rootfs.open(op.target)
        except FileNotFoundError:
            if op.optional:  # the plan's decision (see MountTmpfs): skip it and what goes inside
                self._skipped_trees.append(op.target)
                self.skipped.append(op.describe())
                return
            fd = self.rootfs.ensure_dir(op.target, self.undo)
        labeler = self.rootfs.labeler
        options = f"mode={op.mode:04o}" + (labeler.tmpfs_option() if labeler else "")
        try:
            flags = _linux.mount_flags(op.flags)

            def mount():
                _linux.mount("tmpfs", _fd_path(fd), "tmpfs", flags, options)

            mounted = self._mount_on(op.target, fd, mount)
        finally:
            os.close(fd)
        if self.rootfs.guard is not None:
            self.rootfs.guard.own(mounted)

    def do_CopyFile(self, op: CopyFile) -> None:
        source = self._source(op, "file")[0]
        try:
            reader = os.open(_fd_path(source), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        finally:
            os.close(source)
        with open(reader, "rb") as f:
            lines = f.read(1 << 20).decode("utf-8", "replace").splitlines(keepends=True)
        for prefix, replacement in op.rewrite:
            lines = [replacement + "\n" if line.startswith(prefix) else line for line in lines]
        self._write_new(op.target, "".join(lines).encode(), 0o444)

    def do_WriteFile(self, op: WriteFile) -> None:
        self._write_new(op.target, op.content.encode(), op.mode)

    def _write_new(self, target: str, data: bytes, mode: int) -> None:
        """A new file at target (O_EXCL: nothing the image put there is written through)."""
        parent, name = os.path.split(target)
        parent_fd = self.rootfs.directory(parent, self.undo)
        self.rootfs.may_create(parent_fd, target)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent_fd)
        self.undo.add(f"remove file {target}", lambda: os.unlink(name, dir_fd=parent_fd))
        self.rootfs.created(parent_fd, name)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    def do_Remount(self, op: Remount) -> None:
        # The hook's own mount at the target, through its descriptor, and always with MS_BIND: a
        # remount without it would reconfigure the whole filesystem, for the host too.
        fd = self._mounts.get(op.target)
        if fd is None:
            raise ApplyError(f"{op.target}: the hook mounted nothing there to remount")
        remount = _linux.MS_REMOUNT | _linux.MS_BIND
        _linux.mount(None, _fd_path(fd), None, remount | _linux.mount_flags(op.flags))
        # Writable again on rollback, so that what was made inside it can be removed in order.
        writable = _linux.mount_flags(f for f in op.flags if f != "ro")
        path = _fd_path(fd)
        self.undo.add(f"remount {op.target} writable", lambda: _linux.mount(None, path, None, remount | writable))

    def do_Symlink(self, op: Symlink) -> None:
        if self.rootfs.ensure_symlink(op.target, op.value, self.undo) == "kept":
            self.skipped.append(op.describe() + " (the image's own file kept)")

    # --- cgroups and ld cache -----------------------------------------------------------------

    def _cgroup(self):
        """(mode, directory): mode v1, v2, off, or runtime (left to it: the hook has no right to
        the container's cgroup), as the settings, the hook's privilege and the cgroup say."""
        if self._cgroup_mode is None:
            wanted = self.settings.cgroups
            if wanted == "off":
                self._cgroup_mode = "off"
                return self._cgroup_mode, None
            if userns.unprivileged():
                # Rootless podman: root of a user namespace may neither write devices.allow nor
                # attach a device program; the runtime, which made the cgroup (or none), decides.
                return self._leave_cgroup("the hook runs in a user namespace (rootless)")
            text = cgroups.read_cgroup_file(self.state.pid)
            found = cgroups.detect_version(text)
            # auto follows the devices controller (v1 where it is mounted, as runc does on hybrid
            # hosts); an explicit v1 or v2 is taken as said, if the container has such a cgroup.
            mode = found if wanted == "auto" else wanted
            if mode == "none":
                raise ApplyError("the container is in no device cgroup; set 'cgroups: off' to skip device rules")
            table = mountinfo.read_text()  # the container's, names as the os module decodes them
            if mode == "v1":
                directory = cgroups.v1_devices_path(text, table)
            else:
                directory = cgroups.v2_path(text, table)
            if directory is None:
                raise ApplyError(
                    f"the {mode} device cgroup of pid {self.state.pid} is not mounted where the hook can see it"
                )
            if mode == "v1" and not os.access(os.path.join(directory, "devices.allow"), os.W_OK):
                # A read-only cgroupfs (the hook run inside a container) or a cgroup not ours.
                return self._leave_cgroup(f"{directory}/devices.allow is not writable by the hook")
            self._cgroup_mode, self._cgroup_dir = mode, directory
        return self._cgroup_mode, self._cgroup_dir

    def _leave_cgroup(self, why: str):
        """Device rules left to the runtime, said once (in the start's log record), not per rule."""
        self._cgroup_mode = "runtime"
        rules = sum(isinstance(op, DeviceRule) for op in self.plan.operations)
        self.left.append(f"cgroup device rules ({rules}): {why}")
        return self._cgroup_mode, None

    def do_DeviceRule(self, op: DeviceRule) -> None:
        mode, directory = self._cgroup()
        if mode == "runtime":
            return  # said once, in self.left
        if mode == "off":
            self.skipped.append(op.describe())
        elif mode == "v1":
            if self._v1_list is None:
                self._v1_list = cgroups.read_v1(directory, "devices.list")
            if cgroups.v1_granted(self._v1_list, op.major, op.minor, op.access):
                return  # already allowed (the root cgroup, a privileged container): nothing to change
            rule = cgroups.v1_rule(op.major, op.minor, op.access)
            with no_deadline_between():
                cgroups.write_v1(directory, "devices.allow", rule)
                self.undo.add(f"deny {rule}", lambda: cgroups.write_v1(directory, "devices.deny", rule))
            self.allowed.append((op.major, op.minor, op.access))
        elif not self._v2_done:
            # One eBPF program replacement for all the plan's devices: each load is verified by
            # the kernel, so one per device would cost a GPU container milliseconds per GPU.
            from oci_gpu_hook.start.linux import bpf

            rules = [(r.major, r.minor, r.access) for r in self.plan.operations if isinstance(r, DeviceRule)]
            with no_deadline_between():
                change = bpf.allow_devices(directory, rules)
                self.undo.add(f"restore the device programs of {directory}", change.undo)
            self.undo.on_close.append(change.close)
            self._v2_done = True
            if change.changed:
                self.allowed.extend(rules)

    def do_RefreshLdcache(self, op: RefreshLdcache) -> None:
        """Starts ldconfig; the operations after this one run while it works (the plan puts
        them after: nothing ldconfig reads), and run() installs its cache at the end."""
        remaining = max(1.0, signal.getitimer(signal.ITIMER_REAL)[0] or self.settings.deadline_seconds)
        self._ldcache = ldconfig.Refresh(self.rootfs, op.directories, self.undo, timeout=remaining,
                                         sources=self.sources)  # fmt: skip


def check_handlers(operations=None) -> None:
    """Every operation type the plan can produce has its do_<Type> here (checked at import, so a
    new operation without a handler fails every test, not a container start)."""
    missing = [t.__name__ for t in operations or Operation.__subclasses__() if not hasattr(Applier, f"do_{t.__name__}")]
    if missing:
        raise ImportError(f"apply has no handler for {', '.join(missing)}")


check_handlers()


# --- the two processes --------------------------------------------------------------------------


def _join_mount_namespace(pid: int) -> None:
    try:
        pidfd = _linux.pidfd_open(pid)
    except OSError as e:
        if e.errno == errno.ESRCH:
            raise ApplyError(f"the container process {pid} does not exist (any more)") from None
        pidfd = None  # kernels before 5.3: fall back to the procfs handle
    if pidfd is not None:
        try:
            _linux.setns(pidfd, _linux.CLONE_NEWNS)
            return
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: setns(pidfd) needs 5.8
                raise ApplyError(f"cannot join the mount namespace of pid {pid}: {e.strerror}") from None
        finally:
            os.close(pidfd)
    try:
        fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise ApplyError(f"cannot open the mount namespace of pid {pid}: {e.strerror}") from None
    try:
        _linux.setns(fd, _linux.CLONE_NEWNS)
    finally:
        os.close(fd)


def _identity(path: str):
    """(device, inode) of path in the hook's own namespace; None if it cannot be seen (then the
    rootfs, looked up in the container's namespace, says why, after the pid was checked)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _check_is_the_container(pid: int, own_namespace: int, bundle_rootfs, rootfs: Rootfs) -> None:
    """state.pid must be the container being created, not a host process (a runtime bug, or a
    pid reused): mounting into the hook's own namespace would change the host's mount table. So
    the pid's mount namespace is another one, and in it the bundle's rootfs is a mount point (the
    runtime bind-mounts it onto itself before pivot_root) of the same directory the bundle names.
    Nothing has been changed yet when this fails."""
    what = f"pid {pid} is not the container of this bundle"
    if os.stat("/proc/self/ns/mnt").st_ino == own_namespace:
        raise ApplyError(f"{what}: it shares the hook's own mount namespace; nothing was changed")
    st = os.fstat(rootfs.fd)
    if (st.st_dev, st.st_ino) != bundle_rootfs:
        raise ApplyError(f"{what}: its {rootfs.path} is another directory; nothing was changed")
    parent = os.open("..", os.O_PATH | os.O_CLOEXEC, dir_fd=rootfs.fd)
    try:
        if _mount_id(rootfs.fd) == _mount_id(parent):
            raise ApplyError(f"{what}: {rootfs.path} is not a mount point in its namespace; nothing was changed")
    finally:
        os.close(parent)


def _on_deadline(signum, frame):
    raise DeadlineExceeded("the hook's deadline passed; every change was rolled back")


def _carry_out(plan: Plan, state: ContainerState, spec: Spec, settings: Settings, seconds: float) -> dict:
    """Join the container's mount namespace and apply; the report, never an exception (every
    change rolled back first). The caller returns to its own namespace afterwards (_own_place)."""
    signal.setitimer(signal.ITIMER_REAL, seconds)
    applier = rootfs = host_mountinfo = None
    keep_journal = False  # kept when something could not be undone: the next start finishes it
    started = time.perf_counter()
    try:
        try:
            own_namespace = os.stat("/proc/self/ns/mnt").st_ino
            bundle_rootfs = _identity(spec.rootfs)
            # Opened here, it reads the hook's own namespace after the join: which tmpfs is the host's.
            host_mountinfo = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
            _join_mount_namespace(state.pid)
            os.chdir("/")
            try:
                rootfs = Rootfs(spec.rootfs, labels.labeler_for(spec.mount_label))
            except OSError as e:
                raise ApplyError(f"{spec.rootfs}: cannot open the container's rootfs: {e.strerror}") from None
            _check_is_the_container(state.pid, own_namespace, bundle_rootfs, rootfs)
            applier = Applier(plan, state, spec, settings, rootfs)
            rootfs.guard = MountGuard(rootfs.fd, spec.rootfs, applier.undo.keep_fd(host_mountinfo))
            host_mountinfo = None  # the undo log's to close now
            pending = journal_directory(settings.inventory_cache)
            refused = applier.skipped.append  # what the hook did not write there: left alone, and said
            applier.undo.journal = Journal.start(pending, rootfs, lambda line: refused(f"{pending}/{line}"))
            ready = time.perf_counter()
            applier.run()
            signal.setitimer(signal.ITIMER_REAL, 0)
            applier.undo.commit()
            timings = applier.timings
            timings["setup"] = (ready - started) * 1e3  # join the namespace, the checks, the journal
            timings["operations"] = (time.perf_counter() - ready) * 1e3 - timings.get("ldconfig_wait", 0.0)
            report = {"ok": True, "skipped": applier.skipped, "left": applier.left, "timings": timings}
            if applier._ldcache is not None:  # who made ldconfig's sandbox: a server's helper, or a fork
                report["ldconfig_sandbox"] = "helper" if applier._ldcache.sandbox.via_helper else "fork"
            if applier.allowed:
                report["cgroup"] = (applier._cgroup_dir, applier.allowed)
            return report
        except BaseException:
            # Disarmed at once, and the error passed on to the rollback below: the one-shot alarm
            # may be run as this handler starts (an operation failing just as the deadline
            # passes), and its DeadlineExceeded then reaches the rollback instead of skipping it.
            signal.setitimer(signal.ITIMER_REAL, 0)
            raise
    except BaseException as e:
        signal.setitimer(signal.ITIMER_REAL, 0)  # the rollback itself must not be interrupted
        failures = applier.undo.rollback() if applier else []
        keep_journal = bool(failures)
        if isinstance(e, HookError):
            return {"ok": False, "error": e.message, "exit_code": e.exit_code, "undo_failures": failures}
        return {
            "ok": False,
            "error": f"internal error: {type(e).__name__}: {e}",
            "exit_code": Exit.INTERNAL,
            "undo_failures": failures,
        }
    finally:
        if applier:
            if applier.undo.journal:
                applier.undo.journal.close(keep=keep_journal)
            applier.undo.close()
        if rootfs is not None:
            rootfs.close()
        if host_mountinfo is not None:
            os.close(host_mountinfo)


class _own_place:
    """The hook's mount namespace, root and working directory, taken before it joins the
    container's and given back after, whatever happened there: everything after apply (the
    record, the log) must see the host. Not being able to go back is fatal: the process ends at
    once, before it writes anything anywhere."""

    def __enter__(self):
        flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
        self.namespace = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        self.root = os.open("/", flags)
        try:
            self.cwd = os.open(".", flags)
        except OSError:
            self.cwd = None  # a working directory removed meanwhile: "/" afterwards
        self.handler = signal.signal(signal.SIGALRM, _on_deadline)
        return self

    def __exit__(self, *exc):
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            _linux.setns(self.namespace, _linux.CLONE_NEWNS)
            # setns() put the root and the working directory at the namespace's root: the
            # runtime's own (a chroot, say) and the caller's are restored.
            os.fchdir(self.root)
            if _identity(".") != _identity("/"):
                os.chroot(".")
            os.fchdir(self.cwd if self.cwd is not None else self.root)
        except OSError as e:
            os.write(2, f"oci-gpu-hook: cannot return to the hook's own mount namespace: {e.strerror}\n".encode())
            os._exit(Exit.APPLY)
        for fd in (self.namespace, self.root, self.cwd):
            if fd is not None:
                os.close(fd)
        signal.signal(signal.SIGALRM, self.handler)
        return False


def _arm_kill(seconds: float):
    """A timer that SIGKILLs this process once seconds have passed (None where the kernel refuses
    one): the SIGALRM deadline cannot end a system call that waits for a hung FUSE or NFS source
    (the handler runs only when the call returns), but a fatal signal ends that wait. Without it
    the start hangs until the source answers where the runtime sets no hook timeout (dockerd's
    --gpus hook has none). The forked child had this from its parent; the kernel does it now,
    with no process to fork. Killed, the hook says nothing: the runtime reports a killed hook,
    the mounts die with the container's namespace and the journal lets the next start remove
    the files (docs/security.md)."""
    try:
        return _linux.kill_timer(seconds, signal.SIGKILL)
    except OSError:
        return None


def apply(plan: Plan, state: ContainerState, spec: Spec, settings: Settings, budget=None, meanwhile=None) -> dict:
    """Apply in this process; returns the report, or raises ApplyError (after the rollback).
    The apply gets what is left of the hook's budget (budget.Budget; all of deadline_seconds
    without one): its SIGALRM rolls back and fails the start. An operation the kernel does not
    let a signal interrupt (a hung FUSE or NFS source) holds the hook until _arm_kill's timer
    (or the runtime's hook timeout) kills it; its journal lets the next start remove what it made.
    meanwhile: called once the plan is applied, back in the hook's own namespace (work that needs
    no result of it); what it raises is the caller's."""
    if state.pid is None:
        raise ApplyError("the OCI state has no pid: the runtime must run the hook at prestart or createRuntime")
    seconds = settings.deadline_seconds if budget is None else budget.remaining()
    if seconds <= 0:
        raise DeadlineExceeded("the hook's deadline passed before the container was changed; nothing was done")
    killer = _arm_kill(seconds + _GRACE_SECONDS)
    with _own_place():
        try:
            report = _carry_out(plan, state, spec, settings, seconds)
        finally:
            if killer is not None:
                _linux.timer_delete(killer)
    if not report["ok"]:
        error = ApplyError(
            report["error"]
            + ("" if not report["undo_failures"] else f" (rollback incomplete: {'; '.join(report['undo_failures'])})")
        )
        error.exit_code = report["exit_code"]
        error.undo_failures = report["undo_failures"]
        raise error
    if "cgroup" in report:
        _tell_systemd(report, budget)
    if meanwhile is not None:
        meanwhile()
    return report


def _tell_systemd(report: dict, budget=None) -> None:
    """systemd's own view of a scope it owns gets the devices the hook allowed, so that a
    `systemctl daemon-reload` (which re-applies that view) keeps them (start/linux/systemd.py).
    Back in the hook's own mount namespace: systemd's socket and /run are the host's, never a
    path the container's namespace resolves. The apply has committed: the container has its
    devices and its record is still to be written, so nothing here may fail the start. Not
    telling systemd, for whatever reason (what its socket sent included), is a note in the log.
    The exchange gets systemd.TIMEOUT at most, and no more than is left of the hook's budget."""
    started = time.perf_counter()
    directory, allowed = report.pop("cgroup")
    try:
        from oci_gpu_hook.start.linux import systemd

        seconds = systemd.TIMEOUT if budget is None else min(systemd.TIMEOUT, budget.remaining())
        note = systemd.keep_devices(directory, allowed, timeout=seconds)
    except Exception as e:  # keep_devices says its own failures; this is for a bug around it
        note = f"systemd not told of the GPU nodes of {directory}: internal error: {type(e).__name__}: {e}"
    if note:
        report["skipped"].append(note)
    report["timings"]["systemd"] = (time.perf_counter() - started) * 1e3
