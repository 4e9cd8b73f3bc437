"""The local services really work: Kafka round trips, Prometheus scrapes, Alertmanager API."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from ncclwatch_testkit import services as testing
from ncclwatch_testkit.services import Services

CONSUMER_KW = {
    "session_timeout_ms": 6000,
    "heartbeat_interval_ms": 2000,
    "enable_auto_commit": False,
    "consumer_timeout_ms": 1000,
}


def produce(bootstrap: str, topic: str, messages: list[tuple[bytes, bytes]]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    try:
        futures = [producer.send(topic, key=k, value=v) for k, v in messages]
        producer.flush(timeout=30)
        for f in futures:
            f.get(timeout=30)
    finally:
        producer.close(timeout=10)


def consume_all(
    bootstrap: str, topic: str, partitions: int, expected: int, timeout: float = 30.0
) -> list[tuple[int, int, bytes, bytes]]:
    """Read every partition from the beginning with manual assign() (no group join)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, **CONSUMER_KW)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        got: list[tuple[int, int, bytes, bytes]] = []
        deadline = time.monotonic() + timeout
        while len(got) < expected and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                got.extend((r.partition, r.offset, r.key, r.value) for r in batch)
        return got
    finally:
        consumer.close()


@pytest.mark.kafka
def test_kafka_produce_consume_exact(kafka_bootstrap: str) -> None:
    topic = testing.unique_name("selftest")
    testing.kafka_create_topic(kafka_bootstrap, topic, 3)
    messages = [(f"k{i % 7}".encode(), f"value-{i}-{'x' * (i % 13)}".encode()) for i in range(300)]
    produce(kafka_bootstrap, topic, messages)

    got = consume_all(kafka_bootstrap, topic, 3, len(messages))
    assert len(got) == len(messages)
    assert sorted((k, v) for _, _, k, v in got) == sorted(messages)
    # per key, order is preserved (one key -> one partition)
    for key in {k for k, _ in messages}:
        sent = [v for k, v in messages if k == key]
        received = [v for _, _, k, v in sorted(got, key=lambda r: (r[0], r[1])) if k == key]
        assert received == sent
        assert len({p for p, _, k, _ in got if k == key}) == 1


@pytest.mark.kafka
def test_kafka_consumer_group_commit(kafka_bootstrap: str) -> None:
    """Group coordination works on one broker (offsets topic with replication factor 1)."""
    topic = testing.unique_name("selftest-group")
    group = testing.unique_name("selftest-g")
    testing.kafka_create_topic(kafka_bootstrap, topic, 1)
    produce(kafka_bootstrap, topic, [(None, f"m{i}".encode()) for i in range(20)])

    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=kafka_bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        **CONSUMER_KW,
    )
    try:
        values: list[bytes] = []
        deadline = time.monotonic() + 60
        while len(values) < 20 and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                values.extend(r.value for r in batch)
        assert values == [f"m{i}".encode() for i in range(20)]
        consumer.commit()
        assert consumer.committed(TopicPartition(topic, 0)) == 20
    finally:
        consumer.close()


@pytest.mark.kafka
@pytest.mark.slow
def test_kafka_restart_same_port_keeps_data(services: Services) -> None:
    topic = testing.unique_name("selftest-restart")
    testing.kafka_create_topic(services.kafka_bootstrap, topic, 2)
    messages = [(f"k{i % 2}".encode(), f"before-{i}".encode()) for i in range(50)]
    produce(services.kafka_bootstrap, topic, messages)

    testing.stop_service("kafka")
    assert not testing.is_running("kafka")
    after = testing.start_service("kafka")
    assert after.kafka_bootstrap == services.kafka_bootstrap, testing.log_tail("kafka")

    got = consume_all(after.kafka_bootstrap, topic, 2, len(messages))
    assert sorted((k, v) for _, _, k, v in got) == sorted(messages)
    # and the broker still takes writes
    produce(after.kafka_bootstrap, topic, [(b"k0", b"after")])
    got = consume_all(after.kafka_bootstrap, topic, 2, len(messages) + 1)
    assert (b"k0", b"after") in [(k, v) for _, _, k, v in got]


@pytest.mark.prometheus
def test_prometheus_scrapes_node_exporter(services: Services) -> None:
    instance = urllib.parse.urlparse(services.node_exporter_url).netloc
    result = testing.wait_prometheus(
        services.prometheus_url, f'up{{job="node",instance="{instance}"}} == 1', timeout=15
    )
    assert result[0]["metric"]["instance"] == instance
    assert result[0]["value"][1] == "1"


@pytest.mark.prometheus
def test_textfile_metric_reaches_prometheus(services: Services) -> None:
    name = testing.unique_name("ncclwatch_selftest").replace("-", "_")
    final = services.textfile_dir / f"{name}.prom"
    tmp = services.textfile_dir / f".{name}.tmp"  # not *.prom: the collector ignores it
    tmp.write_text(f'# TYPE {name} gauge\n{name}{{rank="3"}} 42.5\n')
    os.replace(tmp, final)
    try:
        result = testing.wait_prometheus(services.prometheus_url, name, timeout=15)
        assert result[0]["metric"]["rank"] == "3"
        assert float(result[0]["value"][1]) == 42.5
    finally:
        final.unlink(missing_ok=True)


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, str]]:
    name = testing.unique_name("ncclwatch_selftest_sd").replace("-", "_")
    handler = type("H", (_MetricsHandler,), {"body": f"{name} 7\n".encode()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", name
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.prometheus
def test_file_sd_target_is_scraped(services: Services, metrics_server: tuple[str, str]) -> None:
    address, metric = metrics_server
    targets: Path = services.prometheus_targets_file
    original = targets.read_text() if targets.exists() else "[]"
    entries = json.loads(original or "[]")
    entries.append({"targets": [address], "labels": {"selftest": "yes"}})
    tmp = targets.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries))
    os.replace(tmp, targets)
    try:
        result = testing.wait_prometheus(
            services.prometheus_url, f'{metric}{{job="ncclwatch",selftest="yes"}}', timeout=20
        )
        assert result[0]["metric"]["instance"] == address
        assert result[0]["value"][1] == "7"
    finally:
        tmp.write_text(original)
        os.replace(tmp, targets)


@pytest.mark.prometheus
def test_alertmanager_post_and_get(alertmanager_url: str) -> None:
    alertname = testing.unique_name("SelftestAlert")
    alert = {
        "labels": {"alertname": alertname, "severity": "warning", "job": "selftest"},
        "annotations": {"summary": "services self-test"},
        "generatorURL": "http://127.0.0.1/selftest",
    }
    testing.http_json(f"{alertmanager_url}/api/v2/alerts", [alert], method="POST")
    query = urllib.parse.urlencode({"filter": f'alertname="{alertname}"'})
    deadline = time.monotonic() + 10
    found: list[dict] = []
    while not found and time.monotonic() < deadline:
        found = testing.http_json(f"{alertmanager_url}/api/v2/alerts?{query}")
        if not found:
            time.sleep(0.2)
    assert len(found) == 1
    assert found[0]["labels"] == alert["labels"]
    assert found[0]["annotations"] == alert["annotations"]
    assert found[0]["status"]["state"] == "active"


@pytest.mark.prometheus
def test_prometheus_rule_fires_into_alertmanager(services: Services) -> None:
    """rule_files + /-/reload + alerting to the started Alertmanager, end to end."""
    alertname = testing.unique_name("SelftestRule").replace("-", "_")
    rule = services.prometheus_rules_dir / f"{alertname}.yml"
    rule.write_text(
        "groups:\n"
        f"  - name: {alertname}\n"
        "    rules:\n"
        f"      - alert: {alertname}\n"
        "        expr: vector(1)\n"
        "        labels: {severity: info}\n"
    )
    try:
        testing.reload(services.prometheus_url)
        testing.wait_prometheus(
            services.prometheus_url, f'ALERTS{{alertname="{alertname}",alertstate="firing"}}'
        )
        query = urllib.parse.urlencode({"filter": f'alertname="{alertname}"'})
        deadline = time.monotonic() + 15
        found: list[dict] = []
        while not found and time.monotonic() < deadline:
            found = testing.http_json(f"{services.alertmanager_url}/api/v2/alerts?{query}")
            if not found:
                time.sleep(0.25)
        assert found, testing.log_tail("prometheus")
        assert found[0]["labels"]["severity"] == "info"
    finally:
        rule.unlink(missing_ok=True)
        testing.reload(services.prometheus_url)


def test_kafka_cluster_ids_never_start_with_a_dash():
    """StorageTool reads ``-t -abc…`` as an option: one random id in 64 failed a CI run
    (2026-11-26, the SASL broker of tests/test_kafka_auth.py)."""
    ids = [testing.kafka_cluster_id() for _ in range(2000)]
    assert not [c for c in ids if c.startswith("-")]
    assert len(set(ids)) == 2000 and all(len(c) == 22 for c in ids)
