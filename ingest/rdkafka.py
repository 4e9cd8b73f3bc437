"""The forwarder's producer on librdkafka (confluent-kafka), behind kafka-python's interface.

The forwarder talks to one producer interface, kafka-python's: ``send(topic, value=,
key=)`` returns a future with ``add_callback``/``add_errback``, and ``flush``/``close``.
:class:`RdKafkaProducer` gives librdkafka that interface, so ``kafka.producer =
"confluent-kafka"`` swaps the client and nothing else. kafka-python's send path is pure
Python (partitioner, accumulator) and caps the forwarder; librdkafka's is C.

librdkafka runs delivery callbacks only inside ``poll``/``flush``; a poller thread calls
``poll`` all the time, as kafka-python's sender thread runs its callbacks, so the
forwarder sees the same threading either way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ncclwatch.config import KafkaConfig

log = logging.getLogger(__name__)

# kafka-python's names -> librdkafka's (security settings only; the rest is set below)
_SECURITY = {
    "security_protocol": "security.protocol",
    "sasl_mechanism": "sasl.mechanism",
    "sasl_plain_username": "sasl.username",
    "sasl_plain_password": "sasl.password",
    "ssl_cafile": "ssl.ca.location",
    "ssl_certfile": "ssl.certificate.location",
    "ssl_keyfile": "ssl.key.location",
    "ssl_password": "ssl.key.password",
}


class DeliveryError(Exception):
    """A message librdkafka gave up on (its ``KafkaError`` as text)."""


class Delivery:
    """kafka-python's ``FutureRecordMetadata``, as much as the forwarder uses of it.

    >>> d = Delivery()
    >>> d.add_callback(lambda meta: print("ok", meta))
    >>> d.done(None, "offset 7")
    ok offset 7
    >>> d.add_callback(lambda meta: print("late ok", meta))  # already delivered: runs now
    late ok offset 7
    """

    __slots__ = ("_lock", "_ok", "_err", "_result", "_error", "_settled")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ok: list[Callable[[Any], None]] = []
        self._err: list[Callable[[BaseException], None]] = []
        self._result: Any = None
        self._error: BaseException | None = None
        self._settled = False

    def add_callback(self, fn: Callable[[Any], None]) -> None:
        with self._lock:
            if not self._settled:
                self._ok.append(fn)
                return
        if self._error is None:
            fn(self._result)

    def add_errback(self, fn: Callable[[BaseException], None]) -> None:
        with self._lock:
            if not self._settled:
                self._err.append(fn)
                return
        if self._error is not None:
            fn(self._error)

    def done(self, err: Any, msg: Any) -> None:
        """librdkafka's ``on_delivery(err, msg)``."""
        with self._lock:
            self._error = None if err is None else DeliveryError(str(err))
            self._result = msg
            self._settled = True
            ok, bad = self._ok, self._err
            self._ok, self._err = [], []
        if self._error is None:
            for fn in ok:
                fn(msg)
        else:
            for fn in bad:
                fn(self._error)


def producer_conf(kafka: KafkaConfig, *, compression: str, batch_size_bytes: int, linger_ms: int,
                  request_timeout_ms: int, delivery_timeout_ms: int) -> dict[str, Any]:
    """librdkafka settings with the same guarantees as the kafka-python producer's
    (``kafka_sink.make_producer``): acks from all replicas, each partition in send order
    across retries, retries until the delivery timeout.

    The order needs librdkafka's idempotent producer. One request in flight is not enough
    on its own: librdkafka builds the next requests of a partition while one is in flight,
    and re-queues the messages of a request that failed with a retriable error (a fresh
    topic's "not leader", a leader election) behind them, silently. That is the likely
    cause of a communicator's records CI saw out of order (not reproduced here;
    docs/ingest.md, "Producer").
    """
    conf: dict[str, Any] = {
        "bootstrap.servers": kafka.bootstrap_servers,
        "client.id": kafka.client_id,
        "acks": "all",
        "compression.type": compression,
        "batch.size": batch_size_bytes,
        "linger.ms": linger_ms,
        "enable.idempotence": True,
        # One request in flight: brokers before the fix of KAFKA-15591 (2026) could append
        # a second in-flight request to a fresh partition ahead of a first one refused.
        "max.in.flight.requests.per.connection": 1,
        "request.timeout.ms": request_timeout_ms,
        "message.timeout.ms": max(delivery_timeout_ms, request_timeout_ms + linger_ms),
        "message.max.bytes": 16 << 20,
        "reconnect.backoff.max.ms": 2_000,
        "queue.buffering.max.kbytes": 256 * 1024,
    }
    for ours, theirs in _SECURITY.items():
        value = getattr(kafka, ours)
        if value:
            conf[theirs] = value
    return conf


class RdKafkaProducer:
    """``confluent_kafka.Producer`` with kafka-python's ``send``/``flush``/``close``.

    :attr:`fatal` is set once librdkafka reports a fatal error (the idempotent producer
    can no longer keep its guarantees): every later send fails, and the owner replaces
    the producer (the forwarder does, after spilling what was unacknowledged).
    """

    def __init__(self, conf: dict[str, Any], poll_interval_s: float = 0.05):
        from confluent_kafka import Producer

        self.fatal = ""
        # through Python's logging, where the redaction of broker addresses and secrets
        # applies (ncclwatch/redact.py), instead of librdkafka's own stderr lines
        self._producer = Producer({**conf, "logger": log, "error_cb": self.on_error})
        self._stop = threading.Event()
        self._poll_interval_s = poll_interval_s
        self._poller = threading.Thread(target=self._poll, name="ncclwatch-rdkafka-poll", daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(self._poll_interval_s)

    def on_error(self, err: Any) -> None:
        """librdkafka's ``error_cb``: client-level errors (most are retried inside it)."""
        if err.fatal():
            self.fatal = err.str()
            log.error("event=kafka_producer_fatal error=%s", self.fatal)

    def send(self, topic: str, value: bytes | None = None, key: bytes | None = None) -> Delivery:
        if self.fatal:
            raise DeliveryError(f"producer failed fatally: {self.fatal}")
        delivery = Delivery()
        try:
            self._producer.produce(topic, value=value, key=key, on_delivery=delivery.done)
        except BufferError:  # the local queue is full: let deliveries drain once, then retry
            self._producer.poll(0.5)
            self._producer.produce(topic, value=value, key=key, on_delivery=delivery.done)
        return delivery

    def flush(self, timeout: float | None = None) -> None:
        left = self._producer.flush(-1 if timeout is None else timeout)
        if left:
            raise TimeoutError(f"{left} message(s) not delivered within {timeout} s")

    def close(self, timeout: float | None = None) -> None:
        try:
            if self.fatal:  # nothing more will be delivered: drop the queues, do not wait
                self._producer.purge()
                return
            self.flush(timeout)
        finally:
            self._stop.set()
            self._poller.join(timeout=2)
