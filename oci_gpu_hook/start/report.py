"""The log of what the hook did or why it failed: one entry per event, tagged with the container id.

The runtime shows the user one line (stderr); operators get these entries in the log file and/or
syslog. Writing it must never make a container fail: errors here are swallowed.
"""

import os
import time

from oci_gpu_hook.errors import printable
from oci_gpu_hook.start import jsonio

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}
# How this start came, in each of its log entries: None for the hook's own process; the start
# server's workers set it (start/server.py), so an operator can tell which path ran.
VIA = None


def log(settings, container_id: str, level: str, message: str, **details) -> None:
    if settings is None or _LEVELS[level] < _LEVELS[settings.logging.level]:
        return
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "container": container_id, "level": level,
             "message": message, **details}  # fmt: skip
    if VIA is not None:
        entry["via"] = VIA
    if settings.logging.file:
        try:
            fd = os.open(settings.logging.file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o640)  # fmt: skip
            try:
                os.write(fd, (jsonio.dumps(entry, sort_keys=True) + "\n").encode())
            finally:
                os.close(fd)
        except OSError:
            pass
    if settings.logging.syslog:
        import syslog

        priority = {"debug": syslog.LOG_DEBUG, "info": syslog.LOG_INFO, "warning": syslog.LOG_WARNING}.get(
            level, syslog.LOG_ERR
        )
        syslog.openlog("oci-gpu-hook", syslog.LOG_PID, syslog.LOG_DAEMON)
        # The log file is JSON (escaped); a syslog line is shown as it is.
        syslog.syslog(priority, printable(f"container {container_id}: {message}"))
