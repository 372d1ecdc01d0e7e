"""The machines the hook runs on, x86_64 and aarch64 (Grace Hopper, Grace Blackwell), and the one
table of what differs between them.

Two things differ: the numbers of the system calls _linux.py makes through syscall(2) (bpf and
pivot_root; the ones added since Linux 5.2 share one number everywhere but alpha, ia64 and mips),
and where a Debian-like image's loader looks for libraries (its multiarch directories). The
rest is the same on both: os module flags come from the running Python, and the bpf_attr
layout, the eBPF instruction encoding and ld.so.cache are little-endian on both.

On any other machine the first GPU start fails with one line (UnsupportedArchitecture):
prestart asks current() as soon as a container asks for GPUs, before anything is read or
changed (the library layout and _linux._nr ask it too). A container that cannot be asking for a
GPU never gets here.

The RPM is noarch: its %check runs verify(), which fails the build unless every architecture
numbers every system call _linux.py makes and has a library layout.
"""

from __future__ import annotations

import os

from oci_gpu_hook.errors import PrerequisiteError
from oci_gpu_hook.frozen import Frozen

# Every name _linux.py passes to _nr() (verify() reads _linux.py's source to make sure).
SYSCALL_NAMES = ("pivot_root", "bpf", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
                 "pidfd_open", "openat2", "mount_setattr", "timer_create", "timer_settime", "timer_delete")  # fmt: skip

# The same on x86_64 (arch/x86/entry/syscalls/syscall_64.tbl) and aarch64 (the generic table,
# include/uapi/asm-generic/unistd.h).
_SINCE_5_2 = {"open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
              "pidfd_open": 434, "openat2": 437, "mount_setattr": 442}  # fmt: skip


class Architecture(Frozen):
    """One machine type, by its os.uname().machine name."""

    __slots__ = ("machine", "syscalls", "multiarch", "multiarch32", "lib64", "lib32", "loader")
    machine: str
    syscalls: dict[str, int]  # name -> number, for every name in SYSCALL_NAMES
    multiarch: str  # a Debian-like image's library directory
    multiarch32: str | None  # and its 32-bit one; None: no 32-bit libraries are placed
    lib64: str  # any other image's
    lib32: str | None
    loader: str  # the glibc dynamic loader, as programs name it (PT_INTERP)


ARCHITECTURES = {
    "x86_64": Architecture(
        "x86_64",
        {"pivot_root": 155, "bpf": 321, "timer_create": 222, "timer_settime": 223, "timer_delete": 226, **_SINCE_5_2},
        "/usr/lib/x86_64-linux-gnu", "/usr/lib/i386-linux-gnu",
        "/usr/lib64", "/usr/lib",
        "/lib64/ld-linux-x86-64.so.2",
    ),
    # NVIDIA's aarch64 driver ships no 32-bit (armhf) libraries: compat32 places nothing there.
    "aarch64": Architecture(
        "aarch64",
        {"pivot_root": 41, "bpf": 280, "timer_create": 107, "timer_settime": 110, "timer_delete": 111, **_SINCE_5_2},
        "/usr/lib/aarch64-linux-gnu", None,
        "/usr/lib64", None,
        "/lib/ld-linux-aarch64.so.1",
    ),
}  # fmt: skip

MACHINE = os.uname().machine


class UnsupportedArchitecture(PrerequisiteError):
    """This machine is neither x86_64 nor aarch64."""

    def __init__(self, machine: str):
        super().__init__(
            f"unsupported architecture {machine!r}: oci-gpu-hook runs on {' and '.join(ARCHITECTURES)} only "
            "(it knows their system call numbers and library directories)"
        )


def current(machine: str | None = None) -> Architecture:
    """The table entry for machine (default: this one); UnsupportedArchitecture if there is none."""
    name = MACHINE if machine is None else machine
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise UnsupportedArchitecture(name) from None


def verify() -> None:
    """Raise AssertionError unless the table is complete for every architecture and _linux.py
    makes no system call but through _nr() with a name in SYSCALL_NAMES (the RPM's %check; not
    assert statements, which python -O would drop)."""
    import ast

    def need(ok, what) -> None:
        if not ok:
            raise AssertionError(what)

    need(set(ARCHITECTURES) == {"x86_64", "aarch64"}, sorted(ARCHITECTURES))
    for name, entry in ARCHITECTURES.items():
        need(entry.machine == name, entry)
        missing, extra = set(SYSCALL_NAMES) - set(entry.syscalls), set(entry.syscalls) - set(SYSCALL_NAMES)
        need(not missing and not extra, f"{name}: no number for {sorted(missing)}; unused {sorted(extra)}")
        numbers = list(entry.syscalls.values())
        need(all(type(n) is int and n > 0 for n in numbers) and len(set(numbers)) == len(numbers), entry)
        dirs = [entry.multiarch, entry.lib64, entry.loader] + [d for d in (entry.multiarch32, entry.lib32) if d]
        need(all(d.startswith("/") and d == os.path.normpath(d) for d in dirs), entry)
        need((entry.multiarch32 is None) == (entry.lib32 is None), entry)

    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_linux.py")
    with open(source, encoding="utf-8") as f:
        tree = ast.parse(f.read(), source)
    used = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "_nr":
            arg = node.args[0] if len(node.args) == 1 and not node.keywords else None
            need(isinstance(arg, ast.Constant) and isinstance(arg.value, str), f"_linux.py:{node.lineno}: _nr(?)")
            need(arg.value in SYSCALL_NAMES, f"_linux.py:{node.lineno}: _nr({arg.value!r}) is not in SYSCALL_NAMES")
            used.add(arg.value)
        elif isinstance(func, ast.Attribute) and func.attr == "syscall":
            first = node.args[0] if node.args else None
            from_nr = isinstance(first, ast.Call) and isinstance(first.func, ast.Name) and first.func.id == "_nr"
            need(from_nr, f"_linux.py:{node.lineno}: syscall() with a number that does not come from _nr()")
    need(used == set(SYSCALL_NAMES), f"SYSCALL_NAMES that _linux.py never uses: {sorted(set(SYSCALL_NAMES) - used)}")
