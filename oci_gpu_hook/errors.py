"""The project's one exception tree.

Every error a user can cause or meet is a HookError: it carries a one-line message (what the
runtime shows to the user) and an exit status. Anything else escaping is a bug, reported as such.
"""


class HookError(Exception):
    """An error with a one-line message meant for the user."""

    exit_code = 1

    def __init__(self, message: str):
        # Newlines would break the runtime's one-line error report.
        super().__init__(" ".join(str(message).split()))

    @property
    def message(self) -> str:
        return str(self)


class UsageError(HookError):
    """The command line was wrong."""

    exit_code = 2


class ConfigError(HookError):
    """The configuration file is missing, unreadable or invalid."""

    exit_code = 3


class InventoryError(HookError):
    """The host's driver, devices or files are not what they must be."""

    exit_code = 4


class RequestError(HookError):
    """The container asks for something malformed or impossible."""

    exit_code = 5


class RequirementError(RequestError):
    """An NVIDIA_REQUIRE_* condition is not met by the host."""


class SimulateError(HookError):
    """The simulated GPU host could not be built or removed."""

    exit_code = 6


class PrerequisiteError(HookError):
    """A tool or privilege the command needs is missing (root, gcc, ldconfig, ...)."""

    exit_code = 7
