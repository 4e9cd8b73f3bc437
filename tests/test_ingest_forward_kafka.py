"""The forwarder against the real local Kafka broker: delivery, order, crashes, outages."""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ncclwatch.ingest.forward import Forwarder, Options
from ncclwatch.ingest.metrics import ForwarderMetrics
from ncclwatch_testkit import services as testing
from ncclwatch_testkit.synth import stream_lines, write_spool

from ncclwatch import config
from ncclwatch.records import OpRecord, Quarantined, WindowSummary, parse_line

pytestmark = pytest.mark.kafka
FIXTURES = Path(__file__).parent / "fixtures" / "inspector"
TOPIC_KEYS = config.TOPIC_NAME_FIELDS


PRODUCERS = pytest.mark.parametrize("producer", config.PRODUCERS)


def make_cfg(bootstrap: str, producer: str = config.KafkaConfig.producer, **ingest) -> config.Config:
    env = {"NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": bootstrap, "NCCLWATCH_TOPICS_PARTITIONS": "3",
           "NCCLWATCH_KAFKA_PRODUCER": producer, **testing.RECORDED_TOPICS_ENV}
    prefix = testing.unique_name("ingest")
    for k in TOPIC_KEYS:
        env[f"NCCLWATCH_TOPICS_{k.upper()}"] = f"{prefix}.{k}"
    for k, v in ingest.items():
        env[f"NCCLWATCH_INGEST_{k.upper()}"] = str(v)
    return config.load(None, environ=env)


def consume(bootstrap: str, topic: str, timeout_s: float = 30.0) -> list:
    """Every message of a topic, per partition in offset order: (partition, key, value)."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                      session_timeout_ms=6000, heartbeat_interval_ms=2000,
                      consumer_timeout_ms=1000)
    try:
        parts = c.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        if not tps:
            return []
        c.assign(tps)
        c.seek_to_beginning(*tps)
        end = c.end_offsets(tps)
        got: dict[tuple[int, int], tuple] = {}
        deadline = time.monotonic() + timeout_s
        while any(c.position(tp) < end[tp] for tp in tps) and time.monotonic() < deadline:
            for tp, msgs in c.poll(timeout_ms=500).items():
                got.update(((tp.partition, m.offset), (m.key, m.value)) for m in msgs)
        # By offset: the partition's order, whatever order the client's fetches returned.
        return [(p, k, v) for (p, _), (k, v) in sorted(got.items())]
    finally:
        c.close()


def records_of(messages: list) -> list:
    out = []
    for part, key, value in messages:
        for line in value.split(b"\n"):
            out.append((part, key, parse_line(line)))
    return out


def spool_index(spool: Path) -> dict[str, tuple[str, int]]:
    """op id -> (file, offset of its line), computed before the forwarder deletes files."""
    idx = {}
    for p in sorted(spool.rglob("*.jsonl")):
        off = 0
        for line in p.read_bytes().split(b"\n")[:-1]:
            rec = parse_line(line)
            if isinstance(rec, OpRecord):
                idx[rec.id] = (str(p), off)
            off += len(line) + 1
    return idx


def spill_counts(metrics: ForwarderMetrics) -> dict[str, float]:
    """reason -> how often the forwarder moved unacknowledged batches to its disk buffer."""
    return {s.labels["reason"]: s.value for m in metrics.kafka_spills.collect()
            for s in m.samples if s.name.endswith("_total")}


def run_once(cfg, tmp_path: Path, spool: Path, **kw) -> Forwarder:
    opts = Options(spool_dir=str(spool), state_dir=str(tmp_path / "state"), node_id="n1",
                   once=True, compression="gzip", **kw)
    fwd = Forwarder(cfg, opts, metrics=ForwarderMetrics())
    assert fwd.run() == 0
    return fwd


@PRODUCERS
def test_every_spool_record_arrives_in_order_per_communicator_with_its_key(
        kafka_bootstrap, tmp_path, producer):
    cfg = make_cfg(kafka_bootstrap, producer)
    spool = tmp_path / "spool"
    write_spool(str(spool), streams=3, ops_per_stream=1500, segment_ops=400, comms=3,
                with_stats=True)
    expected = spool_index(spool)
    fwd = run_once(cfg, tmp_path, spool, ops_per_message=1)

    ops = records_of(consume(kafka_bootstrap, cfg.topics.ops))
    assert all(isinstance(r, OpRecord) for _, _, r in ops)
    assert sorted(r.id for _, _, r in ops) == sorted(expected)  # all, no duplicate
    assert all(k == f"{r.job}|{r.comm}".encode() for _, k, r in ops)
    # One communicator is one key, so one partition, and each rank's seqs stay in order.
    by_comm = collections.defaultdict(set)
    seqs = collections.defaultdict(list)
    for p, _, r in ops:
        by_comm[r.comm].add(p)
        seqs[(r.comm, r.rank)].append(r.seq)
    assert all(len(parts) == 1 for parts in by_comm.values())
    disorder = {k: next(i for i in range(1, len(s)) if s[i] < s[i - 1])
                for k, s in seqs.items() if s != sorted(s)}
    assert not disorder, (
        {k: seqs[k][max(0, i - 3):i + 3] for k, i in disorder.items()},
        spill_counts(fwd.metrics))
    # drops and plugin stats on their own topic, keyed by job as the windows are
    others = records_of(consume(kafka_bootstrap, cfg.topics.telemetry))
    kinds = collections.Counter(type(r).__name__ for _, _, r in others)
    assert kinds == {"PluginStats": 3, "DropRecord": 3}
    assert all(k == r.job.encode() for _, k, r in others)
    assert fwd.metrics.registry.get_sample_value(
        "ncclwatch_plugin_dropped_total",
        {"training_job": "job-1", "node": "node001", "Hostname": "node001", "reason": "pool_full"}) == 9.0

    wins = [r for _, k, r in records_of(consume(kafka_bootstrap, cfg.topics.windows))]
    assert wins and all(isinstance(w, WindowSummary) for w in wins)
    assert sum(w.count for w in wins) == len(expected)  # --once closes every window
    # Closed, acknowledged segments were deleted; each stream's newest one is kept.
    assert len(list(spool.rglob("*.jsonl"))) == 3


def write_backlog(spool: Path, *, job: str, streams: int, seconds: int, ops_per_s: int,
                  segment_ops: int) -> int:
    """A recorded spool: ``streams`` processes of one job, ``seconds`` of ops each, every
    stream in several segments (what a forwarder finds after an outage)."""
    d = spool / job
    d.mkdir(parents=True, exist_ok=True)
    interval_ns = 10**9 // ops_per_s
    n = seconds * ops_per_s
    for s in range(streams):
        lines = stream_lines(job=job, host="node001", pid=2000 + s, gpu=f"GPU-{s:04d}",
                             rank=s, n=n, comms=2, interval_ns=interval_ns,
                             t0_ns=1_763_790_000_000_000_000 + s * 7_000_000)
        for i, k in enumerate(range(0, n, segment_ops)):
            (d / f"node001-GPU-{s:04d}-{2000 + s}.{i:06d}.jsonl").write_bytes(
                b"\n".join(lines[k:k + segment_ops]) + b"\n")
    return streams * n


@pytest.mark.parametrize("batch_size", [2000, 500])
def test_forward_once_on_a_multi_process_backlog_publishes_windows_in_start_order(
        kafka_bootstrap, tmp_path, batch_size):
    # Three processes, 70 s of ops each at 40 ops/s, 700-line segments: read file by file,
    # one batch of 2000 lines is 50 s of one process, so windows reached Kafka up to ~50 s
    # out of order and a detector saw one rank far ahead of the others.
    cfg = make_cfg(kafka_bootstrap)
    spool = tmp_path / "spool"
    total = write_backlog(spool, job="job-b", streams=3, seconds=70, ops_per_s=40,
                          segment_ops=700)
    # The order holds while Kafka keeps up: a loaded machine's slow acknowledgement must
    # not send the run down the stall path (spill and resend), which may reorder.
    fwd = run_once(cfg, tmp_path, spool, ops_per_message=50, batch_size=batch_size,
                   stall_s=300.0)
    spills = spill_counts(fwd.metrics)
    assert not spills, spills

    wins = [(p, r) for p, _, r in records_of(consume(kafka_bootstrap, cfg.topics.windows))]
    assert len({p for p, _ in wins}) == 1  # keyed by job: one partition, offset order
    starts = [w.start_ns for _, w in wins]
    assert sum(w.count for _, w in wins) == total  # every op in a window, none late
    assert fwd.windows.windowers["spool"].late_total == 0
    assert len({w.rank for _, w in wins}) == 3
    assert max(starts) - min(starts) >= 69 * 10**9
    # Non-decreasing start order across processes, allowing the documented lateness
    # (one window): the largest step back from the newest start seen so far.
    lateness_ns = int(cfg.ingest.window_s * 1e9)
    newest, worst_back_ns = starts[0], 0
    for s in starts:
        worst_back_ns = max(worst_back_ns, newest - s)
        newest = max(newest, s)
    assert worst_back_ns <= lateness_ns, worst_back_ns / 1e9
    # Op records of a communicator's processes (its ranks) are read together too: in the
    # order its key's partition holds them, no op is more than a second behind the newest.
    ops = [(k, r) for _, k, r in records_of(consume(kafka_bootstrap, cfg.topics.ops))]
    assert len(ops) == total
    for key in {k for k, _ in ops}:
        assert len({r.rank for k, r in ops if k == key}) == 3
        ends = [r.start_ns + r.exec_ns for k, r in ops if k == key]
        newest, back = ends[0], 0
        for e in ends:
            back = max(back, newest - e)
            newest = max(newest, e)
        assert back <= 10**9, (key, back / 1e9)


def test_packed_messages_carry_several_records_of_one_communicator(kafka_bootstrap, tmp_path):
    cfg = make_cfg(kafka_bootstrap)
    spool = tmp_path / "spool"
    write_spool(str(spool), streams=2, ops_per_stream=1000, comms=2)
    expected = spool_index(spool)
    run_once(cfg, tmp_path, spool, ops_per_message=100)
    raw = consume(kafka_bootstrap, cfg.topics.ops)
    assert len(raw) < len(expected) / 10
    recs = records_of(raw)
    assert sorted(r.id for _, _, r in recs) == sorted(expected)
    assert all(k == f"{r.job}|{r.comm}".encode() for _, k, r in recs)


def test_windows_are_packed_by_job_and_read_back_exactly_as_unpacked(kafka_bootstrap, tmp_path):
    # two jobs on one node, so packing must also keep each job's windows in their order
    spool = tmp_path / "spool"
    write_spool(str(spool), job="job-a", streams=2, ops_per_stream=3000, comms=2)
    write_spool(str(spool), job="job-b", streams=2, ops_per_stream=3000, comms=2)
    got = {}
    for per in (1, config.IngestConfig.windows_per_message):
        cfg = make_cfg(kafka_bootstrap)
        shutil.copytree(spool, tmp_path / f"spool-{per}")
        run_once(cfg, tmp_path / f"run-{per}", tmp_path / f"spool-{per}", windows_per_message=per)
        raw = consume(kafka_bootstrap, cfg.topics.windows)
        got[per] = raw, [(p, k, r) for p, k, r in records_of(raw)]
    (one, unpacked), (packed_raw, packed) = got[1], got[config.IngestConfig.windows_per_message]
    assert all(b"\n" not in v for _, _, v in one)
    assert len(one) >= 20 and len(packed_raw) <= len(one) / 3  # windows that closed together share a message
    assert max(v.count(b"\n") + 1 for _, _, v in packed_raw) <= config.IngestConfig.windows_per_message
    assert all(k == r.job.encode() for _, k, r in packed)
    # the same windows, in the same order per partition (one job is one key)
    for job in ("job-a", "job-b"):
        assert [r for _, _, r in packed if r.job == job] == [r for _, _, r in unpacked if r.job == job]


def _forward_cmd(spool: Path, state: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ncclwatch.cli", "forward", "--spool", str(spool),
            "--state-dir", str(state), "--node-id", "n1", "--metrics-port", "-1",
            "--batch-size", "500", *extra]


def _env(cfg) -> dict:
    env = dict(os.environ)
    env["NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS"] = cfg.kafka.bootstrap_servers
    env["NCCLWATCH_TOPICS_PARTITIONS"] = str(cfg.topics.partitions)
    env["NCCLWATCH_TOPICS_RETENTION_MS"] = str(cfg.topics.retention_ms)
    env["NCCLWATCH_KAFKA_PRODUCER"] = cfg.kafka.producer
    for k in TOPIC_KEYS:
        env[f"NCCLWATCH_TOPICS_{k.upper()}"] = getattr(cfg.topics, k)
    return env


@PRODUCERS
def test_kill_9_then_restart_loses_nothing_and_duplicates_only_the_unacked_tail(
        kafka_bootstrap, tmp_path, producer):
    cfg = make_cfg(kafka_bootstrap, producer)
    spool, state = tmp_path / "spool", tmp_path / "state"
    write_spool(str(spool), streams=4, ops_per_stream=15000, segment_ops=5000, comms=2)
    expected = spool_index(spool)
    ckpt = state / "n1" / "checkpoint.json"
    proc = subprocess.Popen(_forward_cmd(spool, state), env=_env(cfg),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill once some, but not all, is acknowledged
            if ckpt.exists() and sum(json.loads(ckpt.read_text())["acked"].values()) > 0:
                break
            time.sleep(0.01)
        # at once: librdkafka sends the whole 60,000 ops in ~0.2 s on a fast machine, so a
        # wait here could let everything through (the check below would then fail)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    at_kill = json.loads(ckpt.read_text())
    acked_at_kill = at_kill["acked"]
    before = records_of(consume(kafka_bootstrap, cfg.topics.ops))
    assert 0 < len(before) < len(expected), "kill came too late or too early to test anything"

    done = subprocess.run(_forward_cmd(spool, state, "--once"), env=_env(cfg), timeout=120,
                          capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]

    ids = collections.Counter(r.id for _, _, r in records_of(consume(kafka_bootstrap,
                                                                       cfg.topics.ops)))
    assert set(ids) == set(expected)  # zero lost
    dups = {i: n for i, n in ids.items() if n > 1}
    # Duplicates only where the checkpoint had not yet confirmed delivery at the kill.
    for i in dups:
        path, off = expected[i]
        assert off >= acked_at_kill.get(path, 0), (i, path, off)
    assert all(n == 2 for n in dups.values())
    print(f"\nkill -9: {len(before)} records acknowledged before the kill, "
          f"{len(dups)} duplicates after restart, {len(expected)} records")

    # Windows: re-emitted ones are identical (consumers dedupe), none is partial.
    wins = [r for _, _, r in records_of(consume(kafka_bootstrap, cfg.topics.windows))]
    by_key: dict[tuple, set] = collections.defaultdict(set)
    for w in wins:
        by_key[(w.job, w.comm, w.op, w.size_bucket, w.transport, w.rank, w.start_ns)].add(w)
    assert all(len(v) == 1 for v in by_key.values()), "a window came out twice, different"
    assert sum(next(iter(v)).count for v in by_key.values()) == len(expected)


@PRODUCERS
def test_broker_outage_spills_to_disk_and_loses_nothing(kafka_bootstrap, tmp_path, producer):
    cfg = make_cfg(kafka_bootstrap, producer)
    spool = tmp_path / "spool"
    job_dir = spool / "job-1"
    job_dir.mkdir(parents=True)
    seg = job_dir / "node001-GPU-0000-1000.000000.jsonl"
    lines = stream_lines(job="job-1", host="node001", pid=1000, gpu="GPU-0000", rank=0, n=6000)
    seg.write_bytes(b"\n".join(lines[:2000]) + b"\n")
    opts = Options(spool_dir=str(spool), state_dir=str(tmp_path / "state"), node_id="n1",
                   stall_s=3.0, compression="gzip")
    metrics = ForwarderMetrics()
    fwd = Forwarder(cfg, opts, metrics=metrics)
    t = threading.Thread(target=fwd.run, daemon=True)
    t.start()
    stopped = False
    try:
        _wait(lambda: fwd.delivery.sent_total >= 2000, 60, "first part acknowledged")
        testing.stop_service("kafka")
        stopped = True
        with open(seg, "ab") as f:
            f.write(b"\n".join(lines[2000:]) + b"\n")
        _wait(lambda: fwd.delivery.mode == "spill" and fwd.delivery.buffer.pending_bytes > 0
              and fwd.spool.bytes_behind() == 0, 60, "reading into the disk buffer")
        testing.start_service("kafka")
        stopped = False
        _wait(lambda: fwd.delivery.mode == "direct" and fwd.delivery.buffer.empty()
              and not any(not b.done for b in fwd.delivery.batches), 120, "buffer drained")
    finally:
        if stopped:
            testing.start_service("kafka")
        fwd.stop()
        t.join(30)
    ids = {r.id for _, _, r in records_of(consume(kafka_bootstrap, cfg.topics.ops))}
    assert ids == {parse_line(x).id for x in lines}
    assert sum(spill_counts(metrics).values()) >= 1  # the outage is counted, with what it was


def test_a_producer_librdkafka_gave_up_on_is_replaced_and_nothing_is_lost(
        kafka_bootstrap, tmp_path, caplog):
    from confluent_kafka import KafkaError

    cfg = make_cfg(kafka_bootstrap, "confluent-kafka")
    spool = tmp_path / "spool"
    write_spool(str(spool), streams=2, ops_per_stream=600, segment_ops=200, comms=2)
    expected = spool_index(spool)
    opts = Options(spool_dir=str(spool), state_dir=str(tmp_path / "state"), node_id="n1",
                   once=True, compression="gzip", ops_per_message=1, batch_size=100)
    fwd = Forwarder(cfg, opts, metrics=ForwarderMetrics())
    deadline = time.monotonic() + 30
    while fwd.delivery.producer is None or fwd.delivery.sent_total == 0:  # connected, something acknowledged
        assert time.monotonic() < deadline, "the forwarder never got an acknowledgement"
        fwd.step()
        time.sleep(0.01)
    first = fwd.delivery.producer
    # What librdkafka's error callback delivers when the idempotent producer cannot keep
    # its guarantees any more; from then on the producer refuses every message.
    first.on_error(KafkaError(KafkaError._FATAL, "injected by the test", fatal=True))
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(fwd.run()), daemon=True)
    t.start()
    t.join(60)
    if t.is_alive():  # kept sending through the dead producer
        fwd.stop()
        t.join(30)
    assert rc == [0] and not t.is_alive()

    assert "event=kafka_producer_replaced" in caplog.text
    assert spill_counts(fwd.metrics).get("DeliveryError", 0) >= 1
    ids = [r.id for _, _, r in records_of(consume(kafka_bootstrap, cfg.topics.ops))
           if isinstance(r, OpRecord)]
    assert set(ids) == set(expected)  # what the dead producer held was spilled and resent


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.1)


def test_bad_lines_are_quarantined_with_reasons_and_a_cut_last_line_is_retried(
        kafka_bootstrap, tmp_path):
    cfg = make_cfg(kafka_bootstrap)
    spool = tmp_path / "spool"
    d = spool / "job-1"
    d.mkdir(parents=True)
    good = stream_lines(job="job-1", host="node001", pid=7, gpu="g", rank=0, n=4)
    bad_schema = json.loads(good[0])
    del bad_schema["seq"]
    seg0 = d / "node001-g-7.000000.jsonl"
    seg0.write_bytes(b"\n".join([
        good[0],
        b"{not json",
        b"\xff\xfe\x00garbage",
        good[1].replace(b'"v":1', b'"v":2'),
        good[1].replace(b'"kind":"op"', b'"kind":"opz"'),
        json.dumps(bad_schema).encode(),
        b"x" * (100 * 1024),
        good[1],
    ]) + b"\n" + good[2][:50])  # the last line is still being written
    metrics = ForwarderMetrics()
    opts = Options(spool_dir=str(spool), state_dir=str(tmp_path / "state"), node_id="n1",
                   once=True)
    assert Forwarder(cfg, opts, metrics=metrics).run() == 0
    q = [r for _, _, r in records_of(consume(kafka_bootstrap, cfg.topics.quarantine))]
    assert all(isinstance(x, Quarantined) for x in q)
    assert sorted(x.reason for x in q) == sorted(
        ["not_json", "not_utf8", "unknown_version", "unknown_kind", "schema", "too_long"])
    assert all(x.source == str(seg0) for x in q)
    assert {x.reason: x.offset for x in q}["not_json"] == len(good[0]) + 1
    qfile = tmp_path / "state" / "n1" / "quarantine.jsonl"
    assert len(qfile.read_bytes().splitlines()) == 6
    assert metrics.registry.get_sample_value(
        "ncclwatch_forwarder_records_quarantined_total",
        {"stage": "size", "reason": "too_long"}) == 1.0

    # The writer finishes the cut line: it arrives as a record, nothing more is quarantined.
    with open(seg0, "ab") as f:
        f.write(good[2][50:] + b"\n")
    assert Forwarder(cfg, opts, metrics=ForwarderMetrics()).run() == 0
    ops = [r for _, _, r in records_of(consume(kafka_bootstrap, cfg.topics.ops))]
    assert sorted(r.seq for r in ops) == sorted(parse_line(x).seq for x in good[:3])
    assert len(consume(kafka_bootstrap, cfg.topics.quarantine)) == 6


def shared_node_spool(spool: Path) -> tuple[list[bytes], list[bytes], Path]:
    """``job-a``'s directory with its own stream, a stream of another job's records written
    by the same user, and a segment another user (uid 54321) dropped in (as root)."""
    d = spool / "job-a"
    d.mkdir(parents=True)
    own = stream_lines(job="job-a", host="node001", pid=7, gpu="g", rank=0, n=40)
    (d / "node001-g-7.000000.jsonl").write_bytes(b"\n".join(own) + b"\n")
    # the same user writing records of a job it has no directory of (or another's)
    claims = stream_lines(job="job-b", host="node001", pid=8, gpu="g", rank=1, n=5)
    (d / "node001-g-8.000000.jsonl").write_bytes(b"\n".join(own[:2] + claims) + b"\n")
    foreign = d / "node001-g-9.000000.jsonl"
    foreign.write_bytes(b"\n".join(stream_lines(job="job-a", host="node001", pid=9, gpu="g",
                                                rank=2, n=6)) + b"\n")
    os.chown(foreign, 54321, 54321)
    return own, claims, foreign


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a segment to another user needs root")
def test_a_shared_node_spool_publishes_only_the_job_directory_owners_records_of_that_job(
        kafka_bootstrap, tmp_path):
    cfg = make_cfg(kafka_bootstrap)
    assert cfg.ingest.spool_trust == "owner"  # the default
    spool = tmp_path / "spool"
    own, claims, foreign = shared_node_spool(spool)
    metrics = ForwarderMetrics()
    opts = Options(spool_dir=str(spool), state_dir=str(tmp_path / "state"), node_id="n1",
                   once=True, delete_acked=False)
    fwd = Forwarder(cfg, opts, metrics=metrics)
    assert fwd.run() == 0
    ops = [r for _, _, r in records_of(consume(kafka_bootstrap, cfg.topics.ops))]
    assert {r.job for r in ops} == {"job-a"}
    assert {r.pid for r in ops} == {7}  # the foreign segment (pid 9) was never read
    assert len(ops) == len(own) + 2  # job-a's lines in the mixed segment still count
    q = [r for _, _, r in records_of(consume(kafka_bootstrap, cfg.topics.quarantine))]
    assert [(x.stage, x.reason) for x in q] == [("origin", "wrong_job")] * len(claims)
    assert sorted(x.raw.encode() for x in q) == sorted(claims)
    assert metrics.registry.get_sample_value(
        "ncclwatch_forwarder_records_quarantined_total", {"stage": "origin", "reason": "wrong_job"}) == 5
    assert metrics.registry.get_sample_value("ncclwatch_forwarder_untrusted_files") == 1
    assert str(foreign) in fwd.spool.untrusted and foreign.exists()

    # a node with one tenant can switch the checks off: everything is read as it is
    cfg_any = make_cfg(kafka_bootstrap, spool_trust="any")
    spool2 = tmp_path / "spool2"
    own2, claims2, _ = shared_node_spool(spool2)
    run_once(cfg_any, tmp_path / "any", spool2)
    ops2 = [r for _, _, r in records_of(consume(kafka_bootstrap, cfg_any.topics.ops))]
    assert {r.pid for r in ops2} == {7, 8, 9} and len(ops2) == len(own2) + 2 + len(claims2) + 6
    assert consume(kafka_bootstrap, cfg_any.topics.quarantine) == []


def test_inspector_json_and_prom_become_op_and_window_records(kafka_bootstrap, tmp_path):
    cfg = make_cfg(kafka_bootstrap)
    insp = tmp_path / "nccl-inspector-4242"
    shutil.copytree(FIXTURES, insp)
    spool = tmp_path / "spool"
    spool.mkdir()
    run_once(cfg, tmp_path, spool, inspector_dirs=[str(insp)])
    ops = [r for _, _, r in records_of(consume(kafka_bootstrap, cfg.topics.ops))]
    assert ops and all(isinstance(r, OpRecord) and r.timing == "inspector" for r in ops)
    assert {r.job for r in ops} == {"4242"}
    n_json = sum(1 for p in FIXTURES.glob("*.log") for line in p.read_bytes().splitlines()
                 if b"_perf" in line)
    assert len(ops) == n_json
    wins = [r for _, _, r in records_of(consume(kafka_bootstrap, cfg.topics.windows))]
    assert wins and all(isinstance(w, WindowSummary) for w in wins)
    prom = [w for w in wins if w.first_seq == 0 and w.last_seq == 0 and w.job == "1670760"]
    assert prom, "the .prom fixture produced no window"
    from_ops = [w for w in wins if w.job == "4242"]
    assert sum(w.count for w in from_ops) == len(ops)


def test_sigterm_flushes_checkpoints_and_exits_zero(kafka_bootstrap, tmp_path):
    cfg = make_cfg(kafka_bootstrap)
    spool, state = tmp_path / "spool", tmp_path / "state"
    write_spool(str(spool), streams=2, ops_per_stream=2000, segment_ops=1000)
    expected = spool_index(spool)
    proc = subprocess.Popen(_forward_cmd(spool, state), env=_env(cfg),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpt = state / "n1" / "checkpoint.json"
    try:
        _wait(lambda: ckpt.exists() and len(records_of(consume(kafka_bootstrap, cfg.topics.ops, 5)))
              >= len(expected), 60, "everything delivered")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    state_now = json.loads(ckpt.read_text())
    # Every remaining file is acknowledged to its end (closed ones were deleted).
    for path, off in state_now["acked"].items():
        assert off == os.path.getsize(path)
    ids = [r.id for _, _, r in records_of(consume(kafka_bootstrap, cfg.topics.ops))]
    assert sorted(ids) == sorted(expected)


def test_throughput_from_the_api_and_a_training_log_reaches_its_topic(kafka_bootstrap, tmp_path):
    from ncclwatch import report_throughput
    from ncclwatch.records import ThroughputRecord

    cfg = make_cfg(kafka_bootstrap)
    spool = tmp_path / "spool"
    for step in range(3):
        report_throughput(300.0 + step, step, rank=0, spool_dir=str(spool), job="job-api")
    log = tmp_path / "train.log"
    log.write_text("".join(
        f" iteration {i:8d}/ 1000 | lm loss: 2.1 | throughput per GPU (TFLOP/s/GPU): {305 + i}.5 |\n"
        for i in (10, 11)) + "some other line\n")
    run_once(cfg, tmp_path, spool, training_logs=[str(log)], job="job-log")
    recs = [(k, r) for _, k, r in records_of(consume(kafka_bootstrap, cfg.topics.throughput))]
    assert all(isinstance(r, ThroughputRecord) and k == r.job.encode() for k, r in recs)
    got = sorted((r.job, r.source, r.step, r.tflops_per_gpu) for _, r in recs)
    assert got == [("job-api", "api", 0, 300.0), ("job-api", "api", 1, 301.0),
                   ("job-api", "api", 2, 302.0), ("job-log", "log", 10, 315.5),
                   ("job-log", "log", 11, 316.5)]


def test_forward_once_publishes_a_stall_s_progress_records_in_time_order_across_processes(
        kafka_bootstrap, tmp_path):
    """A recorded network outage (tests/fixtures/gpu_runs/2026-11-29-x1): both processes
    wrote a progress record a second for 10 s. Read as a backlog, file by file, all of one
    process's reached Kafka before the other's, and a worker heard one rank wait for 10 s
    while the other said nothing: it named that one as stopped. Progress records are
    timed for the node's stream-time alignment now, like ops and throughput."""
    import tarfile

    run = Path(__file__).parent / "fixtures" / "gpu_runs" / "2026-11-29-x1" / "p1x2-sync-tc-1k-10s.tar.gz"
    with tarfile.open(run) as t:
        t.extractall(tmp_path / "run", filter="data")
    spool = tmp_path / "run" / "p1x2-sync-tc-1k-10s" / "spool"
    cfg = make_cfg(kafka_bootstrap)
    run_once(cfg, tmp_path, spool)
    prog = [r for _, _, r in records_of(consume(kafka_bootstrap, cfg.topics.telemetry)) if r.KIND == "progress"]
    assert len(prog) == 48 and len({r.pid for r in prog}) == 2
    newest, back = prog[0].ts_ns, 0
    for r in prog:
        back = max(back, newest - r.ts_ns)
        newest = max(newest, r.ts_ns)
    assert back <= 2 * 10**9, back / 1e9
