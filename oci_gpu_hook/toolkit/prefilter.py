"""The compiled pre-filter (start/csrc/prefilter.c): its header, written from the Python rule, and
its build.

The pre-filter takes the place of the launcher a runtime runs. It answers the containers that
cannot ask for a GPU itself, without an interpreter, and execs the Python hook (the launcher, at
another path) for every other one. Its rule is start/prestart.py's: the values come from
start/prefilter_rule.py and the hook's limits through prefilter_rule.h, which header() writes at every build,
and tests/toolkit/test_prefilter.py runs both rules over one corpus. Nothing compiled is kept in the
repository. Where no C compiler is found, or the one found cannot build it, install keeps the Python
launcher (today's speed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from oci_gpu_hook.errors import Exit, HookError

SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "start", "csrc", "prefilter.c")
# Warnings are shown but never fatal here: install builds on production hosts, where a newer
# compiler's new warning must not stop it. The suite adds -Werror (tests/toolkit/test_prefilter.py).
CFLAGS = ("-O2", "-std=c11", "-Wall", "-Wextra", "-D_FORTIFY_SOURCE=2", "-fstack-protector-strong",
          "-fPIE", "-pie", "-Wl,-z,relro,-z,now")  # fmt: skip


# sockaddr_un's sun_path on Linux, its terminating NUL included
SOCKET_PATH_ROOM = 108


class PrefilterError(HookError):
    exit_code = Exit.INSTALL


def _c_string(value: str) -> str:
    if any(ord(c) < 0x20 or ord(c) > 0x7E for c in value):
        raise PrefilterError(f"{value!r}: only printable ASCII goes into the pre-filter")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def header(python_hook: str, launcher_options=(), start_server: str | None = None) -> str:
    """prefilter_rule.h: the rule's values, the hook's input limits and the Python hook's path;
    start_server: the start server's socket (start/server.py), offered every start Python would get."""
    from oci_gpu_hook.start import prefilter_rule, server, spec, state

    if not os.path.isabs(python_hook):
        raise PrefilterError(f"{python_hook}: the Python hook's path must be absolute")
    if start_server is not None and not (os.path.isabs(start_server) and len(start_server) < SOCKET_PATH_ROOM):
        raise PrefilterError(f"{start_server}: the start server's socket must be an absolute path of fewer than "
                             f"{SOCKET_PATH_ROOM} bytes")  # fmt: skip
    lines = [
        "/* Written by oci_gpu_hook/toolkit/prefilter.py from start/prefilter_rule.py: do not edit. */",
        f"#define PYTHON_HOOK {_c_string(python_hook)}",
        f"#define RULE_VISIBLE_DEVICES {_c_string(prefilter_rule.VISIBLE_DEVICES)}",
        f"#define RULE_NO_DEVICES {_c_string(prefilter_rule.NO_DEVICES)}",
        f"#define RULE_LEGACY_VARIABLE {_c_string(prefilter_rule.LEGACY_VARIABLE)}",
        f"#define RULE_ANNOTATION_PREFIX {_c_string(prefilter_rule.CDI_ANNOTATION_PREFIX)}",
        f"#define RULE_CDI_DEVICE_PREFIX {_c_string(prefilter_rule.CDI_DEVICE_ENV_PREFIX)}",
        # The C side matches the directory's own name anywhere in a destination (a superset of
        # the normalised rule), so it needs only that name.
        f"#define RULE_VOLUME_MOUNT_NAME {_c_string(os.path.basename(prefilter_rule.VOLUME_MOUNT_DIR))}",
        f"#define RULE_MAX_STATE_BYTES {state.MAX_STATE_BYTES}u",
        f"#define RULE_MAX_CONFIG_BYTES {spec.MAX_CONFIG_BYTES}u",
        f"#define RULE_RUNTIME_COMMANDS {{{', '.join(_c_string(c) for c in prefilter_rule.RUNTIME_COMMANDS)}, NULL}}",
        f"#define RULE_LAUNCHER_OPTIONS {1 if launcher_options else 0}",
        f"#define RULE_MAX_INT_DIGITS {max_int_digits()}u",
        # The code this install runs, in the offer's version line: a server of other code (one that
        # kept running through an upgrade) answers "not taken".
        f"#define START_SERVER_VERSION {_c_string(server.version_line(server.code_identity()))}",
        f"#define START_SERVER_TAKE_MS {prefilter_rule.START_SERVER_TAKE_MS}",
        f"#define START_SERVER_ENV_PREFIX {_c_string(prefilter_rule.HOOK_ENV_PREFIX)}",
    ]
    if start_server is not None:
        lines.append(f"#define START_SERVER {_c_string(start_server)}")
        # The launcher's own options (its --config) go first in an offer, as the launcher puts them
        # first for Python: the server's worker must run the hook with the same configuration.
        options = "".join(f"{_c_string(o)}, " for o in launcher_options)
        lines.append(f"#define START_SERVER_OPTIONS {{{options}NULL}}")
    lines.append("")
    return "\n".join(lines)


MARKER = b"oci-gpu-hook pre-filter: runs "


def is_prefilter(path: str) -> bool:
    """Whether path is a pre-filter (an ELF program carrying MARKER)."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError:
        return False
    return data.startswith(b"\x7fELF") and MARKER in data


def _marked(path: str, marker: bytes) -> str | None:
    """The text after marker (to its NUL) in the pre-filter at path, or None: not a pre-filter, or
    one without that marker."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError:
        return None
    at = data.find(marker) if data.startswith(b"\x7fELF") and MARKER in data else -1
    end = data.find(b"\0", at) if at >= 0 else -1
    return data[at + len(marker) : end].decode("ascii", "replace") if end >= 0 else None


def runs(path: str) -> str | None:
    """The Python hook the pre-filter at path runs (its PYTHON_HOOK, written after MARKER), or None
    when path is not a pre-filter (doctor follows Docker's program to the launcher it runs)."""
    return _marked(path, MARKER)


OFFERS_MARKER = b"oci-gpu-hook pre-filter: offers starts to "


def offers_to(path: str) -> str | None:
    """The start server's socket the pre-filter at path offers starts to (its START_SERVER, written
    after OFFERS_MARKER), or None: not a pre-filter, or one built without a socket (install
    --start-server refuses to wire a server to that one: no start would ever reach it)."""
    return _marked(path, OFFERS_MARKER)


VERSION_MARKER = b"oci-gpu-hook pre-filter: offers as "


def offers_as(path: str) -> str | None:
    """The version line the pre-filter at path offers with (server.version_line: the protocol and
    the identity of the code it was built for), or None: not a pre-filter, or one that offers
    to no server."""
    return _marked(path, VERSION_MARKER)


def max_int_digits() -> int:
    """The most digits Python turns into an int (its CVE-2020-10735 limit; a document with a longer
    integer is an error there): this interpreter's limit, and never more than the default 4300,
    which the hook, started with -I, keeps."""
    get = getattr(sys, "get_int_max_str_digits", None)
    limit = get() if get else 0
    return min(limit, 4300) if limit else 4300


def compiler() -> str | None:
    """The C compiler install and the build use: $CC, else cc or gcc on PATH; None without one."""
    named = os.environ.get("CC")
    if named:
        return shutil.which(named)
    return shutil.which("cc") or shutil.which("gcc")


def build_bytes(python_hook: str, launcher_options=(), start_server: str | None = None) -> bytes:
    """The pre-filter program's bytes (what install writes)."""
    with tempfile.TemporaryDirectory(prefix="oci-gpu-hook-prefilter-") as work:
        output = os.path.join(work, "oci-gpu-hook")
        with open(build(output, python_hook, launcher_options, start_server=start_server), "rb") as f:
            return f.read()


def build(output: str, python_hook: str, launcher_options=(), cc: str | None = None, flags=(),
          start_server: str | None = None) -> str:  # fmt: skip
    """Compile the pre-filter to output (mode 0755); returns output. flags: more compiler options,
    after CFLAGS (the suite's -Werror and sanitizers). Raises PrefilterError with the compiler's
    first error line."""
    cc = cc or compiler()
    if not cc:
        raise PrefilterError("no C compiler (cc, gcc or $CC) to build the pre-filter")
    with tempfile.TemporaryDirectory(prefix="oci-gpu-hook-prefilter-") as work:
        with open(os.path.join(work, "prefilter_rule.h"), "w") as f:
            f.write(header(python_hook, launcher_options, start_server))
        done = subprocess.run([cc, *CFLAGS, *flags, "-I", work, "-o", output, SOURCE], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                                             "LC_ALL": "C"})  # fmt: skip
        if done.returncode != 0:
            first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip())
            raise PrefilterError(f"{cc}: cannot build the pre-filter: {first[:300]}")
    os.chmod(output, 0o755)
    return output
