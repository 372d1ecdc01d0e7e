"""ld.so.cache parser: against caches the real ldconfig writes (and reads back with `ldconfig -p`),
hand-built caches in every layout, and fuzzed bytes that may only ever raise InventoryError."""

import os
import re
import shutil
import struct
import subprocess
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oci_gpu_hook.errors import InventoryError
from oci_gpu_hook.start import ldcache
from oci_gpu_hook.start.ldcache import CacheEntry

LIBC6, X8664, X32 = 0x0003, 0x0303, 0x0803

# --------------------------------------------------------------------------------------------
# Helpers


def ldconfig_p(cache):
    """(name, path, word size) per line of `ldconfig -p -C cache`, in its order. The word size is
    read from the "(libc6,x86-64)" column: x86-64/aarch64 -> 64, x32 or bare libc6 -> 32, else 0."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    argv = [ldconfig, "-p"] + (["-C", str(cache)] if cache else [])
    out = subprocess.run(argv, capture_output=True, check=True).stdout
    rows = []
    for line in os.fsdecode(out).splitlines():
        m = re.match(r"^\t(.+) \((.*)\) => (.+)$", line)
        if not m:
            continue
        name, desc, path = m.groups()
        kind = [part.strip() for part in desc.split(",") if "hwcap" not in part and "OS ABI" not in part]
        if kind[0] != "libc6":
            size = 0
        elif len(kind) == 1 or kind[1] in ("x32",):
            size = 32
        elif kind[1] in ("x86-64", "AArch64", "64bit"):
            size = 64
        else:
            size = -1  # an arch this test does not know: fails the comparison loudly
        rows.append((name, path, size))
    return rows


def rows_of(entries):
    return [(e.name, e.path, e.word_size) for e in entries]


def build_cache(entries, layout="new", order="<", header_flags=None):
    """Write a cache by hand from [(flags, name, path, hwcap)]: layout "new" (glibc >= 2.32),
    "compat" (old table, then the new format aligned to 8, strings shared) or "old" (old only)."""
    strings = bytearray()
    where = {}
    for s in [x for _, name, path, _ in entries for x in (name, path)]:
        if s not in where:
            where[s] = len(strings)
            strings += os.fsencode(s) + b"\0"
    n = len(entries)
    new_fixed = 48 + 24 * n
    if header_flags is None:
        header_flags = 3 if order == ">" else 2
    new = bytearray(struct.pack(order + "20sIIB3xI12x", b"glibc-ld.so.cache1.1", n, len(strings), header_flags, 0))
    for flags, name, path, hwcap in entries:
        new += struct.pack(order + "iIIIQ", flags, new_fixed + where[name], new_fixed + where[path], 0, hwcap)
    if layout == "new":
        return bytes(new + strings)
    old_fixed = 16 + 12 * n
    pad = -old_fixed % 8
    # old-format offsets count from the end of the old table; the new part hides in "strings"
    skip = 0 if layout == "old" else pad + len(new)
    old = bytearray(struct.pack("<11sxI", b"ld.so-1.7.0", n))
    for flags, name, path, _ in entries:
        old += struct.pack("<iII", flags, skip + where[name], skip + where[path])
    if layout == "old":
        return bytes(old + strings)
    return bytes(old + b"\0" * pad + new + strings)


SAMPLE = [
    (X8664, "libcuda.so.1", "/usr/lib64/libcuda.so.1", 0),
    (X8664, "libcuda.so", "/usr/lib64/libcuda.so", 0),
    (LIBC6, "libcuda.so.1", "/usr/lib/libcuda.so.1", 0),
    (X32, "libz.so.1", "/libx32/libz.so.1", 0),
    (0x0A03, "libnvidia-ml.so.1", "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1", 0),
    (X8664, "libm.so.6", "/usr/lib64/glibc-hwcaps/x86-64-v3/libm.so.6", 1 << 62),
    (0x0001, "libold.so", "/usr/lib/libold.so", 0),
]


def expected(entries, with_hwcap=True):
    return tuple(
        CacheEntry(name, path, ldcache.word_size_of(flags), flags, hwcap if with_hwcap else 0)
        for flags, name, path, hwcap in entries
    )


# --------------------------------------------------------------------------------------------
# Caches written by the real ldconfig

SRC = "int foo(void) { return 1; }\n"
SRC_LIBC = '#include <stdio.h>\nint bar(void) { return puts("x"); }\n'


@pytest.fixture(scope="session")
def libroot(tmp_path_factory, require):
    """A root with etc/ld.so.conf naming two directories of real shared libraries, 64-bit, 32-bit
    (when gcc -m32 works), a glibc-hwcaps variant and odd names; returns (root, has_m32)."""
    require("root", "gcc", "ldconfig")
    root = tmp_path_factory.mktemp("ldroot")
    work = tmp_path_factory.mktemp("ldsrc")
    (work / "x.c").write_text(SRC)
    (work / "y.c").write_text(SRC_LIBC)
    lib, lib32 = root / "opt/gpu/lib64", root / "opt/gpu/lib"
    hw = lib / "glibc-hwcaps/x86-64-v2"
    for d in (root / "etc", lib, lib32, hw):
        d.mkdir(parents=True)
    (root / "etc/ld.so.conf").write_text("/opt/gpu/lib64\n/opt/gpu/lib\n")

    def cc(out, soname, *flags, src="x.c"):
        argv = ["gcc", "-shared", "-fPIC", *flags, "-Wl,--no-as-needed", b"-Wl,-soname," + os.fsencode(soname)]
        subprocess.run([*argv, "-o", os.fsencode(out), str(work / src)], check=True, capture_output=True)

    cc(lib / "libfoo.so.1.2.3", "libfoo.so.1")
    cc(lib / "libbar.so.2.0", "libbar.so.2", src="y.c")
    cc(hw / "libbar.so.2.0", "libbar.so.2", src="y.c")
    cc(lib / "libnvidia-é.so.550.54", "libnvidia-é.so.1", src="y.c")
    cc(lib / os.fsdecode(b"libraw\xe9.so.7"), os.fsdecode(b"libraw\xe9.so.7"), src="y.c")
    m32 = subprocess.run(["gcc", "-m32", "-x", "c", "-c", "-o", "/dev/null", "-"], input=b"int x;").returncode == 0
    if m32:
        cc(lib32 / "libbar.so.2.0", "libbar.so.2", "-m32", src="y.c")
        cc(lib32 / "libqux.so.3", "libqux.so.3", "-m32", src="y.c")
    return root, m32


def run_ldconfig(root, *args):
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    return subprocess.run([ldconfig, "-r", str(root), *args], capture_output=True, text=True)


def test_ldconfig_new_format(libroot):
    root, m32 = libroot
    proc = run_ldconfig(root)
    assert proc.returncode == 0, proc.stderr
    cache = root / "etc/ld.so.cache"
    entries = ldcache.read(str(cache))
    want = ldconfig_p(cache)
    assert rows_of(entries) == want
    names = {e.name for e in entries}
    assert {"libfoo.so.1", "libbar.so.2", "libnvidia-é.so.1", "libraw\udce9.so.7"} <= names
    assert ("libfoo.so.1", "/opt/gpu/lib64/libfoo.so.1", 64) in want
    hwcap = [e for e in entries if "glibc-hwcaps" in e.path]
    assert len(hwcap) == 1 and hwcap[0].hwcap != 0 and hwcap[0].word_size == 64
    assert all(e.hwcap == 0 for e in entries if "glibc-hwcaps" not in e.path)
    assert all(e.flags & 0xFF == 3 for e in entries)
    if m32:
        assert ("libqux.so.3", "/opt/gpu/lib/libqux.so.3", 32) in rows_of(entries)
        assert ("libbar.so.2", "/opt/gpu/lib/libbar.so.2", 32) in rows_of(entries)


def test_ldconfig_32bit(libroot, require):
    require("gcc-m32")
    root, _ = libroot
    assert run_ldconfig(root, "-C", "/etc/ld32.cache").returncode == 0
    entries = ldcache.read(str(root / "etc/ld32.cache"))
    assert [e for e in entries if e.word_size == 32 and e.flags == LIBC6]
    assert rows_of(entries) == ldconfig_p(root / "etc/ld32.cache")


def test_ldconfig_compat_format(libroot):
    root, _ = libroot
    proc = run_ldconfig(root, "-c", "compat", "-C", "/etc/compat.cache")
    if proc.returncode != 0:
        pytest.skip(f"this ldconfig cannot write the compat format: {proc.stderr.strip()}")
    cache = root / "etc/compat.cache"
    data = cache.read_bytes()
    assert data.startswith(b"ld.so-1.7.0") and b"glibc-ld.so.cache1.1" in data
    entries = ldcache.parse(data, str(cache))
    assert rows_of(entries) == ldconfig_p(cache)
    # same content (hwcap included) as the new-format cache of the same root
    assert run_ldconfig(root, "-c", "new", "-C", "/etc/new.cache").returncode == 0
    assert entries == ldcache.read(str(root / "etc/new.cache"))


def test_host_cache_matches_ldconfig(require):
    require("ldconfig")
    if not os.path.exists("/etc/ld.so.cache"):
        pytest.skip("no /etc/ld.so.cache on this host")
    entries = ldcache.read("/etc/ld.so.cache")
    want = ldconfig_p(None)
    assert Counter((e.name, e.path) for e in entries) == Counter((n, p) for n, p, _ in want)
    assert Counter(rows_of(entries)) == Counter(want)


def header_count(data: bytes) -> int:
    """The entry count in the header of the table glibc reads (the new part of a compat cache)."""
    base = 0
    if data.startswith(ldcache.OLD_MAGIC):
        (nlibs,) = struct.unpack_from("<I", data, 12)
        base = -(-(16 + 12 * nlibs) // 8) * 8
        if not data.startswith(ldcache.NEW_MAGIC, base):
            return nlibs
    order = ">" if data[base + 28] & 3 == 3 else "<"
    return struct.unpack_from(order + "I", data, base + 20)[0]


def test_host_cache_parse_is_one_pass_over_its_entries():
    """The parse runs on every container start, so its work is bounded by what the header counts
    (and a count that cannot fit in the file is refused before any work: test_malformed): one
    entry out per entry in the table. How long it takes is the bench's to measure, not a test's."""
    if not os.path.exists("/etc/ld.so.cache"):
        pytest.skip("no /etc/ld.so.cache on this host")
    with open("/etc/ld.so.cache", "rb") as f:
        data = f.read()
    entries = ldcache.parse(data, "/etc/ld.so.cache")
    assert entries and len(entries) == header_count(data)


@pytest.mark.parametrize("layout", ["new", "compat", "old"])
def test_a_shared_string_is_decoded_once(layout):
    """What keeps the per-entry work small: ldconfig shares strings, and each string offset is
    decoded once, however many entries point at it (the entries hold the very same str)."""
    entries = [(X8664, "libcuda.so.1", f"/usr/lib64/dir{i % 5}/libcuda.so.1", 0) for i in range(500)]
    got = ldcache.parse(build_cache(entries, layout), "c")
    assert got == expected(entries, with_hwcap=layout != "old")
    assert len({id(e.name) for e in got}) == 1
    assert len({id(e.path) for e in got}) == 5


# --------------------------------------------------------------------------------------------
# Hand-built caches


@pytest.mark.parametrize("layout", ["new", "compat", "old"])
def test_hand_built_layouts(layout):
    got = ldcache.parse(build_cache(SAMPLE, layout), "c")
    assert got == expected(SAMPLE, with_hwcap=layout != "old")
    assert [e.word_size for e in got] == [64, 64, 32, 32, 64, 64, 0]


@pytest.mark.parametrize("layout", ["new", "compat", "old"])
def test_hand_built_read_back_by_ldconfig(layout, tmp_path, require):
    """The hand-built layouts are what glibc reads: `ldconfig -p` agrees with them."""
    require("ldconfig")
    entries = [e for e in SAMPLE if e[3] == 0 and e[0] in (X8664, LIBC6, X32)]
    cache = tmp_path / "ld.so.cache"
    cache.write_bytes(build_cache(entries, layout))
    assert rows_of(ldcache.read(str(cache))) == ldconfig_p(cache)


def test_compat_prefers_new_part():
    """When both are present the new part wins, even where the old table says otherwise."""
    data = bytearray(build_cache(SAMPLE, "compat"))
    struct.pack_into("<i", data, 16, 0x0001)  # first old entry: flags ELF
    got = ldcache.parse(bytes(data), "c")
    assert got == expected(SAMPLE)


def test_old_table_misaligned_new_part_ignored():
    """The new part is looked for only at the 8-aligned end of the old table, as glibc does."""
    entries = SAMPLE[:3]  # 16 + 36 = 52 bytes of old table: 4 bytes of padding
    data = build_cache(entries, "compat")
    assert ldcache.parse(data, "c") == expected(entries)
    shifted = data[:52] + data[56:]  # no padding: the new header is at 52, not found; old table read
    got = ldcache.parse(shifted, "c")  # whose offsets now land 4 bytes into each string
    assert [(e.name, e.path) for e in got][0] == ("uda.so.1", "/lib64/libcuda.so.1")


def test_big_endian_cache():
    got = ldcache.parse(build_cache(SAMPLE, "new", order=">"), "c")
    assert got == expected(SAMPLE)


def test_unset_endianness_is_little():
    assert ldcache.parse(build_cache(SAMPLE, header_flags=0), "c") == expected(SAMPLE)


def test_empty_cache():
    assert ldcache.parse(build_cache([]), "c") == ()
    assert ldcache.parse(build_cache([], "compat"), "c") == ()


def test_shared_strings():
    """ldconfig stores a soname as the tail of its path; both offsets resolve."""
    path = b"/usr/lib64/libcuda.so.1\0"
    n = 2
    base = 48 + 24 * n
    data = struct.pack("<20sIIB3xI12x", b"glibc-ld.so.cache1.1", n, len(path), 2, 0)
    data += struct.pack("<iIIIQ", X8664, base + 11, base, 0, 0)
    data += struct.pack("<iIIIQ", X8664, base + 11, base, 0, 0)
    data += path
    got = ldcache.parse(data, "c")
    assert got == (CacheEntry("libcuda.so.1", "/usr/lib64/libcuda.so.1", 64, X8664, 0),) * 2


def test_non_utf8_names_surrogateescape():
    entries = [(X8664, os.fsdecode(b"lib\xff.so"), os.fsdecode(b"/l/lib\xff.so"), 0)]
    (got,) = ldcache.parse(build_cache(entries), "c")
    assert os.fsencode(got.name) == b"lib\xff.so" and os.fsencode(got.path) == b"/l/lib\xff.so"


def test_entries_equal_constructed_ones():
    """The parser's fast construction gives ordinary CacheEntry objects."""
    (got,) = ldcache.parse(build_cache(SAMPLE[:1]), "c")
    want = CacheEntry("libcuda.so.1", "/usr/lib64/libcuda.so.1", 64, X8664, 0)
    assert got == want and hash(got) == hash(want) and repr(got) == repr(want)
    assert type(got) is CacheEntry
    with pytest.raises(AttributeError):
        got.name = "x"


@pytest.mark.parametrize(
    "flags, size",
    [
        (0x0303, 64),  # x86-64
        (0x0A03, 64),  # aarch64
        (0x0503, 64),  # ppc64
        (0x0403, 64),  # s390x
        (0x0703, 64),  # mips n64
        (0x1203, 64),  # loongarch64
        (0x0003, 32),  # i386 (libc6, no arch bits)
        (0x0803, 32),  # x32
        (0x0903, 32),  # armhf
        (0x0603, 32),  # mips n32
        (0x1003, 0),  # riscv: rv32 or rv64
        (0x0001, 0),  # plain ELF
        (0x0002, 0),  # libc5
        (0x7F03, 0),  # unknown arch
        (-1, 0),
    ],
)
def test_word_size(flags, size):
    assert ldcache.word_size_of(flags) == size


# --------------------------------------------------------------------------------------------
# Malformed input: one-line InventoryError naming the file


def new_header(nlibs, flags=2):
    return struct.pack("<20sIIB3xI12x", b"glibc-ld.so.cache1.1", nlibs, 0, flags, 0)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "not an ld.so.cache"),
        (b"\x7fELF\x02\x01\x01", "not an ld.so.cache"),
        (b"glibc-ld.so.cache1.1\x01\x00", "truncated header"),
        (b"glibc-ld.so.cache1.0" + bytes(40), "not an ld.so.cache"),
        (new_header(0, flags=1), "invalid byte order"),
        (new_header(1), "entry count 1 does not fit"),
        (new_header(0xFFFFFFFF) + bytes(100), "entry count 4294967295 does not fit"),
        (new_header(1) + struct.pack("<iIIIQ", 3, 1000, 72, 0, 0) + b"x\0", "string offset 1000 is past the end"),
        (new_header(1) + struct.pack("<iIIIQ", 3, 72, 72, 0, 0) + b"libx", "offset 72 is not NUL-terminated"),
        (new_header(1) + struct.pack("<iIIIQ", 3, 72, 73, 0, 0) + b"\0/x\0", "empty string at offset 72"),
        (b"ld.so-1.7.0", "truncated old-format header"),
        (b"ld.so-1.7.0\0\x05\0\0\0" + bytes(12), "old-format entry count 5 does not fit"),
        (b"ld.so-1.7.0\0\x01\0\0\0" + struct.pack("<iII", 3, 0, 99), "string offset 0 is past the end"),
    ],
)
def test_malformed(data, message):
    with pytest.raises(InventoryError) as info:
        ldcache.parse(data, "/etc/ld.so.cache")
    assert str(info.value).startswith("/etc/ld.so.cache: ")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_read_errors(tmp_path, monkeypatch):
    with pytest.raises(InventoryError, match=r"^/nonexistent/ld.so.cache: cannot read"):
        ldcache.read("/nonexistent/ld.so.cache")
    with pytest.raises(InventoryError, match="cannot read"):
        ldcache.read(str(tmp_path))  # a directory
    cache = tmp_path / "ld.so.cache"
    cache.write_bytes(build_cache(SAMPLE))
    assert ldcache.read(str(cache)) == expected(SAMPLE)
    monkeypatch.setattr(ldcache, "MAX_CACHE_SIZE", len(cache.read_bytes()) - 1)
    with pytest.raises(InventoryError, match="larger than"):
        ldcache.read(str(cache))


def test_read_size_cap_real(tmp_path):
    cache = tmp_path / "ld.so.cache"
    with open(cache, "wb") as f:
        f.truncate(64 * 1024 * 1024 + 1)  # sparse
    with pytest.raises(InventoryError, match=f"larger than {64 * 1024 * 1024} bytes"):
        ldcache.read(str(cache))


# --------------------------------------------------------------------------------------------
# Properties: whatever the bytes, the parser returns entries or raises InventoryError


def parse_or_inventory_error(data):
    try:
        got = ldcache.parse(data, "/p")
    except InventoryError as e:
        assert str(e).startswith("/p: ") and "\n" not in str(e)
        return None
    assert isinstance(got, tuple) and all(type(e) is CacheEntry for e in got)
    for e in got:
        assert isinstance(e.name, str) and e.name and isinstance(e.path, str) and e.path
        assert e.word_size in (0, 32, 64)
    return got


names = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), min_size=1, max_size=12)
entry_st = st.tuples(
    st.integers(-(2**31), 2**31 - 1),
    names.map(lambda s: "lib" + s),
    names.map(lambda s: "/l/" + s),
    st.integers(0, 2**64 - 1),
)


@st.composite
def caches(draw):
    entries = draw(st.lists(entry_st, max_size=8))
    layout = draw(st.sampled_from(["new", "compat", "old"]))
    order = draw(st.sampled_from(["<", ">"])) if layout == "new" else "<"
    return entries, layout, order, build_cache(entries, layout, order)


@given(st.binary(max_size=300))
def test_property_arbitrary_bytes(data):
    parse_or_inventory_error(data)


@given(st.sampled_from([b"glibc-ld.so.cache1.1", b"ld.so-1.7.0", b"ld.so-1.7.0\0\x02\0\0\0"]), st.binary(max_size=300))
def test_property_magic_then_garbage(magic, rest):
    parse_or_inventory_error(magic + rest)


@given(caches())
def test_property_valid_caches_round_trip(cache):
    entries, layout, _, data = cache
    assert ldcache.parse(data, "c") == expected(entries, with_hwcap=layout != "old")


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(caches(), st.data())
def test_property_flips_and_truncations(cache, d):
    data = bytearray(cache[3])
    for _ in range(d.draw(st.integers(0, 4))):
        i = d.draw(st.integers(0, len(data) - 1))
        data[i] = d.draw(st.integers(0, 255))
    if d.draw(st.booleans()):
        del data[d.draw(st.integers(0, len(data))) :]
    parse_or_inventory_error(bytes(data))


@settings(max_examples=200)
@given(st.data())
def test_property_host_cache_mutations(d):
    try:
        with open("/etc/ld.so.cache", "rb") as f:
            data = bytearray(f.read())
    except OSError:
        pytest.skip("no readable /etc/ld.so.cache")
    if not data:
        pytest.skip("empty /etc/ld.so.cache")
    # the header and entry table are where a flip changes structure
    hot = min(len(data), 48 + 24 * 64)
    for _ in range(d.draw(st.integers(1, 6))):
        i = d.draw(st.integers(0, hot - 1))
        data[i] = d.draw(st.integers(0, 255))
    if d.draw(st.booleans()):
        del data[d.draw(st.integers(0, len(data))) :]
    parse_or_inventory_error(bytes(data))
