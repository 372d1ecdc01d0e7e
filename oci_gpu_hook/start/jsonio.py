"""JSON for the start path, without the json package.

`import json` imports re, and with it enum, functools and collections: 7.7 ms of CPU per cold
start here (docs/performance.md, "Which path is the fast path"), more than half of what the hook
may spend on a container that asks for no GPU. json's own C accelerator, _json, parses and quotes
strings without any of that; this module drives it directly (and falls back to json where an
interpreter lacks _json). _json's interface is CPython's own, documented nowhere: it is kept only
because tests/start/test_jsonio.py runs it on every Python the project supports (3.9 to 3.13).
Only the start path uses it; everything else uses json.
"""

try:
    import _json
except ImportError:  # pragma: no cover - CPython always has it
    _json = None

_WHITESPACE = " \t\n\r"


class _Context:
    """The attributes _json.make_scanner reads from a json.JSONDecoder (json's defaults)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float  # NaN, Infinity, -Infinity, as json.loads accepts them
    memo: dict = {}


_scan = _json.make_scanner(_Context()) if _json is not None else None


def loads(data):
    """Like json.loads for UTF-8 bytes or str; raises ValueError (or RecursionError) on bad input."""
    if _scan is None:
        import json

        return json.loads(data)
    text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    start, end = 0, len(text)
    while start < end and text[start] in _WHITESPACE:
        start += 1
    try:
        value, stop = _scan(text, start)
    except StopIteration as e:
        raise ValueError(f"Expecting value: char {e.value}") from None
    except SystemError:
        # _json reports most syntax errors with json.decoder.JSONDecodeError, which it finds only
        # if json.decoder is already imported; otherwise it fails with a SystemError. Only bad
        # input gets here: import it, and scan again for the real error (a ValueError).
        import json.decoder  # noqa: F401

        _Context.memo.clear()
        value, stop = _scan(text, start)
    finally:
        _Context.memo.clear()
    while stop < end and text[stop] in _WHITESPACE:
        stop += 1
    if stop != end:
        raise ValueError(f"Extra data: char {stop}")
    return value


def dumps(value, sort_keys: bool = False) -> str:
    """Compact JSON of dicts (str keys), lists, tuples, str, int, float, bool and None."""
    if _json is None:
        import json

        return json.dumps(value, sort_keys=sort_keys, separators=(",", ":"))
    out = []
    _encode(value, out, sort_keys)
    return "".join(out)


def _encode(value, out, sort_keys) -> None:
    if isinstance(value, str):
        out.append(_json.encode_basestring_ascii(value))
    elif value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        out.append(int.__repr__(value))
    elif isinstance(value, float):
        out.append(float.__repr__(value) if value == value and value not in (float("inf"), float("-inf")) else
                   {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}[repr(value)])  # fmt: skip
    elif isinstance(value, dict):
        out.append("{")
        items = sorted(value.items()) if sort_keys else value.items()
        for i, (key, item) in enumerate(items):
            if not isinstance(key, str):
                raise TypeError(f"JSON object keys must be str, not {type(key).__name__}")
            out.append("," if i else "")
            out.append(_json.encode_basestring_ascii(key))
            out.append(":")
            _encode(item, out, sort_keys)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, item in enumerate(value):
            out.append("," if i else "")
            _encode(item, out, sort_keys)
        out.append("]")
    else:
        raise TypeError(f"{type(value).__name__} is not JSON serialisable")
