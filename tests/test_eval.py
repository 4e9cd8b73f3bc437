"""`ncclwatch eval`: precision, recall, delay and attribution on hand-computed cases."""

from __future__ import annotations

import json

import pytest
from ncclwatch.detectors.evaluate import evaluate, evaluate_one
from ncclwatch.detectors.labels import Label, LabelSet

from ncclwatch import cli
from ncclwatch.records import AnomalyEvent, to_json

S = 10**9
KEY = {"comm": None, "comm_name": None, "op": None, "size_bucket": None, "transport": None}


def ev(i, type_, state, start, det, end=None, *, attribution=None, host=None, rank=None,
       severity="warning", job="j", comm=None):
    attribution = attribution or {
        "network_path": "network", "straggler": "straggler", "intra_node": "intra_node",
        "telemetry_loss": "telemetry"}.get(type_, "unknown")
    return AnomalyEvent(
        id=f"{i:016x}", type=type_, state=state, job=job, key={**KEY, "comm": comm}, host=host,
        rank=rank, start_ns=start * S, end_ns=None if end is None else end * S,
        detected_ns=det * S, baseline_busbw_gbs=None, observed_busbw_gbs=None, effect=0.2,
        attribution=attribution, throughput_delta=None, severity=severity, evidence={})


LABELS = LabelSet(scenario="hand", job="j", labels=[
    Label(start_ns=100 * S, end_ns=150 * S, type="network_path", attribution="network",
          severity="critical"),
    Label(start_ns=300 * S, end_ns=350 * S, type="straggler", attribution="straggler",
          host="nB", rank=2, comm="0xc"),
    Label(start_ns=500 * S, end_ns=540 * S, type="intra_node", attribution="intra_node"),
    Label(start_ns=700 * S, end_ns=720 * S, type="network_path", attribution="network",
          optional=True),
])

EVENTS = [
    ev(1, "network_path", "firing", 100, 103),
    ev(1, "network_path", "firing", 100, 108, severity="critical"),  # escalation
    ev(2, "collective_degraded", "firing", 301, 305, host="nB", rank=2, comm="0xc"),
    ev(3, "throughput_drop", "firing", 200, 203),
    ev(1, "network_path", "resolved", 100, 153, 150, severity="critical"),
    ev(3, "throughput_drop", "resolved", 200, 212, 210),
    ev(5, "straggler", "firing", 320, 330, host="nB", rank=2, comm="0xc"),
    ev(2, "collective_degraded", "resolved", 301, 353, 350, host="nB", rank=2),
    ev(5, "straggler", "resolved", 320, 352, 349, host="nB", rank=2, comm="0xc"),
    ev(4, "network_path", "firing", 702, 705),
    ev(4, "network_path", "resolved", 702, 722, 719),
    ev(6, "intra_node", "firing", 900, 903),  # never resolves
]


def test_hand_computed_precision_recall_delay_and_attribution():
    report = evaluate([(LABELS, EVENTS)])
    t = report["total"]
    assert (t["labels"], t["detected"]) == (3, 2)
    assert (t["anomalies_tp"], t["anomalies_fp"]) == (3, 2)
    assert t["recall"] == pytest.approx(2 / 3)
    assert t["precision"] == pytest.approx(3 / 5)
    assert t["f1"] == pytest.approx(2 * 0.6 * (2 / 3) / (0.6 + 2 / 3))
    assert t["delay_s"] == {"n": 2, "p50": 3.0, "p90": 5.0, "max": 5.0, "mean": 4.0}
    # the straggler was first reported as collective_degraded: attribution wrong
    assert t["attribution_accuracy"] == 0.5
    assert t["severity_accuracy"] == 1.0
    bt = report["by_type"]
    assert (bt["straggler"]["anomalies_tp"], bt["network_path"]["anomalies_tp"]) == (2, 1)
    assert bt["throughput_drop"]["anomalies_fp"] == 1 and bt["intra_node"]["anomalies_fp"] == 1
    assert bt["intra_node"]["recall"] == 0.0


def test_attribution_checks_host_and_rank_of_the_label():
    lb = LabelSet(scenario="s", job="j", labels=[Label(
        start_ns=0, end_ns=10 * S, type="straggler", attribution="straggler", host="nB", rank=2,
        comm="0xc")])
    right = [ev(1, "straggler", "firing", 0, 3, host="nB", rank=2, comm="0xc")]
    wrong_rank = [ev(1, "straggler", "firing", 0, 3, host="nB", rank=1, comm="0xc")]
    other_comm = [ev(1, "straggler", "firing", 0, 3, host="nB", rank=5, comm="0xd")]
    wrong_host = [ev(1, "straggler", "firing", 0, 3, host="nA", rank=2, comm="0xc")]
    acc = [evaluate_one(lb, e).total.attributed for e in (right, wrong_rank, other_comm,
                                                          wrong_host)]
    assert acc == [1, 0, 1, 0]


def test_tolerance_decides_whether_nearby_events_match():
    lb = LabelSet(scenario="s", job="j", labels=[Label(
        start_ns=100 * S, end_ns=120 * S, type="network_path", attribution="network")])
    near = [ev(1, "network_path", "firing", 90, 93), ev(1, "network_path", "resolved", 90, 98, 96)]
    assert evaluate_one(lb, near, tolerance_s=5).total.detected == 1
    assert evaluate_one(lb, near, tolerance_s=1).total.fp == 1


def test_events_of_another_job_never_match():
    other = [ev(1, "network_path", "firing", 100, 103, job="k")]
    r = evaluate_one(LABELS, other).total
    assert (r.detected, r.fp) == (0, 1)


def test_no_events_on_a_steady_stream_is_perfect_precision_and_undefined_recall():
    steady = LabelSet(scenario="steady", job="j", labels=[])
    s = evaluate([(steady, [])])["total"]
    assert (s["precision"], s["recall"], s["anomalies_fp"]) == (None, None, 0)


def test_labels_format_rejects_unknown_fields_and_bad_intervals():
    with pytest.raises(ValueError, match="unknown field"):
        LabelSet.from_dict({"scenario": "s", "job": "j", "labels": [
            {"start_ns": 1, "end_ns": 2, "type": "straggler", "attribution": "straggler",
             "colour": "red"}]})
    with pytest.raises(ValueError, match="start_ns <= end_ns"):
        LabelSet.from_dict({"scenario": "s", "job": "j", "labels": [
            {"start_ns": 3, "end_ns": 2, "type": "straggler", "attribution": "straggler"}]})


def test_labels_round_trip_through_their_json_file(tmp_path):
    path = tmp_path / "hand.labels.json"
    LABELS.save(path)
    again = LabelSet.load(path)
    assert again.labels == LABELS.labels and again.scenario == "hand"


def test_eval_command_prints_a_table_and_json(tmp_path, capsys):
    LABELS.save(tmp_path / "hand.labels.json")
    (tmp_path / "hand.events.jsonl").write_text("".join(to_json(e) + "\n" for e in EVENTS))
    assert cli.main(["eval", str(tmp_path / "hand.labels.json"),
                     str(tmp_path / "hand.events.jsonl"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["total"]["detected"] == 2 and report["scenarios"][0]["scenario"] == "hand"
    assert cli.main(["eval", "--dir", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "hand" in table and "TOTAL" in table and "67%" in table and "60%" in table
    assert cli.main(["eval", str(tmp_path / "hand.labels.json")]) == 2
