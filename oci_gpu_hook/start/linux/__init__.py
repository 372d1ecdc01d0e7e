"""Mechanisms of the start path: they do what the plan says and hold no policy of their own.

_linux.py is the only ctypes module (syscall numbers come from arch.py's per-architecture table).
"""
