"""toolkit/bundle.py: a bundle's id and its python3 (the image's bundle itself: tests/deploy/test_image.py)."""

import os
import subprocess

import pytest

from oci_gpu_hook.toolkit import bundle

# What the caller could use to have glibc load something of its choosing (its unsecure list).
UNSECURE = {name: "/tmp/x" for name in ("LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH", "GLIBC_TUNABLES", "GCONV_PATH",
                                        "LOCPATH", "NLSPATH", "MALLOC_TRACE", "HOSTALIASES", "RES_OPTIONS",
                                        "LOCALDOMAIN", "TZDIR", "TMPDIR", "GETCONF_DIR", "NIS_PATH")}  # fmt: skip


def tree(top):
    os.makedirs(top / "bin")
    (top / "bin" / "python3.bin").write_bytes(b"\x7fELF interpreter")
    os.chmod(top / "bin" / "python3.bin", 0o755)
    (top / "site").mkdir()
    (top / "site" / "m.py").write_text("x = 1\n")
    os.symlink("m.py", top / "site" / "n.py")
    return top


def test_the_id_is_the_content(tmp_path):
    """Two trees with the same files have one id; a byte, any mode bit (of a file or a
    directory), a link's value, a name, a new file or an empty directory changes it; the launcher
    and the pre-filter (made from the id, and checked against it where a bundle is placed) and
    Python's bytecode do not."""
    one, two = tree(tmp_path / "one"), tree(tmp_path / "two")
    bundle_id = bundle.identity(str(one))
    assert len(bundle_id) == bundle.ID_LENGTH and bundle.identity(str(two)) == bundle_id
    (two / bundle.LAUNCHER).write_text(bundle.launcher_text(bundle_id))
    (two / bundle.PREFILTER).write_bytes(b"a pre-filter")
    (two / "site" / "__pycache__").mkdir()
    (two / "site" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"bytecode")
    assert bundle.identity(str(two)) == bundle_id
    changes = {
        "a byte": lambda t: (t / "site" / "m.py").write_text("x = 2\n"),
        "an executable bit": lambda t: os.chmod(t / "site" / "m.py", 0o755),
        "a link's value": lambda t: (os.unlink(t / "site" / "n.py"), os.symlink("o.py", t / "site" / "n.py")),
        "a file more": lambda t: (t / "site" / "o.py").write_text(""),
        "a name": lambda t: os.rename(t / "site" / "m.py", t / "site" / "p.py"),
        "a set-id bit": lambda t: os.chmod(t / "bin" / "python3.bin", 0o4755),
        "a mode others may write": lambda t: os.chmod(t / "site" / "m.py", 0o666),
        "a directory's mode": lambda t: os.chmod(t / "site", 0o777),
        "an empty directory": lambda t: (t / "site" / "empty").mkdir(),
    }
    for what, change in changes.items():
        changed = tree(tmp_path / what.replace(" ", "-"))
        change(changed)
        assert bundle.identity(str(changed)) != bundle_id, what


def test_the_launcher_names_the_bundles_own_python_and_site():
    text = bundle.launcher_text("0123456789abcdef")
    here = f"{bundle.BUNDLES_DIR}/0123456789abcdef"
    assert text.startswith(f"#!{here}/{bundle.PYTHON} -IS\n")
    assert f"sys.path.append({here + '/' + bundle.SITE!r})" in text


def test_building_python_says_what_failed(tmp_path):
    """A compiler that fails is one line naming what the build needs; a loader name that is not
    a file name never reaches the compiler's command line."""
    with pytest.raises(bundle.BundleError, match=r"^/bin/false: cannot build a bundle's python3 \(static"):
        bundle.build_python(str(tmp_path / "python3"), "ld-linux-x86-64.so.2", "/bin/false")
    with pytest.raises(bundle.BundleError, match="not a loader's file name"):
        bundle.build_python(str(tmp_path / "python3"), 'ld.so" -o /etc/x "', "/bin/false")
    assert not os.path.exists(tmp_path / "python3")


def test_python_runs_the_interpreter_beside_it_through_the_loader_in_lib(tmp_path, require):
    """bin/python3 runs bin/python3.bin with lib/'s loader, --argv0 itself: here the loader is a
    script that prints what it was given, so the command line is seen whole; LD_* and the rest of
    glibc's unsecure variables (gconv modules, locales, tunables, ...) are gone from its
    environment, everything else is kept."""
    require("gcc")
    top = tmp_path / "b"
    (top / "bin").mkdir(parents=True)
    (top / "lib").mkdir()
    loader = top / "lib" / "ld-test.so"
    loader.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\nenv | sort\n")
    os.chmod(loader, 0o755)
    bundle.build_python(str(top / "bin" / "python3"), "ld-test.so", "gcc")
    out = subprocess.run([str(top / "bin" / "python3"), "-IS", "-c", "pass"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "KEEP": "1", "LANG": "C.UTF-8", **UNSECURE},
                         timeout=30)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:9] == ["--inhibit-cache", "--library-path", f"{top}/lib", "--argv0", f"{top}/bin/python3",
                         f"{top}/bin/python3.bin", "-IS", "-c", "pass"]  # fmt: skip
    assert "KEEP=1" in lines and "LANG=C.UTF-8" in lines
    assert not [x for x in lines if x.split("=")[0] in UNSECURE], lines
