"""The detector in two stages on a real broker: ``worker --stage keys`` (windows keyed
by communicator, ``topics.window_key = "comm"``, to verdicts) and ``worker --stage jobs``
(verdicts, throughput, telemetry to anomalies) in separate processes.

Not shown yet: several key workers in one group. With two, the job stage lets only
part of the input go after their rebalance (it waits on some partition's progress
mark); docs/architecture.md says where that stands."""

from __future__ import annotations

import pytest
from drivers_support import (
    WorkerProcess,
    config_of,
    create_topics,
    identity,
    publish,
    read_events,
    read_topic,
    scenario_records,
    staged_reference_events,
    topics_env,
)
from ncclwatch.detectors.messages import STAGE_KINDS, Message, decode_message
from ncclwatch_testkit import services as testing
from ncclwatch_testkit import stages

pytestmark = pytest.mark.kafka

SCENARIOS = ["multi_fault_2x8", "throughput_dip_2x2", "telemetry_drops_2x2", "steady_noisy_2x8"]


@pytest.fixture(scope="module")
def staged_run(kafka_bootstrap, tmp_path_factory):
    env = {**topics_env(kafka_bootstrap, partitions=4), "NCCLWATCH_TOPICS_WINDOW_KEY": "comm"}
    create_topics(env)
    records = scenario_records(SCENARIOS)
    publish(env, records)  # a backlog: the workers start on it together
    logs = tmp_path_factory.mktemp("staged")
    keys_id, jobs_id = testing.unique_name("keys"), testing.unique_name("jobs")
    workers = [
        WorkerProcess(env, keys_id, logs, "--stage", "keys").start(),
        WorkerProcess(env, jobs_id, logs, "--stage", "jobs").start(),
    ]
    try:
        expected = staged_reference_events(env, records)
        events = read_events(env, min_count=len(expected), idle_s=3.0, timeout_s=180)
    finally:
        rcs = [w.stop() for w in workers]
    cfg = config_of(env)
    verdicts = read_topic(kafka_bootstrap, cfg.topics.verdicts, idle_s=1.0, timeout_s=30)
    return {
        "env": env,
        "records": records,
        "events": events,
        "expected": expected,
        "verdicts": verdicts,
        "rcs": rcs,
        "outputs": [w.output() for w in workers],
        "logs": "\n".join(w.output() for w in workers),
    }


def _records_done(output: str) -> int:
    import re

    m = re.search(r": (\d+) records, ", output)
    assert m, output
    return int(m.group(1))


def test_a_key_worker_and_a_job_worker_give_the_events_of_one_process(staged_run):
    got = sorted(identity(e) for e in staged_run["events"])
    want = sorted(identity(e) for e in staged_run["expected"])
    assert want, "the scenarios raise anomalies"
    assert got == want, (sorted(set(got) ^ set(want)), staged_run["logs"])


def test_the_events_are_those_of_one_pipeline_running_both_stages(staged_run):
    # the same incidents as the library's two stages run offline, to the end
    want = {(e.job, e.type, e.start_ns) for e in stages.run_two_stages(staged_run["records"], 1, _cfg(staged_run))
            if e.state == "firing"}
    got = {(e["job"], e["type"], e["start_ns"]) for e in staged_run["events"] if e["state"] == "firing"}
    assert got == want


def test_every_partition_marks_its_progress_and_every_window_is_read(staged_run):
    sources = set()
    for m in staged_run["verdicts"]:
        msg = Message(m.topic, m.partition, m.offset, m.key, m.value)
        for line in m.value.split(b"\n"):
            rec = decode_message(msg, STAGE_KINDS, line=line)
            if rec.KIND == "verdict_mark":
                sources.add(rec.source)
    n = config_of(staged_run["env"]).topics.partitions
    assert sources == set(range(n))  # empty partitions too: every job stage waits on each
    windows = sum(r.KIND == "window" for r in staged_run["records"])
    assert _records_done(staged_run["outputs"][0]) == windows
    assert "0 verdicts late" in staged_run["outputs"][1]


def test_every_stage_worker_exits_cleanly(staged_run):
    assert staged_run["rcs"] == [0, 0], staged_run["logs"]


def _cfg(run):
    return config_of(run["env"]).detector
