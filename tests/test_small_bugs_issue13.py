"""The smaller bugs of issue 13, one specification each: stopping a paced replay, both
labels shapes in ``eval`` and ``report``, and the baseline band in ``report``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ncclwatch.dashboards.report import load as load_report
from ncclwatch.detectors.labels import LabelSet
from ncclwatch_testkit.drivers import T0_NS, _op, write_spool
from sources_support import write_inspector_run

from ncclwatch import cli
from ncclwatch.config import load
from ncclwatch.records import to_json

S = 10**9


# --- watch --speed N hears SIGINT/SIGTERM while it sleeps through a gap ------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_paced_replay_stops_at_once_on_a_signal_while_sleeping_through_a_long_gap(tmp_path, sig):
    spool = tmp_path / "spool" / "j"
    spool.mkdir(parents=True)
    # two ops an hour apart: at --speed 1 the replay sleeps an hour between them
    ops = [_op("j", "h", 1, 0, "0x00000000000000a0", "net", 2, 2, s, T0_NS + s * 3600 * S, 32 << 20, 20.0)
           for s in range(2)]
    (spool / "h-GPU-1-1.000000.jsonl").write_text("".join(to_json(r) + "\n" for r in ops))
    out = tmp_path / "ev.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ncclwatch.cli", "watch", str(tmp_path / "spool"), "--speed", "1",
         "--events-out", str(out), "--metrics-port", "-1", "--status-every-s", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        assert "replaying" in proc.stdout.readline()
        time.sleep(1.0)  # now inside the hour-long wait
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=15)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0 and took < 5, (rc, took, proc.stderr.read())
    assert "status" in proc.stdout.read()  # it flushed and printed its final status


# --- eval: both labels shapes, no traceback ---------------------------------------------


@pytest.fixture(scope="module")
def spool_run(tmp_path_factory) -> tuple[Path, dict, Path]:
    d = tmp_path_factory.mktemp("spool-run")
    info = write_spool(d / "spool")
    events = d / "events.jsonl"
    assert cli.main(["watch", str(d / "spool"), "--speed", "0", "--events-out", str(events),
                     "--metrics-port", "-1"]) == 0
    return d, info, events


def _eval_json(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert cli.main(["eval", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_takes_a_labels_file_without_job_as_about_the_events_job(spool_run, tmp_path, capsys):
    _, info, events = spool_run
    labels = tmp_path / "nojob.labels.json"
    labels.write_text(json.dumps({"scenario": "s", "labels": [
        {"start_ns": info["degrade_ns"], "end_ns": info["degrade_ns"] + 20 * S, "type": "network_path",
         "attribution": "network"}]}))
    report = _eval_json(capsys, str(labels), str(events))
    assert report["total"]["recall"] == 1.0 and report["total"]["attribution_accuracy"] == 1.0


def test_eval_takes_a_recorded_runs_labels_json(spool_run, tmp_path, capsys):
    _, info, events = spool_run
    labels = tmp_path / "labels.json"  # bench/scenarios/record.py finish()
    labels.write_text(json.dumps({"scenario": "congestion", "job": info["job"], "faults": [
        {"type": "network_path", "attribution": "network", "global_rank": None, "injector": "tc:rate=8gbit",
         "start_ns": info["degrade_ns"], "end_ns": info["degrade_ns"] + 20 * S, "host": "node-a",
         "comms": {"pretend.all": {"comm": "0x00000000000000a0", "transport_expected": "net"}}}]}))
    report = _eval_json(capsys, str(labels), str(events))
    assert report["total"]["recall"] == 1.0
    assert LabelSet.load(labels).labels[0].comm == "0x00000000000000a0"


def test_eval_on_a_broken_labels_file_says_so_without_a_traceback(spool_run, tmp_path, capsys):
    _, _, events = spool_run
    for text in ("{not json", json.dumps({"job": "j"}), json.dumps({"scenario": "s", "labels": [{"type": "x"}]})):
        bad = tmp_path / "bad.labels.json"
        bad.write_text(text)
        capsys.readouterr()
        assert cli.main(["eval", str(bad), str(events)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ncclwatch eval: ") and "Traceback" not in err and "bad.labels.json" in err


def test_eval_runs_the_detectors_over_an_inspector_recording_given_instead_of_events(tmp_path, capsys):
    info = write_inspector_run(tmp_path / "run")
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps({"scenario": "congestion", "job": "job-x", "faults": [
        {"type": "network_path", "start_ns": info["degrade_ns"], "end_ns": info["degrade_ns"] + 20 * S}]}))
    report = _eval_json(capsys, str(labels), str(tmp_path / "run" / "inspector"),
                        "--training-log", str(tmp_path / "run" / "logs" / "*.log"))
    # the Inspector ops took the labels' job, so the anomaly matched
    assert report["total"]["recall"] == 1.0 and report["total"]["anomalies_fp"] == 0


# --- report: a run's labels.json of either shape, and the baseline band -------------------


def test_report_on_an_inspector_run_directory_with_its_labels_json(tmp_path):
    run_dir = tmp_path / "p-tc-8g"
    info = write_inspector_run(run_dir)
    (run_dir / "logs").rename(run_dir / "trainlogs")
    (run_dir / "labels.json").write_text(json.dumps({"scenario": "congestion", "job": "gpu-p-tc-8g", "faults": [
        {"type": "network_path", "attribution": "network", "start_ns": info["degrade_ns"],
         "end_ns": info["degrade_ns"] + 20 * S, "host": "vm"}]}))
    out = tmp_path / "report"
    assert cli.main(["report", str(run_dir), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "## Job `gpu-p-tc-8g`" in md and "No throughput records" not in md
    assert "| network_path | +40 s |" in md  # the fault, from labels.json
    assert "network_path, detected" in md


def test_report_takes_a_labels_file_without_job(spool_run, tmp_path):
    run_dir, info, events = spool_run
    labels = tmp_path / "nojob.labels.json"
    labels.write_text(json.dumps({"scenario": "s", "labels": [
        {"start_ns": info["degrade_ns"], "end_ns": info["degrade_ns"] + 20 * S, "type": "network_path",
         "attribution": "network"}]}))
    out = tmp_path / "report"
    rc = cli.main(["report", str(run_dir / "spool"), "--events", str(events), "--labels", str(labels),
                   "--out", str(out)])
    assert rc == 0 and "### Injected faults" in (out / "report.md").read_text()


def test_report_draws_the_band_of_the_baseline_the_detector_used(spool_run, tmp_path):
    run_dir, info, _ = spool_run

    class Args:
        run = str(run_dir / "spool")
        events = labels = None
        job = ""
        training_log: list[str] = []

    cfg = load(None)
    data = load_report(Args, cfg)
    net = [k for k in data.baselines if k[4] == "net"]
    assert net and data.threshold == cfg.detector.threshold
    series = data.baselines[net[0]]
    # one point per window the key was judged against a baseline, at the window's end
    assert len(series) > 30 and all(b > 0 for _, b in series)
    # the baseline did not follow the degraded level down
    before = [b for t, b in series if t < info["degrade_ns"]]
    after = [b for t, b in series if t > info["degrade_ns"] + 5 * S]
    assert after and min(after) > 0.9 * before[-1]
