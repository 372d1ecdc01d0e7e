"""The tools the end-to-end suites run, built or fetched once per machine into their caches: the
shared ones (../shared/tools: a kubelet, a Kubernetes control plane, CRI-O, NVIDIA's driver files,
RHEL's policy headers) and the project's own (tests/tools/containerd17.sh: Debian 13's containerd
1.7, for CDI; tests/vm/build-base.sh: the node VM's base images, of both policy flavours).

One place for where each is cached and for the lock that keeps two builds of one tool apart, used
by the harnesses (kubeletcheck.shared_tool) and by `make test`, which starts
`python3 tests/toolbuild.py` in the background: a cold machine then builds them (about 12 minutes
on 2 cores) while the suites that need none of them run, instead of before the first test that
does (issue 40, item 9). A harness that needs a tool the background build is still making waits
on the same lock, then finds it cached. The scripts write only into their caches.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

from oci_gpu_hook.start.digits import decimal

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tool: (the variable that names its cache, the script's own default cache, the script), in the
# order the suite first needs them (the RHEL policy headers for tests/packaging, which runs before
# tests/e2e; then tests/e2e, by module name: the kubelet and CRI-O come before the cluster, whose
# apiserver is the longest build).
TOOLS = {
    "selinux-rhel": ("SELINUX_RHEL_CACHE", "/var/cache/oci-gpu-hook-selinux-rhel", "build.sh"),
    "nvidia-driver": ("NVIDIA_DRIVER_CACHE", "/var/cache/oci-gpu-hook-nvidia-driver", "fetch.sh"),
    "kubelet": ("KUBELET_CACHE", "/var/cache/oci-gpu-hook-kubelet", "build.sh"),
    "crio": ("CRIO_CACHE", "/var/cache/oci-gpu-hook-crio", "build.sh"),
    # containerd 1.7 (Debian 13's, fetched): the CDI answers on containerd (test_kubernetes_cdi_containerd)
    "containerd17": ("CONTAINERD17_CACHE", "/var/cache/oci-gpu-hook-containerd17", "containerd17.sh"),
    "kube": ("KUBE_CACHE", "/var/cache/oci-gpu-hook-kube", "build.sh"),
    # the node VM's base images (tests/vmcheck.py), last: tests/e2e/test_node_vm.py comes late.
    # The rhel flavour's is made from the debian one's root, in the same cache, with Fedora's
    # targeted policy built from ../shared/tools/selinux-rhel (its build-policy.sh, cached there).
    "node-vm": ("SEVM", "/var/cache/oci-gpu-hook-node-vm", "build-base.sh"),
    "node-vm-rhel": ("SEVM", "/var/cache/oci-gpu-hook-node-vm", "build-base.sh"),
}
# the arguments a script gets after its cache
ARGS = {"node-vm-rhel": ("rhel",)}
# tools whose script is the project's own (tests/vm, tests/tools), not ../shared/tools'
OWN_SCRIPTS = {
    "node-vm": os.path.join(REPO, "tests", "vm", "build-base.sh"),
    "node-vm-rhel": os.path.join(REPO, "tests", "vm", "build-base.sh"),
    "containerd17": os.path.join(REPO, "tests", "tools", "containerd17.sh"),
}
WAIT_FOR_OTHERS = 1200  # seconds: a build started by hand, outside the lock


def script(tool: str) -> str:
    if tool in OWN_SCRIPTS:
        return OWN_SCRIPTS[tool]
    return os.path.normpath(os.path.join(REPO, "..", "shared", "tools", tool, TOOLS[tool][2]))


def cache(tool: str) -> str:
    variable, default, _ = TOOLS[tool]
    return os.environ.get(variable) or default


def build(tool: str) -> subprocess.CompletedProcess:
    """Run the tool's script into its cache under the cache's lock; what it printed is what it made
    (a path a line). The scripts have no lock of their own, and two builds at once would double
    what they need: wait for one started by hand too."""
    deadline = time.monotonic() + WAIT_FOR_OTHERS
    while _runs_of(tool) and time.monotonic() < deadline:
        time.sleep(2)
    os.makedirs(cache(tool), exist_ok=True)
    with open(os.path.join(cache(tool), "build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        shell = "bash" if tool in OWN_SCRIPTS else "sh"
        return subprocess.run([shell, script(tool), cache(tool), *ARGS.get(tool, ())], capture_output=True,
                              text=True, stdin=subprocess.DEVNULL)  # fmt: skip


def _runs_of(tool: str) -> list[int]:
    """Pids of other runs of tool's script (any checkout's: they share the cache)."""
    name = f"{os.path.basename(os.path.dirname(script(tool)))}/{TOOLS[tool][2]}".encode()
    found = []
    for entry in os.listdir("/proc"):
        pid = decimal(entry)
        if pid not in (None, os.getpid()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if any(arg.endswith(name) for arg in argv[:3]):
                found.append(pid)
    return found


def main() -> int:
    """Build every tool that is there to build, in turn, saying how long each took. Failures are
    only reported: the test that needs the tool runs the script again and fails with its output."""
    if os.geteuid() != 0:
        print("toolbuild: not root: the tools are built by the tests that need them, if they can", flush=True)
        return 0
    for tool in TOOLS:
        if not os.path.exists(script(tool)):
            print(f"toolbuild: {script(tool)}: missing", flush=True)
            continue
        started = time.monotonic()
        done = build(tool)
        took = time.monotonic() - started
        if done.returncode == 0:
            print(f"toolbuild: {tool}: ready in {took:.0f} s", flush=True)
        else:
            why = done.stderr[-2000:]
            print(f"toolbuild: {tool}: failed ({done.returncode}) after {took:.0f} s: {why}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
