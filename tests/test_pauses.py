"""Checkpoint saves: a job that stops training on purpose is not a stalled job.

While rank 0 writes a checkpoint its peers wait for it in NCCL: by the progress records a
stall naming rank 0. Megatron-LM logs the save's begin and end; they reach the detectors
as ``pause`` records, and what begins inside a pause is not raised while it lasts
(``detectors/pauses.py``). Each test runs the same stall with and without the pause,
so a pass cannot come from a stall that raises nothing anyway.
"""

from __future__ import annotations

import json
import tarfile
from datetime import UTC, datetime
from pathlib import Path

import pytest
from ncclwatch.detectors.messages import DETECTOR_KINDS, JOB_KINDS, Message, decode_message
from ncclwatch.detectors.pipeline import Pipeline
from ncclwatch.ingest.parse import parse_record, to_record
from ncclwatch.ingest.trainlog import RankLogs, RankMerge

from ncclwatch.config import DetectorConfig, TopicsConfig, load
from ncclwatch.records import PauseRecord, ThroughputRecord, WindowSummary, parse_line, schema_path, to_json
from ncclwatch.routing import key_for, topic_for

S = 10**9
COMM = "0x" + "0" * 15 + "1"


def window(t: int, rank: int, busbw: float = 40.0) -> WindowSummary:
    return WindowSummary(
        job="j", host=f"h{rank}", comm=COMM, comm_name="dp", op="AllReduce", size_bucket="64MiB",
        transport="net", rank=rank, nranks=2, start_ns=t * S, end_ns=(t + 1) * S, count=10,
        bytes=10 << 26, exec_ns_min=1, exec_ns_p50=int(67e6 / busbw), exec_ns_p95=1, exec_ns_max=1,
        busbw_gbs_p50=busbw, first_seq=10 * t, last_seq=10 * t + 9, pid=100 + rank)


def step(t: float, tflops: float = 300.0) -> ThroughputRecord:
    return ThroughputRecord(job="j", host="h0", rank=-1, ts_ns=int(t * S), step=int(t), tflops_per_gpu=tflops,
                            tokens_per_s=None, source="log")


def pause(t: float, state: str) -> PauseRecord:
    return PauseRecord(job="j", host="h0", rank=-1, ts_ns=int(t * S), state=state, reason="checkpoint", step=40)


def progress(t: int, since: int):
    from ncclwatch.records import ProgressRecord
    return ProgressRecord(
        job="j", host="h1", pid=101, gpu="GPU-x", comm=COMM, comm_name="dp", rank=1, nranks=2, ts_ns=t * S,
        issued=400, colls=400, done=399, in_flight=1, waiting_since_ns=since * S, last_done_ns=since * S)


def saving_job(*, pauses: dict[float, str], stall_at: int = 40, stall_s: int = 10,
               steps_in_stall: tuple[float, ...] = ()) -> list:
    """A job running 40 s; from ``stall_at`` rank 1 waits ``stall_s`` s for rank 0 (which
    writes no record: it is writing a checkpoint, or stopped), with ``pauses`` (time ->
    begin/end) and steps logged at ``steps_in_stall``; then 20 s more. The events."""
    p = Pipeline(DetectorConfig())
    out = []
    for t in range(0, stall_at):
        out += p.process(window(t, 0)) + p.process(window(t, 1)) + p.process(step(t + 1.0))
    todo = sorted([(t, "pause", s) for t, s in pauses.items()] + [(t, "step", None) for t in steps_in_stall])
    for k in range(1, stall_s + 1):
        t = stall_at + k
        while todo and todo[0][0] <= t - 0.5:
            at, what, state = todo.pop(0)
            out += p.process(pause(at, state) if what == "pause" else step(at))
        out += p.process(progress(t, stall_at))
        out += p.advance(t * S)
    for at, what, state in todo:
        out += p.process(pause(at, state) if what == "pause" else step(at))
    end = stall_at + stall_s
    out += p.process(step(end + 0.5))  # Megatron's interval time leaves the save out
    for t in range(end, end + 20):
        out += p.process(window(t, 0)) + p.process(window(t, 1)) + p.process(step(t + 1.5))
    return out


def fired(events: list) -> list:
    return [(e.type, e.rank, e.start_ns // S, e.detected_ns // S) for e in events if e.state == "firing"]


def test_a_checkpoint_save_raises_nothing_where_the_same_wait_is_a_stall():
    assert fired(saving_job(pauses={})) == [("straggler", 0, 40, 43)]
    assert saving_job(pauses={40.1: "begin", 50.0: "end"}) == []


def test_a_save_whose_end_line_is_missing_raises_nothing_either():
    # (that the next logged step ends it: the asynchronous-save test below)
    assert saving_job(pauses={40.1: "begin"}) == []


def test_a_key_slowed_in_a_save_is_held_and_raised_once_it_outlasts_it():
    """The keys' own incidents (``IncidentBook.confirm``): a link 40 % slower from 40 s
    is the path; begun inside a save that ends at 45 s, it is raised only past the save's
    early span, dated from 40 s; over by the save's end, never."""
    def run(pauses: dict[float, str], slow_until: int) -> list:
        p = Pipeline(DetectorConfig())
        out = []
        for t in range(70):
            for at, state in pauses.items():
                if t - 1 < at <= t:
                    out += p.process(pause(at, state))
            slow = 40 <= t < slow_until
            bw = 24.0 if slow else 40.0  # ... which costs the job 20 %
            out += p.process(window(t, 0, bw)) + p.process(window(t, 1, bw))
            if not (pauses and 40 <= t < 45):  # no step completes while the job saves
                out += p.process(step(t + 1.0, 240.0 if slow else 300.0))
        return [(e.type, e.start_ns // S, e.detected_ns // S) for e in out if e.state == "firing"]

    alone = run({}, 60)
    assert [(t, s) for t, s, _ in alone] == [("network_path", 40)], alone
    outlasting = run({39.9: "begin", 45.0: "end"}, 60)
    assert [(t, s) for t, s, _ in outlasting] == [("network_path", 40)] and outlasting[0][2] >= 48, outlasting
    assert alone[0][2] < outlasting[0][2]
    assert run({39.9: "begin", 45.0: "end"}, 45) == []


def test_a_wait_that_outlasts_the_save_is_raised_from_where_it_began():
    """The save ended at 43 s, its ranks still wait: raised once the early span (3 s)
    after the save's end is over, dated from when the wait began."""
    assert fired(saving_job(pauses={40.1: "begin", 43.0: "end"})) == [("straggler", 0, 40, 46)]


def test_a_wait_that_began_before_the_save_is_raised_as_ever():
    assert fired(saving_job(pauses={45.0: "begin", 50.0: "end"}, stall_at=40)) == [("straggler", 0, 40, 43)]


def test_an_asynchronous_save_excuses_only_until_training_goes_on():
    """An asynchronous save logs its begin, the job steps on (which ends the pause), and
    a stall after that is a stall."""
    assert fired(saving_job(pauses={36.0: "begin"}, steps_in_stall=(37.0,), stall_at=40)) == [
        ("straggler", 0, 40, 43)]


def test_pauses_survive_a_restart_of_the_job_stage():
    p = Pipeline(DetectorConfig())
    for t in range(0, 40):
        p.process(window(t, 0)), p.process(window(t, 1)), p.process(step(t + 1.0))
    p.process(pause(40.1, "begin"))
    q = Pipeline.from_state(DetectorConfig(), p.to_state())
    out = []
    for t in range(41, 51):
        out += q.process(progress(t, 40)) + q.advance(t * S)
    assert out == []


def test_megatrons_save_lines_are_pauses_released_at_once_in_time_order():
    """Rank 0 logs the save, the last rank the iterations: the merge holds an iteration
    for its ranks, never the pause (it says what the job does now)."""
    logs = RankLogs(job="j", host="h", timezone="UTC", expect_new=True)
    it = b"[2026-12-07 11:00:%02d.0] iteration %d/ 100 | elapsed time per iteration (ms): 450.0 | " \
         b"throughput per GPU (TFLOP/s/GPU): 15.7 |"
    logs.add(b"", "rank-0.log", 0)
    logs.add(it % (4, 40), "rank-1.log", 0)
    logs.add(b"[2026-12-07 11:00:04.2] saving checkpoint at iteration      40 to /ck in torch format",
             "rank-0.log", 0)
    out = logs.merge.release()
    assert [(r.KIND, getattr(r, "state", None)) for r in out] == [("pause", "begin")]
    logs.add(b"  [2026-12-07 11:00:12.5] successfully saved checkpoint from iteration      40 to /ck "
             b"[ t 1/1, gtp_remat 1/1, p 1/1 ]", "rank-0.log", 0)
    logs.add(it % (13, 41), "rank-1.log", 0)
    out = logs.merge.flush()
    assert [(r.KIND, r.step) for r in out] == [("throughput", 40), ("pause", 40), ("throughput", 41)]
    assert [r.ts_ns for r in out] == sorted(r.ts_ns for r in out)


def test_an_untimed_save_line_of_older_megatron_is_stamped_when_read():
    logs = RankLogs(job="j", host="h", timezone="UTC")
    rec = logs.add(b"saving checkpoint at iteration     200 to /ck in torch_dist format", "rank-0.log", 123)
    assert (rec.KIND, rec.state, rec.ts_ns, rec.step) == ("pause", "begin", 123, 200)
    assert logs.parser("rank-0.log").untimed == 1


def test_a_custom_throughput_pattern_reads_no_save_lines():
    logs = RankLogs(job="j", host="h", regex=r"tflops=(?P<tflops>[0-9.]+)")
    assert logs.add(b"[2026-12-07 11:00:04.2] saving checkpoint at iteration 40 to /ck", "r.log", 0) is None


def test_the_pause_record_is_in_the_contract_and_rides_the_job_topic():
    rec = pause(40.1, "begin")
    line = to_json(rec)
    assert parse_line(line) == rec and parse_record(line.encode()) == rec
    assert schema_path("pause").exists()
    topics = TopicsConfig()
    assert (topic_for(topics, "pause"), key_for(rec)) == (topics.throughput, b"j")
    assert to_record(decode_message(Message(topics.throughput, 0, 1, b"j", line.encode()), JOB_KINDS)) == rec
    assert PauseRecord in DETECTOR_KINDS
    bad = parse_line(line.replace('"begin"', '"halfway"'))
    assert bad.reason == "schema"


def test_release_of_a_merge_without_pauses_is_unchanged():
    m = RankMerge(hold_s=None)
    m.add("a", step(1.0))
    assert m.release() == [] and [r.step for r in m.flush()] == [1]


def test_a_save_is_a_gauge_while_it_lasts_and_shaded_on_the_job_dashboard():
    from ncclwatch.dashboards import generate
    from ncclwatch.detectors.metrics import DetectorMetrics
    from prometheus_client import CollectorRegistry

    p = Pipeline(DetectorConfig())
    p.observer = m = DetectorMetrics(CollectorRegistry())
    seen = []
    for rec in (step(1.0), pause(1.5, "begin"), step(9.0), pause(20.0, "begin"), pause(25.0, "end")):
        p.process(rec)
        seen.append(m.registry.get_sample_value("ncclwatch_job_checkpoint_saving", {"training_job": "j"}))
    assert seen == [None, 1.0, 0.0, 1.0, 0.0]  # a logged step ends a save as its end line does
    anno = [a["expr"] for a in generate.job_dashboard()["annotations"]["list"] if a.get("expr")]
    assert any(e.startswith("ncclwatch_job_checkpoint_saving{") and e.endswith("> 0") for e in anno)


MEGATRON = Path(__file__).parent / "fixtures" / "gpu_runs" / "2026-11-29-megatron"


def _stop_as_a_save(tmp: Path) -> Path:
    """The recorded 6-s stop of rank 0 in real Megatron-LM (``m1x2-stop-r0-6s-bf``: its peer
    waits in NCCL, its progress records say so), told as a checkpoint save: rank 0's log
    given the two lines Megatron core_v0.19 prints around a save (rank 0 logs the begin
    before it goes quiet and the end after; the device's clock is UTC, as the log's), the
    labels no fault, the job renamed (``SAVE_JOB``). Packed as a run archive of its own."""
    run = "m1x2-stop-r0-6s-bf"
    with tarfile.open(MEGATRON / f"{run}.tar.gz") as tar:
        tar.extractall(tmp / "src", filter="data")
    d = tmp / "src" / run
    labels = json.loads((d / "labels.json").read_text())
    stop = labels["faults"][0]

    def stamp(ns: int) -> str:
        return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")

    with open(d / "trainlogs" / "rank-0.log", "a") as f:
        f.write(f"[{stamp(stop['start_ns'] - 50_000_000)}] saving checkpoint at iteration      40 to "
                "/tmp/ck in torch format\n")
        f.write(f"  [{stamp(stop['end_ns'] + 50_000_000)}] successfully saved checkpoint from iteration      40 "
                "to /tmp/ck [ t 1/1, gtp_remat 1/1, p 1/1 ]\n")
    old = labels["job"]
    for f in (d / "spool").rglob("*.jsonl"):
        f.write_text(f.read_text().replace(f'"job":"{old}"', f'"job":"{SAVE_JOB}"'))
    (d / "spool" / old).rename(d / "spool" / SAVE_JOB)
    (d / "labels.json").write_text(json.dumps({**labels, "job": SAVE_JOB, "scenario": "checkpoint", "faults": []}))
    name = "m1x2-save-r0-6s"
    d = d.rename(d.with_name(name))
    out = tmp / f"{name}.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        tar.add(d, arcname=name)
    return out


SAVE_JOB = "gpu-m1x2-save-r0-6s"


def test_megatrons_real_wait_told_as_a_save_raises_nothing_and_as_a_stop_names_the_rank(tmp_path):
    from gpu_runs_support import eval_gpu_runs

    cfg = load(None, environ={})
    stop, save = eval_gpu_runs.evaluate([MEGATRON / "m1x2-stop-r0-6s-bf.tar.gz", _stop_as_a_save(tmp_path)], cfg, 5.0)
    assert (stop["got"], stop["ok"]) == ("straggler rank 0", True), stop
    assert (save["got"], save["false_alerts"], save["ok"]) == ("-", [], True), save


@pytest.mark.kafka
def test_a_save_in_megatrons_log_reaches_the_worker_through_the_forwarder(kafka_bootstrap, tmp_path):
    """``ncclwatch forward --training-log`` publishes the save's pause records on the job
    topic and ``ncclwatch worker`` raises what local mode raises: the stop, and for the
    same wait told as a save, nothing."""
    from gpu_runs_support import eval_gpu_runs
    from ncclwatch_testkit.drivers import recorded_runs_through_worker, worker_and_local

    runs = [MEGATRON / "m1x2-stop-r0-6s-bf.tar.gz", _stop_as_a_save(tmp_path)]
    got = recorded_runs_through_worker(kafka_bootstrap, tmp_path / "w", runs, eval_gpu_runs.sources)
    worker, local = worker_and_local(got)
    assert worker == local, (worker, local, got["log"][-3000:])
    fired = {(e["job"], e["type"], e.get("rank")) for e in got["events"] if e["state"] == "firing"}
    assert fired == {("gpu-m1x2-stop-r0-6s-bf", "straggler", 0)}, fired  # the stop; the save: nothing
