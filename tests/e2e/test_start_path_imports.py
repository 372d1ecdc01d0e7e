"""What the start path imports (not how long it takes: that is `make bench`).

The hook runs on every container start, so with a valid inventory cache and compiled settings it
must not load the toolkit's heavy libraries (click, YAML, jsonschema, NVML bindings) nor the
standard modules it was written to avoid (dataclasses, typing, json, re, subprocess, ...).
"""

import os
import subprocess
import sys

FORBIDDEN = {"click", "yaml", "jsonschema", "pynvml", "dataclasses", "inspect", "typing", "json", "re",
             "subprocess", "tempfile", "glob", "signal", "enum"}  # fmt: skip

# -S: no site hooks (a developer's editable install loads re and enum at startup); the package and
# its dependencies come from explicit paths instead.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATHS = [REPO] + [p for p in sys.path if p.endswith("site-packages")]
PROBE = (
    f"import sys; sys.path[:0] = {PATHS!r}\n"
    "from oci_gpu_hook.hook import main\n"
    "code = main(sys.argv[1:])\n"
    "sys.stdout.write(' '.join(sorted(m.split('.')[0] for m in sys.modules)))\n"
    "sys.exit(code)\n"
)


# The same run, but every process of the hook reports what it imports: an audit hook (inherited
# across fork) writes each import to a file, so the apply child's lazy imports show too.
PROBE_ALL = (
    f"import sys; sys.path[:0] = {PATHS!r}\n"
    "log = open(sys.argv.pop(1), 'a')\n"
    "def audit(event, args):\n"
    "    if event == 'import':\n"
    "        log.write(args[0] + '\\n'); log.flush()\n"
    "sys.addaudithook(audit)\n"
    "from oci_gpu_hook.hook import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def loaded_by_every_process(args, state: str, log: str) -> set:
    """The full names of every module any process of the hook imported (parent and apply child)."""
    out = subprocess.run([sys.executable, "-I", "-S", "-c", PROBE_ALL, log, *args], input=state,
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    with open(log) as f:
        return set(f.read().split())


def loaded(args, state: str):
    out = subprocess.run([sys.executable, "-I", "-S", "-c", PROBE, *args], input=state, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def baseline():
    code = "import sys; sys.stdout.write(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_non_gpu_container(tmp_path, live_container):
    state, bundle, pid, cgroup, host = live_container(env={})
    added = loaded(["--config", f"{host['root']}/config.yaml", "prestart"], state) - baseline()
    assert not added & FORBIDDEN, added & FORBIDDEN
    assert "oci_gpu_hook" in added


def test_gpu_container_with_warm_caches(live_container):
    warm = live_container(env={"NVIDIA_VISIBLE_DEVICES": "0"})
    config = f"{warm[4]['root']}/config.yaml"
    assert loaded(["--config", config, "prestart"], warm[0])  # fills the inventory cache and compiled settings
    state = live_container(env={"NVIDIA_VISIBLE_DEVICES": "0"})[0]
    added = loaded(["--config", config, "prestart"], state) - baseline()
    assert not added & FORBIDDEN, added & FORBIDDEN
    assert {"oci_gpu_hook", "ctypes"} <= added  # it did the work (mounts need ctypes)


# What the apply child may import on its own (lazily, after the fork: the probes above cannot see
# it), cgroup v2's bpf.py among them.
CHILD_MODULES = (
    "start.apply",
    "start.budget",
    "start.linux.arch",
    "start.linux.bpf",
    "start.linux.cgroups",
    "start.linux.journal",
    "start.linux.labels",
    "start.linux.ldconfig",
    "start.linux.rootfs",
    "start.linux.sources",
)


def test_what_the_apply_child_loads_on_cgroup_v1_and_v2():
    code = (
        f"import sys; sys.path[:0] = {PATHS!r}\n"
        f"for name in {CHILD_MODULES!r}: __import__('oci_gpu_hook.' + name)\n"
        "import select\n"  # ldconfig's wait
        "sys.stdout.write(' '.join(sorted(m.split('.')[0] for m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, check=True)
    added = set(out.stdout.split()) - baseline()
    assert not added & FORBIDDEN, added & FORBIDDEN


def test_ldcache_refresh_takes_the_fast_path(live_container):
    """The CDI spec's createContainer hook runs on every start of a CDI GPU container: like
    prestart, it must not go through click."""
    state = live_container(env={})[0]
    added = loaded(["ldcache-refresh", "--link", "/usr/lib/libprobe.so=libprobe.so.1", "--dir", "/usr/lib"],
                   state) - baseline()  # fmt: skip
    assert not added & {"click", "yaml", "jsonschema", "pynvml"}, added
    assert "oci_gpu_hook" in added


def test_gpu_start_on_cgroup_v1_in_every_process(live_container, tmp_path):
    """The whole start on cgroup v1, the apply child included; tests/e2e/test_cgroup_v2.py runs
    the same check on a v2 cgroup."""
    warm = live_container(env={"NVIDIA_VISIBLE_DEVICES": "0"})
    config = f"{warm[4]['root']}/config.yaml"
    assert loaded(["--config", config, "prestart"], warm[0])  # fills the caches
    state = live_container(env={"NVIDIA_VISIBLE_DEVICES": "0"})[0]
    modules = loaded_by_every_process(["--config", config, "prestart"], state, str(tmp_path / "imports"))
    assert not {m.split(".")[0] for m in modules} & FORBIDDEN, modules
    assert "oci_gpu_hook.start.linux.cgroups" in modules and "oci_gpu_hook.start.linux.bpf" not in modules
