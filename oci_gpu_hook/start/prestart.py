"""`oci-gpu-hook prestart` (also `createRuntime`): the hook itself, as the runtime runs it.

state (stdin) -> spec (config.json) -> request -> inventory (cache) -> plan -> apply -> report.
Standard library only, and a container that cannot be asking for a GPU leaves after reading two
small JSON documents, before any configuration file or inventory is read.
"""

from __future__ import annotations

import sys
import time

from oci_gpu_hook.errors import HookError, RequestError
from oci_gpu_hook.start import spec as spec_module
from oci_gpu_hook.start import state as state_module
from oci_gpu_hook.start.prefilter_rule import (
    CDI_ANNOTATION_PREFIX,
    CDI_DEVICE_ENV_PREFIX,
    LEGACY_VARIABLE,
    NO_DEVICES,
    VISIBLE_DEVICES,
)

# Why a rootless start keeps no record (docs/security.md: rootless podman): the node services
# read records as root, from root's directory alone; one that the user wrote would name pids and
# cgroups of the user's choosing to the watchdog, which kills processes.
NO_RECORD = ("none written: a rootless hook may not write root's records directory, and the node services "
             "read no record a user could write")  # fmt: skip


def may_ask_for_gpus(spec) -> bool:
    """False only when no setting could make this a GPU container. The compiled pre-filter
    (start/csrc/prefilter.c) applies the same test, built with prefilter_rule.py's values."""
    env = spec.env
    visible = env.get(VISIBLE_DEVICES)
    if visible is not None and visible.strip() and NO_DEVICES not in [v.strip() for v in visible.split(",")]:
        return True
    return (
        LEGACY_VARIABLE in env
        or any(key.startswith(CDI_DEVICE_ENV_PREFIX) for key in env)
        or any(key.startswith(CDI_ANNOTATION_PREFIX) for key in spec.annotations)
        or any(spec_module.volume_mount_device(m.destination) for m in spec.mounts)
    )


# What a GPU start imports after the pre-filter's test (_configure and what it calls): the start
# server imports them once, before its first worker (preload).
GPU_PATH_MODULES = (
    "oci_gpu_hook.start.report", "oci_gpu_hook.start.settings", "oci_gpu_hook.start.apply",
    "oci_gpu_hook.start.inventory_cache", "oci_gpu_hook.start.budget", "oci_gpu_hook.start.linux.arch",
    "oci_gpu_hook.start.linux.userns", "oci_gpu_hook.start.plan", "oci_gpu_hook.start.container_record",
    "oci_gpu_hook.start.memory_limit", "oci_gpu_hook.start.linux.systemd",
)  # fmt: skip


def preload() -> None:
    import importlib

    for name in GPU_PATH_MODULES:
        importlib.import_module(name)


def warm(config: str | None) -> None:
    """In a start server's spare worker, before its start comes: read the settings and the cached
    inventory that a start with this configuration reads, into memory (settings.keep_in_memory,
    inventory_cache.keep_in_memory), where the start finds them while they are still what the
    files hold. Anything that fails here is left for the start to meet and say."""
    from oci_gpu_hook.start import inventory_cache
    from oci_gpu_hook.start import settings as settings_module

    settings_module.keep_in_memory()
    inventory_cache.keep_in_memory()
    try:
        inventory_cache.read(settings_module.load(config, cache=True))
    except Exception:  # noqa: BLE001 - the start itself reads them again and reports
        pass


def collect_records(config: str | None, stop=None) -> None:
    """In a start server's idle spare worker: remove the records of containers that are gone
    (container_record.collect) from the directory this configuration names, once the readers have
    had KEEP_FOR_READERS_SECONDS to count them; stop: as collect's. Anything that fails here is
    left to the next look (a start's, a node service's)."""
    from oci_gpu_hook.start import container_record
    from oci_gpu_hook.start import settings as settings_module

    kept_since = time.time() - container_record.KEEP_FOR_READERS_SECONDS
    try:
        directory = settings_module.load(config, cache=True).records_path
        container_record.collect(directory, stop=stop, written_before=kept_since)
    except Exception:  # noqa: BLE001 - an untrusted directory, a configuration that fails: not ours to say
        pass


def run(config: str | None, stdin=None, since_process_start: bool = False, started: float | None = None) -> int:
    # How long the start took is counted from the process's start when the runtime started this
    # process for it, from started (time.monotonic()) when a start server's worker runs it for
    # the pre-filter that started then, from now when a caller runs it in-process.
    if started is None:
        started = None if since_process_start else time.monotonic()
    stdin = stdin if stdin is not None else sys.stdin.buffer
    container = state_module.parse(stdin.read(state_module.MAX_STATE_BYTES + 1))
    spec = spec_module.load(container.bundle)
    if not may_ask_for_gpus(spec):
        return 0
    from oci_gpu_hook.start import report
    from oci_gpu_hook.start import settings as settings_module

    settings = None
    try:
        clock = time.perf_counter()
        settings = settings_module.load(config, cache=True)  # the compiled copy is the hook's alone
        return _configure(container, spec, settings, started, {"settings": _since(clock)})
    except HookError as e:
        report.log(settings, container.id, "error", e.message, bundle=container.bundle)
        if settings is not None:  # a GPU start that failed (a bad request included): counted
            _keep_record(settings, container, spec, (), started, failure_code=e.exit_code)
        raise


def _configure(container, spec, settings, started: float | None, timings: dict) -> int:
    """timings: milliseconds spent so far by step, for the log record (docs/performance.md
    explains them); each step adds its own."""
    clock = time.perf_counter()
    from oci_gpu_hook.start import apply, inventory_cache, report
    from oci_gpu_hook.start.budget import Budget, process_age
    from oci_gpu_hook.start.linux import arch, userns
    from oci_gpu_hook.start.plan import decide

    timings["imports"] = _since(clock)
    clock = time.perf_counter()
    budget = None

    def inventory_for():
        nonlocal started, budget
        # Counted from the process start all the same; built only once the container asks for GPUs.
        if started is None:  # the process's own start, read from procfs once for the budget and the record
            started = time.monotonic() - process_age()
        budget = Budget(settings.deadline_seconds, age=time.monotonic() - started)
        arch.current()  # an unknown machine says so first, not through whatever fails next
        return inventory_cache.load(settings, budget)

    plan = decide(spec, settings, inventory_for)  # the one decision, as `plan` prints it
    if plan is None:
        return 0
    gpu_request, limits = plan.request, plan.memory_limits
    unprivileged = userns.unprivileged()
    if unprivileged and limits:
        # The watchdog enforces limits from the container record, which a rootless container
        # cannot have (_keep_record), whoever applied its devices: refused, not left unenforced.
        raise RequestError("a GPU memory limit applies to this container, and the watchdog that enforces it "
                           "cannot see a rootless container; run it with rootful podman")  # fmt: skip
    if plan.applied_by_runtime:
        # The runtime gave the devices (CDI): nothing to do but the record, where the node
        # services find the container (the watchdog its limits, the exporter its pod). In a
        # user namespace there is none (NO_RECORD), and the start goes on as the runtime made it.
        timings["plan"] = _since(clock)
        if not unprivileged:
            _keep_record(settings, container, spec, plan.devices, started, limits=limits, applied_by="runtime")
        said = f"no record: {NO_RECORD}" if unprivileged else "recorded"
        report.log(settings, container.id, "info", f"GPU devices applied by the runtime (CDI): {said}",
                      devices=[d.name for d in plan.devices], source=gpu_request.source,
                      timings_ms={k: round(v, 2) for k, v in timings.items()})  # fmt: skip
        return 0
    timings["plan"] = _since(clock)
    clock = time.perf_counter()
    prepared = []

    def prepare_record():  # the record's reads of /proc, once the plan is applied
        from oci_gpu_hook.start import container_record

        if unprivileged:
            return
        try:
            prepared.append(container_record.build(container, spec.annotations, plan.devices, 0.0, None, limits))
        except OSError:
            pass  # built again afterwards, where a failure is said

    result = apply.apply(plan, container, spec, settings, budget, meanwhile=prepare_record)
    timings["apply"] = _since(clock)
    timings.update(("apply_" + k, v) for k, v in result.get("timings", {}).items())
    clock = time.perf_counter()
    _keep_record(settings, container, spec, plan.devices, started, limits=limits, record=(prepared or [None])[0])
    timings["record"] = _since(clock)
    some_starts = {}  # the log record's fields that only some starts have
    if result.get("left") or unprivileged:  # said here once, for the whole start
        some_starts["left_to_runtime"] = list(result.get("left", ()))
    if unprivileged:
        some_starts["unprivileged"] = f"a user namespace ({userns.user()}): device nodes bind-mounted, never made"
        some_starts["left_to_runtime"].append(f"the container record: {NO_RECORD}")
    if "ldconfig_sandbox" in result:
        some_starts["ldconfig_sandbox"] = result["ldconfig_sandbox"]
    report.log(
        settings, container.id, "info", "GPU devices configured",
        devices=[d.name for d in plan.devices], operations=len(plan.operations), skipped=result["skipped"],
        notes=list(gpu_request.notes), timings_ms={k: round(v, 2) for k, v in timings.items()}, **some_starts,
    )  # fmt: skip
    return 0


def _since(clock: float) -> float:
    return (time.perf_counter() - clock) * 1e3


def _keep_record(settings, container, spec, devices, started: float | None, failure_code=None, limits=None,
                 record=None, applied_by: str = "hook") -> None:  # fmt: skip
    """The container record (container_record.py); like the log, it never fails a start.
    record: one built already (while the child worked), its duration still to fill in. None in a
    user namespace (NO_RECORD says why)."""
    from oci_gpu_hook.start.linux import userns

    if userns.unprivileged():
        return
    from oci_gpu_hook.start import container_record
    from oci_gpu_hook.start.budget import process_age

    duration = process_age() if started is None else time.monotonic() - started
    try:
        if record is None:
            record = container_record.build(container, spec.annotations, devices, duration, failure_code, limits,
                                            applied_by)  # fmt: skip
        else:
            record["duration_seconds"] = round(duration, 6)
        container_record.write(settings.records_path, record)
    except OSError as e:
        from oci_gpu_hook.start import report

        report.log(settings, container.id, "warning", f"the container record was not written: {e}")
