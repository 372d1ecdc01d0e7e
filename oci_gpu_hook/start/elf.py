"""What a shared library says about itself: its SONAME and the libraries it NEEDs (DT_NEEDED).

Discovery reads these from the driver's own files, so that a container that gets a driver library
also gets every driver library it needs (libnvidia-glcore NEEDs libnvidia-gpucomp, whichever
capability lists it): the truth is in the ELF file, not in a table. Only the dynamic section is
read, through the program headers, as the loader reads it; standard library only, bounded reads.
"""

from __future__ import annotations

import struct

MAX_HEADERS = 256  # program headers; real libraries have about ten
MAX_DYNAMIC = 1 << 16  # bytes of dynamic section
MAX_STRTAB = 1 << 20  # bytes of dynamic string table
PT_LOAD, PT_DYNAMIC = 1, 2
DT_NULL, DT_NEEDED, DT_STRTAB, DT_STRSZ, DT_SONAME = 0, 1, 5, 10, 14


class NotElf(ValueError):
    """Not an ELF shared object this reader understands."""


def read_dynamic(path: str) -> tuple:
    """(SONAME or None, NEEDED names) of the ELF file at path. NotElf or OSError otherwise."""
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
            raise NotElf(f"{path}: not an ELF file")
        wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
        if wide:
            phoff, phentsize, phnum = struct.unpack_from(order + "Q", head, 32)[0], *struct.unpack_from(
                order + "HH", head, 54)  # fmt: skip
        else:
            phoff, phentsize, phnum = struct.unpack_from(order + "I", head, 28)[0], *struct.unpack_from(
                order + "HH", head, 42)  # fmt: skip
        if phnum > MAX_HEADERS or phentsize < (56 if wide else 32):
            raise NotElf(f"{path}: implausible program headers")
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        loads, dynamic = [], None
        for i in range(phnum):
            entry = table[i * phentsize : (i + 1) * phentsize]
            if wide:
                kind, _, offset, vaddr, _, filesz = struct.unpack_from(order + "IIQQQQ", entry)
            else:
                kind, offset, vaddr, _, filesz = struct.unpack_from(order + "IIIII", entry)
            if kind == PT_LOAD:
                loads.append((vaddr, offset, filesz))
            elif kind == PT_DYNAMIC:
                dynamic = (offset, min(filesz, MAX_DYNAMIC))
        if dynamic is None:
            return None, ()
        f.seek(dynamic[0])
        data = f.read(dynamic[1])
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
            return None, ()
        strtab = _file_offset(loads, tags[DT_STRTAB])
        if strtab is None:
            raise NotElf(f"{path}: its string table is outside every loaded segment")
        f.seek(strtab)
        strings = f.read(min(tags.get(DT_STRSZ, MAX_STRTAB), MAX_STRTAB))

    def name(offset: int) -> str:
        end = strings.find(b"\0", offset)
        return strings[offset : end if end >= 0 else len(strings)].decode("utf-8", "replace")

    soname = next((name(v) for t, v in entries if t == DT_SONAME), None)
    return soname, tuple(name(v) for t, v in entries if t == DT_NEEDED)


def _file_offset(loads, vaddr: int):
    for start, offset, size in loads:
        if start <= vaddr < start + size:
            return offset + vaddr - start
    return None
