"""What the container runtimes' own configuration files say about hooks directories, read as the
runtimes read them (TOML), so that install and doctor follow the runtime instead of guessing.

- podman: `engine.hooks_dir` in containers.conf, else its built-in pair (later masks earlier).
- CRI-O: `crio.runtime.hooks_dir` in crio.conf, then in each file below crio.conf.d in the order
  of their names (every file: CRI-O does not look at the suffix). CRI-O does not merge lists: the
  last file that sets hooks_dir gives the whole list, and with none, its built-in default holds.
"""

from __future__ import annotations

import os

from oci_gpu_hook.start.inventory import host_path

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


def toml_list(path: str, keys: tuple):
    """The list of strings at `keys` (tables, then the key) in a TOML file, or None when the file
    does not exist or does not set it. ConfigFileError when it is not valid TOML or the value is
    not a list of strings: the runtime would refuse to start."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
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
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ConfigFileError(f"{path}: {'.'.join(keys)} is not an array of strings")
    return value


def podman_hooks_dirs(root: str) -> list:
    configured = toml_list(host_path(root, PODMAN_CONF), ("engine", "hooks_dir"))
    return list(PODMAN_DEFAULT_HOOKS_DIRS) if configured is None else configured


def crio_files(root: str) -> list:
    """CRI-O's configuration files (paths on the host, as CRI-O sees them), in the order it reads
    them: crio.conf, then every file below crio.conf.d, whatever its name, in the order of a
    walk by name that enters each subdirectory where its name falls (CRI-O's filepath.Walk)."""
    found = [CRIO_CONF]

    def walk(directory: str) -> None:
        try:
            names = sorted(os.listdir(host_path(root, directory)))
        except (FileNotFoundError, NotADirectoryError):
            return
        for name in names:
            path = f"{directory}/{name}"
            on_host = host_path(root, path)
            if os.path.isdir(on_host) and not os.path.islink(on_host):
                walk(path)
            else:
                found.append(path)

    walk(CRIO_DROPIN_DIR)
    return found


def crio_hooks_dirs(root: str, without: str | None = None) -> tuple:
    """(hooks directories CRI-O reads, the file that set them or None for CRI-O's default), as if
    the file `without` (a drop-in) were not there."""
    dirs, source = list(CRIO_DEFAULT_HOOKS_DIRS), None
    for path in crio_files(root):
        if path == without:
            continue
        configured = toml_list(host_path(root, path), ("crio", "runtime", "hooks_dir"))
        if configured is not None:
            dirs, source = configured, path
    return dirs, source
