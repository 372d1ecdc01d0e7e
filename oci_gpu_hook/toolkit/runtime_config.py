"""What the container runtimes' own configuration files say about hooks directories, read as the
runtimes read them (TOML), so that install and doctor follow the runtime instead of guessing.

- podman: `engine.hooks_dir` in /usr/share/containers/containers.conf, then
  /etc/containers/containers.conf, then each *.conf in containers.conf.d in the order of their
  names (containers/common's order; a later file's list replaces the list before it, unless it
  ends with `{append = true}`), else the built-in default of the podman installed, which differs
  between versions (4.x: the /usr/share directory alone), so that podman is asked for it
  (`podman --help` prints the effective list as --hooks-dir's default). On the host itself
  (root /), doctor asks podman for its effective list: podman's answer, whatever its version reads.
- CRI-O: `crio.runtime.hooks_dir` in crio.conf, then in each file below crio.conf.d in the order
  of their names (every file: CRI-O does not look at the suffix). CRI-O does not merge lists: the
  last file that sets hooks_dir gives the whole list, and with none, its built-in default holds.

Under a root other than /, each file is the tree's own, found as the runtime in that image finds
it (toolkit/tree.py: links followed inside the tree): a tree's link must not make install read,
and so copy into a drop-in, the build host's configuration.
"""

from __future__ import annotations

import os

from oci_gpu_hook.toolkit.tree import Tree

PODMAN_CONF = "/etc/containers/containers.conf"
PODMAN_CONFS = ("/usr/share/containers/containers.conf", PODMAN_CONF)
PODMAN_DROPIN_DIR = "/etc/containers/containers.conf.d"
# containers-common's documented default (its containers.conf's commented hooks_dir): what podman
# 4 reads when no file sets hooks_dir; used where no podman can be asked (an image tree, no podman).
PODMAN_DEFAULT_HOOKS_DIRS = ("/usr/share/containers/oci/hooks.d",)
CRIO_CONF = "/etc/crio/crio.conf"
CRIO_DROPIN_DIR = "/etc/crio/crio.conf.d"
# CRI-O's built-in hooks_dir (what `crio config --default` prints; a test compares the two).
CRIO_DEFAULT_HOOKS_DIRS = ("/usr/share/containers/oci/hooks.d",)
# CRI-O's built-in [crio.api] listen (`crio config --default`).
CRIO_DEFAULT_LISTEN = "/var/run/crio/crio.sock"


class ConfigFileError(Exception):
    """A runtime's TOML configuration file that exists but cannot be read as the runtime reads it."""


class TomlUnavailable(Exception):
    """No TOML reader (Python before 3.11 without tomli) or writer (no tomli-w)."""


def load_toml(text: str) -> dict:
    # Imported here (and tomli-w in dump_toml): a toolkit command's need; the hook's start path
    # never reads or writes TOML.
    try:
        import tomllib  # novermin (before Python 3.11: tomli, the same parser and API)
    except ModuleNotFoundError:
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise TomlUnavailable("reading TOML needs tomli before Python 3.11 (python3-tomli)") from None
    return tomllib.loads(text)


def dump_toml(document: dict) -> str:
    """document as TOML that reads back as exactly document (tomli-w): every string is escaped
    for TOML, so that an entry install copies from the administrators' files (a quote, a
    backslash, a newline followed by a table header) cannot end its string or add a line of its
    own. TomlUnavailable without tomli-w."""
    try:
        import tomli_w
    except ModuleNotFoundError:
        raise TomlUnavailable("writing TOML needs tomli-w (python3-tomli-w)") from None
    return tomli_w.dumps(document)


def _tree(root: str) -> Tree:
    try:
        return Tree(root)
    except OSError as e:
        raise ConfigFileError(f"{root}: unreadable ({e.strerror})") from None


# containers/common (podman 5) appends an array to the one before it when it ends with this table.
APPEND = {"append": True}


def toml_list(tree: Tree, file: str, keys: tuple, appendable: bool = False):
    """The list of strings at `keys` (tables, then the key) in the tree's TOML file, or None when
    the file does not exist or does not set it. ConfigFileError when it is not valid TOML or the
    value is not a list of strings: the runtime would refuse to start. appendable: the list may
    end with APPEND, which stays in it."""
    value = _toml_value(tree, file, keys)
    if value is None:
        return None
    strings = value[:-1] if appendable and isinstance(value, list) and value[-1:] == [APPEND] else value
    if not isinstance(value, list) or not all(isinstance(item, str) for item in strings):
        raise ConfigFileError(f"{tree.shown(file)}: {'.'.join(keys)} is not an array of strings")
    return value


def toml_string(tree: Tree, file: str, keys: tuple):
    """The string at `keys` in the tree's TOML file, or None (as toml_list)."""
    value = _toml_value(tree, file, keys)
    if value is not None and not isinstance(value, str):
        raise ConfigFileError(f"{tree.shown(file)}: {'.'.join(keys)} is not a string")
    return value


def _toml_value(tree: Tree, file: str, keys: tuple):
    path = tree.shown(file)
    try:
        text = tree.read(file).decode("utf-8")  # a regular file only, bounded (tree.py)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise ConfigFileError(f"{path}: unreadable ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigFileError(f"{path}: not valid TOML (not UTF-8: {e.reason} at byte {e.start})") from None
    try:
        value = load_toml(text)
    except ValueError as e:  # tomllib.TOMLDecodeError
        raise ConfigFileError(f"{path}: not valid TOML ({e})") from None
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def podman_files(tree: Tree) -> list:
    """podman's containers.conf files (paths in the tree) in the order it reads them: the
    packages', the administrators', then the *.conf files directly in containers.conf.d by name
    (containers/common: no subdirectory, other suffixes ignored)."""
    found = list(PODMAN_CONFS)
    try:
        fd = tree.open(PODMAN_DROPIN_DIR, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return found
    except OSError as e:
        raise ConfigFileError(f"{tree.shown(PODMAN_DROPIN_DIR)}: unreadable ({e.strerror})") from None
    try:
        with os.scandir(fd) as entries:
            names = sorted(e.name for e in entries if e.name.endswith(".conf") and not e.is_dir())
    finally:
        os.close(fd)
    return found + [f"{PODMAN_DROPIN_DIR}/{name}" for name in names]


def podman_hooks_dirs(root: str, without: str | None = None, default=None) -> tuple:
    """(hooks directories podman reads, the file that set them or None for the default), as if the
    file `without` (install's drop-in) were not there. default: podman's built-in list (None:
    containers-common's documented one)."""
    dirs, source = list(PODMAN_DEFAULT_HOOKS_DIRS if default is None else default), None
    if not os.path.isdir(root):  # no tree (doctor --root of one to come): no file sets it
        return dirs, source
    with _tree(root) as tree:
        for path in podman_files(tree):
            if path == without:
                continue
            configured = toml_list(tree, path, ("engine", "hooks_dir"), appendable=True)
            if configured is not None:
                appended = configured and configured[-1] == APPEND
                dirs = dirs + configured[:-1] if appended else configured
                source = path
    return dirs, source


class PodmanUnavailable(Exception):
    """No podman to ask (or one without --hooks-dir: podman-remote)."""


def podman_effective_hooks_dirs(builtin: bool = False) -> list:
    """The hooks directories the podman on PATH reads, in its own words: `podman --help` prints
    --hooks-dir's default, which is containers.conf's hooks_dir as this podman merged it (its
    version's files, its drop-ins, $CONTAINERS_CONF) over its built-in default; pflag writes that
    list as CSV in brackets. builtin: the built-in default alone (CONTAINERS_CONF=/dev/null: an
    empty file, so that no file sets it)."""
    import csv
    import io
    import re
    import shutil
    import subprocess

    podman = shutil.which("podman")
    if podman is None:
        raise PodmanUnavailable("podman is not on PATH")
    env = dict(os.environ)
    if builtin:
        env.pop("CONTAINERS_CONF_OVERRIDE", None)
        env["CONTAINERS_CONF"] = "/dev/null"
    try:
        out = subprocess.run([podman, "--help"], capture_output=True, text=True, env=env, timeout=60,
                             stdin=subprocess.DEVNULL)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigFileError(f"{podman} --help: {e}") from None
    if out.returncode != 0:  # what it refuses is its configuration: containers.conf, $CONTAINERS_CONF
        from oci_gpu_hook.errors import printable

        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigFileError(f"{podman} --help failed: {printable(last)}")
    match = re.search(r"^\s*--hooks-dir \S+\s+", out.stdout, re.M)
    if match is None:
        raise PodmanUnavailable(f"{podman} --help names no --hooks-dir")
    # The default runs to the first "])" ending a line: an entry may hold a newline, which CSV
    # quotes and pflag follows with the usage column's indentation (taken off again here).
    rest = out.stdout[match.start() :].replace("\n" + " " * (match.end() - match.start()), "\n")
    listed = re.match(r"[^\n]*?\(default \[(.*?)\]\)$", rest, re.M | re.S)
    if listed is None:
        return []  # pflag prints no default for an empty list
    return next(csv.reader(io.StringIO(listed.group(1))), [])


def crio_files(tree: Tree) -> list:
    """CRI-O's configuration files (paths in the tree, as CRI-O sees them), in the order it reads
    them: crio.conf, then every file below crio.conf.d, whatever its name, in the order of a
    walk by name that enters each subdirectory where its name falls (CRI-O's filepath.Walk,
    which enters no link)."""
    found = [CRIO_CONF]

    def walk(directory: str) -> None:
        try:
            fd = tree.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as e:
            raise ConfigFileError(f"{tree.shown(directory)}: unreadable ({e.strerror})") from None
        try:
            with os.scandir(fd) as entries:
                listed = sorted((e.name, e.is_dir(follow_symlinks=False)) for e in entries)
        finally:
            os.close(fd)
        for name, is_directory in listed:
            path = f"{directory}/{name}"
            if is_directory:
                walk(path)
            else:
                found.append(path)

    walk(CRIO_DROPIN_DIR)
    return found


def crio_listen(root: str) -> str:
    """The socket CRI-O serves its API on: the last of its files to set [crio.api] listen, else
    CRI-O's default."""
    listen = CRIO_DEFAULT_LISTEN
    with _tree(root) as tree:
        for path in crio_files(tree):
            configured = toml_string(tree, path, ("crio", "api", "listen"))
            if configured is not None:
                listen = configured
    return listen


def crio_hooks_dirs(root: str, without: str | None = None) -> tuple:
    """(hooks directories CRI-O reads, the file that set them or None for CRI-O's default), as if
    the file `without` (a drop-in) were not there."""
    dirs, source = list(CRIO_DEFAULT_HOOKS_DIRS), None
    if not os.path.isdir(root):
        return dirs, source
    with _tree(root) as tree:
        for path in crio_files(tree):
            if path == without:
                continue
            configured = toml_list(tree, path, ("crio", "runtime", "hooks_dir"))
            if configured is not None:
                dirs, source = configured, path
    return dirs, source
