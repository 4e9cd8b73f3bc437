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
import json
import re
import urllib.parse
from pathlib import Path

import pytest
from ncclwatch.dashboards import check, demo, generate, panels
from ncclwatch.dashboards.check import (
    load_dashboards,
    substitute,
    undefined_variables,
)
from ncclwatch.dashboards.panels import DATASOURCE_UID, DS, iter_panels, panel_queries

REPO = Path(__file__).resolve().parents[1]
UIDS = {"ncclwatch-job", "ncclwatch-comm", "ncclwatch-pipeline"}

# The metric names the components export (the brief's list): each must appear on a dashboard.
DETECTOR_METRICS = [
    "ncclwatch_busbw_observed_gbs",
    "ncclwatch_busbw_baseline_gbs",
    "ncclwatch_degradation_ratio",
    "ncclwatch_exec_seconds_bucket",
    "ncclwatch_anomaly_active",
    "ncclwatch_anomalies_total",
    "ncclwatch_job_tflops_per_gpu",
    "ncclwatch_rank_relative_exec",
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
            alert = alert_from_event(ev, AlertLinks(), {"cluster": "c1"})
            urls.append(alert["annotations"]["dashboard_url"])
    # and the Prometheus rules' links
    rules = (REPO / "alerting" / "rules" / "ncclwatch.rules.yml").read_text()
    urls += [
        re.sub(r"\{\{[^}]*\}\}", "x", u) for u in re.findall(r'dashboard_url: "([^"]+)"', rules)
    ]
    assert len(urls) > 12
    for url in urls:
        parsed = urllib.parse.urlparse(url)
        uid = parsed.path.split("/d/")[1].split("/")[0]
        assert uid in dashboards, url
        names = {v["name"] for v in dashboards[uid]["templating"]["list"]}
        used = {
            k.removeprefix("var-")
            for k in urllib.parse.parse_qs(parsed.query)
            if k.startswith("var-")
        }
        assert used <= names, (url, used - names)


def test_every_datasource_reference_is_the_dashboard_variable_pointing_at_the_provisioned_one(
    dashboards,
):
    import yaml

    provisioned = yaml.safe_load(
        (REPO / "dashboards/provisioning/datasources/ncclwatch.yml").read_text()
    )["datasources"]
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
        "ncclwatch_busbw_observed_gbs",
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
            assert not labels & {"rank", "comm", "host", "gpu", "node"}, t["expr"]
    assert checked >= 6


def test_the_dashboards_show_every_exported_metric(dashboards):
    text = "\n".join(e for d in dashboards.values() for e in all_exprs(d))
    for metric in DETECTOR_METRICS + FORWARDER_METRICS + INSPECTOR_METRICS:
        assert re.search(rf"\b{metric}\b", text), metric


def test_the_panels_the_design_asks_for_are_there(dashboards):
    job, comm, pipe = (
        dashboards[u] for u in ("ncclwatch-job", "ncclwatch-comm", "ncclwatch-pipeline")
    )
    titles = {p["title"]: p for p in iter_panels(job["panels"])}
    nvlink = titles["NVLink-only communicators"]["targets"][0]["expr"]
    network = titles["Network / mixed communicators"]["targets"][0]["expr"]
    assert 'transport="nvlink"' in nvlink and 'transport=~"mixed|net"' in network
    assert any(
        "ncclwatch_job_tflops_per_gpu" in t["expr"] for t in titles["Job throughput"]["targets"]
    )
    anno = [a for a in job["annotations"]["list"] if a.get("expr")]
    assert anno and anno[0]["expr"].startswith("ncclwatch_anomaly_active{")
    comm_exprs = [t["expr"] for t in panel_queries(comm)]
    assert any(
        e.startswith("histogram_quantile(0.95,") and "ncclwatch_exec_seconds_bucket" in e
        for e in comm_exprs
    )
    heatmaps = [p for p in iter_panels(comm["panels"]) if p["type"] == "heatmap"]
    assert heatmaps and "ncclwatch_rank_relative_exec" in heatmaps[0]["targets"][0]["expr"]
    assert any("ncclwatch_busbw_baseline_gbs" in e and "$threshold" in e for e in comm_exprs)
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
            mine = {
                (x, y)
                for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])
            }
            assert not mine & cells, (uid, p["title"])
            cells |= mine


def test_substitute_fills_variables_and_grafana_intervals():
    expr = 'sum(rate(x{job=~"$job", comm=~"${comm}", op=~"[[op]]"}[$__rate_interval])) * $threshold'
    got = substitute(expr, {"job": "j1", "threshold": "0.1"}, rate_s=20)
    assert got == 'sum(rate(x{job=~"j1", comm=~".*", op=~".*"}[20s])) * 0.1'


@pytest.mark.parametrize("module", [check, demo, generate, panels])
def test_doctests(module):
    # dashboards/ is not in pytest's testpaths, so its doctests run from here
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
