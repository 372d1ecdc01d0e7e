"""What the dynamic loader maps, found from the ELF files: against programs and libraries gcc
links here with RUNPATH, RPATH and $ORIGIN, compared with what the real loader mapped into them
(each program prints its own /proc/self/maps), and the places a user could plant a library."""

import os
import shutil
import subprocess

import pytest

from oci_gpu_hook.start.linux.sources import HostSources, UntrustedSource
from oci_gpu_hook.toolkit import ldso

NOBODY = 65534
PRINT_MAPS = """#include <stdio.h>
int dep(void);
int main(void) {
    FILE *f = fopen("/proc/self/maps", "r");
    int c;
    while ((c = fgetc(f)) != EOF) putchar(c);
    return dep() == 0 ? 0 : 1;
}
"""


def gcc(*args):
    subprocess.run(["gcc", *args], check=True, capture_output=True)


def library(path, soname, needs=(), runpath=None, rpath=None, symbol="dep"):
    """A shared library at path (its SONAME soname) that NEEDs the libraries at needs; int symbol(void)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    source = f"{path}.c"
    with open(source, "w") as f:
        f.write(f"int {symbol}(void) {{ return 0; }}\n")
    gcc("-shared", "-fPIC", "-o", path, source, f"-Wl,-soname,{soname}", "-Wl,--no-as-needed", *needs,
        *search_flags(runpath, rpath))  # fmt: skip
    os.unlink(source)
    return str(path)


def search_flags(runpath, rpath):
    if runpath is not None:
        return ["-Wl,--enable-new-dtags", f"-Wl,-rpath,{runpath}"]
    if rpath is not None:
        return ["-Wl,--disable-new-dtags", f"-Wl,-rpath,{rpath}"]
    return []


def program(path, needs, runpath=None, rpath=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    source = f"{path}.c"
    with open(source, "w") as f:
        f.write(PRINT_MAPS)
    gcc("-o", path, source, "-Wl,--no-as-needed", *needs, *search_flags(runpath, rpath))
    os.unlink(source)
    return str(path)


def mapped_objects(path):
    """The ELF files the real loader mapped into the program at path (it prints its maps)."""
    out = subprocess.run([path], capture_output=True, text=True, env={}, cwd="/", check=True).stdout
    found = set()
    for line in out.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith("/"):
            with open(fields[5], "rb") as f:
                if f.read(4) == b"\x7fELF":
                    found.add(fields[5])
    return found


def loaded(path, etc="/etc"):
    sources = HostSources()
    try:
        loader = ldso.Loader(sources, etc=etc)
        loader.program(path)
        return set(loader.files)
    finally:
        sources.close()


@pytest.fixture
def tree(tmp_path, require):
    require("root", "gcc")
    os.chmod(tmp_path, 0o755)
    return tmp_path


def test_runpath_with_origin_and_a_dependency_s_own_runpath(tree):
    """An --enable-shared layout: bin/prog's RUNPATH $ORIGIN/../lib finds liba; liba's own
    RUNPATH finds libb."""
    libb = library(f"{tree}/lib/b/libb.so.1", "libb.so.1", symbol="dep_0")
    liba = library(f"{tree}/lib/liba.so.1", "liba.so.1", [libb], runpath="$ORIGIN/b")
    prog = program(f"{tree}/bin/prog", [liba], runpath="$ORIGIN/../lib")
    assert {liba, libb} <= mapped_objects(prog) == loaded(prog)


def test_a_runpath_that_repeats_lib_is_the_loader_s_one_value_each_time(tree):
    """The loader gives $LIB one value wherever it stands: a RUNPATH with it twenty times is one
    directory to it, and three candidates here, not 3**20 (which never finished)."""
    lib = subprocess.run(["gcc", "-print-multiarch"], capture_output=True, text=True).stdout.strip()
    deep = "/".join(["lib", lib] * 20) if lib else "/".join(["lib64"] * 20)
    liba = library(f"{tree}/bin/{deep}/liba.so.1", "liba.so.1")
    prog = program(f"{tree}/bin/prog", [liba], runpath="/".join(["$ORIGIN"] + ["$LIB"] * 20))
    assert liba in mapped_objects(prog) == loaded(prog)


def test_rpath_is_passed_on_and_runpath_is_not(tree):
    """An RPATH serves the dependencies of the object that has it too; a RUNPATH serves only its
    own. liba's RPATH (inner) finds libc, which libb NEEDs; liba2's libm.so.6 comes from the
    loader's cache, never from the decoy in the program's RUNPATH."""
    libc = library(f"{tree}/lib/inner/libc.so.1", "libc.so.1", symbol="dep_0")
    libb = library(f"{tree}/lib/inner/libb.so.1", "libb.so.1", [libc], symbol="dep_0")  # no search path
    liba = library(f"{tree}/lib/liba.so.1", "liba.so.1", [libb], rpath="$ORIGIN/inner")
    prog = program(f"{tree}/bin/prog", [liba], runpath="$ORIGIN/../lib")
    assert {liba, libb, libc} <= mapped_objects(prog) == loaded(prog)

    decoy = library(f"{tree}/decoy/libm.so.6", "libm.so.6", symbol="decoy")
    os.makedirs(f"{tree}/own")
    liba2 = library(f"{tree}/new/lib/liba.so.1", "liba.so.1", ["-lm"], runpath=f"{tree}/own")
    new = program(f"{tree}/new/prog", [liba2], runpath=f"{tree}/decoy:{tree}/new/lib")
    assert liba2 in mapped_objects(new) == loaded(new)
    assert decoy not in loaded(new)


def test_a_glibc_hwcaps_copy_is_followed(tree):
    """The loader tries <dir>/glibc-hwcaps/<level>/ before <dir>/: whichever it maps, both are found."""
    libb = library(f"{tree}/lib/libb.so.1", "libb.so.1", symbol="dep_0")
    liba = library(f"{tree}/lib/liba.so.1", "liba.so.1", [libb], runpath="$ORIGIN")
    os.makedirs(f"{tree}/lib/glibc-hwcaps/x86-64-v2")
    shutil.copy(libb, f"{tree}/lib/glibc-hwcaps/x86-64-v2/libb.so.1")
    prog = program(f"{tree}/bin/prog", [liba], runpath="$ORIGIN/../lib")
    assert mapped_objects(prog) <= loaded(prog)
    assert {f"{tree}/lib/glibc-hwcaps/x86-64-v2/libb.so.1", libb} <= loaded(prog)


@pytest.fixture
def searched(tree):
    """bin/prog with RUNPATH early (empty), opt/lib (opt empty) and lib (liba, which NEEDs libb
    beside it): all root's."""
    libb = library(f"{tree}/lib/libb.so.1", "libb.so.1", symbol="dep_0")
    liba = library(f"{tree}/lib/liba.so.1", "liba.so.1", [libb], runpath="$ORIGIN")
    os.makedirs(f"{tree}/early")
    os.makedirs(f"{tree}/opt")
    prog = program(f"{tree}/bin/prog", [liba], runpath="$ORIGIN/../early:$ORIGIN/../opt/lib:$ORIGIN/../lib")
    assert {liba, libb} <= loaded(prog)  # root's alone: accepted
    return tree, prog


@pytest.mark.parametrize(
    "target, change, words",
    [("lib/liba.so.1", "chown", "owned by uid 65534"),
     ("lib/libb.so.1", "chown", "owned by uid 65534"),  # what a dependency NEEDs, from its own RUNPATH
     ("lib/libb.so.1", "chmod", "writable by others than root"),
     ("lib", "chmod", "others than root"),
     ("early", "chmod", "others than root"),  # searched before lib: a user's liba would win
     ("opt", "chown", "owned by uid 65534"),  # opt/lib does not exist: whoever owns opt can make it
     ("lib/glibc-hwcaps", "mkdir", "owned by uid 65534"),  # searched before lib itself
     ("bin", "chmod", "others than root")],  # the program, and $ORIGIN
    ids=["needed", "needed-of-needed", "writable", "directory", "earlier-runpath", "missing-runpath",
         "hwcaps", "origin"],
)  # fmt: skip
def test_every_place_the_loader_looks_must_be_roots_alone(searched, target, change, words):
    tree, prog = searched
    path = f"{tree}/{target}"
    if change == "mkdir":
        os.makedirs(f"{path}/x86-64-v3")
        os.chown(path, NOBODY, NOBODY)
    elif change == "chown":
        os.chown(path, NOBODY, NOBODY)
    else:
        os.chmod(path, os.stat(path).st_mode | 0o002)
    with pytest.raises(UntrustedSource) as e:
        loaded(prog)
    assert e.value.path == path and words in e.value.why


@pytest.mark.parametrize(
    "runpath", ["lib", "$ORIGIN/../lib:", "$ORIGIN/../lib::/usr/lib"], ids=["relative", "trailing-empty", "empty"]
)
def test_a_search_path_relative_to_the_working_directory_is_refused(tree, runpath):
    """The runtime picks the working directory: an entry relative to it (or empty) is refused."""
    liba = library(f"{tree}/lib/liba.so.1", "liba.so.1")
    prog = program(f"{tree}/bin/prog", [liba], runpath=runpath)
    with pytest.raises(UntrustedSource, match="relative to the working directory") as e:
        loaded(prog)
    assert e.value.path == os.path.realpath(prog)


@pytest.fixture
def etc(tree):
    """A copy of the loader's configuration: an ld.so.cache, an ld.so.conf that includes
    ld.so.conf.d/*.conf naming a directory, and an ld.so.preload naming a library."""
    path = tree / "etc"
    (path / "ld.so.conf.d").mkdir(parents=True)
    shutil.copy("/etc/ld.so.cache", path / "ld.so.cache")
    (path / "ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    (path / "ld.so.conf.d" / "extra.conf").write_text(f"{tree}/conf-lib\n")
    (tree / "conf-lib").mkdir()
    preloaded = library(f"{tree}/preload/libpre.so", "libpre.so", symbol="pre")
    (path / "ld.so.preload").write_text(f"{preloaded}\n")
    os.chmod(path / "ld.so.preload", 0o644)
    libb = library(f"{tree}/lib/libb.so.1", "libb.so.1", symbol="dep")
    prog = program(f"{tree}/bin/prog", [libb], runpath="$ORIGIN/../lib")
    assert preloaded in loaded(prog, etc=str(path))  # root's alone: accepted, the preloaded library followed
    return str(path), prog


@pytest.mark.parametrize(
    "target, change",
    [("etc/ld.so.cache", "chmod"),  # the loader's answer for every name
     ("etc/ld.so.preload", "chown"),  # mapped into every program
     ("preload/libpre.so", "chown"),
     ("etc/ld.so.conf.d/extra.conf", "chown"),  # ldconfig rebuilds the cache from these
     ("conf-lib", "chmod")],
    ids=["cache", "preload", "preloaded", "conf", "conf-directory"],
)  # fmt: skip
def test_the_loader_s_own_configuration_must_be_roots_alone(tree, etc, target, change):
    directory, prog = etc
    path = f"{tree}/{target}"
    if change == "chown":
        os.chown(path, NOBODY, NOBODY)
    else:
        os.chmod(path, os.stat(path).st_mode | 0o002)
    with pytest.raises(UntrustedSource) as e:
        loaded(prog, etc=directory)
    assert e.value.path == path


def test_what_is_not_an_elf_program_is_refused(tree):
    script = tree / "script"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(UntrustedSource, match="not an ELF program"):
        loaded(str(script))
