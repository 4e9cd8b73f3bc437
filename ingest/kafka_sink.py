"""Sink: Kafka through kafka-python, acks=all, topics created when absent.

Connection settings come from ``config.kafka.client_kwargs()`` and are never logged: only
how many bootstrap hosts there are and the security protocol.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from ncclwatch import redact
from ncclwatch.config import KafkaConfig, TopicsConfig

log = logging.getLogger(__name__)

CODECS = ("none", "gzip", "lz4", "zstd", "snappy")


def available_codecs() -> list[str]:
    """Compression codecs kafka-python can use with the libraries installed here."""
    from kafka import codec

    out = ["none", "gzip"]
    if codec.has_lz4():
        out.append("lz4")
    if codec.has_zstd():
        out.append("zstd")
    if codec.has_snappy():
        out.append("snappy")
    return out


def describe(kafka: KafkaConfig) -> str:
    """What may be logged about the connection (no host names, no credentials)."""
    n = len([h for h in kafka.bootstrap_servers.split(",") if h.strip()])
    return f"bootstrap_hosts={n} security_protocol={kafka.security_protocol}"


class RedactFilter(logging.Filter):
    """Remove the broker addresses and secret values of ``kafka`` from a record
    (:mod:`ncclwatch.redact` holds the rule; this filter is for handlers set up by hand)."""

    def __init__(self, kafka: KafkaConfig):
        super().__init__()
        self._redactor = redact.Redactor(redact.kafka_needles(kafka))
        self.needles = self._redactor.needles

    def filter(self, record: logging.LogRecord) -> bool:
        self._redactor.scrub(record)
        return True


def install_redaction(kafka: KafkaConfig) -> redact.Redactor:
    """Redact the Kafka secrets and addresses from every log record from now on (the CLI
    already did for the whole configuration; this is for drivers started from code)."""
    return redact.install(redact.kafka_needles(kafka))


# kafka-python 3.0 retries a refused SASL handshake until its bootstrap times out and
# then raises only KafkaTimeoutError, as for a broker that is down; the refusals show
# only in its log records, by the names of these error classes.
AUTH_ERRORS = ("SaslAuthenticationFailedError", "UnsupportedSaslMechanismError", "IllegalSaslStateError")


class AuthFailures(logging.Handler):
    """Notices the authentication failures kafka-python logs and swallows."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = ""

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        for name in AUTH_ERRORS:
            if name in msg:
                self.seen = name


@contextlib.contextmanager
def watching_auth() -> Iterator[AuthFailures]:
    """``with watching_auth() as w: <build clients>``; afterwards ``w.seen`` names the
    authentication error kafka-python hit, or is empty."""
    h = AuthFailures()
    logger = logging.getLogger("kafka")
    logger.addHandler(h)
    try:
        yield h
    finally:
        logger.removeHandler(h)


def auth_failure_message(kafka: KafkaConfig, error: str, attempts: int) -> str:
    return (f"Kafka refused the credentials {attempts} time(s) ({error}; security_protocol="
            f"{kafka.security_protocol} sasl_mechanism={kafka.sasl_mechanism or '-'}): check "
            "kafka.sasl_plain_username / sasl_plain_password (or the SSL settings)")


def any_listening(bootstrap_servers: str, timeout_s: float = 2.0) -> bool:
    """Whether any ``host:port`` of a bootstrap list accepts a TCP connection: a silent
    bootstrap failure against a listening broker is not an unreachable one."""
    import socket

    for server in bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
                return True
        except (OSError, ValueError):
            continue
    return False


def check_credentials(kafka: KafkaConfig, *, attempts: int = 3, bootstrap_timeout_s: float = 5.0,
                      pause_s: float = 1.0, silent_tries: int = 2) -> str:
    """Empty when Kafka accepts the credentials or cannot be reached (the caller says so
    in its own words), else why it refused them ``attempts`` times in a row.

    After a first refusal, a broker slows down and drops the next handshakes of the same
    client (``connection.failed.authentication.delay.ms``) without saying why again: a
    failure then counts as a refusal too. Before any refusal, a try that times out
    silently (a loaded machine, a broker still starting) is tried again, ``silent_tries``
    times at most, with twice the timeout each time.
    """
    from kafka.admin import KafkaAdminClient

    error = ""
    refusals = silent = 0
    timeout_s = bootstrap_timeout_s
    while refusals < attempts:
        with watching_auth() as w:
            try:
                admin = KafkaAdminClient(**kafka.client_kwargs(), bootstrap_timeout_ms=int(timeout_s * 1000))
                admin.close()
                return ""
            except Exception:  # unreachable, or refused: only a refusal counts here
                error = w.seen or error
        if not error:
            silent += 1
            if silent > silent_tries or not any_listening(kafka.bootstrap_servers):
                return ""
            timeout_s *= 2
            continue
        refusals += 1
        log.warning("event=kafka_auth_failed attempt=%d/%d error=%s", refusals, attempts, error)
        if refusals < attempts:
            time.sleep(pause_s)
    return auth_failure_message(kafka, error, attempts)


def make_producer(kafka: KafkaConfig, *, compression: str, batch_size_bytes: int,
                  linger_ms: int, request_timeout_ms: int = 10_000,
                  delivery_timeout_ms: int = 30_000, bootstrap_timeout_ms: int = 3_000) -> Any:
    if compression not in CODECS:
        raise ValueError(f"compression {compression!r} is not one of {CODECS}")
    if kafka.producer == "confluent-kafka":  # librdkafka has every codec built in
        from ncclwatch.ingest.rdkafka import RdKafkaProducer, producer_conf

        return RdKafkaProducer(producer_conf(
            kafka, compression=compression, batch_size_bytes=batch_size_bytes, linger_ms=linger_ms,
            request_timeout_ms=request_timeout_ms, delivery_timeout_ms=delivery_timeout_ms))
    from kafka import KafkaProducer

    if compression not in available_codecs():
        raise ValueError(f"compression {compression!r} needs a library that is not installed "
                         f"(available here: {', '.join(available_codecs())})")
    return KafkaProducer(
        **kafka.client_kwargs(),
        acks="all",
        compression_type=None if compression == "none" else compression,
        batch_size=batch_size_bytes,
        linger_ms=linger_ms,
        # One request in flight per connection keeps each partition in send order even
        # across retries, without relying on the idempotent producer's epoch handling.
        enable_idempotence=False,
        max_in_flight_requests_per_connection=1,
        retries=2**31,
        request_timeout_ms=request_timeout_ms,
        delivery_timeout_ms=max(delivery_timeout_ms, request_timeout_ms + linger_ms),
        max_block_ms=5_000,
        max_request_size=16 << 20,
        reconnect_backoff_max_ms=2_000,
        allow_auto_create_topics=False,
        # The forwarder retries with backoff itself; a long bootstrap wait would only
        # stall reading into the spill buffer.
        bootstrap_timeout_ms=bootstrap_timeout_ms,
    )


def ensure_topics(kafka: KafkaConfig, topics: TopicsConfig, names: list[str],
                  timeout_s: float = 10.0, bootstrap_timeout_s: float = 3.0,
                  retention_ms: int | None = None) -> list[str]:
    """Create the topics that do not exist yet; returns the ones created.

    ``retention_ms`` overrides the configured retention (``-1`` for recorded data, whose
    old timestamps the broker's time-based retention would delete at once).
    """
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(**kafka.client_kwargs(), request_timeout_ms=int(timeout_s * 1000),
                             bootstrap_timeout_ms=int(bootstrap_timeout_s * 1000))
    try:
        existing = set(admin.list_topics())
        missing = [n for n in dict.fromkeys(names) if n not in existing]
        if not missing:
            return []
        new = [NewTopic(n, num_partitions=topics.partitions,
                        replication_factor=topics.replication_factor,
                        topic_configs={"retention.ms": str(
                            topics.retention_ms if retention_ms is None else retention_ms)})
               for n in missing]
        with contextlib.suppress(TopicAlreadyExistsError):  # another forwarder won the race
            admin.create_topics(new, timeout_ms=int(timeout_s * 1000))
        # Producing before every partition has a leader only burns the send timeout.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            described = admin.describe_topics(missing)
            ready = [t for t in described if t.get("error_code", 0) == 0
                     and t.get("partitions")
                     and all(p.get("leader", p.get("leader_id", -1)) >= 0
                             for p in t["partitions"])]
            if len(ready) == len(missing):
                break
            time.sleep(0.1)
        log.info("event=topics_created topics=%s partitions=%d", ",".join(missing),
                 topics.partitions)
        return missing
    finally:
        admin.close()
