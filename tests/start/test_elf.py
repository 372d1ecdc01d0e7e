"""The ELF reader discovery uses for a library's SONAME and NEEDED entries: against libraries
gcc links here (64- and 32-bit) and files that are not what they claim."""

import os
import subprocess

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


@pytest.mark.parametrize("content", [b"", b"#!/bin/sh\n", b"\x7fELF" + b"\x00" * 10, b"\x7fELF\x02\x01" + b"\xff" * 58])
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
