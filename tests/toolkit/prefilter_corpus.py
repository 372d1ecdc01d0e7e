"""One corpus of OCI states and config.json files for both rules: the Python hook's
(prestart.may_ask_for_gpus, after state.parse and spec.load) and the compiled pre-filter's
(start/csrc/prefilter.c). tests/toolkit/test_prefilter.py runs every case through both.

A case is (name, state, config, exact): state is a dict (its bundle filled in) or raw bytes,
config a dict, raw bytes or None (no config.json). exact: the pre-filter must decide it itself
(exit 0 exactly when Python finds no GPU request); otherwise it may also hand the case to Python.
"""

from __future__ import annotations

import json
import random

STATE = {"ociVersion": "1.0.2", "id": "c1", "status": "created", "pid": 4242, "bundle": None}


def config(env=(), mounts=(), annotations=None, **extra) -> dict:
    doc = {"ociVersion": "1.0.2", "root": {"path": "rootfs"},
           "process": {"args": ["sh"], "env": ["PATH=/usr/bin:/bin", *env]}, "mounts": list(mounts)}  # fmt: skip
    if annotations is not None:
        doc["annotations"] = annotations
    doc.update(extra)
    return doc


def mount(destination, source="/dev/null", **extra):
    return {"destination": destination, "source": source, "type": "bind", "options": ["bind"], **extra}


PLAIN = [
    # What most containers are: nothing asks.
    ("plain", STATE, config(), True),
    ("no-env", STATE, {"root": {"path": "rootfs"}, "process": {"args": ["sh"]}}, True),
    ("no-process", STATE, {"root": {"path": "rootfs"}}, True),
    ("other-nvidia-variable", STATE, config(["NVIDIA_DRIVER_CAPABILITIES=all", "NVIDIA_REQUIRE_CUDA=cuda>=12"]), True),
    ("visible-void", STATE, config(["NVIDIA_VISIBLE_DEVICES=void"]), True),
    ("visible-void-in-list", STATE, config(["NVIDIA_VISIBLE_DEVICES=0, void ,1"]), True),
    ("visible-empty", STATE, config(["NVIDIA_VISIBLE_DEVICES="]), True),
    ("visible-blank", STATE, config(["NVIDIA_VISIBLE_DEVICES= \t\x0b\x0c\x1c\x1f"]), True),
    ("visible-later-void-wins", STATE, config(["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=void"]), True),
    ("env-not-strings", STATE, config([7, None, {"NVIDIA_VISIBLE_DEVICES": "all"}]), True),
    ("env-key-empty", STATE, config(["=NVIDIA_VISIBLE_DEVICES=all"]), True),
    ("env-no-equals", STATE, config(["NVIDIA_VISIBLE_DEVICES"]), True),
    ("env-prefix-only", STATE, config(["NVIDIA_VISIBLE_DEVICESX=all", "XCUDA_VERSION=12"]), True),
    ("cdi-device-prefix-elsewhere", STATE, config(["XOCI_GPU_HOOK_CDI_DEVICE_0=0", "OCI_GPU_HOOK_CDI_DEVIC=0"]), True),
    ("mounts-ordinary", STATE, config(mounts=[mount("/proc", "proc"), mount("/etc/hosts", "/tmp/hosts")]), True),
    ("annotations-other", STATE, config(annotations={"io.kubernetes.pod.name": "p", "cdi.k8s.io": "x"}), True),
    ("state-annotations", dict(STATE, annotations={"a": "b"}), config(), True),
    ("state-annotations-falsy", dict(STATE, annotations=[]), config(), True),
    ("state-no-pid", {k: v for k, v in STATE.items() if k != "pid"}, config(), True),
    ("state-null-pid", dict(STATE, pid=None), config(), True),
    ("state-version-suffix", dict(STATE, ociVersion="1.2.0-rc.1"), config(), True),
    ("state-escaped", dict(STATE, id="c\\u00e9\u00e9"), config(), True),
    ("config-escapes", STATE, config(['A=\u00e9\\"\n', "B=\U0001f600"]), True),
    # What asks.
    ("visible-all", STATE, config(["NVIDIA_VISIBLE_DEVICES=all"]), True),
    ("visible-index", STATE, config(["NVIDIA_VISIBLE_DEVICES=0"]), True),
    ("visible-none", STATE, config(["NVIDIA_VISIBLE_DEVICES=none"]), True),
    ("visible-voidish", STATE, config(["NVIDIA_VISIBLE_DEVICES=voids"]), True),
    ("visible-later-all-wins", STATE, config(["NVIDIA_VISIBLE_DEVICES=void", "NVIDIA_VISIBLE_DEVICES=all"]), True),
    ("cuda-version", STATE, config(["CUDA_VERSION=12.4"]), True),
    ("cuda-version-empty", STATE, config(["CUDA_VERSION="]), True),
    ("cdi-annotation", STATE, config(annotations={"cdi.k8s.io/x": "nvidia.com/gpu=0"}), True),
    # A device of the spec `cdi generate` wrote, applied by the runtime: the hook records it.
    ("cdi-device-variable", STATE, config(["NVIDIA_VISIBLE_DEVICES=void", "OCI_GPU_HOOK_CDI_DEVICE_0=0"]), True),
    ("cdi-device-variable-empty", STATE, config(["OCI_GPU_HOOK_CDI_DEVICE_="]), True),
    ("volume-mount", STATE, config(mounts=[mount("/var/run/nvidia-container-devices/0")]), True),
    ("volume-mount-double-slash", STATE, config(mounts=[mount("//var/run/nvidia-container-devices/GPU-1/")]), True),
]

HOSTILE = [
    # Input Python refuses: the pre-filter must hand it over, never exit 0.
    ("state-not-json", b"{", config(), True),
    ("state-not-object", b"[]", config(), True),
    ("state-bad-utf8", b'{"ociVersion":"1.0.2","id":"\xff","status":"x","bundle":"/x"}', config(), True),
    ("state-overlong-utf8", b'{"ociVersion":"1.0.2","id":"\xc0\xaf","status":"x","bundle":"/x"}', config(), True),
    ("state-utf8-surrogate", b'{"ociVersion":"1.0.2","id":"\xed\xa0\x80","status":"x","bundle":"/x"}', config(), True),
    ("state-bom", b"\xef\xbb\xbf{}", config(), True),
    ("state-trailing", None, config(), True),  # filled in below: a valid state, then more
    ("state-version-2", dict(STATE, ociVersion="2.0.0"), config(), True),
    ("state-version-short", dict(STATE, ociVersion="1.0"), config(), True),
    ("state-version-unicode-digit", dict(STATE, ociVersion="1.\u00b2.0"), config(), True),
    ("state-id-empty", dict(STATE, id=""), config(), True),
    ("state-id-nul", dict(STATE, id="a\u0000b"), config(), True),
    ("state-id-long", dict(STATE, id="x" * 1025), config(), True),
    ("state-id-1024-wide", dict(STATE, id="\u00e9" * 1024), config(), True),
    ("state-id-number", dict(STATE, id=7), config(), True),
    ("state-no-status", {k: v for k, v in STATE.items() if k != "status"}, config(), True),
    ("state-bundle-relative", dict(STATE, bundle="relative/path"), config(), True),
    ("state-pid-zero", dict(STATE, pid=0), config(), True),
    ("state-pid-huge", dict(STATE, pid=1 << 22), config(), True),
    ("state-pid-bignum", dict(STATE, pid=10**30), config(), True),
    ("state-pid-float", dict(STATE, pid=12.0), config(), True),
    ("state-pid-bool", dict(STATE, pid=True), config(), True),
    ("state-annotations-list", dict(STATE, annotations=["a"]), config(), True),
    ("state-annotations-value", dict(STATE, annotations={"a": 1}), config(), True),
    ("state-annotations-zero", dict(STATE, annotations=0), config(), False),  # falsy: Python takes it
    ("state-nan", dict(STATE, pid=float("nan")), config(), True),
    (
        "state-lone-surrogate",
        b'{"ociVersion":"1.0.2","id":"\\ud800","status":"x","bundle":"%BUNDLE%"}',
        config(),
        False,
    ),  # fmt: skip
    ("state-control-char", b'{"ociVersion":"1.0.2","id":"a\tb","status":"x","bundle":"/x"}', config(), True),
    ("state-bad-escape", b'{"ociVersion":"1.0.2","id":"\\x41","status":"x","bundle":"/x"}', config(), True),
    ("state-leading-zero", b'{"ociVersion":"1.0.2","id":"a","status":"x","bundle":"/x","pid":01}', config(), True),
    ("state-deep", b"[" * 5000 + b"]" * 5000, config(), True),
    ("state-too-large", None, config(), True),  # filled in below
    ("no-config", STATE, None, True),
    ("config-not-json", STATE, b"{,}", True),
    ("config-not-object", STATE, b'"x"', True),
    ("config-no-root", STATE, {"process": {"env": []}}, True),
    ("config-root-path-empty", STATE, {"root": {"path": ""}}, True),
    ("config-root-path-nul", STATE, {"root": {"path": "a\u0000"}}, True),
    ("config-root-not-object", STATE, {"root": "rootfs"}, True),
    ("config-bad-utf8", STATE, b'{"root":{"path":"r"},"x":"\x80"}', True),
    ("config-deep", STATE, b'{"root":{"path":"r"},"x":' + b"[" * 3000 + b"]" * 3000 + b"}", True),
    # Asking in ways only Python reads exactly: handed over.
    ("visible-unicode-space", STATE, config(["NVIDIA_VISIBLE_DEVICES=\u00a0void\u2003"]), False),
    ("visible-unicode-only", STATE, config(["NVIDIA_VISIBLE_DEVICES=\u3000"]), False),
    ("visible-unicode", STATE, config(["NVIDIA_VISIBLE_DEVICES=GPU-\u00e9"]), True),
    ("volume-mount-dotted", STATE, config(mounts=[mount("/var/run/./nvidia-container-devices/0")]), True),
    ("volume-mount-dotdot", STATE, config(mounts=[mount("/x/../var/run/nvidia-container-devices/1")]), True),
    ("volume-mount-nested", STATE, config(mounts=[mount("/var/run/nvidia-container-devices/0/1")]), False),
    ("volume-mount-relative", STATE, config(mounts=[mount("var/run/nvidia-container-devices/0")]), True),
    ("volume-mount-null-source", STATE, config(mounts=[mount("/var/run/nvidia-container-devices/0", None)]), False),
    ("escaped-key", STATE, b'{"root":{"path":"r"},"process":{"env":["NVIDIA_VISIBLE_DEVICE\\u0053=all"]}}', True),
    ("escaped-annotation", STATE, b'{"root":{"path":"r"},"annotations":{"cdi.k8s.io\\/a":"b"}}', True),
    (
        "duplicate-process",
        STATE,
        b'{"root":{"path":"r"},"process":{"env":["NVIDIA_VISIBLE_DEVICES=0"]},"process":{"env":[]}}',
        True,
    ),  # fmt: skip
    (
        "duplicate-process-later-asks",
        STATE,
        b'{"root":{"path":"r"},"process":{"env":[]},"process":{"env":["NVIDIA_VISIBLE_DEVICES=0"]}}',
        True,
    ),  # fmt: skip
    ("annotation-not-string", STATE, config(annotations={"cdi.k8s.io/a": 1}), False),
    ("nan-in-config", STATE, b'{"root":{"path":"r"},"x":NaN}', False),
    # Python converts integers of at most 4300 digits; one more is an error there.
    ("config-int-4300-digits", STATE, b'{"root":{"path":"r"},"x":' + b"9" * 4300 + b"}", True),
    ("config-int-4301-digits", STATE, b'{"root":{"path":"r"},"x":-' + b"9" * 4301 + b"}", True),
    (
        "state-int-4301-digits",
        b'{"ociVersion":"1.0.2","id":"c","status":"x","bundle":"%BUNDLE%","x":' + b"9" * 4301 + b"}",
        config(),
        True,
    ),  # fmt: skip
    # More values than its arena holds (two million numbers: 4 MB): handed over whole.
    ("arena-exhausted", STATE, b'{"root":{"path":"r"},"x":[' + b"0," * 2_000_000 + b"0]}", False),
]


def expanded(state, bundle: str) -> bytes:
    """The state's bytes with the bundle filled in."""
    if isinstance(state, bytes):
        return state.replace(b"%BUNDLE%", bundle.encode())
    doc = dict(state)
    if "bundle" in doc and doc["bundle"] is None:
        doc["bundle"] = bundle
    return json.dumps(doc).encode()


def config_bytes(doc) -> bytes | None:
    if doc is None or isinstance(doc, bytes):
        return doc
    return json.dumps(doc).encode()


def cases(bundle_of) -> list:
    """[(name, state bytes, config bytes or None, exact)], bundle_of(name) naming each case's bundle."""
    out = []
    for name, state, doc, exact in PLAIN + HOSTILE:
        bundle = bundle_of(name)
        if name == "state-trailing":
            data = expanded(STATE, bundle) + b" x"
        elif name == "state-too-large":
            data = expanded(dict(STATE, padding="x" * (1 << 20)), bundle)
        else:
            data = expanded(state, bundle)
        out.append((name, data, config_bytes(doc), exact))
    return out


def mutations(seed: int, count: int, bundle_of) -> list:
    """Seeded random edits of the plain cases' bytes (a byte changed, dropped or repeated, a cut):
    hostile input of every shape, for the rule that the pre-filter never exits 0 where Python
    would not."""
    rng = random.Random(seed)
    base = [c for c in cases(bundle_of) if c[2] is not None]
    out = []
    for i in range(count):
        name, state, doc, _ = rng.choice(base)
        target = rng.choice(("state", "config"))
        data = bytearray(state if target == "state" else doc)
        at = rng.randrange(len(data))
        edit = rng.choice(("flip", "drop", "repeat", "cut", "byte"))
        if edit == "flip":
            data[at] ^= 1 << rng.randrange(8)
        elif edit == "drop":
            del data[at]
        elif edit == "repeat":
            data[at:at] = data[at : at + rng.randrange(1, 8)]
        elif edit == "cut":
            del data[at:]
        else:
            data[at] = rng.choice(b'{}[]",:\\0a\x00\x80\xff ')
        mutated = bytes(data)
        out.append((f"mutation-{i}-{name}", mutated if target == "state" else state,
                    mutated if target == "config" else doc, False))  # fmt: skip
    return out
