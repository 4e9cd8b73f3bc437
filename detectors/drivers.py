"""What the three drivers (`watch`, `worker`, `replay`) share, so they cannot disagree.

The detector library (:mod:`ncclwatch.detectors.pipeline`) does the thinking; a driver
only moves records in and anomaly events out. Everything here is plain Python without
Kafka or Faust, so it is tested directly:

- :class:`JobDetectors`: one ``Pipeline`` per job. A job is the unit of state in the
  Faust worker (its table is keyed by job), so the local drivers split state the same
  way and both give the same events for the same input.
- :class:`StreamCore`: the worker's logic for a batch of Kafka messages (decode,
  dead-letter, skip what the saved state has already seen, detect, snapshot).
- :func:`format_event`: the one line a person reads per firing or resolved anomaly.
- :class:`Pacer`: replay at N× the speed the records were written.
- :func:`read_recording` (from :mod:`ncclwatch.ingest.recording`, where every command
  that replays reads its sources): a recording as records in time order.

>>> record_time_ns(ThroughputRecord(job="j", host="h", rank=0, ts_ns=7, step=1,
...                                 tflops_per_gpu=1.0, tokens_per_s=None, source="api"))
7
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ncclwatch.ingest.parse import parse_record
from ncclwatch.ingest.recording import (  # noqa: F401 (re-exported: the drivers' vocabulary)
    KIND_ORDER,
    ReadStats,
    iter_recording_lines,
    opened_recording,
    order_key,
    read_recording,
    record_time_ns,
)

from ncclwatch import private
from ncclwatch.config import DetectorConfig
from ncclwatch.describe import where_of
from ncclwatch.records import (
    AnomalyEvent,
    DropRecord,
    PluginStats,
    Quarantined,
    ThroughputRecord,
    WindowSummary,
    from_json,
    to_dict,
    to_json,
)

log = logging.getLogger(__name__)

STATE_VERSION = 1


def job_partition(job: str, partitions: int) -> int:
    """The partition Kafka's default partitioner (murmur2, as the Java client, kafka-python
    and aiokafka) gives a record keyed by ``job``.

    >>> [job_partition(j, 4) for j in ("llm-7", "job-a")] == [job_partition(j, 4) for j in ("llm-7", "job-a")]
    True
    """
    if partitions <= 1:
        return 0
    from kafka.partitioner.default import murmur2

    return (murmur2(job.encode("utf-8")) & 0x7FFFFFFF) % partitions


def instant_key(record: Any) -> tuple:
    """The order of a job's records of one instant, whoever published them first."""
    kind = record.KIND
    if kind == "window":
        r = record
        return (0, r.comm, r.op, r.size_bucket, r.transport, r.rank, r.host, r.start_ns)
    return (KIND_ORDER.get(kind, 3), to_json(record))


# --- per-job pipelines -----------------------------------------------------------------


def load_model(cfg: DetectorConfig) -> Any:
    """The `ncclwatch fit` cold-start model named by ``cfg.model_path``, or None.

    Loaded once and shared by every job's pipeline (a pipeline would load it itself).
    """
    if not cfg.model_path:
        return None
    from ncclwatch.detectors.model import BusbwModel

    return BusbwModel.load(cfg.model_path)


class JobDetectors:
    """One detector pipeline per job, created when the job is first seen.

    A job is the unit of state of the Faust worker (its table is keyed by job, and a
    partition holds whole jobs), so every driver splits state this way: the same
    records then give the same events in ``watch``, ``replay`` and the worker.

    Stream time: every ``tick_s`` of stream time (the largest record time seen) every
    job's pipeline is advanced to it, which is how a job that went silent while others
    kept reporting gets its anomalies ended and, after an hour, is forgotten. Stream
    time is kept per *group* of jobs: the Kafka partition of the job's key. The worker's
    time merge delivers each partition in time order, but partitions apart, so one
    racing ahead while catching up cannot make another's jobs look silent; ``watch``
    groups jobs the same way (``job_partition``), so both couple the same jobs.

    For :class:`~ncclwatch.detectors.metrics.DetectorMetrics` this object looks like a
    single pipeline (``observer``, ``open_anomalies``, ``key_count``, ``last_end_ns``),
    so ``metrics.bind(detectors)`` observes every job, including those added later.

    Parameters
    ----------
    cfg
        The detector section of the configuration.
    model
        The cold-start model (`ncclwatch fit`), shared by every job's pipeline; by
        default the one ``cfg.model_path`` names.
    pipeline_cls
        The pipeline class; injected so this glue can be tested on its own.
    tick_s
        Stream-time interval between ``advance`` calls.
    partitions
        Partitions of the job-keyed topics (``topics.partitions``): the default grouping.
    """

    def __init__(
        self,
        cfg: DetectorConfig,
        *,
        model: Any = None,
        pipeline_cls: Any = None,
        tick_s: float = 1.0,
        partitions: int = 1,
    ):
        if pipeline_cls is None:
            from ncclwatch.detectors.pipeline import Pipeline as pipeline_cls
        self.cfg = cfg
        self.model = model if model is not None else load_model(cfg)
        self.pipeline_cls = pipeline_cls
        self.tick_ns = int(tick_s * 1e9)
        self.partitions = partitions
        self.pipelines: dict[str, Any] = {}
        self.stream_ns: dict[int, int] = {}  # group -> largest record time seen
        self._next_tick_ns: dict[int, int] = {}
        self.group_of: dict[str, int] = {}
        self._held: dict[str, list] = {}  # job -> records of its current instant
        self._held_t: dict[str, int] = {}
        self._observer: Any = None
        self.evicted: list[str] = []  # jobs advance forgot; the worker drains this list

    # -- the Pipeline look-alike for metrics --------------------------------------------

    @property
    def observer(self) -> Any:
        return self._observer

    @observer.setter
    def observer(self, value: Any) -> None:
        self._observer = value
        for p in self.pipelines.values():
            p.observer = value

    def open_anomalies(self) -> list[AnomalyEvent]:
        return [ev for job in sorted(self.pipelines) for ev in self.pipelines[job].open_anomalies()]

    def key_count(self) -> int:
        return sum(p.key_count() for p in self.pipelines.values())

    @property
    def last_end_ns(self) -> int:
        return max((p.last_end_ns for p in self.pipelines.values()), default=-1)

    # -- records in, events out ---------------------------------------------------------

    def pipeline(self, job: str) -> Any:
        p = self.pipelines.get(job)
        if p is None:
            p = self.pipelines[job] = self.pipeline_cls(self.cfg, model=self.model)
            p.observer = self._observer
        return p

    def process(self, record: Any, group: int | None = None, t_ns: int | None = None) -> list[AnomalyEvent]:
        """Detect on one record (``t_ns``: its stream time, if the caller has it).

        ``group`` is the stream-time group (the Kafka partition, in the worker); by
        default the partition the job's key maps to (``partitions``), so a local run
        couples exactly the jobs the worker would.

        Records of one job and one instant are held until the job's next instant and
        then given to its pipeline in a canonical order (``instant_key``): within an
        instant the order records arrive in depends on who published first (one node's
        forwarder, one topic), and the pipeline's decisions can depend on it (which
        key's window confirms an anomaly first, whether a throughput drop is judged
        before or after it). The cost is one instant of delay, at most a window.
        """
        job = record.job
        if group is None:
            group = self.group_of.get(job)
            if group is None:
                group = job_partition(job, self.partitions)
        self.group_of[job] = group
        self.pipeline(job)  # the job exists from its first record on, held or not
        t = record_time_ns(record) if t_ns is None else t_ns
        events: list[AnomalyEvent] = []
        held_t = self._held_t.get(job)
        if held_t is None or t == held_t:
            self._held.setdefault(job, []).append(record)
            self._held_t[job] = t
        elif t > held_t:
            events += self._release(job)
            self._held[job] = [record]
            self._held_t[job] = t
        else:  # later than its instant: nothing to wait for
            events += self.pipeline(job).process(record)
        if t > self.stream_ns.get(group, -1):
            self.stream_ns[group] = t
            if t >= self._next_tick_ns.get(group, -1):
                self._next_tick_ns[group] = t - t % self.tick_ns + self.tick_ns
                events += self.advance(t, group)
        return events

    def _release(self, job: str) -> list[AnomalyEvent]:
        records = self._held.pop(job, [])
        self._held_t.pop(job, None)
        if len(records) > 1:
            records.sort(key=instant_key)
        p = self.pipeline(job)
        return [ev for r in records for ev in p.process(r)]

    def advance(self, now_ns: int, group: int | None = None) -> list[AnomalyEvent]:
        """Advance the pipelines (of one group, or all) to stream time ``now_ns``, after
        letting go their held instants before it; forget the jobs they emptied."""
        events: list[AnomalyEvent] = []
        for job in sorted(set(self.pipelines) | set(self._held)):
            if group is not None and self.group_of.get(job, 0) != group:
                continue
            if self._held_t.get(job, now_ns) < now_ns:
                events += self._release(job)
            p = self.pipelines.get(job)
            if p is None:
                continue
            events += p.advance(now_ns)
            if not p.jobs() and job not in self._held:
                del self.pipelines[job]
                self.group_of.pop(job, None)
                self.evicted.append(job)
        return events

    def flush(self) -> list[AnomalyEvent]:
        """End of input: held instants go, every pipeline closes its incomplete groups."""
        events = [ev for job in sorted(self._held) for ev in self._release(job)]
        return events + [ev for job in sorted(self.pipelines) for ev in self.pipelines[job].flush()]

    # -- state --------------------------------------------------------------------------

    def job_state(self, job: str) -> dict:
        """A job's pipeline state and the records of its held instant (as JSON)."""
        return {
            "pipeline": self.pipeline(job).to_state(),
            "held": [to_dict(r) for r in self._held.get(job, [])],
        }

    def restore_job(self, job: str, state: dict) -> None:
        p = self.pipeline_cls.from_state(self.cfg, state["pipeline"], model=self.model)
        self.pipelines[job] = p
        held = [from_json(d) for d in state.get("held", [])]
        if held:
            self._held[job] = held
            self._held_t[job] = record_time_ns(held[0])
        else:
            self._held.pop(job, None)
            self._held_t.pop(job, None)
        p.observer = self._observer
        if self._observer is not None and hasattr(self._observer, "bind"):
            self._observer.bind(self)  # re-marks the restored job's open anomalies

    def forget(self, job: str | None = None) -> None:
        """Drop cached pipelines (all, or one job's): they are reloaded from saved state."""
        if job is None:
            self.pipelines.clear()
            self._held.clear()
            self._held_t.clear()
            self.stream_ns.clear()
            self._next_tick_ns.clear()
        else:
            self.pipelines.pop(job, None)
            self._held.pop(job, None)
            self._held_t.pop(job, None)

    def to_state(self) -> dict:
        jobs = sorted(set(self.pipelines) | set(self._held))
        return {
            "jobs": {job: self.job_state(job) for job in jobs},
            "stream_ns": {str(g): t for g, t in self.stream_ns.items()},
            "group_of": self.group_of,
        }

    def restore(self, state: dict) -> None:
        self.pipelines = {}
        for job, s in state.get("jobs", {}).items():
            self.restore_job(job, s)
        self.stream_ns = {int(g): t for g, t in state.get("stream_ns", {}).items()}
        self._next_tick_ns = dict(self.stream_ns)
        self.group_of = dict(state.get("group_of", {}))


# --- the one line per anomaly ------------------------------------------------------------


def _clock(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9).strftime("%H:%M:%S")


def _duration(ns: int) -> str:
    s = max(0, round(ns / 1e9))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_event(event: AnomalyEvent) -> str:
    """One line per firing or resolved anomaly, for people watching a terminal.

    >>> ev = AnomalyEvent(id="a1", type="network_path", state="firing", job="llm-7",
    ...     key={"comm": "0x00000000000000ab", "comm_name": "", "op": "AllReduce",
    ...          "size_bucket": "32MiB", "transport": "net"}, host=None, rank=None,
    ...     start_ns=0, end_ns=None, detected_ns=0, baseline_busbw_gbs=18.2,
    ...     observed_busbw_gbs=12.1, effect=0.335, attribution="network",
    ...     throughput_delta=-0.128, severity="critical", evidence={})
    >>> print(format_event(ev))
    FIRING network_path job=llm-7 AllReduce 32MiB over net (comm 0x00000000000000ab):
    busbw 18.2 → 12.1 GB/s (-34%) since ..., throughput -12.8% [critical]
    """
    head = f"{event.state.upper()} {event.type} job={event.job} {where_of(event, whole='(whole job)')}"
    if event.baseline_busbw_gbs is not None and event.observed_busbw_gbs is not None:
        what = f"busbw {event.baseline_busbw_gbs:.1f} → {event.observed_busbw_gbs:.1f} GB/s ({-event.effect:+.0%})"
    else:
        what = f"{event.attribution} loss {event.effect:.0%}"
    if event.state == "firing":
        what += f" since {_clock(event.start_ns)}"
    else:
        end_ns = event.end_ns if event.end_ns is not None else event.detected_ns
        span = f"{_clock(event.start_ns)}–{_clock(end_ns)}"
        what += f", lasted {_duration(end_ns - event.start_ns)} ({span})"
    if event.throughput_delta is not None:
        what += f", throughput {event.throughput_delta:+.1%}"
    return f"{head}: {what} [{event.severity}]"


# --- pacing ------------------------------------------------------------------------------


class Pacer:
    """Hold records back so they come out at ``speed``× the rate they were written.

    ``speed`` 0 means as fast as possible. The first record sets the origin; a record
    older than the previous one is let through at once (spools are only roughly ordered).

    >>> slept = []
    >>> p = Pacer(10.0, clock=lambda: 0.0, sleep=slept.append)
    >>> p.wait(1_000_000_000); p.wait(3_000_000_000)
    >>> slept
    [0.2]
    """

    def __init__(
        self,
        speed: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] = time.sleep,
    ):
        if speed < 0:
            raise ValueError(f"speed must be >= 0, got {speed}")
        self.speed = speed
        self.clock = clock
        self.sleep = sleep
        self._origin: tuple[int, float] | None = None

    def delay_s(self, t_ns: int) -> float:
        """Seconds to wait before the record of time ``t_ns`` is due."""
        if self.speed == 0:
            return 0.0
        if self._origin is None:
            self._origin = (t_ns, self.clock())
            return 0.0
        t0_ns, wall0 = self._origin
        due = wall0 + (t_ns - t0_ns) / 1e9 / self.speed
        return max(0.0, due - self.clock())

    def wait(self, t_ns: int) -> None:
        d = self.delay_s(t_ns)
        if d > 0:
            self.sleep(d)


# --- recorded spools ---------------------------------------------------------------------


def write_jsonl_atomic(path: str | Path, obj: Any) -> None:
    """Write a JSON document so a crash leaves the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class EventsFile:
    """Anomaly events appended as JSON lines (``--events-out``), flushed per event."""

    def __init__(self, path: str | Path | None):
        self._f: io.TextIOBase | None = None
        if path:
            private.makedirs(Path(path).parent)
            # 0600 whatever the umask: events name jobs, hosts and communicators
            self._f = os.fdopen(private.open_append(path), "a", encoding="utf-8")

    def write(self, event: AnomalyEvent) -> None:
        if self._f is not None:
            from ncclwatch.records import to_json

            self._f.write(to_json(event) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


# --- the worker's batch logic ------------------------------------------------------------

# Which record kinds each input may carry; anything else breaks the contract of the topic.
DETECTOR_KINDS = (WindowSummary, ThroughputRecord, DropRecord, PluginStats)
TELEMETRY_KINDS = (DropRecord, PluginStats)


@dataclass(frozen=True, slots=True)
class Message:
    """A Kafka message as the core sees it, whatever client delivered it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int | None = None


def message_lines(value: bytes) -> list[bytes]:
    """The records of one message: one JSON line, or several (JSON Lines).

    The forwarder packs many op records into one message (``--ops-per-message``) and a
    producer may pack windows the same way, which is what makes Kafka and Faust cheap
    per record; every input of the worker and of replay accepts both.

    >>> message_lines(b'{"a":1}'), message_lines(b'{"a":1}\\n{"b":2}\\n')
    ([b'{"a":1}'], [b'{"a":1}', b'{"b":2}'])
    """
    if b"\n" not in value:
        return [value]
    return [line for line in value.split(b"\n") if line]


def dead_letter(msg: Message, stage: str, reason: str, detail: str, raw_line: bytes | None = None) -> Quarantined:
    """A message (or one line of it) that cannot be used, with why and where it came from."""
    raw = (msg.value if raw_line is None else raw_line) or b""
    raw = raw[:4096].decode("utf-8", errors="replace")
    return Quarantined(
        stage=stage,
        reason=reason,
        detail=detail,
        source=f"kafka:{msg.topic}/{msg.partition}",
        offset=msg.offset,
        raw=raw,
    )


def decode_message(
    msg: Message, allowed: tuple[type, ...], *, key_is_job: bool = True, line: bytes | None = None
) -> Any:
    """The message's record (or that of ``line`` of it), or a :class:`Quarantined` saying
    why it is not usable here.

    Besides the record contract, a topic has its own: only some kinds belong on it, and
    its key is the record's job, which is what puts a whole job on one partition (a
    record on the wrong partition would split the job's state across workers).
    """
    raw = msg.value if line is None else line
    if raw is None:
        return dead_letter(msg, "parse", "not_json", "message without a value (tombstone)")
    rec = parse_record(raw, source=f"kafka:{msg.topic}/{msg.partition}", offset=msg.offset)
    if isinstance(rec, Quarantined):
        return rec
    if not isinstance(rec, allowed):
        kinds = ", ".join(sorted(c.KIND for c in allowed))
        detail = f"a {rec.KIND} record does not belong on {msg.topic} ({kinds})"
        return dead_letter(msg, "schema", "schema", detail, raw)
    if key_is_job and msg.key is not None and msg.key != rec.job.encode("utf-8"):
        return dead_letter(
            msg,
            "schema",
            "schema",
            f"message key {msg.key[:200]!r} is not the record's job {rec.job!r}: "
            "the job would be split across partitions",
            raw,
        )
    return rec


class TimeMerge:
    """Merge input partitions into record-time order, as far as what was read allows.

    Each input partition is a FIFO (its own order is kept: the offset bookkeeping needs
    it). The merge takes the earliest head among the partitions of a *group* (the
    co-partitioned inputs of one partition number), but only while no input of that
    group that is still *behind* (messages on the broker not read yet) could bring
    something earlier: the latest time read from such an input bounds what may go.
    Inputs that are caught up hold nothing back, so live nothing waits; catching up
    after an outage, windows wait for the throughput and telemetry of their time, as
    they would have met them live. ``hold(name, behind, t_ns)`` adds a bound from an
    input fed elsewhere (the telemetry re-keyed by this worker's other agent).

    A bound that has not moved for ``max_hold_s`` (an input that says it is behind
    but delivers nothing) stops holding anything, and the earliest items go when more
    than ``max_held`` are held; both are counted in ``forced``.

    >>> m = TimeMerge(clock=lambda: 0.0)
    >>> m.add(("w", 0), 0, 30, "w30"); m.add(("w", 0), 0, 40, "w40"); m.add(("t", 0), 0, 10, "t10")
    >>> m.progress(("t", 0), behind=True)     # throughput has more to read
    >>> m.release()                           # nothing after t=10 may go yet
    ['t10']
    >>> m.add(("t", 0), 0, 35, "t35"); m.progress(("t", 0), behind=False)
    >>> m.release()
    ['w30', 't35', 'w40']
    """

    def __init__(
        self,
        *,
        max_hold_s: float = 10.0,
        max_held: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_hold_s = max_hold_s
        self.max_held = max_held
        self.clock = clock
        self._queues: dict[Any, deque] = {}
        self._groups: dict[int, list[Any]] = {}
        self._last_t: dict[Any, int] = {}
        self._moved: dict[Any, float] = {}  # wall time an input last delivered
        self._behind: dict[Any, bool] = {}
        self._external: dict[str, tuple[bool, int, float]] = {}
        self.held = 0
        self.forced = 0  # let go before their time (a stuck bound, or too many held)

    def add(self, tp: Any, group: int, t_ns: int, item: Any, rank: int = 0) -> None:
        """Queue ``item`` of time ``t_ns``; ``rank`` orders items of equal time (lower first)."""
        q = self._queues.get(tp)
        if q is None:
            q = self._queues[tp] = deque()
            self._groups.setdefault(group, []).append(tp)
            self._last_t[tp] = t_ns
        q.append((t_ns, rank, item))
        # The newest message, not the largest time: a partition is read in order, so
        # what comes next follows the last one read (a partition whose times jump back,
        # e.g. a second run published after a first, bounds by where it is now).
        self._last_t[tp] = t_ns
        self._moved[tp] = self.clock()
        self.held += 1

    def expect(self, tp: Any, group: int, behind: bool = True) -> None:
        """An input not read yet that has something to deliver: nothing may pass it."""
        if tp not in self._queues:
            self._queues[tp] = deque()
            self._groups.setdefault(group, []).append(tp)
            self._last_t[tp] = -(1 << 62)
            self._moved[tp] = self.clock()
        self._behind[tp] = behind

    def progress(self, tp: Any, behind: bool) -> None:
        """Whether ``tp`` has unread messages on the broker (after what was added)."""
        self._behind[tp] = behind

    def hold(self, name: str, behind: bool, t_ns: int) -> None:
        """An input fed from elsewhere: while behind, nothing later than ``t_ns`` goes."""
        old = self._external.get(name)
        moved = self.clock() if old is None or old[:2] != (behind, t_ns) else old[2]
        self._external[name] = (behind, t_ns, moved)

    def clear(self) -> None:
        """Drop everything held (it will be read again); counters and settings stay."""
        for d in (self._queues, self._groups, self._last_t, self._moved, self._behind):
            d.clear()
        self._external.clear()
        self.held = 0

    def _bound(self, tps: list[Any], now: float) -> tuple[int, int]:
        """(bound from live inputs, bound including stuck ones) for one group."""
        live = stuck = 1 << 62
        bounds = [(t, m) for _, (b, t, m) in self._external.items() if b]
        bounds += [(self._last_t[tp], self._moved[tp]) for tp in tps if self._behind.get(tp) and not self._queues[tp]]
        for t, moved in bounds:
            stuck = min(stuck, t)
            if now - moved <= self.max_hold_s:
                live = min(live, t)
        return live, stuck

    def drain(self) -> list[Any]:
        """Everything held, in merge order (end of input: nothing more will come)."""
        self._behind.clear()
        self._external.clear()
        return self.release()

    def release(self) -> list[Any]:
        out: list[Any] = []
        now = self.clock()
        for tps in self._groups.values():
            live, stuck = self._bound(tps, now)
            while True:
                heads = [(q[0][0], q[0][1], i) for i, tp in enumerate(tps) if (q := self._queues[tp])]
                if not heads:
                    break
                t, _, i = min(heads)
                if t > live and self.held <= self.max_held:
                    break
                if t > stuck:
                    self.forced += 1
                tp = tps[i]
                q = self._queues[tp]
                out.append(q.popleft()[2])
                self.held -= 1
                if not q and self._behind.get(tp):
                    # drained but behind: its next message may be as early as its last
                    live = min(live, self._last_t[tp])
                    stuck = min(stuck, self._last_t[tp])
        return out


@dataclass
class BatchOutcome:
    events: list[AnomalyEvent] = field(default_factory=list)
    dead_letters: list[tuple[Message, Quarantined]] = field(default_factory=list)
    # job -> (partition, state to save, or None to delete): the partition its table
    # entry belongs to, the same as its records'
    states: dict[str, tuple[int, dict | None]] = field(default_factory=dict)
    done: list[Message] = field(default_factory=list)  # may be acknowledged once saved
    records: int = 0
    skipped: int = 0
    max_record_time_ns: int = 0


class StreamCore:
    """The worker's logic for batches of messages, without Faust.

    State per job is ``{"v", "detectors", "positions"}``: the job's detector state and,
    per input ``topic/partition``, the position of the last record folded into it
    (``offset << 20 | line``: a message may hold several records). The worker saves the
    states touched by a batch and only then acknowledges the messages the batch
    finished, so Kafka's committed offsets never pass the saved state. After a crash the
    messages since the last commit come again; records the saved state already holds
    are skipped by position, the rest are processed as if for the first time. The
    pipeline is deterministic, so what is emitted again is what was emitted before.

    Records go through a :class:`TimeMerge` first, so what the topics deliver in no
    particular order between them is detected in record-time order; a message is
    finished (``done``) when the merge has let all its records go.

    Parameters
    ----------
    detectors
        The per-job pipelines, used as a cache in front of the saved states.
    load_state
        ``job -> saved state or None`` (the Faust table's ``get``).
    merge
        The time merge (default: :class:`TimeMerge` with its defaults).
    """

    LINE_BITS = 20  # records per message < 2**20: a Kafka message is at most ~1 MB

    def __init__(
        self,
        detectors: JobDetectors,
        load_state: Callable[[str], dict | None],
        merge: TimeMerge | None = None,
    ):
        self.detectors = detectors
        self.load_state = load_state
        self.merge = merge or TimeMerge()
        self.positions: dict[str, dict[str, int]] = {}
        self.partition_of: dict[str, int] = {}
        self._remaining: dict[tuple[str, int, int], int] = {}  # message -> records held

    def _ensure(self, job: str) -> dict[str, int]:
        positions = self.positions.get(job)
        if positions is None or job not in self.detectors.pipelines:
            saved = self.load_state(job)
            if saved:
                self.detectors.restore_job(job, saved["detectors"])
                positions = dict(saved.get("positions", {}))
            else:
                self.detectors.forget(job)
                positions = {}
            self.positions[job] = positions
        return positions

    def forget(self) -> None:
        """Drop every cached job and held message (on rebalance: they come again)."""
        self.detectors.forget()
        self.positions.clear()
        self.merge.clear()
        self._remaining.clear()

    def handle(
        self,
        messages: Iterable[Message],
        kinds: dict[str, tuple[type, ...]] | None = None,
        behind: dict[tuple[str, int], bool] | None = None,
    ) -> BatchOutcome:
        """Decode, merge by time, detect what the merge lets go.

        ``kinds`` says which record kinds each topic may carry (default: any the
        detectors take); ``behind`` says which ``(topic, partition)`` has unread
        messages on the broker.
        """
        kinds = kinds or {}
        out = BatchOutcome()
        merge_add = self.merge.add
        for msg in messages:
            allowed = kinds.get(msg.topic, DETECTOR_KINDS)
            lines: list[bytes | None] = [None] if msg.value is None else message_lines(msg.value)
            tp = (msg.topic, msg.partition)
            where = f"{msg.topic}/{msg.partition}"
            held = 0
            for i, line in enumerate(lines):
                rec = decode_message(msg, allowed, line=line)
                if isinstance(rec, Quarantined):
                    out.dead_letters.append((msg, rec))
                else:
                    t = record_time_ns(rec)
                    rank = KIND_ORDER.get(rec.KIND, 3)
                    merge_add(tp, msg.partition, t, (msg, i, rec, t, where), rank)
                    held += 1
            if held:
                self._remaining[(msg.topic, msg.partition, msg.offset)] = held
            else:
                out.done.append(msg)
        for tp, b in (behind or {}).items():
            self.merge.progress(tp, b)
        touched: set[str] = set()
        remaining = self._remaining
        process = self.detectors.process
        pipelines = self.detectors.pipelines
        max_t = out.max_record_time_ns
        for msg, i, rec, t, where in self.merge.release():
            key = (msg.topic, msg.partition, msg.offset)
            left = remaining.get(key, 1) - 1
            if left:
                remaining[key] = left
            else:
                remaining.pop(key, None)
                out.done.append(msg)
            job = rec.job
            positions = self.positions.get(job)
            if positions is None or job not in pipelines:
                positions = self._ensure(job)
            pos = msg.offset << self.LINE_BITS | i
            if pos <= positions.get(where, -1):
                out.skipped += 1  # already in the saved state: read again after a restart
                continue
            positions[where] = pos
            self.partition_of[job] = msg.partition
            events = process(rec, msg.partition, t)
            touched.add(job)
            if events:
                out.events += events
                # advance() can change other jobs too: those that emitted are saved
                touched.update(ev.job for ev in events)
            out.records += 1
            if t > max_t:
                max_t = t
        out.max_record_time_ns = max_t
        for job in self.detectors.evicted:
            # forgotten after an hour of silence: its table entry goes too
            self.positions.pop(job, None)
            touched.discard(job)
            if job in self.partition_of:
                out.states[job] = (self.partition_of.pop(job), None)
        self.detectors.evicted = []
        for job in sorted(touched):
            if job not in self.detectors.pipelines or job not in self.partition_of:
                continue
            state = {
                "v": STATE_VERSION,
                "detectors": self.detectors.job_state(job),
                "positions": dict(self.positions[job]),
            }
            out.states[job] = (self.partition_of[job], state)
        return out
