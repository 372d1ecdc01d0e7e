"""The ELF reader discovery uses for a library's SONAME and NEEDED entries: against libraries
gcc links here (64- and 32-bit) and files that are not what they claim."""

import os
import subprocess
import sys

import pytest

from oci_gpu_hook.start import elf


def _link(tmp_path, name, *args):
    source = tmp_path / "empty.c"
    source.write_text("int nothing;\n")
    out = str(tmp_path / name)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", out, str(source), *args], check=True, capture_output=True)
    return out


def test_soname_and_needed_as_the_linker_wrote_them(tmp_path, require):
    require("gcc", "readelf")
    dependency = _link(tmp_path, "libdep.so.7", "-Wl,-soname,libdep.so.7")
    library = _link(tmp_path, "libx.so.1.2", "-Wl,-soname,libx.so.1", "-Wl,--no-as-needed", dependency, "-lm")
    soname, needed = elf.read_dynamic(library)
    readelf = subprocess.run(["readelf", "-d", library], capture_output=True, text=True, check=True).stdout
    assert soname == "libx.so.1" and needed[:2] == ("libdep.so.7", "libm.so.6")
    assert [line.split("[")[1].rstrip("]") for line in readelf.splitlines() if "(NEEDED)" in line] == list(needed)


def test_a_32_bit_library(tmp_path, require):
    require("gcc-m32")
    library = _link(tmp_path, "libx32.so.1", "-m32", "-Wl,-soname,libx32.so.1", "-Wl,--no-as-needed", "-lc")
    soname, needed = elf.read_dynamic(library)
    assert soname == "libx32.so.1" and "libc.so.6" in needed


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"#!/bin/sh\n",
        b"\x7fELF" + b"\x00" * 10,
        b"\x7fELF\x02\x01" + b"\xff" * 58,
        b"\x7fELF\x02\x01" + b"\x00" * 50,
    ],
)
def test_what_is_not_a_library_is_refused(tmp_path, content):
    path = tmp_path / "lib.so"
    path.write_bytes(content)
    with pytest.raises(elf.NotElf):
        elf.read_dynamic(str(path))


def test_a_program_has_no_soname(tmp_path, require):
    require("gcc")
    source = tmp_path / "main.c"
    source.write_text("int main(void) { return 0; }\n")
    program = str(tmp_path / "main")
    subprocess.run(["gcc", "-o", program, str(source)], check=True)
    soname, needed = elf.read_dynamic(program)
    assert soname is None and "libc.so.6" in needed and os.path.exists(program)


def _readelf(path, option, marker):
    out = subprocess.run(["readelf", option, path], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rsplit("]", 1)[0] for line in out.splitlines() if marker in line]


def test_search_paths_and_the_loader_as_the_linker_wrote_them(tmp_path, require):
    """RUNPATH (--enable-new-dtags) and RPATH (--disable-new-dtags), $ORIGIN left as written, and a
    program's PT_INTERP: what install's trust check follows (toolkit/ldso.py)."""
    require("gcc", "readelf")
    new = _link(tmp_path, "libnew.so", "-Wl,--enable-new-dtags,-rpath,$ORIGIN/../lib:/opt/x")
    old = _link(tmp_path, "libold.so", "-Wl,--disable-new-dtags,-rpath,$ORIGIN")
    plain = _link(tmp_path, "libplain.so")
    found = elf.read(new)
    assert (found.runpath, found.rpath) == ("$ORIGIN/../lib:/opt/x", None) == (*_readelf(new, "-d", "(RUNPATH)"), None)
    assert (elf.read(old).rpath, elf.read(old).runpath) == ("$ORIGIN", None) == (*_readelf(old, "-d", "(RPATH)"), None)
    assert (elf.read(plain).rpath, elf.read(plain).runpath, elf.read(plain).interpreter) == (None, None, None)
    assert found.wide and found.machine == elf.read(sys.executable).machine
    source = tmp_path / "main.c"
    source.write_text("int main(void) { return 0; }\n")
    program = str(tmp_path / "main")
    subprocess.run(["gcc", "-o", program, str(source)], check=True)
    assert elf.read(program).interpreter == _readelf(program, "-l", "Requesting program interpreter")[0].split(": ")[1]


def test_a_32_bit_program_s_search_path(tmp_path, require):
    require("gcc-m32")
    library = _link(tmp_path, "libx32r.so", "-m32", "-Wl,--enable-new-dtags,-rpath,$ORIGIN/lib32")
    found = elf.read(library)
    assert not found.wide and found.runpath == "$ORIGIN/lib32"


def _with(data: bytes, offset: int, value: int) -> bytes:
    out = bytearray(data)
    out[offset : offset + 8] = value.to_bytes(8, "little")
    return bytes(out)


@pytest.mark.parametrize("value", [2**64 - 1, 2**63, 2**62, 1 << 40])
def test_an_offset_past_the_end_of_the_file_is_not_elf(tmp_path, require, value):
    """Every offset a header states (the program header table's, each segment's, a name's in a
    string table with no DT_STRSZ) is refused as NotElf: before, one past what lseek takes ended
    in ValueError (a traceback in the hook's discovery and in install) and a large one in EINVAL."""
    require("gcc")
    library = _link(tmp_path, "libx.so.1", "-Wl,-soname,libx.so.1", "-Wl,--no-as-needed", "-lm")
    with open(library, "rb") as f:
        data = f.read()
    phoff = int.from_bytes(data[32:40], "little")
    phnum = int.from_bytes(data[56:58], "little")
    headers = [data[phoff + 56 * i : phoff + 56 * (i + 1)] for i in range(phnum)]
    kinds = [int.from_bytes(h[:4], "little") for h in headers]
    dyn = headers[kinds.index(elf.PT_DYNAMIC)]
    dyn_offset, dyn_size = int.from_bytes(dyn[8:16], "little"), int.from_bytes(dyn[32:40], "little")
    tags = [int.from_bytes(data[dyn_offset + 16 * j : dyn_offset + 16 * j + 8], "little")
            for j in range(dyn_size // 16)]  # fmt: skip
    # DT_STRSZ made a tag the reader does not know: names are then bounded by MAX_NAME alone.
    no_strsz = _with(data, dyn_offset + 16 * tags.index(elf.DT_STRSZ), 0x6FFFFFEF)
    needed = dyn_offset + 16 * tags.index(elf.DT_NEEDED) + 8
    loads = [phoff + 56 * i + 8 for i, kind in enumerate(kinds) if kind == elf.PT_LOAD]
    cases = {
        "program headers": _with(data, 32, value),
        "dynamic segment": _with(data, phoff + 56 * kinds.index(elf.PT_DYNAMIC) + 8, value),
        "a name with no DT_STRSZ": _with(bytes(no_strsz), needed, value),
        **{f"loaded segment {i}": _with(data, at, value) for i, at in enumerate(loads)},
    }
    for what, content in cases.items():
        path = tmp_path / "crafted.so"
        path.write_bytes(content)
        try:
            elf.read(str(path))
        except elf.NotElf:
            pass
        else:  # a segment the strings are not in is never read: then the names are as they were
            found = elf.read(str(path))
            assert found.soname == "libx.so.1" and "libm.so.6" in found.needed, what
