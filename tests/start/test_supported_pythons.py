"""The start path on every Python the project supports (3.9 to 3.13), run by that Python itself.

vermin reads the source for what each version lacks, but not everything: an annotation such as
`str | None` in a module without `from __future__ import annotations` is evaluated when the
function is defined, and fails on 3.9 (RHEL 9's Python), which vermin did not report. And the
start path imports CPython's C modules behind signal and socket (_signal, _socket; jsonio's _json
has its own test in test_jsonio.py) to save their imports (docs/performance.md, "Which path is the
fast path"): nothing documents their names, so each name the start path uses is asked of each
Python.
"""

from __future__ import annotations

import ast
import os

import pytest
import pythons

import oci_gpu_hook

PACKAGE = os.path.dirname(os.path.abspath(oci_gpu_hook.__file__))


def start_path_modules() -> list:
    """Every module of the start path (start/, and the hook's own hook.py, errors.py, frozen.py)."""
    names = ["oci_gpu_hook.hook", "oci_gpu_hook.errors", "oci_gpu_hook.frozen"]
    for directory, _, files in os.walk(os.path.join(PACKAGE, "start")):
        for file in sorted(f for f in files if f.endswith(".py")):
            parts = os.path.relpath(os.path.join(directory, file), os.path.dirname(PACKAGE))[:-3].split(os.sep)
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


def c_core_names() -> dict:
    """{C module: the names the start path uses from it} for each `import _signal as signal` (or
    plain `import _socket`) in the start path, read from the source."""
    used: dict = {}
    for name in start_path_modules():
        path = os.path.join(os.path.dirname(PACKAGE), *name.split(".")) + ".py"
        if not os.path.exists(path):
            path = path[:-3] + "/__init__.py"
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("_") and alias.name != "__future__":
                        aliases[alias.asname or alias.name] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                used.setdefault(aliases[node.value.id], set()).add(node.attr)
    return used


def test_the_source_reading_finds_the_c_cores():
    used = c_core_names()
    assert {"_signal", "_socket", "_json"} <= set(used), used
    assert {"setitimer", "SIGALRM", "pthread_sigmask"} <= used["_signal"]


@pytest.mark.parametrize("version", pythons.SUPPORTED)
def test_every_start_path_module_imports_and_finds_what_it_uses(require, version):
    python = pythons.interpreter(version)
    require(python)
    code = (
        f"import importlib\nfor name in {start_path_modules()!r}:\n    importlib.import_module(name)\n"
        f"missing = sorted(f'{{m}}.{{n}}' for m, names in {c_core_names()!r}.items()\n"
        "                 for n in names if not hasattr(importlib.import_module(m), n))\n"
        "print('missing:', ' '.join(missing))\n"
    )
    out = pythons.run(python, code)
    assert out.returncode == 0, out.stderr.decode(errors="replace").strip().splitlines()[-1]
    assert out.stdout.decode().split() == ["missing:"]
