"""What the container runtimes' own configuration files say about hooks directories, read as the
runtimes read them (TOML), so that install and doctor follow the runtime instead of guessing.

- podman: `engine.hooks_dir` in containers.conf, else its built-in pair (later masks earlier).
- CRI-O: `crio.runtime.hooks_dir` in crio.conf, then in each file below crio.conf.d in the order
  of their names (every file: CRI-O does not look at the suffix). CRI-O does not merge lists: the
  last file that sets hooks_dir gives the whole list, and with none, its built-in default holds.

Under a root other than /, each file is the tree's own, found as the runtime in that image finds
it (toolkit/tree.py: links followed inside the tree): a tree's link must not make install read,
and so copy into a drop-in, the build host's configuration.
"""

from __future__ import annotations

import os
import stat

from oci_gpu_hook.toolkit.tree import Tree

PODMAN_CONF = "/etc/containers/containers.conf"
PODMAN_DEFAULT_HOOKS_DIRS = ("/usr/share/containers/oci/hooks.d", "/etc/containers/oci/hooks.d")
CRIO_CONF = "/etc/crio/crio.conf"
CRIO_DROPIN_DIR = "/etc/crio/crio.conf.d"
# CRI-O's built-in hooks_dir (what `crio config --default` prints; a test compares the two).
CRIO_DEFAULT_HOOKS_DIRS = ("/usr/share/containers/oci/hooks.d",)


class ConfigFileError(Exception):
    """A runtime's TOML configuration file that exists but cannot be read as the runtime reads it."""


class TomlUnavailable(Exception):
    """No TOML parser: Python before 3.11 without tomli."""


def load_toml(text: str) -> dict:
    # Imported here: a toolkit command's need; the hook's start path never reads TOML.
    try:
        import tomllib  # novermin (before Python 3.11: tomli, the same parser and API)
    except ModuleNotFoundError:
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise TomlUnavailable("reading TOML needs tomli before Python 3.11 (python3-tomli)") from None
    return tomllib.loads(text)


def _tree(root: str) -> Tree:
    try:
        return Tree(root)
    except OSError as e:
        raise ConfigFileError(f"{root}: unreadable ({e.strerror})") from None


def toml_list(tree: Tree, file: str, keys: tuple):
    """The list of strings at `keys` (tables, then the key) in the tree's TOML file, or None when
    the file does not exist or does not set it. ConfigFileError when it is not valid TOML or the
    value is not a list of strings: the runtime would refuse to start."""
    path = tree.shown(file)
    try:
        fd = tree.open(file, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO there cannot hang us
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise ConfigFileError(f"{path}: unreadable ({e.strerror})") from None
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ConfigFileError(f"{path}: not a regular file")
            text = f.read().decode("utf-8")
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
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ConfigFileError(f"{path}: {'.'.join(keys)} is not an array of strings")
    return value


def podman_hooks_dirs(root: str) -> list:
    if not os.path.isdir(root):  # no tree (doctor --root of one to come): no file sets it
        return list(PODMAN_DEFAULT_HOOKS_DIRS)
    with _tree(root) as tree:
        configured = toml_list(tree, PODMAN_CONF, ("engine", "hooks_dir"))
    return list(PODMAN_DEFAULT_HOOKS_DIRS) if configured is None else configured


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
