"""Reader of glibc's /etc/ld.so.cache (what `ldconfig -p` prints), in pure Python.

Two layouts exist (format facts from glibc's dl-cache.h):

* new, "glibc-ld.so.cache" + "1.1": a 48-byte header (nlibs u32, len_strings u32, flags u8 + 3 pad,
  extension_offset u32, 3 unused u32) then nlibs 24-byte entries (flags i32, key u32, value u32,
  osversion u32, hwcap u64). key/value are offsets of NUL-terminated strings, relative to the start
  of this header (the start of the file when the file is new-format only).
* old/compat, "ld.so-1.7.0": a 16-byte header (11-byte magic, pad, nlibs u32) then nlibs 12-byte
  entries (flags i32, key u32, value u32) whose string offsets are relative to the end of that
  entry table. ldconfig's "compat" output hides a complete new-format cache right after the old
  table, aligned to 8 bytes; when it is there it is what glibc reads, and so do we.

Byte order: little-endian (x86-64, aarch64). The new header's flags say the writer's byte order
(0 unset, 2 little, 3 big): "unset" is read as little-endian, big-endian is read as such, 1
("invalid") is rejected. The old format carries no mark and is read as little-endian.

Names and paths are decoded with 'surrogateescape' (as os.fsdecode does), so any byte string a
file system allows round-trips through os.fsencode; an empty string is rejected.

Every malformed input raises InventoryError("<path>: <what is wrong>").
"""

from __future__ import annotations

import collections
import struct
from collections.abc import Iterable

from oci_gpu_hook.errors import InventoryError

MAX_CACHE_SIZE = 64 * 1024 * 1024

OLD_MAGIC = b"ld.so-1.7.0"
NEW_MAGIC = b"glibc-ld.so.cache1.1"

_OLD_HEADER = struct.Struct("<11sxI")  # magic, pad, nlibs: 16 bytes
_OLD_ENTRY = struct.Struct("<iII")  # flags, key, value: 12 bytes
_NEW_HEADER_LE = struct.Struct("<20sIIB3xI12x")  # magic+version, nlibs, len_strings, flags, ext offset: 48
_NEW_HEADER_BE = struct.Struct(">20sIIB3xI12x")
_NEW_ENTRY_LE = struct.Struct("<iIIIQ")  # flags, key, value, osversion, hwcap: 24 bytes
_NEW_ENTRY_BE = struct.Struct(">iIIIQ")
_NEW_ALIGN = 8  # alignof(struct cache_file_new): its entries hold a uint64_t

# Type of an entry (flags & FLAG_TYPE_MASK).
FLAG_TYPE_MASK = 0x00FF
FLAG_LIBC4 = 0x0000
FLAG_ELF = 0x0001
FLAG_ELF_LIBC5 = 0x0002
FLAG_ELF_LIBC6 = 0x0003

# Architecture/ABI of an entry (flags & FLAG_REQUIRED_MASK).
FLAG_REQUIRED_MASK = 0xFF00
FLAG_SPARC_LIB64 = 0x0100
FLAG_IA64_LIB64 = 0x0200
FLAG_X8664_LIB64 = 0x0300
FLAG_S390_LIB64 = 0x0400
FLAG_POWERPC_LIB64 = 0x0500
FLAG_MIPS64_LIBN32 = 0x0600
FLAG_MIPS64_LIBN64 = 0x0700
FLAG_X8664_LIBX32 = 0x0800
FLAG_ARM_LIBHF = 0x0900
FLAG_AARCH64_LIB64 = 0x0A00
FLAG_ARM_LIBSF = 0x0B00
FLAG_MIPS_LIB32_NAN2008 = 0x0C00
FLAG_MIPS64_LIBN32_NAN2008 = 0x0D00
FLAG_MIPS64_LIBN64_NAN2008 = 0x0E00
FLAG_RISCV_FLOAT_ABI_SOFT = 0x0F00
FLAG_RISCV_FLOAT_ABI_DOUBLE = 0x1000
FLAG_LARCH_FLOAT_ABI_SOFT = 0x1100
FLAG_LARCH_FLOAT_ABI_DOUBLE = 0x1200

# word_size is the ELF class of the library: 64 or 32 (x32 and MIPS n32 are ILP32, ELFCLASS32).
# RISC-V marks only the float ABI, the same for rv32 and rv64: unknown (0), as is anything unlisted.
_WORD_SIZE_BY_ARCH = {
    FLAG_SPARC_LIB64: 64,
    FLAG_IA64_LIB64: 64,
    FLAG_X8664_LIB64: 64,
    FLAG_S390_LIB64: 64,
    FLAG_POWERPC_LIB64: 64,
    FLAG_MIPS64_LIBN64: 64,
    FLAG_AARCH64_LIB64: 64,
    FLAG_MIPS64_LIBN64_NAN2008: 64,
    FLAG_LARCH_FLOAT_ABI_SOFT: 64,  # glibc supports only LoongArch64
    FLAG_LARCH_FLOAT_ABI_DOUBLE: 64,
    FLAG_MIPS64_LIBN32: 32,
    FLAG_X8664_LIBX32: 32,
    FLAG_ARM_LIBHF: 32,
    FLAG_ARM_LIBSF: 32,
    FLAG_MIPS_LIB32_NAN2008: 32,
    FLAG_MIPS64_LIBN32_NAN2008: 32,
}

# Header flags: the writer's byte order.
_ENDIAN_MASK = 0x03
_ENDIAN_UNSET = 0
_ENDIAN_INVALID = 1
_ENDIAN_BIG = 3


# name: the soname ("libcuda.so.1"); path: "/usr/lib64/libcuda.so.1"; word_size: 64, 32, or 0
# when the flags do not tell; flags: the raw entry flags; hwcap: raw (0 in the old format).
CacheEntry = collections.namedtuple("CacheEntry", ("name", "path", "word_size", "flags", "hwcap"))


def word_size_of(flags: int) -> int:
    """ELF class (64/32) of a cache entry from its flags, 0 when unknown. Mapped: sparc64, ia64,
    x86-64, s390x, ppc64, mips n64 (both NaN modes), aarch64, loongarch64 -> 64; x32, mips n32 (both
    NaN modes), mips o32 nan2008, arm hf/sf, and libc6 with no arch bits (i386 etc.) -> 32."""
    arch = flags & FLAG_REQUIRED_MASK
    if arch:
        return _WORD_SIZE_BY_ARCH.get(arch, 0)
    return 32 if flags & FLAG_TYPE_MASK == FLAG_ELF_LIBC6 else 0


def read(path: str) -> tuple[CacheEntry, ...]:
    """Read and parse the cache file at `path`."""
    from oci_gpu_hook.start import files

    try:
        data = files.read_bounded(path, MAX_CACHE_SIZE)
    except OSError as e:
        raise InventoryError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) > MAX_CACHE_SIZE:
        raise InventoryError(f"{path}: larger than {MAX_CACHE_SIZE} bytes")
    return parse(data, path)


def parse(data: bytes, path: str) -> tuple[CacheEntry, ...]:
    """Parse the bytes of an ld.so.cache; `path` names it in error messages."""
    data = bytes(data)
    if data.startswith(NEW_MAGIC):
        return _parse_new(data, 0, path)
    if data.startswith(OLD_MAGIC):
        if len(data) < _OLD_HEADER.size:
            raise InventoryError(f"{path}: truncated old-format header ({len(data)} bytes)")
        nlibs = _OLD_HEADER.unpack_from(data)[1]
        table = _OLD_HEADER.size
        if nlibs > (len(data) - table) // _OLD_ENTRY.size:
            raise InventoryError(f"{path}: old-format entry count {nlibs} does not fit in {len(data)} bytes")
        strings = table + nlibs * _OLD_ENTRY.size
        new = -(-strings // _NEW_ALIGN) * _NEW_ALIGN
        if data.startswith(NEW_MAGIC, new):
            return _parse_new(data, new, path)
        return _parse_old(data, table, nlibs, strings, path)
    raise InventoryError(f"{path}: not an ld.so.cache (unknown magic {data[:20]!r})")


def _parse_new(data: bytes, base: int, path: str) -> tuple[CacheEntry, ...]:
    if len(data) - base < _NEW_HEADER_LE.size:
        raise InventoryError(f"{path}: truncated header at offset {base} ({len(data) - base} bytes)")
    hflags = data[base + 28]
    endian = hflags & _ENDIAN_MASK
    if endian == _ENDIAN_INVALID:
        raise InventoryError(f"{path}: header flags {hflags:#x} mark an invalid byte order")
    header, entry = (_NEW_HEADER_BE, _NEW_ENTRY_BE) if endian == _ENDIAN_BIG else (_NEW_HEADER_LE, _NEW_ENTRY_LE)
    _, nlibs, _len_strings, _, _ext = header.unpack_from(data, base)
    table = base + header.size
    if nlibs > (len(data) - table) // entry.size:
        raise InventoryError(f"{path}: entry count {nlibs} does not fit in {len(data)} bytes")
    rows = entry.iter_unpack(memoryview(data)[table : table + nlibs * entry.size])
    return _entries(data, base, rows, path)


def _parse_old(data: bytes, table: int, nlibs: int, base: int, path: str) -> tuple[CacheEntry, ...]:
    rows = _OLD_ENTRY.iter_unpack(memoryview(data)[table : table + nlibs * _OLD_ENTRY.size])
    return _entries(data, base, ((flags, key, value, 0, 0) for flags, key, value in rows), path)


def _entries(data: bytes, base: int, rows: Iterable[tuple], path: str) -> tuple[CacheEntry, ...]:
    """Entries from rows of (flags, key, value, osversion, hwcap); key and value are offsets from
    `base` of NUL-terminated strings. This loop is the parser's hot path, hence inlined lookups."""
    find = data.find
    strings: dict[int, str] = {}  # by offset: ldconfig shares strings (the same path recurs)
    get_string = strings.get
    sizes: dict[int, int] = {}
    get_size = sizes.get
    out: list[CacheEntry] = []
    append = out.append
    for flags, key, value, _osversion, hwcap in rows:
        name = get_string(key)
        if name is None:
            start = base + key
            stop = find(b"\0", start)  # -1 when start is past the end
            if stop <= start:
                raise _bad_string(data, base, key, path)
            name = strings[key] = data[start:stop].decode("utf-8", "surrogateescape")
        file = get_string(value)
        if file is None:
            start = base + value
            stop = find(b"\0", start)
            if stop <= start:
                raise _bad_string(data, base, value, path)
            file = strings[value] = data[start:stop].decode("utf-8", "surrogateescape")
        word_size = get_size(flags)
        if word_size is None:
            word_size = sizes[flags] = word_size_of(flags)
        append(CacheEntry(name, file, word_size, flags, hwcap))
    return tuple(out)


def _bad_string(data: bytes, base: int, offset: int, path: str) -> InventoryError:
    start = base + offset
    if start >= len(data):
        return InventoryError(f"{path}: string offset {offset} is past the end of the file")
    if data[start] == 0:
        return InventoryError(f"{path}: empty string at offset {offset}")
    return InventoryError(f"{path}: string at offset {offset} is not NUL-terminated")
