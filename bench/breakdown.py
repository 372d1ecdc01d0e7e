"""Where the time of one GPU start goes, for `make bench` (bench/run.py calls breakdown()).

Three sources, each measured, nothing estimated:
- the interpreter's own start: `python3 -IS -c pass`, the launcher's flags (a bench case);
- the imports before the GPU path (hook, prestart, state, spec, settings, report): a fresh
  interpreter that imports them and times itself, median of many;
- the rest from the hook's own log record of each timed start (`timings_ms`, prestart.py and
  apply.py): settings, the GPU path's imports, inventory and plan, apply (joining the container
  and the checks, the operations and what of ldconfig they did not hide, the rest: going back to
  the hook's own namespace and the container record's reads of /proc), the container record.
  Bookkeeping is what is left of the start's median wall time: reading the
  state and config.json, the log line, the process's exit.
"""

import json
import statistics
import subprocess

IMPORT_PROBE = r"""
import sys, time
start = time.perf_counter()
sys.path.append(sys.argv[1])
import oci_gpu_hook.hook, oci_gpu_hook.start.prestart, oci_gpu_hook.start.settings, oci_gpu_hook.start.report
print((time.perf_counter() - start) * 1e3)
"""


def import_ms(python: str, site: str, runs: int) -> float:
    """Median time to import what every GPU start imports before its GPU path, in a fresh
    interpreter started as the launcher starts it (-IS)."""
    times = [float(subprocess.run([python, "-IS", "-c", IMPORT_PROBE, site], capture_output=True, text=True,
                                  check=True).stdout) for _ in range(runs)]  # fmt: skip
    return statistics.median(times)


def logged(log: str, container_prefix: str) -> dict:
    """Median of each timings_ms figure over the log records of containers whose id starts with
    container_prefix (the bench names its containers by case)."""
    figures = {}
    with open(log) as f:
        for line in f:
            record = json.loads(line)
            if record.get("container", "").startswith(container_prefix) and "timings_ms" in record:
                for name, value in record["timings_ms"].items():
                    figures.setdefault(name, []).append(value)
    return {name: statistics.median(values) for name, values in figures.items()}


def sandboxes(log: str) -> dict:
    """{who made ldconfig's sandbox ("helper", "fork"): how many starts} over the start server's
    records: a warm spare's helper, or the worker's own fork where none was ready."""
    made = {}
    with open(log) as f:
        for line in f:
            record = json.loads(line)
            if record.get("via") == "start server" and "ldconfig_sandbox" in record:
                made[record["ldconfig_sandbox"]] = made.get(record["ldconfig_sandbox"], 0) + 1
    return made


def breakdown(total_ms: float, interpreter_ms: float, imports_ms: float, timings: dict) -> list:
    """[(part, ms, what it is)] of one start, in its order, adding up to total_ms (ldconfig's
    own time overlaps the mounts: only what they did not hide is a part)."""
    t = timings.get
    rows = [
        ("interpreter start (`python3 -IS -c pass`)", interpreter_ms, "the launcher's interpreter, no site"),
        ("imports before the GPU path", imports_ms, "hook, prestart, state, spec, settings, report"),
        ("settings", t("settings", 0.0), "the compiled configuration"),
        ("GPU path imports", t("imports", 0.0),
         "apply with ctypes and the Linux calls, inventory cache, request, plan"),
        ("inventory and plan", t("plan", 0.0), "the cached inventory, the request, the plan, memory limits"),
        ("apply: joining the container, the checks, the journal", t("apply_setup", 0.0),
         "setns through a pidfd, the pid check, the journal"),
        ("apply: mounts, device rules, ldconfig start", t("apply_operations", 0.0),
         "every operation of the plan, ldconfig's sandbox started after the libraries"),
        ("apply: ldconfig, what the mounts did not hide", t("apply_ldconfig_wait", 0.0),
         f"ldconfig took {t('apply_ldconfig', 0.0):.2f} ms in all"),
        ("apply: the rest", t("apply", 0.0) - t("apply_setup", 0.0) - t("apply_operations", 0.0)
         - t("apply_ldconfig_wait", 0.0), "back to the hook's own namespace; the record's reads of /proc"),
        ("container record", t("record", 0.0), "written here"),
    ]  # fmt: skip
    counted = sum(ms for _, ms, _ in rows)
    rows.append(("bookkeeping and the rest", total_ms - counted, "state and config.json, the log line, exit"))
    return [(part, round(ms, 2), why) for part, ms, why in rows]
