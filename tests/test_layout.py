"""The folders are the budgets: the start path (start/, plus the shared errors.py and frozen.py)
imports nothing from toolkit/, node/ or cli/, and nothing outside the standard library. And no
module of the package reaches itself again through its imports: each layer reads those below it.
And the package ships no helper that only the tests and the bench use: those live in tests/.

Read from the source (every import statement, at module level or inside a function), so a lazy
import that a run never reaches is caught too.
"""

import ast
import importlib.util
import os
import re
import sysconfig

import pytest

import oci_gpu_hook

PACKAGE = os.path.dirname(os.path.abspath(oci_gpu_hook.__file__))
START = os.path.join(PACKAGE, "start")
SHARED = ("errors.py", "frozen.py")
# What of ours the start path may import (with what lies below): anything else is off limits.
ALLOWED_OURS = ("oci_gpu_hook.errors", "oci_gpu_hook.frozen", "oci_gpu_hook.start")
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


def module_name(path, package=PACKAGE):
    """oci_gpu_hook.start.plan for .../oci_gpu_hook/start/plan.py; a package is its __init__.py."""
    parts = os.path.relpath(path, os.path.dirname(package))[:-3].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def statements(path, package=PACKAGE):
    """(absolute module name, the names it imports or None for `import x`, line) for each import
    statement in the file, anywhere in it; relative ones resolved."""
    name = module_name(path, package)
    inside = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = inside[: len(inside) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            if module != "__future__":
                yield module, [alias.name for alias in node.names], node.lineno


def imports(path):
    """(absolute module name, line) for each import in the file. `from oci_gpu_hook.x import y`
    gives both oci_gpu_hook.x and oci_gpu_hook.x.y, as y may name a subpackage (the budget check
    errs on the side of refusing)."""
    for module, names, line in statements(path):
        yield module, line
        for alias in names or ():
            if module.startswith("oci_gpu_hook"):
                yield f"{module}.{alias}", line


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


def package_modules(package=PACKAGE):
    """{module name: path} for every module of the package."""
    found = {}
    for directory, _, names in os.walk(package):
        for n in names:
            if n.endswith(".py"):
                path = os.path.join(directory, n)
                found[module_name(path, package)] = path
    return found


def our_imports(path, modules, package=PACKAGE):
    """{module of ours this file imports: first line}. `from oci_gpu_hook.x import y` is an import
    of the submodule x.y where the package has one, else of x (y is a name defined there). A
    package's own __init__.py, which Python runs before any of its submodules, is not counted
    for them: it is no choice of the importing module's, and counting it would make every
    package whose __init__ imports a child a circle."""
    found = {}
    for module, names, line in statements(path, package):
        if not is_ours(module):
            continue
        targets = [module] if names is None else [f"{module}.{n}" if f"{module}.{n}" in modules else module
                                                  for n in names]  # fmt: skip
        for target in targets:
            found.setdefault(target, line)
    return found


def import_graph(package=PACKAGE):
    """({module: {module of ours it imports: line}}, {module: path}) for every module of the package."""
    modules = package_modules(package)
    return {name: our_imports(path, modules, package) for name, path in modules.items()}, modules


def circles(graph):
    """The strongly connected components of more than one module, or of one that imports itself
    (Tarjan's algorithm, iterative), each sorted, the list sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for succ in edges:
                if succ not in graph:
                    continue  # an import of something the package lacks fails elsewhere
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        found.append(sorted(component))
    return sorted(found)


def describe(component, graph, modules):
    """Each import that keeps the circle closed, as file:line: module."""
    inside = set(component)
    return [
        f"{os.path.relpath(modules[a], PACKAGE)}:{line}: {b}"
        for a in component
        for b, line in sorted(graph[a].items())
        if b in inside
    ]


def test_no_module_reaches_itself_through_its_imports():
    """A circle makes the order of imports matter and ties layers that should read one way
    (start/ <- toolkit/ <- cli/; pipeline stages in their order) together. Lazy imports count:
    they only move the circle to run time."""
    graph, modules = import_graph()
    found = circles(graph)
    assert not found, "import circles:\n" + "\n\n".join("\n".join(describe(c, graph, modules)) for c in found)


def test_the_circle_check_sees_what_it_must_refuse(tmp_path):
    """The graph's own check, on a package of files: a circle through a lazy, relative import and
    a `from package import submodule`; one through a name a package's __init__.py defines; a
    module importing itself. And none where a package's __init__.py imports a child that imports
    a sibling (Python runs the package first; the child did not choose it)."""
    root = tmp_path / "oci_gpu_hook"
    (root / "p").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from oci_gpu_hook.p import b\n",  # the submodule p.b, not the package p
        "p/__init__.py": "from oci_gpu_hook.p.c import NAME\n\ndef g():\n    from . import d\n",
        "p/b.py": "def f():\n    from ..a import x\n",  # a name in a: an import of a
        "p/c.py": "NAME = 1\nfrom oci_gpu_hook.p import f\n",  # the sibling p.f: no edge to p
        "p/d.py": "import json\nfrom oci_gpu_hook.p import NAME\n",  # a name p defines: an edge to p
        "p/f.py": "",
        "e.py": "import oci_gpu_hook.e\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    graph = import_graph(str(root))[0]
    assert graph["oci_gpu_hook.a"] == {"oci_gpu_hook.p.b": 1}
    assert graph["oci_gpu_hook.p.c"] == {"oci_gpu_hook.p.f": 2}
    assert graph["oci_gpu_hook.p.d"] == {"oci_gpu_hook.p": 2}
    assert circles(graph) == [
        ["oci_gpu_hook.a", "oci_gpu_hook.p.b"],
        ["oci_gpu_hook.e"],
        ["oci_gpu_hook.p", "oci_gpu_hook.p.d"],
    ]


# --- what the package ships -----------------------------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the product names what it runs besides its own code: its console script, the RPM's %check.
PRODUCT_FILES = ("pyproject.toml", "rpm/oci-gpu-hook.spec", "deploy/build-image.py")


def python_files(top: str):
    for directory, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        yield from (os.path.join(directory, f) for f in sorted(files) if f.endswith(".py"))


def names_used(paths, strings: bool) -> set:
    """Every name the files use: variables, attributes, imported names (and, with strings, string
    constants that are identifiers: getattr and the like)."""
    used = set()
    for path in paths:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.alias):
                used.add(node.name.rsplit(".", 1)[-1])
            elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
                used.update(w for w in node.value.split() if w.isidentifier())
    return used


def helpers_only_tests_use(package: str, users, product_files=()) -> list:
    """module:name of each public function or class at a module's top level that nothing of the
    package (nor its product files) names but the tests or the bench do. A decorated definition is
    used by its decorator (a click command); generated gRPC stubs are left out."""
    modules = [p for p in python_files(package) if "_pb2" not in os.path.basename(p)]
    in_package = names_used(modules, strings=True)
    for path in product_files:
        with open(path) as f:
            in_package.update(re.findall(r"\w+", f.read()))
    in_users = names_used([p for top in users for p in python_files(top)], strings=False)
    found = []
    for path in modules:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in tree.body:
            if (isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")
                    and not node.decorator_list and node.name not in in_package and node.name in in_users):  # fmt: skip
                found.append(f"{os.path.relpath(path, os.path.dirname(package))}:{node.name}")
    return found


def test_the_package_ships_no_helper_only_tests_use():
    """Issue 40, item 8: ldconfig.build_cache, containers.runc_detached and hold_namespace shipped
    in the package and ran only in tests. A test helper belongs with the tests' (hookcheck.py,
    kubeletcheck.py, ...; the bench imports those too)."""
    found = helpers_only_tests_use(PACKAGE, [os.path.join(REPO, "tests"), os.path.join(REPO, "bench")],
                         [os.path.join(REPO, p) for p in PRODUCT_FILES])  # fmt: skip
    assert not found, "used by tests alone, yet shipped in the package: " + ", ".join(found)


def test_the_helper_check_sees_what_it_must_refuse(tmp_path):
    """A function only a test calls is found; one the package calls, a click command (decorated),
    one that a product file names, a private one and a class the package names are not."""
    package, tests = tmp_path / "oci_gpu_hook", tmp_path / "tests"
    package.mkdir()
    tests.mkdir()
    (package / "m.py").write_text(
        "import click\n\ndef for_tests(): pass\ndef used(): pass\ndef checked(): pass\ndef _private(): pass\n"
        "class Named: pass\n\n@click.command()\ndef command(): used()\n"
    )
    (package / "n.py").write_text("from oci_gpu_hook.m import Named\n")
    (tmp_path / "spec").write_text("%check\npython3 -c 'from oci_gpu_hook import m; m.checked()'\n")
    (tests / "test_m.py").write_text(
        "from oci_gpu_hook import m\n\nm.for_tests(); m.used(); m.checked(); m._private(); m.command(); m.Named()\n"
    )
    found = helpers_only_tests_use(str(package), [str(tests)], [str(tmp_path / "spec")])
    assert found == ["oci_gpu_hook/m.py:for_tests"]


def duplicate_test_modules(tests: str) -> list:
    """Test modules under tests that share a file name: pytest imports each by its name alone
    (there is no package above them), so the second is not collected and the whole run stops."""
    seen: dict = {}
    for directory, dirs, files in os.walk(tests):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                seen.setdefault(name, []).append(os.path.relpath(os.path.join(directory, name), tests))
    return sorted(" and ".join(sorted(paths)) for paths in seen.values() if len(paths) > 1)


def test_no_two_test_modules_share_a_name():
    """CI found tests/node/test_gate_report.py and tests/e2e/test_gate_report.py: 'import file
    mismatch', and no test ran."""
    assert duplicate_test_modules(os.path.join(REPO, "tests")) == []


def test_the_name_check_sees_a_shared_name(tmp_path):
    for directory in ("node", "e2e"):
        (tmp_path / directory).mkdir()
        (tmp_path / directory / "test_same.py").write_text("")
    (tmp_path / "e2e" / "test_other.py").write_text("")
    assert duplicate_test_modules(str(tmp_path)) == ["e2e/test_same.py and node/test_same.py"]
