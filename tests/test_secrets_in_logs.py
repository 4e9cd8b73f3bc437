"""No password, token or broker address in any log line of any command, at debug level.

Every command runs as the operator would run it, ``ncclwatch -vv ...`` (debug logging,
and Faust's at debug for the worker), with secrets in its configuration: Kafka SASL and
SSL key passwords (kafka-python's clients log their whole configuration at debug
level) and Alertmanager basic-auth credentials. Whatever each prints or logs must hold
none of them, nor the form they travel in (the basic-auth header), nor the broker's
``host:port``.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ncclwatch_testkit import services as testing
from ncclwatch_testkit.drivers import WorkerProcess, create_topics, publish, topics_env, window_scenario, write_spool

pytestmark = pytest.mark.kafka

SECRETS = {
    "NCCLWATCH_KAFKA_SASL_PLAIN_PASSWORD": "pw-kafka-7f3a91",
    "NCCLWATCH_KAFKA_SSL_PASSWORD": "pw-sslkey-91c2e4",
    "NCCLWATCH_ALERTING_ALERTMANAGER_USERNAME": "oncall-bot",
    "NCCLWATCH_ALERTING_ALERTMANAGER_PASSWORD": "pw-am-55d1b0",
}
BASIC = base64.b64encode(b"oncall-bot:pw-am-55d1b0").decode()


def leaks(text: str, bootstrap: str) -> list[str]:
    needles = [v for k, v in SECRETS.items() if "PASSWORD" in k] + [BASIC, bootstrap]
    return [n for n in needles if n in text]


def run_cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ncclwatch.cli", "-vv", *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def env(kafka_bootstrap):
    e = {**topics_env(kafka_bootstrap), **SECRETS,
         "NCCLWATCH_ALERTING_ALERTMANAGER_URL": refused_url()}
    create_topics(e)
    publish(e, window_scenario("job-s", seconds=20, degrade_from_s=10**6))
    return e


def refused_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_forwarder_logs_no_secret_at_debug(env, kafka_bootstrap, tmp_path):
    from ncclwatch_testkit.synth import write_spool as synth_spool

    synth_spool(str(tmp_path / "spool"), streams=1, ops_per_stream=200)
    done = run_cli(env, "forward", "--once", "--spool", str(tmp_path / "spool"), "--state-dir",
                   str(tmp_path / "state"), "--node-id", "n1", "--metrics-port", "-1")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "DEBUG" in out and "sasl_plain_password" in out  # kafka-python did log its config
    assert leaks(out, kafka_bootstrap) == []


def test_worker_logs_no_secret_at_debug(env, kafka_bootstrap, tmp_path):
    worker = WorkerProcess(env, testing.unique_name("app"), tmp_path, "-vv", "--loglevel", "debug").start()
    try:
        worker.wait_assigned(90)
    finally:
        worker.stop()
    out = worker.log_path.read_text(errors="replace")
    assert "DEBUG" in out and "sasl_plain_password" in out
    assert leaks(out, kafka_bootstrap) == []


def test_watch_and_replay_log_no_secret_at_debug(env, kafka_bootstrap, tmp_path):
    write_spool(tmp_path / "spool", seconds=50)
    watch = run_cli(env, "watch", str(tmp_path / "spool"), "--once", "--metrics-port", "-1")
    out = watch.stdout + watch.stderr
    assert watch.returncode == 0, out[-3000:]
    assert "alertmanager unreachable" in out  # it did try, with the credentials
    assert leaks(out, kafka_bootstrap) == []
    replay = run_cli(env, "replay", "--topic", env["NCCLWATCH_TOPICS_WINDOWS"], "--detect", "--no-progress")
    out = replay.stdout + replay.stderr
    assert replay.returncode == 0, out[-3000:]
    assert "DEBUG kafka" in out  # the consumer's own debug logs are on
    assert leaks(out, kafka_bootstrap) == []


def test_alert_test_logs_no_secret_at_debug(env, kafka_bootstrap):
    done = run_cli(env, "alert-test", "--duration", "1", timeout=60)
    out = done.stdout + done.stderr
    assert done.returncode != 0  # Alertmanager is unreachable here
    assert leaks(out, kafka_bootstrap) == []


def test_redaction_covers_handlers_added_later_and_tracebacks(caplog):
    import logging

    from ncclwatch import config, redact

    cfg = config.load(None, environ={**SECRETS, "NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": "kafka-0.example:9094"})
    redact.install_for(cfg)
    log = logging.getLogger("some.library.added.later")
    try:
        raise ValueError("auth failed for pw-kafka-7f3a91 at kafka-0.example:9094")
    except ValueError:
        log.exception("config %s", {"sasl_plain_password": "pw-kafka-7f3a91", "host": "kafka-0.example"})
    text = caplog.text
    assert "pw-kafka-7f3a91" not in text and "kafka-0.example" not in text
    assert "<redacted>" in text and Path(__file__).name in text  # the traceback is still there
