"""The SELinux policy module a bundle carries, loaded into its host's policy by install (issue 47).

A node that the cluster's toolkit gives the hook has no RPM to load selinux/oci_gpu_hook.te, and
no compiler to build it (RHCOS has neither). So the node image carries the module compiled, once
for each policy family it knows (deploy/build-image.py), in its bundle:

| path (under the bundle) | compiled against | the host's SELINUXTYPE |
|---|---|---|
| selinux/debian/oci_gpu_hook.pp | Debian's refpolicy headers (selinux-policy-dev) | default |
| selinux/rhel/oci_gpu_hook.pp | RHEL's targeted policy with container-selinux | targeted |

The two differ in what they are, not only in how they were built: the .te takes one branch or the
other by which container policy its headers hold (oci_gpu_hook.te), and a module built for one
family does not link into the other's policy. The family is read from the file that names the
policy the host runs, /etc/selinux/config's SELINUXTYPE: a RHEL policy installed on a Debian host
(the node VM's rhel flavour) is RHEL's, whatever /etc/os-release says.

Install loads it at PRIORITY, a priority of its own: the RPM's module is at 200 and `semodule -i`
by hand at 400, so that uninstall removes only what install loaded, and leaves an administrator's
or a package's module as it was. Loading relinks the whole policy (seconds on a real host, a
minute in the node VM), so install loads only when the store lacks the module at PRIORITY or holds
another build of it than the one recorded (its digest, in the install manifest).

This module plans (what to load, from which file, or why none) and runs semodule; install.py
decides when, and records it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess

MODULE = "oci_gpu_hook"
PRIORITY = 300
DIRECTORY = "selinux"
FLAVOUR_OF_POLICY = {"default": "debian", "targeted": "rhel"}
SELINUX_CONFIG = "/etc/selinux/config"
STORE = "/var/lib/selinux"  # libsemanage's default store root (semanage.conf's store-root)
ENVIRONMENT = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
# A relink of RHEL's whole targeted policy took up to a few minutes in the node VM (qemu's TCG);
# under the toolkit's own bound on a host step (toolkit/host.py).
TIMEOUT = 200


class ModuleError(Exception):
    """One line: why the module cannot be loaded or removed."""


def carried(bundle_top: str) -> dict:
    """{flavour: path of its .pp} that the bundle at bundle_top carries."""
    found = {}
    for flavour in sorted(set(FLAVOUR_OF_POLICY.values())):
        path = os.path.join(bundle_top, DIRECTORY, flavour, f"{MODULE}.pp")
        if os.path.isfile(path):
            found[flavour] = path
    return found


def policy_type(config_text: str | None) -> str | None:
    """SELINUXTYPE from /etc/selinux/config's text (None: no file, or no such line)."""
    if config_text is None:
        return None
    value = None
    for line in config_text.splitlines():
        key, sep, rest = line.strip().partition("=")
        if sep and key.strip() == "SELINUXTYPE":
            value = rest.strip().strip("\"'") or None
    return value


def chosen(policy: str | None, modules: dict) -> str:
    """The path of the module for a host running policy, from modules (carried()); ModuleError
    says why there is none, with what to do."""
    if policy is None:
        raise ModuleError(f"SELinux is enabled, and {SELINUX_CONFIG} names no SELINUXTYPE: cannot tell which "
                          "policy to load oci_gpu_hook into")  # fmt: skip
    flavour = FLAVOUR_OF_POLICY.get(policy)
    if flavour is None:
        raise ModuleError(f"SELinux policy {policy!r}: the image carries the module for "
                          f"{', '.join(sorted(FLAVOUR_OF_POLICY))} only; load selinux/oci_gpu_hook.te built "
                          "for this policy by hand (docs/selinux.md)")  # fmt: skip
    if flavour not in modules:
        raise ModuleError(f"SELinux policy {policy!r} ({flavour}): this image was built without the module for it "
                          "(deploy/build-image.py --selinux-headers); build the image with it, or load "
                          "selinux/oci_gpu_hook.te by hand (docs/selinux.md)")  # fmt: skip
    return modules[flavour]


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def loaded_at(policy: str, root: str = "/") -> list:
    """The priorities at which the store of policy holds the module, read from the store itself
    (libsemanage keeps each at STORE/<policy>/active/modules/<priority>/<name>)."""
    modules = os.path.join(root, STORE.lstrip("/"), policy, "active", "modules")
    try:
        names = os.listdir(modules)
    except OSError:
        return []
    return sorted(int(p) for p in names if p.isdigit() and os.path.isdir(os.path.join(modules, p, MODULE)))


def load(path: str) -> None:
    _semodule(["-X", str(PRIORITY), "-i", path])


def remove() -> None:
    _semodule(["-X", str(PRIORITY), "-r", MODULE])


def _semodule(args: list) -> None:
    """semodule with args; ModuleError with its own words on failure. It runs with no descriptor
    of ours but /dev/null: it execs load_policy, whose domain (load_policy_t) may not use a pipe of
    its caller's (unconfined_t, spc_t), and the kernel logs a denial for each one it inherits.
    Only when it failed is it run again with its output read, for the line that says why (a
    module that does not link fails the same way before anything is loaded)."""
    quiet = _run_semodule(args, subprocess.DEVNULL)
    if quiet.returncode == 0:
        return
    done = _run_semodule(args, subprocess.PIPE)
    if done.returncode == 0:
        return  # it failed once and not again: what was asked is done
    # Its first line says why (a statement the policy cannot resolve); its last, "Failed!".
    said = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    why = "; ".join(dict.fromkeys([said[0], said[-1]])) if said else f"exit status {done.returncode}"
    raise ModuleError(f"semodule {' '.join(args)}: {why}")


def _run_semodule(args: list, output) -> subprocess.CompletedProcess:
    what = "loaded" if "-i" in args else "removed"
    try:
        return subprocess.run(["semodule", *args], env=ENVIRONMENT, stdin=subprocess.DEVNULL, stdout=output,
                              stderr=output, text=True, timeout=TIMEOUT)  # fmt: skip
    except FileNotFoundError:
        raise ModuleError(f"semodule: not found, so the SELinux module cannot be {what} (policycoreutils "
                          "has it)") from None  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ModuleError(f"semodule {' '.join(args)}: took over {TIMEOUT} s") from None
    except OSError as e:
        raise ModuleError(f"semodule: {e.strerror}") from None


CONTAINER_DOMAIN = "gpu_container_t"
START_DOMAIN = "oci_gpu_hook_start_t"  # the start server's, which uninstall stops first


def domains_in_use(proc: str = "/proc") -> dict:
    """{pid: domain} of the processes that run in a domain of the module: removing it would leave
    them in unlabeled_t, so uninstall keeps it while any runs (a GPU pod that outlives the
    DaemonSet)."""
    pids = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "attr", "current"), "rb") as f:
                context = f.read().rstrip(b"\0\n").decode(errors="replace")
        except OSError:
            continue  # gone, or a kernel thread's
        parts = context.split(":")
        if len(parts) >= 3 and parts[2] in (CONTAINER_DOMAIN, START_DOMAIN):
            pids[int(name)] = parts[2]
    return dict(sorted(pids.items()))
