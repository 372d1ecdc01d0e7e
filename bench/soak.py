"""The start server held over time, for `make bench` (issue 51; root, runc, gcc, busybox-static):
`--starts` served starts (10,000 by default) through runc, the pre-filter and the server, with
create/delete churn, GPU and not, refused and killed (tests/soakcheck.py runs them, in a private
mount namespace of its own), the server probed every `--every` served starts while nothing runs.

Judged from the sample taken after the first 10% of the starts (the warm-up) on: its resident
size within 5% of that sample's, its descriptors, children and mounts exactly that sample's; no
zombie among its children and no journal left pending in any sample; the records of containers
that are gone never past the hook's own bound (it collects them above 512: soakcheck.records_bound)
while starts come, and none written over container_record.KEEP_FOR_READERS_SECONDS ago left once
the server has been idle a moment (its spare collects them).

The server runs with soakcheck.GC_TRACE: serve() freezes what exists and disables the collector
(server.py), so a cycle made per offer would never be freed; the trace says how many objects the
server made since and still holds, every 50 offers, and what a collection at its exit finds
unreachable (--plain-server leaves it out). Writes the "soak" part of bench/results.json (the
rest is bench/run.py's, kept) and prints a table; docs/performance.md ("Soak") explains it.
"""

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(1, os.path.join(REPO, "tests"))  # tests/soakcheck.py: shared with the reliability test

import results  # noqa: E402 - bench/results.py, beside this file
import soakcheck  # noqa: E402

WORK_PARENT = "/var/tmp"
RSS_LIMIT = 0.05
WARMUP_SHARE = 0.10
COLUMNS = (("served", "served", 7), ("seconds", "s", 6), ("rss_kib", "RSS KiB", 8), ("fds", "fds", 4),
           ("children", "children", 8), ("zombies", "zombies", 7), ("mounts", "mounts", 6),
           ("journals", "journals", 8), ("gone_records", "gone records", 12))  # fmt: skip


def row(line: str) -> None:
    """A probe's sample (a JSON line from the soak) as a row of the table; any other line as it is."""
    try:
        sample = json.loads(line)
    except ValueError:
        print(line, flush=True)
        return
    print(" ".join(f"{sample[key]:>{width}}" for key, _, width in COLUMNS), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--starts", type=int, default=10_000, help="served starts (offered to the server)")
    parser.add_argument("--every", type=int, default=250, help="served starts between two probes")
    parser.add_argument("--plain-server", action="store_true", help="the server without soakcheck.GC_TRACE")
    parser.add_argument("--output", default=os.path.join(HERE, "results.json"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the soak needs root (runc, a mount namespace, cgroups)")
    warmup = max(args.every, int(args.starts * WARMUP_SHARE))
    if args.starts < warmup + args.every:
        raise SystemExit(f"--starts {args.starts}: too few to judge anything after a warm-up of {warmup}")
    work = tempfile.mkdtemp(prefix="oci-gpu-hook-soak-", dir=WORK_PARENT)
    try:
        print(f"{args.starts} served starts, the server probed every {args.every} (its first row: before any)")
        print(" ".join(f"{title:>{width}}" for _, title, width in COLUMNS), flush=True)
        result = soakcheck.soak(work, args.starts, args.every, patch="" if args.plain_server else soakcheck.GC_TRACE,
                                timeout=24 * 3600, progress=row)  # fmt: skip
    finally:
        shutil.rmtree(work)
    samples = result["samples"]
    checks = soakcheck.verdicts(samples, warmup, RSS_LIMIT, RSS_LIMIT, soakcheck.records_bound())
    left, idle = result["stale_records_after_idle"], result["idle_seconds_to_collect"]
    checks["no record of a gone container once idle, past the readers' time"] = {
        "ok": left == 0, "why": f"{left} left after {idle} s idle"}  # fmt: skip
    checks["every container's life cycle went as its kind should"] = {
        "ok": not result["errors"], "why": f"{len(result['errors'])} did not: {result['errors'][:5]}"}  # fmt: skip
    seconds = samples[-1]["seconds"]
    soak = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["bench/soak.py", *sys.argv[1:]]),
        "starts": result["served"],
        "containers": result["containers"],
        "run_by_the_servers_workers": result["starts_run_by_workers"],
        "threads": result["threads"],
        "cycle": result["cycle"],
        "every": args.every,
        "warmup_starts": warmup,
        "seconds": seconds,
        "served_per_second": result["served"] / seconds if seconds else None,
        "samples": samples,
        "verdicts": checks,
        "errors": result["errors"],
        "server_log": result["server_log"],
        "gc": result.get("gc"),
        "gone_records_after_idle": result["gone_records_after_idle"],
        "stale_records_after_idle": result["stale_records_after_idle"],
        "idle_seconds_to_collect": result["idle_seconds_to_collect"],
    }
    results.save_part(args.output, "soak", soak)
    print(f"{result['served']} served starts ({result['containers']} containers, {result['starts_run_by_workers']} "
          f"run by the server's workers) in {seconds:.0f} s; judged after {warmup}")  # fmt: skip
    gc = result.get("gc")
    if gc:
        first, last = gc["offers_tracked_gen0"][0], gc["offers_tracked_gen0"][-1]
        print(
            f"the server's collector (disabled): objects tracked outside the frozen ones {first[1]} after "
            f"{first[0]} offers, {last[1]} after {last[0]} (generation-0 count {first[2]} -> {last[2]}); "
            f"a collection at its exit found {gc['unreachable_at_exit']} unreachable {gc['unreachable_kinds']}"
        )
    for name, check in checks.items():
        print(f"{'met ' if check['ok'] else 'MISSED'} {name}: {check['why']}")
    print(f"wrote the soak to {args.output}")


if __name__ == "__main__":
    main()
