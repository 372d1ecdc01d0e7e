"""Steps run as a user runs them on a host whose configuration is the test's own: in a mount
namespace of their own (unshare), with a writable overlay over each directory named (/etc,
/usr/share/containers, /var/lib, ...) and a private tmpfs over each state directory named, so that
the runtimes read their real default files, `oci-gpu-hook install` writes where it writes on a
host, and nothing of it reaches the host (the namespace, and its mounts, go when its last process
ends). Importable from any test (pytest puts tests/ on sys.path); `python privatehost.py SPEC` is
what runs inside the namespace.

Steps (dicts, in order; run() returns one result for each):
- {"write": path, "text": text}: write a file (a runtime's setting the test gives, before the user
  starts); None.
- {"run": argv, "env": {...}}: run a command to its end; {"rc", "stdout", "stderr"}.
- {"tree": [paths], "contents": bool}: hookcheck.tree(path, contents) of each (contents: True
  unless said); {path: tree}.
- {"daemon": argv, "env": {...}, "ready": argv}: start a daemon, wait until `ready` exits 0; it is
  stopped (SIGTERM, then SIGKILL) after the last step. {"rc": 0} once ready, or the daemon's log.

Session: the same, held open: its steps run, then the test works with what they started (a
daemon's socket under work is reachable from outside the namespace) until it leaves the `with`;
then the daemons stop and the final steps run (uninstall, a tree to compare).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

USER_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LC_ALL": "C"}


def run(work: str, overlays, steps, tmpfs=(), timeout: float = 900) -> list:
    """Run steps in a private mount namespace with overlays (directories) and tmpfs (directories,
    those that exist); work: a directory of the test's own (the overlays' upper layers, the log)."""
    spec = os.path.join(work, "privatehost-spec.json")
    with open(spec, "w") as f:
        json.dump({"work": work, "overlays": list(overlays), "tmpfs": list(tmpfs), "steps": list(steps)}, f)
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-I",
                          os.path.abspath(__file__), spec], capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    with open(spec + ".results") as f:
        return json.load(f)


class Session:
    """with Session(work, overlays, steps, final, tmpfs) as session: ...; session.results: the
    steps' results then the final steps' (read them after the `with`; session.ready: the steps'
    results, inside it)."""

    def __init__(self, work: str, overlays, steps, final=(), tmpfs=()):
        self.work, self.results, self.ready = work, None, None
        self.spec = os.path.join(work, "privatehost-spec.json")
        with open(self.spec, "w") as f:
            json.dump({"work": work, "overlays": list(overlays), "tmpfs": list(tmpfs), "steps": list(steps),
                       "final": list(final), "serve": True}, f)  # fmt: skip
        self.process = None

    def __enter__(self) -> Session:
        self.process = subprocess.Popen(["unshare", "--mount", "--propagation", "private", sys.executable, "-I",
                                         os.path.abspath(__file__), self.spec], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        line = self.process.stdout.readline()
        if line != "ready\n":
            self.__exit__(None, None, None)
            ran = [r for r in self.results if isinstance(r, dict) and "rc" in r]  # not the trees
            raise AssertionError(f"privatehost: {line.strip()}; {ran}")
        with open(self.spec + ".ready") as f:
            self.ready = json.load(f)
        return self

    def __exit__(self, *exc) -> None:
        _, err = self.process.communicate(timeout=600)  # EOF on its stdin: it stops and finishes
        assert self.process.returncode == 0, err
        with open(self.spec + ".results") as f:
            self.results = json.load(f)


def _steps(steps, work: str, results: list, daemons: list) -> bool:
    """Run steps, appending their results; False when a daemon did not become ready."""
    import hookcheck

    for step in steps:
        env = step.get("env") or USER_ENV
        if "write" in step:
            os.makedirs(os.path.dirname(step["write"]), exist_ok=True)
            with open(step["write"], "w") as f:
                f.write(step["text"])
            results.append(None)
        elif "run" in step:
            out = subprocess.run(step["run"], env=env, capture_output=True, text=True, timeout=300,
                                 stdin=subprocess.DEVNULL)  # fmt: skip
            results.append({"rc": out.returncode, "stdout": out.stdout, "stderr": out.stderr})
        elif "tree" in step:
            results.append({p: hookcheck.tree(p, contents=step.get("contents", True)) for p in step["tree"]})
        elif "daemon" in step:
            log = open(f"{work}/daemon{len(daemons)}.log", "w")
            daemon = subprocess.Popen(step["daemon"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)  # fmt: skip
            daemons.append(daemon)
            deadline = time.monotonic() + 90
            ready = False
            while not ready and daemon.poll() is None and time.monotonic() < deadline:
                ready = subprocess.run(step["ready"], env=env, capture_output=True, timeout=30).returncode == 0
                time.sleep(0 if ready else 0.2)
            if not ready:
                with open(log.name) as f:
                    results.append({"rc": 1, "stdout": "", "stderr": f.read()[-3000:]})
                return False
            results.append({"rc": 0, "stdout": "", "stderr": ""})
    return True


def _stop(daemons: list) -> None:
    for daemon in reversed(daemons):
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    daemons.clear()


def _main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    work = spec["work"]
    for i, directory in enumerate(spec["overlays"]):
        upper, scratch = f"{work}/overlay{i}/upper", f"{work}/overlay{i}/work"
        os.makedirs(upper)
        os.makedirs(scratch)
        options = f"lowerdir={directory},upperdir={upper},workdir={scratch}"
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, directory], check=True)
    for directory in spec["tmpfs"]:
        if os.path.isdir(directory):
            subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "privatehost", directory], check=True)
    results, daemons = [], []
    try:
        ok = _steps(spec["steps"], work, results, daemons)
        if spec.get("serve"):
            with open(spec_path + ".ready", "w") as f:
                json.dump(results, f)
            print("ready" if ok else "a daemon did not start", flush=True)
            sys.stdin.read()  # until the test is done with what the steps started
    finally:
        _stop(daemons)
        try:
            _steps(spec.get("final", []), work, results, daemons)
        finally:
            _stop(daemons)
            with open(spec_path + ".results", "w") as f:
                json.dump(results, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # hookcheck, beside this file
    _main(sys.argv[1])
