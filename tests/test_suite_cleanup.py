"""The suite's clean-up of the host's /run/oci-gpu-hook (conftest.py's
_clean_compiled_settings_of_subprocesses, hookcheck.remove_compiled_settings): the hooks a run
starts as programs keep compiled settings there, and the run removes those of its own
configuration files, never another run's (several runs share one host) or the host's hook's."""

import os

from hookcheck import remove_compiled_settings

from oci_gpu_hook.start import settings


def test_the_clean_up_removes_only_what_this_run_made(tmp_path):
    run_dir = settings.RUN_DIR  # a directory of this test's own (conftest.py)
    this_run = tmp_path / "pytest-12"
    # Other runs at the same time, one whose name starts with this run's, and one whose compiled
    # file's name starts with this run's own prefix (pytest-12_x/ reads as pytest-12/x in a name).
    others = [tmp_path / "pytest-123", tmp_path / "pytest-12_x", tmp_path / "elsewhere"]
    configs = {}
    for directory in [this_run, this_run / "deeper", *others]:
        directory.mkdir(parents=True)
        path = directory / "config.yaml"
        path.write_text("driver_root: /\n")
        settings.load(str(path), environ={}, cache=True)  # the hook's way: keeps its compiled copy
        configs[str(path)] = settings.compiled_path(str(path))
    assert all(os.path.exists(p) for p in configs.values())
    hooks_own = os.path.join(run_dir, "inventory.json")  # the host hook's other files
    with open(hooks_own, "w") as f:
        f.write("{}")
    before = set(os.listdir(run_dir))

    removed = remove_compiled_settings(run_dir, str(this_run))

    ours = [configs[str(this_run / "config.yaml")], configs[str(this_run / "deeper" / "config.yaml")]]
    assert sorted(removed) == sorted(ours)
    assert set(os.listdir(run_dir)) == before - {os.path.basename(p) for p in ours}
    assert all(os.path.exists(configs[str(d / "config.yaml")]) for d in others)
