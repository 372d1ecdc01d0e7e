"""node/gates.py: the gates' verdicts as written and read (the device plugin following them:
tests/node/plugin/test_supervisor.py)."""

import json
import os

import pytest

from oci_gpu_hook.node import gates
from oci_gpu_hook.start import settings


def test_what_is_written_is_read_and_a_gate_left_out_is_pending(tmp_path):
    path = str(tmp_path / gates.GATES_FILE)
    assert {g: v["state"] for g, v in gates.read(path).items()} == {"toolkit": "pending", "plugin": "pending"}
    gates.write(path, {"toolkit": gates.verdict("failed", "containerd runs no hook", "oci-gpu-hook doctor")})
    verdicts = gates.read(path)
    assert verdicts["toolkit"]["why"] == "containerd runs no hook" and verdicts["plugin"]["state"] == "pending"
    assert gates.failed(verdicts) == "gate toolkit failed: containerd runs no hook (fix: oci-gpu-hook doctor)"
    assert not gates.toolkit_passed(verdicts)
    gates.write(path, {"toolkit": gates.verdict("passed"), "plugin": gates.verdict("passed")})
    assert gates.failed(gates.read(path)) is None and gates.toolkit_passed(gates.read(path))
    assert settings.trusted(os.stat(path))  # root's (its cache owner's), writable by no one else


@pytest.mark.parametrize("case", ["others may write it", "not json", "a gate missing", "a state unknown",
                                  "another format", "a link"])  # fmt: skip
def test_a_file_not_to_be_trusted_is_refused_in_one_line(tmp_path, case, require):
    require("root")
    path = str(tmp_path / gates.GATES_FILE)
    gates.write(path, {"toolkit": gates.verdict("passed")})
    doc = json.loads(open(path).read())
    text = {"not json": "{", "a gate missing": json.dumps({**doc, "gates": {"toolkit": doc["gates"]["toolkit"]}}),
            "a state unknown": json.dumps({**doc, "gates": {**doc["gates"], "plugin": {"state": "ok"}}}),
            "another format": json.dumps({**doc, "format": 2})}.get(case)  # fmt: skip
    if text is not None:
        os.unlink(path)
        gates.write(path, {})  # root's, then its content replaced in place by root
        with open(path, "w") as f:
            f.write(text)
    elif case == "others may write it":
        os.chmod(path, 0o666)
    else:
        os.rename(path, path + ".real")
        os.symlink(path + ".real", path)
    with pytest.raises(ValueError, match=rf"^{path}: "):
        gates.read(path)


def test_a_gate_or_state_not_known_is_not_written(tmp_path):
    with pytest.raises(ValueError, match="not a gate"):
        gates.write(str(tmp_path / "g.json"), {"labels": gates.verdict("passed")})
    with pytest.raises(ValueError, match="not a gate's state"):
        gates.verdict("ok")
