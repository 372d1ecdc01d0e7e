"""What an ELF file says about its loading: its SONAME, the libraries it NEEDs (DT_NEEDED), where
the loader is to look for them (DT_RPATH, DT_RUNPATH) and the loader itself (PT_INTERP).

Discovery reads these from the driver's own files, so that a container that gets a driver library
also gets every driver library it needs (libnvidia-glcore NEEDs libnvidia-gpucomp, whichever
capability lists it): the truth is in the ELF file, not in a table. install's trust check reads
them to follow what the hook's interpreter maps (toolkit/ldso.py) without running anything.
Only the program headers and the dynamic section are read, as the loader reads them; standard
library only, bounded reads.
"""

from __future__ import annotations

import os
import struct

from oci_gpu_hook.frozen import Frozen

MAX_HEADERS = 256  # program headers; real libraries have about ten
MAX_DYNAMIC = 1 << 16  # bytes of dynamic section
MAX_NAME = 4096  # bytes of one name or search path (PATH_MAX)
PT_LOAD, PT_DYNAMIC, PT_INTERP = 1, 2, 3
DT_NULL, DT_NEEDED, DT_STRTAB, DT_STRSZ, DT_SONAME, DT_RPATH, DT_RUNPATH = 0, 1, 5, 10, 14, 15, 29


class NotElf(ValueError):
    """Not an ELF shared object this reader understands."""


class Dynamic(Frozen):
    """How one ELF file is loaded. rpath and runpath: None when the tag is absent (an empty
    one means the working directory to the loader); interpreter: PT_INTERP or None."""

    __slots__ = ("wide", "machine", "interpreter", "soname", "needed", "rpath", "runpath")
    wide: bool  # ELFCLASS64: the loader maps only objects of its own class and machine
    machine: int  # e_machine
    interpreter: str | None
    soname: str | None
    needed: tuple
    rpath: str | None
    runpath: str | None


def read_dynamic(path: str) -> tuple:
    """(SONAME or None, NEEDED names) of the ELF file at path. NotElf or OSError otherwise."""
    found = read(path)
    return found.soname, found.needed


def read(path: str) -> Dynamic:
    """How the ELF file at path is loaded. NotElf or OSError otherwise."""
    with open(path, "rb") as f:
        end = os.fstat(f.fileno()).st_size
        head = f.read(64)
        if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
            raise NotElf(f"{path}: not an ELF file")
        if head[4] == 2 and len(head) < 64:
            raise NotElf(f"{path}: a truncated ELF header")
        wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
        machine = struct.unpack_from(order + "H", head, 18)[0]
        if wide:
            phoff, phentsize, phnum = struct.unpack_from(order + "Q", head, 32)[0], *struct.unpack_from(
                order + "HH", head, 54)  # fmt: skip
        else:
            phoff, phentsize, phnum = struct.unpack_from(order + "I", head, 28)[0], *struct.unpack_from(
                order + "HH", head, 42)  # fmt: skip
        if phnum > MAX_HEADERS or phentsize < (56 if wide else 32):
            raise NotElf(f"{path}: implausible program headers")
        table = _read_at(f, phoff, phentsize * phnum, end, path)
        loads, dynamic, interpreter = [], None, None
        for i in range(phnum):
            entry = table[i * phentsize : (i + 1) * phentsize]
            if len(entry) < (56 if wide else 32):
                raise NotElf(f"{path}: truncated program headers")
            if wide:
                kind, _, offset, vaddr, _, filesz = struct.unpack_from(order + "IIQQQQ", entry)
            else:
                kind, offset, vaddr, _, filesz = struct.unpack_from(order + "IIIII", entry)
            if kind == PT_LOAD:
                loads.append((vaddr, offset, filesz))
            elif kind == PT_DYNAMIC:
                dynamic = (offset, min(filesz, MAX_DYNAMIC))
            elif kind == PT_INTERP:
                interpreter = _string(f, offset, min(filesz, MAX_NAME), end, path)
        if dynamic is None:
            return Dynamic(wide, machine, interpreter, None, (), None, None)
        data = _read_at(f, dynamic[0], dynamic[1], end, path)
        size = 16 if wide else 8
        fmt = order + ("qQ" if wide else "iI")
        entries = []
        for i in range(len(data) // size):
            tag, value = struct.unpack_from(fmt, data, i * size)
            if tag == DT_NULL:
                break
            entries.append((tag, value))
        tags = dict((t, v) for t, v in entries if t in (DT_STRTAB, DT_STRSZ))
        if DT_STRTAB not in tags:
            return Dynamic(wide, machine, interpreter, None, (), None, None)
        strtab = _file_offset(loads, tags[DT_STRTAB])
        if strtab is None:
            raise NotElf(f"{path}: its string table is outside every loaded segment")
        strsz = tags.get(DT_STRSZ)

        def name(offset: int) -> str:
            # Each name read where it is: a C++ library's string table runs to megabytes.
            if strsz is not None and offset >= strsz:
                raise NotElf(f"{path}: a name past the end of its string table")
            limit = MAX_NAME if strsz is None else min(MAX_NAME, strsz - offset)
            return _string(f, strtab + offset, limit, end, path)

        def first(tag: int):
            return next((name(v) for t, v in entries if t == tag), None)

        needed = tuple(name(v) for t, v in entries if t == DT_NEEDED)
        return Dynamic(wide, machine, interpreter, first(DT_SONAME), needed, first(DT_RPATH), first(DT_RUNPATH))


def _read_at(f, offset: int, limit: int, size: int, path: str) -> bytes:
    """Up to limit bytes at offset. Every offset a file states goes through here: one past the
    file's end (up to 2**64 - 1 in a crafted header) is NotElf, never a seek the C library
    refuses with ValueError or EINVAL, which would end the hook or install in a traceback."""
    if offset > size:
        raise NotElf(f"{path}: an offset past the end of the file")
    f.seek(offset)
    return f.read(limit)


def _string(f, offset: int, limit: int, size: int, path: str) -> str:
    """The NUL-terminated string at offset, as the file system would take it (surrogateescape)."""
    data = _read_at(f, offset, limit, size, path)
    end = data.find(b"\0")
    if end < 0 and len(data) < limit:
        raise NotElf(f"{path}: a name runs past the end of the file")
    return data[: end if end >= 0 else len(data)].decode("utf-8", "surrogateescape")


def _file_offset(loads, vaddr: int):
    for start, offset, size in loads:
        if start <= vaddr < start + size:
            return offset + vaddr - start
    return None
