"""``ncclwatch watch``: the single-node driver on spools written like the plugin writes them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest
from ncclwatch_testkit.drivers import write_spool

from ncclwatch import cli
from ncclwatch.records import parse_line


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _firing(events: list[dict]) -> list[dict]:
    return [e for e in events if e["state"] == "firing"]


def test_watch_once_prints_the_firing_line_and_writes_the_event(tmp_path, capsys):
    spool = tmp_path / "spool"
    info = write_spool(spool)
    out = tmp_path / "events.jsonl"
    rc = cli.main(["watch", str(spool), "--once", "--events-out", str(out), "--metrics-port", "-1"])
    assert rc == 0
    events = _events(out)
    for e in events:  # what was written is valid contract
        assert parse_line(json.dumps(e)).KIND == "anomaly"
    network = [e for e in _firing(events) if e["key"]["transport"] == "net"]
    assert network, f"no anomaly on the degraded network key: {events}"
    ev = network[0]
    assert ev["attribution"] == "network" and ev["type"] == "network_path"
    # it started where the degradation started, and was decided a few windows later
    assert info["degrade_ns"] <= ev["start_ns"] <= info["degrade_ns"] + 2 * 10**9
    assert ev["detected_ns"] <= info["degrade_ns"] + 10 * 10**9
    assert not [e for e in _firing(events) if e["key"]["transport"] == "nvlink"]
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("FIRING network_path"))
    assert f"job={info['job']}" in line and "AllReduce 32MiB over net (comm " in line
    assert "GB/s" in line and "since" in line and "[" in line


def test_watch_replays_a_tar_gz_recording_at_the_given_speed(tmp_path):
    spool = tmp_path / "rec"
    write_spool(spool, seconds=60)
    archive = tmp_path / "run.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(spool, arcname="spool")
    out = tmp_path / "ev.jsonl"
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ncclwatch.cli",
            "watch",
            str(archive),
            "--speed",
            "60",
            "--events-out",
            str(out),
            "--metrics-port",
            "-1",
            "--status-every-s",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    took_s = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    # 60 s of recording at 60x: about a second, not "as fast as possible"
    assert took_s >= 0.9, took_s
    assert "replaying" in proc.stdout and "60× real time" in proc.stdout
    assert "FIRING network_path" in proc.stdout
    assert "status" in proc.stdout and "GB/s" in proc.stdout
    assert [e for e in _firing(_events(out)) if e["key"]["transport"] == "net"]


def test_watch_resumes_from_saved_state_without_relearning_or_rereading(tmp_path, capsys):
    """First run: warm-up only. Second run: only the degraded part is new, and it is caught."""
    spool = tmp_path / "spool"
    state = tmp_path / "state.json"
    write_spool(spool, seconds=38, degrade_from_s=1000)
    args = ["watch", str(spool), "--once", "--metrics-port", "-1", "--state", str(state)]
    assert cli.main(args + ["--events-out", str(tmp_path / "a.jsonl")]) == 0
    saved = json.loads(state.read_text())
    assert saved["positions"] and saved["detectors"]["jobs"]
    assert not _firing(_events(tmp_path / "a.jsonl")) if (tmp_path / "a.jsonl").exists() else True
    # the run goes on in new segments; the old ones stay and must not be read again
    info = write_spool(spool, first_s=38, seconds=60, degrade_from_s=40)
    capsys.readouterr()
    assert cli.main(args + ["--events-out", str(tmp_path / "b.jsonl")]) == 0
    text = capsys.readouterr().out
    assert "restored baselines of 1 job(s)" in text
    ev = [e for e in _firing(_events(tmp_path / "b.jsonl")) if e["key"]["transport"] == "net"]
    assert ev and info["degrade_ns"] <= ev[0]["start_ns"] <= info["degrade_ns"] + 2 * 10**9
    # only the new 22 s were read: 4 ranks x 2 comms x 4 ops/s x 22 s
    assert f"ops {4 * 2 * 4 * 22} " in text


def _stop_once(proc: subprocess.Popen, done: Any, timeout_s: float) -> tuple[str, str]:
    """SIGTERM ``proc`` once ``done()`` (or after ``timeout_s``); its output."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done():
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=30)


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_watch_tails_a_live_spool_and_saves_state_on_sigterm(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    state = tmp_path / "state.json"
    out = tmp_path / "ev.jsonl"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ncclwatch.cli",
            "watch",
            str(spool),
            "--state",
            str(state),
            "--events-out",
            str(out),
            "--metrics-port",
            "0",
            "--status-every-s",
            "0.5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        time.sleep(1.0)
        write_spool(spool)  # the files appear while watch is running
        stdout, stderr = _stop_once(proc, lambda: out.exists() and out.read_text(), 30)
    finally:
        _reap(proc)
    assert proc.returncode == 0, stderr
    assert "metrics on http://127.0.0.1:" in stdout
    assert "FIRING network_path" in stdout
    assert json.loads(state.read_text())["detectors"]["jobs"]


@pytest.mark.parametrize("bad", ["nonexistent-dir"])
def test_watch_on_a_missing_spool_fails_clearly(tmp_path, capsys, bad):
    assert cli.main(["watch", str(tmp_path / bad), "--once", "--metrics-port", "-1"]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_the_events_file_is_private_whatever_the_umask(tmp_path):
    spool = tmp_path / "spool"
    write_spool(spool)
    out = tmp_path / "new-dir" / "events.jsonl"
    old = os.umask(0)
    try:
        assert cli.main(["watch", str(spool), "--once", "--events-out", str(out),
                         "--metrics-port", "-1"]) == 0
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o600
    assert out.parent.stat().st_mode & 0o777 == 0o700


def test_watch_says_it_does_not_read_inspector_prometheus_files(tmp_path, capsys):
    # Inspector's Prometheus mode (*.prom: means over >= 30 s) is read by the forwarder
    # only; watch pointed at such a dump must say so, not show zeros in silence
    import shutil

    dump = tmp_path / "nccl-inspector-77"
    dump.mkdir()
    prom = Path(__file__).parent / "fixtures" / "inspector"
    for f in prom.glob("*.prom"):
        shutil.copy(f, dump)
    for where in (tmp_path, dump):
        assert cli.main(["watch", str(where), "--once", "--metrics-port", "-1", "--job", "j"]) == 0
        err = capsys.readouterr().err
        assert f"note: {dump} holds 1 NCCL Inspector Prometheus file(s)" in err
        assert f"ncclwatch forward --inspector-dir {dump}" in err
    (tmp_path / "elsewhere").mkdir()
    assert cli.main(["watch", str(tmp_path / "elsewhere"), "--once", "--metrics-port", "-1", "--job", "j"]) == 0
    assert "Prometheus" not in capsys.readouterr().err


def test_watch_tailing_resolves_a_job_that_stopped_firing_after_quiet_end_s(tmp_path):
    # The job's records stop while its network incident is open (the job ended): after
    # detector.quiet_end_s of wall time with nothing newer, its incidents are resolved.
    spool = tmp_path / "spool"
    write_spool(spool)  # degraded from 40 s to the end, 60 s
    out = tmp_path / "ev.jsonl"
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCLWATCH_DETECTOR_QUIET_END_S="2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ncclwatch.cli", "watch", str(spool), "--events-out", str(out),
         "--metrics-port", "-1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        stdout, stderr = _stop_once(proc, lambda: out.exists() and '"resolved"' in out.read_text(), 60)
    finally:
        _reap(proc)
    assert proc.returncode == 0, stderr
    events = _events(out)
    firing = {e["id"] for e in _firing(events)}
    resolved = [e for e in events if e["state"] == "resolved"]
    assert firing and {e["id"] for e in resolved} == firing, stdout
    assert {e["evidence"]["resolved_because"] for e in resolved} == {"job_silent"}
    assert "RESOLVED network_path" in stdout


def test_a_bad_line_found_only_while_replaying_is_still_reported(tmp_path, capsys):
    # The first pass only looks at a spool op line's version, job and time; a line bad
    # elsewhere (here its communicator) is found while replaying and said after it.
    from ncclwatch_testkit.synth import T0_NS, op_record

    from ncclwatch.records import to_json

    lines = [to_json(op_record(job="j", host="h", pid=1, gpu="GPU-0", comm=0xAB, rank=0, seq=i,
                               start_ns=T0_NS + i * 1000, exec_ns=500)).encode() for i in range(20)]
    lines[7] = lines[7].replace(b'"comm":"0x', b'"comm":"0X', 1)
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "h-GPU-0-1.000000.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    assert cli.main(["watch", str(spool), "--speed", "0", "--metrics-port", "-1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "replaying 20 records" in out  # counted before the replay: it looked like one
    assert "1 more bad lines found while reading the records: left out 1 bad lines in all: {'schema': 1}" in out
    dest = tmp_path / "out.jsonl"
    assert cli.main(["replay", "--files", str(spool), "--out", str(dest), "--no-progress"]) == 0
    assert len(dest.read_bytes().splitlines()) == 19
    assert "1 more bad lines found while reading the records" in capsys.readouterr().err
