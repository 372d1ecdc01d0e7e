"""bench/results.json, written in parts: bench/run.py writes the whole file, and each part that runs
on its own (bench/soak.py, bench/cdi.py, bench/concurrent_starts.py) replaces its own key alone,
keeping the rest."""

import json
import os


def save_part(path: str, key: str, part) -> None:
    doc = {}
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
    doc[key] = part
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
