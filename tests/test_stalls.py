"""Stalls: the rank that holds its communicator up, named from the plugin's progress records.

A process stopped for seconds (or hung) completes nothing, and neither do its peers, who
wait for it: every key falls silent alike and windows cannot say who is late. The plugin
writes a ``progress`` record per communicator of a process that has waited a second
(``plugin/README.md``); the job stage names the rank that is silent or behind.

Two kinds of input here: a job made of windows (every number chosen), and the recorded
10-s stall of 2026-11-29 with the progress lines the waiting process's plugin writes
added (``_with_progress``: one a second per communicator while an op of the process is
in flight for a second or more, as ``plugin/src/writer.c`` does; the stopped process
writes none). The plugin's own lines are tested in ``tests/test_plugin_progress.py``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
from pathlib import Path

import pytest
from ncclwatch.detectors.evaluate import events_of
from ncclwatch.detectors.pipeline import Pipeline
from ncclwatch.detectors.stalls import StallTracker
from ncclwatch.ingest.recording import Options

from ncclwatch import config
from ncclwatch.config import DetectorConfig, TopicsConfig
from ncclwatch.records import ProgressRecord, ThroughputRecord, WindowSummary, parse_line, to_json
from ncclwatch.routing import key_for, topic_for

S = 10**9
COMM = "0x" + "0" * 15 + "1"
RUNS = Path(__file__).parent / "fixtures" / "gpu_runs" / "2026-11-29-x1"


def window(t: int, rank: int, busbw: float = 40.0) -> WindowSummary:
    return WindowSummary(
        job="j", host=f"h{rank}", comm=COMM, comm_name="dp", op="AllReduce", size_bucket="64MiB",
        transport="net", rank=rank, nranks=2, start_ns=t * S, end_ns=(t + 1) * S, count=10,
        bytes=10 << 26, exec_ns_min=1, exec_ns_p50=int(67e6 / busbw), exec_ns_p95=1, exec_ns_max=1,
        busbw_gbs_p50=busbw, first_seq=10 * t, last_seq=10 * t + 9, pid=100 + rank)


def step(t: float, tflops: float = 300.0) -> ThroughputRecord:
    return ThroughputRecord(job="j", host="h0", rank=-1, ts_ns=int(t * S), step=int(t), tflops_per_gpu=tflops,
                            tokens_per_s=None, source="api")


def progress(t: float, rank: int, *, colls: int, in_flight: int, since: float = 0.0,
             comm: str = COMM, nranks: int = 2) -> ProgressRecord:
    return ProgressRecord(
        job="j", host=f"h{rank}", pid=100 + rank, gpu="GPU-x", comm=comm, comm_name="dp", rank=rank,
        nranks=nranks, ts_ns=int(t * S), issued=colls, colls=colls, done=colls - in_flight, in_flight=in_flight,
        waiting_since_ns=int(since * S) if in_flight else 0, last_done_ns=int(since * S))


def run(p: Pipeline, start: int, end: int, *, step_at: float = 1.0) -> list:
    """Both ranks' windows and a step a second over ``[start, end)``: the events."""
    out = []
    for t in range(start, end):
        for rank in (0, 1):
            out += p.process(window(t, rank))
        out += p.process(step(t + step_at))
    return out


def stalled_job(cfg: DetectorConfig, *, stall_at: int = 40, stall_s: int = 10, waiting: tuple = (0,),
                writes: dict | None = None, resume: bool = True) -> list:
    """Windows and steps for ``stall_at`` s, nothing completing for ``stall_s`` s while
    ``waiting`` ranks write progress records once a second (``writes``: other ranks'
    records, rank -> kwargs), then ``resume``; the events in order."""
    p = Pipeline(cfg)
    out = run(p, 0, stall_at)
    for k in range(1, stall_s + 1):
        t = stall_at + k
        for rank in waiting:
            out += p.process(progress(t, rank, colls=400, in_flight=1, since=stall_at))
        for rank, kw in (writes or {}).items():
            out += p.process(progress(t, rank, **kw))
        out += p.advance(t * S)
    if resume:
        end = stall_at + stall_s
        out += p.process(step(end + 0.5, 300.0 / (stall_s + 1)))  # the step that spanned it
        out += run(p, end, end + 20, step_at=1.5)
    return out


def test_a_silent_rank_is_named_while_its_peer_waits_and_resolved_once_ops_complete():
    events = stalled_job(DetectorConfig())
    assert [(e.type, e.state, e.rank, e.host) for e in events] == [
        ("straggler", "firing", 1, "h1"), ("straggler", "resolved", 1, "h1")]
    fired = events[0]
    assert fired.severity == "critical" and fired.attribution == "straggler"
    assert fired.start_ns == 40 * S and fired.detected_ns == 43 * S  # stall_after_s = 3
    assert fired.evidence["comm"] == COMM and fired.evidence["pid"] == 101  # from its windows
    stalled = fired.evidence["stalled"]
    assert stalled["silent_ranks"] == [1] and stalled["waiting_ranks"] == [0] and stalled["behind_ranks"] == []
    assert events[1].end_ns == 50 * S and events[1].evidence["stalled"]["waiting_s"] == 10.0
    # the job's drop over the stall is the stall's: no throughput_drop of its own


def test_a_rank_that_has_not_called_the_collective_is_named_as_behind():
    events = stalled_job(DetectorConfig(), writes={1: {"colls": 399, "in_flight": 0}})
    assert events[0].rank == 1 and events[0].evidence["stalled"]["behind_ranks"] == [1]
    assert events[0].evidence["stalled"]["silent_ranks"] == []


def test_every_rank_waiting_names_nobody_and_raises_the_path():
    """Both in the same collective, none behind or silent: no rank holds it, and a
    straggler would be a guess. What they wait on is raised, by the communicator's
    transport class: here a network communicator, so the path (gone altogether)."""
    events = stalled_job(DetectorConfig(), writes={1: {"colls": 400, "in_flight": 1, "since": 40}})
    assert [(e.type, e.state, e.rank, e.attribution) for e in events] == [
        ("network_path", "firing", None, "network"), ("network_path", "resolved", None, "network")]
    fired = events[0]
    assert fired.detected_ns == 43 * S and fired.severity == "critical"
    assert fired.evidence["every_rank_waits"] is True and fired.evidence["stalled"]["waiting_ranks"] == [0, 1]
    assert fired.evidence["hosts"] == ["h0", "h1"]


def test_a_short_wait_or_the_knob_off_raises_nothing():
    assert [e.type for e in stalled_job(DetectorConfig(), stall_s=2)] == []
    assert [e for e in stalled_job(DetectorConfig(stall_after_s=0)) if "stalled" in e.evidence] == []


def test_the_wait_must_also_be_several_steps_long():
    """Steps of 1 s here: with stall_steps = 8 a 5-s wait is a barrier, not a stall."""
    assert [e for e in stalled_job(DetectorConfig(stall_steps=8.0), stall_s=5) if "stalled" in e.evidence] == []
    assert any("stalled" in e.evidence for e in stalled_job(DetectorConfig(stall_steps=2.0), stall_s=5))


def test_waits_at_start_up_are_not_stalls():
    p = Pipeline(DetectorConfig())
    out = []
    for t in range(3):  # the job has run 3 s: nothing warm yet
        for rank in (0, 1):
            out += p.process(window(t, rank))
    for t in range(4, 15):
        out += p.process(progress(t, 0, colls=30, in_flight=1, since=3))
    assert out == []


def test_a_start_up_wait_is_not_judged_once_the_job_runs():
    """Records from before the job ran steadily are held for a recording whose windows
    come late; those of its start-up are dropped, not judged, once it runs."""
    p = Pipeline(DetectorConfig())
    out = []
    for t in range(1, 30):  # rank 0 waits 30 s in its first collective for rank 1
        out += p.process(progress(t, 0, colls=1, in_flight=1, since=0))
    out += run(p, 30, 70)
    assert out == []


def test_progress_read_before_the_windows_of_its_time_is_judged_once_they_come():
    """A recording replayed through watch: its time merge may hold a job's windows behind
    other processes while the progress records of later seconds go to the detectors."""
    p = Pipeline(DetectorConfig())
    out = []
    for t in range(41, 51):
        out += p.process(progress(t, 0, colls=400, in_flight=1, since=40))
    out += run(p, 0, 40)
    out += p.process(step(50.5, 300.0 / 11))
    out += run(p, 50, 70, step_at=1.5)
    assert [(e.type, e.state, e.rank, e.detected_ns // S) for e in out] == [
        ("straggler", "firing", 1, 43), ("straggler", "resolved", 1, 53)]


def test_a_hung_job_stays_raised_while_its_ranks_write_progress():
    """No window for a minute: the job waits, it has not ended (no job_silent)."""
    events = stalled_job(DetectorConfig(), stall_s=60, resume=False)
    assert [(e.type, e.state) for e in events] == [("straggler", "firing")]


def test_half_the_ranks_silent_is_lost_telemetry_not_a_stall():
    tr = StallTracker()
    for t in range(1, 6):
        tr.see("c", "x", 8, 0, t * S, colls=5, in_flight=1, waiting_since_ns=S // 2, host="a", pid=1)
    (st,) = tr.stalls(3 * S)
    assert len(st.holders) == 7  # seven of eight said nothing
    p = Pipeline(DetectorConfig())
    run(p, 0, 40)
    out = []
    for t in range(41, 50):
        out += p.process(progress(t, 0, colls=400, in_flight=1, since=40, comm="0x" + "0" * 15 + "2", nranks=8))
    assert out == []


def test_a_stall_continues_across_a_restart():
    cfg = DetectorConfig()
    whole = stalled_job(cfg)
    p = Pipeline(cfg)
    out = run(p, 0, 40)
    for t in range(41, 45):
        out += p.process(progress(t, 0, colls=400, in_flight=1, since=40))
    p = Pipeline.from_state(cfg, json.loads(json.dumps(p.to_state())))
    for t in range(45, 51):
        out += p.process(progress(t, 0, colls=400, in_flight=1, since=40))
        out += p.advance(t * S)
    out += p.process(step(50.5, 300.0 / 11))
    out += run(p, 50, 70, step_at=1.5)
    assert out == whole


def test_progress_records_round_trip_and_route_with_the_telemetry():
    rec = progress(3, 1, colls=7, in_flight=1, since=2)
    assert parse_line(to_json(rec)) == rec
    assert topic_for(TopicsConfig(), rec.KIND) == TopicsConfig().telemetry and key_for(rec) == b"j"
    bad = json.loads(to_json(rec))
    bad["in_flight"] = -1
    assert parse_line(json.dumps(bad)).reason == "schema"


@pytest.mark.parametrize("knob", ["stall_after_s", "stall_steps"])
def test_negative_knobs_are_refused(knob):
    with pytest.raises(ValueError, match=knob):
        dataclasses.replace(DetectorConfig(), **{knob: -1.0})


# --- the recorded stall, with its waiting process's progress lines -----------------------


def _with_progress(src: Path, dst: Path, waiting_pid: int) -> Path:
    """The run with the lines the plugin of ``waiting_pid`` writes while an op of it is
    in flight for over a second: each second, one per communicator."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w:gz") as tout:
        for m in tin.getmembers():
            data = tin.extractfile(m).read() if m.isfile() else None
            if data is not None and m.name.endswith(f"-{waiting_pid}.000000.jsonl") and "/spool/" in m.name \
                    and "-throughput-" not in m.name:
                recs = [json.loads(line) for line in data.splitlines() if line.strip()]
                ops = [r for r in recs if r["kind"] == "op"]
                comms = {r["comm"]: r for r in ops}
                extra = []
                for w in (r for r in ops if r["exec_ns"] >= 1.5 * S):
                    t = w["start_ns"] + S
                    while t < w["start_ns"] + w["exec_ns"]:
                        for c, r0 in comms.items():
                            mine = [r for r in ops if r["comm"] == c and r["start_ns"] <= t]
                            done = [r for r in mine if r["start_ns"] + r["exec_ns"] <= t]
                            n = len(mine) - len(done)
                            extra.append(to_json(ProgressRecord(
                                job=r0["job"], host=r0["host"], pid=r0["pid"], gpu=r0["gpu"], comm=c,
                                comm_name=r0["comm_name"], rank=r0["rank"], nranks=r0["nranks"], ts_ns=t,
                                issued=len(mine), colls=len(mine), done=len(done), in_flight=n,
                                waiting_since_ns=w["start_ns"] if n else 0,
                                last_done_ns=max((r["start_ns"] + r["exec_ns"] for r in done), default=0))))
                        t += S
                assert extra, "the waiting process has no op in flight for over a second"
                data = data + ("\n".join(extra) + "\n").encode()
                m.size = len(data)
            tout.addfile(m, io.BytesIO(data) if data is not None else None)
    return dst


def test_the_recorded_10s_stall_names_the_stopped_rank(tmp_path):
    run = _with_progress(RUNS / "p1x2-sync-stall-r1-10s.tar.gz", tmp_path / "p1x2-sync-stall-r1-10s.tar.gz", 705)
    events = events_of(run, config.load(None, environ={}), Options())
    with tarfile.open(run) as t:
        labels = next(m for m in t.getmembers() if m.name.endswith("labels.json"))
        fault = json.loads(t.extractfile(labels).read())["faults"][0]
    assert [(e.type, e.state, e.rank) for e in events] == [("straggler", "firing", 1), ("straggler", "resolved", 1)]
    fired = events[0]
    assert fired.evidence["pid"] == fault["pid"] == 706 and fired.evidence["stalled"]["silent_ranks"] == [1]
    assert fired.severity == "critical"
    assert 2.5 * S <= fired.detected_ns - fault["start_ns"] <= 4.5 * S  # was a throughput_drop 13-14 s in


def test_progress_read_after_the_windows_passed_it_is_one_stall():
    """A worker catching up may read a stall's progress records after the windows that
    followed it: the stall is raised once (at its own time) and ends, not once a record."""
    p = Pipeline(DetectorConfig())
    out = run(p, 0, 40)
    for t in range(50, 70):
        for rank in (0, 1):
            out += p.process(window(t, rank))
    for t in range(41, 51):
        out += p.process(progress(t, 0, colls=400, in_flight=1, since=40))
    stalls = [(e.state, e.detected_ns // S) for e in out if "stalled" in e.evidence]
    assert stalls[0] == ("firing", 43) and [s for s, _ in stalls] == ["firing", "resolved"]


def test_one_record_of_a_wait_is_not_a_wait_seen():
    """A stopped process, resumed, writes one record of the wait it slept through before
    its op completes; read alone (its peer's records not yet), it must not make the peer
    the silent one."""
    p = Pipeline(DetectorConfig())
    run(p, 0, 40)
    assert p.process(progress(48.5, 1, colls=400, in_flight=1, since=40)) == []


def test_people_are_told_it_is_a_stall_not_a_loss_of_bandwidth():
    from ncclwatch.alerting.alerts import AlertLinks, alert_from_event
    from ncclwatch.detectors.console import format_event

    fired = stalled_job(DetectorConfig())[0]
    line = format_event(fired)
    assert "stalled: rank 1 silent while rank 0 waits 3 s in collective #400" in line and "loss" not in line
    alert = alert_from_event(fired, AlertLinks())
    text = json.dumps(alert)
    assert "stalled: rank 1 silent" in text and "Effect 0.0%" not in text


def test_a_hung_job_that_falls_silent_keeps_its_stall_until_it_is_forgotten():
    """The plugin stops reporting an op stuck past NCCLWATCH_OP_TIMEOUT_MS: the job then
    says nothing at all, which ends its other incidents (job_silent) but not the stall,
    which resolves only if the job comes back or is forgotten (job_evict_s)."""
    cfg = DetectorConfig(job_evict_s=600.0)
    p = Pipeline(cfg)
    out = run(p, 0, 40)
    for t in range(41, 71):  # 30 s of progress, then nothing
        out += p.process(progress(t, 0, colls=400, in_flight=1, since=40))
    for t in range(71, 300, 10):
        out += p.advance(t * S)
    assert [(e.type, e.state) for e in out] == [("straggler", "firing")]
    out += p.advance(700 * S)
    assert [(e.type, e.state) for e in out][-1] == ("straggler", "resolved")
    assert out[-1].evidence["resolved_because"] == "job_evicted" and p.jobs() == []


@pytest.mark.parametrize("stall_s", [2, 10])
def test_the_wait_is_a_gauge_while_it_lasts_stall_or_not(stall_s):
    """``ncclwatch_comm_waiting_seconds``: how long the communicator has waited, as the
    records say, from a second on, for a wait too short to raise as for a stall; the
    series goes once operations complete again."""
    from ncclwatch.detectors.metrics import DetectorMetrics
    from prometheus_client import CollectorRegistry

    labels = {"training_job": "j", "comm": COMM, "comm_name": "dp"}
    m = DetectorMetrics(CollectorRegistry())
    p = Pipeline(DetectorConfig())
    m.bind(p)
    run(p, 0, 40)
    assert m.registry.get_sample_value("ncclwatch_comm_waiting_seconds", labels) is None
    seen = []
    for k in range(1, stall_s + 1):
        p.process(progress(40 + k, 0, colls=400, in_flight=1, since=40))
        p.advance((40 + k) * S)
        seen.append(m.registry.get_sample_value("ncclwatch_comm_waiting_seconds", labels))
    assert seen == [float(k) for k in range(1, stall_s + 1)]
    end = 40 + stall_s
    p.process(step(end + 0.5, 300.0 / (stall_s + 1)))
    run(p, end, end + 20, step_at=1.5)
    assert m.registry.get_sample_value("ncclwatch_comm_waiting_seconds", labels) is None
