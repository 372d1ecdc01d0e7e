"""`oci-gpu-hook exporter` as a program, on a simulated host whose NVML values the tests set:
the DCGM names and labels, the container holding each device, per-container memory from NVML's
process lists, the hook's counters, and every fault (NVML failing or missing, garbage records,
a container that is gone, a port in use) met with one line and an endpoint that keeps serving."""

import os
import socket
import subprocess
import time
import urllib.error
import urllib.request

import hookcheck
import pytest
from servicecheck import ANNOTATIONS, Exporter, start_gpu_container, values

from oci_gpu_hook.node import gates
from oci_gpu_hook.start import container_record, pids, settings
from oci_gpu_hook.toolkit.containers import hook_command
from oci_gpu_hook.toolkit.simulate import control

pytestmark = [pytest.mark.host(gpus=2, mig=[1], needs=("pynvml", "prometheus_client")),
              pytest.mark.usefixtures("fresh_nvml_values")]  # fmt: skip

MIB = 1 << 20


@pytest.fixture
def exporter(host, tmp_path):
    started = []

    def start(config=None, open_files=None, listen="127.0.0.1", args=()):
        e = Exporter(config or f"{host['root']}/config.yaml", tmp_path, open_files, listen, args=args)
        started.append(e)
        return e

    yield start
    for e in started:
        e.stop()


def test_device_metrics_carry_the_holding_containers_names(host, exporter, live_container):
    gpu0, gpu1 = host["gpus"]
    container_id, pid = start_gpu_container(live_container, host, "0", ANNOTATIONS)
    host_process = subprocess.Popen(["sleep", "60"])  # the root cgroup: nobody's container
    try:
        control.write(
            host["root"],
            {gpu0["uuid"]: {"util_gpu": 42, "util_memory": 17, "temperature": 61, "power": 123456, "sm_clock": 1305,
                            "mem_clock": 1593, "energy": 987654, "memory_used": 3000 * MIB}},
            processes=[(gpu0["uuid"], pid, 700 * MIB), (gpu0["uuid"], host_process.pid, 900 * MIB),
                       (gpu1["mig"][0]["uuid"], pid, 5 * MIB)],
        )  # fmt: skip
        e = exporter()
        samples = e.scrape()
        text = e.text()
    finally:
        host_process.kill()
        host_process.wait()
    # pci_bus_id as NVML writes it: an eight-digit domain (the host's summary has sysfs's four)
    held = {"gpu": "0", "UUID": gpu0["uuid"], "device": "nvidia0", "pod": "pod-a", "namespace": "team",
            "container": "cuda", "pci_bus_id": "0000" + gpu0["bus_id"],
            "DCGM_FI_DRIVER_VERSION": host["driver_version"]}  # fmt: skip
    expected = {"DCGM_FI_DEV_GPU_UTIL": 42, "DCGM_FI_DEV_MEM_COPY_UTIL": 17, "DCGM_FI_DEV_GPU_TEMP": 61,
                "DCGM_FI_DEV_POWER_USAGE": 123.456, "DCGM_FI_DEV_SM_CLOCK": 1305, "DCGM_FI_DEV_MEM_CLOCK": 1593,
                # prometheus_client's parser adds _total to a counter's samples; DCGM's name has none (below)
                "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total": 987654, "DCGM_FI_DEV_FB_USED": 3000,
                # free is what neither the processes nor the driver (reserved: 384 MiB by default) hold
                "DCGM_FI_DEV_FB_FREE": (gpu0["model"]["memory_total"] >> 20) - 3000 - 384,
                "DCGM_FI_DEV_FB_RESERVED": 384}  # fmt: skip
    for name, value in expected.items():
        assert values(samples, name, **held) == [value], name
    assert "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n" in text
    assert "\nDCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{" in text and "_CONSUMPTION_total" not in text
    (labels,) = [ls for n, ls, v in samples if n == "DCGM_FI_DEV_FB_USED" and ls.get("pod") == "pod-a"]
    assert labels["modelName"] == gpu0["model"]["name"]
    assert labels["Hostname"] == socket.gethostname()
    # GPU 1 is not held: its series have empty container labels; its MIG devices carry their profile.
    (free,) = [ls for n, ls, v in samples if n == "DCGM_FI_DEV_FB_USED" and ls["gpu"] == "1" and "GPU_I_ID" not in ls]
    assert (free["pod"], free["namespace"], free["container"]) == ("", "", "")
    mig_series = [ls for n, ls, v in samples if n == "DCGM_FI_DEV_FB_FREE" and "GPU_I_ID" in ls]
    assert sorted(ls["GPU_I_ID"] for ls in mig_series) == sorted(str(m["gi"]) for m in gpu1["mig"])
    assert all(ls["UUID"] == gpu1["uuid"] for ls in mig_series)  # DCGM's: the GPU's UUID
    # Per container: its own process only (not the host's, not what it would use elsewhere unrecorded).
    assert values(samples, "oci_gpu_hook_container_gpu_memory_used_bytes", container_id=container_id,
                  UUID=gpu0["uuid"], pod="pod-a") == [700 * MIB]  # fmt: skip
    per_container = values(samples, "oci_gpu_hook_container_gpu_memory_used_bytes")
    assert sorted(per_container) == [5 * MIB, 700 * MIB]  # the MIG process is its cgroup's too
    assert values(samples, "oci_gpu_hook_gpu_facts_stale") == [0]
    assert values(samples, "oci_gpu_hook_gpu_containers") >= [1]


def test_a_deleted_containers_labels_are_gone_at_the_next_scrape(host, exporter, live_container):
    container_id, pid = start_gpu_container(live_container, host, "1", ANNOTATIONS)
    e = exporter()
    assert values(e.scrape(), "DCGM_FI_DEV_GPU_TEMP", pod="pod-a", gpu="1") == [33]
    os.kill(pid, 9)
    # The fixture reaps its holder only at teardown: until then a zombie, which runs nothing.
    deadline = time.monotonic() + 10
    while pids.start_ticks(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    samples = e.scrape()
    assert [ls for n, ls, v in samples if ls.get("pod") == "pod-a"] == []
    assert values(samples, "DCGM_FI_DEV_GPU_TEMP", gpu="1") == [33]
    assert container_record.file_name(container_id) not in os.listdir(f"{host['root']}/containers")


def test_the_hooks_counters(host, exporter, live_container):
    e = exporter()
    before = e.scrape()
    start_gpu_container(live_container, host, "0")
    state, bundle, pid, cgroup, _ = live_container({"NVIDIA_VISIBLE_DEVICES": "9"})
    assert hookcheck.run_hook(f"{host['root']}/config.yaml", state).returncode == 5
    after = e.scrape()

    def delta(name, **labels):
        return sum(values(after, name, **labels)) - sum(values(before, name, **labels))

    assert delta("oci_gpu_hook_gpu_container_starts_total") == 2
    assert delta("oci_gpu_hook_gpu_container_served_starts_total") == 0  # both in the hook's own process
    assert delta("oci_gpu_hook_gpu_container_failures_total", reason="request") == 1
    assert delta("oci_gpu_hook_start_duration_seconds_count") == 2
    assert delta("oci_gpu_hook_start_duration_seconds_bucket", le="+Inf") == 2
    assert delta("oci_gpu_hook_start_duration_seconds_sum") > 0
    # Counted once: the same records seen again add nothing.
    assert values(e.scrape(), "oci_gpu_hook_gpu_container_starts_total") == values(
        after, "oci_gpu_hook_gpu_container_starts_total"
    )


def test_failing_nvml_keeps_the_endpoint_serving_marked_stale(host, exporter):
    gpu0 = host["gpus"][0]
    control.write(host["root"], {gpu0["uuid"]: {"temperature": 55}})
    e = exporter()
    assert values(e.scrape(), "DCGM_FI_DEV_GPU_TEMP", gpu="0") == [55]
    control.write(host["root"], {gpu0["uuid"]: {"temperature": 99}}, fail=999)
    for _ in range(3):
        samples = e.scrape()
        assert values(samples, "oci_gpu_hook_gpu_facts_stale") == [1]
        assert values(samples, "DCGM_FI_DEV_GPU_TEMP", gpu="0") == [55]  # the last facts read
    control.write(host["root"], {gpu0["uuid"]: {"temperature": 70}})
    samples = e.scrape()
    assert values(samples, "oci_gpu_hook_gpu_facts_stale") == [0]
    assert values(samples, "DCGM_FI_DEV_GPU_TEMP", gpu="0") == [70]
    # (the XID thread says its own NVML trouble, once, as "XID counts: ...")
    lines = [line for line in e.output().splitlines() if "NVML" in line and "XID counts:" not in line]
    assert len(lines) == 2 and "Unknown Error" in lines[0] and "stale" in lines[0] and "again" in lines[1]
    assert "Traceback" not in e.output()


def test_missing_nvml_keeps_the_endpoint_serving(host, exporter, tmp_path):
    config = hookcheck.config_with(
        host, tmp_path, f'proc_root: "{tmp_path}/no-driver"\ninventory_cache: "{tmp_path}/no-driver-cache.json"\n'
    )
    e = exporter(config)
    samples = e.scrape()
    assert values(samples, "oci_gpu_hook_gpu_facts_stale") == [1]
    assert values(samples, "DCGM_FI_DEV_GPU_TEMP") == []
    (line,) = [line for line in e.output().splitlines() if "GPU inventory" in line]
    assert "/proc/driver/nvidia" in line and "Traceback" not in e.output()


def test_garbage_records_are_logged_once_and_removed(host, exporter):
    """Garbage in a file of the hook's own (a file it did not write is refused before it is
    parsed: tests/security/test_untrusted_records.py)."""
    directory = f"{host['root']}/containers"
    os.makedirs(directory, mode=0o700, exist_ok=True)
    settings.write_trusted(f"{directory}/garbage.json", b"{not json")
    e = exporter()
    e.scrape()
    e.scrape()
    assert not os.path.exists(f"{directory}/garbage.json")
    assert [line for line in e.output().splitlines() if "garbage.json" in line] == [
        f"oci-gpu-hook exporter: {directory}/garbage.json: not a container record; removed"
    ]


def test_a_port_in_use_is_one_line_and_an_exit(host):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        argv = [*hook_command(f"{host['root']}/config.yaml"), "exporter", "--listen", f"127.0.0.1:{port}"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.splitlines()[-1] == f"oci-gpu-hook: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("listen", ["9400", "host:", ":0", ":70000", "a:b"])
def test_a_bad_listen_address_is_one_line(host, listen):
    done = subprocess.run([*hook_command(f"{host['root']}/config.yaml"), "exporter", "--listen", listen],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and "--listen" in done.stderr


def test_text_from_a_container_cannot_take_the_page_down(host, exporter, live_container):
    """Annotations are the container creator's text: a lone surrogate (JSON's \\ud800) could not be
    encoded and emptied every reply while the container ran; controls and quotes could break the
    format. Each is rendered printable, and the page parses."""
    hostile = {"io.kubernetes.cri.sandbox-name": "pod\ud800", "io.kubernetes.cri.sandbox-namespace": 'ns"\n}x 1',
               "io.kubernetes.cri.container-name": "c\x1b[2J\udfff"}  # fmt: skip
    container_id, pid = start_gpu_container(live_container, host, "0", hostile)
    control.write(host["root"], processes=[(host["gpus"][0]["uuid"], pid, 700 * MIB)])
    e = exporter()
    samples = e.scrape()
    assert values(samples, "oci_gpu_hook_container_gpu_memory_used_bytes", container_id=container_id,
                  pod="pod\\ud800", namespace='ns"\\n}x 1', container="c\\x1b[2J\\udfff") == [700 * MIB]  # fmt: skip
    assert values(samples, "oci_gpu_hook_gpu_facts_stale") == [0]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_connections_cannot_stop_the_endpoint(host, exporter):
    """A thousand idle TCP clients against an exporter short of descriptors (64): it used to give
    each a thread with no timeout until EMFILE, then stop answering and spin on accept. Now the
    oldest idle ones are closed to make room, /metrics answers meanwhile, and the process idles."""
    e = exporter(open_files=64)
    clients = []
    try:
        for _ in range(1000):
            client = socket.socket()
            client.setblocking(False)
            client.connect_ex(("127.0.0.1", e.port))
            clients.append(client)
        assert "DCGM_FI_DEV_FB_USED" in e.text()
        assert e.proc.poll() is None
        time.sleep(2)  # the rest of the flood is accepted (and the oldest closed) meanwhile
        before = _cpu_seconds(e.proc.pid)
        time.sleep(3)
        # Idle while the clients stay: no busy loop on a full table or on EMFILE (one that spins
        # uses all 3 s; a loaded CI machine gives it less, never more).
        assert _cpu_seconds(e.proc.pid) - before < 1.5
        assert "DCGM_FI_DEV_FB_USED" in e.text()
    finally:
        for client in clients:
            client.close()
    assert "closing the oldest idle connections to keep answering" in e.output()
    assert "Traceback" not in e.output()


def test_a_client_that_never_finishes_its_request_is_closed(host, exporter):
    """Each client has REQUEST_TIMEOUT seconds to send its request and read the reply; headers past
    MAX_REQUEST_BYTES are refused at once; only GET and HEAD are answered."""
    from oci_gpu_hook.node import scrape_server

    e = exporter()
    with socket.create_connection(("127.0.0.1", e.port), timeout=60) as slow:
        slow.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the blank line
        assert slow.recv(1) == b""  # closed by the server (before this socket's own 60 s)
    with socket.create_connection(("127.0.0.1", e.port), timeout=60) as big:
        big.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (2 * scrape_server.MAX_REQUEST_BYTES))
        assert big.recv(64).startswith(b"HTTP/1.1 431 ")
    with socket.create_connection(("127.0.0.1", e.port), timeout=60) as post:
        post.sendall(b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        assert post.recv(64).startswith(b"HTTP/1.1 405 ")
    assert "DCGM_FI_DEV_FB_USED" in e.text()


def test_many_scrapes_at_once_each_get_the_whole_page_and_head_renders_none(host, exporter):
    """Requests that arrive together share one render (each gets all of it); HEAD answers with
    the last page's length and no body, and never makes the exporter read NVML."""
    e = exporter()
    clients = [socket.create_connection(("127.0.0.1", e.port), timeout=60) for _ in range(40)]
    for client in clients:
        client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    pages = []
    for client in clients:
        data = b""
        while chunk := client.recv(65536):
            data += chunk
        client.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and b"DCGM_FI_DEV_FB_USED" in body
        assert f"Content-Length: {len(body)}".encode() in head
        pages.append(body)
    with socket.create_connection(("127.0.0.1", e.port), timeout=60) as client:
        client.sendall(b"HEAD /metrics HTTP/1.1\r\n\r\n")
        data = b""
        while chunk := client.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert body == b"" and f"Content-Length: {len(pages[-1])}".encode() in head


def test_a_changed_host_is_noticed(tmp_path, require):
    """The exporter follows the host as the inventory cache does (issue 32): a GPU gone (its node
    removed) is gone from the next scrape, NVML started afresh; a new driver (another NVML library,
    which a process cannot unload) ends the process with status 75 and one line, for systemd or
    Kubernetes to start it again, and the new process serves the new host."""
    require("root", "gcc", "pynvml", "prometheus_client")
    from oci_gpu_hook.node.nvml_reader import RESTART
    from oci_gpu_hook.toolkit.simulate import simulate

    root = str(tmp_path / "host")
    host = simulate(root, gpus=2)
    e = Exporter(f"{root}/config.yaml", tmp_path)
    try:
        assert len(values(e.scrape(), "DCGM_FI_DEV_GPU_TEMP")) == 2
        os.unlink(f"{root}/dev/nvidia{host['gpus'][1]['minor']}")
        gpus = [ls["UUID"] for n, ls, v in e.scrape() if n == "DCGM_FI_DEV_GPU_TEMP"]
        assert gpus == [host["gpus"][0]["uuid"]]
        simulate(root, gpus=3, driver_version="555.42.02", cuda_version="12.5")
        with pytest.raises(OSError):  # the reply never comes: the process ends
            e.text()
        assert e.proc.wait(timeout=60) == RESTART
        assert "the NVIDIA driver changed (550.54.15 -> 555.42.02" in e.output()
    finally:
        e.stop()
    again = Exporter(f"{root}/config.yaml", tmp_path)
    try:
        assert len(values(again.scrape(), "DCGM_FI_DEV_GPU_TEMP")) == 3
    finally:
        again.stop()


def _ask(port: int, request: bytes, host: str = "127.0.0.1") -> tuple:
    """Send one request and read the whole reply: (status line, head, body)."""
    with socket.create_connection((host, port), timeout=60) as client:
        client.sendall(request)
        data = b""
        while chunk := client.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0], head, body


def _send_all(port: int, requests: list) -> list:
    """Every request on a connection of its own, all sent before any reply is read (so that they
    reach the server together), then each whole reply: [(status line, head, body)]."""
    clients = []
    try:
        for request in requests:
            client = socket.create_connection(("127.0.0.1", port), timeout=60)
            clients.append(client)
            client.sendall(request)
        replies = []
        for client in clients:
            data = b""
            while chunk := client.recv(65536):
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            replies.append((head.split(b"\r\n", 1)[0], head, body))
        return replies
    finally:
        for client in clients:
            client.close()


def _whole_page(reply) -> bool:
    status, head, body = reply
    return (status.startswith(b"HTTP/1.1 200 ") and f"Content-Length: {len(body)}".encode() in head
            and b"DCGM_FI_DEV_FB_USED" in body and body.endswith(b"\n"))  # fmt: skip


def test_a_clients_bad_request_never_becomes_anothers_reply(host, exporter):
    """Round 4, class 3 (poisoning): the reply was shared by request line, but it depended on the
    headers too. Clients sending Prometheus's own line with an 8.3 KB header got 431, and so did
    the real scrapes that completed in the same turn. Now every request is checked on its own and
    only a rendered page is shared: each real scrape gets the whole page, each oversized one 431."""
    from oci_gpu_hook.node import scrape_server

    e = exporter()
    pad = b"a" * (scrape_server.MAX_REQUEST_BYTES + 100 - 40)
    oversized = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + pad + b"\r\n\r\n"
    assert scrape_server.MAX_REQUEST_BYTES < len(oversized) < 2 * scrape_server.MAX_REQUEST_BYTES
    scrape = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: text/plain\r\n\r\n"
    for _ in range(3):
        # Each oversized request is read over three turns of the server's loop, a real scrape in
        # one: spread out so that each turn completes some of both.
        requests = [oversized if i % 2 else scrape for i in range(96)]
        replies = _send_all(e.port, requests)
        scrapes = [r for q, r in zip(requests, replies) if q is scrape]
        refused = [r for q, r in zip(requests, replies) if q is oversized]
        assert [r[0] for r in scrapes if not _whole_page(r)] == []
        assert {r[0] for r in refused} == {b"HTTP/1.1 431 Request Header Fields Too Large"}
    assert "Traceback" not in e.output()


def _renders(e) -> float:
    (count,) = values(e.scrape(), "oci_gpu_hook_exporter_renders_total")
    return count


def test_query_strings_cannot_make_the_exporter_render_more(host, exporter):
    """Round 4, class 3 (amplification): a query string made every request a render of its own
    (`GET /metrics?<n>`: a real scrape's median went from 37 ms to 390 ms). The page does not
    depend on the query string, so it is not part of the key; and a rendered page is reused for
    REUSE_SECONDS, so renders are bounded per second whatever the requests. Counted with the
    exporter's own counter of renders; the bound follows from the elapsed time (k renders are at
    least REUSE_SECONDS apart), so a slow machine loosens it and never fails it."""
    from oci_gpu_hook.node import scrape_server

    e = exporter()
    started = time.monotonic()
    before = _renders(e)
    n = 0
    for _ in range(15):
        requests = [f"GET /metrics?{n + i} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for i in range(10)]
        requests.append(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # a real scrape among them
        n += 10
        replies = _send_all(e.port, requests)
        assert [r[0] for r in replies if not _whole_page(r)] == []
    after = _renders(e)
    elapsed = time.monotonic() - started
    assert 1 <= after - before <= elapsed / scrape_server.REUSE_SECONDS + 1, (after - before, elapsed)


def test_every_address_is_ipv6_and_ipv4(host, exporter, require):
    """Round 4, class 9: `:PORT` (the default, `:9400`) listened on every IPv4 address only, unlike
    DCGM's exporter: a node reached over IPv6 could not be scraped. An empty host is now one IPv6
    socket with IPV6_V6ONLY off, whatever net.ipv6.bindv6only says: both families answer."""
    require("ipv6")
    e = exporter(listen="")
    for address in ("127.0.0.1", "::1"):
        reply = _ask(e.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", address)
        assert _whole_page(reply), (address, reply[0])
    assert f"serving /metrics on :{e.port}" in e.output()


def test_starts_a_start_servers_worker_ran_are_counted_apart():
    """A record says which path ran its start ("via", the start server's workers'; the hook's own
    process writes none): the served ones are counted in their own counter, each record once."""
    from oci_gpu_hook.node.metrics import StartCounters

    record = {"outcome": "started", "duration_seconds": 0.01, "reason": None}
    records = {"a": dict(record, time=1.0, via="start server"), "b": dict(record, time=2.0, via=None),
               "c": dict(record, time=3.0)}  # fmt: skip
    counters = StartCounters()
    counters.observe(records)
    counters.observe(records)
    got = {f.name: f for f in counters.families()}
    assert [v for _, _, v in got["oci_gpu_hook_gpu_container_served_starts_total"].samples] == [1]
    assert [v for _, _, v in got["oci_gpu_hook_gpu_container_starts_total"].samples] == [3]


def test_a_gpu_without_gpm_has_no_profiling_series_and_says_so_once(host, exporter):
    """The A100s here predate GPM (Hopper): no DCGM_FI_PROF_* series, never a made-up zero, and one
    line per GPU in the log however many scrapes (test_exporter_fields.py has an H100 with GPM)."""
    e = exporter()
    for _ in range(2):
        samples = e.scrape()
        time.sleep(1.1)
    assert [n for n, ls, v in samples if n.startswith("DCGM_FI_PROF_")] == []
    said = [line for line in e.output().splitlines() if "has no GPM" in line]
    assert sorted(line.split(" (")[0].split()[-1] for line in said) == ["0", "1"], said
    assert all("no DCGM_FI_PROF_* series" in line for line in said)


def test_ready_waits_on_every_gate_and_the_index_does_not(host, exporter, tmp_path):
    """--gate: /ready (the readiness probe's) is 503 with the line of the gate it waits on until
    gate toolkit and gate plugin passed, and again when one fails; a gates' file that is not
    root's alone is no verdict. / (liveness) answers 200 all along: a pending gate is no reason
    to restart it. Gate (d) of issue 47: the exporter is a Service endpoint only on a validated node."""
    gate = tmp_path / "run" / "gates.json"
    e = exporter(args=["--gate", str(gate)])

    def get(path: str) -> tuple:
        from oci_gpu_hook.node.scrape_server import REUSE_SECONDS

        time.sleep(REUSE_SECONDS + 0.1)  # an answer is reused for that long, as pages are
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{e.port}{path}", timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    assert get("/ready") == (503, "waiting: gate toolkit pending\n")
    gates.write(str(gate), {"toolkit": gates.verdict("passed")})
    assert get("/ready") == (503, "waiting: gate plugin pending\n")
    gates.write(str(gate), {"toolkit": gates.verdict("passed"), "plugin": gates.verdict("passed")})
    assert get("/ready") == (200, "ready\n")
    assert e.text()  # the page is the page, gated or not
    broken = gates.verdict("failed", "no GPU in the container", "install again")
    gates.write(str(gate), {"toolkit": broken, "plugin": gates.verdict("passed")})
    assert get("/ready") == (503, "waiting: gate toolkit failed: no GPU in the container (fix: install again)\n")
    gates.write(str(gate), {"toolkit": gates.verdict("passed"), "plugin": gates.verdict("passed")})
    os.chmod(gate, 0o666)
    status, body = get("/ready")
    assert status == 503 and body.startswith("waiting: the gates' verdicts cannot be trusted: "), body
    assert get("/")[0] == 200
