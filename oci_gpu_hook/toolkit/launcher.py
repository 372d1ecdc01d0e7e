"""The launcher: the small Python program a runtime runs, whatever way the package was installed.

The RPM's /usr/bin/oci-gpu-hook, the program `oci-gpu-hook install` writes for a pip install
(LAUNCHER), and Docker's nvidia-container-runtime-hook are all this text, so every way of
installing the hook starts a container as fast as the RPM does. A console script made by pip
would not: it starts Python without -I and with site (the host's and the venv's .pth files run
on every container start), imports re, and Docker's program would add a shell in front.

- `-IS`: isolated (no PYTHONPATH, PYTHONHOME or user site from the runtime's environment) and
  no site module. One word: a shebang passes everything after the interpreter as one argument.
- The package's directory is appended, after the standard library, so that nothing installed
  beside the package can stand in for a standard module.
- The interpreter and that directory must be root's alone: the launcher runs as root on every
  container start, so whoever can change either runs code as root (`check_trusted`).
"""

from __future__ import annotations

import os
import sys

from oci_gpu_hook.errors import Exit, HookError
from oci_gpu_hook.start.linux.sources import HostSources, UntrustedSource

MARKER = "# oci-gpu-hook launcher"
# Where install puts the launcher when no RPM's /usr/bin/oci-gpu-hook is one: a directory of its
# own, so that nothing else of the host's is shadowed or replaced.
LAUNCHER = "/usr/local/libexec/oci-gpu-hook/oci-gpu-hook"
MAX_SHEBANG = 255  # the kernel reads 256 bytes of '#!' line (BINPRM_BUF_SIZE) since Linux 5.1


class LauncherError(HookError):
    exit_code = Exit.INSTALL


def package_parent() -> str:
    """The directory this package is imported from (site-packages, or a source checkout)."""
    import oci_gpu_hook

    return os.path.dirname(os.path.dirname(os.path.abspath(oci_gpu_hook.__file__)))


def text(interpreter: str, parent: str, options=(), note: str = "") -> str:
    """The launcher for interpreter with the package in parent; options go before the user's
    arguments (a --config). note: comment lines (each '# ...\n') saying who wrote it and why."""
    for what, value in (("interpreter", interpreter), ("package directory", parent)):
        if not os.path.isabs(value) or any(c.isspace() or not c.isprintable() for c in value):
            raise LauncherError(f"{value!r}: the {what} of a launcher must be an absolute path without spaces")
    shebang = f"#!{interpreter} -IS"
    if len(shebang) > MAX_SHEBANG:
        raise LauncherError(f"{interpreter}: too long for a '#!' line ({len(shebang)} bytes, the kernel reads "
                            f"{MAX_SHEBANG})")  # fmt: skip
    call = f"main(options={list(options)!r})" if options else "main()"
    return (
        f"{shebang}\n"
        f"{MARKER}: -IS keeps the runtime's environment and the site module out of every container start.\n"
        + note
        + "import sys\n"
        f"sys.path.append({parent!r})\n"
        "from oci_gpu_hook.hook import main\n"
        f"sys.exit({call})\n"
    )


def for_this_install(options=(), note: str = "") -> str:
    """The launcher of the interpreter and package this process runs (a venv's python stays the
    venv's: its pyvenv.cfg is read without site, and the CLI's site then adds the venv's packages)."""
    return text(sys.executable, package_parent(), options, note)


def is_launcher(path: str) -> bool:
    """Whether path is a launcher (its second line carries MARKER)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    lines = head.split(b"\n")
    return len(lines) > 1 and lines[0].startswith(b"#!") and lines[1].startswith(MARKER.encode())


def check_trusted(interpreter: str | None = None, parent: str | None = None) -> None:
    """Refuse an interpreter or package directory that anyone but root could change (a user's
    venv, `pip install --user` as a user): checked as the hook checks its mount sources."""
    sources = HostSources()
    try:
        parent = parent or package_parent()
        for path, kind in ((interpreter or sys.executable, "file"), (parent, "dir"),
                           (os.path.join(parent, "oci_gpu_hook"), "dir")):  # fmt: skip
            try:
                os.close(sources.open(path, kind))
            except UntrustedSource as e:
                raise LauncherError(f"{e}: the hook runs as root on every container start, so its interpreter and "
                                    "package must be root's alone (install it as root, outside a user's home)"
                                    ) from None  # fmt: skip
            except OSError as e:
                raise LauncherError(f"{path}: {e.strerror}") from None
    finally:
        sources.close()
