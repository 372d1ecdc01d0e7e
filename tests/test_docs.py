"""What the README and docs/ list that the code or the tree also says, read from both sides: a list
kept by hand in two places drifts (review 4 found the README's packages, folders and commands
behind the code, and four DaemonSets in the docs where deploy/kubernetes/ is the one tested).
Each test parses the doc and the thing it mirrors, and names what differs."""

import fnmatch
import glob
import json
import os
import re

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "oci_gpu_hook")
MANIFESTS = os.path.join(REPO, "deploy", "kubernetes")
# Objects that run pods: a doc showing one of these for the node services is a second DaemonSet.
WORKLOAD_KINDS = {"Pod", "Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job", "CronJob"}


def read(path):
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def doc_paths():
    paths = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
    assert len(paths) > 10, paths
    return paths


def fenced_blocks(text):
    """(language, dedented body, line number) of every fenced block, indented ones (in a list item)
    included."""
    blocks = []
    for m in re.finditer(r"^( *)```([^\n`]*)\n(.*?)^\1```[ \t]*$", text, re.M | re.S):
        indent = len(m.group(1))
        body = "".join(line[indent:] if line[:indent].isspace() else line for line in m.group(3).splitlines(True))
        blocks.append((m.group(2).strip(), body, text.count("\n", 0, m.start()) + 1))
    return blocks


def table_rows(text, header):
    """The cells of each row of the markdown tables whose header row starts with header."""
    rows, inside = [], False
    for line in text.splitlines():
        if line.startswith(header):
            inside = True
        elif inside and line.startswith("|"):
            if not line.startswith("|---"):
                rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
        else:
            inside = False
    return rows


def ticked(text):
    return re.findall(r"`([^`]+)`", text)


# --- One manifest set: deploy/kubernetes/ --------------------------------------------------------


def manifest_kinds():
    kinds = set()
    for path in glob.glob(os.path.join(MANIFESTS, "*.yaml")):
        with open(path) as f:
            kinds.update(doc["kind"] for doc in yaml.safe_load_all(f) if doc)
    assert {"DaemonSet", "ConfigMap", "Namespace"} <= kinds, kinds
    return kinds


def _runs_oci_gpu_hook(node):
    """Does this parsed YAML hold a container that runs oci-gpu-hook (its image or its command)?"""
    if isinstance(node, dict):
        image = node.get("image")
        command = node.get("command")
        if isinstance(image, str) and "oci-gpu-hook" in image:
            return True
        if isinstance(command, list) and command and os.path.basename(str(command[0])) == "oci-gpu-hook":
            return True
        return any(_runs_oci_gpu_hook(v) for v in node.values())
    if isinstance(node, list):
        return any(_runs_oci_gpu_hook(v) for v in node)
    return False


def manifests_in(text, refused_kinds):
    """Where a doc's text carries a manifest of the node services: an object of a kind that
    deploy/kubernetes/ holds or any workload (read from the text, so a block that does not parse
    counts too), or any fragment with a container that runs oci-gpu-hook."""
    found = []
    for language, body, line in fenced_blocks(text):
        if language not in ("", "yaml", "yml", "json"):
            continue
        if re.search(r"^\s*apiVersion:", body, re.M):
            kinds = set(re.findall(r"^\s*kind:\s*([A-Za-z]+)\s*$", body, re.M)) & refused_kinds
            found += [f"line {line}: a {kind}" for kind in sorted(kinds)]
        try:
            documents = list(yaml.safe_load_all(body))
        except yaml.YAMLError:
            documents = []
            if re.search(r"^\s*-?\s*image:.*oci-gpu-hook", body, re.M):
                found.append(f"line {line}: a container of oci-gpu-hook's image")
        if _runs_oci_gpu_hook(documents):
            found.append(f"line {line}: a container that runs oci-gpu-hook")
    return found


def test_no_doc_carries_a_node_services_manifest():
    """The DaemonSet, its ConfigMap, namespace and Service are deploy/kubernetes/'s alone (tested by
    tests/deploy and tests/e2e/test_deploy.py): a doc explains them and links there. A copy in a
    doc drifts from them (other namespaces, an image 'not published') and, applied beside them,
    registers nvidia.com/gpu twice and binds port 9400 twice. Other objects a doc may show (an
    OpenShift MachineConfig or SCC, a user's GPU pod spec) have no counterpart there."""
    refused = manifest_kinds() | WORKLOAD_KINDS
    found = {path: manifests_in(read(path), refused) for path in doc_paths()}
    assert {path: where for path, where in found.items() if where} == {}


def test_the_manifest_check_sees_what_it_refuses():
    """The check above, shown a manifest each way it looks for one (a DaemonSet, a ConfigMap, a
    list-item fragment of a container, in a list item's indented block), finds every one."""
    text = (
        "Text.\n\n```yaml\napiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: x}\n---\n"
        "apiVersion: v1\nkind: ConfigMap\n```\n\n"
        "1. a step:\n\n   ```yaml\n   - name: watchdog\n     image: registry.example.com/oci-gpu-hook:0.1.0\n   ```\n\n"
        '```json\n{"command": ["/usr/bin/oci-gpu-hook", "exporter"]}\n```\n'
        "```yaml\napiVersion: machineconfiguration.openshift.io/v1\nkind: MachineConfig\n```\n"
    )
    found = manifests_in(text, manifest_kinds() | WORKLOAD_KINDS)
    assert found == ["line 3: a ConfigMap", "line 3: a DaemonSet", "line 14: a container that runs oci-gpu-hook",
                     "line 19: a container that runs oci-gpu-hook"]  # fmt: skip


def test_the_docs_point_to_the_one_manifest_set():
    """Each page that explains a part of the DaemonSet names the file it is in, and make image;
    each that explains the labels' pod (its own since issue 46) names its file too."""
    for path in ("docs/deploy.md", "docs/kubernetes.md", "docs/monitoring.md", "docs/watchdog.md"):
        text = read(path)
        assert "deploy/kubernetes/30-daemonset.yaml" in text or "`30-daemonset.yaml`" in text, path
        assert "make image" in text, path
    for path in ("docs/deploy.md", "docs/kubernetes.md", "docs/monitoring.md", "docs/security.md"):
        text = read(path)
        assert "deploy/kubernetes/31-labels.yaml" in text or "`31-labels.yaml`" in text, path


# --- The README's install table: scripts/setup-host.sh and pyproject.toml -------------------------


def setup_host_lists():
    text = read("scripts/setup-host.sh")
    demo = re.search(r'^demo="([^"]*)"$', text, re.M).group(1).split()
    test = re.search(r'^\s*test\) packages="\$demo ([^"]*)"', text, re.M).group(1).split()
    return demo, test


def install_rows():
    rows = {row[0]: row for row in table_rows(read("README.md"), "| command | Debian packages |")}
    assert set(rows) >= {"`make demo`", "`make test`"}, rows
    return rows["`make demo`"], rows["`make test`"]


def test_the_readmes_debian_packages_are_setup_hosts():
    demo, test = setup_host_lists()
    demo_row, test_row = install_rows()
    assert ticked(demo_row[1]) == demo
    assert test_row[1].startswith("the demo's, and ")
    assert sorted(ticked(test_row[1])) == sorted(test)
    assert len(set(test)) == len(test)


def test_the_readmes_rhel_line_is_setup_hosts():
    script = re.search(r"^# RHEL 9 equivalent: (dnf install .*)$", read("scripts/setup-host.sh"), re.M).group(1)
    assert f"(`{script}`)" in read("README.md")


def test_the_readmes_python_packages_are_pyprojects():
    from oci_gpu_hook.toolkit.runtime_config import load_toml

    project = load_toml(read("pyproject.toml"))["project"]

    def names(requirements):
        return sorted(re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements)

    extras = project["optional-dependencies"]
    test = [r for r in extras["test"] if not r.startswith("oci-gpu-hook")] + extras["kubernetes"]
    demo_row, test_row = install_rows()
    assert sorted(n.lower() for n in ticked(demo_row[2])) == names(project["dependencies"])
    assert sorted(n.lower() for n in ticked(test_row[2])) == names(test)


# --- The README's layout: the tree ---------------------------------------------------------------


def _layout_block():
    text = read("README.md")
    blocks = [body for _, body, _ in fenced_blocks(text) if body.startswith("oci_gpu_hook/\n")]
    assert len(blocks) == 1, "the README's layout block"
    return text, blocks[0]


def _ignored(name):
    patterns = [p.strip().rstrip("/") for p in read(".gitignore").splitlines() if p.strip()]
    return name.startswith(".") or any(fnmatch.fnmatch(name, p) for p in patterns)


def test_the_readmes_layout_is_the_package():
    text, block = _layout_block()
    folders = set(re.findall(r"^  (\w+)/ ", block, re.M))
    real = {n for n in os.listdir(PACKAGE) if os.path.isdir(os.path.join(PACKAGE, n)) and not _ignored(n)}
    assert folders == real
    modules = set(re.findall(r"^  (\w+\.py) ", block, re.M))
    assert modules <= set(os.listdir(PACKAGE))
    # A number of folders, where the text gives one, is the number listed.
    words = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7}
    for word in re.findall(r"Layout: (\w+) folders", text):
        assert words.get(word) == len(folders), f"'Layout: {word} folders' lists {len(folders)}"


def test_the_readmes_test_folders_and_top_folders_are_the_tree():
    text = read("README.md")
    paragraph = re.search(r"^- Tests mirror the tree:(.*?)^- ", text, re.M | re.S).group(1)
    named = set(re.findall(r"`(tests/[\w/]+)`", paragraph))
    real = set()
    for directory, subdirs, files in os.walk(os.path.join(REPO, "tests")):
        subdirs[:] = [d for d in subdirs if not _ignored(d)]
        if directory != os.path.join(REPO, "tests") and any(f.startswith("test_") for f in files):
            real.add(os.path.relpath(directory, REPO))
    assert named == real
    beside = set(re.findall(r"`(\w[\w.]*)/`", paragraph.split("beside them")[0].rsplit(";", 1)[1]))
    top = {n for n in os.listdir(REPO) if os.path.isdir(os.path.join(REPO, n)) and not _ignored(n)}
    assert beside | {"oci_gpu_hook", "tests"} == top


# --- The commands: the CLI ------------------------------------------------------------------------


def cli_commands():
    """Every command path of the CLI, with whether it is hidden: {"inventory refresh": False, ...}."""
    import click

    from oci_gpu_hook.cli import cli

    found = {}

    def walk(group, prefix):
        for name, command in group.commands.items():
            if isinstance(command, click.Group):
                walk(command, prefix + name + " ")
            else:
                found[prefix + name] = command.hidden

    walk(cli, "")
    assert len(found) > 15, found
    return found


def _command_path(snippet, commands):
    """'oci-gpu-hook simulate DIR [--gpus N]' -> 'simulate'; 'inventory refresh' -> itself."""
    words = snippet.split()
    if words and words[0] == "oci-gpu-hook":
        words = words[1:]
    path = []
    for word in words:
        if not re.fullmatch(r"[a-z][A-Za-z-]*", word):
            break
        path.append(word)
        if " ".join(path) in commands:
            return " ".join(path)
    return " ".join(path)


def test_the_readmes_commands_are_the_clis():
    commands = cli_commands()
    rows = table_rows(read("README.md"), "| command | what it does |")
    listed = {_command_path(s, commands) for row in rows for s in ticked(row[0])}
    assert listed <= set(commands), listed - set(commands)
    assert {c for c, hidden in commands.items() if not hidden} <= listed


def test_cli_md_has_a_section_for_every_command():
    commands = cli_commands()
    headings = re.findall(r"^## (.+)$", read("docs/cli.md"), re.M)
    listed = {p.strip() for h in headings for p in re.split(r"[,()]", h) if p.strip()}
    listed = {p for p in listed if p in commands}
    assert set(commands) <= listed, set(commands) - listed


# --- The configuration keys: the schema ------------------------------------------------------------


def schema_keys():
    with open(os.path.join(PACKAGE, "schemas", "config.schema.json")) as f:
        schema = json.load(f)
    keys = {}

    def walk(node, prefix):
        for name, sub in node.get("properties", {}).items():
            if "properties" in sub:
                walk(sub, prefix + name + ".")
            else:
                keys[prefix + name] = sub

    walk(schema, "")
    return keys


def _number(value):
    return str(int(value)) if float(value).is_integer() else str(value)


def test_configuration_md_lists_every_key_with_its_bounds():
    keys = schema_keys()
    rows = {row[0].strip("`"): row for row in table_rows(read("docs/configuration.md"), "| key | default |")}
    assert set(rows) == set(keys)
    for key, sub in keys.items():
        if "minimum" in sub and "maximum" in sub:
            bounds = f"{_number(sub['minimum'])} to {_number(sub['maximum'])}"
            assert bounds in rows[key][2], f"{key}: the schema's bounds ({bounds}) are not in configuration.md"


def test_other_pages_key_tables_agree_with_configuration_md():
    keys = schema_keys()
    defaults = {row[0]: row[1] for row in table_rows(read("docs/configuration.md"), "| key | default |")}
    seen = 0
    for path in doc_paths():
        if path == "docs/configuration.md":
            continue
        for row in table_rows(read(path), "| key | default |"):
            key = row[0].strip("`")
            if key in keys:
                seen += 1
                assert row[1] == defaults[row[0]], (
                    f"{path}: {key}: default {row[1]}, configuration.md {defaults[row[0]]}"
                )
    assert seen >= 5


# --- Where the hook is ----------------------------------------------------------------------------


def test_every_runc_hook_example_names_both_install_places():
    """/usr/bin/oci-gpu-hook is the RPM's; oci-gpu-hook install puts the hook at launcher.LAUNCHER.
    An example that names one says where the other is, before the next heading."""
    from oci_gpu_hook.toolkit import install, launcher

    examples = 0
    for path in doc_paths():
        text = read(path)
        for m in re.finditer(r'"path": "([^"]+)", "args": \["oci-gpu-hook", "prestart"\]', text):
            examples += 1
            section = text[m.end() :].split("\n#", 1)[0]
            others = [p for p in (install.INSTALLED_PATH, launcher.LAUNCHER) if p != m.group(1)]
            missing = [p for p in others if f"`{p}`" not in section]
            assert not missing, f"{path}: the hook example at {m.group(1)} does not say where {missing} is"
    assert examples >= 3


# --- The start server's refusals: server.NOT_TAKEN --------------------------------------------------


def _as_documented(template: str) -> str:
    """A line of server.NOT_TAKEN as docs/cli.md writes it: each field its name in capitals."""
    import string

    return "".join(text + (field.upper() if field is not None else "")
                   for text, field, _, _ in string.Formatter().parse(template))  # fmt: skip


def start_server_conditions() -> list:
    """(condition, the line the server logs where it does not hold) of each item of docs/cli.md's
    list of what the start server checks, in the list's order."""
    section = read("docs/cli.md").split("\n## start-server\n", 1)[1].split("\n## ", 1)[0]
    assert "and the line given here" in section, "docs/cli.md's start-server section has no list of its refusals"
    after = section.split("and the line given here", 1)[1]
    items, started = [], False
    for line in after.splitlines()[1:]:
        if line.startswith("- "):
            items.append(line[2:])
            started = True
        elif started and line.startswith("  "):
            items[-1] += " " + line.strip()
        elif started:
            break
    found = []
    for item in items:
        condition, _, said = item.rpartition(": `")
        found.append((condition, " ".join(said.rstrip(";.").rstrip("`").split())))
    assert len(found) > 10, found
    return found


def test_cli_md_lists_every_line_the_start_server_refuses_with_and_no_other():
    """Each "not taken" line of server.NOT_TAKEN, in the order the server checks, is an item of
    docs/cli.md's list with the condition it says does not hold; the list has no other."""
    from oci_gpu_hook.start import server

    documented = [said for _, said in start_server_conditions()]
    code = [_as_documented(template) for template in server.NOT_TAKEN.values()]
    assert documented == code, (
        f"missing in docs/cli.md: {[c for c in code if c not in documented]}; "
        f"not the code's: {[d for d in documented if d not in code]}"
    )


def test_the_start_servers_conditions_name_its_limits():
    from oci_gpu_hook.start import prefilter_rule, server

    conditions = dict(zip(server.NOT_TAKEN, (condition for condition, _ in start_server_conditions())))
    assert f"fewer than {server.MAX_PENDING} connections" in conditions["too many"], conditions["too many"]
    assert f"within {prefilter_rule.START_SERVER_TAKE_MS} ms" in conditions["no offer"], conditions["no offer"]
    assert "SO_PEERPIDFD" in conditions["unknown peer"] and "SO_PEERCRED" in conditions["not root"]


def test_the_start_server_refuses_only_with_its_table():
    """server.py writes no refusal of its own beside NOT_TAKEN (no literal "an offer ..." outside
    it), and each line of the table is one it can say (named in a not_taken() or refuse() call)."""
    import ast

    from oci_gpu_hook.start import server

    with open(server.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    table = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and [getattr(t, "id", None) for t in node.targets] == ["NOT_TAKEN"])  # fmt: skip
    in_table = {id(node) for node in ast.walk(table)}
    stray = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and node.value.startswith("an offer") and id(node) not in in_table]  # fmt: skip
    assert stray == [], f"refusals outside server.NOT_TAKEN: {stray}"
    named = []
    for node in ast.walk(tree):
        # receive() names its refusals through refuse(key, ...), which hands the key to not_taken()
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("not_taken", "refuse") and node.args:
            key = node.args[0]
            if isinstance(key, ast.Constant):
                named.append(re.escape(key.value))
            elif isinstance(key, ast.JoinedStr):  # f"other {name} namespace"
                named.append("".join(re.escape(p.value) if isinstance(p, ast.Constant) else ".+" for p in key.values))
    unsaid = [key for key in server.NOT_TAKEN if not any(re.fullmatch(pattern, key) for pattern in named)]
    assert unsaid == [], f"lines of server.NOT_TAKEN the server never says: {unsaid}"


def test_cli_md_gives_a_workers_line_for_a_state_that_is_no_file():
    from oci_gpu_hook.errors import PROG
    from oci_gpu_hook.start import server

    section = read("docs/cli.md").split("\n## start-server\n", 1)[1].split("\n## ", 1)[0]
    assert f"{PROG}: {server.STATE_NOT_A_FILE}" in " ".join(ticked(" ".join(section.split())))


# --- Names in the package's docstrings --------------------------------------------------------------


def test_the_packages_docstrings_name_functions_that_exist():
    """A docstring that names `name()` names a function or class of the package, one of Python's
    (a builtin, str.isdigit, os.uname) or a system call Python wraps (accept, poll, mknod): a name
    left behind by a rename (userns.py's trusted_owners(), review 5) is found here."""
    import ast
    import builtins
    import importlib
    import select
    import socket

    defined, named = set(), []
    for directory, _, names in os.walk(PACKAGE):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    defined.add(node.name)
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    for m in re.finditer(r"(?<![\w.`-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\(\)",
                                         ast.get_docstring(node) or ""):  # fmt: skip
                        named.append((os.path.relpath(path, REPO), m.group(1)))

    def exists(dotted: str) -> bool:
        *owner, name = dotted.split(".")
        if name in defined or (not owner and hasattr(builtins, name)):
            return True
        if owner:
            try:
                return hasattr(importlib.import_module(".".join(owner)), name)
            except ImportError:
                return hasattr(getattr(builtins, owner[0], None), name)
        return any(hasattr(place, name) for place in (os, select, socket.socket, str))

    assert len(named) > 20, named
    missing = [(path, name) for path, name in named if not exists(name)]
    assert missing == [], f"docstrings name what does not exist: {missing}"
