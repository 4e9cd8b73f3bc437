"""Wrong Kafka credentials end the forwarder and the worker with a clear message, after a
bounded number of tries, instead of retrying forever.

kafka-python 3.0 retries a refused SASL handshake until its bootstrap times out and then
raises only a timeout, as for a broker that is down; Faust's client retries forever. The
services' broker has no SASL listener (and must not be restarted), so this module starts
a broker of its own (``testing.PrivateKafka``, from the same jars scripts/setup.sh
fetched) with a SASL_PLAINTEXT listener (PLAIN, user ``ncclwatch``), and stops it at the
end.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ncclwatch.ingest import kafka_sink
from ncclwatch_testkit import services as testing
from ncclwatch_testkit.synth import write_spool

from ncclwatch import config

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

USER, PASSWORD = "ncclwatch", "right-pw-4c1d"


@pytest.fixture(scope="module")
def sasl_bootstrap(tmp_path_factory) -> Iterator[str]:
    with testing.PrivateKafka(tmp_path_factory.mktemp("sasl-kafka"), sasl_users={USER: PASSWORD}) as kafka:
        yield kafka.bootstrap


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


def test_a_listening_but_silent_broker_is_tried_again_with_longer_timeouts_then_left_to_the_caller():
    # A loaded machine or a broker still starting: the port accepts, nothing answers in
    # time. The check tries again (timeouts 0.2, 0.4, 0.8 s), then leaves the outage to
    # the caller's own retries instead of calling it a refusal.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        bootstrap = f"127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        why = kafka_sink.check_credentials(kafka_config(bootstrap, "any-pw"), bootstrap_timeout_s=0.2,
                                           silent_tries=2)
        took = time.monotonic() - t0
    assert why == ""
    assert 1.4 <= took < 30, took  # three tries, each twice as patient as the one before


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


def test_worker_with_no_broker_listening_exits_1_with_a_clear_message(tmp_path):
    env = {**os.environ, "NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{testing.free_port()}",
           "NCCLWATCH_DETECTOR_METRICS_PORT": "-1", **testing.RECORDED_TOPICS_ENV}
    done = subprocess.run([sys.executable, "-m", "ncclwatch.cli", "worker", "--app-id", testing.unique_name("app")],
                          env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "ncclwatch worker: cannot reach Kafka (bootstrap_hosts=1" in done.stderr
    assert "Traceback" not in done.stderr
