"""The alerting sink without external services: a real HTTP server on 127.0.0.1:0 stands
in for Alertmanager's API, a fake clock drives re-sends and backoff. The real
Alertmanager and Prometheus are exercised in test_alerting_services.py."""

from __future__ import annotations

import io
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from ncclwatch.alerting import alerts, prom_rules
from ncclwatch.alerting.alertmanager import AlertmanagerClient
from ncclwatch.alerting.outbox import JOURNAL_NAME, Outbox
from ncclwatch.alerting.sink import AlertSink

from ncclwatch import cli, config
from ncclwatch.records import ANOMALY_TYPES, AnomalyEvent, from_json, to_dict

ALERTING = Path(__file__).resolve().parent.parent / "alerting"
T0_NS = 1_763_000_000_000_000_000  # 2025-11-13, a fixed stream time
LINKS = alerts.AlertLinks("https://grafana.example.com", "https://runbooks.example.com/ncclwatch")


def event(**over) -> AnomalyEvent:
    base = dict(
        id="an-1", type="collective_degraded", state="firing", job="llm-70b",
        key={"comm": "0x00000000000000ab", "comm_name": "dp", "op": "AllReduce",
             "size_bucket": "64MiB", "transport": "net"},
        host="node-3", rank=None, start_ns=T0_NS, end_ns=None, detected_ns=T0_NS + 3 * 10**9,
        baseline_busbw_gbs=40.0, observed_busbw_gbs=30.0, effect=0.25, attribution="unknown",
        throughput_delta=-0.13, severity="warning", evidence={"windows": 3},
    )
    base.update(over)
    # through the contract, so an event the schema rejects cannot sneak into a test
    return from_json({"v": 1, "kind": "anomaly", **base})


def resolved(ev: AnomalyEvent, end_ns: int) -> AnomalyEvent:
    return from_json({**to_dict(ev), "state": "resolved", "end_ns": end_ns})


class FakeAlertmanager:
    """A real HTTP server that records what is POSTed to /api/v2/alerts."""

    def __init__(self):
        self.posts: list[list[dict]] = []
        self.status = 200
        self.status_for = lambda batch: self.status
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                batch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status = outer.status_for(batch)
                if self.path == "/api/v2/alerts" and status == 200:
                    outer.posts.append(batch)
                self.send_response(status)
                self.end_headers()

            def do_GET(self):
                data = json.dumps([{"labels": a["labels"], "receivers": [{"name": "ticket"}]}
                                   for batch in outer.posts for a in batch]).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def alerts(self) -> list[dict]:
        return [a for batch in self.posts for a in batch]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def am():
    server = FakeAlertmanager()
    yield server
    server.close()


def refused_url() -> str:
    """A loopback URL where nothing listens."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_sink(url: str, clock: Clock, state_dir=None, **kw) -> AlertSink:
    client = AlertmanagerClient(url, clock=clock, timeout_s=2, backoff_initial_s=1,
                                backoff_max_s=8)
    return AlertSink(client=client, resend_interval_s=60, state_dir=state_dir, clock=clock,
                     now_ns=lambda: T0_NS + int(clock.t * 1e9), **kw)


def ts(text: str) -> int:
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1e9)


# --- mapping ------------------------------------------------------------------------------


@pytest.mark.parametrize("typ", ANOMALY_TYPES)
def test_every_anomaly_type_has_an_alert_name_and_a_runbook(typ):
    name = alerts.ALERT_NAMES[typ]
    a = alerts.alert_from_event(event(type=typ), LINKS)
    assert a["labels"]["alertname"] == name
    assert a["annotations"]["runbook_url"] == f"https://runbooks.example.com/ncclwatch/{name}.md"
    assert (ALERTING.parent / "docs" / "runbooks" / f"{name}.md").is_file()


def test_without_configured_urls_alerts_carry_no_links_rather_than_guessed_ones():
    a = alerts.alert_from_event(event(), alerts.AlertLinks())
    assert "runbook_url" not in a["annotations"] and "dashboard_url" not in a["annotations"]
    assert "generatorURL" not in a
    assert config.AlertingConfig().grafana_url == config.AlertingConfig().runbook_base_url == ""
    with pytest.raises(ValueError, match="grafana_url"):
        alerts.AlertLinks(grafana_url="grafana:3000")


def test_no_grafana_or_runbook_host_is_hard_coded_in_alerting_or_dashboards():
    sources = [*ALERTING.rglob("*.py"), *ALERTING.rglob("*.yml"), *(ALERTING.parent / "dashboards").rglob("*.py")]
    for path in sources:
        text = path.read_text()
        assert "127.0.0.1:3000" not in text and "github.com/ncclwatch" not in text, path


def test_rendered_rules_link_to_the_configured_grafana_and_runbooks_like_the_sink():
    text = prom_rules.render(LINKS)
    names = set(re.findall(r"(?m)^\s*- alert: (\w+)$", text))
    runbooks = re.findall(r'runbook_url: "([^"]+)"', text)
    assert {u.rsplit("/", 1)[1] for u in runbooks} == {f"{n}.md" for n in names}
    assert all(u.startswith("https://runbooks.example.com/ncclwatch/") for u in runbooks)
    dashboards = re.findall(r'dashboard_url: "([^"]+)"', text)
    assert len(dashboards) == len(re.findall(r"(?m)^\s*- alert: ", text))
    assert all(u.startswith("https://grafana.example.com/d/ncclwatch-") for u in dashboards)
    sink_alert = alerts.alert_from_event(event(type="straggler"), LINKS)
    assert sink_alert["annotations"]["runbook_url"] in runbooks


def test_alert_rules_command_prints_the_rules_with_links_from_the_config(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[alerting]\ngrafana_url = "{LINKS.grafana_url}"\nrunbook_base_url = "{LINKS.runbook_base_url}"\n')
    r = subprocess.run([sys.executable, "-m", "ncclwatch.cli", "alert-rules", "-c", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == prom_rules.render(LINKS)
    bad = subprocess.run([sys.executable, "-m", "ncclwatch.cli", "alert-rules", "--grafana-url", "g:3000"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "grafana_url" in bad.stderr


def test_alert_labels_identify_the_anomaly_and_leave_out_what_it_spans():
    ev = event(key={"comm": None, "comm_name": None, "op": "AllGather", "size_bucket": None,
                    "transport": None}, host=None, rank=7)
    a = alerts.alert_from_event(ev, alerts.AlertLinks(), {"cluster": "eu-1"})
    assert a["labels"] == {
        "cluster": "eu-1", "alertname": "NcclCollectiveDegraded", "training_job": "llm-70b",
        "severity": "warning", "anomaly_id": "an-1", "source": "ncclwatch",
        "op": "AllGather", "rank": "7",
    }


def test_a_straggler_alert_names_its_gpu_as_dcgm_does():
    ev = event(type="straggler", attribution="straggler", rank=3, host="node-3",
               evidence={"gpu": "GPU-3b3f9d87-a4f1-dc38-6e64-50b8ef77c6ba"})
    labels = alerts.alert_from_event(ev, alerts.AlertLinks())["labels"]
    assert labels["UUID"] == "GPU-3b3f9d87-a4f1-dc38-6e64-50b8ef77c6ba"
    assert labels["node"] == "node-3" and labels["rank"] == "3"
    assert "UUID" not in alerts.alert_from_event(event(), alerts.AlertLinks())["labels"]


def test_a_straggler_alert_without_a_gpu_names_its_process_in_an_annotation():
    # NCCL Inspector gives no GPU: the process id (host + pid) is what finds the process
    ev = event(type="straggler", attribution="straggler", rank=0, host="node-0", evidence={"pid": 2021})
    a = alerts.alert_from_event(ev, alerts.AlertLinks())
    assert a["annotations"]["pid"] == "2021" and "UUID" not in a["labels"] and "pid" not in a["labels"]
    for bad in (0, True, "2021", None):
        ev = event(type="straggler", attribution="straggler", rank=0, host="node-0", evidence={"pid": bad})
        assert "pid" not in alerts.alert_from_event(ev, alerts.AlertLinks())["annotations"]


def test_annotations_carry_baseline_observed_effect_since_and_throughput():
    a = alerts.alert_from_event(event(), alerts.AlertLinks())
    ann = a["annotations"]
    assert "30.00 GB/s vs baseline 40.00 GB/s (-25.0%)" in ann["description"]
    assert "Degraded since 2025-11-13T" in ann["description"]
    assert "-13.0%" in ann["description"] and "-13.0%" in ann["summary"]
    assert ann["baseline_busbw_gbs"] == "40.000" and ann["observed_busbw_gbs"] == "30.000"
    assert json.loads(ann["evidence"]) == {"windows": 3}
    assert a["startsAt"] == alerts.iso(T0_NS)


@pytest.mark.parametrize(
    "typ,uid",
    [("network_path", "ncclwatch-comm"), ("straggler", "ncclwatch-comm"),
     ("throughput_drop", "ncclwatch-job"), ("telemetry_loss", "ncclwatch-pipeline")],
)
def test_dashboard_link_opens_the_right_dashboard_from_15_min_before_start(typ, uid):
    links = alerts.AlertLinks(grafana_url="https://grafana.example.com/")
    url = urlparse(alerts.alert_from_event(event(type=typ), links)["annotations"]["dashboard_url"])
    q = {k: v[0] for k, v in parse_qs(url.query).items()}
    assert url.netloc == "grafana.example.com" and url.path == f"/d/{uid}"
    assert q["var-job"] == "llm-70b"
    assert int(q["from"]) == (T0_NS - 15 * 60 * 10**9) // 10**6
    assert q["to"] == "now"
    if uid == "ncclwatch-comm":
        assert (q["var-comm"], q["var-op"], q["var-transport"]) == (
            "0x00000000000000ab", "AllReduce", "net")


def test_dashboard_link_of_a_resolved_anomaly_ends_at_its_end():
    a = alerts.alert_from_event(resolved(event(), T0_NS + 60 * 10**9), LINKS)
    q = parse_qs(urlparse(a["generatorURL"]).query)
    assert q["to"] == [str((T0_NS + 60 * 10**9) // 10**6)]


def test_static_labels_may_not_override_the_scheme():
    with pytest.raises(ValueError, match="training_job"):
        alerts.parse_static_labels("training_job=x")
    with pytest.raises(ValueError, match="not name=value"):
        alerts.parse_static_labels("bad-name=1")


# --- client -------------------------------------------------------------------------------


def test_client_posts_a_json_list_to_the_v2_api(am):
    AlertmanagerClient(am.url + "/").post_alerts([{"labels": {"alertname": "X"}}])
    assert am.posts == [[{"labels": {"alertname": "X"}}]]


def test_client_backs_off_exponentially_and_resets_after_success(am):
    clock = Clock()
    client = AlertmanagerClient(am.url, clock=clock, backoff_initial_s=1, backoff_max_s=4)
    am.status = 503
    delays = []
    for _ in range(4):
        assert not client.try_post([{"labels": {}}])
        delays.append(client.retry_in_s())
        assert not client.try_post([{"labels": {}}])  # inside the backoff: not even tried
        clock.t += delays[-1]
    assert delays == [1, 2, 4, 4]
    am.status = 200
    assert client.try_post([{"labels": {}}]) and client.retry_in_s() == 0 and client.failures == 0


# --- sink ---------------------------------------------------------------------------------


def test_firing_alert_is_resent_every_resend_interval_with_ends_at_moving_ahead(am):
    clock = Clock()
    sink = make_sink(am.url, clock)
    sink.handle(event())
    assert len(am.alerts) == 1
    first = am.alerts[0]
    assert ts(first["endsAt"]) - ts(first["startsAt"]) > 4 * 60 * 10**9 - 10**9
    clock.t += 59
    sink.tick()
    assert len(am.alerts) == 1  # not due yet
    clock.t += 1
    sink.tick()
    assert len(am.alerts) == 2
    assert ts(am.alerts[1]["endsAt"]) - ts(first["endsAt"]) == 60 * 10**9
    assert am.alerts[1]["labels"] == first["labels"]


def test_resolution_is_sent_with_ends_at_and_then_forgotten(am):
    clock = Clock()
    sink = make_sink(am.url, clock)
    ev = event()
    sink.handle(ev)
    sink.handle(resolved(ev, T0_NS + 90 * 10**9))
    assert am.alerts[-1]["endsAt"] == alerts.iso(T0_NS + 90 * 10**9)
    assert am.alerts[-1]["labels"] == am.alerts[0]["labels"]
    assert sink.stats()["outbox"] == 0
    clock.t += 600
    sink.tick()
    assert len(am.alerts) == 2  # nothing re-sent after the resolution


def test_alerts_raised_while_alertmanager_is_down_are_delivered_when_it_returns(am):
    clock = Clock()
    sink = make_sink(refused_url(), clock)
    ev = event()
    sink.handle(ev)
    sink.handle(event(id="an-2", type="network_path"))
    sink.handle(resolved(ev, T0_NS + 10**9))
    assert sink.pending() == 2 and sink.stats()["post_failures"] == 1  # backoff held the rest
    for _ in range(5):
        clock.t += 10
        sink.tick()
    sink.client.url = am.url  # Alertmanager is back
    clock.t += 10
    sink.tick()
    assert sink.pending() == 0
    # an-1 fired and resolved during the outage: Alertmanager would drop a resolution of
    # an alert it never had firing, so it gets an-1 firing first, ...
    got = {(a["labels"]["anomaly_id"], a["endsAt"] <= alerts.iso(T0_NS + 10**9)) for a in am.alerts}
    assert got == {("an-1", False), ("an-2", False)}
    # ... and its resolution once Alertmanager had time to notify the firing one
    clock.t += sink.resolve_hold_s - 10
    am.posts.clear()
    sink.tick()  # (re-sends of what is firing)
    assert all(a["endsAt"] > alerts.iso(T0_NS + 10**9) for a in am.alerts)
    am.posts.clear()
    clock.t += 10
    sink.tick()
    got = {(a["labels"]["anomaly_id"], a["endsAt"] <= alerts.iso(T0_NS + 10**9)) for a in am.alerts}
    assert got == {("an-1", True)} and sink.active() == 1 and len(sink._outbox) == 1


def test_pending_resolution_survives_a_restart(am, tmp_path):
    clock = Clock()
    down = refused_url()
    ev = event()
    sink = make_sink(am.url, clock, state_dir=tmp_path)
    sink.handle(ev)
    sink.handle(event(id="an-2", severity="critical"))
    sink.client.url = down
    sink.handle(resolved(ev, T0_NS + 10**9))
    del sink  # the process dies without close()
    restarted = make_sink(am.url, clock, state_dir=tmp_path)
    assert restarted.pending() == 2  # an-1's resolution and an-2 (re-sent after restart)
    restarted.tick()
    last = {a["labels"]["anomaly_id"]: a for a in am.alerts}
    assert last["an-1"]["endsAt"] == alerts.iso(T0_NS + 10**9)
    assert ts(last["an-2"]["endsAt"]) > T0_NS + int(clock.t * 1e9)
    assert restarted.pending() == 0 and restarted.active() == 1


def test_changed_severity_resolves_the_old_alert_instead_of_leaving_it_firing(am):
    clock = Clock()
    sink = make_sink(am.url, clock)
    sink.handle(event(severity="warning"))
    sink.handle(event(severity="critical"))
    by_severity = {a["labels"]["severity"]: a for a in am.alerts[1:]}
    assert ts(by_severity["warning"]["endsAt"]) <= T0_NS + int(clock.t * 1e9)
    assert ts(by_severity["critical"]["endsAt"]) > T0_NS + int(clock.t * 1e9)
    assert sink.active() == 1


def test_print_mode_prints_one_readable_line_per_change():
    out = io.StringIO()
    sink = AlertSink(client=None, out=out)
    ev = event(type="network_path", severity="critical")
    sink.handle(ev)
    sink.tick()
    sink.handle(resolved(ev, T0_NS + 10**9))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("ALERT firing critical NcclNetworkPathDegraded training_job=llm-70b")
    assert "bus bandwidth down 25%" in lines[0]
    assert lines[1].startswith("ALERT resolved critical NcclNetworkPathDegraded")


def test_from_config_without_url_prints_and_with_url_sends(am):
    from ncclwatch.config import load

    cfg = load(None, environ={"NCCLWATCH_ALERTING_ALERT_LABELS": "cluster=eu-1"})
    assert AlertSink.from_config(cfg.alerting).client is None
    cfg = load(None, environ={"NCCLWATCH_ALERTING_ALERTMANAGER_URL": am.url,
                              "NCCLWATCH_ALERTING_GRAFANA_URL": "https://grafana.example.com",
                              "NCCLWATCH_ALERTING_ALERT_LABELS": "cluster=eu-1"})
    sink = AlertSink.from_config(cfg.alerting)
    sink.handle(event())
    assert am.alerts[0]["labels"]["cluster"] == "eu-1"
    assert "var-cluster=eu-1" in am.alerts[0]["generatorURL"]


def test_an_alert_alertmanager_rejects_is_dropped_without_blocking_the_others(am):
    clock = Clock()
    sink = make_sink(am.url, clock)
    handler_status = am.status

    def status_for(batch):  # Alertmanager validates each alert; one bad one fails the POST
        return 400 if any(a["labels"]["anomaly_id"] == "bad" for a in batch) else handler_status

    am.status_for = status_for
    sink.client.url = refused_url()
    for aid in ("a", "bad", "c"):
        sink.handle(event(id=aid))
    sink.client.url = am.url
    clock.t += 10
    sink.tick()
    assert sorted(a["labels"]["anomaly_id"] for a in am.alerts) == ["a", "c"]
    assert sink.stats()["rejected"] == 1 and sink.pending() == 0 and sink.client.failures == 0


def test_start_in_the_future_of_our_clock_is_clamped_so_the_resolution_is_valid(am):
    clock = Clock()
    sink = make_sink(am.url, clock)
    now_ns = T0_NS + int(clock.t * 1e9)
    ev = event(start_ns=now_ns + 5 * 10**9)  # the training node's clock runs 5 s ahead
    sink.handle(ev)
    sink.handle(resolved(ev, now_ns + 6 * 10**9))
    firing, resolution = am.alerts
    assert ts(firing["startsAt"]) == now_ns
    assert ts(resolution["startsAt"]) <= ts(resolution["endsAt"]) <= now_ns


def test_a_lone_surrogate_in_a_job_name_does_not_break_delivery(am):
    sink = make_sink(am.url, Clock())
    sink.handle(event(job="bad\udcffname"))
    assert len(am.alerts) == 1 and am.alerts[0]["labels"]["training_job"] == "bad?name"


# --- outbox -------------------------------------------------------------------------------


def test_full_outbox_evicts_the_oldest_resolution_then_refuses_new_alerts(tmp_path):
    ob = Outbox(tmp_path / JOURNAL_NAME, max_entries=3)
    assert ob.put("f1", {"labels": {}}, "firing")
    assert ob.put("r1", {"labels": {}}, "resolved", 1)
    assert ob.put("r2", {"labels": {}}, "resolved", 2)
    assert ob.put("f2", {"labels": {}}, "firing")  # evicts r1, the oldest resolution
    assert ob.put("r2", {"labels": {}}, "resolved", 3)  # an update is never refused
    assert ob.put("f3", {"labels": {}}, "firing")  # evicts r2
    assert not ob.put("f4", {"labels": {}}, "firing")
    assert (ob.evicted, ob.refused) == (2, 1)
    ob.close()
    assert [e.key for e in Outbox(tmp_path / JOURNAL_NAME).entries()] == ["f1", "f2", "f3"]


def test_truncated_last_journal_line_is_skipped_not_fatal(tmp_path):
    ob = Outbox(tmp_path / JOURNAL_NAME)
    ob.put("a", {"labels": {"x": "1"}}, "firing")
    ob.put("b", {"labels": {}}, "resolved", 5)
    ob.close()
    with open(tmp_path / JOURNAL_NAME, "a") as f:
        f.write('{"op":"done","key":"a"')  # crash mid-write
    again = Outbox(tmp_path / JOURNAL_NAME)
    assert [(e.key, e.state) for e in again.entries()] == [("a", "firing"), ("b", "resolved")]


def test_journal_is_compacted_so_it_stays_bounded(tmp_path):
    ob = Outbox(tmp_path / JOURNAL_NAME)
    for i in range(1000):
        ob.put(f"k{i}", {"labels": {}}, "resolved", i)
        ob.remove(f"k{i}")
    ob.put("live", {"labels": {}}, "firing")
    lines = (tmp_path / JOURNAL_NAME).read_text().splitlines()
    assert len(lines) < 200
    ob.close()
    assert [e.key for e in Outbox(tmp_path / JOURNAL_NAME).entries()] == ["live"]


# --- ncclwatch alert-test -----------------------------------------------------------------


def test_alert_test_exits_nonzero_with_a_clear_message_when_alertmanager_is_down(capsys):
    url = refused_url()
    rc = cli.main(["alert-test", "--url", url, "--duration", "0"])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"Alertmanager at {url} is not reachable" in err and "nothing was sent" in err


def test_alert_test_without_a_url_says_how_to_configure_one(capsys, monkeypatch):
    monkeypatch.delenv("NCCLWATCH_ALERTING_ALERTMANAGER_URL", raising=False)
    monkeypatch.delenv("NCCLWATCH_CONFIG", raising=False)
    assert cli.main(["alert-test"]) == 2
    assert "alertmanager_url" in capsys.readouterr().err


def test_alert_test_sends_a_labelled_test_alert_and_resolves_it(am, capsys):
    rc = cli.main(["alert-test", "--url", am.url, "--duration", "0", "--severity", "critical"])
    assert rc == 0, capsys.readouterr().err
    firing, resolution = am.alerts
    assert firing["labels"]["alertname"] == "NcclwatchTestAlert"
    assert firing["labels"]["test"] == "true" and firing["labels"]["severity"] == "critical"
    assert resolution["labels"] == firing["labels"]
    assert ts(resolution["endsAt"]) < ts(firing["endsAt"])
    assert "routed to: ticket" in capsys.readouterr().out


# --- shipped configuration ----------------------------------------------------------------

AMTOOL = shutil.which("amtool")
PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(AMTOOL is None, reason="amtool not installed (Debian: prometheus-alertmanager)")
def test_shipped_alertmanager_config_passes_amtool_check_config():
    r = subprocess.run([AMTOOL, "check-config", str(ALERTING / "alertmanager.yml")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 inhibit rules" in r.stdout


@pytest.mark.skipif(AMTOOL is None, reason="amtool not installed (Debian: prometheus-alertmanager)")
@pytest.mark.parametrize(
    "labels,receiver",
    [
        (["alertname=NcclNetworkPathDegraded", "severity=critical", "job=j"], "ncclwatch-page"),
        (["alertname=NcclCollectiveDegraded", "severity=warning", "job=j"], "ncclwatch-ticket"),
        (["alertname=NcclStragglerRank", "severity=info", "job=j"], "ncclwatch-null"),
        (["alertname=NcclTelemetryLoss", "severity=critical", "job=j"], "ncclwatch-telemetry"),
        (["alertname=NcclTelemetryLoss", "severity=info", "job=j"], "ncclwatch-null"),
        (["alertname=NcclwatchTestAlert", "severity=critical", "test=true"], "ncclwatch-page"),
        (["alertname=Other"], "ncclwatch-ticket"),
    ],
)
def test_shipped_routes_send_critical_to_page_warning_to_ticket_info_nowhere(labels, receiver):
    r = subprocess.run(
        [AMTOOL, "config", "routes", "test", f"--config.file={ALERTING / 'alertmanager.yml'}",
         *labels],
        capture_output=True, text=True, timeout=30,
    )
    assert r.stdout.strip() == receiver, r.stdout + r.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: prometheus)")
def test_shipped_rules_pass_promtool_check_rules():
    rules = ALERTING / "rules" / "ncclwatch.rules.yml"
    r = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


PROMTOOL_TEST = """
rule_files: [{rules}]
evaluation_interval: 15s
tests:
  # the training job is `training_job`; the scrape job and instance are aggregated away
  # (two workers exporting one key during a rebalance make one alert)
  - interval: 15s
    input_series:
      - series: 'ncclwatch_busbw_observed_bytes_per_second{{job="ncclwatch-worker", training_job="llm", comm="0xa", comm_name="dp", op="AllReduce", size_bucket="64MiB", transport="net", instance="w1:9466"}}'
        values: '40e9 40e9 40e9 30e9x10'
      - series: 'ncclwatch_busbw_observed_bytes_per_second{{job="ncclwatch-worker", training_job="llm", comm="0xa", comm_name="dp", op="AllReduce", size_bucket="64MiB", transport="net", instance="w2:9466"}}'
        values: '_ _ _ 30e9x10'
      - series: 'ncclwatch_busbw_baseline_bytes_per_second{{job="ncclwatch-worker", training_job="llm", comm="0xa", comm_name="dp", op="AllReduce", size_bucket="64MiB", transport="net", instance="w1:9466"}}'
        values: '40e9x13'
    alert_rule_test:
      - eval_time: 30s
        alertname: NcclCollectiveDegraded
        exp_alerts: []
      - eval_time: 2m30s
        alertname: NcclCollectiveDegraded
        exp_alerts:
          - exp_labels: {{training_job: llm, comm: "0xa", comm_name: dp, op: AllReduce, size_bucket: 64MiB, transport: net, severity: warning, source: prometheus}}
            exp_annotations:
              summary: "AllReduce 64MiB over net (comm 0xa) in job llm: bus bandwidth at 75% of baseline"
              description: "Observed bus bandwidth is 75% of its learned baseline for at least 1m (degraded below 90%)."
              runbook_url: "https://runbooks.example.com/ncclwatch/NcclCollectiveDegraded.md"
              dashboard_url: "https://grafana.example.com/d/ncclwatch-comm?var-job=llm&var-comm=0xa&var-op=AllReduce&var-transport=net&from=now-1h&to=now"
  # the straggler is the detector's verdict, not a threshold on the rank gauge (rank 4's
  # low gauge alone pages nobody)
  - interval: 15s
    input_series:
      - series: 'ncclwatch_anomaly_active{{job="ncclwatch-worker", training_job="llm", anomaly_type="straggler", comm="0xa", comm_name="", op="", size_bucket="", transport="", rank="3", severity="critical", node="gpu-node-7", Hostname="gpu-node-7", instance="w1:9466"}}'
        values: '1x10'
      - series: 'ncclwatch_rank_relative_exec_ratio{{job="ncclwatch-worker", training_job="llm", comm="0xa", comm_name="", rank="4", node="gpu-node-8", Hostname="gpu-node-8", instance="w1:9466"}}'
        values: '0.5x10'
    alert_rule_test:
      - eval_time: 1m
        alertname: NcclStragglerRank
        exp_alerts:
          - exp_labels: {{training_job: llm, anomaly_type: straggler, comm: "0xa", rank: "3", node: gpu-node-7, Hostname: gpu-node-7, severity: critical, source: prometheus}}
            exp_annotations:
              summary: "Straggler: rank 3 (node gpu-node-7) of comm 0xa in job llm keeps the other ranks waiting"
              description: "The ncclwatch detector names this rank as the one the others wait for at every collective of its communicator (ncclwatch:rank_relative_exec_ratio shows by how much)."
              runbook_url: "https://runbooks.example.com/ncclwatch/NcclStragglerRank.md"
              dashboard_url: "https://grafana.example.com/d/ncclwatch-comm?var-job=llm&var-comm=0xa&from=now-1h&to=now"
  # the attributed alerts carry the detector's severity: the same page as the alert sink
  - interval: 15s
    input_series:
      - series: 'ncclwatch_anomaly_active{{job="ncclwatch-worker", training_job="llm", anomaly_type="network_path", comm="", comm_name="", op="AllReduce", size_bucket="64MiB", transport="net", rank="", severity="critical", node="", Hostname="", instance="w1:9466"}}'
        values: '1x4'
      - series: 'ncclwatch_anomaly_active{{job="ncclwatch-worker", training_job="llm2", anomaly_type="intra_node", comm="0xb", comm_name="tp", op="AllGather", size_bucket="16MiB", transport="nvlink", rank="", severity="warning", node="n3", Hostname="n3", instance="w1:9466"}}'
        values: '1x4'
    alert_rule_test:
      - eval_time: 30s
        alertname: NcclNetworkPathDegraded
        exp_alerts:
          - exp_labels: {{training_job: llm, anomaly_type: network_path, op: AllReduce, size_bucket: 64MiB, transport: net, severity: critical, source: prometheus}}
            exp_annotations:
              summary: "Network path degraded in job llm: AllReduce 64MiB over net (comm )"
              description: "The ncclwatch detector attributes a sustained bus bandwidth loss to the network path (only ranks whose traffic crosses the network are slow)."
              runbook_url: "https://runbooks.example.com/ncclwatch/NcclNetworkPathDegraded.md"
              dashboard_url: "https://grafana.example.com/d/ncclwatch-comm?var-job=llm&var-comm=&var-op=AllReduce&var-transport=net&from=now-1h&to=now"
      - eval_time: 30s
        alertname: NcclIntraNodeDegraded
        exp_alerts:
          - exp_labels: {{training_job: llm2, anomaly_type: intra_node, comm: "0xb", comm_name: tp, op: AllGather, size_bucket: 16MiB, transport: nvlink, node: n3, Hostname: n3, severity: warning, source: prometheus}}
            exp_annotations:
              summary: "Intra-node (NVLink/PCIe) degradation in job llm2: AllGather 16MiB (comm 0xb)"
              description: "The ncclwatch detector attributes a sustained bus bandwidth loss to communication inside a node."
              runbook_url: "https://runbooks.example.com/ncclwatch/NcclIntraNodeDegraded.md"
              dashboard_url: "https://grafana.example.com/d/ncclwatch-comm?var-job=llm2&var-comm=0xb&var-op=AllGather&var-transport=nvlink&from=now-1h&to=now"
  # a forwarder with data waiting and no ack for 1000 s alerts; an idle one does not
  - interval: 15s
    input_series:
      - series: 'ncclwatch_forwarder_last_send_timestamp_seconds{{job="ncclwatch-forwarder", instance="n1:9465"}}'
        values: '0x20'
      - series: 'ncclwatch_forwarder_buffer_bytes{{job="ncclwatch-forwarder", instance="n1:9465"}}'
        values: '5000x20'
      - series: 'ncclwatch_forwarder_bytes_behind{{job="ncclwatch-forwarder", instance="n1:9465"}}'
        values: '0x20'
      - series: 'ncclwatch_forwarder_last_send_timestamp_seconds{{job="ncclwatch-forwarder", instance="n2:9465"}}'
        values: '0x20'
      - series: 'ncclwatch_forwarder_buffer_bytes{{job="ncclwatch-forwarder", instance="n2:9465"}}'
        values: '0x20'
      - series: 'ncclwatch_forwarder_bytes_behind{{job="ncclwatch-forwarder", instance="n2:9465"}}'
        values: '0x20'
    alert_rule_test:
      - eval_time: 4m
        alertname: NcclTelemetryLoss
        exp_alerts:
          - exp_labels: {{job: ncclwatch-forwarder, instance: "n1:9465", cause: forwarder_silent, severity: warning, source: prometheus}}
            exp_annotations:
              summary: "ncclwatch forwarder n1:9465 has sent nothing to Kafka for 4m 0s"
              description: "Records are waiting (buffered or unread) but none was acknowledged by Kafka for over 2 minutes: Kafka unreachable or refusing, or the forwarder stuck."
              runbook_url: "https://runbooks.example.com/ncclwatch/NcclTelemetryLoss.md"
              dashboard_url: "https://grafana.example.com/d/ncclwatch-pipeline?from=now-1h&to=now"
"""  # noqa: E501


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: prometheus)")
def test_rules_fire_on_synthetic_series_labelled_as_scraped(tmp_path):
    rules = tmp_path / "ncclwatch.rules.yml"
    rules.write_text(prom_rules.render(LINKS))
    test_file = tmp_path / "rules_test.yml"
    test_file.write_text(PROMTOOL_TEST.format(rules=rules))
    r = subprocess.run([PROMTOOL, "test", "rules", str(test_file)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_outbox_journal_is_private_whatever_the_umask(tmp_path):
    import os
    import stat

    old = os.umask(0)
    try:
        ob = Outbox(tmp_path / "alerts" / JOURNAL_NAME)
        ob.put("a", {"labels": {"job": "j"}}, "firing")
        ob.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "alerts").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "alerts" / JOURNAL_NAME).stat().st_mode) == 0o600


def test_outbox_on_a_full_disk_keeps_alerts_in_memory_and_rewrites_the_journal_after(
    small_fs, caplog
):
    import os

    clock = Clock()
    sink = make_sink(refused_url(), clock, state_dir=small_fs / "alerts")
    st = os.statvfs(small_fs)
    filler = small_fs / "filler"
    with open(filler, "wb") as f:  # the disk is full
        f.write(b"\0" * (st.f_bavail * st.f_frsize))
    ev = event()
    sink.handle(ev)  # raised OSError before
    sink.handle(event(id="an-2"))
    sink.handle(resolved(ev, T0_NS + 10**9))
    assert len(sink._outbox) == 2 and sink.pending() == 2
    assert len([r for r in caplog.records if "cannot be written" in r.getMessage()]) == 1
    filler.unlink()  # space is back: the next change rewrites everything
    sink.handle(event(id="an-3"))
    sink.close()
    again = Outbox(small_fs / "alerts" / JOURNAL_NAME)
    assert {e.key: (e.state, e.fire_first) for e in again.entries()} == {
        "an-1": ("resolved", True), "an-2": ("firing", False), "an-3": ("firing", False)}
    assert [p.name for p in (small_fs / "alerts").iterdir()] == [JOURNAL_NAME]  # no temp file


def test_a_flapping_link_says_so_in_its_summary_and_description():
    flapping = alerts.alert_from_event(
        event(type="network_path", attribution="network", evidence={"flapping": True}), LINKS)
    steady = alerts.alert_from_event(event(type="network_path", attribution="network"), LINKS)
    assert "(network path, flapping)" in flapping["annotations"]["summary"]
    assert "drops out and comes back" in flapping["annotations"]["description"]
    assert "flapping" not in steady["annotations"]["summary"]
    assert "drops out" not in steady["annotations"]["description"]
    assert flapping["labels"] == steady["labels"]  # the same alert to group, inhibit, silence
