"""The start server on the path users take (issue 41): `oci-gpu-hook install --runtime podman`
exactly as a user types it (the start server is install's default, issue 51), the server started
with the command systemd would run (the ExecStart= of the unit install wrote: there is no systemd
here), then plain `podman run`.

A GPU container gets exactly its GPU and nodes through the server's worker (its log records say
"via": "start server", its container record is written); after the server is stopped (SIGTERM)
the next start goes to Python as without it; after it is killed (SIGKILL) its socket stays behind,
the next start still goes to Python, and a server started again replaces that socket and takes
starts again. A runc bundle whose hook entry is the one install wrote goes through the server
too, and rootless podman never does (the server is root's and acts as root).

All of it happens in one private mount namespace (tests/privatehost.py) with overlays over /etc,
/usr/share/containers, /usr/local and /var/lib and a private tmpfs over /run/oci-gpu-hook (so no
other test's GPU start on this machine can reach the server, and the server's socket never
reaches the host), /run/runc, /run/libpod and /run/containers. The rootless user is set up as in
test_podman_rootless.py (real user, subordinate ids, a home of its own), so the simulated GPU
host, the image and the bundle lie in a directory every user may enter, removed afterwards.
"""

import contextlib
import json
import os
import sys

import pytest
import usercheck
from hookcheck import listed_uuids
from privatehost import Session

# The rootless user's setup, as the rootless test makes it (the same helpers, not a second copy).
from test_podman_rootless import SUBORDINATE, _closed_directories, _free_uid, _hook_paths

from oci_gpu_hook.start import prefilter_rule, server
from oci_gpu_hook.toolkit import containers, install

USER = "ocigpu-startsrv"
IMAGE = "localhost/ocigpu-start-server:test"
SOCKET = prefilter_rule.START_SERVER_SOCKET
RUN_DIR = os.path.dirname(SOCKET)
UNIT = f"{install.UNIT_DIR}/{install.START_SERVICE}"
OVERLAYS = ["/etc", "/usr/share/containers", "/usr/local", "/var/lib"]
TMPFS = [RUN_DIR, "/run/runc", "/run/libpod", "/run/containers"]
# The GPU's nodes, the GPUs nvidia-smi sees, and the container's hostname (podman: the first 12
# characters of its id; runc: the bundle's), to find the start's log records.
GPU_COMMAND = ["sh", "-c", "nvidia-smi -L && ls /dev && cat /etc/hostname"]
VIA = "start server"
RUNC_ID = "ocigpu-start-server-runc"
# The server as systemd would start it: the words of the unit's ExecStart= (the test checks that
# they are plain words, which systemd and this shell split alike) at the unit's Nice=, with its pid
# kept to signal it.
SERVER = 'echo $$ > "$0" && set -f && exec nice -n "$(sed -n "s/^Nice=//p" "$1")" $(sed -n "s/^ExecStart=//p" "$1")'
# Every container record, copied as soon as it is there (the hook puts each in place by a rename):
# the server's idle spare collects the records of containers that are gone a second after the
# starts, and these containers are gone as soon as they have listed their GPUs.
WATCH_RECORDS = ('mkdir -p "$1" && while :; do for f in "$0"/*.json; do [ -e "$f" ] && [ ! -e "$1/${f##*/}" ] && '
                 'cp "$f" "$1/"; done; sleep 0.01; done')  # fmt: skip
# SIGTERM by pid; done when the socket it bound is gone (it removes it on its way out).
TERM = 'kill -TERM "$(cat "$0")" && i=0 && while [ -e "$1" ]; do i=$((i+1)); [ $i -lt 600 ] || exit 1; sleep 0.1; done'
# SIGKILL by pid; done when the process is dead (a zombie until privatehost reaps it, or gone).
KILL = ('pid=$(cat "$0") && kill -KILL "$pid" && i=0 && while [ -e "/proc/$pid" ] && '
        '[ "$(sed "s/.*) //" "/proc/$pid/stat" | cut -d" " -f1)" != Z ]; do i=$((i+1)); [ $i -lt 600 ] || exit 1; '
        "sleep 0.1; done")  # fmt: skip
# Sets the bundle's hook entry to the one in install's hooks.d file, read inside the namespace.
HOOK_ENTRY = (
    "import json, sys\n"
    "hook = json.load(open(sys.argv[1]))['hook']\n"
    "config = json.load(open(sys.argv[2]))\n"
    "config['hooks'] = {'prestart': [hook]}\n"
    "json.dump(config, open(sys.argv[2], 'w'))\n"
)


@contextlib.contextmanager
def _run_directories(paths):
    """Each of paths as a directory on the host, so that privatehost lays its tmpfs over it (it
    covers only what exists): those made here are removed afterwards (empty: what the namespace
    wrote there went to its tmpfs)."""
    made = [p for p in paths if not os.path.isdir(p)]
    for path in made:
        os.mkdir(path, 0o755)
    try:
        yield
    finally:
        for path in reversed(made):
            with contextlib.suppress(OSError):  # something else wrote there meanwhile: it stays
                os.rmdir(path)


def _scenario(top: str, host: dict) -> tuple:
    """Run it all in one private namespace; returns (results by step name, work directory, uid)."""
    work = f"{top}/work"
    os.mkdir(work)
    os.chmod(work, 0o755)
    uid, home, xdg = _free_uid(), f"{work}/home", f"{work}/xdg"
    config = f"{host['root']}/config.yaml"
    cli = containers.hook_command(config)
    as_user = ["runuser", "-u", USER, "--", "env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin", f"HOME={home}",
               f"XDG_RUNTIME_DIR={xdg}", "LC_ALL=C"]  # fmt: skip
    podman_gpu = ["podman", "run", "--rm", *containers.PODMAN_RUN_OPTIONS, "-e", "NVIDIA_VISIBLE_DEVICES=1", IMAGE,
                  *GPU_COMMAND]  # fmt: skip
    storage = f'[storage]\ndriver = "vfs"\ngraphroot = "{work}/storage"\nrunroot = "{work}/run"\n'
    useradd = ["useradd", "-M", "-d", home, "-u", str(uid), "-U", "-s", "/bin/sh"]
    useradd += ["-K", "SUB_UID_COUNT=0", "-K", "SUB_GID_COUNT=0", USER]
    subids = (f'echo "{USER}:{SUBORDINATE}" >> /etc/subuid && echo "{USER}:{SUBORDINATE}" >> /etc/subgid && '
              f'mkdir -m 0700 "$0" "$1" && chown {USER}: "$0" "$1"')  # fmt: skip
    # The log: the user's hook appends to it too (a group); root's hook writes it as ever.
    log_setup = f'touch "$0" && chown root:{USER} "$0" && chmod 0660 "$0"'
    image = f'tar -C "$0" -cf - . | podman import - {IMAGE}'
    stop_user = ('kill "$(cat "$0/libpod/tmp/pause.pid")"; i=0; while pgrep -u "$1" >/dev/null; do i=$((i+1)); '
                 "[ $i -lt 300 ] || exit 1; sleep 0.1; done")  # fmt: skip
    chmods = {d: 0o755 for d in _closed_directories(_hook_paths())}  # every user may run the hook
    pids = [f"{work}/server{i}.pid" for i in range(3)]
    bundle_config = f"{top}/bundle/config.json"

    def server(i: int) -> dict:
        # privatehost names a daemon's log daemon<N>.log, N counting from 0 in the order started
        # (the record watch is the first).
        return {"daemon": ["sh", "-c", SERVER, pids[i], UNIT], "ready": ["grep", "-q", "listening on",
                                                                         f"{work}/daemon{i + 1}.log"]}  # fmt: skip

    named = [
        ("storage", {"write": "/etc/containers/storage.conf", "text": storage}),
        ("useradd", {"run": useradd}),
        ("subids", {"run": ["sh", "-c", subids, home, xdg]}),
        ("log", {"run": ["sh", "-c", log_setup, f"{host['root']}/hook.log"]}),
        *[(f"chmod {d}", {"run": ["chmod", f"{mode:o}", d]}) for d, mode in chmods.items()],
        ("install", {"run": [*cli, "install", "--runtime", "podman"]}),
        ("unit", {"run": ["cat", UNIT]}),
        ("root import", {"run": ["sh", "-c", image, f"{top}/rootfs"]}),
        ("user import", {"run": [*as_user, "sh", "-c", image, f"{top}/rootfs"]}),
        ("bundle", {"run": [sys.executable, "-I", "-c", HOOK_ENTRY, install.HOOKS_D_FILE, bundle_config]}),
        (
            "record watch",
            {
                "daemon": ["sh", "-c", WATCH_RECORDS, f"{host['root']}/containers", f"{work}/records"],
                "ready": ["test", "-d", f"{work}/records"],
            },
        ),
        ("server 1", server(0)),
        ("doctor served", {"run": [*cli, "doctor", "--json"]}),
        ("served", {"run": podman_gpu}),
        ("runc", {"run": ["runc", "run", "--bundle", f"{top}/bundle", RUNC_ID]}),
        ("runc delete", {"run": ["runc", "delete", "--force", RUNC_ID]}),
        ("user", {"run": [*as_user, *podman_gpu]}),
        ("term", {"run": ["sh", "-c", TERM, pids[0], SOCKET]}),
        ("doctor after term", {"run": [*cli, "doctor", "--json"]}),
        ("after term", {"run": podman_gpu}),
        ("server 2", server(1)),
        ("kill", {"run": ["sh", "-c", KILL, pids[1]]}),
        ("stale inode", {"run": ["stat", "-c", "%F %i", SOCKET]}),
        ("after kill", {"run": podman_gpu}),
        ("server 3", server(2)),
        ("new inode", {"run": ["stat", "-c", "%F %i", SOCKET]}),
        ("served again", {"run": podman_gpu}),
    ]
    # However the steps end (a server that does not start ends them), the user's processes end.
    final = [("stop user", {"run": ["sh", "-c", stop_user, xdg, str(uid)]})]
    with _run_directories(TMPFS):
        session = Session(work, OVERLAYS + list(chmods), [step for _, step in named], [step for _, step in final],
                          tmpfs=TMPFS)  # fmt: skip
        with session:
            pass
    by_name = dict(zip((n for n, _ in named + final), session.results))
    for step in ("useradd", "subids", "log", "install", "unit", "root import", "user import", "bundle",
                 "runc delete", "stop user"):  # fmt: skip
        assert by_name[step]["rc"] == 0, (step, by_name[step])
    assert all(by_name[n]["rc"] == 0 for n in by_name if n.startswith("chmod")), by_name
    return by_name, work, uid


@pytest.fixture(scope="module")
def world(require):
    require("root", "podman", "runc", "busybox", "gcc", "unshare", "useradd", "runuser", "newuidmap", "newgidmap")
    with usercheck.rootless_world("oci-gpu-hook-start-server-") as (top, host):
        env = {"NVIDIA_VISIBLE_DEVICES": "2"}
        containers.make_bundle(f"{top}/bundle", args=GPU_COMMAND, env=env, config_file=None, with_hook=False)
        with open(f"{top}/bundle/rootfs/etc/hostname", "w") as f:  # podman writes one; runc leaves it to the bundle
            f.write(f"{RUNC_ID}\n")
        results, work, uid = _scenario(top, host)
        with open(f"{host['root']}/hook.log") as f:
            log = [json.loads(line) for line in f]
        records = {}
        for name in os.listdir(f"{work}/records"):  # as the record watch copied them
            with open(f"{work}/records/{name}") as f:
                records[name] = json.load(f)
        servers = []
        for i in range(3):
            with open(f"{work}/daemon{i + 1}.log") as f:
                servers.append(f.read())
        yield {"host": host, "r": results, "log": log, "records": records, "servers": servers, "uid": uid,
               "config": f"{host['root']}/config.yaml"}  # fmt: skip


def _started(world, step: str, gpu: int) -> list:
    """The step's container got exactly GPU `gpu` and its nodes; returns its log records."""
    host, result = world["host"], world["r"][step]
    assert result["rc"] == 0, (step, result["stderr"])
    out = result["stdout"].split()
    assert listed_uuids(result["stdout"], ("GPU",)) == [host["gpus"][gpu]["uuid"]], (step, result["stdout"])
    nodes = {name for name in out if name.startswith("nvidia")}
    expected = {"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", f"nvidia{host['gpus'][gpu]['minor']}"}
    assert nodes == expected, (step, result["stdout"])
    hostname = out[-1]
    entries = [e for e in world["log"] if e["container"].startswith(hostname)]
    assert [e["message"] for e in entries if e["message"] == "GPU devices configured"] == ["GPU devices configured"], (
        step, entries)  # fmt: skip
    return entries


def _record(world, entries) -> dict:
    container = entries[0]["container"]
    return world["records"][f"{container}.json"]


def test_install_writes_a_service_whose_command_is_the_server(world):
    r = world["r"]
    assert "systemctl start oci-gpu-hook-start.socket" in r["install"]["stdout"], r["install"]
    assert "warning" not in r["install"]["stderr"], r["install"]
    commands = [line[len("ExecStart=") :] for line in r["unit"]["stdout"].splitlines() if line.startswith("ExecStart=")]
    assert len(commands) == 1, r["unit"]["stdout"]
    # Plain words (no quotes, escapes, specifiers or variables): systemd splits them as the shell did.
    assert not set(commands[0]) & set("\"'\\%$;"), commands[0]
    # The server's own launcher (its SELinux domain's entry point), not the hook's program.
    assert commands[0].split() == [install.START_LAUNCHER, "--config", world["config"], prefilter_rule.START_SERVER]
    assert f"listening on {SOCKET}" in world["servers"][0], world["servers"][0]


def test_plain_podman_run_starts_through_the_server(world):
    entries = _started(world, "served", 1)
    assert all(e.get("via") == VIA for e in entries), entries
    record = _record(world, entries)
    assert record["outcome"] == "started" and record["id"] == entries[0]["container"], record
    assert world["host"]["gpus"][1]["uuid"] in json.dumps(record["devices"]), record
    # Every offer was taken, and the server said nothing else about them.
    for log in world["servers"]:
        assert "not taken" not in log and "Traceback" not in log, log


def test_runc_bundle_with_installs_hook_entry_starts_through_the_server(world):
    entries = _started(world, "runc", 2)
    assert entries[0]["container"] == RUNC_ID, entries
    assert all(e.get("via") == VIA for e in entries), entries
    assert _record(world, entries)["outcome"] == "started"


def test_after_sigterm_the_next_start_goes_to_python(world):
    r = world["r"]
    assert r["term"]["rc"] == 0, r["term"]  # the server removed its socket on its way out
    assert world["servers"][0].rstrip().endswith("stopped"), world["servers"][0]
    entries = _started(world, "after term", 1)
    assert not [e for e in entries if "via" in e], entries
    assert _record(world, entries)["outcome"] == "started"


def test_after_sigkill_a_stale_socket_falls_back_and_a_new_server_replaces_it(world):
    r = world["r"]
    assert r["kill"]["rc"] == 0, r["kill"]
    stale, new = r["stale inode"], r["new inode"]
    assert stale["rc"] == 0 and stale["stdout"].startswith("socket "), stale  # left behind
    entries = _started(world, "after kill", 1)
    assert not [e for e in entries if "via" in e], entries
    # The server started again took the path (a socket of its own there) and the next start.
    assert new["rc"] == 0 and new["stdout"].startswith("socket ") and new["stdout"] != stale["stdout"], (stale, new)
    assert f"listening on {SOCKET}" in world["servers"][2], world["servers"][2]
    entries = _started(world, "served again", 1)
    assert all(e.get("via") == VIA for e in entries), entries


def _doctor_says(world, step: str) -> dict:
    (check,) = [c for c in json.loads(world["r"][step]["stdout"])["checks"] if c["id"] == "start-server"]
    return check


def test_doctor_sees_the_server_serve_the_installed_code_and_then_stopped(world):
    """Asked while the server runs: it serves the installed code, and the hook install wrote offers
    it starts as that code. After SIGTERM: nothing answers, a WARN that says each start runs in Python."""
    served = _doctor_says(world, "doctor served")
    installed = server.code_identity()
    assert served["status"] == "PASS", served
    assert f"serves the installed code ({installed})" in served["summary"], served
    stopped = _doctor_says(world, "doctor after term")
    assert stopped["status"] == "WARN" and "does not answer" in stopped["summary"], stopped


def test_rootless_podman_never_goes_through_the_server(world):
    entries = _started(world, "user", 1)
    assert f"host uid {world['uid']}" in entries[0].get("unprivileged", ""), entries
    assert not [e for e in entries if "via" in e], entries
    # Not even offered: the server that listened then refused nothing (an offer it would refuse).
    assert "not taken" not in world["servers"][0], world["servers"][0]
