"""Poison lines: one hostile line is quarantined (or dead-lettered) with its reason, and
every reader goes on: the forwarder, ``watch``, ``replay`` and the worker.

Each line here once crashed a reader or passed the contract (issue 15): nesting deep
enough for ``RecursionError``, lone surrogate escapes (valid JSON, no Unicode, so every
later ``.encode()`` raised), NaN/Infinity/1e999, integers past 64 bits, a start time
near 2^63 ns that stopped a process's windows, and a drop reason outside the closed set.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ncclwatch.detectors.messages import DETECTOR_KINDS, Message, decode_message
from ncclwatch.ingest.forward import Forwarder, Options
from ncclwatch.ingest.metrics import ForwarderMetrics
from ncclwatch.ingest.parse import parse
from ncclwatch_testkit import services as testing
from ncclwatch_testkit.drivers import (
    WorkerProcess,
    config_of,
    create_topics,
    publish,
    read_events,
    read_topic,
    reference_events,
    topics_env,
    window_scenario,
    write_spool,
)
from ncclwatch_testkit.synth import stream_lines
from ncclwatch_testkit.synth import write_spool as synth_spool
from test_ingest_forward_kafka import consume, make_cfg, records_of

from ncclwatch import cli, records
from ncclwatch.records import OpRecord, PluginStats, Quarantined, to_json

GOOD_OP = json.loads(stream_lines(job="job-1", host="node001", pid=1000, gpu="GPU-0000", rank=0, n=1)[0])


def op_with(**fields) -> bytes:
    return json.dumps({**GOOD_OP, **fields}).encode()


def op_text(field: str, json_text: str) -> bytes:
    """The good op with one field's value replaced by raw JSON text."""
    return json.dumps({**GOOD_OP, field: "@MARK@"}).replace('"@MARK@"', json_text).encode()


STATS = records.to_dict(PluginStats(job="job-1", host="node001", pid=1000, gpu="GPU-0000",
                                    ts_ns=GOOD_OP["start_ns"], recorded=1, dropped={}, segment=0))

# (name, line, reason)
POISON = [
    ("deep-array", b"[" * 20000, "too_deep"),
    ("deep-in-a-field", op_text("comm_name", "[" * 5000 + "]" * 5000), "too_deep"),
    ("surrogate-job", op_text("job", '"a\\udcffb"'), "not_unicode"),
    ("surrogate-op", op_text("op", '"All\\ud800Reduce"'), "not_unicode"),
    ("surrogate-comm-name", op_text("comm_name", '"\\udfff"'), "not_unicode"),
    ("nan-busbw", op_text("busbw_gbs", "NaN"), "not_finite"),
    ("infinity-algbw", op_text("algbw_gbs", "Infinity"), "not_finite"),
    ("overflow-busbw", op_text("busbw_gbs", "1e999"), "not_finite"),
    ("seq-2^70", op_with(seq=2**70), "out_of_range"),
    ("bytes-2^64", op_with(bytes=2**64), "out_of_range"),
    ("start-near-2^63", op_with(start_ns=2**63 - 10**9), "out_of_range"),
    ("start-past-2100", op_with(start_ns=4_102_444_800 * 10**9), "out_of_range"),
    ("exec-two-days", op_with(exec_ns=2 * 86_400 * 10**9), "out_of_range"),
    ("drop-reason-not-in-the-set", json.dumps({**STATS, "dropped": {"evil\nlabel": 3}}).encode(), "schema"),
    ("drop-count-2^64", json.dumps({**STATS, "dropped": {"pool_full": 2**64}}).encode(), "out_of_range"),
]
IDS = [p[0] for p in POISON]


@pytest.mark.parametrize("name,line,reason", POISON, ids=IDS)
def test_the_contract_quarantines_each_poison_line_with_its_reason(name, line, reason):
    slow = records.parse_line(line, source="s", offset=9)
    assert isinstance(slow, Quarantined), slow
    assert slow.reason == reason, slow.detail
    assert parse(line, source="s", offset=9) == slow  # the forwarder's fast path agrees
    to_json(slow).encode()  # the quarantine record itself is clean, encodable JSON


def test_the_contract_documents_its_windows_and_accepts_their_edges():
    assert records.parse_line(op_with(start_ns=0, exec_ns=86_400 * 10**9)).KIND == "op"
    assert records.parse_line(op_with(start_ns=records.TIME_MAX_NS - 86_400 * 10**9)).KIND == "op"
    assert records.parse_line(op_with(seq=2**63 - 1, bytes=2**63 - 1)).KIND == "op"
    assert records.parse_line(op_with(peer=-(2**63))).KIND == "op"
    doc = (Path(__file__).parent.parent / "docs" / "records.md").read_text()
    for reason in records.QUARANTINE_REASONS:
        assert f"`{reason}`" in doc, reason
    assert "2100-01-01" in doc and f"{records.MAX_DEPTH} levels" in doc


def poison_spool(spool: Path) -> list[bytes]:
    """The watch/replay test spool with every poison line in the middle of one file."""
    info = write_spool(spool)
    first = sorted(spool.rglob("*.jsonl"))[0]
    lines = first.read_bytes().split(b"\n")
    mid = len(lines) // 2
    first.write_bytes(b"\n".join(lines[:mid] + [p[1] for p in POISON] + lines[mid:]))
    return info


def events_of(path: Path) -> list[tuple]:
    return [(e["type"], e["state"], e["start_ns"], e["rank"]) for e in map(json.loads, path.read_text().splitlines())]


def test_watch_quarantines_poison_lines_and_detects_as_without_them(tmp_path):
    clean, dirty = tmp_path / "clean", tmp_path / "dirty"
    write_spool(clean)
    poison_spool(dirty)
    outs = []
    for spool in (clean, dirty):
        out = tmp_path / f"{spool.name}.events.jsonl"
        rc = cli.main(["watch", str(spool), "--once", "--events-out", str(out), "--metrics-port", "-1"])
        assert rc == 0
        outs.append(events_of(out))
    assert outs[0] and outs[1] == outs[0]


def test_replay_of_files_with_poison_lines_detects_as_without_them(tmp_path):
    clean, dirty = tmp_path / "clean", tmp_path / "dirty"
    write_spool(clean)
    poison_spool(dirty)
    outs = []
    for spool in (clean, dirty):
        out = tmp_path / f"{spool.name}.events.jsonl"
        rc = cli.main(["replay", "--files", str(spool), "--detect", "--events-out", str(out), "--no-progress"])
        assert rc == 0
        outs.append(events_of(out))
    assert outs[0] and outs[1] == outs[0]


def test_worker_decode_dead_letters_each_poison_message_with_its_reason():
    for name, line, reason in POISON:
        msg = Message("nccl.windows", 0, 3, b"job-1", line, 0)
        got = decode_message(msg, DETECTOR_KINDS + (OpRecord,))
        assert isinstance(got, Quarantined) and got.reason == reason, (name, got)
        to_json(got).encode()


@pytest.mark.kafka
def test_forwarder_quarantines_poison_lines_and_sends_everything_else(kafka_bootstrap, tmp_path):
    cfg = make_cfg(kafka_bootstrap)
    spool = tmp_path / "spool"
    paths = synth_spool(str(spool), streams=2, ops_per_stream=3000, segment_ops=1000)
    # 2,000 lines before the poison: the batch that a crash used to re-send at every start
    seg = Path(paths[2])
    lines = seg.read_bytes().split(b"\n")
    seg.write_bytes(b"\n".join(lines[:500] + [p[1] for p in POISON] + lines[500:]))
    expected = {records.parse_line(x).id for p in paths for x in Path(p).read_bytes().split(b"\n")
                if x and isinstance(records.parse_line(x), OpRecord)}
    metrics = ForwarderMetrics()
    opts = Options(spool_dir=str(spool), state_dir=str(tmp_path / "state"), node_id="n1", once=True,
                   compression="gzip")
    assert Forwarder(cfg, opts, metrics=metrics).run() == 0
    ops = [r for _, _, r in records_of(consume(kafka_bootstrap, cfg.topics.ops))]
    assert sorted(r.id for r in ops) == sorted(expected)  # every good op, once
    q = [r for _, _, r in records_of(consume(kafka_bootstrap, cfg.topics.quarantine))]
    assert sorted(x.reason for x in q) == sorted(p[2] for p in POISON)
    assert all(x.source == str(seg) for x in q)
    qfile = tmp_path / "state" / "n1" / "quarantine.jsonl"
    assert len(qfile.read_bytes().splitlines()) == len(POISON)
    assert metrics.registry.get_sample_value(
        "ncclwatch_forwarder_records_quarantined_total", {"stage": "parse", "reason": "not_unicode"}) == 3.0


@pytest.mark.kafka
def test_worker_dead_letters_poison_messages_and_detects_as_without_them(kafka_bootstrap, tmp_path):
    env = topics_env(kafka_bootstrap)
    create_topics(env)
    cfg = config_of(env)
    recs = window_scenario("job-p", recover_at_s=52, seconds=62)
    bad = [(cfg.topics.windows, b"job-p", line) for _, line, _ in POISON]
    bad.append((cfg.topics.telemetry, b"job-p", POISON[0][1]))
    publish(env, recs, extra=bad)
    worker = WorkerProcess(env, testing.unique_name("app"), tmp_path).start()
    try:
        expected = reference_events(env, recs)
        events = read_events(env, min_count=len(expected), idle_s=2.0, timeout_s=90)
        dead = read_topic(kafka_bootstrap, cfg.topics.dead_letter, min_count=len(bad), idle_s=1.0, timeout_s=60)
    finally:
        rc = worker.stop()
    assert rc == 0, worker.output()
    assert len(events) == len(expected) and expected
    reasons = sorted(json.loads(m.value)["reason"] for m in dead)
    assert reasons == sorted([p[2] for p in POISON] + [POISON[0][2]])


@pytest.mark.kafka
def test_forwarder_quarantines_a_record_far_ahead_of_its_clock_and_windows_go_on(kafka_bootstrap, tmp_path):
    # Within the contract (before 2100) but a year ahead of the reader: it used to move its
    # process's stream time a year on, after which every op was late and no window closed.
    windows = {}
    for name, poison in (("clean", None), ("ahead", op_with(start_ns=GOOD_OP["start_ns"] + 400 * 86_400 * 10**9))):
        cfg = make_cfg(kafka_bootstrap)
        spool = tmp_path / name / "spool"
        paths = synth_spool(str(spool), streams=2, ops_per_stream=3000, segment_ops=1000)
        if poison is not None:
            seg = Path(paths[0])
            lines = seg.read_bytes().split(b"\n")
            seg.write_bytes(b"\n".join(lines[:300] + [poison] + lines[300:]))
        opts = Options(spool_dir=str(spool), state_dir=str(tmp_path / name / "state"), node_id="n1", once=True)
        assert Forwarder(cfg, opts, clock=lambda: GOOD_OP["start_ns"] / 1e9 + 60).run() == 0
        got = [r for _, _, r in records_of(consume(kafka_bootstrap, cfg.topics.windows))]
        windows[name] = sorted((w.host, w.rank, w.comm, w.op, w.start_ns, w.count) for w in got)
        q = [r for _, _, r in records_of(consume(kafka_bootstrap, cfg.topics.quarantine))]
        assert [(x.reason, "ahead of this reader's clock" in x.detail) for x in q] == (
            [("out_of_range", True)] if poison else [])
    assert windows["clean"] and windows["ahead"] == windows["clean"]
