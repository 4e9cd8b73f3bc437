"""The Grafana dashboards: structure checked offline, every query run against real Prometheus.

No Grafana server exists here, so what Grafana would do is checked piecewise: the JSON
(uids, schema version, variables, datasources, layout), the links other components build
into it (alerts' ``dashboard_url``), and every panel, annotation and variable query run
against the test services' Prometheus while a live pipeline feeds it: ``ncclwatch watch``
and ``ncclwatch forward`` tail a spool that is written as the run goes, and an NCCL
Inspector ``.prom`` file sits in node-exporter's textfile directory.
"""

from __future__ import annotations

import doctest
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ncclwatch.dashboards import check, generate, panels
from ncclwatch.dashboards.check import (
    check_dashboard,
    label_values,
    load_dashboards,
    substitute,
    undefined_variables,
)
from ncclwatch.dashboards.panels import DATASOURCE_UID, DS, iter_panels, panel_queries
from ncclwatch_testkit import demo
from ncclwatch_testkit import services as testing

from ncclwatch.config import TOPIC_NAME_FIELDS

REPO = Path(__file__).resolve().parents[1]
UIDS = {"ncclwatch-job", "ncclwatch-comm", "ncclwatch-pipeline"}

# The metric names the components export (the brief's list): each must appear on a dashboard.
DETECTOR_METRICS = [
    "ncclwatch_busbw_observed_bytes_per_second",
    "ncclwatch_busbw_baseline_bytes_per_second",
    "ncclwatch_degradation_ratio",
    "ncclwatch_exec_seconds_bucket",
    "ncclwatch_anomaly_active",
    "ncclwatch_anomalies_total",
    "ncclwatch_job_flops_per_second_per_gpu",
    "ncclwatch_rank_relative_exec_ratio",
    "ncclwatch_detector_records_total",
    "ncclwatch_detector_lag_seconds",
    "ncclwatch_detector_keys",
]
FORWARDER_METRICS = [
    "ncclwatch_forwarder_records_read_total",
    "ncclwatch_forwarder_records_sent_total",
    "ncclwatch_forwarder_records_quarantined_total",
    "ncclwatch_forwarder_bytes_behind",
    "ncclwatch_forwarder_buffer_bytes",
    "ncclwatch_forwarder_last_send_timestamp_seconds",
    "ncclwatch_plugin_dropped_total",
]
INSPECTOR_METRICS = [
    "nccl_bus_bandwidth_gbs",
    "nccl_collective_exec_time_microseconds",
    "nccl_p2p_bus_bandwidth_gbs",
]


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict]:
    return load_dashboards()


def all_exprs(dash: dict) -> list[str]:
    exprs = [t["expr"] for t in panel_queries(dash)]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if a.get("expr")]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


# ---------------------------------------------------------------------------- offline


def test_committed_dashboards_are_what_the_generator_builds():
    assert generate.stale() == [], "run: python -m ncclwatch.dashboards.generate"


def test_dashboards_have_the_agreed_uids_refresh_and_a_current_schema_version(dashboards):
    assert set(dashboards) == UIDS
    for uid, dash in dashboards.items():
        assert (REPO / "dashboards" / "grafana" / f"{uid}.json").is_file()
        assert dash["refresh"] == "5s"
        # Grafana 11.0 writes 39; 12.x writes 41-42. Older numbers get migrated on load.
        assert 39 <= dash["schemaVersion"] <= 42
        assert dash["id"] is None  # provisioned dashboards get their id from Grafana
        assert "ncclwatch" in dash["tags"]


def test_every_variable_a_dashboard_uses_is_defined(dashboards):
    for uid, dash in dashboards.items():
        assert undefined_variables(dash) == [], uid


def test_an_undefined_variable_is_caught(dashboards):
    dash = json.loads(json.dumps(dashboards["ncclwatch-comm"]))
    dash["templating"]["list"] = [v for v in dash["templating"]["list"] if v["name"] != "op"]
    missing = {name for _, name in undefined_variables(dash)}
    assert missing == {"op"}


def test_the_variables_alert_links_use_exist(dashboards):
    for uid in ("ncclwatch-job", "ncclwatch-comm"):
        names = {v["name"] for v in dashboards[uid]["templating"]["list"]}
        assert {"cluster", "job", "comm", "op", "transport"} <= names


def test_alert_dashboard_urls_point_at_dashboards_and_variables_that_exist(dashboards):
    from ncclwatch.alerting.alerts import AlertLinks, alert_from_event
    from ncclwatch.alerting.prom_rules import render

    from ncclwatch.records import ANOMALY_TYPES, AnomalyEvent

    urls = []
    for type_ in ANOMALY_TYPES:
        for comm in ("0x00000000000000a0", None):
            ev = AnomalyEvent(
                id="a", type=type_, state="firing", job="j1",
                key={"comm": comm, "comm_name": "", "op": comm and "AllReduce",
                     "size_bucket": comm and "1MiB", "transport": comm and "net"},
                host=None, rank=None, start_ns=10**18, end_ns=None, detected_ns=10**18,
                baseline_busbw_gbs=None, observed_busbw_gbs=None, effect=0.2,
                attribution="unknown", throughput_delta=None, severity="warning", evidence={},
            )  # fmt: skip
            alert = alert_from_event(ev, AlertLinks("https://grafana.example.com"), {"cluster": "c1"})
            urls.append(alert["annotations"]["dashboard_url"])
    # and the Prometheus rules' links
    rules = render(AlertLinks("https://grafana.example.com"))
    urls += [re.sub(r"\{\{[^}]*\}\}", "x", u) for u in re.findall(r'dashboard_url: "([^"]+)"', rules)]
    assert len(urls) > 12
    for url in urls:
        parsed = urllib.parse.urlparse(url)
        uid = parsed.path.split("/d/")[1].split("/")[0]
        assert uid in dashboards, url
        names = {v["name"] for v in dashboards[uid]["templating"]["list"]}
        used = {k.removeprefix("var-") for k in urllib.parse.parse_qs(parsed.query) if k.startswith("var-")}
        assert used <= names, (url, used - names)


def test_every_datasource_reference_is_the_dashboard_variable_pointing_at_the_provisioned_one(
    dashboards,
):
    import yaml

    provisioned = yaml.safe_load((REPO / "dashboards/provisioning/datasources/ncclwatch.yml").read_text())[
        "datasources"
    ]
    assert DATASOURCE_UID in {d["uid"] for d in provisioned if d["type"] == "prometheus"}
    for uid, dash in dashboards.items():
        var = {v["name"]: v for v in dash["templating"]["list"]}["datasource"]
        assert var["type"] == "datasource" and var["query"] == "prometheus"
        assert var["current"]["value"] == DATASOURCE_UID
        for panel in iter_panels(dash["panels"]):
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == DS, (uid, panel["title"])
            for t in panel["targets"]:
                assert t["datasource"] == DS, (uid, panel["title"])
        for v in dash["templating"]["list"]:
            if v["type"] == "query":
                assert v["datasource"] == DS
        for a in dash["annotations"]["list"]:
            if not a.get("builtIn"):
                assert a["datasource"] == DS


def test_rates_use_grafanas_rate_interval(dashboards):
    windows = 0
    for dash in dashboards.values():
        for expr in all_exprs(dash):
            for _fn, window in re.findall(r"\b(rate|irate|increase)\([^\[]*\[([^\]]+)\]", expr):
                windows += 1
                assert window in ("$__rate_interval", "$__range"), expr
    assert windows >= 8


def test_the_job_overview_keeps_its_series_bounded(dashboards):
    """Per-key metrics are aggregated by a few bounded labels, never by rank or comm."""
    dash = dashboards["ncclwatch-job"]
    per_key = (
        "ncclwatch_busbw_observed_bytes_per_second",
        "ncclwatch_degradation_ratio",
        "nccl_bus_bandwidth_gbs",
    )
    checked = 0
    for t in panel_queries(dash):
        if t["panel_type"] in ("timeseries", "stat") and any(m in t["expr"] for m in per_key):
            checked += 1
            m = re.match(r"^(avg|min|max|sum) ?(by \(([^)]*)\) )?\(", t["expr"])
            assert m, t["expr"]
            labels = {x.strip() for x in (m.group(3) or "").split(",")}
            assert not labels & {"rank", "comm", "comm_name", "host", "gpu", "node", "Hostname"}, t["expr"]
    assert checked >= 6


def test_the_dashboards_show_every_exported_metric(dashboards):
    text = "\n".join(e for d in dashboards.values() for e in all_exprs(d))
    for metric in DETECTOR_METRICS + FORWARDER_METRICS + INSPECTOR_METRICS:
        assert re.search(rf"\b{metric}\b", text), metric


def test_the_panels_the_design_asks_for_are_there(dashboards):
    job, comm, pipe = (dashboards[u] for u in ("ncclwatch-job", "ncclwatch-comm", "ncclwatch-pipeline"))
    titles = {p["title"]: p for p in iter_panels(job["panels"])}
    nvlink = titles["NVLink-only communicators"]["targets"][0]["expr"]
    network = titles["Network / mixed communicators"]["targets"][0]["expr"]
    assert 'transport="nvlink"' in nvlink and 'transport=~"mixed|net"' in network
    assert any("ncclwatch_job_flops_per_second_per_gpu" in t["expr"] for t in titles["Job throughput"]["targets"])
    anno = [a for a in job["annotations"]["list"] if a.get("expr")]
    assert anno and anno[0]["expr"].startswith("ncclwatch_anomaly_active{")
    comm_exprs = [t["expr"] for t in panel_queries(comm)]
    assert any(e.startswith("histogram_quantile(0.95,") and "ncclwatch_exec_seconds_bucket" in e for e in comm_exprs)
    heatmaps = [p for p in iter_panels(comm["panels"]) if p["type"] == "heatmap"]
    assert heatmaps and "ncclwatch_rank_relative_exec_ratio" in heatmaps[0]["targets"][0]["expr"]
    assert any("ncclwatch_busbw_baseline_bytes_per_second" in e and "$threshold" in e for e in comm_exprs)
    pipe_titles = {p["title"] for p in iter_panels(pipe["panels"])}
    assert {
        "Plugin drops / s",
        "Backlog: spool bytes not yet sent",
        "Send buffer",
        "Detector lag",
    } <= pipe_titles


def test_panels_have_unique_ids_and_fit_the_grid_without_overlapping(dashboards):
    for uid, dash in dashboards.items():
        ids = [p["id"] for p in iter_panels(dash["panels"])]
        assert len(ids) == len(set(ids)), uid
        cells: set[tuple[int, int]] = set()
        for p in dash["panels"]:  # top level: collapsed rows hold their panels inside
            g = p["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24, (uid, p["title"])
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not mine & cells, (uid, p["title"])
            cells |= mine


def test_substitute_fills_variables_and_grafana_intervals():
    expr = 'sum(rate(x{job=~"$job", comm=~"${comm}", op=~"[[op]]"}[$__rate_interval])) * $threshold'
    got = substitute(expr, {"job": "j1", "threshold": "0.1"}, rate_s=20)
    assert got == 'sum(rate(x{job=~"j1", comm=~".*", op=~".*"}[20s])) * 0.1'


@pytest.mark.parametrize("module", [check, generate, panels])
def test_doctests(module):
    # dashboards/ is not in pytest's testpaths, so its doctests run from here
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------------------- live

SECONDS = 120  # of recording, written at SPEED× real time: a 20 s run
SPEED = 6.0
STRAGGLER_S = (25, 45)
NETWORK_S = (65, 100)
CHECKPOINT_S = (52, 60)  # a checkpoint save: rank 0 writes, the others wait for it; not a fault
STALL_S = (112, SECONDS)  # the straggler's process stopped at the end: still waited on as the run ends
RATE_S = 10  # $__rate_interval: >= 4 scrape intervals of the test Prometheus (1 s)
DEMO_COMMS = {f"0x00000000000000{c}" for c in ("a0", "a1", "b0", "b1", "c0")}
INSPECTOR_FIXTURE = REPO / "tests" / "fixtures" / "inspector"



class Targets:
    """Scrape targets in the services' shared file_sd file (read-modify-write under a lock)."""

    def __init__(self, path: Path):
        self.path = path

    def _edit(self, change: Callable[[list], list]) -> None:
        with open(self.path.with_name(self.path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            groups = json.loads(self.path.read_text() or "[]") if self.path.exists() else []
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(change(groups)))
            os.replace(tmp, self.path)

    def add(self, targets: list[str], labels: dict[str, str]) -> None:
        self._edit(lambda gs: [*gs, {"targets": targets, "labels": labels}])

    def remove(self, targets: list[str]) -> None:
        self._edit(lambda gs: [g for g in gs if not set(targets) & set(g.get("targets", []))])


def record_second(line: str, t0_ns: int) -> int:
    rec = json.loads(line)
    t = rec.get("start_ns", rec.get("ts_ns", t0_ns))
    return max(0, (t - t0_ns) // 10**9)


def write_live(stage: Path, spool: Path, t0_ns: int, stop_at: Callable[[], bool]) -> None:
    """Copy the staged recording into the live spool second by second, at SPEED× real time."""
    per_second: dict[int, dict[Path, list[str]]] = {}
    for f in sorted(stage.rglob("*.jsonl")):
        for line in f.read_text().splitlines():
            per_second.setdefault(record_second(line, t0_ns), {}).setdefault(f, []).append(line)
    start = time.monotonic()
    for s in sorted(per_second):
        delay = start + s / SPEED - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        if stop_at():
            return
        for f, lines in per_second[s].items():
            dest = spool / f.relative_to(stage)
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "a") as out:
                if s == SECONDS // 2 and f.name.startswith("node-b-GPU-3"):
                    out.write("this line is not JSON\n")  # the forwarder quarantines it
                out.write("\n".join(lines) + "\n")


def wait_up(prometheus_url: str, instance: str, procs: dict, logs: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not testing.prometheus_query(prometheus_url, f'up{{instance="{instance}"}} == 1'):
        for name, p in procs.items():
            assert p.poll() is None, f"{name} exited: {(logs / f'{name}.log').read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{instance} not scraped as up after {timeout_s}s"
        time.sleep(0.25)


@pytest.fixture(scope="module")
def live(services, prometheus_url, kafka_bootstrap, textfile_dir, tmp_path_factory) -> Iterator[dict]:
    """``ncclwatch watch`` and ``ncclwatch forward`` on a spool written as the run goes."""
    tmp = tmp_path_factory.mktemp("live")
    job = testing.unique_name("dash")
    cluster = testing.unique_name("cluster")
    t0_ns = (time.time_ns() // 10**9 - SECONDS) * 10**9
    labels = demo.write_demo_spool(
        tmp / "stage", job=job, seconds=SECONDS, t0_ns=t0_ns, straggler_s=STRAGGLER_S, network_s=NETWORK_S,
        stall_s=STALL_S, checkpoint_s=CHECKPOINT_S,
    )
    spool = tmp / "spool"
    spool.mkdir()
    topics = {
        k: testing.unique_name(f"dash-{k}")
        for k in TOPIC_NAME_FIELDS
    }
    for name in topics.values():
        testing.kafka_create_topic(kafka_bootstrap, name, 1)
    env = {
        **os.environ,
        "NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "NCCLWATCH_ALERTING_ALERTMANAGER_URL": "",
        "NCCLWATCH_DETECTOR_STATE_PATH": "",
        "NCCLWATCH_INGEST_STATE_DIR": str(tmp / "state"),
        **{f"NCCLWATCH_TOPICS_{k.upper()}": v for k, v in topics.items()},
    }
    env.pop("NCCLWATCH_CONFIG", None)
    watch_port, forward_port = testing.free_port(), testing.free_port()
    cli = [sys.executable, "-m", "ncclwatch.cli"]
    logs = {n: open(tmp / f"{n}.log", "w") for n in ("watch", "forward")}  # noqa: SIM115
    procs = {
        "watch": subprocess.Popen(
            [*cli, "watch", str(spool), "--metrics-port", str(watch_port), "--status-every-s", "0"],
            env=env, stdout=logs["watch"], stderr=subprocess.STDOUT, start_new_session=True,
        ),
        "forward": subprocess.Popen(
            [*cli, "forward", "--spool", str(spool), "--state-dir", str(tmp / "state"),
             "--node-id", "dash-node", "--no-delete-acked", "--metrics-port", str(forward_port)],
            env=env, stdout=logs["forward"], stderr=subprocess.STDOUT, start_new_session=True,
        ),
    }  # fmt: skip
    inspector = textfile_dir / f"nccl_inspector_metrics_{job}.prom"
    dcgm = textfile_dir / f"dcgm_{job}.prom"
    targets = Targets(services.prometheus_targets_file)
    # node-exporter is scraped again here, so its textfile metrics carry this run's cluster
    node_exporter = urllib.parse.urlparse(services.node_exporter_url).netloc
    instances = [f"127.0.0.1:{watch_port}", f"127.0.0.1:{forward_port}", node_exporter]
    try:
        # NCCL Inspector's own Prometheus-mode file, for this job, in node-exporter's textfile dir
        fixture = next(INSPECTOR_FIXTURE.glob("*.prom")).read_text()
        tmp_prom = inspector.with_suffix(".tmp")  # node-exporter reads only *.prom: no torn reads
        tmp_prom.write_text(fixture.replace('slurm_job_id="1670760"', f'slurm_job_id="{job}"'))
        os.replace(tmp_prom, inspector)
        # DCGM exporter's GPU utilisation for the demo's nodes, as it names them (`Hostname`)
        dcgm_tmp = dcgm.with_suffix(".tmp")
        dcgm_tmp.write_text("".join(
            f'DCGM_FI_DEV_GPU_UTIL{{gpu="{g}",UUID="GPU-{host}-{g}",Hostname="{host}"}} {40 + g}\n'
            for host in demo.HOSTS for g in range(demo.GPUS_PER_NODE)))
        os.replace(dcgm_tmp, dcgm)
        targets.add(instances, {"cluster": cluster})
        for instance in instances:
            wait_up(prometheus_url, instance, procs, tmp)
        start_s = time.time()
        write_live(tmp / "stage", spool, t0_ns, lambda: any(p.poll() is not None for p in procs.values()))
        time.sleep(4)  # the last windows close and a few more scrapes land
        for name, p in procs.items():
            assert p.poll() is None, f"{name} exited: {(tmp / f'{name}.log').read_text()[-3000:]}"
        end_s = time.time()
        yield {
            "job": job, "cluster": cluster, "labels": labels, "start_s": start_s, "end_s": end_s,
            "logs": {n: tmp / f"{n}.log" for n in logs},
        }  # fmt: skip
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in logs.values():
            f.close()
        targets.remove(instances)
        inspector.unlink(missing_ok=True)
        dcgm.unlink(missing_ok=True)


def run_values(live: dict) -> dict[str, str]:
    """Variable values that select this run's series and nothing else's.

    `cluster` is the label this run's scrape targets carry; `job` (the dashboards'
    variable) selects the ``training_job`` label, which no scrape config renames.
    """
    return {"cluster": live["cluster"], "job": live["job"]}


def failures(results: list[check.Result]) -> list[str]:
    return [f"{r.dashboard} / {r.panel} [{r.ref}]: {r.error or 'no data'}\n    {r.query}" for r in results if not r.ok]


@pytest.mark.prometheus
@pytest.mark.kafka
@pytest.mark.slow
def test_every_panel_annotation_and_variable_query_returns_data_from_the_live_pipeline(
    live, prometheus_url, dashboards
):
    results = []
    for dash in dashboards.values():
        results += check_dashboard(
            prometheus_url, dash, values=run_values(live), start_s=live["start_s"], end_s=live["end_s"], rate_s=RATE_S
        )
    assert len(results) > 40
    assert failures(results) == [], "\n".join(failures(results))


@pytest.mark.prometheus
@pytest.mark.kafka
@pytest.mark.slow
def test_the_communicator_drill_down_with_one_communicator_selected_returns_data(live, prometheus_url, dashboards):
    values = {**run_values(live), "comm": "0x00000000000000a0", "op": "AllReduce", "transport": "net"}
    results = check_dashboard(
        prometheus_url, dashboards["ncclwatch-comm"], values=values,
        start_s=live["start_s"], end_s=live["end_s"], rate_s=RATE_S,
    )  # fmt: skip
    # the demo's straggler (global rank 1) is not in this communicator: its GPUs stay empty here
    dcgm = "Straggler's GPUs (DCGM exporter)"
    assert {r.series for r in results if r.panel == dcgm} == {0}
    assert failures([r for r in results if r.panel != dcgm]) == [], "\n".join(failures(results))
    # ... and show up once a communicator the straggler belongs to is selected (dp, ranks 1 and 3)
    theirs = {**run_values(live), "comm": "0x00000000000000a1", "op": "AllReduce", "transport": "net"}
    results = check_dashboard(
        prometheus_url, dashboards["ncclwatch-comm"], values=theirs,
        start_s=live["start_s"], end_s=live["end_s"], rate_s=RATE_S,
    )  # fmt: skip
    assert {r.panel for r in results if r.series > 0} >= {dcgm}
    # a communicator the run never had selects nothing: the filters really filter
    values["comm"] = "0x00000000000000ff"
    results = check_dashboard(
        prometheus_url, dashboards["ncclwatch-comm"], values=values,
        start_s=live["start_s"], end_s=live["end_s"], rate_s=RATE_S,
    )  # fmt: skip
    empty = {r.panel for r in results if r.series == 0}
    assert "Per-rank relative exec time (straggler score)" in empty
    assert "Bus bandwidth vs baseline: $op" in empty


@pytest.mark.prometheus
@pytest.mark.kafka
@pytest.mark.slow
def test_template_variables_list_the_runs_clusters_communicators_ops_and_transports(live, prometheus_url, dashboards):
    variables = {v["name"]: v for v in dashboards["ncclwatch-comm"]["templating"]["list"]}

    def values_of(name: str, **chosen: str) -> set[str]:
        q = substitute(variables[name]["definition"], {**run_values(live), **chosen})
        return set(label_values(prometheus_url, q, live["start_s"], live["end_s"]))

    assert live["cluster"] in values_of("cluster")
    assert values_of("job") == {live["job"]}  # the training job, not the scrape job
    assert values_of("comm") == DEMO_COMMS
    assert values_of("op", comm="0x00000000000000c0") == {"AllGather"}
    assert values_of("op") == {"AllReduce", "AllGather"}
    assert values_of("transport") == {"nvlink", "net", "mixed"}


@pytest.mark.prometheus
@pytest.mark.kafka
@pytest.mark.slow
def test_the_injected_faults_show_on_the_dashboards_while_they_last(live, prometheus_url):
    """The anomaly annotation covers the network fault; the straggler's rank goes below 1."""
    t0 = live["start_s"]
    net_from, net_to = (t0 + s / SPEED for s in NETWORK_S)
    sel = f'cluster="{live["cluster"]}"'
    active = check.query_range(
        prometheus_url, f'ncclwatch_anomaly_active{{{sel}, anomaly_type="network_path"}} > 0', t0, live["end_s"], 1
    )
    assert active, "no network_path anomaly was active during the run"
    times = [float(t) for series in active for t, _ in series["values"]]
    assert min(times) <= net_to and max(times) >= net_from
    rel = check.query_range(
        prometheus_url,
        f'min by (rank) (ncclwatch_rank_relative_exec_ratio{{{sel}, comm="0x00000000000000c0"}})',
        t0,
        live["end_s"],
        1,
    )
    lowest = {s["metric"]["rank"]: min(float(v) for _, v in s["values"]) for s in rel}
    # global rank 1 is rank 1 of the 4-rank world communicator
    assert min(lowest, key=lowest.get) == "1" and lowest["1"] < 0.9, lowest


@pytest.mark.prometheus
@pytest.mark.kafka
@pytest.mark.slow
def test_a_stopped_rank_shows_as_its_communicator_waiting_and_is_named(live, prometheus_url):
    """The run ends with global rank 1's process stopped: the world communicator's wait
    grows on the dashboards past the detector's stall time, and rank 1 is the straggler."""
    sel = f'cluster="{live["cluster"]}", comm="0x00000000000000c0"'
    waits = check.query_range(prometheus_url, f"ncclwatch_comm_waiting_seconds{{{sel}}}",
                              live["start_s"], live["end_s"] + 5, 1)
    assert waits, "no ncclwatch_comm_waiting_seconds series during the stop"
    longest = max(float(v) for series in waits for _, v in series["values"])
    assert longest >= 3.0, longest
    stalled = check.query_range(
        prometheus_url, f'ncclwatch_anomaly_active{{{sel}, anomaly_type="straggler"}} > 0',
        live["start_s"], live["end_s"] + 5, 1)
    assert {s["metric"]["rank"] for s in stalled} == {"1"}


@pytest.mark.prometheus
@pytest.mark.kafka
@pytest.mark.slow
def test_a_checkpoint_save_shows_as_a_save_and_names_nobody(live, prometheus_url):
    """Rank 0 writes a checkpoint for 8 s while the others wait for it: the wait shows, the
    save is shaded, and no anomaly of any kind begins in it (the stop at the end, a
    real one, names rank 1: the test above)."""
    t0 = live["start_s"]
    save_from, save_to = (t0 + s / SPEED for s in CHECKPOINT_S)
    job = f'cluster="{live["cluster"]}"'
    saving = check.query_range(prometheus_url, f"ncclwatch_job_checkpoint_saving{{{job}}} > 0", t0, live["end_s"], 1)
    times = [float(t) for series in saving for t, _ in series["values"]]
    # 8 s of the run are 1.3 s of real time: a sample or two, a scrape late at most
    assert times and save_from <= max(times) and min(times) <= save_to + 2, (save_from, save_to, times)
    waits = check.query_range(prometheus_url, f'ncclwatch_comm_waiting_seconds{{{job}, comm="0x00000000000000c0"}}',
                              save_from, save_to + 2, 1)
    assert max(float(v) for series in waits for _, v in series["values"]) >= 3.0
    raised = check.query_range(prometheus_url, f"ncclwatch_anomaly_active{{{job}}} > 0", t0, live["end_s"], 1)
    began = {s["metric"]["anomaly_type"] + " rank " + s["metric"].get("rank", ""): min(float(t) for t, _ in s["values"])
             for s in raised}
    # a stall of the save would be raised 3 s of the run (0.5 s) into it; the network
    # fault begins 5 s of the run after it
    assert not {a for a, t in began.items() if save_from <= t <= save_to + 0.5}, (save_from, save_to, began)
