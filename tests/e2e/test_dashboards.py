"""The Grafana dashboards, every panel evaluated against a real Prometheus (issue 49, items 5 and 6):
ours (deploy/monitoring/dashboards/oci-gpu-hook.json) and NVIDIA's dcgm-exporter dashboard
(grafana.com 12239, ../shared/reference/dcgm-exporter/).

A cluster of three simulated GPU nodes, each with its own exporter running as a program under its
own host name (a UTS namespace of its own): A100s with one GPU in MIG mode, T4s time-sliced two
ways, H100s with GPM. Real runc containers get their GPUs from the hook, with the annotations a
Kubernetes runtime passes, two of them on one time-sliced T4; one start is refused. The simulated
NVML is given live values (power, temperature, utilization, each container's memory and per-process
utilization, tensor activity) and an XID. One Prometheus scrapes the three exporters.

Each dashboard's template variables are substituted as Grafana does for a Prometheus data source
(query variables read through label_values; All as a regex alternation of every value, each
escaped; $__interval, $__rate_interval and $__range for a data source whose scrape interval is
1 s), and every panel target's expression is run through Prometheus's query API: an instant query,
and a range query over the test's span for a target Grafana draws over time. A target with no
data (no sample, or NaN alone) fails, named by its panel's title, unless docs/monitoring.md's table
of panels empty on purpose lists the panel, with why. Then the totals the panels show are checked
against the values set: each GPU once, however many containers hold it.
"""

from __future__ import annotations

import json
import math
import os
import re
import time

import nvmlevents
import pytest
from hookcheck import runc_delete, runc_detached
from servicecheck import Exporter, Prometheus
from test_docs import table_rows

from oci_gpu_hook.toolkit import containers
from oci_gpu_hook.toolkit.simulate import control

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OURS = os.path.join(REPO, "deploy", "monitoring", "dashboards", "oci-gpu-hook.json")
NVIDIA = os.path.normpath(os.path.join(REPO, "..", "shared", "reference", "dcgm-exporter",
                                       "dcgm-exporter-dashboard.json"))  # fmt: skip
MONITORING_DOC = os.path.join(REPO, "docs", "monitoring.md")
EMPTY_ON_PURPOSE = "| dashboard | panel empty on purpose | why |"  # the table's header row there

SCRAPE = 1  # s: Prometheus's scrape interval, and the data source's "Scrape interval" setting in Grafana
MAX_DATA_POINTS = 1000  # a panel about a thousand pixels wide: Grafana asks for no more points than that
GIB, MIB = 1 << 30, 1 << 20
XID = 48  # a double-bit ECC error: one of the XIDs counted from 0, so increase() sees its first


# --- Grafana's side: variables and their substitution -----------------------------------------------


def regular_escape(value: str) -> str:
    """A single-value variable's value (no multi, no includeAll), as Grafana's Prometheus data
    source escapes it."""
    return value.replace("\\", "\\\\").replace("'", "\\\\'")


def regex_escape(value: str) -> str:
    """A value of a multi-value or includeAll variable: escaped for a regular expression inside a
    PromQL string (a backslash itself doubled for the string), as Grafana does."""
    value = value.replace("\\", "\\\\\\\\")
    return re.sub(r"[$^*{}\[\]+?.()|]", lambda m: "\\\\" + m.group(0), value)


def formatted(values: list, variable: dict) -> str:
    if not variable.get("multi") and not variable.get("includeAll"):
        (value,) = values
        return regular_escape(value)
    escaped = [regex_escape(v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


REFERENCE = re.compile(r"\$\{(\w+)(:[^}]*)?\}|\[\[(\w+)\]\]|\$(\w+)")


def interpolate(text: str, values: dict) -> str:
    """$name, ${name} and [[name]] replaced by their formatted values; an unknown name or a format
    option (${name:csv}) fails, as this harness does not do what Grafana would with it."""

    def replace(m):
        name = m.group(1) or m.group(3) or m.group(4)
        if m.group(2):
            pytest.fail(f"{text!r}: variable format {m.group(2)!r} is not substituted by this test")
        if name not in values:
            pytest.fail(f"{text!r}: ${name} is no variable of the dashboard")
        return values[name]

    return REFERENCE.sub(replace, text)


def seconds(text: str) -> int:
    m = re.fullmatch(r"(\d+)s", text)
    assert m, f"an interval of whole seconds, not {text!r}"
    return int(m.group(1))


def builtins(start: float, end: float, min_interval: int = SCRAPE) -> dict:
    """Grafana's global variables for a panel over [start, end]: $__interval is the range over the
    panel's points, no less than the data source's scrape interval (or the panel's own minimum);
    $__rate_interval is max($__interval + scrape interval, 4 x scrape interval)."""
    span = end - start
    assert span < MAX_DATA_POINTS * min_interval, "a range where Grafana's interval is its minimum"
    interval = min_interval
    whole = round(span)
    return {"__interval": f"{interval}s", "__interval_ms": str(interval * 1000),
            "__rate_interval": f"{max(interval + SCRAPE, 4 * SCRAPE)}s",
            "__range": f"{whole}s", "__range_s": str(whole), "__range_ms": str(whole * 1000)}  # fmt: skip


def label_values(prometheus, query: str, start: float, end: float) -> list:
    """A query variable's options: label_values(label) or label_values(selector, label)."""
    m = re.fullmatch(r"\s*label_values\((.*)\)\s*", query, re.S)
    assert m, f"query variable {query!r}: only label_values() is evaluated here"
    selector, _, label = m.group(1).rpartition(",")
    params = {"start": start, "end": end}
    if selector.strip():
        params["match[]"] = selector.strip()
    return sorted(prometheus.api(f"label/{label.strip()}/values", **params))


def variables(dashboard: dict, prometheus, start: float, end: float, chosen: dict | None = None) -> dict:
    """{name: substituted text} for the dashboard's variables, in their order (a later one's query
    may use an earlier one): each query variable's options from Prometheus, the chosen values or
    else All (every option)."""
    chosen = chosen or {}
    values = builtins(start, end)
    for variable in dashboard["templating"]["list"]:
        name, kind = variable["name"], variable["type"]
        if kind == "datasource":
            values[name] = "prometheus"  # the data source's own reference: in no expression
            continue
        assert kind == "query", f"${name}: a {kind} variable is not evaluated by this test"
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        options = label_values(prometheus, interpolate(query, values), start, end)
        assert options, f"${name}: {query!r} has no values"
        picked = chosen.get(name, options)
        assert set(picked) <= set(options), (name, picked, options)
        assert not variable.get("allValue"), f"${name}: a custom All value is not evaluated by this test"
        values[name] = formatted(list(picked), variable)
    return values


def panels(dashboard: dict) -> list:
    """Every panel that queries, rows' collapsed panels included."""
    found = []
    for panel in dashboard["panels"]:
        found += [panel] + panel.get("panels", [])
    return [p for p in found if p.get("targets")]


def panel_named(dashboard: dict, title: str) -> dict:
    (panel,) = [p for p in panels(dashboard) if p["title"] == title]
    return panel


def has_data(result: list) -> bool:
    """Some sample that is a number: NaN alone (a quantile of no observations) draws nothing."""
    for series in result:
        points = series["values"] if "values" in series else [series["value"]]
        if any(not math.isnan(float(value)) for _, value in points):
            return True
    return False


def run_target(prometheus, panel: dict, target: dict, chosen: dict, start: float, end: float) -> dict:
    """{"instant": result, "range": result} of one target, as Grafana asks: a range query (step
    $__interval) unless the target is instant only; the instant query always, so every expression
    is known to parse."""
    minimum = seconds(panel["interval"]) if panel.get("interval") else SCRAPE
    expr = interpolate(target["expr"], dict(chosen, **builtins(start, end, minimum)))
    out = {"expr": expr, "instant": prometheus.api("query", query=expr, time=end)["result"]}
    if not (target.get("instant") and not target.get("range")):
        step = seconds(builtins(start, end, minimum)["__interval"])
        out["range"] = prometheus.api("query_range", query=expr, start=start, end=end, step=step)["result"]
    return out


def evaluate(prometheus, dashboard: dict, title: str, chosen: dict, start: float, end: float) -> list:
    panel = panel_named(dashboard, title)
    return [run_target(prometheus, panel, t, chosen, start, end) for t in panel["targets"] if not t.get("hide")]


def empty_targets(prometheus, dashboard: dict, chosen: dict, start: float, end: float) -> dict:
    """{panel title: [expressions with no data]}: an instant-only target needs data in its instant
    answer, any other in its range answer (what Grafana draws)."""
    empty = {}
    for panel in panels(dashboard):
        for target in panel["targets"]:
            if target.get("hide"):
                continue
            out = run_target(prometheus, panel, target, chosen, start, end)
            if not has_data(out.get("range", out["instant"])):
                empty.setdefault(panel["title"], []).append(out["expr"])
    return empty


def empty_on_purpose() -> dict:
    """{(dashboard title, panel title): why} from docs/monitoring.md's table of panels that stay
    empty on purpose (the one list of them: the docs say why)."""
    with open(MONITORING_DOC, encoding="utf-8") as f:
        text = f.read()
    if EMPTY_ON_PURPOSE not in text:
        pytest.fail(f"docs/monitoring.md has no table headed {EMPTY_ON_PURPOSE!r} (Dashboards section): the "
                    "panels that stay empty on purpose, and why, are listed there", pytrace=False)  # fmt: skip
    rows = table_rows(text, EMPTY_ON_PURPOSE)
    for row in rows:
        assert len(row) == 3 and all(row), f"docs/monitoring.md: a row of {EMPTY_ON_PURPOSE!r} without a why: {row}"
    return {(row[0].strip("`"), row[1].strip("`")): row[2] for row in rows}


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# --- the cluster --------------------------------------------------------------------------------------

# node: (host name, simulate's options, what the node's configuration adds to the simulated host's:
# keys of its node: section, and top-level keys)
NODES = {
    "a100": ("gpu-a100-0.cluster.example", {"gpus": 2, "mig": [1]}, {"node": ["mig_strategy: mixed"]}),
    "t4": ("gpu-t4-0.cluster.example", {"gpus": 2, "model": "t4", "driver_version": "535.183.01"},
           {"node": ["replicas: 2"], "top": ["shared_gpu_memory_limit: per-replica"]}),
    "h100": ("gpu-h100-0.cluster.example", {"gpus": 2, "model": "h100", "driver_version": "560.35.03"}, {}),
}  # fmt: skip
# Live values: {node: {GPU index: (power mW, temperature C, utilization %)}}
BOARD = {"a100": {0: (250_000, 40, 0), 1: (180_000, 50, 0)},
         "t4": {0: (70_000, 60, 70), 1: (30_000, 35, 0)},
         "h100": {0: (600_000, 55, 90), 1: (90_000, 30, 0)}}  # fmt: skip
TENSOR = 60  # % of GPM's tensor utilization on the H100 that the pod "llm" holds


def node_config(host: dict, additions: dict, path) -> str:
    """The simulated host's config.yaml with the node's own keys: a file of the test's, so the
    session's shared simulated host keeps its own configuration. Its records directory is the
    test's own too: the shared host's holds what other tests' containers left (a failed start
    there would count among this cluster's)."""
    with open(f"{host['root']}/config.yaml") as f:
        text = f.read()
    shared = f'records_directory: "{host["root"]}/containers"\n'
    assert shared in text, "simulate's config.yaml names no records directory to replace"
    text = text.replace(shared, f'records_directory: "{path.parent / (path.stem + "-records")}"\n')
    if additions.get("node"):
        assert "\nnode:\n" in text, "simulate's config.yaml has no node: section to add to"
        text = text.replace("\nnode:\n", "\nnode:\n" + "".join(f"  {line}\n" for line in additions["node"]))
    text += "".join(f"{line}\n" for line in additions.get("top", ()))
    path.write_text(text)
    return str(path)


class Cluster:
    """The nodes' simulated hosts and configurations; run() starts an exporter for each and the one
    Prometheus, stop() stops whatever started (containers included)."""

    def __init__(self, tmp_path, simulated_host):
        self.tmp_path = tmp_path
        self.hosts, self.configs, self.exporters, self.started, self.prometheus = {}, {}, {}, [], None
        for node, (_, options, additions) in NODES.items():
            host = self.hosts[node] = simulated_host(**options)
            self.configs[node] = node_config(host, additions, tmp_path / f"{node}.yaml")
        self.start = None  # when run() began: the dashboards' time range starts there

    def run(self):
        self.start = time.time()
        for node, (hostname, _, _) in NODES.items():
            self.exporters[node] = Exporter(self.configs[node], self.tmp_path, hostname=hostname)
        self.prometheus = Prometheus(self.tmp_path, [f"127.0.0.1:{e.port}" for e in self.exporters.values()],
                                     scrape=SCRAPE)  # fmt: skip

    def gpu(self, node: str, index: int) -> dict:
        return self.hosts[node]["gpus"][index]

    def pod(self, node: str, name: str, visible: str, namespace: str = "ml") -> int:
        """A container of pod `name` on the node, given `visible` (NVIDIA_VISIBLE_DEVICES); its pid."""
        container_id = f"ocigpu-dash-{os.getpid()}-{name}"
        bundle = containers.make_bundle(
            str(self.tmp_path / name), args=["busybox", "sleep", "600"], env={"NVIDIA_VISIBLE_DEVICES": visible},
            config_file=self.configs[node],
            annotations={"io.kubernetes.cri.sandbox-name": name, "io.kubernetes.cri.sandbox-namespace": namespace,
                         "io.kubernetes.cri.container-name": "main"},
        )  # fmt: skip
        self.started.append(container_id)
        return runc_detached(bundle, container_id)

    def stop(self):
        for container_id in self.started:
            runc_delete(container_id)
        if self.prometheus is not None:
            self.prometheus.stop()
        for exporter in self.exporters.values():
            exporter.stop()
        for host in self.hosts.values():
            control.clear(host["root"])
            nvmlevents.clear_events(host["root"])


@pytest.fixture(scope="module")
def cluster(simulated_host, require, tmp_path_factory):
    require("root", "gcc", "runc", "busybox", "pynvml", "prometheus", NVIDIA)
    cluster = Cluster(tmp_path_factory.mktemp("dashboards"), simulated_host)
    try:
        cluster.run()
        prometheus = cluster.prometheus
        # Every exporter scraped before any container starts: the hook's counters are seen at 0 first,
        # so their increase and rate see the starts.
        prometheus.wait_for(f"count(up == 1) == {len(NODES)}")
        for exporter in cluster.exporters.values():  # the XID thread waits on NVML's events
            prometheus.wait_until(lambda e=exporter: "XID counts: waiting on NVML events" in e.output(),
                                  "the exporters' XID threads")  # fmt: skip
        a100_mig = cluster.gpu("a100", 1)["mig"][0]["uuid"]  # 3g.20gb
        pids = {
            "trainer": cluster.pod("a100", "trainer", "0"),  # a whole A100, idle
            "notebook": cluster.pod("a100", "notebook", a100_mig, namespace="lab"),
            "infer-1": cluster.pod("t4", "infer-1", "0"),  # two pods time-slicing one T4
            "infer-2": cluster.pod("t4", "infer-2", "0"),
            "llm": cluster.pod("h100", "llm", "0"),
        }
        with pytest.raises(RuntimeError):  # no GPU 7 there: the hook refuses the start (reason "request")
            cluster.pod("a100", "refused", "7")
        t4, h100 = cluster.gpu("t4", 0)["uuid"], cluster.gpu("h100", 0)["uuid"]
        memory = {
            "a100": [(cluster.gpu("a100", 0)["uuid"], pids["trainer"], 1 * GIB), (a100_mig, pids["notebook"], 2 * GIB)],
            "t4": [(t4, pids["infer-1"], 3 * GIB), (t4, pids["infer-2"], 5 * GIB)],
            "h100": [(h100, pids["llm"], 20 * GIB)],
        }  # fmt: skip
        utilization = {"t4": [(t4, pids["infer-1"], 30, 10, 0, 0), (t4, pids["infer-2"], 40, 20, 0, 0)],
                       "h100": [(h100, pids["llm"], 90, 50, 0, 0)]}  # fmt: skip
        for node, gpus in BOARD.items():
            devices = {cluster.gpu(node, i)["uuid"]: {"power": p, "temperature": t, "util_gpu": u}
                       for i, (p, t, u) in gpus.items()}  # fmt: skip
            if node == "h100":
                devices[h100]["gpm_tensor_util"] = TENSOR
            control.write(cluster.hosts[node]["root"], devices, processes=memory[node],
                          process_utilization=utilization.get(node, ()))  # fmt: skip
        nvmlevents.inject_xid(cluster.hosts["t4"]["root"], t4, XID)
        # Everything set is in Prometheus before a panel is asked.
        for expr in ("count(oci_gpu_hook_container_gpu_allocated) == 5",
                     "count(oci_gpu_hook_container_gpu_memory_used_bytes > 0) == 5",
                     'count(oci_gpu_hook_container_gpu_utilization_percent{engine="sm"} > 0) == 3',
                     f"DCGM_FI_PROF_PIPE_TENSOR_ACTIVE == {TENSOR / 100}",
                     f'sum(oci_gpu_hook_gpu_xid_errors_total{{xid="{XID}"}}) == 1',
                     'sum(oci_gpu_hook_gpu_container_failures_total{reason="request"}) == 1',
                     f"sum(DCGM_FI_DEV_POWER_USAGE) == {watts(*BOARD.values())}"):  # fmt: skip
            prometheus.wait_for(expr)
        # And scraped for longer than $__rate_interval, as a dashboard looked at a little later
        # sees it: a rate needs two samples in its window, a graph a few points to draw.
        prometheus.wait_for(f"min(count_over_time(oci_gpu_hook_container_gpu_allocated[1m])) > {4 * SCRAPE + 1}")
        yield cluster
    finally:
        cluster.stop()


def span(cluster) -> tuple:
    return cluster.start, time.time()


# --- the harness's own rules, against what Grafana sends --------------------------------------------


def test_values_are_escaped_and_joined_as_grafana_does():
    multi = {"multi": True, "includeAll": True}
    assert formatted(["127.0.0.1:9400"], multi) == r"127\\.0\\.0\\.1:9400"
    assert formatted(["a|b", "c"], multi) == r"(a\\|b|c)"
    assert formatted(["x\\y"], multi) == "x\\\\\\\\y"
    assert formatted(["gpu-t4.cern.ch"], {"multi": False}) == "gpu-t4.cern.ch"
    values = {"node": "(a|b)", "__rate_interval": "4s"}
    assert interpolate('rate(x{n=~"$node"}[$__rate_interval]) + y{n=~"${node}"} + [[node]]', values) == (
        'rate(x{n=~"(a|b)"}[4s]) + y{n=~"(a|b)"} + (a|b)'
    )
    assert builtins(100, 130)["__rate_interval"] == "4s" and builtins(100, 130)["__range"] == "30s"


def test_both_dashboards_take_their_data_source_from_a_variable():
    for path in (OURS, NVIDIA):
        if not os.path.exists(path):
            continue
        dashboard = load(path)
        (source,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
        assert source["query"] == "prometheus"
        for panel in panels(dashboard):
            for where in [panel] + panel["targets"]:
                uid = where.get("datasource")
                uid = uid.get("uid") if isinstance(uid, dict) else uid
                assert uid in (None, "$datasource", "${datasource}"), (path, panel["title"], uid)


def test_our_dashboard_is_for_a_current_grafana():
    dashboard = load(OURS)
    assert dashboard["schemaVersion"] >= 39 and dashboard["uid"] == "oci-gpu-hook"
    titles = [p["title"] for p in panels(dashboard)]
    assert len(titles) == len(set(titles)), "panel titles name the panels in the docs and in this test's failures"
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "node", "model", "mechanism"}


# --- every panel, through Prometheus ------------------------------------------------------------------


@pytest.mark.parametrize("path", [OURS, NVIDIA], ids=["ours", "nvidia-12239"])
def test_every_panel_has_data_unless_the_docs_say_why(cluster, path):
    dashboard = load(path)
    allowed = {panel: why for (title, panel), why in empty_on_purpose().items() if title == dashboard["title"]}
    start, end = span(cluster)
    chosen = variables(dashboard, cluster.prometheus, start, end)
    empty = empty_targets(cluster.prometheus, dashboard, chosen, start, end)
    titles = {p["title"] for p in panels(dashboard)}
    unknown = set(allowed) - titles
    assert not unknown, f"docs/monitoring.md lists panels that {dashboard['title']!r} lacks: {unknown}"
    unexplained = {title: exprs for title, exprs in empty.items() if title not in allowed}
    assert not unexplained, "panels with no data: " + "; ".join(f"{t!r}: {e}" for t, e in unexplained.items())
    filled = set(allowed) - set(empty)
    assert not filled, f"docs/monitoring.md lists as empty on purpose panels that have data: {filled}"


def test_a_variable_picks_what_it_names(cluster):
    """The node, model and mechanism chosen narrow every panel to them: a T4 node's GPUs alone."""
    dashboard = load(OURS)
    start, end = span(cluster)
    t4 = NODES["t4"][0]
    chosen = variables(dashboard, cluster.prometheus, start, end, {"node": [t4]})
    assert chosen["model"] == r"Tesla T4" and chosen["mechanism"] == r"time-sliced"
    (result,) = evaluate(cluster.prometheus, dashboard, "Power by node", chosen, start, end)
    assert [s["metric"]["Hostname"] for s in result["instant"]] == [t4]


# --- the totals the panels show: each GPU once (item 6) ---------------------------------------------


def instant_values(results: list, *labels: str) -> dict:
    """{(label values...): value} of a panel's targets' instant answers."""
    return {tuple(s["metric"].get(k, "") for k in labels): float(s["value"][1]) for r in results for s in r["instant"]}


def single(results: list) -> float:
    (value,) = instant_values(results).values()
    return value


def watts(*boards) -> float:
    return sum(power for board in boards for power, _, _ in board.values()) / 1000


def test_nvidias_power_total_and_average_temperature_count_each_gpu_once(cluster):
    """12239's gauges over all nodes and over the T4 node, where two containers hold one GPU: the
    sum of the power set for each GPU, and the mean of their temperatures, each GPU weighed once."""
    dashboard = load(NVIDIA)
    start, end = span(cluster)
    every = variables(dashboard, cluster.prometheus, start, end)
    t4_instance = f"127.0.0.1:{cluster.exporters['t4'].port}"
    t4 = variables(dashboard, cluster.prometheus, start, end, {"instance": [t4_instance]})
    temperatures = [t for board in BOARD.values() for _, t, _ in board.values()]
    for chosen, power, temperature in (
        (every, watts(*BOARD.values()), sum(temperatures) / len(temperatures)),
        (t4, watts(BOARD["t4"]), (60 + 35) / 2),
    ):
        assert single(evaluate(cluster.prometheus, dashboard, "GPU Power Total", chosen, start, end)) == power
        average = single(evaluate(cluster.prometheus, dashboard, "GPU Avg. Temp", chosen, start, end))
        assert average == pytest.approx(temperature)


def test_our_panels_give_the_true_totals(cluster):
    dashboard = load(OURS)
    start, end = span(cluster)
    chosen = variables(dashboard, cluster.prometheus, start, end)
    names = {node: hostname for node, (hostname, _, _) in NODES.items()}

    def panel(title):
        return evaluate(cluster.prometheus, dashboard, title, chosen, start, end)

    assert instant_values(panel("Power by node"), "Hostname") == {(names[n],): watts(b) for n, b in BOARD.items()}
    # GPUs: 6 boards; devices: an A100 whole, its MIG GPU's three instances, two T4s, two H100s
    counts = {t: single(panel(t)) for t in ("GPUs", "Devices offered", "Devices allocated", "Idle devices",
                                            "Allocated but idle", "Pods on GPUs")}  # fmt: skip
    assert counts == {"GPUs": 6, "Devices offered": 8, "Devices allocated": 4, "Idle devices": 3,
                      "Allocated but idle": 1, "Pods on GPUs": 5}  # fmt: skip
    assert instant_values(panel("GPUs by node, model and mechanism"), "Hostname", "modelName", "mechanism",
                          "replicas") == {
        (names["a100"], "NVIDIA A100-SXM4-40GB", "whole", "1"): 1,
        (names["a100"], "NVIDIA A100-SXM4-40GB", "mig", "1"): 3,
        (names["t4"], "Tesla T4", "time-sliced", "2"): 2,
        (names["h100"], "NVIDIA H100 80GB HBM3", "whole", "1"): 2,
    }  # fmt: skip
    share = instant_values(panel("Share of its GPU memory limit used, per pod"), "pod")
    t4_memory = cluster.gpu("t4", 0)["model"]["memory_total"]
    assert share == {("infer-1",): 3 * GIB / (t4_memory / 2), ("infer-2",): 5 * GIB / (t4_memory / 2)}
    assert instant_values(panel("GPU utilization per pod"), "pod", "engine") == {
        ("infer-1", "sm"): 30, ("infer-1", "memory"): 10, ("infer-2", "sm"): 40, ("infer-2", "memory"): 20,
        ("llm", "sm"): 90, ("llm", "memory"): 50, ("trainer", "sm"): 0, ("trainer", "memory"): 0}  # fmt: skip
    assert instant_values(panel("Tensor core activity of each pod's devices"), "pod") == {("llm",): TENSOR / 100}
    (xids,) = [s for r in panel("XIDs in the time range") for s in r["instant"]]
    assert (xids["metric"]["Hostname"], xids["metric"]["gpu"], xids["metric"]["xid"]) == (names["t4"], "0", str(XID))
    assert 1 <= float(xids["value"][1]) < 2  # one XID; increase() extrapolates a little
    assert list(instant_values(panel("Failed starts by reason"), "reason")) == [("request",)]
    assert 6 <= single(panel("Container starts")) < 7  # five started, one refused


@pytest.mark.parametrize("mechanism, gpus, power", [("time-sliced", 2, 100), ("mig", 1, 180), ("whole", 3, 940)])
def test_the_mechanism_picks_the_boards_of_its_devices(cluster, mechanism, gpus, power):
    """A GPU in MIG mode goes with its MIG devices: its board's power and temperature are the mig
    mechanism's."""
    dashboard = load(OURS)
    start, end = span(cluster)
    chosen = variables(dashboard, cluster.prometheus, start, end, {"mechanism": [mechanism]})
    assert single(evaluate(cluster.prometheus, dashboard, "GPUs", chosen, start, end)) == gpus
    totals = instant_values(evaluate(cluster.prometheus, dashboard, "Power by node", chosen, start, end), "Hostname")
    assert sum(totals.values()) == power
