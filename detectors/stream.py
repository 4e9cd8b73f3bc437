"""What the three drivers (`watch`, `worker`, `replay`) share, so they cannot disagree.

The detector library (:mod:`ncclwatch.detectors.pipeline`) does the thinking; a driver
only moves records in and anomaly events out. Everything here is plain Python without
Kafka or Faust, so it is tested directly:

- :class:`JobDetectors`: one ``Pipeline`` per job. A job is the unit of state in the
  Faust worker (its table is keyed by job), so the local drivers split state the same
  way and both give the same events for the same input.
- :class:`TimeMerge`: input partitions merged into record-time order.
- :class:`StreamCore`: the worker's logic for a batch of Kafka messages (decode,
  dead-letter, skip what the saved state has already seen, detect, snapshot).

Next to it: :mod:`~ncclwatch.detectors.messages` (decoding Kafka messages),
:mod:`~ncclwatch.detectors.console` (the line per anomaly),
:mod:`~ncclwatch.detectors.playback` (pacing, events and state files), and
:mod:`ncclwatch.ingest.recording` (reading a recording in time order).
"""

from __future__ import annotations

import gc
import heapq
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from ncclwatch.detectors.keys import NEVER, KeyStage, VerdictMark, VerdictMerge, record_end
from ncclwatch.detectors.messages import (
    DETECTOR_KINDS,
    Message,
    decode_records,
    message_key,
)
from ncclwatch.ingest.recording import (
    KIND_ORDER,
    record_time_ns,
)

from ncclwatch.config import DetectorConfig
from ncclwatch.records import (
    AnomalyEvent,
    Quarantined,
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
    staged
        The job stage alone (``worker --stage jobs``): the records are key verdicts,
        their progress marks, throughput and telemetry, put in order per job by a
        :class:`~ncclwatch.detectors.keys.VerdictMerge` instead of held instants.
    """

    def __init__(
        self,
        cfg: DetectorConfig,
        *,
        model: Any = None,
        pipeline_cls: Any = None,
        tick_s: float = 1.0,
        partitions: int = 1,
        staged: bool = False,
        idle_wait_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
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
        self._heard: dict[int, float] = {}  # group -> when (clock) its stream time last moved
        self.quiet_end_s = cfg.quiet_end_s
        self._next_tick_ns: dict[int, int] = {}
        self.group_of: dict[str, int] = {}
        self._held: dict[str, list] = {}  # job -> records of its current instant
        self._held_t: dict[str, int] = {}
        self._observer: Any = None
        self.evicted: list[str] = []  # jobs advance forgot; the worker drains this list
        # The job stage of the two-stage topology: every record of a job goes through
        # its VerdictMerge, which lets verdicts and records go in one order as far as
        # the key stages' marks allow.
        self.staged = staged
        self.merges: dict[str, VerdictMerge] = {}
        self.sources = range(partitions)  # the windows partitions: every key stage
        self.idle_wait_s = idle_wait_s  # see VerdictMerge
        self.clock = clock
        self.marked: list[str] = []  # jobs a mark let records go for (to save)
        self._releasing: set[str] = set()
        self.late = 0
        # staged, records wait in the merges beyond the batch that read them: their
        # messages are acknowledged only once they went (``process``'s ``tag``)
        self.holds_records = staged
        self.released_tags: list[Any] = []

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

    def process(
        self, record: Any, group: int | None = None, t_ns: int | None = None, tag: Any = None,
        key: str | None = None,
    ) -> list[AnomalyEvent]:
        """Detect on one record (``t_ns``: its stream time, if the caller has it; ``tag``:
        staged, put in ``released_tags`` once the record went through its job's merge;
        ``key``: its state key, the job, if the caller has it).

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
        job = record.job if key is None else key
        if group is None:
            group = self.group_of.get(job)
            if group is None:
                group = job_partition(job, self.partitions)
        self.group_of[job] = group
        self.pipeline(job)  # the job exists from its first record on, held or not
        if self.staged:
            return self._merged(record, job, group, tag)
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
        self._clock(group, t, events)
        return events

    def _clock(self, group: int, t: int, events: list[AnomalyEvent]) -> None:
        if t > self.stream_ns.get(group, -1):
            self.stream_ns[group] = t
            self._heard[group] = self.clock()
            if t >= self._next_tick_ns.get(group, -1):
                self._next_tick_ns[group] = t - t % self.tick_ns + self.tick_ns
                events += self.advance(t, group)

    def late_verdicts(self) -> int:
        """Verdicts that came after their time was let go (staged), not counting those a
        key stage sent again, since this object was made."""
        return self.late

    def mark(self, m: VerdictMark, group: int | None = None) -> list[AnomalyEvent]:
        """A key stage's progress (staged), for the jobs of ``group`` (default: all);
        the jobs it let records go for are added to ``marked``.

        A key stage sends its marks to every partition of the verdicts topic, each
        after the verdicts it sent there before: a mark read on one partition says
        nothing of verdicts on another, still unread, so it counts for that
        partition's jobs only.
        """
        for job in sorted(self.merges):
            if group is None or self.group_of.get(job) == group:
                self.merges[job].mark(m.source, m.upto_ns)
        return self._release_merged(group)

    def waiting(self) -> bool:
        """Staged: whether records wait for ``idle_wait_s`` to pass (see :meth:`poll`)."""
        return any(m.waiting() for m in self.merges.values())

    def poll(self) -> list[AnomalyEvent]:
        """Staged: let go what waited long enough for key stages that are all idle
        (``idle_wait_s``); the jobs it let records go for are added to ``marked``."""
        return self._release_merged(None) if self.waiting() else []

    def _release_merged(self, group: int | None) -> list[AnomalyEvent]:
        released = []
        for job in sorted(self.merges):
            if group is not None and self.group_of.get(job) != group:
                continue
            merge = self.merges[job]
            if items := merge.release():
                released.append(items)
                self.marked.append(job)
                self._take_tags(merge)
        # In time order across the jobs: a job's records must reach its pipeline before
        # the stream time of its group passes them, or its ranks would look silent.
        events: list[AnomalyEvent] = []
        self._releasing = {items[0].job for items in released}  # not forgotten meanwhile
        for r in heapq.merge(*released, key=record_end):
            job = r.job
            events += self.pipelines[job].process(r)
            self._clock(self.group_of[job], record_time_ns(r), events)
        self._releasing = set()
        return events

    def _merged(self, record: Any, job: str, group: int, tag: Any) -> list[AnomalyEvent]:
        m = self.merges.get(job)
        if m is None:
            m = self.merges[job] = VerdictMerge(self.sources, idle_wait_s=self.idle_wait_s, clock=self.clock)
        late = m.add(record, tag) and record.KIND == "key_verdict"
        events: list[AnomalyEvent] = []
        p = self.pipelines[job]
        repeats = p.duplicate_verdicts
        for r in m.release():  # a late one, or all key stages idle
            events += p.process(r)
            self._clock(group, record_time_ns(r), events)
        self._take_tags(m)
        if late and p.duplicate_verdicts == repeats:
            # not one sent again (a key stage that restarted before saving its state)
            self.late += 1
        return events

    def _take_tags(self, merge: VerdictMerge) -> None:
        if merge.released_tags:
            self.released_tags += merge.released_tags
            merge.released_tags.clear()

    def folded(self, job: str, record: Any) -> bool:
        """Whether a record of ``job`` read again (after a restart) is in its saved state
        already; staged, one its merge held is not, and is processed again."""
        merge = self.merges.get(job) if self.staged else None
        return merge is None or merge.folded(record)

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
            if not p.jobs() and job not in self._held and not self.merges.get(job) and job not in self._releasing:
                del self.pipelines[job]
                self.merges.pop(job, None)
                self.group_of.pop(job, None)
                self.evicted.append(job)
        return events

    def quiet(self) -> list[AnomalyEvent]:
        """Live drivers, between reads: every group whose stream time has not moved for
        ``cfg.quiet_end_s`` of wall-clock time (``clock``) is advanced as if it had moved
        on that long, so a job that ended gets what newer records of other jobs would
        have given it: its held instant goes, its incidents are resolved as
        ``job_silent`` (after ``telemetry_timeout_s``), and after ``job_evict_s`` it is
        forgotten. The group's stream time itself stays where it was: records that still
        come are not late for it. Staged, a group whose jobs hold verdicts or records
        waiting for the key stages is not quiet.
        """
        events: list[AnomalyEvent] = []
        now = self.clock()
        for group in self._quiet_groups(now):
            quiet_s = now - self._heard[group]
            if any(self.merges.get(job) for job, g in self.group_of.items() if g == group):
                continue
            events += self.advance(self.stream_ns[group] + int(quiet_s * 1e9), group)
            if group not in self.group_of.values():
                del self._heard[group]  # every job of it forgotten: nothing left to end
        return events

    def adopt(self, job: str, group: int) -> None:
        """A job restored from saved state with nothing of it read since (a worker that
        restarted after the job ended): put it in ``group`` at its last record's time, so
        :meth:`quiet` ends what it left open. Its stream time counts from now."""
        self.group_of[job] = group
        last = self.pipeline(job).last_end_ns
        if last > self.stream_ns.get(group, -1):
            self.stream_ns[group] = last
        self._heard.setdefault(group, self.clock())

    def quiet_due(self) -> bool:
        """Whether :meth:`quiet` has a group to advance."""
        return bool(self._quiet_groups(self.clock()))

    def _quiet_groups(self, now: float) -> list[int]:
        if not self.quiet_end_s > 0:
            return []
        return sorted(g for g, heard in self._heard.items() if now - heard >= self.quiet_end_s)

    def flush(self) -> list[AnomalyEvent]:
        """End of input: held instants go, every pipeline closes its incomplete groups."""
        events = [ev for job in sorted(self._held) for ev in self._release(job)]
        for job in sorted(self.merges):
            p = self.pipeline(job)
            events += [ev for r in self.merges[job].release(flush=True) for ev in p.process(r)]
            self._take_tags(self.merges[job])
        return events + [ev for job in sorted(self.pipelines) for ev in self.pipelines[job].flush()]

    # -- state --------------------------------------------------------------------------

    def job_state(self, job: str) -> dict:
        """A job's pipeline state and the records of its held instant (as JSON)."""
        state = {
            "pipeline": self.pipeline(job).to_state(),
            "held": [to_dict(r) for r in self._held.get(job, [])],
        }
        if job in self.merges:
            state["merge"] = self.merges[job].to_state()
        return state

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
        if "merge" in state:
            merge = self.merges[job] = VerdictMerge.from_state(state["merge"])
            merge.idle_wait_s, merge.clock = self.idle_wait_s, self.clock
        else:
            self.merges.pop(job, None)
        p.observer = self._observer
        if self._observer is not None and hasattr(self._observer, "bind"):
            self._observer.bind(self)  # re-marks the restored job's open anomalies

    def forget(self, job: str | None = None) -> None:
        """Drop cached pipelines (all, or one job's): they are reloaded from saved state."""
        if job is None:
            self.released_tags.clear()
            self.pipelines.clear()
            self.merges.clear()
            self._held.clear()
            self._held_t.clear()
            self.stream_ns.clear()
            self._heard.clear()
            self._next_tick_ns.clear()
        else:
            self.pipelines.pop(job, None)
            self.merges.pop(job, None)
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
        self._heard = dict.fromkeys(self.stream_ns, self.clock())
        self._next_tick_ns = dict(self.stream_ns)
        self.group_of = dict(state.get("group_of", {}))


class KeyDetectors:
    """The key stage for :class:`StreamCore` (``worker --stage keys``): windows in,
    :class:`~ncclwatch.detectors.keys.KeyVerdict` s and
    :class:`~ncclwatch.detectors.keys.VerdictMark` s out, for the job stage
    (:class:`JobDetectors` with ``staged``) behind the verdicts topic.

    Windows come keyed ``<job>|<comm>`` (``topics.window_key = "comm"``), so a
    communicator's windows are in one partition, and the unit of state is the
    communicator (:func:`state_key`). Each windows partition is a key stage of its own
    (a :class:`~ncclwatch.detectors.keys.KeyStage`, marking the jobs it holds): its
    verdicts do not depend on how partitions are spread over workers.

    Each partition's progress goes to the job stages as :meth:`marks`: every job
    stage waits on every windows partition, so a key worker that lags (or restarts)
    holds the job stage back instead of making its communicators look silent.

    Communicators silent for ``forget_after_s`` of their partition's stream time are
    forgotten (``evicted``: their saved state is deleted too).
    """

    def __init__(self, cfg: DetectorConfig, *, model: Any = None, forget_after_s: float = 3600.0,
                 hold_ranks: int | None | Literal["config"] = "config"):
        self.cfg = cfg
        self.model = model if model is not None else load_model(cfg)
        # Communicators of ``hold_ranks`` ranks or more ("config": ``cfg.key_hold_ranks``;
        # None: none) hold their open groups' windows out of their saved state (KeyStage's
        # ``hold_ranks``): a window's message is done once its group closed. Below, a
        # group's windows are state and a message is done once read.
        self.hold_ranks = cfg.key_hold_ranks if hold_ranks == "config" else hold_ranks
        self.holds_records = self.hold_ranks is not None
        self.released_tags: list[Any] = []  # every partition's stage appends here
        self.stages: dict[int, KeyStage] = {}
        self.pipelines: dict[str, int] = {}  # communicator -> its partition (StreamCore's cache test)
        self._newest: dict[int, int] = {}  # partition -> newest window end
        self._next_sweep: dict[int, int] = {}
        self._forget_ns = int(forget_after_s * 1e9)
        self.evicted: list[str] = []
        self.observer: Any = None

    @staticmethod
    def state_key(w: Any) -> str:
        """The unit of state: a window's communicator, as its message key names it."""
        return f"{w.job}|{w.comm}"

    def _stage(self, partition: int) -> KeyStage:
        stage = self.stages.get(partition)
        if stage is None:
            stage = self.stages[partition] = KeyStage(self.cfg, model=self.model, hold_ranks=self.hold_ranks)
            stage.released_tags = self.released_tags
        return stage

    def process(self, w: Any, partition: int = 0, t_ns: int | None = None, tag: Any = None,
                key: str | None = None) -> list[Any]:
        """Verdicts of the groups window ``w`` closes (``key``: its :meth:`state_key`, if
        the caller has it)."""
        stage = self.stages.get(partition)
        if stage is None:
            stage = self._stage(partition)
        self.pipelines[self.state_key(w) if key is None else key] = partition
        out: list[Any] = stage.process(w, tag)
        if w.end_ns > self._newest.get(partition, -1):
            self._newest[partition] = w.end_ns
            if w.end_ns >= self._next_sweep.get(partition, -1):
                self._next_sweep[partition] = w.end_ns + self._forget_ns // 60
                self._sweep(partition, stage, w.end_ns - self._forget_ns)
        return out

    def _sweep(self, partition: int, stage: KeyStage, before_ns: int) -> None:
        for job, comm in stage.comms():
            if stage.clock(job, comm).watermark < before_ns:
                stage.forget_comm(job, comm)
                self.pipelines.pop(f"{job}|{comm}", None)
                self.evicted.append(f"{job}|{comm}")

    def folded(self, key: str, w: Any) -> bool:
        """Whether window ``w``, read again after a restart, is in the saved state
        already (else its group was open and held: it goes in again)."""
        partition = self.pipelines.get(key)
        return partition is not None and self._stage(partition).folded(w)

    def marks(self, partitions: dict[int, bool]) -> list[VerdictMark]:
        """The progress marks of ``partitions`` (partition -> read to the end?)."""
        out = []
        for p, caught_up in sorted(partitions.items()):
            stage = self.stages.get(p)
            if stage is None:
                out.append(VerdictMark(p, None if caught_up else NEVER))
            else:
                out.append(VerdictMark(p, stage.caught_up_mark() if caught_up else stage.mark()))
        return out

    def flush(self) -> list[Any]:
        """End of input: every open group closes (for tests and replays, not the worker)."""
        return [v for p in sorted(self.stages) for v in self.stages[p].flush()]

    def key_count(self) -> int:
        return sum(s.key_count() for s in self.stages.values())

    def job_state(self, key: str) -> dict:
        partition = self.pipelines[key]
        job, comm = key.rsplit("|", 1)
        return {"partition": partition, "comm": self._stage(partition).comm_state(job, comm)}

    def restore_job(self, key: str, state: dict) -> None:
        partition = state["partition"]
        job, comm = key.rsplit("|", 1)
        if state["comm"] is not None:
            self._stage(partition).restore_comm(job, comm, state["comm"])
        self.pipelines[key] = partition

    def forget(self, key: str | None = None) -> None:
        if key is None:
            self.released_tags.clear()
            self.stages.clear()
            self.pipelines.clear()
            self._newest.clear()
            self._next_sweep.clear()
            return
        partition = self.pipelines.pop(key, None)
        if partition is not None:
            job, comm = key.rsplit("|", 1)
            self._stage(partition).forget_comm(job, comm)


# --- the one line per anomaly ------------------------------------------------------------


class TimeMerge:
    """Merge input partitions into record-time order, as far as what was read allows.

    Each input partition is a FIFO (its own order is kept: the offset bookkeeping needs
    it). The merge takes the earliest head among the partitions of a *group* (the
    co-partitioned inputs of one partition number), but only while no input of that
    group that is still *behind* (messages on the broker not read yet) could bring
    something earlier: the latest time read from such an input bounds what may go.
    Inputs that are caught up hold nothing back, so live nothing waits; catching up
    after an outage, windows wait for the throughput and telemetry of their time, as
    they would have met them live.

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
        self.held = 0
        self.forced = 0  # let go before their time (a stuck bound, or too many held)
        # release() is called once per record read, and mostly nothing can go: it does
        # the work only after something was added or a bound changed, or once the clock
        # reaches the next time an input turns stuck (the only change that needs none).
        self._changed = True
        self._recheck_at = float("inf")

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
        self._changed = True

    def extend(self, tp: Any, group: int, entries: list[tuple[int, int, Any]]) -> None:
        """:meth:`add` for a run of ``(t_ns, rank, item)`` read together (one message's
        records), in the order read.

        >>> m = TimeMerge(clock=lambda: 0.0)
        >>> m.extend(("w", 0), 0, [(30, 0, "w30"), (20, 0, "w20")]); m.add(("t", 0), 0, 25, "t25")
        >>> m.release()
        ['t25', 'w30', 'w20']
        """
        if not entries:
            return
        q = self._queues.get(tp)
        if q is None:
            q = self._queues[tp] = deque()
            self._groups.setdefault(group, []).append(tp)
        q.extend(entries)
        self._last_t[tp] = entries[-1][0]  # the newest read, as in add()
        self._moved[tp] = self.clock()
        self.held += len(entries)
        self._changed = True

    def touch(self, tp: Any) -> None:
        """``tp`` delivered something that cannot be added yet (messages past a hole
        that is being read again): it is not stuck, whatever it last added.

        >>> now = [0.0]
        >>> m = TimeMerge(max_hold_s=10.0, clock=lambda: now[0])
        >>> m.add(("t", 0), 0, 10, "t10"); m.progress(("t", 0), behind=True)
        >>> m.add(("w", 0), 0, 30, "w30")
        >>> m.release()
        ['t10']
        >>> now[0] = 8.0; m.touch(("t", 0)); now[0] = 15.0
        >>> m.release()  # delivering 7 s ago: still holds
        []
        >>> now[0] = 18.5; m.release(), m.forced  # nothing for 10.5 s: stuck, passed
        (['w30'], 1)
        """
        if tp in self._moved:
            self._moved[tp] = self.clock()

    def expect(self, tp: Any, group: int, behind: bool = True) -> None:
        """An input not read yet that has something to deliver: nothing may pass it."""
        if tp not in self._queues:
            self._queues[tp] = deque()
            self._groups.setdefault(group, []).append(tp)
            self._last_t[tp] = -(1 << 62)
            self._moved[tp] = self.clock()
        self._behind[tp] = behind
        self._changed = True

    def holds(self, tp: Any) -> bool:
        """Whether records of ``tp`` wait here."""
        return bool(self._queues.get(tp))

    def progress(self, tp: Any, behind: bool) -> None:
        """Whether ``tp`` has unread messages on the broker (after what was added)."""
        if self._behind.get(tp) is not behind:
            self._behind[tp] = behind
            self._changed = True

    def clear(self) -> None:
        """Drop everything held (it will be read again); counters and settings stay."""
        for d in (self._queues, self._groups, self._last_t, self._moved, self._behind):
            d.clear()
        self.held = 0
        self._changed = True

    def _bound(self, tps: list[Any], now: float) -> tuple[int, int]:
        """(bound from live inputs, bound including stuck ones) for one group."""
        live = stuck = 1 << 62
        bounds = [(self._last_t[tp], self._moved[tp]) for tp in tps if self._behind.get(tp) and not self._queues[tp]]
        hold = self.max_hold_s
        for t, moved in bounds:
            stuck = min(stuck, t)
            if now - moved <= hold:
                live = min(live, t)
                self._recheck_at = min(self._recheck_at, moved + hold)
        return live, stuck

    def drain(self) -> list[Any]:
        """Everything held, in merge order (end of input: nothing more will come)."""
        self._behind.clear()
        self._changed = True
        return self.release()

    def release(self) -> list[Any]:
        """What may go now, in merge order."""
        now = self.clock()
        if not self._changed and now <= self._recheck_at:
            return []  # same inputs, same bounds as the last call: nothing more can go
        self._changed = False
        self._recheck_at = float("inf")
        out: list[Any] = []
        append = out.append
        for tps in self._groups.values():
            live, stuck = self._bound(tps, now)
            queues = [self._queues[tp] for tp in tps]
            going = True
            while going:
                heads = sorted((q[0][0], q[0][1], i) for i, q in enumerate(queues) if q)
                if not heads:
                    break
                i = heads[0][2]
                runner_up = heads[1] if len(heads) > 1 else None
                q, tp = queues[i], tps[i]
                # Take from the earliest queue while it stays the earliest: the other
                # heads do not change meanwhile (one sort per run, not per record).
                while q:
                    t, rank, item = q[0]
                    if runner_up is not None and (t, rank, i) > runner_up:
                        break
                    if t > live and self.held <= self.max_held:
                        going = False
                        break
                    if t > stuck:
                        self.forced += 1
                    q.popleft()
                    append(item)
                    self.held -= 1
                if not q and self._behind.get(tp):
                    # drained but behind: its next message may be as early as its last
                    live = min(live, self._last_t[tp])
                    stuck = min(stuck, self._last_t[tp])
        if out:
            self._changed = True  # queues emptied: the next call takes their bounds afresh
        return out


# Python's default (700, 10, 10) makes a full collection every ~70k allocations, and a
# full collection walks every live object: a worker holding many communicators' windows
# and states spent about half its CPU there (key stage, 204,800 windows of a 2,048-GPU
# job, StreamCore alone: 16.6k windows per CPU-second at the default, 33.4k at 10,000).
# The records, windows and states hold no reference cycles, so collecting less often
# leaves memory as it is.
GC_THRESHOLDS = (10_000, 10, 10)


@contextmanager
def collection_paused() -> Iterator[None]:
    """No garbage collection inside: for building a large state, millions of small
    objects and no reference cycles, whose count alone triggers collections that walk
    the whole live heap. Free them inside too: alive when collection resumes, the next
    young collection walks them all (a 49,152-GPU job's 21 MB state, with that
    collection: 0.47 s built inside and encoded after, 0.34 s built, encoded and freed
    inside; bench/worker/bench_save.py, docs/BENCHMARKS.md)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def collect_less_often() -> None:
    """For a long-running process that holds a large live state (the worker): a young
    collection every ``GC_THRESHOLDS[0]`` allocations; what start-up built (modules,
    configuration) is never walked again (``gc.freeze``)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


@dataclass
class BatchOutcome:
    events: list[AnomalyEvent] = field(default_factory=list)
    dead_letters: list[tuple[Message, Quarantined]] = field(default_factory=list)
    # job -> (partition, state to save, or None to delete): the partition its table
    # entry belongs to, the same as its records'; with StreamCore's ``encode_state``,
    # what that gave for the state instead
    states: dict[str, tuple[int, Any]] = field(default_factory=dict)
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
    state_key
        A record's unit of state (default: its job; the key stage's
        :meth:`KeyDetectors.state_key`: its communicator).
    merge_group
        A partition's time-merge group (default: the partition, the co-partitioned
        inputs of one number). The key stage merges all its partitions as one group, so
        one worker reads its partitions abreast and no partition's jobs reach the job
        stage long after the others' (a partition read late has late verdicts).
    save_every_s
        0 (default): the touched states go out with every batch. Above 0: at most this
        often, and no more often than every ``SAVE_COST_FACTOR`` times what building
        the last save took: a large job's state (6.7 MB of JSON at 16,384 GPUs: 1.4 s
        to build and serialise on 2026-11-26, 0.084 s on 2026-11-28 built and
        encoded with collection paused; 21 MB and 0.34 s at 49,152) saved after every
        batch costs more than detecting.
        Until a save, the messages done wait with it (``done`` is only what a save in
        the same outcome covers), so the committed offsets never pass the saved state;
        and so do the events those messages made (``events`` too is only what the save
        covers): a partition taken away before the save is read again by its next
        owner from the saved state, which then emits them once, not a second time.
    hold_events
        True (default): events wait for the save as above. False for the key stage:
        its verdicts go out at once, ahead of the progress marks sent after them, and a
        verdict sent again is an exact copy the job stage folds.
    encode_state
        ``(job, state or None) -> what to write``, called inside the save (the worker:
        its table codec's entries), so a state's millions of small objects are built,
        encoded and freed while garbage collection is paused. Left for later, they are
        still alive when collection resumes, and the next collection walks them all
        (1.2 s of a 49,152-GPU job worker's 13.6 s of batches, 2026-11-28). None
        (default): ``states`` holds the states themselves.
    """

    SAVE_COST_FACTOR = 5.0  # saving takes at most ~1/5 of the time

    LINE_BITS = 20  # records per message < 2**20: a Kafka message is at most ~1 MB

    def __init__(
        self,
        detectors: JobDetectors,
        load_state: Callable[[str], dict | None],
        merge: TimeMerge | None = None,
        *,
        state_key: Callable[[Any], str] | None = None,
        merge_group: Callable[[int], int] | None = None,
        save_every_s: float = 0.0,
        hold_events: bool = True,
        encode_state: Callable[[str, dict | None], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.detectors = detectors
        self.load_state = load_state
        self.merge = merge or TimeMerge()
        self.state_key = state_key or (lambda r: r.job)
        self._key_of = state_key  # what message keys must be (None: the job)
        self.merge_group = merge_group or (lambda partition: partition)
        self.positions: dict[str, dict[str, int]] = {}
        self.partition_of: dict[str, int] = {}
        self._remaining: dict[tuple[str, int, int], int] = {}  # message -> records held
        self.save_every_s = save_every_s
        self.hold_events = hold_events
        self.encode_state = encode_state
        self._clock = clock
        self._unsaved: set[str] = set()  # touched since the last save
        self._unsaved_gone: dict[str, int] = {}  # forgotten since the last save -> partition
        self._unacked: list[Message] = []  # done, waiting for the next save
        self._unsent: list[Any] = []  # events of the records since the last save
        self._saved_at = float("-inf")
        self.save_cost_s = 0.0  # what building the last save took

    def _ensure(self, job: str, saved: dict | None = None) -> dict[str, int]:
        """The job's input positions, its detectors loaded from its saved state if they
        are not (``saved``: that state, read already)."""
        positions = self.positions.get(job)
        if positions is None or job not in self.detectors.pipelines:
            if saved is None:
                saved = self.load_state(job)
            if saved:
                self.detectors.restore_job(job, saved["detectors"])
                positions = dict(saved.get("positions", {}))
            else:
                self.detectors.forget(job)
                positions = {}
            self.positions[job] = positions
        return positions

    def adopt_saved(self, job: str, partition: int) -> bool:
        """Load a saved job that left incidents open, for :meth:`JobDetectors.quiet` to
        end once its partition stays quiet: a job that ended before a restart sends
        nothing that would load it. Whether it was loaded."""
        detectors = self.detectors
        if not isinstance(detectors, JobDetectors) or job in detectors.pipelines or not detectors.quiet_end_s:
            return False
        saved = self.load_state(job)
        pipeline = (saved or {}).get("detectors", {}).get("pipeline", {})
        if not any(st.get("incidents") and not st.get("silent") for _, st in pipeline.get("jobs", [])):
            return False
        self._ensure(job, saved)  # decoded once: a job's state is megabytes at 10k GPUs
        self.partition_of[job] = partition
        detectors.adopt(job, partition)
        return True

    def forget(self) -> None:
        """Drop every cached job and held message (on rebalance: they come again)."""
        self.detectors.forget()
        self.positions.clear()
        self.merge.clear()
        self._remaining.clear()
        self._unsaved.clear()
        self._unsaved_gone.clear()
        self._unacked.clear()
        self._unsent.clear()

    @property
    def save_pending(self) -> bool:
        """Whether states, done messages or events wait for a save (``save_every_s``)."""
        return bool(self._unsaved or self._unsaved_gone or self._unacked or self._unsent)

    def save_due(self) -> bool:
        wait = max(self.save_every_s, self.SAVE_COST_FACTOR * self.save_cost_s) if self.save_every_s > 0 else 0.0
        return self._clock() - self._saved_at >= wait

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
        key_of = self._key_of
        out = BatchOutcome()
        extend = self.merge.extend
        remaining = self._remaining
        line_bits = self.LINE_BITS
        kind_order = KIND_ORDER
        for msg in messages:
            allowed = kinds.get(msg.topic, DETECTOR_KINDS)
            # What every record of the message shares, built once: the message's
            # bookkeeping key, its partition's position name, its key as the state key
            # (a record that passed the key check has it), and its first position.
            ctx = ((msg.topic, msg.partition, msg.offset), msg, f"{msg.topic}/{msg.partition}",
                   message_key(msg), msg.offset << line_bits)
            entries = []
            for i, rec in enumerate(decode_records(msg, allowed, key_of=key_of)):
                if type(rec) is Quarantined:
                    out.dead_letters.append((msg, rec))
                else:
                    t = record_time_ns(rec)
                    entries.append((t, kind_order.get(rec.KIND, 3), (ctx, i, rec, t)))
            if entries:
                remaining[ctx[0]] = len(entries)
                extend((msg.topic, msg.partition), self.merge_group(msg.partition), entries)
            else:
                out.done.append(msg)
        for tp, b in (behind or {}).items():
            self.merge.progress(tp, b)
        touched: set[str] = set()
        detectors = self.detectors
        process = detectors.process
        pipelines = detectors.pipelines
        holds = detectors.holds_records
        state_key = self.state_key
        positions_of = self.positions
        partition_of = self.partition_of
        done = out.done
        max_t = out.max_record_time_ns
        records = skipped = 0

        def went(key: tuple[str, int, int], msg: Message) -> None:
            # one record of the message is done with: the message is, once all are
            left = remaining.get(key, 1) - 1
            if left:
                remaining[key] = left
            else:
                remaining.pop(key, None)
                done.append(msg)

        for ctx, i, rec, t in self.merge.release():
            key, msg, where, skey, base = ctx
            if rec.KIND == VerdictMark.KIND:
                went(key, msg)
                # progress, not state: a mark is superseded by the next (sent twice a
                # second), so nothing is saved for it but the jobs it let go
                events = detectors.mark(rec, msg.partition)
                out.events += events
                touched.update(detectors.marked)
                detectors.marked.clear()
                touched.update(ev.job for ev in events)
                records += 1
                continue
            if not holds:
                went(key, msg)
            job = skey if skey is not None else state_key(rec)
            positions = positions_of.get(job)
            if positions is None or job not in pipelines:
                positions = self._ensure(job)
            pos = base | i
            last = positions.get(where, -1)
            if pos <= last and (not holds or detectors.folded(job, rec)):
                skipped += 1  # already in the saved state: read again after a restart
                if holds:
                    went(key, msg)
                continue
            if pos > last:
                positions[where] = pos
            partition = msg.partition
            partition_of[job] = partition
            events = process(rec, partition, t, (key, msg) if holds else None, job)
            touched.add(job)
            if events:
                out.events += events
                # advance() can change other jobs too: those that emitted are saved
                touched.update(ev.job for ev in events if ev.KIND == "anomaly")
            records += 1
            if t > max_t:
                max_t = t
        out.records += records
        out.skipped += skipped
        if isinstance(detectors, JobDetectors) and (events := detectors.quiet()):
            # live: jobs whose partition stood still for quiet_end_s of wall time
            out.events += events
            touched.update(ev.job for ev in events)
        if holds:
            if isinstance(detectors, JobDetectors):  # staged: what waited out idle key stages
                if events := detectors.poll():
                    out.events += events
                    touched.update(ev.job for ev in events)
                touched.update(detectors.marked)
                detectors.marked.clear()
            for key, msg in detectors.released_tags:
                went(key, msg)
            detectors.released_tags.clear()
        out.max_record_time_ns = max_t
        unsaved = self._unsaved
        unsaved |= touched
        for job in self.detectors.evicted:
            # forgotten after an hour of silence: its table entry goes too
            self.positions.pop(job, None)
            unsaved.discard(job)
            if job in self.partition_of:
                self._unsaved_gone[job] = self.partition_of.pop(job)
        self.detectors.evicted = []
        self._unacked += out.done
        out.done = []
        if self.hold_events:
            self._unsent += out.events
            out.events = []
        if self.save_pending and self.save_due():
            self._save(out)
        return out

    def _save(self, out: BatchOutcome) -> None:
        """Every state touched since the last save into ``out``, with what it covers."""
        t = time.perf_counter()
        encode = self.encode_state
        with collection_paused():
            for job, partition in self._unsaved_gone.items():
                if job in self._unsaved and job in self.detectors.pipelines and job in self.partition_of:
                    # back again: its state below replaces the tombstone (encoding the
                    # tombstone too would make the codec forget the slot its parts are in)
                    continue
                out.states[job] = (partition, None if encode is None else encode(job, None))
            for job in sorted(self._unsaved):
                if job not in self.detectors.pipelines or job not in self.partition_of:
                    continue
                state = {
                    "v": STATE_VERSION,
                    "detectors": self.detectors.job_state(job),
                    "positions": dict(self.positions[job]),
                }
                if encode is not None:
                    state = encode(job, state)  # the dicts go here, collection still paused
                out.states[job] = (self.partition_of[job], state)
        out.done = self._unacked
        self._unacked = []
        out.events = self._unsent + out.events
        self._unsent = []
        self._unsaved = set()
        self._unsaved_gone = {}
        self._saved_at = self._clock()
        self.save_cost_s = time.perf_counter() - t
