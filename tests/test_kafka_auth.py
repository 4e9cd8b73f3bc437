"""Wrong Kafka credentials end the forwarder and the worker with a clear message, after a
bounded number of tries, instead of retrying forever.

kafka-python 3.0 retries a refused SASL handshake until its bootstrap times out and then
raises only a timeout, as for a broker that is down; Faust's client retries forever. The
services' broker has no SASL listener (and must not be restarted), so this module starts
a broker of its own from the same jars scripts/setup.sh fetched (``.cache/kafka/libs``),
single-node KRaft with a SASL_PLAINTEXT listener (PLAIN, user ``ncclwatch``), and stops
it at the end.
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from ncclwatch.ingest import kafka_sink
from ncclwatch.ingest.synth import write_spool

from ncclwatch import config, testing

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

USER, PASSWORD = "ncclwatch", "right-pw-4c1d"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sasl_bootstrap(tmp_path_factory) -> Iterator[str]:
    libs = Path(os.environ.get("NCCLWATCH_CACHE_DIR", testing.repo_root() / ".cache")) / "kafka" / "libs"
    assert list(libs.glob("kafka_2.13-*.jar")), f"Kafka jars missing in {libs}: run scripts/setup.sh"
    d = tmp_path_factory.mktemp("sasl-kafka")
    port, cport = _free_port(), _free_port()
    (d / "server.properties").write_text(f"""\
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{cport}
listeners=SASL_PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}
advertised.listeners=SASL_PLAINTEXT://127.0.0.1:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=SASL_PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT
sasl.enabled.mechanisms=PLAIN
sasl.mechanism.inter.broker.protocol=PLAIN
listener.name.sasl_plaintext.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule \
required username="admin" password="admin-pw" user_admin="admin-pw" user_{USER}="{PASSWORD}";
log.dirs={d}/data
num.partitions=1
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
group.initial.rebalance.delay.ms=0
""")
    java = ["java", "-Xmx384m", "-cp", f"{libs}/*"]
    cluster = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    subprocess.run([*java, "kafka.tools.StorageTool", "format", "-t", cluster, "-c",
                    str(d / "server.properties")], check=True, capture_output=True, timeout=120)
    log = open(d / "kafka.log", "w")  # noqa: SIM115 (closed at teardown)
    proc = subprocess.Popen([*java, "kafka.Kafka", str(d / "server.properties")], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    bootstrap = f"127.0.0.1:{port}"
    try:
        good = kafka_config(bootstrap, PASSWORD)
        deadline = time.monotonic() + 90
        while True:
            try:
                kafka_sink.ensure_topics(good, config.TopicsConfig(), [], bootstrap_timeout_s=2)
                break
            except Exception:
                assert proc.poll() is None, (d / "kafka.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the SASL broker did not start in 90 s"
                time.sleep(1)
        yield bootstrap
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def kafka_config(bootstrap: str, password: str) -> config.KafkaConfig:
    return config.load(None, environ=env_of(bootstrap, password)).kafka


def env_of(bootstrap: str, password: str) -> dict[str, str]:
    return {"NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": bootstrap, "NCCLWATCH_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "NCCLWATCH_KAFKA_SASL_MECHANISM": "PLAIN", "NCCLWATCH_KAFKA_SASL_PLAIN_USERNAME": USER,
            "NCCLWATCH_KAFKA_SASL_PLAIN_PASSWORD": password, **testing.RECORDED_TOPICS_ENV}


def test_right_credentials_pass_the_check_and_wrong_ones_are_named(sasl_bootstrap):
    assert kafka_sink.check_credentials(kafka_config(sasl_bootstrap, PASSWORD)) == ""
    why = kafka_sink.check_credentials(kafka_config(sasl_bootstrap, "wrong-pw"), attempts=2, pause_s=0.1)
    assert "refused the credentials 2 time(s)" in why and "SaslAuthenticationFailedError" in why
    assert "wrong-pw" not in why


def test_worker_with_wrong_credentials_exits_1_with_a_clear_message(sasl_bootstrap):
    env = {**os.environ, **env_of(sasl_bootstrap, "wrong-pw"), "NCCLWATCH_DETECTOR_METRICS_PORT": "-1"}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ncclwatch.cli", "worker", "--app-id", testing.unique_name("app")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "ncclwatch worker: Kafka refused the credentials 3 time(s)" in done.stderr
    assert "wrong-pw" not in done.stderr + done.stdout
    assert time.monotonic() - t0 < 60


def test_forwarder_with_wrong_credentials_exits_1_and_keeps_the_spool(sasl_bootstrap, tmp_path):
    paths = write_spool(str(tmp_path / "spool"), streams=1, ops_per_stream=100)
    env = {**os.environ, **env_of(sasl_bootstrap, "wrong-pw")}
    done = subprocess.run([sys.executable, "-m", "ncclwatch.cli", "forward", "--spool", str(tmp_path / "spool"),
                           "--state-dir", str(tmp_path / "state"), "--node-id", "n1", "--metrics-port", "-1"],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "ncclwatch forward: Kafka refused the credentials 5 time(s)" in done.stderr
    assert "wrong-pw" not in done.stderr + done.stdout
    assert all(Path(p).exists() for p in paths)  # nothing was deleted: it was never sent
