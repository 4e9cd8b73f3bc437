"""``ncclwatch worker --until-caught-up`` and its data directory, against the real Kafka broker.

One ``topics.prefix`` isolates each run: every topic the worker reads and writes, its
consumer group and its internal topics carry it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ncclwatch.detectors.faust_app import DEFAULT_APP_ID
from ncclwatch_testkit import services as testing
from ncclwatch_testkit.drivers import (
    committed,
    config_of,
    create_topics,
    end_offsets,
    identity,
    publish,
    read_topic,
    reference_events,
    window_scenario,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def prefixed_env(kafka_bootstrap: str) -> dict[str, str]:
    return {
        "NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "NCCLWATCH_TOPICS_PREFIX": testing.unique_name("drain") + ".",
        "NCCLWATCH_TOPICS_PARTITIONS": "2",
        "NCCLWATCH_DETECTOR_METRICS_PORT": "-1",
        "NCCLWATCH_ALERTING_ALERTMANAGER_URL": "",
        # the scenario is dated 2025: the worker's own topics (anomalies) must not expire it
        **testing.RECORDED_TOPICS_ENV,
    }


def run_worker(env: dict[str, str], cwd: Path, *args: str, timeout_s: float = 150) -> subprocess.CompletedProcess:
    """The worker as a real process in ``cwd``; it must exit by itself."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("NCCLWATCH_")}
    return subprocess.run([sys.executable, "-m", "ncclwatch.cli", "worker", "--until-caught-up", *args],
                          env={**base, **env}, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)


def test_until_caught_up_exits_0_once_every_input_is_committed_with_every_event_published(
    kafka_bootstrap, tmp_path
):
    env = prefixed_env(kafka_bootstrap)
    create_topics(env)
    cfg = config_of(env)
    records = window_scenario("job-d", seconds=60, degrade_from_s=35, recover_at_s=50)
    publish(env, records)
    expected = reference_events(env, records)
    assert {e.state for e in expected} == {"firing", "resolved"}
    inputs = [cfg.topics.windows, cfg.topics.throughput, cfg.topics.telemetry]
    ends = end_offsets(env, inputs)

    t0 = time.monotonic()
    r = run_worker(env, tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "caught up with 6 input partition(s)" in r.stderr, r.stderr[-4000:]
    group = cfg.topics.prefix + DEFAULT_APP_ID  # the group follows the prefix too
    done = committed(env, group)
    assert all(done.get(tp, 0) >= end for tp, end in ends.items()), (done, ends)
    events = [m.value for m in read_topic(kafka_bootstrap, cfg.topics.anomalies, min_count=len(expected),
                                          idle_s=0.5, timeout_s=30)]
    import json

    assert sorted(identity(json.loads(v)) for v in events) == sorted(identity(e) for e in expected), r.stderr[-6000:]
    assert time.monotonic() - t0 < 120
    # no `<app-id>-data/` left in the working directory, and no progress bar off a terminal
    assert list(tmp_path.iterdir()) == []
    assert "\r" not in r.stderr


def test_until_caught_up_on_empty_inputs_exits_at_once_and_the_data_dir_is_where_configured(
    kafka_bootstrap, tmp_path
):
    env = prefixed_env(kafka_bootstrap)
    data_dir = tmp_path / "worker-data"
    env["NCCLWATCH_DETECTOR_WORKER_DATA_DIR"] = str(data_dir)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    r = run_worker(env, cwd, timeout_s=90)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "caught up" in r.stderr
    assert list(cwd.iterdir()) == []
    assert data_dir.is_dir() and any(data_dir.iterdir())  # Faust's versioned app dir
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        mine = [t for t in admin.list_topics() if t.startswith(env["NCCLWATCH_TOPICS_PREFIX"])]
    finally:
        admin.close()
    # inputs, outputs, the table's changelog and Faust's assignor topic: all under the
    # prefix; no internal telemetry hop any more (topic contract v2), and nccl.ops is not
    # the worker's to create (it does not read it)
    cfg = config_of(env)
    wanted = {cfg.topics.windows, cfg.topics.throughput, cfg.topics.telemetry, cfg.topics.anomalies,
              cfg.topics.dead_letter, cfg.topics.prefix + "ncclwatch-detectors-detector-state-changelog"}
    assert wanted <= set(mine), mine
    assert cfg.topics.prefix + "ncclwatch-detectors-telemetry" not in mine
