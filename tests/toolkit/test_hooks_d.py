"""The shipped hooks.d file is valid oci-hooks 1.0.0, and the schema really checks that format."""

import copy
import json
import os

import jsonschema
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA = json.load(open(os.path.join(ROOT, "oci_gpu_hook", "schemas", "oci-hooks.schema.json")))
SHIPPED = json.load(open(os.path.join(ROOT, "hooks.d", "oci-gpu-hook.json")))


def errors(doc):
    return list(jsonschema.Draft7Validator(SCHEMA).iter_errors(doc))


def test_shipped_file_is_valid():
    assert errors(SHIPPED) == []


def test_shipped_file_gives_the_hook_a_fixed_environment_and_a_timeout():
    hook = SHIPPED["hook"]
    assert hook["path"] == "/usr/bin/oci-gpu-hook" and hook["args"][1:] == ["prestart"]
    assert hook["env"] and all(not e.startswith(("LD_", "PYTHON")) for e in hook["env"])
    assert hook["timeout"] > 8  # above the hook's own default deadline, so it can roll back first
    assert SHIPPED["stages"] == ["prestart"]


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.pop("when"),
        lambda d: d.update(when={}),
        lambda d: d.update(version="2.0.0"),
        lambda d: d["hook"].update(path="relative/oci-gpu-hook"),
        lambda d: d["hook"].update(env=["NOEQUALS"]),
        lambda d: d["hook"].update(timeout=0),
        lambda d: d.update(stages=["prestrat"]),
        lambda d: d.update(stages=[]),
        lambda d: d.update(extra=True),
    ],
    ids=["no when", "empty when", "version", "relative path", "env entry", "timeout", "stage", "no stage", "extra"],
)
def test_schema_rejects_invalid_files(change):
    doc = copy.deepcopy(SHIPPED)
    change(doc)
    assert errors(doc)
