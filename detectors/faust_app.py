"""``ncclwatch worker``: the detectors as a Faust stream processor over Kafka.

Wiring only; the logic is :class:`~ncclwatch.detectors.stream.StreamCore` (plain
Python, shared with ``watch`` and ``replay``)::

    nccl.windows, job.throughput, nccl.telemetry ──> detect ──> nccl.anomalies
                                    │                     └──> dead-letter topic
                                    └── table "detector-state" (job -> state), changelog-backed

Every input the detectors read is keyed by job and has the same partition count, so
one worker partition holds whole jobs and the table entry of a job lives in the same
partition as its records. The worker does not read ``nccl.ops`` (op records, keyed
``<job>|<comm>``, most of the traffic): the windows summarise them, and the forwarder
publishes drops and plugin stats, keyed by job, on ``nccl.telemetry`` (topic contract v2;
v1 put them on ``nccl.ops`` and the worker re-keyed them through an internal topic).

``--stage keys|jobs`` runs the two detector stages apart (topic contract v3,
``topics.window_key = "comm"``): key workers read ``nccl.windows`` keyed by
communicator and send verdicts and progress marks to ``nccl.verdicts``; job workers
read those with ``job.throughput`` and ``nccl.telemetry``. docs/architecture.md draws
it. Several workers of one stage share its partitions through their consumer group;
:class:`ReadOrder` makes sure none of their messages is skipped around a rebalance.

State and delivery (docs/replay.md has the longer version): the detect agent takes
batches (``--batch-size`` messages or ``--batch-within-s`` seconds), processes them,
publishes the batch's anomaly events and waits for Kafka's acks, then writes each
touched job's state to the table, and only then acknowledges the messages the save
covers (states are saved at most every ``--save-every-s``, longer for states that
take long to build: the messages of batches in between wait for the next save).
Faust flushes the changelog before it commits offsets, so the committed offsets never
pass the saved state; the state carries the last offset it folded in per input
partition, so messages re-read after a crash are skipped if already counted. Events
are published before the state that records them, so a crash in between re-emits an
event (same id, same content) rather than losing it: at-least-once, deduplicate by
``(id, state)``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import ssl
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ncclwatch.detectors import faust_transport
from ncclwatch.detectors.keys import encode_mark, encode_verdict
from ncclwatch.detectors.messages import JOB_KINDS, STAGE_KINDS, TELEMETRY_KINDS, Message
from ncclwatch.detectors.saved import PART_BYTES, StateCodec, state_of
from ncclwatch.detectors.stream import (
    BatchOutcome,
    JobDetectors,
    KeyDetectors,
    StreamCore,
    TimeMerge,
    collect_less_often,
    job_partition,
)

from ncclwatch import progress, routing
from ncclwatch.config import Config, KafkaConfig
from ncclwatch.records import WindowSummary, to_json

log = logging.getLogger(__name__)

DEFAULT_APP_ID = "ncclwatch-detectors"
TABLE_NAME = "detector-state"


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, not {text}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--app-id",
        default=None,
        help=f"Faust app id = consumer group, prefix of its internal topics (default: "
        f"config topics.prefix + {DEFAULT_APP_ID})",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="Prometheus metrics on ADDR:PORT (default: config detector.metrics_port, ADDR "
        "detector.metrics_addr or --metrics-addr; 0: a free port, printed at start; -1: none)",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="Faust's data directory (default: config detector.worker_data_dir; empty: a private "
        "temporary directory removed at exit, as the tables live in memory and in Kafka)",
    )
    p.add_argument(
        "--until-caught-up",
        action="store_true",
        help="drain mode: exit 0 once the consumer group has committed every input partition up "
        "to the end offset it had when the worker started",
    )
    p.add_argument("--batch-size", type=int, default=1000, help="messages per detector batch (default 1000)")
    p.add_argument(
        "--batch-within-s",
        type=float,
        default=0.2,
        help="process a partial batch after this long (default 0.2)",
    )
    p.add_argument(
        "--save-every-s",
        type=float,
        default=1.0,
        help="save touched states at most this often, and no more often than every 5x what "
        "building the last save took (a 16k-GPU job's state is MBs); messages are "
        "acknowledged only once a save covers them (default 1.0; 0: after every batch)",
    )
    p.add_argument(
        "--state-part-bytes",
        type=_positive_int,
        default=PART_BYTES,
        help="a saved state longer than this goes into the table in parts of this size (a "
        "16k-GPU job's state is ~6.7 MB; default %(default)s, under a broker's default 1 MB message)",
    )
    p.add_argument(
        "--stage",
        choices=STAGES,
        default="all",
        help="all: the whole detector on job-keyed windows (topics.window_key = job). With "
        "topics.window_key = comm, one job across many workers: keys: the key stage (windows "
        "-> verdicts, scale it with the job's size), jobs: the job stage (verdicts, "
        "throughput, telemetry -> anomalies). Default all",
    )
    p.add_argument("--loglevel", default="warning", help="Faust log level (default warning)")


STAGES = ("all", "keys", "jobs")
KEY_TABLE_NAME = "key-state"


def table_name(stage: str) -> str:
    return KEY_TABLE_NAME if stage == "keys" else TABLE_NAME


def default_app_id(cfg: Config, stage: str = "all") -> str:
    suffix = "" if stage == "all" else f"-{stage}"
    return cfg.topics.prefix + DEFAULT_APP_ID + suffix


def topic_names(cfg: Config, app_id: str, stage: str = "all") -> dict[str, str]:
    t = cfg.topics
    return {
        "windows": t.windows,
        "verdicts": t.verdicts,
        "throughput": t.throughput,
        "telemetry": t.telemetry,
        "anomalies": t.anomalies,
        "dead_letter": t.dead_letter,
        "changelog": f"{app_id}-{table_name(stage)}-changelog",
    }


def input_keys(stage: str) -> tuple[str, ...]:
    """Which of ``topic_names`` a stage reads (co-partitioned with its changelog)."""
    if stage == "keys":
        return ("windows",)
    if stage == "jobs":
        return ("verdicts", "throughput", "telemetry")
    return ("windows", "throughput", "telemetry")


def check_stage(cfg: Config, stage: str) -> None:
    """Refuse a stage the windows' key does not fit, saying what to change."""
    want = "comm" if stage in ("keys", "jobs") else "job"
    if cfg.topics.window_key != want:
        raise SystemExit(
            f"ncclwatch worker: --stage {stage} needs topics.window_key = \"{want}\" (it is "
            f"\"{cfg.topics.window_key}\"): " + (
                "the key stage reads windows keyed <job>|<comm>" if want == "comm"
                else "the one-stage worker needs a job's windows in one partition; with "
                "windows keyed by communicator run --stage keys and --stage jobs"
            )
        )


def ensure_topics(cfg: Config, app_id: str, stage: str = "all") -> None:
    """Create the worker's topics with matching partition counts, or say what is wrong.

    Faust refuses a table whose changelog's partition count differs from its source
    topics' (PartitionsMismatch) and only creates its own internal topics, with its own
    defaults: so every topic is created here, explicitly, first.
    """
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    names = topic_names(cfg, app_id, stage)
    n = cfg.topics.partitions
    retention = {"retention.ms": str(cfg.topics.retention_ms)}
    used = set(input_keys(stage)) | ({"verdicts"} if stage == "keys" else {"anomalies", "dead_letter"})
    used.add("dead_letter")
    wanted = {name: retention for key, name in names.items() if key in used}
    large = {"max.message.bytes": str(LARGE_MESSAGE_BYTES)}
    if "verdicts" in used:
        wanted[names["verdicts"]] = {**retention, **large}
    wanted[names["changelog"]] = {"cleanup.policy": "compact", **large}
    admin = KafkaAdminClient(**cfg.kafka.client_kwargs())
    try:
        existing = set(admin.list_topics())
        for name, configs in wanted.items():
            if name in existing:
                continue
            topic = NewTopic(name, n, cfg.topics.replication_factor, topic_configs=configs)
            with contextlib.suppress(TopicAlreadyExistsError):  # another worker was first
                admin.create_topics([topic])
        # only the co-partitioned ones must match: outputs may have any count
        must_match = [names[k] for k in (*input_keys(stage), "changelog")]
        for desc in _describe(admin, must_match):
            got = len(desc["partitions"])
            if got == 0:
                raise SystemExit(f"ncclwatch worker: topic {desc['name']} still has no partitions after "
                                 "30 s: the broker is creating it slowly or failed to; start again")
            if got != n:
                raise SystemExit(
                    f"ncclwatch worker: topic {desc['name']} has {got} partitions, config "
                    f"topics.partitions is {n}: the detector inputs and the state changelog "
                    "must be co-partitioned"
                )
    finally:
        admin.close()


def _ensure_topics_or_exit(cfg: Config, app_id: str, stage: str = "all") -> None:
    """``ensure_topics``, ending the worker with one clear line (not a traceback) when
    Kafka cannot be reached or refuses the credentials."""
    from kafka.errors import KafkaError
    from ncclwatch.ingest.kafka_sink import auth_failure_message, describe, watching_auth

    with watching_auth() as w:
        try:
            ensure_topics(cfg, app_id, stage)
        except KafkaError as e:
            if w.seen:
                raise SystemExit(f"ncclwatch worker: {auth_failure_message(cfg.kafka, w.seen, 1)}") from None
            raise SystemExit(f"ncclwatch worker: cannot reach Kafka ({describe(cfg.kafka)}): "
                             f"{type(e).__name__}; check kafka.bootstrap_servers and that the "
                             "brokers are up") from None


def _describe(admin: Any, names: list[str], timeout_s: float = 30.0) -> list[dict]:
    """Topic descriptions once the metadata of freshly created topics has spread (a
    topic another worker is creating has no partitions yet: seen for over 10 s on a
    loaded broker when several workers start at once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        descs = admin.describe_topics(names)
        if all(d.get("partitions") for d in descs) or time.monotonic() > deadline:
            return descs
        time.sleep(0.1)


def broker_credentials(k: KafkaConfig) -> Any:
    """Faust credentials from the kafka section (None for PLAINTEXT)."""
    import faust

    ctx = None
    if k.security_protocol in ("SSL", "SASL_SSL"):
        ctx = ssl.create_default_context(cafile=k.ssl_cafile or None)
        if k.ssl_certfile:
            ctx.load_cert_chain(k.ssl_certfile, k.ssl_keyfile or None, k.ssl_password or None)
    if k.security_protocol.startswith("SASL"):
        return faust.SASLCredentials(
            username=k.sasl_plain_username,
            password=k.sasl_plain_password,
            ssl_context=ctx,
            mechanism=k.sasl_mechanism or "PLAIN",
        )
    if ctx is not None:
        return faust.SSLCredentials(ctx)
    return None


@dataclass
class WorkerStats:
    """Counters the metrics endpoint and the tests read."""

    records: int = 0
    skipped: int = 0
    dead_letters: int = 0
    events: int = 0
    batches: int = 0
    abandoned: int = 0  # batches a rebalance cut through: not saved, read again
    stale: int = 0  # messages fetched before a rebalance, dropped: read again
    out_of_order: int = 0  # messages after a hole or already taken, dropped: see ReadOrder
    seeks: int = 0  # seeks back over a hole
    holes_gone: int = 0  # holes retention made in the broker's log: gone for good


class RecoveryWatch:
    """Whether a table recovery has stopped moving: in recovery, and the changelog
    messages it still needs not fewer for ``stall_s``.

    Faust's recovery waits for ever on a changelog partition that delivers nothing
    (seen once under load: a key worker "in recovery" for 4 minutes, no changelog
    message arriving, and every job stage stalled on its missing progress marks). A
    worker that looks alive and has stopped is worse than one that exits: past the
    bound it exits non-zero, for its supervisor to restart it and the group to
    rebalance.

    >>> watch = RecoveryWatch(stall_s=60.0)
    >>> [watch.stalled(True, 100, now=t) for t in (0.0, 30.0, 59.0)]
    [False, False, False]
    >>> watch.stalled(True, 90, now=70.0), watch.stalled(True, 90, now=125.0)  # it moved at 70
    (False, False)
    >>> watch.stalled(True, 90, now=131.0)
    True
    >>> watch.stalled(False, None, now=500.0), watch.stalled(True, 90, now=501.0)  # a new one
    (False, False)
    """

    def __init__(self, stall_s: float):
        self.stall_s = stall_s
        self._seen: tuple[int | None, float] | None = None  # (remaining, since when)

    def stalled(self, in_recovery: bool, remaining: int | None, now: float) -> bool:
        if not in_recovery:
            self._seen = None
            return False
        seen = self._seen
        if seen is None or (remaining is not None and (seen[0] is None or remaining < seen[0])):
            self._seen = (remaining, now)
            return False
        return now - seen[1] > self.stall_s


class ReadOrder:
    """Per input partition, the next offset the worker must take: it takes every
    partition's messages strictly in order and seeks back over a hole.

    Faust 0.15.3 can skip messages around a rebalance, and so lose them: a seek to the
    committed offsets (how its recovery ends) races its fetcher, which goes on handing
    over what it had fetched and so moves Faust's read offset past the seek; the
    messages the seek brings again are then dropped as already read. Seen in logged
    offsets: a partition kept through a rebalance went on at 1,239 with 523 committed;
    a worker that joined never got 992-1,070 of its new partition. A skipped message is
    neither detected nor acknowledged: verdicts come out wrong and the committed offset
    sticks. So after each rebalance the worker starts this from the committed offsets
    (the saved states skip what they folded in already) and asks :meth:`admit` about
    every message:

    - ``take``: the next one;
    - ``copy``: taken already (a re-delivery after a seek): dropped;
    - ``seek``: a hole before it: dropped; the worker pauses the partition (Faust then
      hands over no more of what it had fetched), and once the partition is
      :meth:`due` seeks it back to :meth:`next_offset` and resumes it;
    - ``wait``: a hole with a seek under way: dropped. A seek that brought nothing
      after ``RESEEK_AFTER_S`` is made again.

    A hole at a partition's end shows no message after it: a partition behind its end
    offset is :meth:`stalled` once no partition brought anything for ``STALL_AFTER_S``,
    and sought back like a hole (seen: the last messages of a partition fetched just
    before a rebalance, dropped as from before it, and never sent again). Only while
    nothing at all comes: a worker with a backlog takes some partitions late, and
    seeking those would drop what Faust holds of them.

    >>> order = ReadOrder()
    >>> order.start({"p": 5, "q": None})
    >>> [order.admit("p", o, now=0.0) for o in (4, 5, 8, 9)]
    ['copy', 'take', 'seek', 'wait']
    >>> order.due(0.1), order.due(0.5)
    ([], ['p'])
    >>> order.seeked("p", now=0.5)
    >>> order.next_offset("p"), [order.admit("p", o, now=0.6) for o in (9, 6, 7, 8)]
    (6, ['wait', 'take', 'take', 'take'])
    >>> order.admit("q", 40, now=0.0)  # nothing committed: the first one starts it
    'take'
    >>> order.admit("p", 12, now=1.0), order.due(2.0)
    ('seek', ['p'])
    >>> order.seeked("p", now=2.0)
    >>> [order.admit("p", 12, now=t) for t in (3.0, 5.0, 5.1)]  # the seek brought nothing
    ['wait', 'seek', 'wait']
    >>> order.start({"p": 5, "q": 7}, now=10.0)
    >>> order.stalled({"p": 9, "q": 7}, now=12.0), order.stalled({"p": 9, "q": 7}, now=15.5)
    ([], ['p'])
    >>> order.due(15.5)  # due at once: nothing of it is in hand
    ['p']
    >>> order.seeked("p", now=15.5)
    >>> order.stalled({"p": 9}, now=18.0), order.stalled({"p": 9}, now=21.0)  # it brought nothing
    ([], ['p'])
    >>> order.start({"p": 5, "q": 7}, now=30.0)
    >>> order.admit("q", 7, now=34.0)
    'take'
    >>> order.stalled({"p": 9, "q": 9}, now=36.0), order.stalled({"p": 9, "q": 9}, now=39.5)
    ([], ['p', 'q'])
    """

    PAUSE_S = 0.3  # between pausing a partition and seeking it: what Faust had in hand goes
    RESEEK_AFTER_S = 2.5
    STALL_AFTER_S = 5.0

    def __init__(self) -> None:
        self._next: dict[Any, int | None] = {}
        self._holes: dict[Any, tuple[bool, float]] = {}  # tp -> (seeked yet, since when)
        self._moved: dict[Any, float] = {}  # tp -> when it last took a message (or started)

    def start(self, offsets: dict[Any, int | None], now: float = 0.0) -> None:
        """Begin each partition at its committed offset (None: at what comes first, where
        the log's start is not known)."""
        self._next = dict(offsets)
        self._holes.clear()
        self._moved = dict.fromkeys(offsets, now)

    def stalled(self, ends: dict[Any, int | None], now: float) -> list[Any]:
        """Partitions behind their end offset in ``ends`` that took nothing for
        ``STALL_AFTER_S``: each becomes a hole, due to be sought back at once."""
        out: list[Any] = []
        if self._moved and now - max(self._moved.values()) < self.STALL_AFTER_S:
            return out  # messages are coming: a hole, if any, shows itself
        for tp, end in ends.items():
            want, hole = self._next.get(tp), self._holes.get(tp)
            if want is None or end is None or want >= end or (hole is not None and not hole[0]):
                continue  # read to its end, or a seek is due already
            since = self._moved.get(tp, now)
            if hole is not None:  # sought back: waits for what the seek brings
                since = max(since, hole[1])
            if now - since >= self.STALL_AFTER_S:
                self._holes[tp] = (False, now - self.PAUSE_S)
                out.append(tp)
        return out

    def next_offset(self, tp: Any) -> int | None:
        return self._next.get(tp)

    def skip_to(self, tp: Any, offset: int) -> None:
        """Go on from ``offset``: the hole is gone from the broker's log (retention)."""
        self._next[tp] = offset

    def admit(self, tp: Any, offset: int, now: float) -> str:
        want = self._next.get(tp)
        if want is None or offset == want:
            self._next[tp] = offset + 1
            self._holes.pop(tp, None)
            self._moved[tp] = now
            return "take"
        if offset < want:
            return "copy"
        hole = self._holes.get(tp)
        if hole is None or (hole[0] and now - hole[1] >= self.RESEEK_AFTER_S):
            self._holes[tp] = (False, now)
            return "seek"
        return "wait"

    def due(self, now: float) -> list[Any]:
        """Partitions paused long enough to be sought back now."""
        return [tp for tp, (seeked, since) in self._holes.items() if not seeked and now - since >= self.PAUSE_S]

    def seeked(self, tp: Any, now: float) -> None:
        if tp in self._holes:
            self._holes[tp] = (True, now)


def highwater(consumer: Any, tp: Any) -> int | None:
    """The end offset of ``tp`` as last fetched; None if unknown, or if ``tp`` was
    revoked meanwhile (aiokafka asserts that it is assigned: a batch in flight during a
    rebalance would crash the worker)."""
    try:
        return consumer.highwater(tp)
    except AssertionError:
        return None


def _faust_tps(tps: Any) -> set[Any]:
    """Faust's own TP type: a message's ``tp`` is aiokafka's (equal, but Faust's
    ``resume_partitions`` asserts its own type)."""
    from faust.types import TP

    return {TP(tp.topic, tp.partition) for tp in tps}


def _message(event: Any) -> Message:
    m = event.message
    return Message(m.topic, m.partition, m.offset, m.key, m.value, int(m.timestamp * 1000))


class Worker:
    """The Faust app and what its agents call; built once per process."""

    def __init__(
        self,
        cfg: Config,
        app_id: str,
        *,
        batch_size: int = 1000,
        batch_within_s: float = 0.2,
        datadir: str | None = None,
        drain: Any = None,
        stage: str = "all",
        save_every_s: float = 1.0,
        state_part_bytes: int = PART_BYTES,
    ):
        import faust

        self.cfg = cfg
        self.app_id = app_id
        self.stage = stage
        self.batch_size = batch_size
        self.batch_within_s = batch_within_s
        self.names = names = topic_names(cfg, app_id, stage)
        self.inputs = {names[k] for k in input_keys(stage)}
        n = cfg.topics.partitions
        self.drain = drain  # a DrainWatch: stop once the inputs are read (--until-caught-up)
        self.app = app = faust.App(
            app_id,
            **({"datadir": datadir} if datadir else {}),
            # Faust's Kafka transport with two fixes (faust_transport.py)
            broker=[f"{faust_transport.SCHEME}://{b}" for b in cfg.kafka.bootstrap_servers.split(",")],
            broker_credentials=broker_credentials(cfg.kafka),
            broker_client_id=cfg.kafka.client_id,
            store="memory://",
            web_enabled=False,
            topic_partitions=n,
            topic_replication_factor=cfg.topics.replication_factor,
            topic_allow_declare=True,
            consumer_auto_offset_reset="earliest",
            # a killed worker's partitions move on after 6 s, not Faust's default 60
            broker_session_timeout=6.0,
            broker_heartbeat_interval=2.0,
            broker_commit_every=batch_size,
            broker_commit_interval=1.0,
            table_standby_replicas=0,
            # A batch is acknowledged only after its state is saved and re-reading is
            # idempotent (offsets in the state), so shutdown and rebalance need not wait
            # for unacknowledged messages: waiting would hang on a crashed batch.
            stream_wait_empty=False,
            producer_acks=-1,
            producer_max_request_size=LARGE_MESSAGE_BYTES,
            consumer_max_fetch_size=LARGE_MESSAGE_BYTES,
        )
        raw = {
            "key_type": bytes,
            "value_type": bytes,
            "key_serializer": "raw",
            "value_serializer": "raw",
        }
        self.detect_in = app.topic(*(names[k] for k in input_keys(stage)), partitions=n, **raw)
        # the key stage's verdicts go where the job stage reads them; the others' events
        self.events_out = app.topic(names["verdicts" if stage == "keys" else "anomalies"], **raw)
        self.dead_out = app.topic(names["dead_letter"], **raw)
        # values are the codec's bytes (JSON, as Faust wrote them before; bytes: "raw"):
        # a large state goes in parts, and the worker encodes it once
        self.table = app.Table(table_name(stage), default=None, partitions=n, key_type=str, value_type=bytes,
                               extra_topic_configs={"max.message.bytes": str(LARGE_MESSAGE_BYTES)})
        self.saved = StateCodec(state_part_bytes)
        merge = TimeMerge(max_hold_s=cfg.detector.merge_max_hold_s)
        if stage == "keys":
            # one time-merge group: the worker reads all its partitions abreast
            self.core = StreamCore(KeyDetectors(cfg.detector), self._load_state, merge,
                                   state_key=KeyDetectors.state_key, merge_group=lambda _: 0,
                                   save_every_s=save_every_s, hold_events=False, encode_state=self.saved.entries)
        else:
            detectors = JobDetectors(cfg.detector, partitions=n, staged=stage == "jobs", idle_wait_s=IDLE_AFTER_S)
            self.core = StreamCore(detectors, self._load_state, merge, save_every_s=save_every_s,
                                   encode_state=self.saved.entries)
        # what each input may carry: anything else there breaks the topic's contract
        self.kinds = {
            names["windows"]: (WindowSummary,),
            names["verdicts"]: STAGE_KINDS,
            names["throughput"]: JOB_KINDS,
            names["telemetry"]: TELEMETRY_KINDS,
        }
        self._read_upto: dict[Any, int] = {}  # detect input partition -> next offset to read
        self._last_read: dict[Any, float] = {}  # input partition -> when it last delivered
        self._pending: dict[tuple[str, int, int], Any] = {}  # held, unacknowledged events
        self.order = ReadOrder()
        self.recovery = RecoveryWatch(RECOVERY_STALL_S)
        self._order_from = -1  # the rebalance count ``order`` was started at
        self._rebalances = 0  # partitions revoked or assigned, so far
        self._batch_began = 0  # ... when the current batch began
        self._settled = False  # partitions assigned, none revoked since
        self._adopted_at = -1  # the rebalance count saved jobs were last adopted at
        self._stream: Any = None
        self._lock = asyncio.Lock()
        self.stats = WorkerStats()
        self.metrics: WorkerMetrics | None = None
        self.crashed: BaseException | None = None
        self.sink: Any = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ncclwatch-alerts")
        # the key stage marks a partition idle only once read to its end, which the
        # consumer knows only for partitions it fetched records from
        ends_of = (names["windows"],) if stage == "keys" else ()
        self.commits = GroupCommits(cfg.kafka.client_kwargs(), app_id, ends_of)
        self.reset()
        self._wire()

    def reset(self) -> None:
        """Forget cached jobs and held messages (at start and on every rebalance)."""
        self.core.forget()
        self._pending.clear()
        self._read_upto.clear()
        self._last_read.clear()

    def _load_state(self, job: str) -> dict | None:
        return self.saved.load(self.table.get, job)

    def _wire(self) -> None:
        app, w = self.app, self

        @app.agent(self.detect_in, name="detect")
        async def detect(stream: Any) -> None:
            async for events in stream.noack_take(w.batch_size, within=w.batch_within_s):
                await w.guarded(w.detect_batch(stream, events))

        @app.timer(0.5)
        async def tick() -> None:
            await w.guarded(w.tick())

        if self.drain is not None:

            @app.timer(1.0)
            async def drain() -> None:
                await w.drain.check()

        @app.on_partitions_revoked.connect
        async def revoked(sender: Any, revoked: Any, **kwargs: Any) -> None:
            # Held messages come again from the committed offsets (ReadOrder seeks back to
            # them where Faust does not); the jobs may move to another worker and are
            # reloaded from the table when they come back.
            w._rebalances += 1
            w._settled = False
            w.reset()

        @app.on_partitions_assigned.connect
        async def assigned(sender: Any, assigned: Any, **kwargs: Any) -> None:
            w._rebalances += 1
            w._settled = True
            w.reset()
            # nothing may pass an input partition that has not been read yet
            for tp in assigned:
                if tp.topic in w.inputs:
                    w.core.merge.expect((tp.topic, tp.partition), w.core.merge_group(tp.partition))
            n = len(assigned)
            print(f"ncclwatch worker {w.app_id}: assigned {n} partition(s)", file=sys.stderr, flush=True)

    async def guarded(self, batch: Any) -> None:
        """Run one batch; a bug stops the whole worker instead of one agent.

        Faust would restart just the crashed agent, with the batch's messages neither
        processed nor acknowledged, so the committed offsets would stick there while
        later batches go on: a worker that looks alive and has stopped. Crashing exits
        the process non-zero; restarted, it resumes from the saved state.
        """
        try:
            await batch
        except Exception as exc:
            log.exception("detector batch failed; stopping the worker")
            if type(exc).__name__ == "MessageSizeTooLargeError":
                log.error("a message was over its topic's max.message.bytes (a topic created before "
                          "ncclwatch set it, or by hand?): raise it to %d with kafka-configs --alter "
                          "--add-config max.message.bytes=%d", LARGE_MESSAGE_BYTES, LARGE_MESSAGE_BYTES)
            self.crashed = exc
            # Faust's shutdown can wait for ever on a producer whose sends failed, deaf to
            # SIGTERM too: a stopped worker that looks alive. Past a grace period, exit.
            timer = threading.Timer(CRASH_EXIT_S, self._exit_after_crash)
            timer.daemon = True  # a worker that does stop in time exits as usual
            timer.start()
            await self.app.crash(exc)
            raise

    def _exit_after_crash(self) -> None:
        print(f"ncclwatch worker {self.app_id}: crashed ({self.crashed!r}) and did not stop within "
              f"{CRASH_EXIT_S:.0f} s; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    def _progress_idle_inputs(self) -> None:
        """An input partition with nothing left on the broker holds nothing back, even
        if it never delivered a message (it was empty, or read before a restart)."""
        consumer = self.app.consumer
        self.commits.refresh()
        for tp in consumer.assignment():
            if tp.topic not in self.inputs:
                continue
            end = self._end(consumer, tp)
            read = max(self._read_upto.get(tp, 0), self.commits.get(tp))
            if end is not None and end <= read:
                self.core.merge.progress((tp.topic, tp.partition), False)

    def _end(self, consumer: Any, tp: Any) -> int | None:
        """The end offset of ``tp``: the consumer knows it once it fetched from it; the
        key stage looks its windows' up besides (a partition it never fetched from,
        empty or read to the end by its previous owner, is idle only if known read)."""
        end = highwater(consumer, tp)
        return self.commits.end(tp) if end is None else end

    def _behind(self, events: list) -> dict[tuple[str, int], bool]:
        """Per input partition in the batch: are there messages on the broker after it?"""
        last: dict[Any, int] = {}
        now = time.monotonic()
        for e in events:
            last[e.message.tp] = e.message.offset
            self._read_upto[e.message.tp] = e.message.offset + 1
            self._last_read[e.message.tp] = now
        consumer = self.app.consumer
        return {(tp.topic, tp.partition): (highwater(consumer, tp) or 0) > off + 1 for tp, off in last.items()}

    async def detect_batch(self, stream: Any, events: list) -> None:
        """Detect what the time merge lets go, publish, save, then acknowledge."""
        t0 = time.perf_counter()
        # From a revocation until the tables are recovered nothing is ours: a state read
        # then may be half recovered, one saved then may land after the new owner
        # recovered. So a batch then is dropped, as is what was fetched before the
        # rebalance (Faust tags messages with the generation they were fetched in), and
        # each partition's messages are taken in order from the committed offsets on
        # (ReadOrder seeks back to what was dropped). Not waited out: an agent that sits
        # on a batch lets its queue fill, Faust's fetcher then blocks putting the next
        # message in it, and the changelog messages the recovery waits for cannot come
        # (seen once under load: a key worker "in recovery" for 4 minutes with no
        # changelog message arriving, and every job stage stalled behind it).
        if not self._ready():
            self.stats.stale += len(events)
            return
        async with self._lock:
            self._stream = stream
            if not self._ready():  # a rebalance began while waiting for the lock
                self.stats.stale += len(events)
                return
            generation = self.app.consumer_generation_id
            fresh = [e for e in events if e.message.generation_id in (None, generation)]
            self.stats.stale += len(events) - len(fresh)
            events = await self._in_order(fresh)
            self._batch_began = self._rebalances
            for e in events:
                m = e.message
                self._pending[(m.topic, m.partition, m.offset)] = e
            out = self.core.handle([_message(e) for e in events], self.kinds, self._behind(events))
            await self._finish(out)
        if self.metrics is not None:
            self.metrics.batch(self, events, out, time.perf_counter() - t0)

    async def _in_order(self, events: list) -> list:
        """The events :class:`ReadOrder` takes; pauses the partitions it finds holes in."""
        if self._order_from != self._rebalances:
            rebalances = self._rebalances
            committed = await self.commits.look_now()
            if rebalances != self._rebalances or not self._ready():
                return []  # another rebalance meanwhile: the next batch starts over
            consumer = self.app.consumer
            owned = [tp for tp in consumer.assignment() if tp.topic in self.inputs]
            start = {tp: committed.get((tp.topic, tp.partition)) for tp in owned}
            never = [tp for tp, offset in start.items() if offset is None]
            if never:  # nothing committed: the group starts at the log's start (earliest)
                start.update(await consumer.earliest_offsets(*never))
            if rebalances != self._rebalances or not self._ready():
                return []
            self.order.start(start, time.monotonic())
            consumer.reading_from(start)  # what no commit may pass unacknowledged
            self._order_from = rebalances
        order, now = self.order, time.monotonic()
        taken, holes, dropped = [], set(), set()
        for e in events:
            m = e.message
            verdict = order.admit(m.tp, m.offset, now)
            if verdict == "take":
                taken.append(e)
            else:
                dropped.add(m.tp)
                if verdict == "seek":
                    holes.add(m.tp)
        self.stats.out_of_order += len(events) - len(taken)
        for tp in dropped:
            # Delivering, if out of order (what Faust had fetched past a hole, or copies
            # after a seek): the time merge must not take it for a stuck input and let
            # its co-partitioned inputs pass it while the seek brings its messages again.
            self.core.merge.touch((tp.topic, tp.partition))
        if holes:
            self.app.consumer.pause_partitions(_faust_tps(holes))
        await self._seek_back()
        return taken

    async def _seek_back(self) -> None:
        """Seek the partitions paused over a hole back to it, and resume them."""
        if self._order_from != self._rebalances:
            return  # a rebalance: Faust resumes every partition, ReadOrder starts over
        now = time.monotonic()
        due = self.order.due(now)
        if not due:
            return
        consumer = self.app.consumer
        rebalances = self._rebalances
        earliest = await consumer.earliest_offsets(*due)
        if rebalances != self._rebalances or not self._ready():
            return  # the partitions may not be ours any more: resumed now, they would
            # deliver into the agent during the new owner's recovery
        seeks = {}
        for tp in due:
            want = self.order.next_offset(tp)
            first = earliest.get(tp)
            if want is not None and first is not None and want < first:
                log.warning("offsets %d..%d of %s[%d] are gone from the broker's log (retention): going on "
                            "from %d", want, first - 1, tp.topic, tp.partition, first)
                self.order.skip_to(tp, first)
                await consumer.skip_gone(tp, want, first - 1)
                self.stats.holes_gone += 1
                want = first
            seeks[tp] = want
            self.order.seeked(tp, now)
        self.stats.seeks += len(seeks)
        log.info("seeking back over holes: %s", {f"{tp.topic}[{tp.partition}]": o for tp, o in seeks.items()})
        await consumer.seek_wait(seeks)
        if rebalances != self._rebalances or not self._ready():
            return
        consumer.resume_partitions(_faust_tps(due))

    async def _send_marks(self) -> list[Any]:
        """The key stage's progress, one message to every partition of the verdicts
        topic: each job stage waits on every windows partition."""
        consumer = self.app.consumer
        now = time.monotonic()
        caught_up = {}
        for tp in consumer.assignment():
            if tp.topic == self.names["windows"]:
                end = self._end(consumer, tp)
                read = max(self._read_upto.get(tp, 0), self.commits.get(tp))
                done = end is not None and end <= read
                quiet = now - self._last_read.setdefault(tp, now) > IDLE_AFTER_S
                caught_up[tp.partition] = done and quiet and not self.core.merge.holds((tp.topic, tp.partition))
        marks = self.core.detectors.marks(caught_up)
        if not marks:
            return []
        value = b"\n".join(encode_mark(m) for m in marks)
        return [await self.events_out.send(key=None, value=value, partition=q)
                for q in range(self.cfg.topics.partitions)]

    async def tick(self) -> None:
        """Let go what the merge held too long; see which inputs are idle; tick alerts;
        the key stage's progress marks."""
        if self.sink is not None:
            self._executor.submit(self.sink.tick)
        self._check_producer()
        self._check_recovery()
        self._progress_idle_inputs()
        if self._ready() and self._order_from == self._rebalances:
            consumer = self.app.consumer
            ends = {tp: self._end(consumer, tp) for tp in consumer.assignment() if tp.topic in self.inputs}
            stalled = self.order.stalled(ends, time.monotonic())
            if stalled:
                log.info("input partitions behind their end, taking nothing: %s",
                         [f"{tp.topic}[{tp.partition}]" for tp in stalled])
                consumer.pause_partitions(_faust_tps(stalled))
        if self._ready() and self.order.due(time.monotonic()):
            async with self._lock:
                await self._seek_back()
        if self.stage != "keys" and self._ready() and self._adopted_at != self._rebalances:
            async with self._lock:
                self._adopt_saved_jobs()
        if self.stage == "keys" and self._stream is None and self._ready():
            async with self._lock:
                futures = await self._send_marks()
                if futures:
                    await asyncio.gather(*futures)
            return
        idle = not self.core.merge.held and not (self.core.save_pending and self.core.save_due())
        if self.stage == "jobs" and self.core.detectors.waiting():
            idle = False  # records wait out IDLE_AFTER_S for key stages that are all idle
        # jobs that ended: nothing newer will move their stream time (a worker that
        # restarted after they did has read nothing at all: no stream, nothing to ack)
        quiet = self.stage != "keys" and self.core.detectors.quiet_due()
        if quiet:
            idle = False
        if (self._stream is None and not quiet) or not self._ready() or (idle and self.stage != "keys"):
            return
        async with self._lock:
            self._batch_began = self._rebalances
            await self._finish(self.core.handle([], self.kinds))

    def _adopt_saved_jobs(self) -> None:
        """After an assignment: load the saved jobs of our partitions that left incidents
        open, so that those of a job that ended before a restart end too (quiet_end_s)."""
        self._adopted_at = self._rebalances
        n = self.cfg.topics.partitions
        ours = {tp.partition for tp in self.app.consumer.assignment() if tp.topic in self.inputs}
        saved = [job for key in list(self.table.keys()) if (job := state_of(key)) is not None]
        adopted = [job for job in saved if (p := job_partition(job, n)) in ours and self.core.adopt_saved(job, p)]
        if adopted:
            log.info("saved jobs with open incidents loaded: %d", len(adopted))

    def _ready(self) -> bool:
        """Partitions assigned, none revoked since, and the tables recovered (Faust's
        recovery reads the changelogs with the same consumer the tick pauses, seeks and
        resumes input partitions on: leave it alone until it is done)."""
        return self._settled and not self.app.rebalancing and not self.app.in_recovery

    def _check_recovery(self) -> None:
        """Stop if the tables' recovery stopped moving (:class:`RecoveryWatch`)."""
        app = self.app
        in_recovery = bool(app.in_recovery)
        remaining = app.tables.recovery.active_remaining_total() if in_recovery else None
        if self.recovery.stalled(in_recovery, remaining, time.monotonic()):
            raise RuntimeError(f"table recovery read no changelog message for {RECOVERY_STALL_S:.0f} s "
                               f"({remaining} still to read): stopping, for a restart to recover afresh")

    def _check_producer(self) -> None:
        """Stop if Faust's producer died: a send that failed (a changelog value over the
        broker's message size, say) crashes only its buffer, and every stream then
        waits on it for ever: a worker that looks alive and has stopped."""
        buffer = getattr(self.app.producer, "buffer", None)
        if buffer is not None and buffer.crashed:
            raise RuntimeError(f"Kafka producer stopped, nothing more can be saved: {buffer.crash_reason!r}")

    async def _finish(self, out: BatchOutcome) -> None:
        """Publish events (waiting for Kafka's acks), save touched jobs, acknowledge."""
        if self.stage == "keys":
            futures = [
                await self.events_out.send(key=key, value=value, timestamp=ts)
                for key, value, ts in pack_verdicts(out.events)
            ]
        else:
            futures = [
                await self.events_out.send(
                    key=routing.key_for(ev), value=to_json(ev).encode(), timestamp=ev.detected_ns / 1e9
                )
                for ev in out.events
            ]
        futures += [
            await self.dead_out.send(key=m.key, value=to_json(q).encode(), timestamp=(m.timestamp_ms or 0) / 1000)
            for m, q in out.dead_letters
        ]
        if self.stage == "keys":
            futures += await self._send_marks()
        if futures:
            await asyncio.gather(*futures)
        if self._rebalances != self._batch_began or self.app.rebalancing:
            # A rebalance while publishing: the new owner of a moved partition may have
            # recovered the table already, so a state written now could land after its
            # own and be what the next owner recovers, older than the offsets it was
            # committed with. Nothing is saved or acknowledged: the batch is read again
            # from the committed offsets (ReadOrder starts over after a rebalance). The
            # codec took the entries built for it as written (which slot holds a state's
            # parts); the rebalance made the core forget every job, and a job's next
            # load from the table sets that right again.
            self.stats.abandoned += 1
            return
        for partition, entries in out.states.values():
            # Not ``table[job] = state``: that takes the partition from the *current*
            # event, and a batch spans partitions. A job's parts (the codec's entries,
            # built in the save) go to its partition.
            for key, value in entries:
                if value is None:  # forgotten, or a part no longer used: compacted away
                    self.table.data.pop(key, None)
                else:
                    self.table.data[key] = value
                self.table.send_changelog(partition, key, value, value_serializer="raw")
        for m in out.done:
            event = self._pending.pop((m.topic, m.partition, m.offset), None)
            if event is not None:
                await self._stream.ack(event)
        s = self.stats
        s.batches += 1
        s.records += out.records
        s.skipped += out.skipped
        s.dead_letters += len(out.dead_letters)
        s.events += len(out.events)
        if self.sink is not None:
            for ev in out.events:
                self._executor.submit(self.sink.handle, ev)


# A windows partition read to the end counts as idle (it holds no job stage back) only
# after this long without a message: an empty partition and one whose next message has
# not arrived yet look alike, and only time tells them apart (Flink's idleness timeout).
IDLE_AFTER_S = 5.0
VERDICTS_PER_MESSAGE = 200  # ~150 KB of small communicators' verdicts
VERDICT_MESSAGE_BYTES = 400_000  # well under Kafka's 1 MB message limit
# The largest message the worker's own topics take (a topic setting; Kafka's default is
# 1 MB): a verdict lists its group's ranks (~1 MB at 50k ranks, one message of its own
# then), and changelogs written before states were saved in parts (detectors/saved.py)
# hold values of a few MB.
LARGE_MESSAGE_BYTES = 16 << 20
CRASH_EXIT_S = 30.0  # a crashed worker that has not stopped by then exits hard
# A table recovery that reads no changelog message for this long has stopped (a large
# job's states are tens of MB: seconds to read, not minutes).
RECOVERY_STALL_S = 180.0


def pack_verdicts(items: list[Any]) -> list[tuple[bytes, bytes, float]]:
    """The key stage's verdicts and marks as messages ``(key, value, timestamp s)``:
    keyed by job, a job's in their order, up to ``VERDICTS_PER_MESSAGE`` lines each.

    >>> from ncclwatch.detectors.keys import KeyVerdict
    >>> def v(job, end):
    ...     return KeyVerdict(job=job, key=("0x1", "AllReduce", "64MiB", "net"), comm_name="",
    ...         window_ns=1, ranks=[], start_ns=end - 1, end_ns=end, observed=1.0, baseline=None,
    ...         effect=0.0, degraded=False, drift=False, was_firing=False, transition=None,
    ...         spread_transition=None, spread_effect=0.0, exec_ns_p50=1, host=None, warm=False,
    ...         baseline_after=None, closed_before=end, rule=(False, 0, None, None),
    ...         spread_rule=(False, 0, None, None))
    >>> [(k, v.count(b"\\n") + 1) for k, v, _ in pack_verdicts([v("a", 5), v("b", 5), v("a", 6)])]
    [(b'a', 2), (b'b', 1)]
    """
    by_job: dict[str, list[Any]] = {}
    for x in items:
        by_job.setdefault(x.job, []).append(x)
    out = []
    for job, xs in by_job.items():
        key = job.encode()
        lines: list[bytes] = []
        size = 0
        for i, x in enumerate(xs):
            line = encode_verdict(x)
            # a verdict lists its group's ranks: ~20 bytes each, 300 KB at 16,384 ranks
            if lines and (len(lines) == VERDICTS_PER_MESSAGE or size + len(line) > VERDICT_MESSAGE_BYTES):
                out.append((key, b"\n".join(lines), xs[i - 1].end_ns / 1e9))
                lines, size = [], 0
            lines.append(line)
            size += len(line) + 1
        out.append((key, b"\n".join(lines), xs[-1].end_ns / 1e9))
    return out


class WorkerMetrics:
    """The detector metrics (shared with ``watch``) plus the worker's own."""

    def __init__(self, cfg: Config, registry: Any = None):
        from ncclwatch.detectors.metrics import DetectorMetrics
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        self.detector = DetectorMetrics(self.registry, max_keys=cfg.detector.max_metric_keys, component="worker")
        r = self.registry
        self.consumer_lag = Gauge(
            "ncclwatch_worker_consumer_lag_messages",
            "Messages on the broker not yet read, per input partition",
            ["topic", "partition"],
            registry=r,
        )
        self.held = Gauge("ncclwatch_worker_held_records", "Records the time merge holds", registry=r)
        self.dead_letters = Counter(
            "ncclwatch_worker_dead_letters_total", "Messages sent to the dead-letter topic", ["reason"], registry=r
        )
        self.skipped = Counter(
            "ncclwatch_worker_reread_skipped_total",
            "Messages read again after a restart that the saved state already held",
            registry=r,
        )
        self.batch_seconds = Histogram(
            "ncclwatch_worker_batch_seconds",
            "Time to process one batch",
            buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0),
            registry=r,
        )

    def batch(self, w: Worker, events: list, out: BatchOutcome, seconds: float) -> None:
        self.batch_seconds.observe(seconds)
        self.held.set(w.core.merge.held)
        self.skipped.inc(out.skipped)
        for _, q in out.dead_letters:
            self.dead_letters.labels(q.reason).inc()
        consumer = w.app.consumer
        last: dict[Any, int] = {}
        for e in events:
            last[e.message.tp] = e.message.offset
        for tp, off in last.items():
            lag = max(0, (highwater(consumer, tp) or 0) - off - 1)
            self.consumer_lag.labels(tp.topic, str(tp.partition)).set(lag)


def _start_metrics(w: Worker, port: int | None) -> None:
    """Serve the worker's metrics on detector.metrics_addr unless the port is negative."""
    from ncclwatch import exposition

    cfg = w.cfg
    if (cfg.detector.metrics_port if port is None else port) < 0:
        return
    w.metrics = WorkerMetrics(cfg)
    if w.stage != "keys":  # the key stage has no anomalies to show
        w.metrics.detector.bind(w.core.detectors)
    server = exposition.serve_configured(w.metrics.registry, cfg.detector, port)
    print(f"metrics on {server.url}", file=sys.stderr, flush=True)


class GroupCommits:
    """The consumer group's committed offsets as the broker has them, looked up off the
    event loop at most once per :meth:`refresh` (the worker's tick, twice a second).

    Faust keeps its own copy in a private attribute; the broker's answer, through
    kafka-python's public admin API, is the same offsets a moment later. Until the first
    answer nothing counts as committed, which only holds the detectors back a little
    longer at start. A failed look keeps the last answer.
    """

    def __init__(self, client_kwargs: dict[str, Any], group: str, ends_of: tuple[str, ...] = ()):
        self._kwargs = client_kwargs
        self._group = group
        self._ends_of = ends_of  # topics whose end offsets to look up too
        self._offsets: Any = None
        self._snapshot: dict[tuple[str, int], int] = {}
        self._ends: dict[tuple[str, int], int] = {}
        self._busy = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ncclwatch-offsets")

    async def look_now(self) -> dict[tuple[str, int], int]:
        """Look the committed offsets up now (after a rebalance) and return them."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self._look)
        return dict(self._snapshot)

    def refresh(self) -> None:
        if not self._busy:
            self._busy = True
            self._executor.submit(self._look)

    def _look(self) -> None:
        from ncclwatch.detectors.drain import KafkaOffsets

        try:
            if self._offsets is None:
                self._offsets = KafkaOffsets(self._kwargs)
            self._snapshot = self._offsets.committed(self._group)
            if self._ends_of:
                self._ends = self._offsets.ends(self._ends_of)
        except Exception as e:  # the broker busy or electing: the next look decides
            log.warning("could not read the group's committed offsets: %s", e)
        finally:
            self._busy = False

    def end(self, tp: Any) -> int | None:
        """The end offset of ``tp`` as last looked up (topics ``ends_of`` only)."""
        return self._ends.get((tp.topic, tp.partition))

    def get(self, tp: Any) -> int:
        """The next offset the group will read from ``tp`` (0: none committed, or not known yet)."""
        return self._snapshot.get((tp.topic, tp.partition), 0)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        if self._offsets is not None:
            self._offsets.close()


class DrainWatch:
    """``--until-caught-up``: looks at the group's committed offsets once a second (off the
    event loop) and stops the worker as a SIGTERM would once they reach the end offsets
    seen at start (:mod:`~ncclwatch.detectors.drain`); a bar on a terminal shows the rest."""

    def __init__(self, cfg: Config, app_id: str, stage: str = "all"):
        from ncclwatch.detectors.drain import Drain, KafkaOffsets

        names = topic_names(cfg, app_id, stage)
        self.app_id = app_id
        self.offsets = KafkaOffsets(cfg.kafka.client_kwargs())
        self.drain = Drain(self.offsets.ends([names[k] for k in input_keys(stage)]))
        total = self.drain.remaining(self.offsets.committed(app_id))
        self.bar = progress.bar(total, f"worker {app_id} catching up", unit="msg")
        self.done = False

    def _show(self, remaining: int) -> None:
        self.bar.n = max(0, self.bar.total - remaining)
        self.bar.refresh()

    async def check(self) -> None:
        from ncclwatch.detectors.drain import drain_check

        if self.done:
            return
        loop = asyncio.get_running_loop()
        try:
            done = await loop.run_in_executor(None, drain_check, self.offsets, self.drain, self.app_id, self._show)
        except Exception as e:  # Kafka busy or electing: the next look decides
            log.warning("until-caught-up: could not read offsets: %s", e)
            return
        if done:
            self.done = True
            self.bar.close()
            print(f"ncclwatch worker {self.app_id}: caught up with {len(self.drain.targets)} input "
                  "partition(s); stopping", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)  # Faust's own graceful stop: commit, flush, leave

    def close(self) -> None:
        self.bar.close()
        self.offsets.close()


def run(args: argparse.Namespace, cfg: Config) -> int:
    import faust

    stage = getattr(args, "stage", "all")
    check_stage(cfg, stage)
    app_id = args.app_id or default_app_id(cfg, stage)
    args.app_id = app_id
    _ensure_topics_or_exit(cfg, app_id, stage)
    datadir = args.data_dir if args.data_dir is not None else cfg.detector.worker_data_dir
    scratch = None
    if not datadir:
        # nothing there has to outlive the process (memory:// tables, recovered from Kafka)
        scratch = tempfile.TemporaryDirectory(prefix=f"ncclwatch-worker-{app_id}-")
        datadir = scratch.name
    drain = DrainWatch(cfg, app_id, stage) if args.until_caught_up else None
    w = Worker(cfg, app_id, batch_size=args.batch_size, batch_within_s=args.batch_within_s, datadir=datadir,
               drain=drain, stage=stage, save_every_s=args.save_every_s,
               state_part_bytes=args.state_part_bytes)
    _start_metrics(w, args.metrics_port)
    if cfg.alerting.alertmanager_url:
        from ncclwatch.alerting.sink import AlertSink

        w.sink = AlertSink.from_config(cfg.alerting)
    collect_less_often()
    worker = faust.Worker(w.app, loglevel=args.loglevel.upper(), quiet=True, redirect_stdouts=False)
    worker.spinner = None  # it writes terminal escapes even into pipes
    try:
        worker.execute_from_commandline()
    except SystemExit as e:
        return 1 if w.crashed else int(e.code or 0)
    finally:
        st = w.stats
        print(
            f"ncclwatch worker {w.app_id}: {st.records} records, {st.events} events, "
            f"{st.dead_letters} dead letters, {st.skipped} re-read and skipped, "
            f"{w.core.merge.forced} let go by the time merge before their time, "
            f"{st.abandoned} batches cut by a rebalance, {st.stale} messages from before one, "
            f"{st.seeks} seeks back over a hole ({st.out_of_order} messages dropped out of order, "
            f"{st.holes_gone} holes gone from the log)"
            + (f", {w.core.detectors.late_verdicts()} verdicts late" if stage == "jobs" else ""),
            file=sys.stderr,
            flush=True,
        )
        w._executor.shutdown(wait=True)
        w.commits.close()
        if w.sink is not None:
            w.sink.close()
        if drain is not None:
            drain.close()
        if scratch is not None:
            scratch.cleanup()
    return 0
