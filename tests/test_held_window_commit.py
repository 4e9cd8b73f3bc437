"""A key worker on a real broker never commits past a window it holds: a large
communicator's open group keeps its windows' messages unacknowledged
(``detector.key_hold_ranks``), while the messages after them, of small communicators,
are done at once. Faust by itself commits the first run of acknowledged offsets with
nothing committed yet, whatever lies before it (detectors/faust_transport.py); the
partition's next owner then never reads the held window, and its group closes without
that rank (seen in tests/test_two_stage_worker.py: verdicts wrong from a communicator's
first window on)."""

from __future__ import annotations

import time

import pytest
from ncclwatch.detectors.keys import decode_stage_line
from ncclwatch_testkit import services as testing
from ncclwatch_testkit import stages
from ncclwatch_testkit.drivers import (
    WorkerProcess,
    committed,
    config_of,
    create_topics,
    publish,
    read_topic,
    scenario_records,
    topics_env,
    wait_consumed,
)

pytestmark = pytest.mark.kafka


def _verdict_lines(messages: list) -> int:
    return sum(decode_stage_line(line).KIND != "verdict_mark" for m in messages for line in m.value.split(b"\n"))


def test_a_held_window_stops_the_commit_until_its_group_closes(kafka_bootstrap, tmp_path):
    env = {**topics_env(kafka_bootstrap, partitions=1), "NCCLWATCH_TOPICS_WINDOW_KEY": "comm",
           "NCCLWATCH_DETECTOR_KEY_HOLD_RANKS": "4"}
    create_topics(env)
    cfg = config_of(env)
    windows = [r for r in scenario_records(["throughput_dip_2x2"]) if r.KIND == "window"]
    large = [w for w in windows if w.nranks >= 4]
    small = [w for w in windows if w.nranks < 4]
    assert large and small
    first = min(w.start_ns for w in large)
    group = [w for w in large if w.start_ns == first and (w.op, w.size_bucket) == (large[0].op, large[0].size_bucket)]
    assert len(group) == group[0].nranks
    # offset 0: one rank's window of the large communicator's first group, which stays
    # open (no other window of that communicator comes); then the small ones' windows
    publish(env, group[:1] + small)
    app_id = testing.unique_name("keys")
    worker = WorkerProcess(env, app_id, tmp_path, "--stage", "keys").start()
    try:
        want = len(stages.key_stage(small, cfg.detector))
        deadline = time.monotonic() + 120
        got = 0
        while got < 0.9 * want and time.monotonic() < deadline:
            got = _verdict_lines(read_topic(kafka_bootstrap, cfg.topics.verdicts, idle_s=0.5, timeout_s=10))
        assert got >= 0.9 * want, (got, want, worker.output())
        time.sleep(3.0)  # three commit intervals: what is acknowledged is committed by now
        assert committed(env, app_id).get((cfg.topics.windows, 0), 0) == 0, worker.output()
        # the group's other ranks: it closes, its held message is done, the commit passes it
        publish(env, group[1:])
        wait_consumed(env, app_id, [cfg.topics.windows], timeout_s=60)
    finally:
        rc = worker.stop()
    assert rc == 0, worker.output()
