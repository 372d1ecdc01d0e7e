"""containerd's CRI plugin, wired for the hook: what `install --runtime containerd` writes, and
what doctor reads, both taken from containerd itself (`containerd config dump`, `ctr oci spec`),
never from a table of its defaults.

The way is a base runtime spec: containerd's own default spec (`ctr oci spec`) with the hook at
prestart, named by `base_runtime_spec` for every runtime of the CRI plugin. Every container the
CRI plugin creates starts from it, and the hook acts only for those that ask for GPUs
(docs/toolkit.md says why this and not CDI).

The setting goes into a drop-in, /etc/containerd/conf.d/oci-gpu-hook.toml, that config.toml
imports. containerd 1.x reads no drop-in directory by itself, and an imported file replaces a
plugin's whole section (containerd 1.6 merges `plugins` one plugin at a time, not key by key: a
drop-in holding base_runtime_spec alone would reset every other CRI setting to its default). So
the drop-in holds the CRI plugin's whole section as containerd reads it without the drop-in
(`containerd config dump`), with base_runtime_spec added; and config.toml gets one line,
IMPORT_LINE, first, which uninstall removes, leaving the file byte for byte as it was. Without a
config.toml (containerd's defaults hold), install writes one that imports the drop-in, and
uninstall removes it.

So the drop-in is a copy, frozen when install ran: CRI settings the administrators add to
config.toml afterwards (enable_selinux, restrict_oom_score_adj, ...) are overridden by it. What
install froze, doctor watches (frozen_verdict): it asks containerd what install would write now
and says FAIL, naming the settings, where the drop-in holds anything else; running install
again writes the drop-in afresh.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

from oci_gpu_hook.start.inventory import host_path
from oci_gpu_hook.toolkit.runtime_config import ConfigFileError, dump_toml, load_toml
from oci_gpu_hook.toolkit.tree import Tree

CONFIG = "/etc/containerd/config.toml"
DROPIN = "/etc/containerd/conf.d/oci-gpu-hook.toml"
BASE_SPEC = "/etc/containerd/oci-gpu-hook-base-spec.json"
CRI = "io.containerd.grpc.v1.cri"
IMPORT_LINE = f'imports = ["{DROPIN}"]  # added by `oci-gpu-hook install`, removed by `oci-gpu-hook uninstall`\n'
# What install writes where there was no config.toml: containerd's defaults, and the drop-in.
CREATED_CONFIG = "version = 2\n" + IMPORT_LINE
TIMEOUT = 30


class ContainerdError(Exception):
    """containerd's configuration cannot take the hook as install writes it (one line, with the fix)."""


def _run(argv) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise ContainerdError(f"{argv[0]}: not found on PATH (is containerd installed?)") from None
    except subprocess.TimeoutExpired:
        raise ContainerdError(f"{' '.join(argv)}: no answer in {TIMEOUT} s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise ContainerdError(f"{' '.join(argv)}: {last}")
    return proc.stdout


def dump(text: str | None = None, config_file: str | None = None) -> dict:
    """The configuration containerd runs with (`containerd config dump`, every default filled in)
    for the config file config_file, or for a config.toml holding text (None: no config.toml, which
    containerd reads as an empty version 2 file)."""
    if config_file is not None:
        return load_toml(_run(["containerd", "--config", config_file, "config", "dump"]))
    with tempfile.TemporaryDirectory(prefix="oci-gpu-hook-containerd.") as directory:
        path = os.path.join(directory, "config.toml")
        with open(path, "w") as f:
            f.write("version = 2\n" if text is None else text)
        return load_toml(_run(["containerd", "--config", path, "config", "dump"]))


def default_spec() -> dict:
    """containerd's default OCI spec: what the CRI plugin starts from without a base spec."""
    return json.loads(_run(["ctr", "oci", "spec"]))


def base_spec_text(hook: dict) -> str:
    """containerd's default spec with hook (an OCI hook entry: the one hooks.d files hold) at prestart."""
    spec = default_spec()
    spec.setdefault("hooks", {}).setdefault("prestart", []).append(dict(hook))
    return json.dumps(spec, indent=2) + "\n"


def read_config(tree) -> bytes | None:
    """The tree's config.toml as containerd opens it (links followed inside the tree), or None.
    A regular file only, bounded (tree.py: an image's device node there is never opened)."""
    try:
        return tree.read(CONFIG)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise ContainerdError(f"{tree.shown(CONFIG)}: unreadable ({e.strerror})") from None


def without_import(data: bytes) -> bytes:
    """config.toml as it was before install added its line."""
    line = IMPORT_LINE.encode()
    return data[len(line) :] if data.startswith(line) else data


def wanted(tree) -> tuple:
    """(config.toml's text with the import, whether install creates the file, the CRI plugin's
    section the drop-in must hold now): containerd's own reading of config.toml without the
    import (`containerd config dump`), base_runtime_spec added for every runtime. ContainerdError
    when containerd's configuration cannot take it."""
    shown = tree.shown(CONFIG)
    if os.path.islink(tree.entry(CONFIG)):  # edited in place, it would become a file: not as it was
        raise ContainerdError(f"{shown}: a symlink, which install does not edit: wire base_runtime_spec by hand "
                              "(docs/kubernetes.md, containerd)")  # fmt: skip
    data = read_config(tree)
    created = data is None or data == CREATED_CONFIG.encode()
    if created:
        config_text, user_text = CREATED_CONFIG, None
    else:
        try:
            user_text = without_import(data).decode("utf-8")
            user = load_toml(user_text)
        except (UnicodeDecodeError, ValueError) as e:
            raise ContainerdError(f"{shown}: not valid TOML ({e}): containerd cannot read it either") from None
        if user.get("version") != 2:
            raise ContainerdError(f"{shown}: config version {user.get('version', 1)}; install wires version 2 "
                                  "(containerd 1.5 to 1.7): migrate the file, then run install again")  # fmt: skip
        if "imports" in user:
            raise ContainerdError(f"{shown}: has imports of its own, which install does not edit: wire "
                                  "base_runtime_spec by hand (docs/kubernetes.md, containerd)")  # fmt: skip
        config_text = IMPORT_LINE + user_text
    merged = dump(user_text)
    if CRI in merged.get("disabled_plugins", []):
        raise ContainerdError(f"{shown}: disabled_plugins lists {CRI}: this containerd serves no CRI "
                              "(Kubernetes); nothing to wire")  # fmt: skip
    cri = merged.get("plugins", {}).get(CRI)
    runtimes = (cri or {}).get("containerd", {}).get("runtimes") or {}
    if not runtimes:
        raise ContainerdError(f"{shown}: containerd's CRI plugin has no runtimes to give a base spec")
    for name, runtime in sorted(runtimes.items()):
        spec = runtime.get("base_runtime_spec", "")
        if spec not in ("", BASE_SPEC):
            raise ContainerdError(f"{shown}: runtime {name} already has base_runtime_spec {spec}: add the hook's "
                                  f"prestart entry from {BASE_SPEC} to that file by hand")  # fmt: skip
        runtime["base_runtime_spec"] = BASE_SPEC
    return config_text, created, cri


def plan(tree, hook: dict) -> tuple:
    """(config.toml's text with the import, whether install creates the file (else it edits the
    administrators' file), the drop-in's text, the base spec's text). ContainerdError when
    containerd's configuration cannot take them."""
    config_text, created, cri = wanted(tree)
    dropin = (
        "# Written by `oci-gpu-hook install --runtime containerd`, imported by config.toml; removed by\n"
        "# `oci-gpu-hook uninstall`. containerd replaces a plugin's whole section with an imported one,\n"
        "# so this is the CRI plugin's section as containerd read it then (`containerd config dump`)\n"
        f"# with base_runtime_spec = {BASE_SPEC} for every runtime: after changing CRI settings in\n"
        "# config.toml, run install again (`oci-gpu-hook doctor` says FAIL until then).\n"
        + dump_toml({"version": 2, "plugins": {CRI: cri}})
    )
    return config_text, created, dropin, base_spec_text(hook)


# --- doctor -------------------------------------------------------------------------------------


FIX = "oci-gpu-hook install --runtime containerd, then systemctl restart containerd"


def hook_verdict(root: str) -> tuple:
    """(status, summary, fix) for doctor: will containerd's CRI plugin, as its config.toml stands
    (read by containerd itself), run the hook?"""
    config = host_path(root, CONFIG)
    try:
        tree = Tree(root)
    except OSError as e:
        return "FAIL", f"{root}: {e.strerror}", "correct the file"
    with tree:
        try:
            # An image tree's files are its author's: read as the image reads them (links inside
            # the tree), a regular file only and bounded (tree.read), so that neither a link out of
            # the tree nor a device node there (/dev/zero's numbers were read until memory ran out)
            # is what doctor reads. On the host, containerd reads its own file and its imports.
            if root == "/":
                merged = dump(config_file=config) if os.path.exists(config) else dump()
            else:
                data = read_config(tree)
                merged = dump(None if data is None else data.decode("utf-8", "replace"))
        except (ContainerdError, ConfigFileError, ValueError) as e:
            return "FAIL", f"{e} (containerd cannot read its configuration)", "correct the file"
        verdict = _verdict(root, tree, merged)
        return (frozen_verdict(tree) or verdict) if verdict[0] == "PASS" else verdict


def frozen_verdict(tree) -> tuple | None:
    """(FAIL, summary, fix) where the drop-in no longer holds what install would write now: CRI
    settings changed in config.toml since (or containerd's defaults, with a new containerd), which
    the drop-in's copy overrides; None where it still does, or config.toml imports no drop-in of
    install's. Both sides are containerd's own reading: the drop-in's section alone (it replaces
    the whole of config.toml's) and config.toml without the import (wanted)."""
    data = read_config(tree)
    if data is None or not data.startswith(IMPORT_LINE.encode()):
        return None
    try:
        frozen = dump(tree.read(DROPIN).decode("utf-8", "replace")).get("plugins", {}).get(CRI) or {}
        now = wanted(tree)[2]
    except (ContainerdError, ConfigFileError, ValueError) as e:
        return "FAIL", f"{e} (config.toml changed since install copied its CRI settings into {DROPIN})", FIX
    except OSError as e:
        return "FAIL", f"{tree.shown(DROPIN)}: unreadable ({e.strerror}), though config.toml imports it", FIX
    changed = _differences(now, frozen)
    if not changed:
        return None
    named = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
    return ("FAIL", f"CRI settings in {tree.shown(CONFIG)} changed since install copied them into {DROPIN}, "
            f"which containerd runs with instead: {named}", FIX)  # fmt: skip


def _differences(now: dict, frozen: dict, path: str = "") -> list:
    """The dotted keys whose values differ between two sections (a key one lacks counts)."""
    changed = []
    for key in sorted(set(now) | set(frozen)):
        a, b, name = now.get(key), frozen.get(key), f"{path}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            changed += _differences(a, b, name + ".")
        elif a != b or (key in now) != (key in frozen):
            changed.append(name)
    return changed


def _verdict(root: str, tree, merged: dict) -> tuple:
    config, fix = host_path(root, CONFIG), FIX
    if CRI in merged.get("disabled_plugins", []):
        return "PASS", f"containerd's CRI plugin is disabled ({config}): no Kubernetes containers to wire", None
    settings = merged.get("plugins", {}).get(CRI, {}).get("containerd", {})
    name = settings.get("default_runtime_name", "runc")
    spec = settings.get("runtimes", {}).get(name, {}).get("base_runtime_spec", "")
    where = f"containerd's CRI plugin runs runtime {name}"
    if not spec:
        return "FAIL", f"{where} with no base_runtime_spec: pods asking for GPUs get none", fix
    try:
        hooks = json.loads(tree.read(spec)).get("hooks", {})
    except (OSError, ValueError, AttributeError) as e:
        return "FAIL", f"{where} with base_runtime_spec {spec}, unreadable ({e}): containers fail to start", fix
    for hook in (hooks.get("prestart") or []) + (hooks.get("createRuntime") or []):
        path, args = hook.get("path", ""), hook.get("args") or []
        ours = os.path.basename(path) == "oci-gpu-hook" or "oci_gpu_hook" in args
        if ours and "prestart" in args:
            if not os.access(host_path(root, path), os.X_OK):
                return "FAIL", f"{spec}: the hook {path} is not an executable: containers fail to start", fix
            return "PASS", f"{where} from {spec}, whose prestart hook runs {path} (restart it after install)", None
    return "FAIL", f"{where} from {spec}, which has no oci-gpu-hook prestart hook: pods asking for GPUs get none", fix
