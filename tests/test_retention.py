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
from ncclwatch.detectors import faust_app
from ncclwatch.ingest import kafka_sink
from ncclwatch_testkit import services as testing
from ncclwatch_testkit.drivers import config_of, topics_env

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
    kafka_sink.ensure_topics(cfg.kafka, t, [t.ops, t.telemetry, t.windows, t.throughput, t.quarantine])
    app_id = testing.unique_name("app")
    faust_app.ensure_topics(cfg, app_id)
    names = [t.ops, t.telemetry, t.windows, t.throughput, t.quarantine, t.anomalies, t.dead_letter]
    got = topic_configs(kafka_bootstrap, names)
    assert {n: c["retention.ms"] for n, c in got.items()} == {n: "-1" for n in names}
    changelog = f"{app_id}-{faust_app.TABLE_NAME}-changelog"
    assert topic_configs(kafka_bootstrap, [changelog])[changelog]["cleanup.policy"] == "compact"


def test_replay_creates_its_target_topics_so_that_they_never_expire(kafka_bootstrap, tmp_path,
                                                                     monkeypatch):
    """``replay --to-topic`` / ``--to-kafka`` into topics that do not exist yet: the broker
    would auto-create them with its default 7-day retention and delete the old records."""
    from ncclwatch_testkit.drivers import window_scenario

    from ncclwatch import cli
    from ncclwatch.records import to_json

    for k, v in topics_env(kafka_bootstrap).items():
        monkeypatch.setenv(k, v)
    src = tmp_path / "run.jsonl"
    src.write_text("".join(to_json(r) + "\n" for r in window_scenario("job-r", seconds=5)))
    target = testing.unique_name("replay-target")
    assert cli.main(["replay", "--files", str(src), "--to-topic", target, "--no-progress"]) == 0
    prefix = testing.unique_name("again") + "."
    assert cli.main(["replay", "--files", str(src), "--to-kafka", "--topic-prefix", prefix,
                     "--no-progress"]) == 0
    got = topic_configs(kafka_bootstrap, [target])
    assert got[target]["retention.ms"] == "-1"
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, client_id="ncclwatch-test-retention")
    try:
        created = [t for t in admin.list_topics() if t.startswith(prefix)]
    finally:
        admin.close()
    assert created
    assert all(v["retention.ms"] == "-1" for v in topic_configs(kafka_bootstrap, created).values())


def test_the_key_stage_creates_its_verdicts_topic_for_verdicts_of_many_ranks(kafka_bootstrap):
    """A verdict lists its group's ranks: ~1 MB at 50k ranks, past Kafka's default limit."""
    env = {**topics_env(kafka_bootstrap), "NCCLWATCH_TOPICS_WINDOW_KEY": "comm"}
    cfg = config_of(env)
    faust_app.ensure_topics(cfg, testing.unique_name("keys"), "keys")
    got = topic_configs(kafka_bootstrap, [cfg.topics.verdicts])[cfg.topics.verdicts]
    assert got["max.message.bytes"] == str(faust_app.LARGE_MESSAGE_BYTES) and got["retention.ms"] == "-1"
