"""The labelled scenario suite through the Pipeline: what operators are promised.

Every sustained degradation of 12 % or more that costs the job at least the throughput
gate (5 %, a point of margin either side) is detected and attributed correctly, the comm
ones within 5 s (P90, stream time) of their start, and steady streams, spikes,
sub-threshold losses and losses that cost the job less raise nothing. ``pytest -s``
prints the table; a failure prints it.
"""

from __future__ import annotations

import pytest
from ncclwatch.detectors.evaluate import evaluate, percentile, table
from ncclwatch.detectors.pipeline import detect_all
from ncclwatch_testkit import scenarios

from ncclwatch.config import DetectorConfig

COMM_TYPES = {"network_path", "intra_node", "straggler", "collective_degraded"}


@pytest.fixture(scope="module")
def suite_report():
    cfg = DetectorConfig()
    pairs = []
    for sc in scenarios.suite():
        records, labels = scenarios.generate(sc)
        pairs.append((labels, detect_all(records, cfg)))
    report = evaluate(pairs)
    text = table(report)
    print("\n" + text)
    return report, text


def test_the_suite_covers_every_topology_and_fault_kind():
    suite = scenarios.suite()
    topologies = {(sc.nodes, sc.gpus_per_node) for sc in suite}
    assert {(1, 2), (2, 2), (4, 1), (2, 8)} <= topologies
    kinds = {f.kind for sc in suite for f in sc.faults}
    assert kinds == set(scenarios.FAULT_KINDS)
    assert any(f.ramp_s for sc in suite for f in sc.faults)


def test_every_sustained_degradation_is_detected(suite_report):
    report, text = suite_report
    missed = [
        (s["scenario"], m["type"]) for s in report["scenarios"] for m in s["matches"]
        if not m["detected"]
    ]
    assert missed == [], text
    assert report["total"]["recall"] == 1.0, text


def test_every_detection_is_attributed_correctly(suite_report):
    report, text = suite_report
    wrong = [
        (s["scenario"], m["type"], m.get("got_type"), m.get("got_attribution"))
        for s in report["scenarios"] for m in s["matches"]
        if m["detected"] and not m["attribution_ok"]
    ]
    assert wrong == [], text


def test_no_false_alerts_on_steady_streams_spikes_or_subthreshold_losses(suite_report):
    report, text = suite_report
    fps = {s["scenario"]: s["false_positives"] for s in report["scenarios"]
           if s["false_positives"]}
    assert fps == {}, text
    quiet = [s for s in report["scenarios"] if s["scenario"].startswith(("steady", "spikes"))]
    assert len(quiet) >= 6 and all(s["anomalies_tp"] + s["anomalies_fp"] == 0 for s in quiet)


def test_comm_degradations_are_detected_within_5_s_at_p90(suite_report):
    report, text = suite_report
    # Measured from when the data could be there: a forwarder that publishes late delays
    # everything by its lag past the usual ~1 s (the scenarios' default).
    lag = {sc.name: max(0.0, max(sc.forwarder_delay_s, default=1.0) - 1.0)
           for sc in scenarios.suite()}
    # The target is for a sustained degradation: a link dropping out every few seconds
    # can only be told from a spike by its next drop-out (tests/test_flapping.py bounds it).
    pulsed = {sc.name for sc in scenarios.suite() if any(f.pulse_s for f in sc.faults)}
    assert pulsed
    delays = sorted(
        m["delay_s"] - lag[s["scenario"]] for s in report["scenarios"] for m in s["matches"]
        if m["detected"] and m["type"] in COMM_TYPES and s["scenario"] not in pulsed
    )
    assert len(delays) >= 15
    assert percentile(delays, 90) <= 5.0, text
    assert min(delays) >= 0, "detected before the fault began"


def test_severity_follows_the_throughput_cost(suite_report):
    report, text = suite_report
    assert report["total"]["severity_accuracy"] == 1.0, text


def test_generation_is_deterministic_per_seed():
    sc = scenarios.by_name("straggler_2x2")
    a, la = scenarios.generate(sc)
    b, lb = scenarios.generate(sc)
    assert a == b and la.to_dict() == lb.to_dict()


def test_a_straggler_has_the_shortest_kernel_time_while_the_others_wait():
    sc = scenarios.by_name("straggler_2x2")
    records, _ = scenarios.generate(sc)
    world = scenarios.communicators(sc)[0]
    t = scenarios.STREAM_START_NS + 80 * 10**9  # inside the fault
    ws = [r for r in records if r.KIND == "window" and r.comm == world.hash
          and r.start_ns == t and r.size_bucket == "64MiB"]
    by_rank = {w.rank: w.exec_ns_p50 for w in ws}
    assert min(by_rank, key=by_rank.__getitem__) == 3
    healthy = [r for r in records if r.KIND == "window" and r.comm == world.hash
               and r.start_ns == scenarios.STREAM_START_NS + 20 * 10**9
               and r.size_bucket == "64MiB"]
    before = sorted(w.busbw_gbs_p50 for w in healthy)[1]
    during = sorted(w.busbw_gbs_p50 for w in ws)[1]
    assert 0.6 < during / before < 0.8  # the others lose ~30 %


def test_scenario_files_are_written_for_replay(tmp_path):
    from ncclwatch.detectors.labels import LabelSet

    from ncclwatch.records import parse_line

    assert scenarios.main(["write", str(tmp_path), "--only", "telemetry_drops_2x2"]) == 0
    lines = (tmp_path / "telemetry_drops_2x2.records.jsonl").read_text().splitlines()
    kinds = {parse_line(line).KIND for line in lines}
    assert kinds == {"window", "throughput", "drop"}
    labels = LabelSet.load(tmp_path / "telemetry_drops_2x2.labels.json")
    assert [lb.type for lb in labels.labels] == ["telemetry_loss"]
