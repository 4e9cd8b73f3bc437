"""The two drivers give the same anomaly events for the same input.

One trace, two ways:

- ``ncclwatch watch`` on the recording (no Kafka: records in time order, in-process);
- the cluster path on the real broker: window summaries and throughput published the
  way the forwarder publishes them (drops on ``nccl.telemetry`` keyed by job), in
  the scenario's *publication* order, consumed by ``ncclwatch worker`` (Faust);

and, for op records, a plugin-style spool: ``watch`` windows it in-process, while
``ncclwatch forward --once`` windows and publishes it for the worker. Event lists are
compared by id, type, state, job, key, start time and attribution.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from ncclwatch.ingest.recording import order_key
from ncclwatch_testkit import services as testing
from ncclwatch_testkit.drivers import (
    WorkerProcess,
    config_of,
    create_topics,
    identity,
    read_events,
    scenario_records,
    topics_env,
    wait_consumed,
    write_spool,
)

from ncclwatch import cli
from ncclwatch.records import to_json

pytestmark = pytest.mark.kafka

# Faults of every attribution, telemetry on its own topic beside the windows, and a
# throughput drop with healthy NCCL: the cases where arrival order could matter.
SCENARIOS = (
    "network_step30_2x2",
    "straggler_2x2",
    "telemetry_drops_2x2",
    "telemetry_silence_2x2",
    "throughput_dip_2x2",
    "nvlink_node1_2x2",
)
FIXTURES = Path(__file__).parent / "fixtures"
# Spools the plugin recorded on 2xH200: runs with a congested network path and with a
# straggler rank (tests/fixtures/gpu_runs/README.md), and a short all-collectives one.
GPU_RUNS = (FIXTURES / "gpu_runs" / "congestion.tar.gz", FIXTURES / "gpu_runs" / "straggler.tar.gz")
PLUGIN_SPOOL = FIXTURES / "plugin_spool"


def _unpacked(archive: Path, tmp: Path) -> Path:
    out = tmp / "unpacked" / archive.name.split(".")[0]
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    return out


def _by_job(events: list[dict]) -> dict[str, list[tuple]]:
    out: dict[str, list[tuple]] = {}
    for e in events:
        out.setdefault(e["job"], []).append(identity(e))
    return {job: sorted(v) for job, v in out.items()}


def _watch(source: Path, events_out: Path) -> list[dict]:
    rc = cli.main(
        ["watch", str(source), "--events-out", str(events_out), "--metrics-port", "-1", "--status-every-s", "0"]
        + (["--once"] if source.is_dir() else [])
    )
    assert rc == 0
    return [json.loads(line) for line in events_out.read_text().splitlines()] if events_out.exists() else []


def _both_ways(env: dict[str, str], spool: Path, tmp: Path) -> dict:
    """watch on a spool; the forwarder, Kafka and the worker on a copy of it."""
    create_topics(env)
    copy = tmp / "forwarded"
    shutil.copytree(spool, copy)
    argv = [
        "forward",
        "--spool",
        str(copy),
        "--once",
        "--state-dir",
        str(tmp / "fwd"),
        "--node-id",
        "n0",
        "--metrics-port",
        "-1",
    ]
    assert cli_in_env(env, argv) == 0
    watch_events = _watch(spool, tmp / "watch.jsonl")
    worker = WorkerProcess(env, testing.unique_name("app"), tmp).start()
    try:
        # everything consumed (committed offsets follow the saved state), then the events
        cfg = config_of(env)
        inputs = [cfg.topics.windows, cfg.topics.throughput, cfg.topics.telemetry]
        wait_consumed(env, worker.app_id, inputs, timeout_s=180)
        worker_events = read_events(env, min_count=len(watch_events), idle_s=1.0, timeout_s=30)
    finally:
        worker.stop()
    return {"watch": watch_events, "worker": worker_events, "log": worker.output()}


@pytest.fixture(scope="module")
def both(kafka_bootstrap, tmp_path_factory):
    """Two spools, each read by watch and, through the forwarder, by a worker.

    One holds the labelled scenarios (their window and throughput records in a spool
    directory per job: the forwarder publishes window records as they are) and a synthetic op
    spool; the other the spools the plugin recorded on 2xH200. They are a year apart, and
    a spool is one stretch of time: mixed in one, the forwarder's time order and the
    silence of the older jobs would be about the mix, not the drivers.
    """
    tmp = tmp_path_factory.mktemp("equiv")
    sim = tmp / "sim" / "spool"
    # One directory per job, as the plugin lays a spool out: the forwarder keeps a
    # directory's records to its job (ingest.spool_trust=owner, wrong_job otherwise).
    by_job: dict[str, list[str]] = {}
    for r in sorted(scenario_records(list(SCENARIOS)), key=order_key):
        by_job.setdefault(r.job, []).append(to_json(r) + "\n")
    for job, lines in by_job.items():
        (sim / job).mkdir(parents=True)
        (sim / job / "sim-0.000000.jsonl").write_text("".join(lines))
    write_spool(sim, job="job-ops", seconds=70, degrade_from_s=40)
    gpu = tmp / "gpu" / "spool"
    gpu.mkdir(parents=True)
    for archive in GPU_RUNS:
        for job_dir in _unpacked(archive, tmp).iterdir():
            shutil.copytree(job_dir, gpu / job_dir.name)
    for job_dir in PLUGIN_SPOOL.iterdir():
        if job_dir.is_dir():
            shutil.copytree(job_dir, gpu / job_dir.name)
    out = {"watch": [], "worker": [], "log": ""}
    for spool in (sim, gpu):
        r = _both_ways(topics_env(kafka_bootstrap), spool, spool.parent)
        for k in out:
            out[k] += r[k]
    return out


def cli_in_env(env: dict[str, str], argv: list[str]) -> int:
    proc = subprocess.run(
        [sys.executable, "-m", "ncclwatch.cli", *argv],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.returncode


def test_every_scenario_raised_what_it_should_under_watch(both):
    jobs = _by_job(both["watch"])
    assert set(jobs) >= {f"sim-{n}" for n in SCENARIOS} | {"job-ops"}
    types = {e["type"] for e in both["watch"]}
    assert types >= {"network_path", "straggler", "telemetry_loss", "throughput_drop", "intra_node"}


@pytest.mark.parametrize("job", [f"sim-{n}" for n in SCENARIOS])
def test_watch_and_worker_give_the_same_events(both, job):
    """Same anomalies, each as often (a firing event is repeated when its severity rises;
    the worker must neither lose nor add one)."""
    watch = _by_job(both["watch"]).get(job, [])
    worker = _by_job(both["worker"]).get(job, [])
    assert watch, f"watch raised nothing for {job}"
    assert worker == watch, both["log"]


def test_spools_through_the_forwarder_give_the_same_events_as_watch(both):
    """Op records: watch windows them itself; the cluster path gets the forwarder's windows.
    The recorded GPU runs' congestion and straggler must be found, and found the same."""
    scenario_jobs = {f"sim-{n}" for n in SCENARIOS}
    watch = {j: v for j, v in _by_job(both["watch"]).items() if j not in scenario_jobs}
    worker = {j: v for j, v in _by_job(both["worker"]).items() if j not in scenario_jobs}
    assert "job-ops" in watch
    assert {e[1] for v in watch.values() for e in v} >= {"network_path", "straggler"}
    assert worker == watch, both["log"]


def test_the_order_records_of_one_instant_arrive_in_does_not_matter():
    """Who published first within an instant (one node's forwarder, one topic) must not
    change what the detectors say: the drivers hand an instant over in one order."""
    import random

    from ncclwatch.detectors.stream import JobDetectors
    from ncclwatch.ingest.recording import record_time_ns

    from ncclwatch.config import DetectorConfig

    records = scenario_records(["multi_fault_2x8", "throughput_dip_2x2"])
    records.sort(key=record_time_ns)
    results = []
    for seed in range(3):
        rnd = random.Random(seed)
        shuffled = sorted(records, key=lambda r: (record_time_ns(r), rnd.random()))
        det = JobDetectors(DetectorConfig())
        events = [ev for r in shuffled for ev in det.process(r)] + det.flush()
        results.append([identity(e) for e in events])
    assert results[0] and results[0] == results[1] == results[2]
