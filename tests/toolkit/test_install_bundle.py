"""install run from a bundle (toolkit/bundle.py), as the cluster's toolkit runs it on a host:
`oci-gpu-hook toolkit install --host-root /host` run in an image root that holds the bundle alone,
with a host tree mounted at /host. It places the bundle on the host tree and runs that copy's own
install chrooted into the tree, with nothing else of Python there (toolkit/host.py).

- What runtimes run becomes a link to the bundle's pre-filter, and the hooks.d file names it.
- An upgrade to another bundle is one rename: a start that runs all the while through the link
  gets the old hook or the new one, whole, never an error; no runtime configuration changes.
- Bundles older than the one before are removed, and uninstall leaves the tree as it was, byte
  for byte, bundles and their directories included.
"""

import json
import os
import shutil
import subprocess
import time

import hookcheck
import pytest
from imagecheck import build, image_bundle, layer

from oci_gpu_hook import __version__
from oci_gpu_hook.toolkit import bundle, install, launcher

ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
# Run argv in a chroot of the tree, in a mount namespace of its own with /proc mounted.
IN_TREE = 'mount -t proc proc "$1/proc" && r="$1" && shift && exec chroot "$r" "$@"'
# Run argv in a chroot of an image root, the tree bind-mounted at its /host, /proc in both.
# (As the kubelet mounts a hostPath: recursively, so that the host's /proc is there too.)
# A container has /dev: the host's, here.
IN_IMAGE = ('mount -t proc proc "$2/proc" && mount --rbind "$2" "$1/host" && mount -t proc proc "$1/proc" && '
            'mount --rbind /dev "$1/dev" && r="$1" && shift 2 && exec chroot "$r" "$@"')  # fmt: skip


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, require):
    """Three bundles: the node image's, and two made from it whose package says another version
    (each with its own id, launcher and pre-filter), as later images would bring."""
    require("root", "gcc", "unshare", "chroot", "mount")
    tmp = tmp_path_factory.mktemp("bundles")
    out = build(tmp / "image.tar", tmp / "build")
    assert out.returncode == 0, out.stderr
    layer(tmp / "image.tar").extractall(tmp / "image")
    made = [image_bundle(str(tmp / "image"))]
    for suffix in ("b", "c"):
        staging = tmp / f"staging-{suffix}"
        shutil.copytree(made[0], staging, symlinks=True)
        for derived in (bundle.LAUNCHER, bundle.PREFILTER):
            os.unlink(staging / derived)
        init = staging / bundle.SITE / "oci_gpu_hook" / "__init__.py"
        text = init.read_text()
        init.write_text(text.replace(f'__version__ = "{__version__}"', f'__version__ = "{__version__}+{suffix}"'))
        bundle_id = bundle.identity(str(staging))
        top = tmp / "made" / bundle_id
        os.makedirs(top.parent, exist_ok=True)
        os.rename(staging, top)
        (top / bundle.LAUNCHER).write_text(bundle.launcher_text(bundle_id))
        os.chmod(top / bundle.LAUNCHER, 0o755)
        (top / bundle.PREFILTER).write_bytes(bundle.build_prefilter(bundle_id, "gcc"))
        os.chmod(top / bundle.PREFILTER, 0o755)
        made.append(str(top))
    return made


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "host"
    (root / "etc/containers").mkdir(parents=True)
    (root / "etc/containers/policy.json").write_text("{}\n")
    for directory in ("var", "proc", "tmp", "usr/local"):
        (root / directory).mkdir(parents=True)
    return str(root)


def in_tree(tree: str, *argv: str, **run) -> subprocess.CompletedProcess:
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", IN_TREE, "sh", tree, *argv],
                          capture_output=True, text=True, timeout=300, env=ENV, **run)  # fmt: skip


def install_from(tree: str, top: str, *args: str) -> list:
    """`oci-gpu-hook toolkit install` as the node pod runs it: from an image root holding only the
    bundle at top, the tree at its /host."""
    out = in_image(tree, top, "toolkit", "install", "--runtime", "crio", *args)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.splitlines()


def in_image(tree: str, top: str, *args: str) -> subprocess.CompletedProcess:
    image = os.path.join(os.path.dirname(tree), "image-" + os.path.basename(top))
    if not os.path.isdir(image):
        shutil.copytree(top, image + bundle.directory(os.path.basename(top)), symlinks=True)
        for directory in ("proc", "host", "dev"):
            os.mkdir(os.path.join(image, directory))
    launcher_path = f"{bundle.directory(os.path.basename(top))}/{bundle.LAUNCHER}"
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", IN_IMAGE, "sh", image, tree,
                           launcher_path, *args], capture_output=True, text=True, timeout=300, env=ENV)  # fmt: skip


def version_of(top: str) -> str:
    with open(os.path.join(top, bundle.SITE, "oci_gpu_hook", "__init__.py")) as f:
        return next(line.split('"')[1] for line in f if line.startswith("__version__"))


def test_install_from_a_bundle_links_what_runtimes_run_to_its_prefilter(bundles, tree):
    before = hookcheck.tree(tree, contents=True)
    first = bundles[0]
    lines = install_from(tree, first)
    here = bundle.directory(os.path.basename(first))
    assert os.readlink(tree + launcher.LAUNCHER) == f"bundles/{os.path.basename(first)}/{bundle.PREFILTER}"
    assert f"wrote {launcher.LAUNCHER}" in lines  # the tree is / to the chrooted install
    with open(tree + install.HOOKS_D_FILE) as f:
        assert json.load(f)["hook"]["path"] == launcher.LAUNCHER
    # The start server's launcher is the bundle's python3 with the bundle's site.
    assert launcher.named(tree + install.START_LAUNCHER) == (f"{here}/{bundle.PYTHON}", f"{here}/{bundle.SITE}")
    with open(tree + install.MANIFEST) as f:
        assert json.load(f)["bundles"] == [os.path.basename(first)]
    out = in_tree(tree, launcher.LAUNCHER, "--version")
    assert out.returncode == 0 and out.stdout.split()[-1] == version_of(first), out.stdout + out.stderr
    # doctor on the host (the bundle's own) says which bundle runtimes run, and that it is whole.
    doctor = in_tree(tree, f"{here}/{bundle.LAUNCHER}", "doctor", "--json")
    (check,) = [c for c in json.loads(doctor.stdout)["checks"] if c["id"] == "bundle"]
    assert check["status"] == "PASS" and check["summary"].startswith(f"runtimes run bundle {os.path.basename(first)}")
    changed = tree + here + "/" + bundle.SITE + "/oci_gpu_hook/node/gates.py"
    with open(changed, "a") as f:
        f.write("# changed on the host\n")  # a bundle no longer whole
    doctor = in_tree(tree, f"{here}/{bundle.LAUNCHER}", "doctor", "--json")
    (check,) = [c for c in json.loads(doctor.stdout)["checks"] if c["id"] == "bundle"]
    assert check["status"] == "FAIL" and "its files do not have the digest its name says" in check["summary"], check
    shutil.copy2(os.path.join(first, bundle.SITE, "oci_gpu_hook", "node", "gates.py"), changed)
    assert install_from(tree, first) == ["nothing to do: already installed"]
    out = in_image(tree, first, "toolkit", "uninstall")
    assert out.returncode == 0, out.stderr
    assert f"removed {here}" in out.stdout.splitlines()
    assert hookcheck.tree(tree, contents=True) == before


def test_docker_is_refused_from_a_bundle(bundles, tree):
    """Docker's program is compiled for each install: from a bundle, one line, nothing written
    but the bundle (the toolkit's first step), which uninstall removes."""
    before = hookcheck.tree(tree, contents=True)
    install.place_bundle(tree, bundles[0])
    here = bundle.directory(os.path.basename(bundles[0]))
    out = in_tree(tree, f"{here}/{bundle.LAUNCHER}", "install", "--runtime", "docker")
    assert out.returncode != 0 and "--runtime docker: not from a bundle" in out.stderr, out.stderr
    assert not os.path.lexists(tree + launcher.LAUNCHER)
    out = in_image(tree, bundles[0], "toolkit", "uninstall")
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == f"removed {here}", out.stdout + out.stderr
    assert hookcheck.tree(tree, contents=True) == before


def test_the_toolkit_outside_a_bundle_says_so_in_one_line(hook_cli, tmp_path):
    out = hook_cli("toolkit", "install", "--host-root", str(tmp_path), "--runtime", "crio")
    assert out.returncode != 0 and out.stdout == ""
    assert out.stderr == ("oci-gpu-hook: toolkit: runs from the node image's bundle (deploy/build-image.py), "
                          "not from this install\n")  # fmt: skip
    assert os.listdir(tmp_path) == []


def test_an_upgrade_is_one_rename_and_every_start_meanwhile_is_whole(bundles, tree, report_measurement):
    """A start through the link runs in a loop while install flips it between two bundles six
    times: each start printed one of the two versions whole, none failed, both were seen; the
    runtime's configuration never changed. A third bundle's install removes the oldest (the
    second: the flips ended on the first), which no process maps; uninstall then leaves the tree
    as it was."""
    before = hookcheck.tree(tree, contents=True)
    first, second, third = bundles
    install_from(tree, first)
    configuration = {p: hookcheck.tree(tree + p, contents=True) for p in ("/etc/containers", "/etc/crio")
                     if os.path.isdir(tree + p)}  # fmt: skip
    stop = os.path.join(os.path.dirname(tree), "stop")
    loop = (f'mount -t proc proc "$1/proc" && while [ ! -e {stop} ]; do '
            f'chroot "$1" {launcher.LAUNCHER} --version 2>&1 || echo FAILED; done')  # fmt: skip
    reader = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", loop, "sh", tree],
                              stdout=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
    try:
        for top in (second, first) * 3:
            lines = install_from(tree, top)
            assert f"updated {launcher.LAUNCHER}" in lines, lines
            assert not [line for line in lines if "/etc/" in line], lines  # nothing a runtime reads
    finally:
        open(stop, "w").close()
        out, _ = reader.communicate(timeout=120)
    said = out.splitlines()
    versions = {f"oci-gpu-hook, version {version_of(top)}" for top in (first, second)}
    assert set(said) == versions, sorted(set(said))
    report_measurement(
        f"bundle upgrades: {len(said)} starts through the link during 6 flips, "
        f"{sorted(said.count(v) for v in versions)} by version, none failed"
    )
    assert configuration == {p: hookcheck.tree(tree + p, contents=True) for p in configuration}
    lines = install_from(tree, third)
    assert f"removed {bundle.directory(os.path.basename(second))}" in lines  # first was the one before
    with open(tree + install.MANIFEST) as f:
        assert json.load(f)["bundles"] == [os.path.basename(first), os.path.basename(third)]
    out = in_image(tree, third, "toolkit", "uninstall")
    assert out.returncode == 0, out.stderr
    os.unlink(stop)
    assert hookcheck.tree(tree, contents=True) == before


def test_only_a_whole_bundle_is_placed_and_nothing_else_is_taken_for_one(bundles, tree, tmp_path):
    """place_bundle checks what it copies and what it finds: a bundle whose launcher runs another
    bundle's interpreter, or a directory planted under a bundle's name, is refused in one line,
    and nothing is placed."""
    first, second = bundles[0], bundles[1]
    forged = tmp_path / "forged" / os.path.basename(first)
    shutil.copytree(first, forged, symlinks=True)
    (forged / bundle.LAUNCHER).write_text(bundle.launcher_text(os.path.basename(second)))
    with pytest.raises(install.InstallError, match=rf"^{forged}: not a whole bundle \(its {bundle.LAUNCHER} is "):
        install.place_bundle(tree, str(forged))
    assert not os.path.lexists(tree + bundle.BUNDLES_DIR)
    planted = tree + bundle.directory(os.path.basename(first))
    os.makedirs(planted)
    with pytest.raises(install.InstallError, match=rf"^{planted}: there, and not bundle "):
        install.place_bundle(tree, first)
    assert os.listdir(planted) == [] and os.listdir(os.path.dirname(planted)) == [os.path.basename(first)]


def test_a_bundle_a_process_still_maps_is_kept_until_it_is_not(bundles, tree):
    """The oldest bundle is kept while a process runs from it (a start that began before an
    upgrade): here its python, sleeping. Once that ends, the next install removes it."""
    first, second, third = bundles
    install_from(tree, first)
    here = bundle.directory(os.path.basename(first))
    # In a mount namespace of its own, as a start on the host is from the toolkit's pod.
    nap = [f"{here}/{bundle.PYTHON}", "-IS", "-c", "import time; time.sleep(120)"]
    sleeper = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", IN_TREE, "sh", tree,
                                *nap], env=ENV)  # fmt: skip
    try:
        install_from(tree, second)
        deadline = time.monotonic() + 30
        while not os.readlink(f"/proc/{sleeper.pid}/exe").endswith(f"{here}/{bundle.LIBRARIES}/ld-linux-x86-64.so.2"):
            assert time.monotonic() < deadline  # unshare, sh and bin/python3 exec into the bundle's loader
            time.sleep(0.1)
        lines = install_from(tree, third)
        assert f"kept {here}: in use by pid {sleeper.pid}" in lines, lines
        assert os.path.isdir(tree + here)
    finally:
        sleeper.kill()
        sleeper.wait()
    install_from(tree, third)  # nothing maps it now: the next install removes it
    assert not os.path.lexists(tree + here)
    out = in_image(tree, third, "toolkit", "uninstall")
    assert out.returncode == 0, out.stderr
