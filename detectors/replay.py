"""``ncclwatch replay``: a recorded run, again, from Kafka or files, into detectors, files or Kafka.

Sources
    ``--topic NAME`` (repeatable), bounded by ``--since``/``--until`` on the Kafka
    message timestamps (``KafkaConsumer.offsets_for_times``) or by ``--offsets
    [TOPIC:]PARTITION:START-END`` (half-open); or ``--files PATH`` (repeatable):
    anything :mod:`ncclwatch.ingest.recording` reads (a spool directory or file, NCCL
    Inspector JSON logs, a recorded run, a ``.tar.gz`` of any of them), with
    ``--training-log`` (repeatable, globs) for the job's throughput, bounded by
    ``--since``/``--until`` on the record times. Inspector ops and training-log
    throughput become contract records (what ``--out`` and ``--to-kafka`` write).
Destinations (exactly one)
    ``--detect``: a fresh in-process detector run, the same code as ``ncclwatch watch``
    (one line per anomaly, ``--events-out FILE``); ``--out FILE``: the records as JSON
    lines, byte for byte as they were; ``--to-topic NAME``: every record into one
    topic; ``--to-kafka``: each record into the topic of its kind (``[topics]`` names,
    with ``--topic-prefix``).
Writing into the live topics (the ``[topics]`` names) is refused unless
``--into-live`` is given. Records go out in time order at ``--speed`` N× the speed
they were written (0, the default: as fast as possible); Kafka message timestamps are
kept (from files: the record's own time), so a replayed topic can be replayed again
by time. A progress bar goes to stderr when it is a terminal.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import math
import re
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from ncclwatch.detectors.messages import message_lines
from ncclwatch.detectors.playback import EventsFile, Pacer
from ncclwatch.ingest import recording
from ncclwatch.ingest.external_sort import ExternalSort
from ncclwatch.ingest.parse import parse as fast_parse
from ncclwatch.ingest.parse import parse_record
from ncclwatch.ingest.recording import (
    Options,
    ReadStats,
    RecordingError,
    SortedRecording,
    add_source_arguments,
    order_key,
    record_time_ns,
)

from ncclwatch import progress, redact, routing
from ncclwatch.config import Config
from ncclwatch.records import Quarantined

# Kafka consumer settings that avoid kafka-python 3's slow defaults (no group: assign()).
_CONSUMER = {
    "enable_auto_commit": False,
    "consumer_timeout_ms": 1000,
    "max_partition_fetch_bytes": 4 << 20,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("source (one kind)")
    src.add_argument("--topic", action="append", default=[], metavar="NAME", help="read this Kafka topic")
    src.add_argument(
        "--files",
        action="append",
        default=[],
        metavar="PATH",
        help="read a recording: a spool, NCCL Inspector JSON logs, a recorded run, a .tar.gz of one",
    )
    add_source_arguments(src)
    rng = p.add_argument_group("range")
    rng.add_argument("--since", metavar="TIME", help="from this time on (ISO 8601, or epoch s/ms/us/ns)")
    rng.add_argument("--until", metavar="TIME", help="up to, not including, this time")
    rng.add_argument(
        "--offsets",
        action="append",
        default=[],
        metavar="[TOPIC:]P:START-END",
        help="offsets START (included) to END (excluded) of partition P; END may be empty "
        "(to the end); partitions not named are not read",
    )
    dst = p.add_argument_group("destination (exactly one)")
    dst.add_argument("--detect", action="store_true", help="run the detectors in-process, print anomalies")
    dst.add_argument("--events-out", metavar="FILE", help="with --detect: anomaly events as JSON lines")
    dst.add_argument("--out", metavar="FILE", help="write the records as JSON lines (.gz: compressed)")
    dst.add_argument("--to-topic", metavar="NAME", help="publish every record to this topic")
    dst.add_argument("--to-kafka", action="store_true", help="publish each record to the topic of its kind")
    dst.add_argument("--topic-prefix", default="", help="with --to-kafka: prefix the [topics] names")
    dst.add_argument("--into-live", action="store_true", help="allow publishing into the live [topics] topics")
    p.add_argument(
        "--speed",
        type=float,
        default=0.0,
        metavar="N",
        help="N× real time (0: as fast as possible)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")


# --- times and ranges ----------------------------------------------------------------------


def parse_time_ns(text: str) -> int:
    """A point in time as ns since the epoch: ISO 8601, or an epoch number in s/ms/us/ns.

    The unit of a bare number is told by its size (a 2020s date has 10, 13, 16 or 19
    digits); naive ISO times are local time, as a person types them.

    >>> parse_time_ns("1700000000"), parse_time_ns("1700000000123")
    (1700000000000000000, 1700000000123000000)
    >>> parse_time_ns("2023-11-14T22:13:20Z")
    1700000000000000000
    >>> parse_time_ns("1700000000.5")
    1700000000500000000
    """
    t = text.strip()
    if re.fullmatch(r"\d+", t):
        n = int(t)
        for limit, scale in ((10**11, 10**9), (10**14, 10**6), (10**17, 10**3)):
            if n < limit:
                return n * scale
        return n
    if re.fullmatch(r"\d+\.\d*", t):
        whole, frac = t.split(".")
        return int(whole) * 10**9 + int((frac + "0" * 9)[:9])
    try:
        dt = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (ISO 8601 or epoch seconds/ms/us/ns)") from None
    return int(dt.timestamp()) * 10**9 + dt.microsecond * 1000


@dataclass(frozen=True)
class OffsetRange:
    topic: str | None
    partition: int
    start: int
    end: int | None


def parse_offsets(text: str) -> OffsetRange:
    """``[TOPIC:]P:START-END``, END optional.

    >>> parse_offsets("2:100-250")
    OffsetRange(topic=None, partition=2, start=100, end=250)
    >>> parse_offsets("nccl.windows:0:7-")
    OffsetRange(topic='nccl.windows', partition=0, start=7, end=None)
    """
    m = re.fullmatch(r"(?:(?P<topic>.+):)?(?P<p>\d+):(?P<start>\d+)-(?P<end>\d*)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not an offset range: {text!r} (want [TOPIC:]P:START-END)")
    end = int(m.group("end")) if m.group("end") else None
    return OffsetRange(m.group("topic"), int(m.group("p")), int(m.group("start")), end)


# --- what moves: one item per message or line --------------------------------------------


@dataclass(frozen=True, slots=True)
class Item:
    """One record on its way: the bytes as they were, and where and when it was."""

    raw: bytes
    time_ns: int  # record time (files) or Kafka timestamp (topics), for pacing and ordering
    timestamp_ms: int  # the Kafka message timestamp to write
    key: bytes | None
    origin: tuple  # (topic's index, partition, offset, line): the sort tie-breaker of topics
    record: Any = None  # the parsed record, where it was parsed already (files)

    def parsed(self) -> Any:
        return self.record if self.record is not None else parse_record(self.raw)


@contextmanager
def read_topics(
    cfg: Config,
    topics: list[str],
    since_ns: int | None,
    until_ns: int | None,
    offsets: list[OffsetRange],
    *,
    by_record_time: bool = False,
) -> Iterator[ExternalSort]:
    """Every message of the topics in the range, sorted in bounded memory
    (:class:`ExternalSort`, like a recording on disk): by (timestamp, topic, partition,
    offset), or with ``by_record_time`` the valid records by record time first (what
    detectors want; items then carry their parsed record).

    ``offsets_for_times`` finds, per partition, the first offset whose timestamp is at or
    after a time; messages between the two found offsets are read and then filtered by
    timestamp again, so even a partition whose timestamps go back and forth yields only
    messages inside the range (though one that goes back past ``until`` is cut there).
    """
    from kafka import KafkaConsumer, TopicPartition

    names = sorted(set(topics))  # the topic's index in the sort key: its name's order
    # Key: [record time, kind,] timestamp, topic, partition, offset, line in the message.
    widths = (20, 1) * by_record_time + (20, 4, 6, 19, 6)
    sorter = ExternalSort(widths, encode=_encode_item, decode=_timed_item if by_record_time else _item,
                          run_records=recording.SORT_RUN_RECORDS,
                          max_open_runs=recording.MAX_OPEN_RUNS)
    consumer = KafkaConsumer(**cfg.kafka.client_kwargs(), **_CONSUMER)
    with sorter:
        try:
            tps = []
            for topic in topics:
                parts = _partitions(consumer, topic)
                if parts is None:
                    raise SystemExit(f"ncclwatch replay: no topic {topic!r}")
                tps += [TopicPartition(topic, p) for p in sorted(parts)]
            begin = consumer.beginning_offsets(tps)
            end = consumer.end_offsets(tps)
            bounds: dict[Any, tuple[int, int]] = {}
            if offsets:
                for r in offsets:
                    for tp in tps:
                        if tp.partition == r.partition and r.topic in (None, tp.topic):
                            stop = end[tp] if r.end is None else min(r.end, end[tp])
                            bounds[tp] = (max(r.start, begin[tp]), stop)
            else:
                lo = _offsets_at(consumer, tps, since_ns, begin, end) if since_ns is not None else begin
                hi = _offsets_at(consumer, tps, until_ns, end, end) if until_ns is not None else end
                bounds = {tp: (lo[tp], hi[tp]) for tp in tps}
            # Kafka timestamps are ms: [since, until) in ns is [ceil(since), ceil(until)) in ms
            since_ms = math.ceil(since_ns / 10**6) if since_ns is not None else -(1 << 62)
            until_ms = math.ceil(until_ns / 10**6) if until_ns is not None else 1 << 62
            for tp, (start, stop) in bounds.items():
                if start >= stop:
                    continue
                ti = names.index(tp.topic)
                consumer.assign([tp])
                consumer.seek(tp, start)
                while consumer.position(tp) < stop:
                    batch = consumer.poll(timeout_ms=1000, max_records=5000)
                    if not batch and consumer.position(tp) < stop:
                        # offsets of aborted transactions or compacted away: nothing more comes
                        if consumer.position(tp) >= end[tp]:
                            break
                        continue
                    for msg in batch.get(tp, []):
                        if msg.offset >= stop:
                            break
                        if not offsets and not (since_ms <= msg.timestamp < until_ms):
                            continue
                        # a message may pack several records (JSON Lines): one item each
                        for i, line in enumerate(message_lines(msg.value or b"")):
                            origin = (ti, tp.partition, msg.offset, i)
                            where = (msg.timestamp + _SHIFT, *origin)
                            if not by_record_time:
                                sorter.add(where, Item(line, msg.timestamp * 10**6, msg.timestamp, msg.key, origin))
                                continue
                            rec = fast_parse(line)
                            if type(rec) is Quarantined:
                                continue
                            t, kind = order_key(rec)
                            sorter.add((t + _SHIFT, kind, *where),
                                       Item(line, t, msg.timestamp, msg.key, origin, rec))
        finally:
            consumer.close()
        yield sorter


_SHIFT = 1 << 63  # times may be negative; sort keys may not


def _encode_item(it: Item) -> bytes:
    # What the sort key does not hold: the timestamp, the message key as hex (any bytes;
    # "-": none), the line last (it has no newline). The origin was for sorting only.
    key = b"-" if it.key is None else it.key.hex().encode()
    return b"%d %b %b" % (it.timestamp_ms, key, it.raw)


def _item(line: bytes) -> Item:
    ts_ms, key, raw = line.split(b" ", 2)
    t = int(ts_ms)
    return Item(raw, t * 10**6, t, None if key == b"-" else bytes.fromhex(key.decode()), ())


def _timed_item(line: bytes) -> Item:
    it = _item(line)
    rec = fast_parse(it.raw)
    return Item(it.raw, record_time_ns(rec), it.timestamp_ms, it.key, (), rec)


def _partitions(consumer: Any, topic: str) -> set[int] | None:
    deadline = time.monotonic() + 10
    while True:
        parts = consumer.partitions_for_topic(topic)
        if parts or time.monotonic() > deadline:
            return parts
        time.sleep(0.2)


def _offsets_at(consumer: Any, tps: list, t_ns: int, default: dict, end: dict) -> dict:
    """Per partition, the first offset whose timestamp is >= t_ns (ms resolution)."""
    t_ms = math.ceil(t_ns / 10**6)
    found = consumer.offsets_for_times({tp: t_ms for tp in tps})
    return {tp: (found[tp].offset if found.get(tp) is not None else end[tp]) for tp in tps}


def read_files(
    paths: list[str],
    since_ns: int | None,
    until_ns: int | None,
    stats: ReadStats,
    options: Options | None = None,
    *,
    fast: bool = False,
) -> SortedRecording:
    """The records of the recordings whose record time is in the range, in time order
    and bounded memory (enter it to read; :class:`SortedRecording`; ``fast``: records
    may be the parser's structs, enough to route and copy them).

    Lines that are not valid records are left out and counted: there is nothing to
    order them by, and no destination wants them.
    """

    def in_range(rec: Any) -> bool:
        t = record_time_ns(rec)
        return (since_ns is None or t >= since_ns) and (until_ns is None or t < until_ns)

    keep = None if since_ns is None and until_ns is None else in_range
    return SortedRecording(paths, stats, options, keep=keep, fast=fast)


def file_items(recording: SortedRecording) -> Iterator[Item]:
    """A recording's records as items: Kafka timestamps are the record times."""
    for _, _, raw, rec in recording:
        t = record_time_ns(rec)
        yield Item(raw, t, t // 10**6, None, (), rec)


# --- destinations --------------------------------------------------------------------------


def live_topics(cfg: Config) -> set[str]:
    t = cfg.topics
    return {t.ops, t.windows, t.throughput, t.anomalies, t.quarantine, t.dead_letter}


def topic_for(cfg: Config, record: Any, prefix: str) -> str:
    """The topic a record of this kind lives in (``[topics]`` names, prefixed)."""
    return prefix + routing.topic_for(cfg.topics, record.KIND)


def run(args: argparse.Namespace, cfg: Config, *, out: TextIO | None = None) -> int:
    out = out or sys.stdout

    def fail(msg: str) -> int:
        print(f"ncclwatch replay: {msg}", file=sys.stderr)
        return 2

    if bool(args.topic) == bool(args.files):
        return fail("give either --topic or --files")
    dests = [args.detect, bool(args.out), bool(args.to_topic), args.to_kafka]
    if sum(dests) != 1:
        return fail("give exactly one of --detect, --out, --to-topic, --to-kafka")
    if args.offsets and (args.files or args.since or args.until):
        return fail("--offsets is for topics and excludes --since/--until")
    if args.topic and (args.training_log or args.job):
        return fail("--training-log and --job are for --files")
    try:
        since_ns = parse_time_ns(args.since) if args.since else None
        until_ns = parse_time_ns(args.until) if args.until else None
        offsets = [parse_offsets(o) for o in args.offsets]
    except argparse.ArgumentTypeError as e:
        return fail(str(e))
    if args.to_topic or args.to_kafka:
        live = live_topics(cfg)
        targets = {args.to_topic} if args.to_topic else {args.topic_prefix + t for t in live}
        # with --to-kafka the real targets depend on the records; every kind's topic is checked
        hit = sorted(targets & live)
        if hit and not args.into_live:
            return fail(f"refusing to write into live topic(s) {', '.join(hit)}: give --into-live to mean it")
        if args.to_topic and args.to_topic in args.topic:
            return fail("refusing to replay a topic into itself")

    from kafka.errors import KafkaError

    try:
        n = _run(args, cfg, out, since_ns, until_ns, offsets)
    except (KafkaError, NotAcknowledged) as e:  # a broker down or failing: say so, no traceback
        from ncclwatch.ingest.kafka_sink import describe

        # the client's message may name the brokers: redacted, as in every log line
        why = redact.install_for(cfg).redact(f"{type(e).__name__}: {e}")
        print(f"ncclwatch replay: Kafka ({describe(cfg.kafka)}): {why}", file=sys.stderr)
        return 1
    if n < 0:
        return 2
    print(f"replayed {n} record(s)", file=sys.stderr)
    return 0


class NotAcknowledged(RuntimeError):
    """Kafka did not acknowledge what ``replay`` published, within the time allowed."""


def _run(args: argparse.Namespace, cfg: Config, out: TextIO, since_ns: int | None, until_ns: int | None,
         offsets: list[OffsetRange]) -> int:
    """Replay as the arguments say; how many records (-1: an error, already said)."""
    with ExitStack() as stack:
        if args.topic:
            items = stack.enter_context(
                read_topics(cfg, args.topic, since_ns, until_ns, offsets, by_record_time=args.detect))
            source: Iterable[Item] = items
            count, kinds = items.total, (None if items.total else set())  # None: found as they come
        else:
            options = Options.from_config(cfg.ingest, training_logs=args.training_log, job=args.job)
            try:
                recording = stack.enter_context(
                    read_files(args.files, since_ns, until_ns, ReadStats(), options, fast=not args.detect))
            except RecordingError as e:
                print(f"ncclwatch replay: {e}", file=sys.stderr)
                return -1
            for note in recording.stats.notes():
                print(note, file=sys.stderr)
            source, count, kinds = file_items(recording), recording.total, set(recording.kinds)
        bar = progress.bar(count, "replay", enabled=False if args.no_progress else None)
        pacer = Pacer(args.speed)
        with bar:
            if args.detect:
                n = _detect(cfg, source, pacer, bar, args.events_out, out)
            elif args.out:
                n = _to_file(source, args.out, pacer, bar)
            else:
                n = _to_kafka(cfg, source, kinds, pacer, bar, args.to_topic, args.topic_prefix)
        if not args.topic and (note := recording.late_note()):
            print(note, file=sys.stderr)
    return n


def _paced(items: Iterable[Item], pacer: Pacer, bar: Any) -> Iterator[Item]:
    for it in items:
        pacer.wait(it.time_ns)
        yield it
        bar.update(1)


def _detect(
    cfg: Config,
    items: Iterable[Item],
    pacer: Pacer,
    bar: Any,
    events_out: str | None,
    out: TextIO,
) -> int:
    """Run ``items`` (valid records in record-time order, as watch gives them) through
    the detectors."""
    from ncclwatch.detectors.watch import Watch

    events_file = EventsFile(events_out)
    watch = Watch(cfg, out=out, events_file=events_file)
    n = 0
    try:
        for it in _paced(items, pacer, bar):
            watch.feed(it.parsed())
            n += 1
        watch.flush()
    finally:
        events_file.close()
    print(f"{watch.events_total} anomaly event(s)", file=out)
    return n


def _to_file(items: Iterable[Item], path: str, pacer: Pacer, bar: Any) -> int:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.endswith(".gz") else open
    n = 0
    with opener(path, "wb") as f:
        for it in _paced(items, pacer, bar):
            f.write(it.raw + b"\n")
            n += 1
    return n


def _to_kafka(
    cfg: Config,
    items: Iterable[Item],
    kinds: set[str] | None,
    pacer: Pacer,
    bar: Any,
    to_topic: str | None,
    prefix: str,
) -> int:
    """Publish ``items``; ``kinds`` (the record kinds among them; None: not known, each
    kind's topic is made sure of when its first record comes) say which topics must
    exist."""
    from kafka import KafkaProducer

    # Replayed records keep their recording's times: a target created with the broker's
    # time-based retention would lose them at its next check (docs/replay.md).
    from ncclwatch.ingest.kafka_sink import ensure_topics

    if kinds is not None and not kinds:
        return 0
    targets = {to_topic} if to_topic else {prefix + routing.topic_for(cfg.topics, k) for k in kinds or ()}
    ensured = set(targets)
    if targets:
        ensure_topics(cfg.kafka, cfg.topics, sorted(targets), retention_ms=-1)
    producer = KafkaProducer(**cfg.kafka.client_kwargs(), acks="all", linger_ms=20)
    n = 0
    # kafka-python bounds neither its queue nor the wait for a broker that stopped
    # answering: hold at most MAX_UNACKED sends, and wait at most ACK_TIMEOUT_S for one.
    unacked: collections.deque = collections.deque()
    try:
        for it in _paced(items, pacer, bar):
            rec = it.parsed()
            if to_topic:
                topic = to_topic
                key = it.key if it.key is not None or isinstance(rec, Quarantined) else routing.key_for(rec)
            elif isinstance(rec, Quarantined):
                continue  # nothing says which topic it belongs to
            else:
                topic = topic_for(cfg, rec, prefix)
                # windows take the configured key (topics.window_key): republishing a
                # job-keyed recording for the two-stage topology re-keys them
                key = it.key if it.key is not None and rec.KIND != "window" else routing.key_for(rec, cfg.topics)
                if topic not in ensured:
                    ensure_topics(cfg.kafka, cfg.topics, [topic], retention_ms=-1)
                    ensured.add(topic)
            unacked.append(producer.send(topic, key=key, value=it.raw, timestamp_ms=it.timestamp_ms))
            n += 1
            if len(unacked) >= MAX_UNACKED:
                _await_acks(unacked, MAX_UNACKED // 2, n)
        producer.flush(timeout=ACK_TIMEOUT_S)
        _await_acks(unacked, 0, n)
    finally:
        producer.close(timeout=5)
    return n


MAX_UNACKED = 20_000  # records sent and not acknowledged yet, at most
ACK_TIMEOUT_S = 60.0  # the longest wait for one acknowledgement


def _await_acks(unacked: collections.deque, keep: int, sent: int) -> None:
    """Wait until at most ``keep`` sends are unacknowledged (oldest first)."""
    from kafka.errors import KafkaError

    while len(unacked) > keep:
        try:
            unacked[0].get(timeout=ACK_TIMEOUT_S)
        except KafkaError as e:
            done = sent - len(unacked)
            raise NotAcknowledged(
                f"a record was not acknowledged ({type(e).__name__}: {e}); {done} of the {sent} sent so far "
                "were: replay the range again once Kafka answers") from e
        unacked.popleft()
