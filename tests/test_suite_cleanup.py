"""The suite's clean-up of the host and its check (tests/leftovers.py; conftest.py's
_clean_compiled_settings_of_subprocesses and _nothing_left_on_the_host_by_module): the hooks a run
starts as programs keep compiled settings in /run/oci-gpu-hook, and the run removes those of its
own configuration files, never another run's (several runs share one host) or the host's hook's;
what a module leaves on the host (compiled settings of a configuration that is gone, files in
install's places, podman's images) fails that module, named."""

import os
import subprocess
import sys
import textwrap

import leftovers

from oci_gpu_hook.start import settings
from oci_gpu_hook.toolkit import containers


def _compiled(config) -> str:
    """Keep the compiled copy of config as the hook does (in settings.RUN_DIR: this test's own,
    conftest.py); its path."""
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text("driver_root: /\n")
    settings.load(str(config), environ={}, cache=True)
    path = settings.compiled_path(str(config))
    assert os.path.exists(path)
    return path


def test_the_clean_up_removes_only_what_this_run_made(tmp_path, require):
    require("root")
    run_dir = settings.RUN_DIR  # a directory of this test's own (conftest.py)
    this_run = tmp_path / "pytest-12"
    # Other runs at the same time, one whose name starts with this run's, and one whose compiled
    # file's name starts with this run's own prefix (pytest-12_x/ reads as pytest-12/x in a name).
    others = [tmp_path / "pytest-123", tmp_path / "pytest-12_x", tmp_path / "elsewhere"]
    configs = {}
    for directory in [this_run, this_run / "deeper", *others]:
        configs[str(directory / "config.yaml")] = _compiled(directory / "config.yaml")
    # One of root's, as an older hook kept them (and a root without CAP_CHOWN would): still this run's.
    os.chown(configs[str(this_run / "deeper" / "config.yaml")], 0, 0)
    hooks_own = os.path.join(run_dir, "inventory.json")  # the host hook's other files
    with open(hooks_own, "w") as f:
        f.write("{}")
    before = set(os.listdir(run_dir))

    removed = leftovers.remove_compiled_settings(run_dir, str(this_run))

    ours = [configs[str(this_run / "config.yaml")], configs[str(this_run / "deeper" / "config.yaml")]]
    assert sorted(removed) == sorted(ours)
    assert set(os.listdir(run_dir)) == before - {os.path.basename(p) for p in ours}
    assert all(os.path.exists(configs[str(d / "config.yaml")]) for d in others)


def _places(tmp_path) -> dict:
    """Stand-ins for the host's places (a test may not write the host's /etc): this test's
    RUN_DIR, an /etc/cdi and a /var/cache whose oci-gpu-hook* names alone are looked at."""
    for name in ("cdi", "cache"):
        (tmp_path / name).mkdir()
    return {settings.RUN_DIR: "", str(tmp_path / "cdi"): "", str(tmp_path / "cache"): "oci-gpu-hook"}


def test_the_check_names_what_was_left_in_each_place_and_removes_dangling_compiled_settings(tmp_path):
    places, edited = _places(tmp_path), (str(tmp_path / "config.toml"),)
    (tmp_path / "config.toml").write_text("version = 2\n")
    kept = _compiled(tmp_path / "kept" / "config.yaml")  # from before: not this module's
    before = leftovers.snapshot(places, edited, podman=False)

    gone = _compiled(tmp_path / "gone" / "config.yaml")  # the test removes its directory, not this
    (tmp_path / "gone" / "config.yaml").unlink()
    still = _compiled(tmp_path / "still" / "config.yaml")  # its configuration is there: the session's
    (tmp_path / "cdi" / "test.json").write_text("{}")
    (tmp_path / "cache" / "oci-gpu-hook-mine").mkdir()
    (tmp_path / "cache" / "someone-elses").mkdir()
    (tmp_path / "config.toml").write_text("version = 2\n[plugins]\n")
    (tmp_path / "kept" / "config.yaml").unlink()  # dangling too, but from before
    found = leftovers.left(before, leftovers.snapshot(places, edited, podman=False), run_dir=settings.RUN_DIR)

    assert found == [
        f"{gone}: the compiled settings of {tmp_path}/gone/config.yaml, which is gone (removed now)",
        f"{tmp_path}/cdi/test.json: made",
        f"{tmp_path}/cache/oci-gpu-hook-mine: made",
        f"{tmp_path}/config.toml: changed",
    ]
    assert not os.path.exists(gone) and os.path.exists(still) and os.path.exists(kept)
    assert leftovers.left(before, before, run_dir=settings.RUN_DIR) == []


def test_the_check_takes_a_name_with_another_live_pytests_pid_for_that_runs(tmp_path):
    places = _places(tmp_path)
    before = leftovers.snapshot(places, (), podman=False)
    other = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()", "pytest"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert other.stdout.readline() == b"up\n"
        (tmp_path / "cdi" / f"oci-gpu-hook-test-{other.pid}.json").write_text("{}")
        (tmp_path / "cdi" / f"oci-gpu-hook-test-{os.getpid()}.json").write_text("{}")
        found = leftovers.left(before, leftovers.snapshot(places, (), podman=False), run_dir=settings.RUN_DIR)
    finally:
        other.communicate(b"")
    assert found == [f"{tmp_path}/cdi/oci-gpu-hook-test-{os.getpid()}.json: made"]


def test_the_check_names_a_podman_image_left(tmp_path, require):
    require("root", "podman", "busybox")
    before = leftovers.snapshot({}, ())
    image = containers.podman_image(containers.make_rootfs(str(tmp_path / "rootfs")),
                                    f"localhost/ocigpu-left-{os.getpid()}:latest")  # fmt: skip
    try:
        found = leftovers.left(before, leftovers.snapshot({}, ()))
    finally:
        subprocess.run(["podman", "rmi", "-f", image], capture_output=True)
    assert len(found) == 1 and found[0].startswith(f"podman's image {image}: made (podman rmi -f "), found
    assert leftovers.left(before, leftovers.snapshot({}, ())) == []


def test_a_directory_is_removed_with_the_compiled_settings_of_its_configurations(tmp_path, monkeypatch):
    monkeypatch.setattr(leftovers, "RUN_DIR", settings.RUN_DIR)
    top = tmp_path / "ogh-start-x"
    inside, beside = _compiled(top / "host" / "config.yaml"), _compiled(tmp_path / "beside" / "config.yaml")
    leftovers.remove_directory(str(top))
    assert not top.exists() and not os.path.exists(inside) and os.path.exists(beside)


LEAKY_MODULE = """
import os, shutil, subprocess, sys, tempfile

def test_a_hook_reads_a_configuration_in_a_directory_of_its_own():
    top = tempfile.mkdtemp(prefix="ogh-leaky-", dir="/tmp")
    with open(os.path.join(top, "config.yaml"), "w") as f:
        f.write("driver_root: /\\n")
    # as a hook run by a runtime does: its compiled copy in the host's /run/oci-gpu-hook
    keep = "import sys; from oci_gpu_hook.start import settings; settings.load(sys.argv[1], cache=True)"
    subprocess.run([sys.executable, "-c", keep, os.path.join(top, "config.yaml")], check=True)
    print("COMPILED", os.path.join(top, "config.yaml"))
    shutil.rmtree(top)  # and not the compiled copy
"""


def test_a_module_that_leaves_compiled_settings_on_the_host_fails_the_run(tmp_path, require):
    """A real pytest run with this suite's conftest.py, of a module whose test runs the hook's
    settings load as a program on a configuration in a /tmp directory of its own, and removes
    that directory alone: the run fails at the module's end, naming the compiled copy, which it
    removed."""
    require("root")
    (tmp_path / "test_leaky.py").write_text(textwrap.dedent(LEAKY_MODULE))
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests)])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-c", os.devnull,
                          "--rootdir", str(tmp_path), "-s", "-q", str(tmp_path / "test_leaky.py")],
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    config = run.stdout.split("COMPILED ", 1)[1].split()[0] if "COMPILED " in run.stdout else None
    assert config, run.stdout + run.stderr
    compiled = os.path.join(leftovers.RUN_DIR, os.path.basename(settings.compiled_path(config)))
    try:
        expected = f"test_leaky left on the host: {compiled}: the compiled settings of {config}, which is gone"
        assert run.returncode == 1 and expected in run.stdout, run.stdout + run.stderr
        assert not os.path.exists(compiled)
    finally:
        if os.path.exists(compiled):
            os.unlink(compiled)
