"""Rootless podman (issue 37, item 3): after one `oci-gpu-hook install --runtime podman`, a real
unprivileged user's plain `podman run` and root's get exactly the GPU they ask for, with the same
configuration and no setting flipped between them (NVIDIA's `no-cgroups` must be).

The user is real: made with useradd, with subordinate uid and gid ranges, running podman through
newuidmap/newgidmap, its storage under a home of its own. All of it happens in a private mount
namespace (tests/privatehost.py) with overlays over /etc, /usr/share/containers, /usr/local and
/var/lib, so the user, its ranges and install's files never reach the host; the home, the
simulated GPU host and the image lie in a directory every user may enter, removed afterwards.
The rootless hook runs as that user's uid in its user namespace: it must bind-mount the nodes,
leave the device cgroup to the runtime, keep no record, and say so once in its log; doctor's
`rootless` verdict must agree with what the container got, both where every user may run the
installed hook and where its interpreter lies in a directory closed to them (as a checkout in
root's 0700 home is).
"""

import json
import os
import pwd
import sys

import pytest
import usercheck
from hookcheck import listed_uuids
from privatehost import run

from oci_gpu_hook.start.memory_limit import ENV as LIMIT
from oci_gpu_hook.toolkit import containers, launcher

USER = "ocigpu-rootless"
IMAGE = "localhost/ocigpu-rootless:test"
SUBORDINATE = "400000:65536"  # a range past every uid the test uses (podman maps 65536 ids)
REQUEST = ["-e", "NVIDIA_VISIBLE_DEVICES=1"]
GPU_COMMAND = ["sh", "-c", "nvidia-smi -L && ls /dev"]
OVERLAYS = ["/etc", "/usr/share/containers", "/usr/local", "/var/lib"]


def _free_uid() -> int:
    uid = 23000
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


def _closed_directories(paths) -> list:
    """The directories on the way to paths that other users cannot enter."""
    closed = []
    for path in paths:
        directory = os.path.dirname(os.path.abspath(path))
        while directory != "/":
            if not os.stat(directory).st_mode & 0o001 and directory not in closed:
                closed.append(directory)
            directory = os.path.dirname(directory)
    return closed


def _hook_paths() -> list:
    """What install's launcher names: this interpreter (as named, and the file it is) and the package."""
    return [sys.executable, os.path.realpath(sys.executable), os.path.join(launcher.package_parent(), "x")]


@pytest.fixture(scope="module")
def world(require):
    require("root", "podman", "runc", "busybox", "gcc", "unshare", "useradd", "runuser", "newuidmap", "newgidmap")
    with usercheck.rootless_world("oci-gpu-hook-rootless-") as made:
        yield made


def _scenario(top: str, host: dict, name: str, chmods: dict):
    """Run it all in a private namespace; returns (results by step name, work directory, uid).
    chmods: {directory: mode} laid over the host's (an overlay's root, so the host keeps its own)."""
    work = f"{top}/{name}"
    os.mkdir(work)
    os.chmod(work, 0o755)
    uid, home, xdg = _free_uid(), f"{work}/home", f"{work}/xdg"
    log = f"{host['root']}/hook.log"
    cli = containers.hook_command(f"{host['root']}/config.yaml")
    as_user = ["runuser", "-u", USER, "--", "env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin", f"HOME={home}",
               f"XDG_RUNTIME_DIR={xdg}", "LC_ALL=C"]  # fmt: skip
    podman_run = ["podman", "run", "--rm", *containers.PODMAN_RUN_OPTIONS]
    storage = f'[storage]\ndriver = "vfs"\ngraphroot = "{work}/storage"\nrunroot = "{work}/run"\n'
    useradd = ["useradd", "-M", "-d", home, "-u", str(uid), "-U", "-s", "/bin/sh"]
    useradd += ["-K", "SUB_UID_COUNT=0", "-K", "SUB_GID_COUNT=0", USER]  # useradd's own ranges off
    subids = (f'echo "{USER}:{SUBORDINATE}" >> /etc/subuid && echo "{USER}:{SUBORDINATE}" >> /etc/subgid && '
              f'mkdir -m 0700 "$0" "$1" && chown {USER}: "$0" "$1"')  # fmt: skip
    # The log: the site lets its users' hooks append (a group); root's hook writes it as ever.
    log_setup = f'rm -f "$0" "$1"/*.json && touch "$0" && chown root:{USER} "$0" && chmod 0660 "$0"'
    image = f'tar -C "$0" -cf - . | podman import - {IMAGE}'
    info = "{{.Host.CgroupManager}} {{.Host.CgroupsVersion}} {{.Store.GraphRoot}}"
    # podman's pause process holds the user's namespaces: ended by its pid, then nothing of the
    # user's may be left running.
    stop = ('kill "$(cat "$0/libpod/tmp/pause.pid")"; i=0; while pgrep -u "$1" >/dev/null; do i=$((i+1)); '
            "[ $i -lt 100 ] || exit 1; sleep 0.1; done")  # fmt: skip
    named = [
        ("storage", {"write": "/etc/containers/storage.conf", "text": storage}),
        ("useradd", {"run": useradd}),
        ("subids", {"run": ["sh", "-c", subids, home, xdg]}),
        ("log", {"run": ["sh", "-c", log_setup, log, f"{host['root']}/containers"]}),  # and no record yet
        *[(f"chmod {d}", {"run": ["chmod", f"{mode:o}", d]}) for d, mode in chmods.items()],
        ("install", {"run": [*cli, "install", "--runtime", "podman"]}),
        ("root import", {"run": ["sh", "-c", image, f"{top}/rootfs"]}),
        ("user import", {"run": [*as_user, "sh", "-c", image, f"{top}/rootfs"]}),
        ("root gpu", {"run": [*podman_run, *REQUEST, IMAGE, *GPU_COMMAND]}),
        ("user gpu", {"run": [*as_user, *podman_run, *REQUEST, IMAGE, *GPU_COMMAND]}),
        ("user plain", {"run": [*as_user, *podman_run, IMAGE, "true"]}),
        ("user limit", {"run": [*as_user, *podman_run, *REQUEST, "-e", f"{LIMIT}=1GiB", IMAGE, "true"]}),
        ("doctor", {"run": [*cli, "doctor"]}),
        ("user info", {"run": [*as_user, "podman", "info", "--format", info]}),
        ("stop", {"run": ["sh", "-c", stop, xdg, str(uid)]}),
    ]
    results = run(work, OVERLAYS + list(chmods), [step for _, step in named], tmpfs=["/run/libpod", "/run/containers"])
    by_name = dict(zip((n for n, _ in named), results))
    for step in ("useradd", "subids", "log", "install", "root import", "user import", "stop"):
        assert by_name[step]["rc"] == 0, (step, by_name[step])
    assert all(by_name[n]["rc"] == 0 for n in by_name if n.startswith("chmod")), by_name
    return by_name, work, uid


def _doctor_line(result, check: str) -> list:
    lines = result["stdout"].splitlines()
    at = [i for i, line in enumerate(lines) if line.split()[1:2] == [check]]
    assert len(at) == 1, result["stdout"] + result["stderr"]
    return lines[at[0] : at[0] + 2]


def _log(host) -> list:
    with open(f"{host['root']}/hook.log") as f:
        return [json.loads(line) for line in f]


def _nvidia_nodes(stdout: str) -> set:
    return {name for name in stdout.split() if name.startswith("nvidia")}


def test_one_configuration_serves_rootful_and_rootless_podman(world):
    top, host = world
    # Every user may run what install's launcher names, as on a host where the package was
    # installed as root outside a home (a checkout in a 0700 directory is opened here, over it).
    r, work, uid = _scenario(top, host, "open", {d: 0o755 for d in _closed_directories(_hook_paths())})
    expected = {"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", f"nvidia{host['gpus'][1]['minor']}"}
    wanted = [host["gpus"][1]["uuid"]]
    # What rootless podman is here: no systemd, so cgroupfs; the user's storage under its home.
    assert r["user info"]["stdout"].split()[0] == "cgroupfs", r["user info"]
    assert r["user info"]["stdout"].split()[2].startswith(f"{work}/home/"), r["user info"]
    for who in ("root gpu", "user gpu"):
        assert r[who]["rc"] == 0, (who, r[who]["stderr"])
        assert listed_uuids(r[who]["stdout"], ("GPU",)) == wanted, (who, r[who]["stdout"])
        assert _nvidia_nodes(r[who]["stdout"]) == expected, (who, r[who]["stdout"])
    assert r["user plain"]["rc"] == 0, r["user plain"]["stderr"]
    # A GPU memory limit is the watchdog's to enforce, and it sees no rootless container: refused.
    assert r["user limit"]["rc"] != 0 and "cannot see a rootless container" in r["user limit"]["stderr"], r
    # The log: one entry per GPU start; the rootless one says once what it left to the runtime.
    starts = [e for e in _log(host) if e["message"] == "GPU devices configured"]
    assert len(starts) == 2, starts
    rootful, rootless = sorted(starts, key=lambda e: "unprivileged" in e)
    assert "unprivileged" not in rootful and "left_to_runtime" not in rootful, rootful
    assert f"host uid {uid}" in rootless["unprivileged"], rootless
    left = rootless["left_to_runtime"]
    assert [x.split(":")[0] for x in left] == ["cgroup device rules (4)", "the container record"], left
    assert not [s for s in rootless["skipped"] if s.startswith("cgroup")], rootless["skipped"]
    # A record for the rootful container alone: the node services see no rootless one.
    assert sorted(os.listdir(f"{host['root']}/containers")) == [rootful["container"] + ".json"]
    # doctor agrees: every user may start the hook.
    line = _doctor_line(r["doctor"], "rootless")
    assert line[0].startswith("PASS") and USER in line[0], line


def test_doctor_fails_when_users_cannot_run_the_hook(world):
    top, host = world
    # The interpreter install's launcher names lies in a directory closed to other users (a
    # checkout in root's home): a rootless GPU container cannot start the hook, and doctor says so.
    closed = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
    chmods = {d: 0o755 for d in _closed_directories(_hook_paths()) if d != closed}
    r, _, _ = _scenario(top, host, "closed", {**chmods, closed: 0o700})
    assert r["root gpu"]["rc"] == 0, r["root gpu"]["stderr"]
    assert r["user gpu"]["rc"] != 0 and "hook" in r["user gpu"]["stderr"], r["user gpu"]
    assert r["user plain"]["rc"] == 0, r["user plain"]  # the compiled pre-filter: no Python for it
    line = _doctor_line(r["doctor"], "rootless")
    assert line[0].startswith("FAIL") and closed in line[0], line
    assert line[1].split()[0] == "fix:" and "oci-gpu-hook install --runtime podman" in line[1], line
