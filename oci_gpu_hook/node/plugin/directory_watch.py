"""Waking the supervisor when the kubelet's device-plugins directory changes (inotify): a
restarted kubelet wipes our sockets and makes a new kubelet.sock, and it re-admits running pods
within a fraction of a second, against the devices registered by then. Waking on those events,
rather than on the next interval, registers the plugin again before that."""

from __future__ import annotations

import os
import time


class DirectoryWatch:
    """inotify on one directory. Without inotify (or on error) wait() just sleeps: the
    supervisor's interval still catches every change."""

    _EVENTS = 0x100 | 0x200 | 0x80 | 0x40  # IN_CREATE | IN_DELETE | IN_MOVED_TO | IN_MOVED_FROM

    def __init__(self, directory: str):
        self.fd = -1
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd >= 0 and libc.inotify_add_watch(fd, os.fsencode(directory), self._EVENTS) >= 0:
                self.fd = fd
            elif fd >= 0:
                os.close(fd)
        except (OSError, AttributeError):
            pass

    def wait(self, timeout: float, stopping) -> None:
        """Until an event in the directory, stopping is set, or timeout."""
        if self.fd < 0:
            stopping.wait(timeout)
            return
        import select

        deadline = time.monotonic() + timeout
        # Short slices so that a stop request is seen promptly even without an event.
        while not stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.25))
            if ready:
                try:
                    while os.read(self.fd, 65536):
                        pass
                except BlockingIOError:
                    pass
                return

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
