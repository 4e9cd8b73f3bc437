"""The detector pipeline: records in, anomaly events out. The one object drivers call.

``ncclwatch watch`` (local mode), the Faust worker and ``ncclwatch replay`` all feed
records to a :class:`Pipeline` and forward what it returns; nothing here reads a clock
for event times, touches Kafka, or does I/O, so the same records in the same order give
the same events with the same ids wherever they run, and a pipeline saved with
:meth:`Pipeline.to_state` and restored with :meth:`Pipeline.from_state` continues as if
it had never stopped.

Flow for window summaries (one per job, comm, op, size bucket, transport, rank, window),
in two stages that share no state (docs/architecture.md, "Two stages in the library"):

1. key stage (:mod:`.keys`): windows of one key and window start are *grouped across
   ranks* (a collective's bus bandwidth belongs to the whole communicator). A group
   closes when every rank of the communicator reported, when a later group of the key
   closes, or when the stream time (here the job's: its largest window end seen) is
   ``lateness_windows`` windows past its end (more, up to ``max_lateness_windows``, once
   windows of a lagging forwarder arrive late);
2. a closed group gives the key's observation: the busbw p50 of the rank that waited
   least; the ranks' exec p50s, aligned by sequence range, feed the straggler scorer;
   the key's :class:`~.baseline.RatioBaseline` scores it (effect ``1 - observed/baseline``),
   the :class:`~.sustained.SustainedRule` decides, and the baseline learns only from
   windows that are neither degraded nor part of an anomaly: a :class:`~.keys.KeyVerdict`;
3. job stage (here): the verdict updates the job's :class:`~.keys.KeyView` of the key; a
   key that fires is attributed (:mod:`.attribution`) and joins or opens an incident,
   which :class:`~.incident_book.IncidentBook` raises once it is worth a page and ends;
   the incident's event carries the job's throughput change.

Fed windows, a :class:`Pipeline` runs both stages; fed ``KeyVerdict`` s from a
:class:`~.keys.KeyStage` elsewhere, it runs the job stage alone.

Throughput records drive ``throughput_drop`` (:class:`~.throughput_drop.ThroughputDrops`)
and the severity of comm anomalies; drop records, plugin stats and silent ranks drive
``telemetry_loss``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ncclwatch.config import DetectorConfig
from ncclwatch.records import (
    AnomalyEvent,
    DropRecord,
    OpRecord,
    PauseRecord,
    PluginStats,
    ProgressRecord,
    ThroughputRecord,
    WindowSummary,
)

from .attribution import Verdict, attribute
from .causes import link_trouble, process_evidence
from .incident_book import COMM_TYPES, DEFAULT_WINDOW_NS, IncidentBook
from .incidents import MAX_LISTED_KEYS, SEVERITY_RANK, Incident
from .job import JobState
from .keys import FireEvidence, KeyParams, KeyState, KeyVerdict, KeyView, SpreadEvidence, due, place
from .model import BusbwModel
from .pauses import Pauses
from .stall_incidents import StallIncidents, is_stall
from .stalls import StallTracker
from .sustained import FIRE, RESOLVE
from .telemetry import TelemetryTracker
from .throughput import ThroughputTracker
from .throughput_drop import ThroughputDrops

STATE_VERSION = 1


class Pipeline:
    """Online detection over ncclwatch records.

    Parameters
    ----------
    cfg
        The ``[detector]`` configuration section (a whole :class:`~ncclwatch.config.Config`
        is accepted too).
    model
        Cold-start bandwidth model (:class:`~.model.BusbwModel` or a path to its JSON
        file); defaults to ``cfg.model_path`` when that is set.
    clock
        Wall clock in seconds, used only for :meth:`lag_s`; event times are stream time.

    ``observer``, when set, receives callbacks (``record``, ``key_window``,
    ``throughput``, ``event``, ``job_evicted``): :class:`~.metrics.DetectorMetrics`
    uses it. It is not part of the saved state.

    Examples
    --------
    >>> from ncclwatch.config import DetectorConfig
    >>> from ncclwatch.records import WindowSummary
    >>> p = Pipeline(DetectorConfig(warmup_windows=5))
    >>> def window(t, rank, busbw):
    ...     return WindowSummary(job="j", host=f"h{rank}", comm="0x" + "0" * 15 + "1",
    ...         comm_name="", op="AllReduce", size_bucket="64MiB", transport="net", rank=rank,
    ...         nranks=2, start_ns=t * 10**9, end_ns=(t + 1) * 10**9, count=10,
    ...         bytes=10 << 26, exec_ns_min=1, exec_ns_p50=int(67e6 / busbw), exec_ns_p95=1,
    ...         exec_ns_max=1, busbw_gbs_p50=busbw, first_seq=10 * t, last_seq=10 * t + 9)
    >>> events = []
    >>> for t in range(30):
    ...     busbw = 40.0 if t < 20 else 28.0      # the network loses 30 % at t = 20 s
    ...     for rank in (0, 1):
    ...         events += p.process(window(t, rank, busbw))
    >>> [(e.type, e.state, e.start_ns // 10**9, e.detected_ns // 10**9, e.effect) for e in events]
    [('network_path', 'firing', 20, 23, 0.3)]
    """

    def __init__(
        self,
        cfg: Any,
        *,
        model: BusbwModel | str | Path | None = None,
        clock: Callable[[], float] | None = None,
    ):
        cfg = getattr(cfg, "detector", cfg)
        if not isinstance(cfg, DetectorConfig):
            raise TypeError(f"cfg must be a DetectorConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.model = BusbwModel.resolve(model, cfg.model_path)
        self.clock = clock or time.time
        # Incidents (opened, raised, resolved) and throughput drops have their own
        # homes; the job state they work on is this pipeline's.
        self.book = IncidentBook(cfg)
        self.drops = ThroughputDrops(self.book)
        self.stall_incidents = StallIncidents(self.book)
        self._p = KeyParams(cfg)
        self._timeout_ns = int(cfg.telemetry_timeout_s * 1e9)
        self._jobs: dict[str, JobState] = {}
        self.records_total: dict[str, int] = {}
        self.late_windows = 0
        self.duplicate_verdicts = 0
        self.last_end_ns = -1  # largest record time seen, for lag
        # By kind, not type: the worker hands over the fast parser's structs
        # (ingest/parse.py), which carry the record dataclasses' fields and KIND.
        self._handlers = {
            WindowSummary.KIND: self._window,
            ThroughputRecord.KIND: self._throughput,
            PauseRecord.KIND: self._pause,
            DropRecord.KIND: self._drop,
            PluginStats.KIND: self._plugin_stats,
            ProgressRecord.KIND: self._progress,
            OpRecord.KIND: self._ignore,
            KeyVerdict.KIND: self._verdict,
        }

    @property
    def observer(self) -> Any:
        return self.book.observer

    @observer.setter
    def observer(self, value: Any) -> None:
        self.book.observer = value

    # --- the driver API -----------------------------------------------------------

    def process(self, record: Any) -> list[AnomalyEvent]:
        """Feed one record; return the anomaly events it caused (usually none)."""
        kind = record.KIND
        rt = self.records_total
        rt[kind] = rt.get(kind, 0) + 1
        handler = self._handlers.get(kind)
        if handler is None:
            return []
        out: list[AnomalyEvent] = []
        handler(record, out)
        if self.observer is not None:
            self.observer.record(kind)
        return out

    def advance(self, now_ns: int) -> list[AnomalyEvent]:
        """Stream-time tick: a job silent for ``telemetry_timeout_s`` has its open
        anomalies resolved and its incomplete groups closed; one silent for
        ``job_evict_s`` is forgotten."""
        out: list[AnomalyEvent] = []
        evict_ns = int(self.cfg.job_evict_s * 1e9)
        for name in list(self._jobs):
            job = self._jobs[name]
            # A job whose ranks write progress records waits (hung, or held up by a
            # rank): it has not ended.
            last = max(job.watermark, job.throughput.ts_ns, job.stalls.now_ns)
            if last <= 0:
                continue
            idle = now_ns - last
            if idle > self._timeout_ns and not job.silent:
                self._close_all(job, out)
                self._job_silent(job, out)
            if idle > evict_ns:
                for inc in list(job.incidents.values()):  # stalls a silent job kept open
                    self.book.resolve(job, inc, out, reason="job_evicted")
                del self._jobs[name]
                if self.observer is not None:
                    self.observer.job_evicted(name)
        return out

    def flush(self) -> list[AnomalyEvent]:
        """End of input: close every incomplete rank group now (open anomalies stay open)."""
        out: list[AnomalyEvent] = []
        for job in self._jobs.values():
            self._close_all(job, out)
        return out

    def open_anomalies(self) -> list[AnomalyEvent]:
        """The current firing event of every open incident."""
        return [
            inc.event("firing", inc.detected_ns)
            for job in self._jobs.values()
            for inc in job.incidents.values()
            if inc.id is not None and inc.confirmed
        ]

    def jobs(self) -> list[str]:
        return list(self._jobs)

    def key_count(self) -> int:
        return sum(len(j.keys) for j in self._jobs.values())

    def lag_s(self) -> float | None:
        """Wall clock minus the newest record time seen, in seconds."""
        if self.last_end_ns < 0:
            return None
        return self.clock() - self.last_end_ns / 1e9

    # --- windows ------------------------------------------------------------------

    def _job_of(self, name: str, window_ns: int) -> JobState:
        job = self._jobs.get(name)
        if job is None:
            job = self._jobs[name] = JobState(name, self.cfg)
        if not job.window_ns:
            job.window_ns = window_ns
            job.lateness_ns = self.cfg.lateness_windows * window_ns
        return job

    def _job_named(self, name: str) -> JobState:
        """The job's state, created by its first record of any kind (no window yet)."""
        job = self._jobs.get(name)
        if job is None:
            job = self._jobs[name] = JobState(name, self.cfg)
        return job

    def _seen(self, job: JobState, end: int) -> None:
        """The job reported up to ``end``: its stream time (its ranks' liveness is the
        telemetry tracker's)."""
        if end > self.last_end_ns:
            self.last_end_ns = end
        job.silent = False
        if end > job.watermark:
            job.watermark = end

    def _window(self, w: WindowSummary, out: list[AnomalyEvent]) -> None:
        """Both stages in this process: the key stage's grouping, then the job stage."""
        job = self._job_of(w.job, max(w.end_ns - w.start_ns, 1))
        end = w.end_ns
        job.telemetry.see_ranks(w.comm, ((w.rank, w.host),), w.start_ns, end, self._timeout_ns)
        self._seen(job, end)
        if w.transport != "single":
            gk = (w.comm, w.op, w.size_bucket, w.transport)
            ks = job.stage.get(gk)
            if ks is None:
                ks = job.stage[gk] = KeyState.new(w, self._p, self.model)
                job.keys[gk] = KeyView.of(ks)
            complete = place(ks, w, job, job.pending_keys, gk, self.cfg.max_lateness_windows)
            if complete:
                self._close_upto(job, ks, w.start_ns, out)
            elif complete is None:
                self.late_windows += 1
        if job.watermark >= job.next_tick_ns:
            self._tick(job, out)

    def _verdict(self, v: KeyVerdict, out: list[AnomalyEvent]) -> None:
        """The job stage on its own: a verdict from a key stage elsewhere (:class:`~.keys.KeyStage`).

        Its ranks are the liveness the windows would have given, late by the group's
        wait; a key is known from its first verdict on.
        """
        job = self._job_of(v.job, v.window_ns)
        view = job.keys.get(v.key)
        if view is not None and v.end_ns <= view.last_end_ns:
            # A key's verdicts come in order from one key stage: this one was sent
            # again (a key stage that crashed after sending, before saving).
            self.duplicate_verdicts += 1
            return
        if view is None:
            view = job.keys[v.key] = KeyView(v.key, v.comm_name, v.window_ns, self.cfg.sustain_windows)
        view.apply(v)
        if v.ranks is None:  # every rank of the communicator
            job.telemetry.see_all(v.key[0], view.rank_host.items(), v.start_ns, v.end_ns, self._timeout_ns)
        else:
            job.telemetry.see_ranks(v.key[0], v.ranks, v.start_ns, v.end_ns, self._timeout_ns)
        self._seen(job, v.end_ns)
        self._key_verdict(job, view, v, out)
        if job.watermark >= job.next_tick_ns:
            self._tick(job, out)

    def _close_upto(self, job: JobState, ks: KeyState, start: int, out: list) -> None:
        """Close every pending group of ``ks`` starting at or before ``start``, in order."""
        view = job.keys[ks.tuple]
        for s, group in ks.take_upto(start):
            v = ks.close(s, group, self._p)
            if self.observer is not None:
                self.observer.key_window(job.job, ks, v.observed, v.baseline, v.effect, v.exec_ns_p50, v.end_ns)
            view.apply(v)
            self._key_verdict(job, view, v, out)
        if not ks.pending:
            job.pending_keys.pop(ks.tuple, None)

    def _key_verdict(self, job: JobState, ks: KeyView, v: KeyVerdict, out: list) -> None:
        """What one closed group of a key sets off across the job (``ks`` has seen it)."""
        if not v.was_firing and self._p.dropout(ks.transport, v.degraded, v.effect):
            # A drop-out a flapping link fires on once it comes back: a throughput drop of
            # its time is NCCL's. Steps are reported when they end, so those the drop-out
            # slowed come up to a window after it.
            ks.dropout_ns = v.end_ns + ks.window_ns
        if self._p.dropout(ks.transport, True, v.effect):
            ks.slowed_ns = v.end_ns
        if v.was_firing:
            inc = job.incidents.get(ks.incident) if ks.incident else None
            if v.transition == RESOLVE or v.effect < self.cfg.recover_threshold:
                ks.hold.append([v.effect, v.observed, v.baseline])
            elif inc is not None:
                trigger = inc.trigger == ks.tuple
                for h in ks.hold:  # the recovery did not hold: those windows count
                    inc.add_window(h[0], h[1], h[2], trigger)
                ks.hold = []
                inc.add_window(v.effect, v.observed, v.baseline, trigger)
                if v.degraded and v.drift:
                    inc.drift = True
        if v.transition == FIRE:
            self._key_fired(job, ks, v.fired, out)
        elif v.transition == RESOLVE:
            self.book.key_resolved(job, ks, ks.rule.end_ns, out)
        if v.spread_transition == FIRE:
            self._spread_fired(job, ks, v.spread_effect, v.spread_fired, out)
        elif v.spread_transition == RESOLVE:
            self._spread_resolved(job, ks, out)

    def _spread_fired(self, job: JobState, ks: KeyView, spread_effect: float, sc: SpreadEvidence,
                      out: list) -> None:
        """A sustained drop of the ranks' spread: a straggler, if one rank explains it.

        Not while a key of the same communicator is degraded or part of a link
        incident: ranks wait differently when the transfer itself slows, and that is
        one cause, not two.
        """
        if link_trouble(job, ks.comm, self.cfg.straggler_score):
            return
        rank = sc.low_rank
        if rank is None or sc.low_streak < max(1, self.cfg.sustain_windows - 1):
            return  # the fastest rank keeps changing: jitter, not one late rank
        host = ks.rank_host.get(rank)
        v = Verdict(
            "straggler", "straggler", scope=host if host is not None else f"{ks.comm}/{rank}",
            host=host, rank=rank,
            evidence={"rank_scores": sc.rank_scores, "comm": ks.comm,
                      "spread_effect": round(spread_effect, 6), "waiting_share": sc.waiting,
                      **process_evidence(ks, rank)},
        )
        member = (*ks.tuple, "spread")
        inc = self.book.find_live(job, "straggler", v.scope) or self.book.reopen(job, "straggler", v.scope, out)
        start = ks.spread_rule.start_ns if ks.spread_rule.start_ns is not None else job.watermark
        b = ks.baseline
        if inc is None:
            inc = self.book.open(job, v, start, ks)
            inc.trigger = member
            inc.add_window(max(ks.last_effect, 0.0), ks.last_observed, b, True)
            inc.members.append(member)
            inc.n_members += 1
            inc.listed.append({**ks.describe(), "effect": round(ks.last_effect, 6)})
            inc.peak = max(inc.peak, spread_effect)
            inc.confirmed = False
            ks.spread_incident = inc.id
            self.book.confirm(job, inc, out)
            return
        elif member not in inc.members:
            inc.members.append(member)
            inc.n_members += 1
            if len(inc.listed) < MAX_LISTED_KEYS:
                inc.listed.append({**ks.describe(), "effect": round(ks.last_effect, 6)})
        ks.spread_incident = inc.id

    def _spread_resolved(self, job: JobState, ks: KeyView, out: list) -> None:
        inc = job.incidents.get(ks.spread_incident) if ks.spread_incident else None
        ks.spread_incident = None
        if inc is None:
            return
        member = (*ks.tuple, "spread")
        if member in inc.members:
            inc.members.remove(member)
        end = ks.spread_rule.end_ns if ks.spread_rule.end_ns is not None else job.watermark
        inc.end_ns = max(inc.end_ns or end, end)
        if not inc.members:
            self.book.resolve(job, inc, out)

    # --- incidents from keys ------------------------------------------------------

    def _key_fired(self, job: JobState, ks: KeyView, fired: FireEvidence, out: list) -> None:
        v = attribute(
            ks,
            job.keys.values(),
            straggler_rank=fired.straggler_rank,
            rank_scores=fired.rank_scores,
            now_ns=job.watermark,
            recent_ns=job.lateness_ns + 2 * ks.window_ns,
        )
        # a mixed key joins the node's intra_node incident
        scope = None if v.type == "intra_node" and ks.transport != "nvlink" else v.scope
        inc = self.book.find_live(job, v.type, scope) or self.book.reopen(job, v.type, scope, out)
        start = ks.rule.start_ns if ks.rule.start_ns is not None else job.watermark
        created = inc is None
        if inc is None:
            inc = self.book.open(job, v, start, ks)
            inc.confirmed = False
        if fired.flapping:
            inc.evidence["flapping"] = True  # on and off, not one streak: on call should know
        self.book.join(inc, ks)
        if created:
            self.book.confirm(job, inc, out)

    # --- maintenance ticks --------------------------------------------------------

    def _tick(self, job: JobState, out: list) -> None:
        for ks, start in due(job, job.pending_keys):  # groups that waited long enough
            self._close_upto(job, ks, start, out)
        self._check_telemetry(job, out)
        self._check_silent_members(job, out)
        self.drops.decide(job, out)
        self.stall_incidents.check(job, out)
        self.book.refresh(job, out)

    def _close_all(self, job: JobState, out: list) -> None:
        for ks in list(job.pending_keys.values()):
            if ks.pending:
                self._close_upto(job, ks, max(ks.pending), out)

    def _check_silent_members(self, job: JobState, out: list) -> None:
        now = job.watermark
        for inc in list(job.incidents.values()):
            if inc.type not in COMM_TYPES or is_stall(inc):
                continue  # a stall has no keys: it ends when operations complete again
            for gk in list(inc.members):
                ks = job.keys.get(gk[:4])
                if ks is not None and now - ks.last_end_ns <= self._timeout_ns:
                    continue
                last = ks.last_end_ns if ks is not None else now
                if ks is not None and len(gk) > 4:
                    ks.spread_rule.force_resolve(last)
                    ks.spread_incident = None
                elif ks is not None:
                    ks.rule.force_resolve(last)
                    ks.incident = None
                    ks.hold = []
                inc.members.remove(gk)
                inc.end_ns = max(inc.end_ns or last, last)
            if not inc.members:
                self.book.resolve(job, inc, out, reason="keys_silent")

    def _check_telemetry(self, job: JobState, out: list) -> None:
        if any(is_stall(inc) for inc in job.incidents.values()):
            # The whole job waited: the first rank back is not the others' silence.
            return
        tel = job.telemetry
        problems = tel.check(job.watermark, self._timeout_ns)
        for inc in list(job.incidents.values()):
            if inc.type == "telemetry_loss" and inc.scope not in problems:
                # Ended when the host came back, or at its last drop.
                resumed = tel.resumed.pop(inc.scope, None)
                if resumed is not None and resumed >= inc.start_ns:
                    inc.end_ns = resumed
                elif inc.end_ns is None:
                    inc.end_ns = job.watermark
                self.book.resolve(job, inc, out)
        for host in list(tel.resumed):
            if host not in problems and job.find("telemetry_loss", host) is None:
                del tel.resumed[host]  # a gap that was no incident (the whole job paused)
        for host, p in problems.items():
            severity = "warning" if (p["silent_host"] or p["silent_ranks"]) else "info"
            ranks = {r for _, r in p["silent_ranks"]}
            evidence = {k: v for k, v in p.items() if k != "since_ns"}
            evidence["timeout_s"] = self.cfg.telemetry_timeout_s
            inc = job.find("telemetry_loss", host)
            if p["drops"] is not None and not (p["silent_host"] or p["silent_ranks"]):
                tel.resumed.pop(host, None)
            detected = max(job.watermark, p["since_ns"])
            if inc is None and self.book.paused(job, p["since_ns"]):
                continue  # its ranks wait for a checkpoint's writer: nothing completes
            if inc is None:
                v = Verdict(
                    "telemetry_loss", "telemetry", scope=host, host=host,
                    rank=next(iter(ranks)) if len(ranks) == 1 else None,
                )
                inc = self.book.open(job, v, p["since_ns"], None)
                inc.evidence = evidence
                inc.severity = severity
                inc.detected_ns = detected
                self.book.emit(inc.event("firing", detected), out)
            elif SEVERITY_RANK[severity] > SEVERITY_RANK[inc.severity]:
                inc.severity = severity
                inc.evidence = evidence
                self.book.emit(inc.event("firing", detected), out)
            if p["drops"] is not None:
                inc.end_ns = p["drops"]["last_ns"]

    def _job_silent(self, job: JobState, out: list) -> None:
        """The whole job stopped reporting: nothing can recover, so end what is open."""
        job.silent = True
        for ks in job.keys.values():
            if ks.rule.firing:
                ks.rule.force_resolve(ks.last_end_ns)
            if ks.spread_rule.firing:
                ks.spread_rule.force_resolve(ks.last_end_ns)
            ks.incident = None
            ks.spread_incident = None
            ks.hold = []
        tp = job.throughput
        if tp.rule.firing:
            tp.rule.force_resolve(tp.ts_ns)
        tp.pending_fire = None
        tp.clear = 0
        job.tp_suppressed = False
        for inc in list(job.incidents.values()):
            if is_stall(inc):
                # A hung job falls silent too (the plugin gives up on an op after
                # NCCLWATCH_OP_TIMEOUT_MS): what held it up is still unresolved.
                continue
            if inc.end_ns is None:
                inc.end_ns = max(job.watermark, job.throughput.ts_ns)
            self.book.resolve(job, inc, out, reason="job_silent")

    # --- throughput ---------------------------------------------------------------

    def _throughput(self, rec: ThroughputRecord, out: list) -> None:
        job = self._job_named(rec.job)
        if rec.ts_ns > self.last_end_ns:
            self.last_end_ns = rec.ts_ns
        if job.silent and rec.ts_ns > job.watermark:
            job.silent = False
        if job.pauses.open_since and job.pauses.stepped(rec.ts_ns) and self.observer is not None:
            self.observer.job_pause(job.job, False)
        tp = job.throughput
        steps = tp.add(rec)
        if steps:
            if self.observer is not None:
                for _, value in steps:
                    self.observer.throughput(job.job, value)
            w = job.window_ns or DEFAULT_WINDOW_NS
            for end, value, filled in tp.windows(steps, w):
                self.drops.step(job, end - w, end, value, out, filled)

    def _pause(self, rec: PauseRecord, out: list) -> None:
        job = self._job_named(rec.job)
        if rec.ts_ns > self.last_end_ns:
            self.last_end_ns = rec.ts_ns
        job.pauses.see(rec)
        if self.observer is not None:
            self.observer.job_pause(job.job, bool(job.pauses.open_since))

    # --- telemetry records ----------------------------------------------------------

    def _drop(self, rec: DropRecord, out: list) -> None:
        job = self._job_named(rec.job)
        job.telemetry.see_drop(rec.host, rec.ts_ns, rec.count, rec.reason)

    def _plugin_stats(self, rec: PluginStats, out: list) -> None:
        job = self._job_named(rec.job)
        job.telemetry.see_plugin_stats(rec.host, rec.pid, rec.ts_ns, rec.dropped)

    def _progress(self, rec: ProgressRecord, out: list) -> None:
        job = self._job_named(rec.job)
        if rec.ts_ns > self.last_end_ns:
            self.last_end_ns = rec.ts_ns
        self.stall_incidents.see(job, rec, out)

    def _ignore(self, rec: Any, out: list) -> None:
        return None

    # --- persistence --------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """Everything needed to continue, as plain JSON types."""
        return {
            "version": STATE_VERSION,
            "records_total": dict(self.records_total),
            "late_windows": self.late_windows,
            "last_end_ns": self.last_end_ns,
            "jobs": [[name, _job_state(job)] for name, job in self._jobs.items()],
        }

    @classmethod
    def from_state(
        cls,
        cfg: Any,
        state: dict[str, Any],
        *,
        model: BusbwModel | str | Path | None = None,
        clock: Callable[[], float] | None = None,
    ) -> Pipeline:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unknown pipeline state version {state.get('version')!r}")
        p = cls(cfg, model=model, clock=clock)
        p.records_total = dict(state["records_total"])
        p.late_windows = state["late_windows"]
        p.last_end_ns = state["last_end_ns"]
        for name, js in state["jobs"]:
            p._jobs[name] = _job_from_state(name, js, p.cfg, p._p)
        return p


def _job_state(job: JobState) -> dict[str, Any]:
    return {
        "watermark": job.watermark,
        "next_tick": job.next_tick_ns,
        "window_ns": job.window_ns,
        "lateness_ns": job.lateness_ns,
        "silent": job.silent,
        "keys": [[*gk, _key_state(ks, job.keys[gk])] for gk, ks in job.stage.items()],
        # keys known from verdicts only (the job stage fed by key stages elsewhere)
        "views": [[*gk, v.to_state()] for gk, v in job.keys.items() if gk not in job.stage],
        "pending_keys": [list(gk) for gk in job.pending_keys],
        "telemetry": job.telemetry.to_state(),
        "throughput": job.throughput.to_state(),
        "incidents": [inc.to_state() for inc in job.incidents.values()],
        "tp_suppressed": job.tp_suppressed,
        "resolved": [inc.to_state() for inc in job.resolved.values()],
        "stalls": job.stalls.to_state(),
        "pauses": job.pauses.to_state(),
    }


def _key_state(ks: KeyState, view: KeyView) -> dict[str, Any]:
    # The job stage's part also where states saved before the split kept it, so a
    # state saved now still loads in a build from before it.
    return {**ks.to_state(), "hold": [list(h) for h in view.hold], "incident": view.incident,
            "spread_incident": view.spread_incident, "view": view.to_state()}


def _job_from_state(name: str, st: dict[str, Any], cfg: DetectorConfig, p: KeyParams) -> JobState:
    job = JobState(name, cfg)
    job.watermark = st["watermark"]
    job.next_tick_ns = st["next_tick"]
    job.window_ns = st["window_ns"]
    job.lateness_ns = st["lateness_ns"]
    job.silent = st["silent"]
    for *gk, ks_state in st["keys"]:
        key = tuple(gk)
        ks = job.stage[key] = KeyState.from_state(gk, ks_state, p)
        view = ks_state.get("view")
        job.keys[key] = (KeyView.from_key_state(ks, ks_state) if view is None
                         else KeyView.from_state(key, view, cfg.sustain_windows))
    for *gk, view in st.get("views", ()):
        job.keys[tuple(gk)] = KeyView.from_state(tuple(gk), view, cfg.sustain_windows)
    for gk in st["pending_keys"]:
        job.pending_keys[tuple(gk)] = job.stage[tuple(gk)]
    job.telemetry = TelemetryTracker.from_state(st["telemetry"])
    job.throughput = ThroughputTracker.from_state(cfg, st["throughput"])
    for inc_state in st["incidents"]:
        inc = Incident.from_state(inc_state)
        job.incidents[inc.id] = inc
    job.tp_suppressed = st["tp_suppressed"]
    for inc_state in st.get("resolved", ()):  # absent before 2026-11-26
        inc = Incident.from_state(inc_state)
        job.resolved[(inc.type, inc.scope)] = inc
    if "stalls" in st:  # absent before 2026-11-29
        job.stalls = StallTracker.from_state(st["stalls"])
    if "pauses" in st:  # absent before 2026-12-07
        job.pauses = Pauses.from_state(st["pauses"])
    return job


def detect_all(records: Any, cfg: Any, *, model: Any = None) -> list[AnomalyEvent]:
    """Run a finite stream through a fresh pipeline; flush at the end (open stays open)."""
    p = Pipeline(cfg, model=model)
    out: list[AnomalyEvent] = []
    for rec in records:
        out += p.process(rec)
    out += p.flush()
    return out
