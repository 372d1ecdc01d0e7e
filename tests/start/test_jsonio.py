import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oci_gpu_hook.start import jsonio

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(), children, max_size=5),
    max_leaves=30,
)


@given(values)
def test_round_trips_like_json(value):
    assert jsonio.loads(jsonio.dumps(value)) == value
    assert json.loads(jsonio.dumps(value)) == value
    assert jsonio.loads(json.dumps(value, indent=2).encode()) == json.loads(json.dumps(value))


@given(st.binary(max_size=64) | st.text(max_size=64))
def test_rejects_what_json_rejects(data):
    try:
        expected = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        with pytest.raises((ValueError, UnicodeDecodeError)):
            jsonio.loads(data)
        return
    if isinstance(data, bytes):
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return  # json also sniffs UTF-16/32; state and config files are UTF-8
    # repr, not ==: NaN (json accepts 'NaN') is not equal to itself, but prints the same.
    assert repr(jsonio.loads(data)) == repr(expected)


@pytest.mark.parametrize("bad", [b"", b"   ", b"{", b'{"a":1} x', b"[1,]", b"\xff", b'"\\ud800"x'])
def test_bad_input_is_value_error(bad):
    with pytest.raises(ValueError):
        jsonio.loads(bad)


def test_sorted_keys_and_special_floats():
    assert jsonio.dumps({"b": 1, "a": [True, None, 1.5]}, sort_keys=True) == '{"a":[true,null,1.5],"b":1}'
    assert jsonio.dumps([float("nan"), float("inf")]) == json.dumps([float("nan"), float("inf")]).replace(" ", "")


def test_imports_neither_json_nor_re():
    import subprocess
    import sys

    code = (
        "import sys; before = set(sys.modules); import oci_gpu_hook.start.jsonio as j; "
        "j.loads(b'[1, {}]'); j.dumps({'a': 1}); print(' '.join(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["_json", "oci_gpu_hook", "oci_gpu_hook.start", "oci_gpu_hook.start.jsonio"]


@pytest.mark.parametrize("bad", [b'{"a": 1', b"{hook: me}", b'["x",]', b'{"a" 1}', b'"unterminated'])
def test_bad_input_is_value_error_without_json_imported(bad):
    """The start path never imports json; _json then cannot build its JSONDecodeError by itself
    (it would fail with SystemError, an 'internal error' for the user)."""
    import subprocess
    import sys

    code = (
        "import sys; import oci_gpu_hook.start.jsonio as j\n"
        "try:\n    j.loads(sys.stdin.buffer.read())\nexcept ValueError as e:\n    print('ValueError', e)"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], input=bad, capture_output=True, check=True)
    assert out.stdout.startswith(b"ValueError "), out.stdout + out.stderr
