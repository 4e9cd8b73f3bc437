"""Every source everywhere: ``watch``, ``replay``, ``report`` and ``eval`` read what ``forward``
reads (plugin spool, NCCL Inspector JSON logs, per-rank training logs), through one reader."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from ncclwatch.detectors import watch
from ncclwatch.detectors.watch import Watch
from ncclwatch.ingest.live import LiveSources
from ncclwatch.ingest.recording import Options, ReadStats, RecordingError, read_recording
from ncclwatch_testkit.drivers import _op
from sources_support import inspector_line, write_inspector_run

from ncclwatch import cli
from ncclwatch.config import load
from ncclwatch.records import OpRecord, ThroughputRecord, parse_line


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("inspector-run")
    return root, write_inspector_run(root)


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_watch_on_an_inspector_dump_directory_with_per_rank_logs_finds_the_network_fault(run, tmp_path):
    """The issue's command, on a recording laid out as Inspector and Megatron write it."""
    root, info = run
    out = tmp_path / "F.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "ncclwatch.cli", "watch", "inspector", "--training-log", "logs/*.log",
         "--speed", "0", "--events-out", str(out), "--metrics-port", "-1"],
        cwd=root, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    events = _events(out)
    assert events and all(parse_line(json.dumps(e)).KIND == "anomaly" for e in events)
    firing = [e for e in events if e["state"] == "firing" and e["type"] == "network_path"]
    assert firing, events
    ev = firing[0]
    assert info["degrade_ns"] <= ev["start_ns"] <= info["degrade_ns"] + 2 * 10**9
    # the training logs' throughput arrived in time to be attached (13 % loss: critical)
    assert ev["throughput_delta"] is not None and ev["throughput_delta"] < -0.05
    assert ev["severity"] == "critical"
    assert not [e for e in events if e["state"] == "firing" and e["key"]["transport"] == "nvlink"]
    # the dump_stats markers were counted, not quarantined as bad lines
    assert "dump_stats" in proc.stdout and "bad lines" not in proc.stdout


def test_inspector_logs_give_the_same_records_from_a_directory_a_file_and_an_archive(run, tmp_path):
    root, info = run
    stats = ReadStats()
    from_dir = read_recording([root / "inspector"], stats)
    assert len(from_dir) == info["ops"] and all(isinstance(r, OpRecord) for r in from_dir)
    assert stats.quarantined == {} and stats.skipped["dump_stats"] > 0
    one = sorted((root / "inspector").glob("*.log"))[0]
    assert 0 < len(read_recording([one])) < len(from_dir)
    archive = tmp_path / "insp.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root / "inspector", arcname="nccl-inspector-4711")
    from_tar = read_recording([archive])
    assert [(r.id, r.start_ns) for r in from_tar] != []
    # the directory Inspector names by default gives the job
    assert {r.job for r in from_tar} == {"4711"}
    assert sorted(r.seq for r in from_tar) == sorted(r.seq for r in from_dir)


def test_a_p2p_record_becomes_a_send_op_and_a_marker_is_skipped_not_quarantined(tmp_path):
    fixture = Path(__file__).parent / "fixtures" / "inspector" / "nvl72033-T01-pid1639453.log"
    d = tmp_path / "dump"
    d.mkdir()
    marker = json.dumps({"header": {"id": "0x1a2b3c4d5e6f7", "comm_name": "PP Group 1", "rank": 0,
                                    "n_ranks": 2, "nnodes": 2},
                         "metadata": {"inspector_output_format_version": "v4.0", "git_rev": "",
                                      "rec_mechanism": "nccl_profiler_interface",
                                      "dump_timestamp_us": 1763790003300000, "hostname": "h", "pid": 1},
                         "dump_stats": {"coll_records": 0, "p2p_records": 1}})
    (d / "h-pid1.log").write_text(marker + "\n" + fixture.read_text())
    stats = ReadStats()
    recs = read_recording([d], stats)
    assert stats.skipped == {"dump_stats": 1} and stats.quarantined == {}
    assert [(r.op, r.peer) for r in recs if r.peer != -1] == [("Send", 1)]
    assert len(recs) == len(fixture.read_text().splitlines())


def test_a_source_nothing_can_read_is_an_error_that_says_what_it_found(tmp_path, capsys):
    d = tmp_path / "logs"
    d.mkdir()
    (d / "torchrun.log").write_text("[default0]: starting\n")
    assert cli.main(["watch", str(d), "--speed", "0", "--metrics-port", "-1"]) == 2
    err = capsys.readouterr().err
    assert "no plugin spool" in err and "Inspector" in err and "torchrun.log" in err
    assert cli.main(["watch", str(d / "torchrun.log"), "--metrics-port", "-1"]) == 2
    assert "--training-log" in capsys.readouterr().err  # a training log given as the source


def test_training_log_given_twice_reads_both_and_a_glob_that_matches_nothing_is_an_error(run):
    root, info = run
    logs = [str(root / "logs" / "rank-0.log"), str(root / "logs" / "rank-1.log")]
    recs = read_recording([root / "inspector"], options=Options(training_logs=tuple(logs)))
    tps = [r for r in recs if isinstance(r, ThroughputRecord)]
    # one job series: one record per iteration, the median of the two ranks' figures
    assert len(tps) == info["steps"]
    fixture = {t.step: t.tflops_per_gpu for t in info["throughput"]}
    assert all(abs(t.tflops_per_gpu - (round(fixture[t.step], 1) + 0.5)) < 0.06 for t in tps)
    with pytest.raises(RecordingError, match="no such file"):
        read_recording([root / "inspector"], options=Options(training_logs=(str(root / "nope-*.log"),)))


def test_training_logs_are_stamped_with_their_own_time_not_when_they_were_read(run):
    root, info = run
    recs = read_recording([root / "inspector"], options=Options(training_logs=(str(root / "logs" / "*.log"),)))
    got = {r.step: r.ts_ns for r in recs if isinstance(r, ThroughputRecord)}
    for t in info["throughput"]:
        # rank 1 logged 7 ms after rank 0: the iteration is stamped at the later one
        assert got[t.step] == t.ts_ns + 7_000_000


def test_replay_files_turns_inspector_logs_and_training_logs_into_contract_records(run, tmp_path):
    root, info = run
    out = tmp_path / "records.jsonl"
    rc = cli.main(["replay", "--files", str(root / "inspector"), "--training-log", str(root / "logs" / "rank-*.log"),
                   "--job", "j7", "--out", str(out), "--no-progress"])
    assert rc == 0
    recs = [parse_line(line) for line in out.read_bytes().splitlines()]
    kinds = {r.KIND for r in recs}
    assert kinds == {"op", "throughput"} and {r.job for r in recs} == {"j7"}
    assert sum(r.KIND == "op" for r in recs) == info["ops"]
    times = [r.start_ns + r.exec_ns if r.KIND == "op" else r.ts_ns for r in recs]
    assert times == sorted(times)


def test_replay_detect_on_inspector_logs_gives_what_watch_gives(run, tmp_path):
    root, _ = run
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    logs = str(root / "logs" / "*.log")
    assert cli.main(["watch", str(root / "inspector"), "--training-log", logs, "--speed", "0",
                     "--events-out", str(a), "--metrics-port", "-1"]) == 0
    assert cli.main(["replay", "--files", str(root / "inspector"), "--training-log", logs, "--detect",
                     "--events-out", str(b), "--no-progress"]) == 0
    assert _events(a) == _events(b) and _events(a)


def test_inspector_ops_give_the_plugin_spools_anomalies(run, tmp_path):
    """The same job seen through Inspector or through the plugin: the same verdict."""
    root, info = run
    cfg = load(None)
    spool_events = watch.detect(cfg, read_recording([info["spool"]]))
    insp = read_recording([root / "inspector"], options=Options(job=info["job"],
                                                                training_logs=(str(root / "logs" / "rank-0.log"),)))
    insp_events = watch.detect(cfg, insp)

    def verdict(events):
        return sorted((e.type, e.state, e.key["comm"], e.severity) for e in events)

    assert verdict(insp_events) == verdict(spool_events)


def test_a_run_directory_with_inspector_and_trainlogs_is_read_with_its_job(tmp_path):
    run_dir = tmp_path / "p-tc-8g"
    info = write_inspector_run(run_dir)
    (run_dir / "logs").rename(run_dir / "trainlogs")
    (run_dir / "run.json").write_text(json.dumps({"job": "gpu-p-tc-8g"}))
    shutil.rmtree(info["spool"])  # an Inspector run: no plugin spool
    recs = read_recording([run_dir])
    assert {r.job for r in recs} == {"gpu-p-tc-8g"}
    assert sum(isinstance(r, ThroughputRecord) for r in recs) == info["steps"]


def test_an_inspector_line_is_windowed_with_inspector_lateness_in_watch(tmp_path):
    """Inspector dumps per communicator, so its ops come out of order: watch waits for them
    as the forwarder's Inspector windower does, and loses none."""
    t0 = 1_763_800_000 * 10**9
    ops = [_op("j", "h", 1, 0, "0x00000000000000a0", "net", 2, 2, s, t0 + s * 10**8, 32 << 20, 20.0)
           for s in range(100)]
    d = tmp_path / "dump"
    d.mkdir()
    # the second communicator's half second comes first: one dump of 5 s late
    lines = [inspector_line(r) for r in ops[50:]] + [inspector_line(r) for r in ops[:50]]
    (d / "h-pid1.log").write_text("\n".join(lines) + "\n")
    live = LiveSources(None, [str(d)], [], Options(job="j"))
    w = Watch(load(None), out=io.StringIO())
    for _, _, rec in live.poll(1000):
        w.feed(rec)
    w.flush()
    assert w.inspector_windower.late_total == 0 and w.windows_made == 10


def test_watch_tails_an_inspector_dump_directory_and_training_logs_as_it_replays_them(run, tmp_path):
    """Live (no --speed): the directory holds Inspector logs, so it is tailed as one."""
    root, info = run
    live, replayed = tmp_path / "live.jsonl", tmp_path / "replayed.jsonl"
    logs = str(root / "logs" / "*.log")
    assert cli.main(["watch", str(root / "inspector"), "--once", "--training-log", logs, "--job", info["job"],
                     "--events-out", str(live), "--metrics-port", "-1"]) == 0
    assert cli.main(["watch", str(root / "inspector"), "--speed", "0", "--training-log", logs, "--job", info["job"],
                     "--events-out", str(replayed), "--metrics-port", "-1"]) == 0
    assert _events(live) == _events(replayed)
    assert any(e["type"] == "network_path" and e["severity"] == "critical" for e in _events(live))


def test_training_logs_take_the_job_the_inspector_directory_names(run, tmp_path):
    root, info = run
    d = tmp_path / "nccl-inspector-4711"
    shutil.copytree(root / "inspector", d)
    logs = (str(root / "logs" / "*.log"),)
    recs = read_recording([d], options=Options(training_logs=logs))
    assert {r.job for r in recs} == {"4711"} and sum(isinstance(r, ThroughputRecord) for r in recs) == info["steps"]
    live = LiveSources(None, [str(d)], list(logs), Options())
    ops = [r for _, _, r in live.poll(100_000)]
    assert {r.job for r in ops} == {"4711"} and any(isinstance(r, ThroughputRecord) for r in ops)
