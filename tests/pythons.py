"""The Pythons the project supports (pyproject.toml: requires-python >= 3.9; RHEL 9's is 3.9), each
as an interpreter on this machine, for the tests that run the start path on every one of them:
it leans on CPython's C modules behind json, signal and socket (_json, _signal, _socket), whose
names no documentation promises (docs/performance.md, "Which path is the fast path").

Found in pyenv's versions (this project's machines come with 3.9 to 3.13 there; Debian 12 packages
only 3.11), else as python3.N in /usr/bin or /usr/local/bin; CI requires every one of them. Never
through pyenv's shims: a shim of a version that pyenv has not selected answers "command not
found" instead of running it.
"""

from __future__ import annotations

import glob
import os
import subprocess

SUPPORTED = ("3.9", "3.10", "3.11", "3.12", "3.13")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def interpreter(version: str) -> str:
    """The path of a Python `version` here; where there is none, a path that does not exist,
    which the require fixture then names as missing."""
    pyenv = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    found = sorted(glob.glob(os.path.join(pyenv, "versions", f"{version}.*", "bin", f"python{version}")))
    found += [p for p in (f"/usr/bin/python{version}", f"/usr/local/bin/python{version}") if os.path.isfile(p)]
    return found[-1] if found else f"/usr/bin/python{version}"


def run(python: str, code: str, data: bytes = b"") -> subprocess.CompletedProcess:
    """code run by python as the hook runs (-I -S: no site, no user paths), with this checkout first
    on its path and nothing else of the environment's; data on its stdin."""
    prelude = f"import sys; sys.path.insert(0, {REPO!r})\n"
    return subprocess.run([python, "-I", "-S", "-c", prelude + code], input=data, capture_output=True, timeout=120)
