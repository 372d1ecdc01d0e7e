"""The project's one exception tree.

Every error a user can cause or meet is a HookError: it carries a one-line message (what the
runtime shows to the user) and an exit status. Anything else escaping is a bug, reported as such.

Messages quote text from images (env values and names, paths in the rootfs); printable() is the
one place such text is made safe to show, and every HookError message goes through it.
"""


def printable(text: str) -> str:
    """text with every character str.isprintable() rejects written as repr() writes it (\\x1b,
    \\u202e, \\ud800): C0 and C1 controls, DEL, line and paragraph separators, bidi and other
    format characters, lone surrogates. Text from an image must not drive the terminal that shows
    an error (ESC sequences, BEL, a CR that overwrites the line), reorder it (U+202E) or break a
    log or syslog line. Backslashes are kept, so applying it twice changes nothing."""
    if text.isprintable():  # the usual case, at C speed
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class Exit:
    """Every exit status the program uses, in one place; docs/cli.md shows the same table (a test
    compares them). `doctor` answers 0/1/2 for PASS/WARN/FAIL instead (see its section)."""

    SUCCESS = 0
    GENERAL = 1
    USAGE = 2
    CONFIG = 3
    INVENTORY = 4
    REQUEST = 5
    SIMULATE = 6
    PREREQUISITE = 7
    STATE = 8
    CGROUP = 9
    LDCONFIG = 10
    APPLY = 11
    LABEL = 12
    CDI = 13
    INSTALL = 14
    INTERNAL = 70  # EX_SOFTWARE: a bug
    RESTART = 75  # EX_TEMPFAIL: not 0, so that systemd (Restart=on-failure) and Kubernetes start it again
    INTERRUPTED = 130  # 128 + SIGINT, as shells report it

    MEANINGS = {
        SUCCESS: "success (also: not a GPU container, nothing done)",
        GENERAL: "general error",
        USAGE: "the command line was wrong",
        CONFIG: "the configuration file is missing, unreadable or invalid",
        INVENTORY: "the host's driver, device nodes, driver files or NVML",
        REQUEST: "the container's request (including an unmet NVIDIA_REQUIRE_*)",
        SIMULATE: "building or removing a simulated host",
        PREREQUISITE: "a missing prerequisite (root, gcc, runc, ldconfig, kernel, architecture)",
        STATE: "the OCI state on stdin or the bundle's config.json",
        CGROUP: "the container's device cgroup",
        LDCONFIG: "refreshing the container's ld.so.cache",
        APPLY: "applying the plan in the container (mounts, files, the deadline)",
        LABEL: "SELinux labels",
        CDI: "CDI spec generation",
        INSTALL: "install or uninstall",
        INTERNAL: "internal error: a bug (OCI_GPU_HOOK_DEBUG=1 shows the traceback)",
        RESTART: "a node service stops to be started again: the NVIDIA driver's NVML library changed",
        INTERRUPTED: "interrupted (Ctrl-C)",
    }


def exit_reason(code: int) -> str:
    """The exit status's name in lower case ("request", "ldconfig"): a failure's reason in the
    container records and the exporter's counters."""
    for name, value in vars(Exit).items():
        if name.isupper() and value == code:
            return name.lower()
    return "unknown"


class HookError(Exception):
    """An error with a one-line message meant for the user."""

    exit_code = Exit.GENERAL

    def __init__(self, message: str):
        # Newlines would break the runtime's one-line error report; whatever module built the
        # message, image text in it must not reach a terminal or log raw.
        super().__init__(printable(" ".join(str(message).split())))

    @property
    def message(self) -> str:
        return str(self)


class UsageError(HookError):
    """The command line was wrong."""

    exit_code = Exit.USAGE


class ConfigError(HookError):
    """The configuration file is missing, unreadable or invalid."""

    exit_code = Exit.CONFIG


class InventoryError(HookError):
    """The host's driver, devices or files are not what they must be."""

    exit_code = Exit.INVENTORY


class NvmlError(InventoryError):
    """NVML failed, timed out, or disagrees with procfs: what a stale cache's rebuild runs into."""


class RequestError(HookError):
    """The container asks for something malformed or impossible."""

    exit_code = Exit.REQUEST


class RequirementError(RequestError):
    """An NVIDIA_REQUIRE_* condition is not met by the host."""


class SimulateError(HookError):
    """The simulated GPU host could not be built or removed."""

    exit_code = Exit.SIMULATE


class PrerequisiteError(HookError):
    """A tool or privilege the command needs is missing (root, gcc, ldconfig, ...)."""

    exit_code = Exit.PREREQUISITE


PROG = "oci-gpu-hook"


def _one_line_on_stderr(message: str) -> None:
    """One line on stderr, the program's name first. HookError messages are safe already; an
    internal error's text (any exception's) is not, so every line goes through printable()."""
    import sys

    sys.stderr.write(f"{PROG}: {printable(message)}\n")
    sys.stderr.flush()


def exit_status_of(call) -> int:
    """call()'s exit status; whatever it raises becomes one line on stderr and an exit status, never
    a traceback (OCI_GPU_HOOK_DEBUG=1 shows one for bug reports). The program's own entry point
    (hook.py) and the start server's workers (start/server.py) answer the same way."""
    try:
        return call()
    except HookError as e:
        _one_line_on_stderr(e.message)
        return e.exit_code
    except KeyboardInterrupt:
        _one_line_on_stderr("interrupted")
        return Exit.INTERRUPTED
    except Exception as e:  # a bug: say so in one line, keep the traceback for those who ask
        import os

        if os.environ.get("OCI_GPU_HOOK_DEBUG") == "1":
            import traceback

            traceback.print_exc()
        _one_line_on_stderr(
            f"internal error: {type(e).__name__}: {e} (please report this; OCI_GPU_HOOK_DEBUG=1 shows details)"
        )
        return Exit.INTERNAL
