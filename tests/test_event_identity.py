"""Anomaly events name where they are: a network path names the nodes at its ends (the
event's single ``host`` is null, since a path has two), and every place people read an
event (the console line, the alert summary) says so."""

from __future__ import annotations

from ncclwatch.alerting.alerts import AlertLinks, alert_from_event
from ncclwatch.detectors.console import format_event
from ncclwatch.detectors.pipeline import detect_all
from ncclwatch_testkit import scenarios

from ncclwatch.config import DetectorConfig


def network_events(name: str):
    records, _ = scenarios.generate(scenarios.by_name(name))
    hosts = sorted({r.host for r in records if r.KIND == "window" and r.transport in ("net", "mixed")})
    events = [e for e in detect_all(records, DetectorConfig()) if e.type == "network_path"]
    return events, hosts


def test_a_network_path_event_names_both_ends():
    events, hosts = network_events("network_step30_2x2")
    assert events and len(hosts) == 2
    for ev in events:
        assert ev.host is None and ev.evidence["hosts"] == hosts
    line = format_event(events[0])
    assert f"on {hosts[0]}, {hosts[1]}" in line


def test_the_alert_summary_names_the_nodes_too():
    events, hosts = network_events("network_step20_2x8")
    assert events
    summary = alert_from_event(events[0], AlertLinks())["annotations"]["summary"]
    assert all(h in summary for h in hosts), summary
