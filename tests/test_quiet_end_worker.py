"""``ncclwatch worker`` on a real broker: a job whose records stop while an incident is
open (it ended, or its telemetry stopped) gets the incident resolved ``job_silent`` once
its partition has been quiet for ``detector.quiet_end_s`` of wall time, in one stage and
in two. Before, nothing newer moved that partition's stream time and the incident (and
its Alertmanager alert, re-sent every minute) stayed open for ever."""

from __future__ import annotations

import pytest
from ncclwatch.detectors.stream import JobDetectors, job_partition
from ncclwatch.ingest.recording import record_time_ns
from ncclwatch_testkit import services as testing
from ncclwatch_testkit.drivers import (
    WorkerProcess,
    config_of,
    create_topics,
    publish,
    read_events,
    scenario_records,
    topics_env,
    wait_consumed,
)
from test_quiet_end import SCENARIO, _cut_while_firing

pytestmark = pytest.mark.kafka

QUIET_S = 3.0


@pytest.fixture(scope="module")
def head():
    return _cut_while_firing(scenario_records([SCENARIO]))[0]


def _library_resolutions(env: dict[str, str], head: list) -> list[tuple]:
    # the library, its stream time moved a minute past the job's last record
    cfg = config_of(env)
    d = JobDetectors(cfg.detector, partitions=cfg.topics.partitions)
    for r in head:
        d.process(r)
    later = max(record_time_ns(r) for r in head) + 60 * 10**9
    ended = d.advance(later, job_partition(head[0].job, cfg.topics.partitions))
    return sorted((e.id, e.type, e.start_ns, e.end_ns) for e in ended if e.state == "resolved")


@pytest.mark.parametrize("stages", [("all",), ("keys", "jobs")])
def test_a_worker_resolves_the_incidents_of_a_job_that_went_quiet(kafka_bootstrap, tmp_path, head, stages):
    env = {**topics_env(kafka_bootstrap, partitions=2), "NCCLWATCH_DETECTOR_QUIET_END_S": str(QUIET_S)}
    if len(stages) == 2:
        env["NCCLWATCH_TOPICS_WINDOW_KEY"] = "comm"
    create_topics(env)
    publish(env, head)
    workers = [WorkerProcess(env, testing.unique_name(stage), tmp_path, "--stage", stage).start()
               for stage in stages]
    try:
        want = _library_resolutions(env, head)
        assert want, "the job had incidents open where its records stop"
        events = read_events(env, min_count=2 * len(want), idle_s=QUIET_S + 2, timeout_s=150)
    finally:
        rcs = [w.stop() for w in workers]
    logs = "\n".join(w.output() for w in workers)
    firing = {e["id"] for e in events if e["state"] == "firing"}
    resolved = [e for e in events if e["state"] == "resolved"]
    assert firing == {w[0] for w in want}, logs
    assert sorted((e["id"], e["type"], e["start_ns"], e["end_ns"]) for e in resolved) == want, logs
    assert {e["evidence"].get("resolved_because") for e in resolved} == {"job_silent"}
    assert rcs == [0] * len(stages), logs


def test_a_worker_restarted_after_the_job_ended_still_ends_its_incidents(kafka_bootstrap, tmp_path, head):
    # The job ended while the first worker ran (which did not wait long enough to end
    # it); the next one reads nothing of it, and loads its saved state to end it.
    env = topics_env(kafka_bootstrap, partitions=2)
    create_topics(env)
    publish(env, head)
    want = _library_resolutions(env, head)
    app_id = testing.unique_name("app")
    first = WorkerProcess({**env, "NCCLWATCH_DETECTOR_QUIET_END_S": "3600"}, app_id, tmp_path).start()
    try:
        fired = read_events(env, min_count=len(want), idle_s=2.0, timeout_s=120)
        cfg = config_of(env)
        wait_consumed(env, app_id, [cfg.topics.windows, cfg.topics.throughput], timeout_s=60)
    finally:
        rc_first = first.stop()
    assert {e["id"] for e in fired if e["state"] == "firing"} == {w[0] for w in want}, first.output()
    assert not [e for e in fired if e["state"] == "resolved"]
    second = WorkerProcess({**env, "NCCLWATCH_DETECTOR_QUIET_END_S": str(QUIET_S)}, app_id, tmp_path).start()
    try:
        events = read_events(env, min_count=len(fired) + len(want), idle_s=QUIET_S + 2, timeout_s=150)
    finally:
        rc_second = second.stop()
    resolved = [e for e in events if e["state"] == "resolved"]
    assert sorted((e["id"], e["type"], e["start_ns"], e["end_ns"]) for e in resolved) == want, second.output()
    assert {e["evidence"].get("resolved_because") for e in resolved} == {"job_silent"}
    assert (rc_first, rc_second) == (0, 0)
