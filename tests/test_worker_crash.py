"""A worker whose batch fails stops, and says why: on a real broker, a key worker whose
verdicts are over the verdicts topic's message limit (a topic created before the worker
set it, by hand, with Kafka's defaults or less)."""

from __future__ import annotations

import time

import pytest
from ncclwatch_testkit import services as testing
from ncclwatch_testkit.drivers import (
    WorkerProcess,
    config_of,
    create_topics,
    publish,
    scenario_records,
    topics_env,
)

pytestmark = pytest.mark.kafka


def test_a_key_worker_that_cannot_send_its_verdicts_exits_non_zero_with_the_fix(kafka_bootstrap, tmp_path):
    env = {**topics_env(kafka_bootstrap, partitions=2), "NCCLWATCH_TOPICS_WINDOW_KEY": "comm"}
    create_topics(env)
    cfg = config_of(env)
    # made before the worker: it keeps its limit (the worker creates only missing topics)
    testing.kafka_create_topic(kafka_bootstrap, cfg.topics.verdicts, 2, config={"max.message.bytes": "2000"})
    publish(env, scenario_records(["steady_2x8"]))
    worker = WorkerProcess(env, testing.unique_name("keys"), tmp_path, "--stage", "keys").start()
    try:
        deadline = time.monotonic() + 120
        while worker.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        rc = worker.proc.poll()
    finally:
        worker.kill()
    out = worker.full_output()
    assert rc is not None and rc != 0, "the worker neither stopped nor exited:\n" + out[-3000:]
    assert "MessageSizeTooLargeError" in out
    assert "max.message.bytes=16777216" in out, out[-3000:]
