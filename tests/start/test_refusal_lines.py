"""The lines users meet when the hook refuses a container, or when `plan` says what the hook
would do, on a simulated host (4 GPUs; GPU 2 in MIG mode with three MIG devices): through the
hook as a runtime runs it (its prestart line) and through `oci-gpu-hook plan --bundle DIR`.

- An id the host lacks names what asked for it (the variable, the volume mount, the
  annotation) and what the host has; it said `7: unknown device` (review 4, item 7).
- A container that cannot ask for a GPU starts untouched whatever the configuration holds, as
  the hook never reads it for such a container; `plan` says so and says that the configuration
  is broken. It refused such a bundle while the hook let it start.
"""

import json
import os

import hookcheck
import pytest

from oci_gpu_hook.errors import Exit

pytestmark = pytest.mark.host(gpus=4, mig=[2], scramble_minors=True)

HAS = "this host has GPUs 0-3 and MIG devices 2:0-2:2"
NO_SUCH_GPU = "GPU-ffffffff-0000-4000-8000-000000000000"
DEVICES = "/var/run/nvidia-container-devices"

# Each case: env, volume-mount names, annotations, configuration lines, the line.
UNKNOWN = {
    "the variable": ({"NVIDIA_VISIBLE_DEVICES": "0,7"}, [], {}, "", f"NVIDIA_VISIBLE_DEVICES=0,7: no GPU 7 ({HAS})"),
    "the variable, a MIG index": ({"NVIDIA_VISIBLE_DEVICES": "2:3"}, [], {}, "",
                                  f"NVIDIA_VISIBLE_DEVICES=2:3: no MIG device 2:3 ({HAS})"),
    "the variable, a bus id": ({"NVIDIA_VISIBLE_DEVICES": "0000:ff:00.0"}, [], {}, "",
                               f"NVIDIA_VISIBLE_DEVICES=0000:ff:00.0: no GPU at PCI 0000:ff:00.0 ({HAS})"),
    "a volume mount": ({"NVIDIA_VISIBLE_DEVICES": DEVICES}, ["0", "1:0"], {}, "accept_volume_mounts: true",
                       f"volume mount {DEVICES}/1:0: no MIG device 1:0 ({HAS})"),
    "an annotation": ({"NVIDIA_VISIBLE_DEVICES": "0"}, [],
                      {"cdi.k8s.io/a": "nvidia.com/gpu=0", "cdi.k8s.io/b": f"nvidia.com/gpu={NO_SUCH_GPU}"},
                      "accept_cdi_annotations: true",
                      f"annotation cdi.k8s.io/b=nvidia.com/gpu={NO_SUCH_GPU}: no GPU {NO_SUCH_GPU} ({HAS})"),
}  # fmt: skip


def make_bundle(directory, env, names=(), annotations=None) -> str:
    bundle = directory / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    mounts = [{"destination": f"{DEVICES}/{name}", "source": "/dev/null", "type": "bind", "options": ["ro", "bind"]}
              for name in names]  # fmt: skip
    config = {"ociVersion": "1.0.2", "root": {"path": "rootfs"},
              "process": {"env": [f"{k}={v}" for k, v in env.items()]}, "mounts": mounts,
              "annotations": annotations or {}}  # fmt: skip
    (bundle / "config.json").write_text(json.dumps(config))
    return str(bundle)


def state(bundle: str) -> str:
    return json.dumps({"ociVersion": "1.0.2", "id": "refusal-lines", "status": "creating", "pid": os.getpid(),
                       "bundle": bundle})  # fmt: skip


def own_config(host, tmp_path, extra: str) -> str:
    """The host's configuration with this test's own log and records (the host is shared)."""
    return hookcheck.config_with(host, tmp_path, f"{extra}\nrecords_directory: {tmp_path}/containers\n"
                                 f"logging: {{level: info, file: {tmp_path}/hook.log}}\n")  # fmt: skip


@pytest.mark.parametrize("case", UNKNOWN)
def test_an_unknown_device_names_what_asked_and_what_the_host_has(host, tmp_path, hook_cli, case):
    env, names, annotations, extra, line = UNKNOWN[case]
    config = own_config(host, tmp_path, extra)
    bundle = make_bundle(tmp_path, env, names, annotations)
    hook = hookcheck.run_hook(config, state(bundle))
    dry = hook_cli("--config", config, "plan", "--bundle", bundle)
    assert hook.returncode == dry.returncode == Exit.REQUEST, (hook.stderr, dry.stderr)
    assert hook.stderr.decode() == dry.stderr == f"oci-gpu-hook: {line}\n"
    (record,) = [json.loads(r) for r in open(tmp_path / "hook.log")]
    assert record["message"] == line


BROKEN = "deadline_seconds: banana"


def test_plan_of_a_void_container_says_it_starts_and_that_the_configuration_is_broken(host, tmp_path, hook_cli):
    """The hook exits 0 for NVIDIA_VISIBLE_DEVICES=void before it reads its configuration; `plan`
    exits 0 too and says both: the container starts untouched, and the configuration is broken
    with its own line (the one a GPU container fails with)."""
    config = own_config(host, tmp_path, BROKEN)
    void = make_bundle(tmp_path, {"NVIDIA_VISIBLE_DEVICES": "void"})
    hook = hookcheck.run_hook(config, state(void))
    assert hook.returncode == 0 and hook.stderr == b"", hook.stderr

    dry = hook_cli("--config", config, "plan", "--bundle", void)
    as_json = hook_cli("--config", config, "plan", "--bundle", void, "--json")
    assert dry.returncode == as_json.returncode == 0, (dry.stderr, as_json.stderr)
    assert dry.stdout.startswith("not a GPU container: ") and dry.stdout.endswith(
        "the hook lets it start untouched\n"
    ), dry.stdout
    assert dry.stderr == as_json.stderr and dry.stderr.count("\n") == 1, dry.stderr

    # The configuration's own line: what the hook says for a GPU container on it.
    gpu = make_bundle(tmp_path / "gpu", {"NVIDIA_VISIBLE_DEVICES": "0"})
    refused = hookcheck.run_hook(config, state(gpu))
    assert refused.returncode == Exit.CONFIG
    error = hookcheck.one_clear_line(refused.stderr)[len("oci-gpu-hook: ") :]
    assert "deadline_seconds" in error, error
    assert dry.stderr.startswith("oci-gpu-hook: warning: the configuration is broken") and dry.stderr.endswith(
        f": {error}\n"
    ), dry.stderr
    assert json.loads(as_json.stdout) == {"gpu_container": False, "operations": [], "configuration_error": error}
    # And plan of that GPU container refuses with the hook's line, as before.
    planned = hook_cli("--config", config, "plan", "--bundle", gpu)
    assert planned.returncode == Exit.CONFIG and planned.stderr == refused.stderr.decode()


def test_plan_of_a_void_container_on_a_sound_configuration_says_nothing_more(host, tmp_path, hook_cli):
    config = own_config(host, tmp_path, "")
    void = make_bundle(tmp_path, {"NVIDIA_VISIBLE_DEVICES": "void"})
    dry = hook_cli("--config", config, "plan", "--bundle", void, "--json")
    assert dry.returncode == 0 and dry.stderr == "", dry.stderr
    assert json.loads(dry.stdout) == {"gpu_container": False, "operations": [], "configuration_error": None}
