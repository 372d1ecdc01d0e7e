import json

import pytest
import pythons
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


# What jsonio must do, run by each supported Python itself: it drives _json's scanner and string
# quoting directly, which CPython documents nowhere (docs/performance.md: kept because `import json`
# costs a cold start about 9.6 ms here). First as the hook runs it, json never imported: bad input
# must be a ValueError even then; then against that Python's own json on random documents.
ON_EVERY_PYTHON = r"""
import random
before = set(sys.modules)
from oci_gpu_hook.start import jsonio
added = sorted(set(sys.modules) - before)
assert added == ["_json", "oci_gpu_hook", "oci_gpu_hook.start", "oci_gpu_hook.start.jsonio"], added
for bad in (b'{"a": 1', b"{hook: me}", b'["x",]', b'{"a" 1}', b'"unterminated', b"", b" ", b"[1] x", b"\xff",
            b'"\\ud800"x', b"[" * 100000):
    try:
        jsonio.loads(bad)
    except (ValueError, RecursionError):
        continue
    raise AssertionError(f"accepted {bad[:20]!r}")
assert jsonio.loads(b' {"state": [1, -0.5, 1e400, true, null, "\\u00e9\\ud83d\\ude00"]} ') == {
    "state": [1, -0.5, float("inf"), True, None, "\u00e9\U0001f600"]}
import json
rng = random.Random(52)
CHARS = "az \\\"\x00\x1f\x7f\u00e9\u2028\ud800\U0001f600"
def text():
    return "".join(rng.choice(CHARS) for _ in range(rng.randrange(6)))
def value(depth):
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, -1, 2**63, -(10**30), rng.randrange(-1000, 1000)])
    if kind == 2:
        return rng.choice([0.0, -0.0, 1.5, 1e-300, 1e300, rng.uniform(-1e6, 1e6)])
    if kind in (3, 4):
        return text()
    if kind == 5:
        return [value(depth + 1) for _ in range(rng.randrange(4))]
    return {text(): value(depth + 1) for _ in range(rng.randrange(4))}
for _ in range(3000):
    v = value(0)
    assert jsonio.loads(json.dumps(v).encode()) == v, v
    assert jsonio.loads(json.dumps(v, indent=2)) == v, v
    assert jsonio.dumps(v, sort_keys=True) == json.dumps(v, sort_keys=True, separators=(",", ":")), v
special = [float("nan"), float("inf"), float("-inf")]
assert jsonio.dumps(special) == json.dumps(special, separators=(",", ":"))
assert repr(jsonio.loads(jsonio.dumps(special))) == repr(special)
print("ok", sys.version_info[:2])
"""


@pytest.mark.parametrize("version", pythons.SUPPORTED)
def test_on_every_supported_python(require, version):
    python = pythons.interpreter(version)
    require(python)
    out = pythons.run(python, ON_EVERY_PYTHON)
    assert out.returncode == 0 and out.stdout.startswith(b"ok"), (out.stdout + out.stderr).decode(errors="replace")
