"""``ncclwatch worker`` (Faust) against the real Kafka broker, as a real subprocess."""

from __future__ import annotations

import json
import time

import pytest
from ncclwatch.detectors import faust_app
from ncclwatch.ingest.recording import record_time_ns
from ncclwatch_testkit import services as testing
from ncclwatch_testkit.drivers import (
    WorkerProcess,
    committed,
    config_of,
    create_topics,
    end_offsets,
    identity,
    publish,
    read_events,
    read_topic,
    reference_events,
    scenario_records,
    topics_env,
    wait_consumed,
    window_scenario,
)

from ncclwatch.records import DropRecord, to_json

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def one_run(kafka_bootstrap, tmp_path_factory):
    """One worker over two jobs' windows and throughput, a telemetry drop, and bad messages."""
    env = topics_env(kafka_bootstrap)
    create_topics(env)
    cfg = config_of(env)
    records = window_scenario("job-a", recover_at_s=52, seconds=62) + window_scenario("job-b", degrade_from_s=10**6)
    drop = DropRecord(
        job="job-a",
        host="node-0",
        pid=7,
        gpu="GPU-0",
        rank=0,
        ts_ns=records[0].end_ns,
        reason="ring_full",
        count=3,
        total=3,
    )
    bad = [
        (cfg.topics.windows, b"job-a", b"{not json"),
        (cfg.topics.windows, b"job-a", b'{"v": 2, "kind": "window"}'),
        (
            cfg.topics.throughput,
            b"job-a",
            to_json(records[0]).encode(),
        ),  # a window on the throughput topic
        (cfg.topics.windows, b"someone-else", to_json(records[0]).encode()),  # key is not the job
        (cfg.topics.telemetry, b"job-a", b"\xff\xfe"),
    ]
    publish(env, records + [drop], extra=bad)
    worker = WorkerProcess(env, testing.unique_name("app"), tmp_path_factory.mktemp("worker")).start()
    try:
        expected = reference_events(env, records + [drop])
        events = read_events(env, min_count=len(expected), idle_s=2.0, timeout_s=90)
        dead = read_topic(kafka_bootstrap, cfg.topics.dead_letter, min_count=len(bad), idle_s=1.0, timeout_s=30)
    finally:
        rc = worker.stop()
    return {
        "env": env,
        "events": events,
        "expected": expected,
        "dead": dead,
        "bad": bad,
        "rc": rc,
        "log": worker.output(),
    }


def test_worker_publishes_the_network_anomaly_with_its_attribution(one_run):
    firing = [e for e in one_run["events"] if e["state"] == "firing"]
    assert firing, one_run["log"]
    net = [e for e in firing if e["job"] == "job-a" and e["key"]["transport"] == "net"]
    assert net and all(e["attribution"] == "network" for e in net), firing
    assert {e["type"] for e in net} == {"network_path"}
    # the healthy job raised nothing
    assert not [e for e in one_run["events"] if e["job"] == "job-b"]


def test_worker_events_equal_the_in_process_detectors_exactly_once(one_run):
    """Each event as often as in one uninterrupted in-process run: none lost, none twice."""
    got = [identity(e) for e in one_run["events"]]
    want = [identity(e) for e in one_run["expected"]]
    assert sorted(got) == sorted(want)


def test_worker_exits_cleanly_on_sigterm(one_run):
    assert one_run["rc"] == 0, one_run["log"]


def test_bad_messages_go_to_the_dead_letter_topic_with_the_reason(one_run):
    dead = [json.loads(m.value) for m in one_run["dead"]]
    assert len(dead) == len(one_run["bad"]), dead
    assert all(d["kind"] == "quarantined" for d in dead)
    by_raw = {d["raw"]: d for d in dead}
    assert by_raw["{not json"]["reason"] == "not_json"
    assert by_raw['{"v": 2, "kind": "window"}']["reason"] == "unknown_version"
    reasons = sorted(d["reason"] for d in dead)
    assert reasons.count("schema") == 2 and "not_utf8" in reasons
    details = " ".join(d["detail"] for d in dead)
    assert "does not belong on" in details and "is not the record's job" in details
    assert all(d["source"].startswith("kafka:") and d["offset"] >= 0 for d in dead)


@pytest.mark.parametrize("part_bytes", [None, 2048], ids=["whole", "in-parts"])
def test_restarted_worker_keeps_its_baselines_and_loses_or_repeats_nothing(kafka_bootstrap, tmp_path, part_bytes):
    """Warm up, SIGKILL, restart, degrade: caught on time. Kill again while firing, restart,
    recover: resolved once. The events equal one uninterrupted in-process run's. In parts:
    the job's state (~20 KB) is saved as parts of 2 KB, as a 100k-GPU job's is of 512 KB."""
    env = topics_env(kafka_bootstrap)
    create_topics(env)
    cfg = config_of(env)
    records = window_scenario("job-r", seconds=70, degrade_from_s=40, recover_at_s=55)
    t0 = records[0].start_ns
    warm = [r for r in records if record_time_ns(r) <= t0 + 40 * 10**9]
    degraded = [r for r in records if t0 + 40 * 10**9 < record_time_ns(r) <= t0 + 55 * 10**9]
    recovery = [r for r in records if record_time_ns(r) > t0 + 55 * 10**9]
    expected = reference_events(env, records)
    assert [e.state for e in expected].count("firing") >= 1 and "resolved" in [e.state for e in expected]

    args = ("--state-part-bytes", str(part_bytes)) if part_bytes else ()
    worker = WorkerProcess(env, testing.unique_name("app"), tmp_path, *args)
    inputs = [cfg.topics.windows, cfg.topics.throughput]
    try:
        publish(env, warm)
        worker.start()
        wait_consumed(env, worker.app_id, inputs)
        worker.kill()

        worker.start()
        publish(env, degraded)
        firing = [e for e in expected if e.state == "firing"]
        events = read_events(env, min_count=len(firing), idle_s=0.5, timeout_s=60)
        assert len(events) >= len(firing), worker.output()
        wait_consumed(env, worker.app_id, inputs)
        worker.kill()

        worker.start()
        publish(env, recovery)
        events = read_events(env, min_count=len(expected), idle_s=2.0, timeout_s=60)
    finally:
        worker.stop()
    # each event exactly as often as without restarts: none lost, none repeated
    got = [identity(e) for e in events]
    assert sorted(got) == sorted(identity(e) for e in expected), worker.output()
    # detected at the same stream time as without restarts: no re-warm-up
    want_detected = sorted((e.id, e.state, e.detected_ns) for e in expected)
    assert sorted((e["id"], e["state"], e["detected_ns"]) for e in events) == want_detected
    # what the changelog holds: the job's state whole, or its head and parts of at most 2 KB
    changelog = read_topic(kafka_bootstrap, f"{worker.app_id}-{faust_app.TABLE_NAME}-changelog", min_count=1)
    parts = [m for m in changelog if m.value is not None and json.loads(m.key).startswith("\x00p")]
    heads = [json.loads(m.value) for m in changelog if m.value is not None and json.loads(m.key) == "job-r"]
    assert heads and ("parted" in heads[-1] if part_bytes else not parts)
    assert all(len(m.value) <= part_bytes for m in parts) and (len(parts) > 10 if part_bytes else True)


def test_two_workers_of_one_group_give_one_workers_events_and_commit_every_input(kafka_bootstrap, tmp_path):
    """A second worker joins while the first reads: partitions move between them
    mid-stream. Every event is one process's, exactly once, and every input partition is
    committed to its end (a message Faust skipped around the rebalance would stick the
    committed offset there: ``ReadOrder``)."""
    # A worker catching up this backlog on two CPUs, its stream's queue seconds long, has
    # been seen to take 9-17 s to get a partition's messages back after a seek over a
    # hole; the time merge's default 10-s hold then lets the partition's jobs pass it,
    # which is what it is for (bounded delay), but their verdicts then differ from one
    # process's. This test is about the rebalance losing or doubling nothing, so its
    # merge waits for a slow partition as long as the test does.
    env = {**topics_env(kafka_bootstrap, partitions=4), "NCCLWATCH_DETECTOR_MERGE_MAX_HOLD_S": "300"}
    create_topics(env)
    cfg = config_of(env)
    records = scenario_records(["multi_fault_2x8", "throughput_dip_2x2", "telemetry_drops_2x2", "steady_noisy_2x8"])
    publish(env, records)
    app_id = testing.unique_name("app")
    first = WorkerProcess(env, app_id, tmp_path).start()
    workers = [first]
    try:
        time.sleep(1.0)
        workers.append(WorkerProcess(env, app_id, tmp_path).start())
        expected = reference_events(env, records)
        events = read_events(env, min_count=len(expected), idle_s=3.0, timeout_s=180)
        inputs = [cfg.topics.windows, cfg.topics.throughput, cfg.topics.telemetry]
        wait_consumed(env, app_id, inputs, timeout_s=60)
        # the rebalance this is about happened: one of them was assigned twice
        assignments = [w.full_output().count("assigned") for w in workers]
    finally:
        rcs = [w.stop() for w in workers]
    logs = "\n".join(w.output() for w in workers)
    assert max(assignments) >= 2, logs
    assert sorted(identity(e) for e in events) == sorted(identity(e) for e in expected), logs
    ends = end_offsets(env, inputs)
    done = committed(env, app_id)
    assert all(done.get(tp, 0) >= end for tp, end in ends.items() if end > 0), (done, ends)
    assert rcs == [0, 0], logs
