"""Training-log time: a line's own timestamp, the time-zone rule, several ranks as one series."""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest
from ncclwatch.ingest import forward
from ncclwatch.ingest.forward import Forwarder, Options
from ncclwatch.ingest.metrics import ForwarderMetrics
from ncclwatch.ingest.trainlog import LineClock, RankMerge, ThroughputParser

from ncclwatch.config import ConfigError, load
from ncclwatch.records import ThroughputRecord, parse_line

MEGATRON = ("[2026-11-22 03:25:28.104489] iteration        2/ 1000000 | consumed samples:          512 | "
            "elapsed time per iteration (ms): 2105.3 | throughput per GPU (TFLOP/s/GPU): 45.7 | "
            "learning rate: 1.000000E-04 |")
STAMP_UTC_NS = int(datetime(2026, 11, 22, 3, 25, 28, tzinfo=UTC).timestamp()) * 10**9 + 104_489_000


def rec(step: int, tflops: float, ts_ns: int) -> ThroughputRecord:
    return ThroughputRecord(job="j", host="h", rank=-1, ts_ns=ts_ns, step=step, tflops_per_gpu=tflops,
                            tokens_per_s=None, source="log")


def test_a_megatron_line_is_stamped_with_its_own_time_not_the_read_time():
    r = ThroughputParser(job="j", host="h", timezone="UTC").parse(MEGATRON, read_ns=5)
    assert (r.step, r.tflops_per_gpu, r.ts_ns) == (2, 45.7, STAMP_UTC_NS)


def test_a_naive_timestamp_is_read_in_the_configured_zone():
    berlin = ThroughputParser(job="j", host="h", timezone="Europe/Berlin").parse(MEGATRON, 5)
    assert berlin.ts_ns == STAMP_UTC_NS - 3600 * 10**9  # CET is UTC+1 in November
    local = ThroughputParser(job="j", host="h").parse(MEGATRON, 5)  # default "local"
    expected = datetime(2026, 11, 22, 3, 25, 28, 104489).astimezone()  # the reader's own zone
    assert local.ts_ns == int(expected.timestamp()) * 10**9 + 104_489_000


@pytest.mark.parametrize(
    "line",
    [
        "2026-11-22T03:25:28.104489Z iteration 2 | throughput per GPU (TFLOP/s/GPU): 45.7",
        "2026-11-22T04:25:28.104489+01:00 iteration 2 | throughput per GPU (TFLOP/s/GPU): 45.7",
        "2026-11-22 00:25:28.104489-0300 iteration 2 | throughput per GPU (TFLOP/s/GPU): 45.7",
        "[default0]:[2026-11-22 03:25:28.104489] iteration 2 | throughput per GPU (TFLOP/s/GPU): 45.7",
    ],
)
def test_an_offset_in_the_line_wins_over_the_zone_and_a_launcher_prefix_is_fine(line):
    # the configured zone must not matter when the line says its offset
    zone = "Asia/Tokyo" if "default0" not in line else "UTC"
    assert ThroughputParser(job="j", host="h", timezone=zone).parse(line, 5).ts_ns == STAMP_UTC_NS


def test_nemo_and_python_logging_timestamps_are_read():
    c = LineClock("UTC")
    assert c.time_ns("[NeMo I 2026-11-22 03:25:28 nemo_logging:349] x") == STAMP_UTC_NS - 104_489_000
    assert c.time_ns("2026-11-22 03:25:28,104 INFO step 2") == STAMP_UTC_NS - 489_000


def test_a_line_without_a_timestamp_falls_back_to_the_read_time_and_is_counted():
    p = ThroughputParser(job="j", host="h")
    r = p.parse(" iteration 2/ 10 | throughput per GPU (TFLOP/s/GPU): 45.7 |", 123)
    assert r.ts_ns == 123 and p.untimed == 1
    # a date deep inside the message is not the line's time
    r = p.parse("iteration 3 | note: resumed from the checkpoint of 2026-11-22 03:25:28 | "
                "throughput per GPU (TFLOP/s/GPU): 45.7", 456)
    assert r.ts_ns == 456 and p.untimed == 2


def test_the_zone_is_a_config_key_checked_at_load():
    assert load(None).ingest.trainlog_timezone == "local"
    assert load(None, environ={"NCCLWATCH_INGEST_TRAINLOG_TIMEZONE": "UTC"}).ingest.trainlog_timezone == "UTC"
    with pytest.raises(ConfigError, match="trainlog_timezone"):
        load(None, environ={"NCCLWATCH_INGEST_TRAINLOG_TIMEZONE": "Mars/Olympus_Mons"})
    with pytest.raises(ValueError, match="IANA"):
        LineClock("Mars/Olympus_Mons")
    assert str(ZoneInfo("America/New_York")) == LineClock("America/New_York").timezone


def test_ranks_give_one_series_median_of_the_ranks_at_the_latest_timestamp():
    m = RankMerge(hold_s=None)
    for src, tf, ts in (("r0", 40.0, 100), ("r1", 44.0, 130), ("r2", 41.0, 110)):
        m.add(src, rec(1, tf, ts))
    m.add("r0", rec(2, 40.0, 200))
    assert m.release() == []  # a recording: everything waits for the end
    out = m.flush()
    assert [(r.step, r.tflops_per_gpu, r.ts_ns) for r in out] == [(1, 41.0, 130), (2, 40.0, 200)]


def test_a_restart_that_logs_steps_again_gives_new_iterations_not_a_mix():
    m = RankMerge(hold_s=None)
    for step, ts in ((1, 10), (2, 20), (3, 30), (2, 1000), (3, 1010)):  # restarted from step 2
        m.add("r0", rec(step, 40.0, ts))
        m.add("r1", rec(step, 42.0, ts + 1))
    assert [(r.step, r.ts_ns) for r in m.flush()] == [(1, 11), (2, 21), (3, 31), (2, 1001), (3, 1011)]


def test_live_an_iteration_waits_for_the_other_ranks_but_not_for_a_rank_that_died():
    """Held by time, not iterations: ranks' logs are flushed at their own pace."""
    m = RankMerge(hold_s=15e-9)  # 15 ns: two of these 10 ns iterations
    m.add("r0", rec(1, 40.0, 10))
    m.add("r1", rec(1, 42.0, 11))
    assert [r.tflops_per_gpu for r in m.release()] == [41.0]
    m.add("r0", rec(2, 40.0, 20))
    assert m.release() == []  # r1 has not logged iteration 2 yet
    m.add("r1", rec(2, 42.0, 21))
    assert [r.tflops_per_gpu for r in m.release()] == [41.0]
    # r1 dies: iteration 3 goes out once a report 15 ns newer came, with r0 alone
    for step in (3, 4):
        m.add("r0", rec(step, 40.0, step * 10))
        assert m.release() == []
    m.add("r0", rec(5, 40.0, 50))
    assert [(r.step, r.tflops_per_gpu) for r in m.release()] == [(3, 40.0)]
    m.add("r1", rec(3, 42.0, 31))  # r1 comes back too late for iteration 3
    assert m.late == 1


def test_the_forwarder_stamps_training_log_lines_with_their_own_time_and_reads_every_log(tmp_path):
    """ncclwatch forward's training-log source: the same parser, the same merge (no Kafka
    needed to see what it would publish)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    for rank in (0, 1):
        (logs / f"rank-{rank}.log").write_text(
            "".join(f"[2026-11-22 03:25:{28 + i:02d}.{rank:06d}] iteration {i:8d}/ 10 | "
                    f"throughput per GPU (TFLOP/s/GPU): {45.0 + rank:.1f} |\n" for i in range(3)))
    cfg = load(None, environ={"NCCLWATCH_INGEST_TRAINLOG_TIMEZONE": "UTC"})
    opts = Options(spool_dir=str(tmp_path / "spool"), state_dir=str(tmp_path / "state"), node_id="n1",
                   training_logs=[str(logs / "rank-0.log"), str(logs / "rank-1.log")], job="job-log", once=True)
    fwd = Forwarder(cfg, opts, metrics=ForwarderMetrics())
    try:
        out: list = []
        fwd.reads.read(fwd.trainlog.tailer, fwd.trainlog.read, 1000, out, {}, fwd._stream_ids)
        out += fwd._flush_idle(force=True)
    finally:
        fwd.close()
    recs = [parse_line(v) for topic, _, v in out if topic == cfg.topics.throughput]
    t0 = int(datetime(2026, 11, 22, 3, 25, 28, tzinfo=UTC).timestamp()) * 10**9
    assert [(r.step, r.tflops_per_gpu, r.ts_ns) for r in recs] == [
        (i, 45.5, t0 + i * 10**9 + 1000) for i in range(3)
    ]
    assert abs(time.time_ns() - recs[0].ts_ns) > 3600 * 10**9  # not when it was read


def test_forward_cli_takes_training_log_several_times(tmp_path):


    p = argparse.ArgumentParser()
    forward.add_arguments(p)
    args = p.parse_args(["--training-log", "a.log", "--training-log", "logs/*.log"])
    opts = forward.options_from(args, load(None))
    assert opts.training_logs == ["a.log", "logs/*.log"]
    args = p.parse_args([])
    cfg = load(None, environ={"NCCLWATCH_INGEST_TRAINING_LOG": "r0.log, r1.log"})
    assert forward.options_from(args, cfg).training_logs == ["r0.log", "r1.log"]
