"""The forwarder's sink: batches of messages to Kafka, in the order read, through a disk
buffer while Kafka fails.

A batch is sent directly while Kafka acknowledges (mode ``direct``). When a send fails or
stalls, every unfinished batch moves, in order, to the disk buffer (mode ``spill``) and
reading goes on; the buffer is drained in order once Kafka answers again, then held
batches are sent and the mode is ``direct`` again. A batch that does not fit in the
buffer (its bound, or a full disk) is *held* in memory, in order, and the forwarder
stops reading until it is spilled or sent: the spool keeps the rest. A batch's
``snapshot`` (the read positions it completes) becomes :attr:`Delivery.committed` once it
and every batch before it are acknowledged or spilled: the checkpoint never passes what
is safe.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from typing import Any

from ncclwatch.ingest import kafka_sink
from ncclwatch.ingest.buffer import BufferFull, DiskBuffer
from ncclwatch.ingest.disk_errors import DiskErrors
from ncclwatch.ingest.metrics import ForwarderMetrics

from ncclwatch.config import Config

log = logging.getLogger("ncclwatch.forward")

DIRECT, SPILL = "direct", "spill"


class Batch:
    """Messages read together, and the positions that become safe once they are done.

    A batch is *held* while it is neither sent nor spilled: Kafka is failing and the
    spill buffer has no room for it (its bound, or a full disk). Held batches stay in
    memory, in order, and reading pauses until they are spilled or sent.
    """

    __slots__ = ("messages", "snapshot", "pending", "errors", "done", "sent_at", "records", "held")

    def __init__(self, messages: list, snapshot: dict | None):
        self.messages = messages
        self.snapshot = snapshot
        self.pending = 0
        self.errors: list[BaseException] = []
        self.done = not messages
        self.sent_at = 0.0
        self.records: collections.Counter = collections.Counter()
        self.held = False

    def ok(self, _metadata: Any) -> None:  # kafka-python sender thread
        self.pending -= 1

    def err(self, exc: BaseException) -> None:  # kafka-python sender thread
        self.errors.append(exc)
        self.pending -= 1

    @property
    def resolved(self) -> bool:
        return self.pending <= 0


def _records_in(value: bytes) -> int:
    # JSON escapes newlines inside strings, so a packed value's records are its lines.
    return value.count(b"\n") + 1


class Delivery:
    """Batches to Kafka in order, spilling to ``buffer`` while Kafka fails (module doc).

    ``opts`` is the forwarder's :class:`~ncclwatch.ingest.forward.Options` (its
    ``compression``, ``linger_ms``, ``stall_s``, ``auth_attempts``, ``buffer_max_bytes``).
    """

    def __init__(self, cfg: Config, opts: Any, buffer: DiskBuffer, *, metrics: ForwarderMetrics,
                 disk: DiskErrors, clock=time.time):
        self.cfg = cfg
        self.topics = cfg.topics
        self.opts = opts
        self.buffer = buffer
        self.metrics = metrics
        self.disk = disk
        self.clock = clock
        self.producer: Any = None
        self.mode = SPILL if not buffer.empty() else DIRECT
        self.batches: collections.deque[Batch] = collections.deque()
        self.draining: Batch | None = None  # the buffer's batch in flight
        self.backoff_s = 0.5
        self.next_attempt = 0.0
        self.auth_refusals = 0
        self.fatal = ""  # why the forwarder must stop (credentials refused)
        self.buffer_full_logged = False
        self.full_at_bytes = 1 << 62  # buffer bytes when a batch was last refused for room
        self.committed: dict | None = None  # the newest snapshot every batch before is safe for
        self.dirty = False  # committed or the buffer moved since the last checkpoint
        self.sent_total = 0

    def held(self) -> bool:
        """Whether a batch waits in memory for room (reading pauses meanwhile)."""
        return any(b.held for b in self.batches)

    def inflight(self) -> int:
        return sum(1 for b in self.batches if not b.done)

    def idle(self) -> bool:
        """Nothing unfinished, in memory or in the buffer."""
        return not self.inflight() and (self.mode == DIRECT or (
            self.buffer.empty() and self.draining is None))

    def try_direct(self) -> None:
        """Before reading in direct mode: connect, or spill what is read next."""
        if self.mode == DIRECT and self.producer is None and not self.connect():
            self.mode = SPILL
            self.next_attempt = self.clock() + self.backoff_s

    def finish(self, timeout_s: float) -> None:
        """At shutdown: wait up to ``timeout_s`` for acknowledgements, spill the rest."""
        deadline = time.monotonic() + timeout_s
        if self.producer is not None:
            with contextlib.suppress(Exception):
                self.producer.flush(timeout=max(0.1, timeout_s / 2))
        while time.monotonic() < deadline:
            self.collect()
            if not self.inflight():
                break
            time.sleep(0.01)
        if self.inflight():
            self.spill_all("shutdown_before_ack")
            self.collect()

    def close(self) -> None:
        if self.producer is not None:
            with contextlib.suppress(Exception):
                self.producer.close(timeout=2)
            self.producer = None

    def connect(self) -> bool:
        if self.producer is not None:
            return True
        t = self.topics
        with kafka_sink.watching_auth() as auth:
            try:
                kafka_sink.ensure_topics(self.cfg.kafka, t, [t.ops, t.telemetry, t.windows,
                                                             t.throughput, t.anomalies,
                                                             t.quarantine])
                self.producer = kafka_sink.make_producer(
                    self.cfg.kafka, compression=self.opts.compression,
                    batch_size_bytes=1 << 20, linger_ms=self.opts.linger_ms)
            except Exception as e:  # broker down, auth failure: keep the data, retry later
                error = auth.seen or type(e).__name__
                log.warning("event=kafka_connect_failed %s error=%s retry_in_s=%.1f",
                            kafka_sink.describe(self.cfg.kafka), error, self.backoff_s)
                self._auth_refused(auth.seen)
                return False
        self.auth_refusals = 0
        log.info("event=kafka_connected %s compression=%s", kafka_sink.describe(self.cfg.kafka),
                 self.opts.compression)
        return True

    def _auth_refused(self, error: str) -> None:
        """Wrong credentials do not fix themselves: after ``auth_attempts`` refusals in a
        row the forwarder stops (exit 1) with a clear message; the spool keeps the data."""
        if not error and not self.auth_refusals:
            return  # unreachable, not refused
        # after a first refusal the broker drops the same client's next handshakes
        # without saying why again: those count too (a success resets the count)
        error = error or "SaslAuthenticationFailedError"
        self.auth_refusals += 1
        if self.auth_refusals >= self.opts.auth_attempts:
            self.fatal = kafka_sink.auth_failure_message(self.cfg.kafka, error, self.auth_refusals)
            log.error("event=kafka_auth_failed action=exit %s", self.fatal)

    def _send(self, batch: Batch) -> None:
        batch.sent_at = self.clock()
        batch.pending = len(batch.messages)
        send = self.producer.send
        for topic, key, value in batch.messages:
            try:
                fut = send(topic, value=value, key=key)
            except Exception as e:  # metadata timeout, producer closed
                batch.errors.append(e)
                batch.pending -= 1
                continue
            fut.add_callback(batch.ok)
            fut.add_errback(batch.err)

    def _count_sent(self, messages: list) -> None:
        counts: collections.Counter = collections.Counter()
        for topic, _, value in messages:
            counts[topic] += _records_in(value)
        for topic, c in counts.items():
            self.metrics.sent.labels(topic).inc(c)
            self.sent_total += c
        self.metrics.last_send.set(time.time())

    def enqueue(self, batch: Batch) -> None:
        self.batches.append(batch)
        if batch.done:
            return
        if self.mode == DIRECT and self.producer is not None:
            self._send(batch)
        elif any(b.held for b in self.batches if b is not batch):
            batch.held = True  # behind a held batch: keep the order
        else:
            self._spill_one(batch)

    def _spill_one(self, batch: Batch) -> bool:
        """Spill a batch, or hold it (in memory) when the buffer has no room for it."""
        if batch.held and not self.disk.retry_due("buffer"):
            return False
        if batch.held and self.buffer.disk_bytes >= self.full_at_bytes:
            return False  # refused for room before, and no room was freed since
        try:
            self.buffer.append(batch.messages)
        except BufferFull:
            self.full_at_bytes = self.buffer.disk_bytes
            if not self.buffer_full_logged:
                log.error("event=buffer_full buffer_bytes=%d limit=%d action=pause_reading "
                          "(nothing is dropped: the spool keeps the data until Kafka is back)",
                          self.buffer.disk_bytes, self.opts.buffer_max_bytes)
                self.buffer_full_logged = True
            batch.held = True
            return False
        except OSError as e:
            self.disk.failed("buffer", self.buffer.directory, e)
            batch.held = True
            return False
        self.disk.ok("buffer")
        batch.held = False
        batch.done = True
        self.metrics.buffer_bytes.set(self.buffer.pending_bytes)
        return True

    def spill_all(self, why: str) -> None:
        """Kafka is failing: move every unfinished batch, in order, to the disk buffer;
        from the first one that does not fit on, they are held, so the order stays."""
        self.metrics.kafka_spills.labels(why).inc()
        self._drop_fatal_producer()
        n = 0
        blocked = False
        for b in self.batches:
            if not b.done:
                if blocked or not self._spill_one(b):
                    blocked = b.held = True
                n += 1
        if self.mode != SPILL:
            log.warning("event=kafka_unavailable reason=%s action=spill_to_disk batches=%d "
                        "buffer_bytes=%d", why, n, self.buffer.pending_bytes)
        self.mode = SPILL
        self.next_attempt = self.clock() + self.backoff_s

    def _drop_fatal_producer(self) -> None:
        """librdkafka gave up on the producer (``RdKafkaProducer.fatal``): let it go, so
        that the next attempt connects a new one instead of failing forever."""
        if getattr(self.producer, "fatal", ""):
            log.error("event=kafka_producer_replaced error=%s", self.producer.fatal)
            with contextlib.suppress(Exception):
                self.producer.close(timeout=0)
            self.producer = None

    def collect(self) -> None:
        """Retire finished batches from the head; the newest retired snapshot is safe."""
        while self.batches:
            head = self.batches[0]
            if head.held:
                return  # neither sent nor spilled yet
            if not head.done:
                if not head.resolved:
                    if self.clock() - head.sent_at > self.opts.stall_s:
                        self.spill_all("no_ack_within_stall_s")
                    return
                if head.errors:
                    self.spill_all(type(head.errors[0]).__name__)
                    continue
                head.done = True
                self._count_sent(head.messages)
            self.batches.popleft()
            if head.snapshot is not None:
                self.committed = head.snapshot
                self.dirty = True

    def drain(self) -> None:
        """In spill mode: send the buffer's batches in order, backing off on failure."""
        if self.mode != SPILL:
            return
        now = self.clock()
        if self.draining is not None:
            if not self.draining.resolved:
                if now - self.draining.sent_at > self.opts.stall_s * 3:
                    self.draining.errors.append(TimeoutError("drain batch not acknowledged"))
                else:
                    return
            if self.draining.errors:
                log.warning("event=buffer_drain_failed error=%s retry_in_s=%.1f",
                            type(self.draining.errors[0]).__name__, self.backoff_s)
                self._drop_fatal_producer()
                self.next_attempt = now + self.backoff_s
                self.backoff_s = min(self.backoff_s * 2, 30.0)
                self.draining = None
                return
            self._count_sent(self.draining.messages)
            self.buffer.advance()
            self.draining = None
            self.backoff_s = 0.5
            self.dirty = True
            self.metrics.buffer_bytes.set(self.buffer.pending_bytes)
        if now < self.next_attempt:
            return
        if not self.connect():
            self.next_attempt = now + self.backoff_s
            self.backoff_s = min(self.backoff_s * 2, 30.0)
            return
        msgs = self.buffer.peek()
        if msgs is None:
            if self.mode == SPILL:
                log.info("event=kafka_recovered action=direct_send held_batches=%d",
                         sum(1 for b in self.batches if b.held))
            self.mode = DIRECT
            self.buffer_full_logged = False
            self._send_held()
            return
        self.draining = Batch(msgs, None)
        self._send(self.draining)

    def _send_held(self) -> None:
        """The buffer is drained and Kafka answers: send held batches, in order, directly
        (no disk needed, so a full disk does not stop forwarding)."""
        for i, b in enumerate(self.batches):
            if b.held:
                fresh = Batch(b.messages, b.snapshot)  # no callbacks of an older send
                self.batches[i] = fresh
                self._send(fresh)

    def retry_held(self) -> None:
        """Spill held batches (in order) once the buffer has room and the disk space."""
        if self.mode != SPILL:
            return
        for b in self.batches:
            if b.held and not self._spill_one(b):
                return

