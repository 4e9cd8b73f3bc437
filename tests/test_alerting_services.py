"""The alerting path against the real Alertmanager and Prometheus of scripts/services.sh.

A real webhook receiver (HTTP on 127.0.0.1:0) stands in for on-call. Alertmanager runs
the shipped alerting/alertmanager.yml with the receiver URLs pointed at it and the
timings shortened (group_wait/group_interval 1 s), written over the services' config and
reloaded; the services' own config is put back afterwards. Every test uses its own
training-job id, so groups (by job) and assertions never mix with other tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ncclwatch.alerting.alertmanager import AlertmanagerClient, AlertmanagerRejected
from ncclwatch.alerting.alerts import AlertLinks
from ncclwatch.alerting.outbox import JOURNAL_NAME
from ncclwatch.alerting.prom_rules import render
from ncclwatch.alerting.sink import AlertSink
from ncclwatch.detectors.metrics import DetectorMetrics
from ncclwatch.detectors.pipeline import Pipeline
from ncclwatch.ingest.metrics import ForwarderMetrics
from ncclwatch_testkit import services as testing
from prometheus_client import start_http_server

from ncclwatch import cli
from ncclwatch.config import DetectorConfig
from ncclwatch.records import AnomalyEvent, ThroughputRecord, WindowSummary, from_json, to_dict

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

ALERTING = Path(__file__).resolve().parent.parent / "alerting"
SHIPPED_HOOK_BASE = "https://oncall.example.com/hooks/ncclwatch"


def shortened_am_config(hook_url: str) -> str:
    """The shipped Alertmanager config, receivers pointed at ``hook_url``, timings short."""
    text = (ALERTING / "alertmanager.yml").read_text()
    assert text.count(f"url: '{SHIPPED_HOOK_BASE}/") == 3
    text = text.replace(SHIPPED_HOOK_BASE, hook_url)
    for key, value in (("group_wait", "1s"), ("group_interval", "1s")):
        text, n = re.subn(rf"(?m)^(\s*{key}:) \S+$", rf"\1 {value}", text)
        assert n >= 1, key
    return text


@pytest.fixture(scope="module")
def webhook() -> Iterator[testing.WebhookReceiver]:
    hook = testing.WebhookReceiver()
    yield hook
    hook.close()


@pytest.fixture(scope="module")
def am(services: testing.Services, webhook: testing.WebhookReceiver) -> Iterator[str]:
    """Alertmanager running the shipped routing with our webhook; restored afterwards."""
    path = services.alertmanager_config_file
    original = path.read_text()
    install_am_config(services, webhook)
    yield services.alertmanager_url
    path.write_text(original)
    # from the endpoints file: Alertmanager may have come back on another port
    testing.reload(testing.Services.from_env_file().alertmanager_url)


def install_am_config(services: testing.Services, webhook: testing.WebhookReceiver) -> None:
    path = services.alertmanager_config_file
    tmp = path.with_name(path.name + ".ncclwatch-test")
    tmp.write_text(shortened_am_config(webhook.url))
    os.replace(tmp, path)
    testing.reload(services.alertmanager_url)
    # Reload answers before... nothing: it is synchronous, but check the routes took.
    status = testing.http_json(f"{services.alertmanager_url}/api/v2/status")
    assert webhook.url in status["config"]["original"]


# --- events -------------------------------------------------------------------------------


def anomaly(job: str, **over: Any) -> AnomalyEvent:
    now = time.time_ns()
    base = dict(
        id=testing.unique_name("an"), type="network_path", state="firing", job=job,
        key={"comm": "0x00000000000000ab", "comm_name": "dp", "op": "AllReduce",
             "size_bucket": "64MiB", "transport": "net"},
        host="node-3", rank=None, start_ns=now - 60 * 10**9, end_ns=None, detected_ns=now,
        baseline_busbw_gbs=40.0, observed_busbw_gbs=30.0, effect=0.25, attribution="network",
        throughput_delta=-0.13, severity="critical", evidence={"keys": 4},
    )
    base.update(over)
    return from_json({"v": 1, "kind": "anomaly", **base})


def resolved(ev: AnomalyEvent) -> AnomalyEvent:
    return from_json({**to_dict(ev), "state": "resolved", "end_ns": time.time_ns()})


def refused_url() -> str:
    """A loopback URL where nothing listens."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


LINKS = AlertLinks("https://grafana.example.com", "https://runbooks.example.com/ncclwatch")


def make_sink(url: str, **kw: Any) -> AlertSink:
    client = AlertmanagerClient(url, timeout_s=2, backoff_initial_s=0.5, backoff_max_s=2)
    return AlertSink(client=client, resend_interval_s=5, links=LINKS, **kw)


@contextlib.contextmanager
def ticking(sink: AlertSink, every_s: float = 0.5) -> Iterator[AlertSink]:
    """Tick the sink while the block runs, as the worker and ``watch`` do: a POST that
    failed (a loaded machine's 2 s timeout) is retried, active alerts are re-sent."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            sink.tick()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield sink
    finally:
        stop.set()
        t.join(5)


def is_firing(name: str) -> Callable[[str, dict], bool]:
    return lambda path, a: a["labels"]["alertname"] == name and a["status"] == "firing"


def is_resolved(name: str) -> Callable[[str, dict], bool]:
    return lambda path, a: a["labels"]["alertname"] == name and a["status"] == "resolved"


# --- Alertmanager ---------------------------------------------------------------------------


def test_anomaly_firing_then_resolved_reaches_on_call_with_labels_and_annotations(am, webhook):
    job = testing.unique_name("job")
    sink = make_sink(am)
    with ticking(sink):
        ev = anomaly(job)
        sink.handle(ev)
        got = webhook.wait(job, is_firing("NcclNetworkPathDegraded"))
        assert got["path"] == "/page"  # critical pages
        assert got["labels"] == {
            "alertname": "NcclNetworkPathDegraded", "training_job": job, "severity": "critical",
            "anomaly_id": ev.id, "source": "ncclwatch", "comm": "0x00000000000000ab",
            "op": "AllReduce", "size_bucket": "64MiB", "transport": "net", "node": "node-3",
        }
        ann = got["annotations"]
        assert "30.00 GB/s vs baseline 40.00 GB/s (-25.0%)" in ann["description"]
        assert "-13.0%" in ann["summary"]
        assert ann["runbook_url"] == "https://runbooks.example.com/ncclwatch/NcclNetworkPathDegraded.md"
        assert "/d/ncclwatch-comm?" in ann["dashboard_url"] and f"var-job={job}" in ann["dashboard_url"]

        sink.handle(resolved(ev))
        done = webhook.wait(job, is_resolved("NcclNetworkPathDegraded"))
        assert done["path"] == "/page" and done["labels"] == got["labels"]
        assert sink.pending() == 0 and sink.active() == 0


def test_warning_tickets_info_goes_nowhere_and_telemetry_loss_has_its_own_route(am, webhook):
    job = testing.unique_name("job")
    sink = make_sink(am)
    sink.handle(anomaly(job, type="collective_degraded", severity="warning", attribution="unknown"))
    # The straggler is on another communicator: one on the same would inhibit the
    # collective alert (the shipped rule), and whether the ticket went out first would
    # depend on timing (CI failed on it once: no ticket in 60 s).
    other_comm = {"comm": "0x00000000000000cd", "comm_name": "tp", "op": "AllReduce",
                  "size_bucket": "64MiB", "transport": "net"}
    sink.handle(anomaly(job, type="straggler", severity="info", rank=3, key=other_comm))
    sink.handle(anomaly(job, type="telemetry_loss", severity="critical", attribution="telemetry"))
    with ticking(sink):
        assert webhook.wait(job, is_firing("NcclCollectiveDegraded"), timeout_s=60)["path"] == "/ticket"
        assert webhook.wait(job, is_firing("NcclTelemetryLoss"), timeout_s=60)["path"] == "/telemetry"
        held = AlertmanagerClient(am).get_alerts(training_job=job, alertname="NcclStragglerRank")
        assert [r["name"] for r in held[0]["receivers"]] == ["ncclwatch-null"]
        assert "NcclStragglerRank" not in {a["labels"]["alertname"] for _, a in webhook.alerts(job)}


def test_network_path_alert_inhibits_collective_degraded_of_the_same_job_only(am, webhook):
    job, other = testing.unique_name("job"), testing.unique_name("job")
    sink = make_sink(am)
    with ticking(sink):
        sink.handle(anomaly(job, type="network_path", severity="warning"))
        webhook.wait(job, is_firing("NcclNetworkPathDegraded"))
        sink.handle(anomaly(job, type="collective_degraded", severity="warning"))
        sink.handle(anomaly(other, type="collective_degraded", severity="warning"))
        webhook.wait(other, is_firing("NcclCollectiveDegraded"))  # other job: not inhibited
        client = AlertmanagerClient(am)
        target = client.get_alerts(training_job=job, alertname="NcclCollectiveDegraded")[0]
        assert target["status"]["state"] == "suppressed" and target["status"]["inhibitedBy"]
        time.sleep(3)  # three group intervals: an uninhibited alert would have been notified
        names = [a["labels"]["alertname"] for _, a in webhook.alerts(job)]
        assert "NcclCollectiveDegraded" not in names


def test_sink_alert_inhibits_the_duplicate_from_prometheus_rules(am, webhook):
    job = testing.unique_name("job")
    with ticking(make_sink(am)) as sink:
        sink.handle(anomaly(job, type="straggler", severity="warning", rank=2))
        webhook.wait(job, is_firing("NcclStragglerRank"))
    # what the Prometheus rule would send for the same straggler
    AlertmanagerClient(am).post_alerts([{"labels": {
        "alertname": "NcclStragglerRank", "training_job": job, "comm": "0x00000000000000ab", "rank": "2",
        "severity": "warning", "source": "prometheus"}}])
    time.sleep(0.5)
    rule_alert = AlertmanagerClient(am).get_alerts(training_job=job, source="prometheus")[0]
    assert rule_alert["status"]["state"] == "suppressed"


def test_an_invalid_outbox_entry_is_rejected_by_alertmanager_and_does_not_block_others(
    am, webhook, tmp_path
):
    job = testing.unique_name("job")
    good, bad = anomaly(job, severity="warning"), anomaly(job, type="straggler", rank=1)
    sink = make_sink(refused_url(), state_dir=tmp_path)
    sink.handle(good)
    sink.handle(bad)
    sink.close()
    # Corrupt the journal the way a bug or an old version might: bad ends before it starts.
    journal = tmp_path / JOURNAL_NAME
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    for line in lines:
        if line["key"] == bad.id:
            line.update(state="resolved", ends_at_ns=bad.start_ns - 10**9)
    journal.write_text("".join(json.dumps(line) + "\n" for line in lines))

    sink = make_sink(am, state_dir=tmp_path)
    sink.tick()
    assert sink.stats()["rejected"] == 1 and sink.pending() == 0
    webhook.wait(job, is_firing("NcclNetworkPathDegraded"))
    with pytest.raises(AlertmanagerRejected, match="start time must be before end time"):
        AlertmanagerClient(am).post_alerts([{"labels": {"alertname": "X", "training_job": job},
                                             "startsAt": "2030-01-01T00:00:00Z",
                                             "endsAt": "2020-01-01T00:00:00Z"}])


def test_an_anomaly_that_fired_and_resolved_during_an_outage_is_notified_firing_then_resolved(
    am, webhook
):
    """Alertmanager unreachable for 20 s (a closed gate in front of it), the anomaly fires
    and resolves in the middle: once it is back, on-call gets one firing notification and
    then one resolved, and the first POST comes within seconds of the recovery."""
    job = testing.unique_name("job")
    gate = testing.TcpGate(am.split("//", 1)[1])
    client = AlertmanagerClient(f"http://{gate.address}", timeout_s=2)  # the default backoff
    sink = AlertSink(client=client, resend_interval_s=5, resolve_hold_s=4)
    ev = anomaly(job)
    t0 = time.monotonic()
    sink.handle(ev)
    while time.monotonic() - t0 < 20:
        if time.monotonic() - t0 > 8 and sink.active():
            sink.handle(resolved(ev))
        sink.tick()
        time.sleep(0.1)
    assert client.failures >= 4 and sink.pending() == 1
    gate.open()
    back = time.monotonic()
    first_post = None
    try:
        while time.monotonic() - back < 30:
            sink.tick()
            if first_post is None and sink.sent:
                first_post = time.monotonic() - back
            if sink.stats()["outbox"] == 0 and any(a["status"] == "resolved" for _, a in webhook.alerts(job)):
                break
            time.sleep(0.1)
        time.sleep(3)  # a few group intervals more: nothing else may come
    finally:
        gate.close()
    assert first_post is not None and first_post <= 6.0, first_post
    got = [(a["labels"]["alertname"], a["status"]) for _, a in webhook.alerts(job)]
    assert got == [("NcclNetworkPathDegraded", "firing"), ("NcclNetworkPathDegraded", "resolved")]
    assert sink.pending() == 0 and sink.active() == 0


def test_alert_test_command_sends_a_labelled_alert_and_resolves_it(am, webhook, capsys):
    job = testing.unique_name("job")
    rc = cli.main(["alert-test", "--url", am, "--severity", "critical", "--duration", "2",
                   "--job", job])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "routed to: ncclwatch-page" in out.out
    # not silent while it waits: it says when it resolves (a countdown bar on a terminal)
    assert "firing for 2 s, then resolving (Ctrl-C: resolve now)" in out.out
    assert out.out.index("routed to") < out.out.index("firing for") < out.out.index("resolved ")
    firing = webhook.wait(job, is_firing("NcclwatchTestAlert"))
    assert firing["path"] == "/page" and firing["labels"]["test"] == "true"
    webhook.wait(job, is_resolved("NcclwatchTestAlert"))


def test_alert_test_reports_what_alertmanager_holds_while_it_waits(am, webhook, capsys, monkeypatch):
    from ncclwatch.alerting import alert_test

    monkeypatch.setattr(alert_test, "PROGRESS_EVERY_S", 0.5)
    job = testing.unique_name("job")
    rc = cli.main(["alert-test", "--url", am, "--duration", "2.5", "--job", job])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert re.search(r"(?m)^  in Alertmanager: active; resolving in [12] s$", out.out), out.out


# --- Prometheus rules on scraped metrics ------------------------------------------------------


class DetectorRun:
    """The real detector pipeline and its real metrics, fed synthetic window summaries.

    Keys of one job: an AllReduce over the network that loses 30 % at t = 20 s (the
    detector fires network_path), a healthy NVLink AllGather, and a 4-rank communicator
    whose rank 3 starts arriving late at t = 20 s (its exec time drops to 0.6 of the
    others'); the job's throughput falls from 310 to 268 TFLOP/s per GPU at t = 20 s.
    Stream time starts 1000 s in the past, as in a replay, so the detector lags; its
    metrics say the input is a replay (``live=False``) unless told otherwise.
    """

    NET = "0x00000000000000a1"
    STRAGGLE = "0x00000000000000a2"
    NAMES = {NET: "dp", STRAGGLE: "tp"}

    def __init__(self, job: str, live: bool = False):

        self.job = job
        self.t0_s = int(time.time()) - 1000
        self.pipeline = Pipeline(DetectorConfig(warmup_windows=5))
        self.metrics = DetectorMetrics(live=live).bind(self.pipeline)
        self.registry = self.metrics.registry
        self.events: list[AnomalyEvent] = []

    def _window(self, t: int, comm: str, op: str, size_bucket: str, transport: str, rank: int,
                nranks: int, busbw: float, exec_scale: float = 1.0) -> WindowSummary:
        return WindowSummary(
            job=self.job, host=f"node-{rank}", comm=comm, comm_name=self.NAMES[comm], op=op,
            size_bucket=size_bucket, transport=transport, rank=rank, nranks=nranks,
            start_ns=(self.t0_s + t) * 10**9, end_ns=(self.t0_s + t + 1) * 10**9, count=10,
            bytes=10 << 26, exec_ns_min=1, exec_ns_p50=int(exec_scale * 67e6 / busbw),
            exec_ns_p95=1, exec_ns_max=1, busbw_gbs_p50=busbw, first_seq=10 * t,
            last_seq=10 * t + 9, gpu=f"GPU-node-{rank}-0",
        )

    def feed(self, seconds: range) -> None:
        p, w = self.pipeline, self._window
        for t in seconds:
            bad = t >= 20
            for r in (0, 1):
                self.events += p.process(w(t, self.NET, "AllReduce", "64MiB", "net", r, 2,
                                           28.0 if bad else 40.0))
                self.events += p.process(w(t, self.NET, "AllGather", "1MiB", "nvlink", r, 2, 100.0))
            for r in range(4):
                # rank 3 arrives 2.7 ms late for each of 10 ops a second: the others wait
                # 2.7 % of the time (a straggler keeps them waiting: straggler_min_wait)
                scale = 0.6 if bad and r == 3 else 1.0
                self.events += p.process(w(t, self.STRAGGLE, "AllReduce", "16MiB", "nvlink", r, 4,
                                           10.0, exec_scale=scale))
            self.events += p.process(ThroughputRecord(
                job=self.job, host="node-0", rank=-1, ts_ns=(self.t0_s + t + 1) * 10**9, step=t,
                tflops_per_gpu=268.0 if bad else 310.0, tokens_per_s=None, source="fixture"))


def forwarder_metrics(job: str, *, stuck: bool):
    """The forwarder's real metrics: stuck (data waiting, Kafka silent) or idle."""
    m = ForwarderMetrics()
    m.last_send.set(time.time() - 1000)  # nothing acknowledged for 1000 s
    if stuck:
        m.buffer_bytes.set(5_000_000)
    return m


class Targets:
    """Adds scrape targets to the services' file_sd file (shared: read-modify-write, locked)."""

    def __init__(self, path: Path):
        self.path = path

    def _edit(self, change: Callable[[list], list]) -> None:
        with open(self.path.with_name(self.path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            groups = json.loads(self.path.read_text() or "[]") if self.path.exists() else []
            tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(change(groups)))
            os.replace(tmp, self.path)

    def add(self, target: str, **labels: str) -> None:
        self._edit(lambda gs: [*gs, {"targets": [target], "labels": labels}])

    def remove(self, target: str) -> None:
        self._edit(lambda gs: [g for g in gs if target not in g.get("targets", [])])


def prom_alerts(prometheus_url: str) -> list[dict]:
    return testing.http_json(f"{prometheus_url}/api/v1/alerts")["data"]["alerts"]


def test_rules_pass_promtool_and_fire_on_scraped_detector_metrics(services, prometheus_url, tmp_path):
    rules = tmp_path / "ncclwatch.rules.yml"
    rules.write_text(render(LINKS))  # what `ncclwatch alert-rules` prints with links configured
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: scripts/setup.sh installs the prometheus package"
    check = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr

    job = testing.unique_name("job")
    detector = DetectorRun(job)
    detector.feed(range(20))  # healthy: baselines learnt, 310 TFLOP/s
    assert detector.events == []
    stuck, idle = forwarder_metrics(job, stuck=True), forwarder_metrics(job, stuck=False)
    live = DetectorMetrics(live=True)  # a live detector 1000 s behind its input
    live.worker_batch(None, lag_s=1000.0)
    servers = [start_http_server(0, addr="127.0.0.1", registry=r)[0]
               for r in (detector.registry, stuck.registry, idle.registry, live.registry)]
    target, stuck_target, idle_target, live_target = (f"127.0.0.1:{h.server_address[1]}" for h in servers)
    down_target = refused_url().removeprefix("http://")  # a forwarder whose process is gone
    # The shipped rules with their `for:` durations cut to 1 s; expressions unchanged.
    text, n = re.subn(r"(?m)^(\s*for:) \S+$", r"\1 1s", rules.read_text())
    assert n >= 5
    rule_file = services.prometheus_rules_dir / f"{testing.unique_name('alerting')}.yml"
    rule_file.write_text(text)
    targets = Targets(services.prometheus_targets_file)
    for t in (target, stuck_target, idle_target, live_target):
        targets.add(t)
    targets.add(down_target, job="ncclwatch-forwarder")  # scraped as dashboards/prometheus.yml names it
    try:
        testing.reload(prometheus_url)
        stuck.plugin_drops(job, "node-3", 4242, "ring_full", 1)
        testing.wait_prometheus(
            prometheus_url, f'ncclwatch_job_flops_per_second_per_gpu{{training_job="{job}"}}', timeout=20)
        time.sleep(3)  # a few scrapes of the healthy state before the degradation
        stuck.plugin_drops(job, "node-3", 4242, "ring_full", 6)  # increase() > 0
        detector.feed(range(20, 40))  # the network degrades, rank 3 straggles, throughput falls
        assert ("network_path", "firing") in {(e.type, e.state) for e in detector.events}

        want = {
            ("NcclCollectiveDegraded", "AllReduce"),
            ("NcclNetworkPathDegraded", "AllReduce"),
            ("NcclStragglerRank", "3"),
            ("NcclJobThroughputDrop", ""),
            ("NcclTelemetryLoss", "plugin_drops"),
            ("NcclTelemetryLoss", "detector_lag"),
            ("NcclTelemetryLoss", "forwarder_silent"),
            ("NcclTelemetryLoss", "target_down"),
        }
        seen: set[tuple[str, str]] = set()
        firing: list[dict] = []
        deadline = time.monotonic() + 30
        while not want <= seen and time.monotonic() < deadline:
            firing = [
                a for a in prom_alerts(prometheus_url)
                if a["state"] == "firing"
                and (a["labels"].get("training_job") == job
                     or a["labels"].get("instance") in (target, stuck_target, idle_target, live_target,
                                                       down_target))
            ]
            for a in firing:
                lab = a["labels"]
                detail = lab.get("op") or lab.get("cause", "")
                if lab["alertname"] == "NcclStragglerRank":
                    detail = lab["rank"]  # the verdict's series also carries its key's op
                if lab["alertname"] == "NcclTelemetryLoss":
                    detail = lab["cause"]
                    if detail == "forwarder_silent":
                        detail += "@idle" if lab["instance"] == idle_target else ""
                    expected_at = {"detector_lag": live_target, "target_down": down_target}
                    if detail in expected_at and lab["instance"] != expected_at[detail]:
                        detail += "@other"
                seen.add((lab["alertname"], detail))
            time.sleep(0.5)
        assert want <= seen, f"missing {want - seen}; firing: {firing}"
        # The healthy key and rank do not fire, and the training job is in `training_job`
        # (this Prometheus scrapes without honor_labels: nothing collides, nothing renamed).
        assert ("NcclCollectiveDegraded", "AllGather") not in seen
        assert not {("NcclStragglerRank", r) for r in "012"} & seen
        # The detector's verdict names the rank's node, which the alert carries.
        assert {a["labels"].get("node") for a in firing if a["labels"]["alertname"] == "NcclStragglerRank"} \
            == {"node-3"}
        assert ("NcclTelemetryLoss", "forwarder_silent@idle") not in seen
        # the replay lags 1000 s too, which is the recording's age, not lateness; and only
        # the target that is down is
        assert ("NcclTelemetryLoss", "detector_lag@other") not in seen
        assert ("NcclTelemetryLoss", "target_down@other") not in seen
        for a in firing:
            lab = a["labels"]
            if lab["alertname"] != "NcclTelemetryLoss" or lab["cause"] == "plugin_drops":
                assert lab["training_job"] == job and "exported_job" not in lab
                assert "job" not in lab  # the scrape job is aggregated away, as `instance`
            assert lab["source"] == "prometheus"
    finally:
        for t in (target, stuck_target, idle_target, live_target, down_target):
            targets.remove(t)
        rule_file.unlink()
        testing.reload(prometheus_url)
        for h in servers:
            h.shutdown()
            h.server_close()


def test_alert_raised_during_an_alertmanager_outage_and_a_pending_resolution_survive_it(
    services, am, webhook, tmp_path
):
    # Last in this module: Alertmanager restarts, possibly on another port.
    job = testing.unique_name("job")
    sink = make_sink(am, state_dir=tmp_path)
    before = anomaly(job, type="network_path", severity="critical")
    sink.handle(before)
    webhook.wait(job, is_firing("NcclNetworkPathDegraded"))

    testing.stop_service("alertmanager")
    try:
        t_down = time.monotonic()
        during = anomaly(job, type="straggler", severity="critical", rank=5)
        sink.handle(during)  # refused: kept in the outbox
        sink.handle(resolved(before))  # the resolution too
        assert sink.pending() == 2
        sink.close()  # ... and the process "restarts" while Alertmanager is still down
        sink = make_sink(am, state_dir=tmp_path)
        assert sink.pending() == 2
        stayed_down = True
        while time.monotonic() - t_down < 30:
            sink.tick()  # retried with backoff, refused
            # The services are shared: another session's fixture may start Alertmanager
            # again before our 30 s are up. Only while it is really down must all stay put.
            if testing.is_running("alertmanager"):
                stayed_down = False
                break
            assert sink.pending() == 2
            time.sleep(1)
        if stayed_down:
            assert sink.client.failures >= 3
    finally:
        restarted = testing.start_service("alertmanager")
    install_am_config(restarted, webhook)  # services.sh start wrote its default config
    sink.client.url = restarted.alertmanager_url  # same port unless it was taken meanwhile
    deadline = time.monotonic() + 10
    while sink.pending() and time.monotonic() < deadline:
        sink.tick()
        time.sleep(0.2)
    assert sink.pending() == 0
    webhook.wait(job, is_firing("NcclStragglerRank"))
    webhook.wait(job, is_resolved("NcclNetworkPathDegraded"))


def test_ncclwatch_series_join_dcgm_and_inspector_series_as_they_are_in_prometheus(services, prometheus_url):
    """The straggler's node, as the detector names it, joins what the cluster already has.

    ncclwatch's rank and anomaly series carry the host under both names the cluster's
    exporters use: ``Hostname`` (DCGM exporter) and ``node`` (NCCL Inspector), the GPU as
    DCGM's ``UUID``, and the communicator's name as Inspector's ``comm_name``. Every join below is on labels as
    scraped: no ``label_replace``, no relabelling.
    """
    from prometheus_client import CollectorRegistry, Gauge

    job = testing.unique_name("job")
    detector = DetectorRun(job)
    detector.feed(range(40))  # rank 3 of the 4-rank communicator straggles from t = 20 s
    (straggler,) = [e for e in detector.events if e.type == "straggler"]
    node = straggler.host
    assert node  # node-3, from the windows' host

    # DCGM exporter and Inspector as they label their series (values are per GPU / key).
    others = CollectorRegistry()
    util = Gauge("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).",
                 ("gpu", "UUID", "device", "modelName", "Hostname"), registry=others)
    for host in (node, "node-0"):
        for gpu in range(2):
            util.labels(str(gpu), f"GPU-{host}-{gpu}", f"nvidia{gpu}", "NVIDIA H200", host).set(
                30 + gpu if host == node else 90)
    busbw = Gauge("nccl_bus_bandwidth_gbs", "Inspector: bus bandwidth, GB/s",
                  ("slurm_job_id", "node", "gpu", "comm_name", "collective", "message_size"),
                  registry=others)
    busbw.labels(job, node, "GPU3", "tp", "AllReduce", "8-16MB").set(71.5)
    busbw.labels(job, "node-0", "GPU0", "tp", "AllReduce", "8-16MB").set(160.0)
    busbw.labels(job, "node-0", "GPU0", "dp", "AllReduce", "32-64MB").set(28.0)

    servers = [start_http_server(0, addr="127.0.0.1", registry=r)[0]
               for r in (detector.registry, others)]
    addrs = [f"127.0.0.1:{h.server_address[1]}" for h in servers]
    targets = Targets(services.prometheus_targets_file)
    for t in addrs:
        targets.add(t)
    try:
        testing.reload(prometheus_url)
        mine, theirs = (f'instance="{a}"' for a in addrs)
        testing.wait_prometheus(prometheus_url, f"ncclwatch_anomaly_active{{{mine}}}", timeout=20)
        testing.wait_prometheus(prometheus_url, f"nccl_bus_bandwidth_gbs{{{theirs}}}", timeout=20)
        # The straggling rank's GPUs, from DCGM: joined on the host the detector names.
        rows = testing.prometheus_query(
            prometheus_url,
            f'max by (Hostname, rank) (ncclwatch_anomaly_active{{{mine}, anomaly_type="straggler"}})'
            f' * on (Hostname) group_right (rank) DCGM_FI_DEV_GPU_UTIL{{{theirs}}}')
        got = sorted((r["metric"]["Hostname"], r["metric"]["rank"], r["metric"]["gpu"], float(r["value"][1]))
                     for r in rows)
        assert got == [(node, "3", "0", 30.0), (node, "3", "1", 31.0)], rows
        # ... and, where the windows carry the GPU's UUID, exactly its GPU.
        rows = testing.prometheus_query(
            prometheus_url,
            f'max by (UUID, rank) (ncclwatch_anomaly_active{{{mine}, anomaly_type="straggler"}})'
            f' * on (UUID) group_right (rank) DCGM_FI_DEV_GPU_UTIL{{{theirs}}}')
        assert [(r["metric"]["UUID"], r["metric"]["rank"], float(r["value"][1])) for r in rows] \
            == [(f"GPU-{node}-0", "3", 30.0)], rows
        # Inspector's own series join as they are, on node and comm_name: its bandwidth for
        # the straggler's communicator on that node.
        rows = testing.prometheus_query(
            prometheus_url,
            f"max by (node, comm_name) (nccl_bus_bandwidth_gbs{{{theirs}}})"
            f' and on (node, comm_name) ncclwatch_rank_relative_exec_ratio{{{mine}, rank="3"}}')
        assert [(r["metric"]["node"], r["metric"]["comm_name"], float(r["value"][1])) for r in rows] \
            == [(node, "tp", 71.5)], rows
        # Same communicator, same quantity: ncclwatch's bytes/s over 1e9 is Inspector's GB/s
        # (docs/metrics.md), joined on comm_name.
        rows = testing.prometheus_query(
            prometheus_url,
            f'max by (comm_name) (ncclwatch_busbw_observed_bytes_per_second{{{mine}, size_bucket="64MiB"}}) / 1e9'
            f' / on (comm_name) min by (comm_name) (nccl_bus_bandwidth_gbs{{{theirs}, message_size="32-64MB"}})')
        assert [(r["metric"]["comm_name"], round(float(r["value"][1]), 3)) for r in rows] == [("dp", 1.0)], rows
    finally:
        for t in addrs:
            targets.remove(t)
        testing.reload(prometheus_url)
        for h in servers:
            h.shutdown()
            h.server_close()
