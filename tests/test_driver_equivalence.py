"""The two drivers give the same anomaly events for the same input.

One trace, two ways:

- ``ncclwatch watch`` on the recording (no Kafka: records in time order, in-process);
- the cluster path on the real broker: window summaries and throughput published the
  way the forwarder publishes them (drops on ``nccl.ops`` keyed ``<job>|<host>``), in
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
from pathlib import Path

import pytest
from drivers_support import (
    WorkerProcess,
    create_topics,
    identity,
    publish,
    read_events,
    scenario_records,
    topics_env,
    write_spool,
)

from ncclwatch import cli, testing
from ncclwatch.records import to_json

pytestmark = pytest.mark.kafka

# Faults of every attribution, telemetry through the worker's re-keying hop, and a
# throughput drop with healthy NCCL: the cases where arrival order could matter.
SCENARIOS = (
    "network_step30_2x2",
    "straggler_2x2",
    "telemetry_drops_2x2",
    "telemetry_silence_2x2",
    "throughput_dip_2x2",
    "nvlink_node1_2x2",
)
GPU_FIXTURE = Path(__file__).parent / "fixtures" / "plugin_spool"


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


@pytest.fixture(scope="module")
def both(kafka_bootstrap, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("equiv")
    env = topics_env(kafka_bootstrap)
    create_topics(env)
    records = scenario_records(list(SCENARIOS))
    # one recording file for watch; the same records, in publication order, to Kafka
    recording = tmp / "scenarios.jsonl"
    recording.write_text("".join(to_json(r) + "\n" for r in records))
    publish(env, records)

    # op records: a spool; the forwarder windows it for the cluster path
    spool = tmp / "spool"
    write_spool(spool, job="job-ops", seconds=70, degrade_from_s=40)
    spools = [spool] + ([GPU_FIXTURE] if GPU_FIXTURE.is_dir() else [])
    for i, s in enumerate(spools):
        copy = tmp / f"forward-{i}"
        shutil.copytree(s, copy)
        rc = cli_in_env(
            env,
            [
                "forward",
                "--spool",
                str(copy),
                "--once",
                "--state-dir",
                str(tmp / f"fwd-state-{i}"),
                "--node-id",
                f"n{i}",
                "--metrics-port",
                "-1",
            ],
        )
        assert rc == 0

    watch_events = _watch(recording, tmp / "watch-scenarios.jsonl")
    for i, s in enumerate(spools):
        watch_events += _watch(s, tmp / f"watch-spool-{i}.jsonl")

    worker = WorkerProcess(env, testing.unique_name("app"), tmp).start()
    try:
        worker_events = read_events(env, min_count=len(watch_events), idle_s=3.0, timeout_s=180)
    finally:
        worker.stop()
    return {"watch": watch_events, "worker": worker_events, "log": worker.output()}


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


@pytest.mark.xfail(
    strict=True,
    reason="`ncclwatch forward --once` publishes a spool backlog one process at a time "
    "(window times go back at each file boundary within a partition); the worker keeps "
    "partition order, so the job's ranks meet later than under watch. Passes once the "
    "forwarder publishes a backlog's windows in time order (docs/replay.md).",
)
def test_a_spool_through_the_forwarder_gives_the_same_events_as_watch(both):
    spool_jobs = {e["job"] for e in both["watch"]} - {f"sim-{n}" for n in SCENARIOS}
    assert spool_jobs
    for job in spool_jobs:
        assert _by_job(both["worker"]).get(job, []) == _by_job(both["watch"])[job]
