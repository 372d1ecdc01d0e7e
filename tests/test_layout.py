"""The folders are the budgets: the start path (start/, plus the shared errors.py and record.py)
imports nothing from toolkit/, node/ or cli/, and nothing outside the standard library.

Read from the source (every import statement, at module level or inside a function), so a lazy
import that a run never reaches is caught too.
"""

import ast
import importlib.util
import os
import sysconfig

import pytest

import oci_gpu_hook

PACKAGE = os.path.dirname(os.path.abspath(oci_gpu_hook.__file__))
START = os.path.join(PACKAGE, "start")
SHARED = ("errors.py", "record.py")
# What of ours the start path may import (with what lies below): anything else is off limits.
ALLOWED_OURS = ("oci_gpu_hook.errors", "oci_gpu_hook.record", "oci_gpu_hook.start")
# The two places where the start path may load more than the standard library, both lazily and
# both only when a cache is stale: nvml.py's child process (a separate interpreter, with what is
# left of the budget) loads NVIDIA's bindings when the inventory cache is; settings.py loads YAML
# and jsonschema on the first start after the configuration file changed (it then keeps a
# compiled JSON copy that later starts read).
EXEMPT = {("start/nvml.py", "pynvml"), ("start/settings.py", "yaml"), ("start/settings.py", "jsonschema")}


def start_path_files():
    files = [os.path.join(PACKAGE, name) for name in SHARED]
    for directory, _, names in os.walk(START):
        files += [os.path.join(directory, n) for n in names if n.endswith(".py")]
    return sorted(files)


def imports(path):
    """(absolute module name, line) for each import in the file; relative ones resolved."""
    relative = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].split(os.sep)
    if relative[-1] == "__init__":
        relative = relative[:-1]
    else:
        relative = relative[:-1]  # the module's package
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = relative[: len(relative) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            if module == "__future__":
                continue
            yield module, node.lineno
            for alias in node.names:  # `from oci_gpu_hook import toolkit` names a subpackage
                if module.startswith("oci_gpu_hook"):
                    yield f"{module}.{alias.name}", node.lineno


def is_ours(module):
    return module == "oci_gpu_hook" or module.startswith("oci_gpu_hook.")


def allowed_ours(module):
    return module == "oci_gpu_hook" or any(module == a or module.startswith(a + ".") for a in ALLOWED_OURS)


def is_stdlib(module):
    top = module.split(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None:
        return False
    if spec.origin in ("built-in", "frozen"):
        return True
    origin = os.path.realpath(spec.origin or "")
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    platstdlib = os.path.realpath(sysconfig.get_paths()["platstdlib"])
    return (origin.startswith(stdlib + os.sep) or origin.startswith(platstdlib + os.sep)) and (
        "site-packages" not in origin and "dist-packages" not in origin
    )


@pytest.mark.parametrize("path", start_path_files(), ids=lambda p: os.path.relpath(p, PACKAGE))
def test_the_start_path_imports_only_itself_and_the_standard_library(path):
    where = os.path.relpath(path, PACKAGE)
    wrong = []
    for module, line in imports(path):
        if is_ours(module):
            if not allowed_ours(module):
                wrong.append(f"{where}:{line}: {module} (toolkit, node and cli are not on the start path)")
        elif (where, module.split(".")[0]) not in EXEMPT and not is_stdlib(module):
            wrong.append(f"{where}:{line}: {module} (not the standard library)")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_what_it_must_refuse(tmp_path):
    """The rule's own check: it flags a toolkit import inside a function and a third-party
    module, and passes a stdlib one (so the test above cannot pass by seeing nothing)."""
    bad = tmp_path / "probe.py"
    bad.write_text("import json\n\ndef f():\n    from oci_gpu_hook.toolkit import doctor\n    import yaml\n")
    found = {m: allowed_ours(m) if is_ours(m) else is_stdlib(m) for m, _ in imports(str(bad))}
    assert found == {"json": True, "oci_gpu_hook.toolkit": False, "oci_gpu_hook.toolkit.doctor": False,
                     "yaml": False}  # fmt: skip


def test_the_entry_point_reaches_click_only_for_people():
    """hook.py may load cli/ (commands for people) but nothing else outside the start path."""
    path = os.path.join(PACKAGE, "hook.py")
    ours = {m for m, _ in imports(path) if is_ours(m)}
    people = {m for m in ours if m == "oci_gpu_hook.cli" or m.startswith("oci_gpu_hook.cli.")}
    assert people, "hook.py no longer dispatches to cli/: update this test"
    assert {m for m in ours - people if not allowed_ours(m)} == set()
    others = {m for m, _ in imports(path) if not is_ours(m)}
    assert all(is_stdlib(m) for m in others), others
