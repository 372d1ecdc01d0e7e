"""The compiled pre-filter (start/csrc/prefilter.c, built by toolkit/prefilter.py) against the
Python rule, on one corpus (prefilter_corpus.py) and on seeded random edits of it:
- it exits 0 by itself only where the Python hook finds no GPU request (never where Python would
  configure GPUs or fail), and on the corpus's plain cases exactly there;
- everything else goes to the Python hook with the same arguments and the same state bytes;
- a bad state, a missing bundle and an oversized config get the Python hook's line and status;
- it opens nothing but config.json and runs nothing but the Python hook;
- built with the start server's socket (offer_to_server), only as root and only to a root peer,
  it offers the starts Python would get; a start the server takes ends as its worker says (one
  line and 70 when the worker ends without a verdict), and one no server takes (no socket, a
  stale one, "not taken") is the Python hook's, as without a server.
The corpus and the random edits run twice: through the build install makes (with -Werror here, so
that a new warning fails the suite and not a host's install), and through the same main built with
AddressSanitizer and UBSan, every check on, alignment included, stopping at the first report. Only
the real main's layout shows how the arena sits in its mapping (issue 36, item 5); a harness with
an arena of its own cannot. The runtimes run it in tests/e2e/test_prefilter_runtimes.py.
"""

from __future__ import annotations

import array
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import hookcheck
import prefilter_corpus
import pytest
import startservercheck

from oci_gpu_hook.errors import Exit, HookError
from oci_gpu_hook.start import prefilter_rule, prestart, spec, state
from oci_gpu_hook.toolkit import install, launcher, prefilter

DEFERRED = 42  # the recording stand-in for the Python hook exits with this
STRICT = ("-Werror",)
# gcc's -fsanitize=undefined has the alignment check; the float checks and bounds-strict are not
# in it. -U_FORTIFY_SOURCE: the fortified string functions would go around ASan's own.
SANITIZERS = ("-fsanitize=address,undefined,float-divide-by-zero,float-cast-overflow,bounds-strict",
              "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g", "-U_FORTIFY_SOURCE")  # fmt: skip
SANITIZER_ENV = {"UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
                 "ASAN_OPTIONS": "halt_on_error=1:abort_on_error=0:detect_leaks=1:strict_string_checks=1:"
                                 "detect_stack_use_after_return=1:check_initialization_order=1"}  # fmt: skip


def build_recorded(work, flags) -> tuple:
    """(the pre-filter built with flags, its directory, a bundle of its own), in front of a
    recording stand-in for the Python hook."""
    recorder = work / "python-hook"
    recorder.write_text(
        '#!/bin/sh\nfor a; do printf "%s\\n" "$a"; done > "$RECORD.argv"\ncat > "$RECORD.stdin"\nexit 42\n'
    )
    recorder.chmod(0o755)
    program = prefilter.build(str(work / "prefilter"), str(recorder), flags=flags)
    bundle = work / "bundle"
    bundle.mkdir()
    return program, work, str(bundle)


@pytest.fixture(scope="module")
def built(tmp_path_factory, require_module):
    """(the pre-filter, its recording Python hook, the shared bundle)."""
    return build_recorded(tmp_path_factory.mktemp("prefilter"), STRICT)


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory, require_module):
    """The same, built with ASan and UBSan: any report ends it with a status run() refuses."""
    return build_recorded(tmp_path_factory.mktemp("prefilter-sanitized"), STRICT + SANITIZERS)


@pytest.fixture(params=["built", "sanitized"])
def each_build(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def require_module(request):
    require = request.getfixturevalue("require")
    require("gcc")


def python_decision(data: bytes) -> str:
    """What the Python hook decides for this state, its bundle as it is now: none, gpu or error."""
    try:
        container = state.parse(data[: state.MAX_STATE_BYTES + 1])
        return "gpu" if prestart.may_ask_for_gpus(spec.load(container.bundle)) else "none"
    except HookError:
        return "error"


def run(program: str, work, data: bytes, argv=("prestart",)) -> tuple:
    """(skip or defer, the argv and stdin the Python hook got)."""
    record = str(work / "record")
    for suffix in (".argv", ".stdin"):
        if os.path.exists(record + suffix):
            os.unlink(record + suffix)
    done = subprocess.run([program, *argv], input=data, capture_output=True, timeout=30,
                          env={"RECORD": record, "PATH": "/usr/bin:/bin", **SANITIZER_ENV})  # fmt: skip
    if done.returncode == 0:
        assert not os.path.exists(record + ".argv") and done.stderr == b"", done.stderr
        return "skip", None, None
    assert done.returncode == DEFERRED, (done.returncode, done.stderr)
    with open(record + ".argv") as f, open(record + ".stdin", "rb") as g:
        return "defer", f.read().splitlines(), g.read()


def place_config(bundle: str, doc) -> None:
    path = os.path.join(bundle, "config.json")
    if os.path.lexists(path):
        os.unlink(path)
    if doc is not None:
        with open(path, "wb") as f:
            f.write(doc)


def check_case(built, name, data, doc, exact) -> str:
    program, work, bundle = built
    place_config(bundle, doc)
    python = python_decision(data)
    decided, argv, stdin = run(program, work, data)
    if decided == "skip":
        assert python == "none", f"{name}: the pre-filter skipped a container Python finds {python}"
    else:
        assert argv == ["prestart"], name
        assert stdin == data[: state.MAX_STATE_BYTES + 1], f"{name}: the Python hook got other state bytes"
    if exact:
        assert (decided == "skip") == (python == "none"), f"{name}: pre-filter {decided}, Python {python}"
    return decided


CORPUS = prefilter_corpus.cases(lambda name: "%BUNDLE%")


@pytest.mark.parametrize("index", range(len(CORPUS)), ids=[c[0] for c in CORPUS])
def test_agrees_with_the_python_rule_on_the_corpus(each_build, index):
    name, data, doc, exact = prefilter_corpus.cases(lambda _: each_build[2])[index]
    check_case(each_build, name, data, doc, exact)


def test_never_skips_where_python_would_not_on_random_edits(each_build):
    """600 seeded edits of the corpus (bytes flipped, dropped, repeated, cut): whatever the input,
    an exit 0 of its own is one Python would give too."""
    bundle = each_build[2]
    decided = [check_case(each_build, *case) for case in prefilter_corpus.mutations(29, 600, lambda _: bundle)]
    assert "skip" in decided and "defer" in decided  # both ways were taken


def test_the_plain_cases_are_decided_without_python(built):
    """The point of it: an ordinary container, and every plain no-GPU case, never starts Python."""
    plain = {case[0] for case in prefilter_corpus.PLAIN}
    skipped = set()
    for name, data, doc, _ in prefilter_corpus.cases(lambda _: built[2]):
        if name in plain:
            place_config(built[2], doc)
            if run(built[0], built[1], data)[0] == "skip":
                skipped.add(name)
    assert {"plain", "no-process", "visible-void", "visible-blank", "state-escaped"} <= skipped
    assert not {"visible-all", "cuda-version", "cdi-annotation", "volume-mount"} & skipped


@pytest.mark.parametrize(
    "argv",
    [("--config", "/x.yaml", "prestart"), ("--config=/x.yaml", "createRuntime"), ("info",), ("prestart", "extra"),
     ("--config", "prestart"), ()],
)  # fmt: skip
def test_other_command_lines_go_to_python_untouched(built, argv):
    """Only a runtime's command line is read; any other goes to Python with its stdin unread."""
    program, work, bundle = built
    place_config(bundle, prefilter_corpus.config_bytes(prefilter_corpus.config()))
    data = prefilter_corpus.expanded(prefilter_corpus.STATE, bundle)
    decided, passed, stdin = run(program, work, data, argv)
    runtime = argv in (("--config", "/x.yaml", "prestart"), ("--config=/x.yaml", "createRuntime"))
    assert decided == ("skip" if runtime else "defer")
    if not runtime:
        assert passed == list(argv) and stdin == data


@pytest.fixture(scope="module")
def fronting_python(tmp_path_factory, require_module):
    """The pre-filter in front of this checkout's real Python hook (a launcher of its own)."""
    from hookcheck import prefilter_for_this_checkout

    return prefilter_for_this_checkout(tmp_path_factory.mktemp("prefilter-real"))


@pytest.mark.parametrize("case", ["bad-state", "missing-bundle", "oversized-config", "bad-config", "gpu-error"])
def test_errors_are_the_python_hooks_own(fronting_python, tmp_path, case):
    """The same one line and exit status as the Python hook alone: the pre-filter says nothing of
    its own, it hands the input over."""
    program, hook = fronting_python
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    data = prefilter_corpus.expanded(prefilter_corpus.STATE, str(bundle))
    doc = prefilter_corpus.config()
    if case == "bad-state":
        data = b'{"ociVersion": "3.0.0"'
    elif case == "missing-bundle":
        data = prefilter_corpus.expanded(prefilter_corpus.STATE, str(tmp_path / "gone"))
    elif case == "gpu-error":
        doc = prefilter_corpus.config(["NVIDIA_VISIBLE_DEVICES=0"])
    if case == "oversized-config":
        (bundle / "config.json").write_bytes(b" " * (spec.MAX_CONFIG_BYTES + 1))
    elif case == "bad-config":
        (bundle / "config.json").write_bytes(b'{"root": ')
    else:
        (bundle / "config.json").write_bytes(prefilter_corpus.config_bytes(doc))
    config = ["--config", str(tmp_path / "missing-config.yaml")]  # a GPU request then fails on it
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}
    alone = subprocess.run([hook, *config, "prestart"], input=data, capture_output=True, env=env, timeout=60)
    fronted = subprocess.run([program, *config, "prestart"], input=data, capture_output=True, env=env, timeout=60)
    assert alone.returncode != 0 and alone.stderr.startswith(b"oci-gpu-hook: "), alone.stderr
    assert (fronted.returncode, fronted.stderr) == (alone.returncode, alone.stderr)


def test_opens_nothing_but_config_json_and_runs_nothing(built, require):
    """strace: the only path it opens is the bundle's config.json, and it starts no program."""
    require("strace")
    program, work, bundle = built
    place_config(bundle, prefilter_corpus.config_bytes(prefilter_corpus.config()))
    data = prefilter_corpus.expanded(prefilter_corpus.STATE, bundle)
    trace = work / "trace"
    done = subprocess.run(["strace", "-f", "-qq", "-e", "trace=%file,%process", "-o", str(trace), program,
                           "prestart"], input=data, capture_output=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line.split(None, 1)[1] for line in trace.read_text().splitlines() if "(" in line]
    named = {m for line in lines for m in re.findall(r'"(/[^"]*)"', line) if not line.startswith("execve")}
    # The dynamic loader's own (its preload list, its cache, the C library); then config.json alone.
    loader = {p for p in named if p.endswith(("/ld.so.preload", "/ld.so.cache")) or "/libc.so" in p}
    assert named - loader == {f"{bundle}/config.json"}, named
    assert [line for line in lines if line.startswith(("execve", "clone", "fork", "vfork"))][1:] == []


def test_header_is_written_from_the_python_rule():
    text = prefilter.header("/usr/libexec/oci-gpu-hook/python-hook")
    r = prefilter_rule
    for value in (r.VISIBLE_DEVICES, r.NO_DEVICES, r.LEGACY_VARIABLE, r.CDI_ANNOTATION_PREFIX,
                  os.path.basename(r.VOLUME_MOUNT_DIR), *r.RUNTIME_COMMANDS):  # fmt: skip
        assert f'"{value}"' in text
    assert f"RULE_MAX_STATE_BYTES {state.MAX_STATE_BYTES}u" in text
    assert f"RULE_MAX_CONFIG_BYTES {spec.MAX_CONFIG_BYTES}u" in text
    with pytest.raises(prefilter.PrefilterError):
        prefilter.header("relative/hook")
    with pytest.raises(prefilter.PrefilterError):
        prefilter.header("/x\n#define PYTHON_HOOK /tmp/mine")  # a path cannot become C
    assert '"/x\\"y"' in prefilter.header('/x"y')  # quoted as one C string


def test_no_compiler_says_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(prefilter.PrefilterError, match="no C compiler"):
        prefilter.build(str(tmp_path / "p"), "/x")


def compiler_wrapper(directory, *options) -> str:
    """A directory whose cc is the real gcc with options added after the build's own (what
    compiler() finds first on PATH): a compiler that is there but differs from the suite's."""
    os.makedirs(directory, exist_ok=True)
    cc = os.path.join(str(directory), "cc")
    with open(cc, "w") as f:
        f.write(f'#!/bin/sh\nexec {shutil.which("gcc")} "$@" {" ".join(options)}\n')
    os.chmod(cc, 0o755)
    return str(directory)


def test_a_new_warning_does_not_fail_the_install_build(tmp_path, require):
    """A newer compiler warns where this one does not (here -Wpadded, on struct value): install's
    build still succeeds; only the suite's strict build makes warnings fatal."""
    require("gcc")
    cc = os.path.join(compiler_wrapper(tmp_path / "bin", "-Wpadded"), "cc")
    with pytest.raises(prefilter.PrefilterError, match="Werror=padded"):
        prefilter.build(str(tmp_path / "strict"), "/x", cc=cc, flags=STRICT)  # the warning is there
    assert prefilter.is_prefilter(prefilter.build(str(tmp_path / "p"), "/x", cc=cc))


@pytest.fixture
def broken_compiler(tmp_path, require):
    """(a --root tree, the CLI's environment): the first cc on PATH cannot find the C library's
    headers (gcc -nostdinc), as on a host with gcc but no libc development package."""
    require("gcc")
    assert install.hook_command() == [launcher.LAUNCHER], "an installed /usr/bin/oci-gpu-hook: no build to try"
    root = tmp_path / "root"
    (root / "etc/containers").mkdir(parents=True)
    path = compiler_wrapper(tmp_path / "bin", "-nostdinc") + ":" + os.environ.get("PATH", "/usr/bin:/bin")
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    return str(root), dict(env, PATH=path, LC_ALL="C")


def test_install_falls_back_to_the_launcher_where_the_compiler_cannot_build(broken_compiler, hook_cli):
    """Asked for nothing (no --prefilter, no --no-prefilter): the launcher where runtimes run the
    hook, one warning line, exit 0."""
    root, env = broken_compiler
    done = hook_cli("install", "--root", root, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("oci-gpu-hook: warning: the pre-filter could not be built (")
    ends = "): runtimes run the launcher, and GPU starts run in Python (no start server)\n"
    assert "errno.h" in done.stderr and done.stderr.endswith(ends), done.stderr
    assert launcher.is_launcher(root + launcher.LAUNCHER) and not os.path.lexists(root + launcher.PYTHON_LAUNCHER)
    with open(os.path.join(root, install.HOOKS_D_FILE.lstrip("/"))) as f:
        assert json.load(f)["hook"]["path"] == launcher.LAUNCHER
    assert f"wrote {root}{launcher.LAUNCHER}" in done.stdout.splitlines()


def test_docker_program_stays_the_launcher_where_the_compiler_cannot_build(broken_compiler, hook_cli):
    """Docker's program, which is the pre-filter where one is built, falls back the same way: the
    launcher with the --config, at dockerd's path, and no launcher of its own beside the others."""
    root, env = broken_compiler
    done = hook_cli("--config", "/etc/gpu.yaml", "install", "--root", root, "--runtime", "docker", env=env)
    assert done.returncode == 0 and "could not be built" in done.stderr, done.stderr
    program = root + install.DOCKER_HOOK
    assert launcher.is_launcher(program) and not os.path.lexists(root + install.DOCKER_LAUNCHER)
    with open(program) as f:
        assert f.read().rstrip().endswith("sys.exit(main(options=['--config', '/etc/gpu.yaml']))")


def test_install_prefilter_fails_in_one_line_and_writes_nothing(broken_compiler, hook_cli):
    """--prefilter asks for it: the same compiler is a one-line error, and the tree is unchanged."""
    root, env = broken_compiler
    before = hookcheck.tree(root, contents=True, times=True)
    done = hook_cli("install", "--prefilter", "--root", root, env=env)
    assert done.returncode != 0 and done.stdout == "", done.stdout
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "cannot build the pre-filter" in done.stderr and "errno.h" in done.stderr, done.stderr
    assert hookcheck.tree(root, contents=True, times=True) == before


# --- the start server's client (offer_to_server; the server's side: tests/start/test_server.py) --
# Each test runs with the build install makes and with the sanitized one: the offer, the verdict,
# the fallbacks and the one line are the pre-filter's own C code.

NOBODY = 65534


def socket_of(place: str) -> str:
    return os.path.join(place, "sock", "start.sock")


@pytest.fixture(scope="module")
def server_place(require_module):
    """A directory of root's, 0700, for the offering pre-filters and their socket (in sock/, a
    directory of root's, 0700, as the server requires)."""
    with startservercheck.socket_directory() as top:
        os.mkdir(os.path.dirname(socket_of(top)), 0o700)
        yield top


@pytest.fixture(scope="module", params=["strict", "sanitized"])
def offering(request, server_place):
    """(a pre-filter offering to socket_of(server_place), in front of this checkout's Python hook;
    the environment to run it in)."""
    sanitized = request.param == "sanitized"
    flags = STRICT + (SANITIZERS if sanitized else ())
    program, _ = startservercheck.prefilter(os.path.join(server_place, request.param), socket_of(server_place), flags)
    return program, SANITIZER_ENV if sanitized else {}


def ends_alike(one, other) -> None:
    assert (one.returncode, one.stderr, one.stdout) == (other.returncode, other.stderr, other.stdout)


def test_a_start_the_server_takes_ends_as_its_worker_says(offering, server_place, live_container, tmp_path):
    """A refused GPU request: the Python hook's status and line, through the pre-filter's stdout
    and stderr; a GPU start: made, exit 0, nothing said. Both ran in the server's workers."""
    program, env = offering
    container = live_container(startservercheck.GPU_ENV)
    config = startservercheck.config(container[4], tmp_path)
    data = startservercheck.gpu_error_state(tmp_path)
    with startservercheck.started(socket_of(server_place), tmp_path / "server.log") as running:
        alone = startservercheck.python_hook(config, data)
        refused = startservercheck.run(program, config, data, env)
        made = startservercheck.run(program, config, container[0].encode(), env)
    assert alone.returncode == Exit.REQUEST and hookcheck.one_clear_line(alone.stderr)
    ends_alike(refused, alone)
    assert (made.returncode, made.stderr, made.stdout) == (0, b"", b""), made.stderr
    with open(f"/proc/{container[2]}/mountinfo") as f:
        assert any(line.split()[4].endswith("/rootfs/dev/nvidia0") for line in f), "no GPU in the container"
    assert [r.get("via") for r in startservercheck.log_records(config)] == [None, "start server", "start server"]
    assert running.refusals() == []


def passing_listener(path: str, offers: list, reply: bytes) -> threading.Thread:
    """A listener of root's at path that takes one offer and answers reply: "not taken", nothing
    (b"": a server stopped with the offer queued), or "taken" too late (b"late": once the
    pre-filter's wait for it is over). offers gets (the offer, how many descriptors came with it,
    what came after a late "taken": b"" when the pre-filter had closed, never "go")."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)

    def answer():
        with listener:
            conn, _ = listener.accept()
        with conn:
            fds = array.array("i")
            data, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(8 * fds.itemsize))
            for _, _, more in ancillary:
                fds.frombytes(more[: len(more) - len(more) % fds.itemsize])
            for fd in fds:
                os.close(fd)
            after = b""
            if reply == b"late":
                time.sleep(2 * prefilter_rule.START_SERVER_TAKE_MS / 1000)
                try:
                    conn.send(b"a")
                    conn.settimeout(60)
                    after = conn.recv(16)
                except OSError:
                    after = b""
            elif reply:
                conn.send(reply)
            offers.append((data, len(fds), after))

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("listener", ["no-socket", "stale-socket", "not-taken", "no-answer", "late-taken"])
def test_a_start_no_server_takes_is_the_python_hooks(offering, server_place, host, tmp_path, listener):
    """No socket, a socket no one listens on (a server killed), a server that answers "not
    taken", closes without a word, or says "taken" only after the pre-filter's wait for it: the
    start is the Python hook's, from the state's first byte, as without a server. The offer came
    with no descriptor, and a late "taken" is never answered "go"."""
    program, env = offering
    path = socket_of(server_place)
    config = startservercheck.config(host, tmp_path)
    data = startservercheck.gpu_error_state(tmp_path)
    offers = []
    try:
        if listener == "stale-socket":
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stale:
                stale.bind(path)
        elif listener in ("not-taken", "no-answer", "late-taken"):
            reply = {"not-taken": b"p", "no-answer": b"", "late-taken": b"late"}[listener]
            thread = passing_listener(path, offers, reply)
        alone = startservercheck.python_hook(config, data)
        fronted = startservercheck.run(program, config, data, env)
    finally:
        if os.path.lexists(path):
            os.unlink(path)
    ends_alike(fronted, alone)
    assert [r.get("via") for r in startservercheck.log_records(config)] == [None, None]
    if listener in ("not-taken", "no-answer", "late-taken"):
        thread.join(60)
        assert offers == [(startservercheck.payload("--config", config, "prestart"), 0, b"")]


@pytest.mark.another_user  # runs a program as uid 65534: tests/test_checkout_location.py
def test_a_prefilter_not_run_as_root_never_offers(server_place, tmp_path):
    """Rootless: with the server's socket open to all, a pre-filter run as uid 65534 still goes
    straight to its Python hook; the server sees no connection (it says every offer it refuses)."""
    top = tempfile.mkdtemp(prefix="ogh-nobody-", dir="/tmp")  # all may read it: nobody runs it
    path = socket_of(server_place)
    try:
        os.chmod(top, 0o755)
        hook = os.path.join(top, "python-hook")
        with open(hook, "w") as f:
            f.write("#!/bin/sh\ncat > /dev/null\nexit 42\n")
        os.chmod(hook, 0o755)
        program = prefilter.build(os.path.join(top, "prefilter"), hook, start_server=path, flags=STRICT)
        bundle = os.path.join(top, "bundle")
        os.mkdir(bundle, 0o755)
        place_config(bundle, prefilter_corpus.config_bytes(prefilter_corpus.config(["NVIDIA_VISIBLE_DEVICES=0"])))
        os.chmod(os.path.join(bundle, "config.json"), 0o644)
        data = prefilter_corpus.expanded(prefilter_corpus.STATE, bundle)
        os.chmod(server_place, 0o711)
        os.chmod(os.path.dirname(path), 0o755)
        with startservercheck.started(path, tmp_path / "server.log") as running:
            os.chmod(path, 0o666)
            done = subprocess.run([program, "prestart"], input=data, capture_output=True, user=NOBODY,
                                  group=NOBODY, extra_groups=[], env=startservercheck.ENV, timeout=60)  # fmt: skip
            log = running.log()
    finally:
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(server_place, 0o700)
        shutil.rmtree(top)
    assert (done.returncode, done.stderr) == (DEFERRED, b""), done.stderr
    assert [line.startswith(startservercheck.LISTENING) for line in log] == [True], log


NOBODY_LISTENS = """
import array, json, os, socket, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(sys.argv[1])
listener.listen(8)
print("ready", flush=True)
got = []
while True:
    conn, _ = listener.accept()
    with conn:
        fds = array.array("i")
        data, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(8 * fds.itemsize))
        if data == b"done":
            break
        for _, _, more in ancillary:
            fds.frombytes(more[: len(more) - len(more) % fds.itemsize])
        got.append([len(data), len(fds)])
        for fd in fds:
            os.close(fd)
print(json.dumps(got), flush=True)
"""


@pytest.mark.another_user  # runs a program as uid 65534: tests/test_checkout_location.py
def test_a_listener_that_is_not_root_is_offered_nothing(offering, server_place, host, tmp_path):
    """A process of uid 65534 listening at the server's path (its directory made that user's):
    the pre-filter sees the peer is not root and runs Python; the listener gets no byte and no
    descriptor (the state and the runtime's stdout and stderr stay with root)."""
    program, env = offering
    path = socket_of(server_place)
    config = startservercheck.config(host, tmp_path)
    data = startservercheck.gpu_error_state(tmp_path)
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    os.chmod(server_place, 0o711)
    os.chown(os.path.dirname(path), NOBODY, NOBODY)
    try:
        listener = subprocess.Popen([python, "-I", "-c", NOBODY_LISTENS, path], stdout=subprocess.PIPE, cwd="/",
                                    user=NOBODY, group=NOBODY, extra_groups=[])  # fmt: skip
        try:
            assert listener.stdout.readline() == b"ready\n"
            alone = startservercheck.python_hook(config, data)
            fronted = startservercheck.run(program, config, data, env)
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as done:
                done.connect(path)
                done.send(b"done")
            got = json.loads(listener.communicate(timeout=60)[0])
        finally:
            if listener.poll() is None:
                listener.kill()
                listener.wait()
    finally:
        if os.path.lexists(path):
            os.unlink(path)
        os.chown(os.path.dirname(path), 0, 0)
        os.chmod(server_place, 0o700)
    ends_alike(fronted, alone)
    assert all(entry == [0, 0] for entry in got), f"the listener got {got} (bytes, descriptors)"


def test_a_worker_killed_before_its_verdict_is_one_line_and_exit_70(offering, server_place, host, tmp_path):
    """Once offered, a start never goes to Python too (the worker may have changed the container):
    a worker that ends without replying leaves the pre-filter its one line, and EX_SOFTWARE."""
    program, env = offering
    with startservercheck.started(socket_of(server_place), tmp_path / "server.log") as running:
        with startservercheck.stalled_start(program, host, tmp_path, running, env) as (offered, worker, _):
            os.kill(worker, signal.SIGKILL)
            out, err = offered.communicate(timeout=60)
        running.wait_for(f"oci-gpu-hook start-server: worker {worker} was killed by signal {signal.SIGKILL:d}")
    assert (offered.returncode, out) == (Exit.INTERNAL, b"")
    assert err == (b"oci-gpu-hook: the start server's worker ended without a verdict (killed?); the server's log "
                   b"says why (journalctl -u oci-gpu-hook-start.service)\n")  # fmt: skip
