"""The forwarder without a reachable Kafka: it spills to a bounded disk buffer, never drops."""

from __future__ import annotations

import json
import os
import time

from ncclwatch.ingest.buffer import DiskBuffer
from ncclwatch.ingest.forward import Forwarder, Options
from ncclwatch.ingest.metrics import ForwarderMetrics
from ncclwatch_testkit.synth import write_spool

from ncclwatch import config
from ncclwatch.records import OpRecord, parse_line


def test_unreachable_kafka_fills_the_buffer_to_its_bound_then_pauses_without_loss(tmp_path):
    cfg = config.load(None, environ={"NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    spool = tmp_path / "spool"
    paths = write_spool(str(spool), streams=2, ops_per_stream=3000, segment_ops=1000)
    total = 6000
    opts = Options(spool_dir=str(spool), state_dir=str(tmp_path / "state"), node_id="n",
                   buffer_max_bytes=300_000, batch_size=200, compression="gzip")
    metrics = ForwarderMetrics()
    fwd = Forwarder(cfg, opts, metrics=metrics)
    deadline = time.monotonic() + 30
    while not fwd.delivery.buffer_full_logged and time.monotonic() < deadline:
        fwd.step()
    assert fwd.delivery.buffer_full_logged, "the buffer bound was never reached"
    assert fwd.delivery.mode == "spill"
    assert fwd.spool.bytes_behind() > 0  # reading paused: the rest waits in the spool
    behind_then = fwd.spool.bytes_behind()
    for _ in range(5):
        fwd.step()
    assert fwd.spool.bytes_behind() == behind_then
    # The bound holds on disk: the batch that would pass it waits in memory instead.
    on_disk = sum(f.stat().st_size for f in (tmp_path / "state" / "n" / "buffer").glob("buffer.*.bin"))
    assert 0 < on_disk <= 300_000
    assert 0 < metrics.registry.get_sample_value("ncclwatch_forwarder_buffer_bytes") <= 300_000
    assert any(b.held for b in fwd.delivery.batches)
    fwd._checkpoint(force=True)
    fwd.close()

    # Nothing lost: what the checkpoint says is safe is in the buffer, the rest in the spool.
    state = json.loads((tmp_path / "state" / "n" / "checkpoint.json").read_text())
    buf = DiskBuffer(str(tmp_path / "state" / "n" / "buffer"), tuple(state["buffer"]))
    buffered = set()
    while (msgs := buf.peek()) is not None:
        for topic, _, value in msgs:
            if topic == cfg.topics.ops:
                buffered.update(parse_line(v).id for v in value.split(b"\n"))
        buf.advance()
    unread = set()
    for p in paths:
        if not os.path.exists(p):
            continue
        with open(p, "rb") as f:
            data = f.read()[state["acked"].get(p, 0):]
        unread.update(parse_line(x).id for x in data.split(b"\n") if x)
    everything = set()
    for p in paths:
        with open(p, "rb") as f:
            everything.update(parse_line(x).id for x in f.read().split(b"\n") if x)
    assert len(everything) == total
    assert buffered | unread == everything
    # No segment was deleted: nothing was acknowledged by Kafka.
    assert all(os.path.exists(p) for p in paths)


def test_restart_resumes_the_buffer(tmp_path):
    cfg = config.load(None, environ={"NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    spool = tmp_path / "spool"
    write_spool(str(spool), streams=1, ops_per_stream=500)
    opts = Options(spool_dir=str(spool), state_dir=str(tmp_path / "state"), node_id="n",
                   batch_size=100)
    fwd = Forwarder(cfg, opts, metrics=ForwarderMetrics())
    deadline = time.monotonic() + 20
    while fwd.spool.bytes_behind() > 0 or fwd.read_total == 0:
        fwd.step()
        assert time.monotonic() < deadline
    pending = fwd.delivery.buffer.pending_bytes
    fwd._checkpoint(force=True)
    fwd.close()
    again = Forwarder(cfg, opts, metrics=ForwarderMetrics())
    assert again.delivery.mode == "spill" and again.delivery.buffer.pending_bytes == pending
    # Ops of still-open windows are read again to rebuild the windows, but not re-sent.
    batch, n = again._read_batch()
    assert n > 0 and not [m for m in batch.messages if m[0] == cfg.topics.ops]
    assert isinstance(parse_line(again.delivery.buffer.peek()[0][2].split(b"\n")[0]), OpRecord)
    again.close()


def test_kafka_logs_are_redacted(caplog):
    import logging

    from ncclwatch.ingest.kafka_sink import RedactFilter, describe

    kafka = config.load(None, environ={
        "NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": "broker-7.example:9093,10.1.2.3:9092",
        "NCCLWATCH_KAFKA_SASL_PLAIN_PASSWORD": "hunter2"}).kafka
    rec = logging.LogRecord("kafka.net", logging.WARNING, __file__, 1,
                            "Unable to bootstrap from %s (pw %s) host %s",
                            (["broker-7.example:9093", "10.1.2.3:9092"], "hunter2",
                             "broker-7.example"), None)
    RedactFilter(kafka).filter(rec)
    text = rec.getMessage()
    assert "broker-7" not in text and "10.1.2.3" not in text and "hunter2" not in text
    assert describe(kafka) == "bootstrap_hosts=2 security_protocol=PLAINTEXT"


def test_file_replaced_while_down_is_read_from_zero_and_sent_whole(tmp_path):
    from ncclwatch.ingest import checkpoint

    cfg = config.load(None, environ={"NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    spool = tmp_path / "spool"
    (p,) = write_spool(str(spool), streams=1, ops_per_stream=50)
    ckpt = checkpoint.path_for(str(tmp_path / "state"), "n")
    size = os.path.getsize(p)
    checkpoint.save(ckpt, {"acked": {p: size}, "window_from": {p: 0},
                           "inodes": {p: os.stat(p).st_ino + 1}, "prom": {}})
    opts = Options(spool_dir=str(spool), state_dir=str(tmp_path / "state"), node_id="n")
    fwd = Forwarder(cfg, opts, metrics=ForwarderMetrics())
    batch, n = fwd._read_batch()
    assert n == 50
    assert sum(len(m[2].split(b"\n")) for m in batch.messages if m[0] == cfg.topics.ops) == 50
    fwd.close()


def test_options_built_in_code_take_the_documented_ingest_defaults():
    """One home for the forwarder's defaults: a forwarder built without the CLI (tests,
    benchmarks, embedding) compresses, batches and windows as docs/ingest.md says."""
    import dataclasses

    from ncclwatch.config import IngestConfig

    opts, ing = Options(spool_dir="s", state_dir="t", node_id="n"), IngestConfig()
    shared = {f.name for f in dataclasses.fields(Options)} & {f.name for f in dataclasses.fields(IngestConfig)}
    assert {"compression", "batch_size", "linger_ms", "window_s", "buffer_max_bytes"} <= shared
    # a list here, comma-separated text there; "" = the configured regex; set per run
    for name in shared - {"spool_dir", "state_dir", "throughput_regex", "inspector_dirs"}:
        assert getattr(opts, name) == getattr(ing, name), name
