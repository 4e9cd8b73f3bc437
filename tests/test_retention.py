"""Topics of recorded data never expire: Kafka's retention reads the records' own times.

Replayed and benchmark records carry the recording's times, older than the broker's
default 7-day retention, so a topic created with the default lost them within minutes
(the broker's next retention check), inputs and anomaly outputs alike. Every topic the
project creates for recorded data gets ``retention.ms=-1``: the test helper (tests,
benchmarks, replay targets in the tests), and the forwarder's and the worker's own
topic creation under a test configuration.
"""

from __future__ import annotations

import pytest
from drivers_support import config_of, topics_env
from ncclwatch.detectors import faust_app
from ncclwatch.ingest import kafka_sink

from ncclwatch import testing

pytestmark = pytest.mark.kafka


def topic_configs(bootstrap: str, names: list[str]) -> dict[str, dict[str, str]]:
    from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="ncclwatch-test-retention")
    try:
        got = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in names])
        return {n: {k: v["value"] for k, v in got["topic"][n].items()} for n in names}
    finally:
        admin.close()


def test_the_test_and_bench_helper_creates_topics_that_never_expire(kafka_bootstrap):
    name = testing.unique_name("rec")
    testing.kafka_create_topic(kafka_bootstrap, name, 1)
    assert topic_configs(kafka_bootstrap, [name])[name]["retention.ms"] == "-1"


def test_forwarder_and_worker_topics_under_a_test_config_never_expire(kafka_bootstrap):
    env = topics_env(kafka_bootstrap)
    cfg = config_of(env)
    assert cfg.topics.retention_ms == -1
    t = cfg.topics
    kafka_sink.ensure_topics(cfg.kafka, t, [t.ops, t.windows, t.throughput, t.quarantine])
    app_id = testing.unique_name("app")
    faust_app.ensure_topics(cfg, app_id)
    names = [t.ops, t.windows, t.throughput, t.quarantine, t.anomalies, t.dead_letter, f"{app_id}-telemetry"]
    got = topic_configs(kafka_bootstrap, names)
    assert {n: c["retention.ms"] for n, c in got.items()} == {n: "-1" for n in names}
    changelog = f"{app_id}-{faust_app.TABLE_NAME}-changelog"
    assert topic_configs(kafka_bootstrap, [changelog])[changelog]["cleanup.policy"] == "compact"
