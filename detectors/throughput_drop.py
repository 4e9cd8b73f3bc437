"""When a job's throughput drop is raised as ``throughput_drop``: NCCL's or not.

A sustained drop of the job's TFLOP/s (its :class:`~.throughput.ThroughputTracker`) is
held until the communication windows of the same seconds are in; a drop that a comm
incident explains is that incident's cost, not an incident of its own, unless it outlasts
the comm trouble by ``sustain_windows`` windows ("not NCCL"), or is held for
``throughput_hold_windows`` windows while no comm anomaly is raised. A held drop in
which the job completed no step for ``sustain_windows`` windows (a stall), with no comm
anomaly raised in all its time, is raised as it ends if the hold has not let it go.
"""

from __future__ import annotations

from ncclwatch.rules import NETWORK_TRANSPORTS

from .attribution import Verdict, degraded_now, rule_degraded
from .baseline import learn_or_hold
from .causes import slowed_alike
from .incident_book import COMM_TYPES, DEFAULT_WINDOW_NS, IncidentBook
from .incidents import Incident
from .job import JobState
from .sustained import FIRE, RESOLVE


class ThroughputDrops:
    """Feeds a job's completed throughput windows to its drop rule and raises, holds or
    ends its ``throughput_drop`` incident through ``book``."""

    def __init__(self, book: IncidentBook):
        self.book = book
        self.cfg = book.cfg
        self._timeout_ns = int(book.cfg.telemetry_timeout_s * 1e9)

    def comm_trouble(self, job: JobState, since_ns: int | None = None) -> bool:
        """A comm incident is open, or a key is degraded now (or, with ``since_ns``, was
        at any time since then: a fault too short to fire a key still cost the steps)."""
        excused: set[str | None] = set()
        for inc in job.incidents.values():
            if inc.type in COMM_TYPES:
                if not self.book.excused(job, inc):
                    return True
                excused.add(inc.id)
        # Keys not in an incident yet: a class that slowed alike with the job is not the
        # cause of its drop either (the drop measured since it began).
        tp = job.throughput
        since = since_ns if since_ns is not None else tp.rule.start_ns if tp.rule.firing else None
        d = None if since is None else tp.delta(since, job.watermark)
        alike: dict[bool, bool] = {}  # per class, asked only of a degraded key (a scan each)
        now = job.watermark
        recent = job.recent_ns
        for ks in job.keys.values():
            if ks.incident in excused:
                continue
            live = now - ks.last_end_ns <= recent
            if live and rule_degraded(ks.spread_rule):
                return True  # a late rank: not a class's bandwidth, whatever it did
            if since_ns is not None and ks.dropout_ns >= since_ns:
                # Its share of the ranks' time rose in the drop-out and fell back: the
                # windows since would call it slowed alike with the job.
                return True
            if not ((live and degraded_now(ks)) or (since_ns is not None and ks.warm and ks.degraded_ns >= since_ns)):
                continue
            if ks.incident is None:
                net = ks.transport in NETWORK_TRANSPORTS
                if net not in alike:
                    alike[net] = d is not None and slowed_alike(job, net, -d, self.cfg.link_share_rise)
                if alike[net]:
                    continue
            return True
        return False

    def comm_incident(self, job: JobState) -> bool:
        """A comm anomaly is raised and is NCCL's trouble (one opened but never confirmed
        is not: nobody has been told of it)."""
        return any(inc.type in COMM_TYPES and inc.confirmed and not self.book.excused(job, inc)
                   for inc in job.incidents.values())

    def step(self, job: JobState, start: int, end: int, value: float, out: list, filled: bool = False) -> None:
        """One completed throughput window ``[start, end)`` with its mean TFLOP/s
        (``filled``: a later step's, which spans it: the baseline has it once)."""
        cfg = self.cfg
        tp = job.throughput
        base = tp.baseline
        effect = base.score_one(value)
        degraded = effect >= cfg.throughput_drop and base.zscore(value) >= self.cfg.z_min
        was_firing = tp.rule.firing
        transition = tp.rule.update(effect, start, degraded)
        trouble = self.comm_trouble(job)
        if transition is None and not tp.rule.firing and not trouble:
            if not filled:
                tp.unlearned = learn_or_hold(base, tp.unlearned, value, degraded)
            elif not base.warm:
                base.span_warmup()  # a line over several windows warms up for their time
        else:
            tp.unlearned = []
        tinc = job.find("throughput_drop", "")
        if was_firing and tinc is not None:
            tinc.add_window(effect, None, None, False)
        if transition == FIRE:
            tp.pending_fire = tp.rule.start_ns if tp.rule.start_ns is not None else start
            tp.fire_ts, tp.fire_wait_ns = end, 0
            tp.carried, tp.stalled = False, 0
            if filled:
                # A line's mean over several windows, whose loss may lie in its last
                # second: NCCL is judged on the windows up to the line, and its keys get
                # the windows they need to call a fault that began there sustained.
                w = end - start
                tp.fire_ts = max(end, tp.win_start + w)
                tp.fire_wait_ns = self.cfg.sustain_windows * w
        elif transition == RESOLVE:
            began = tp.rule.start_ns if tp.rule.start_ns is not None else start
            ended = tp.rule.end_ns if tp.rule.end_ns is not None else start
            if (job.tp_suppressed and tinc is None and cfg.throughput_hold_windows
                    and tp.stalled >= cfg.sustain_windows and not tp.carried
                    and not self.comm_incident(job)
                    and not self.book.paused(job, began, ended)):
                # The job completed no step for seconds (a rank stopped: every key drops
                # out with it, which held the drop), no comm anomaly was raised, and it was
                # over before the hold ran out. The loss still happened: said now, as the
                # hold would have said it. (Not if a checkpoint save it began in explains
                # it: it ended with the save.)
                tinc = self._raise(job, began, ended, tp.held, out)
            job.tp_suppressed = False
            tp.pending_fire = None
            tp.clear = tp.held = tp.stalled = 0
            if tinc is not None:
                tinc.end_ns = tp.rule.end_ns
                self.book.resolve(job, tinc, out)
        elif job.tp_suppressed and tp.rule.firing and tinc is None and tp.pending_fire is None:
            # A drop a comm anomaly explained: "not NCCL" only if it outlasts NCCL's
            # trouble by sustain_windows windows of its own.
            hold = cfg.throughput_hold_windows
            carried = self.comm_incident(job)
            tp.carried = tp.carried or carried
            tp.held = tp.held + 1 if hold and not carried else 0
            if hold and tp.held >= hold:
                # NCCL's trouble never became an anomaly of its own in all that time
                # (keys dipping or dropping out alongside the job): a sustained loss is
                # not left unsaid for want of a cause.
                tp.pending_fire = tp.rule.start_ns if tp.rule.start_ns is not None else start
                tp.fire_ts, tp.clear = end, 0
            elif degraded and not trouble:
                if not tp.clear:
                    tp.clear_start = start
                tp.clear += 1
                if tp.clear >= cfg.sustain_windows:
                    tp.pending_fire, tp.fire_ts, tp.clear = tp.clear_start, end, 0
            elif trouble or not tp.rule.flapping:
                # A flapping drop's healthy windows between its slow ones are the flap,
                # not the drop ending: only NCCL's trouble starts the count over.
                tp.clear = 0
        if filled and degraded and tp.rule.firing:
            tp.stalled += 1  # after FIRE set it to 0: the window that fired it counts
        self.decide(job, out)
        self.book.refresh(job, out)

    def decide(self, job: JobState, out: list) -> None:
        """Report a sustained throughput drop once the windows of its time are in.

        Throughput records reach the detector sooner than window summaries (a window
        is published after it closes), so at the step that completes a drop the comm
        windows of the same seconds may not be here yet: decide when every active key has
        closed its window of the step's time, when the job has no windows at all, or when
        the windows lag the throughput by more than the telemetry timeout.
        """
        tp = job.throughput
        if tp.pending_fire is None:
            return
        t = tp.fire_ts
        now = job.watermark
        # The comm keys get a few windows more to show theirs: a straggler's spread, say,
        # may need a window more than the steps.
        grace = max(self.cfg.throughput_grace_windows * (job.window_ns or DEFAULT_WINDOW_NS), tp.fire_wait_ns)
        ready = (
            not job.keys
            or tp.ts_ns - now > self._timeout_ns
            or now >= t + grace and all(
                ks.closed_before > t - ks.window_ns
                for ks in job.keys.values()
                if now - ks.last_end_ns <= self._timeout_ns
            )
        )
        if not ready or self.book.paused(job, tp.pending_fire):
            return  # a drop a checkpoint save began is raised only if it outlasts it
        held = tp.held
        # Held long enough: only a comm anomaly actually raised holds it back now.
        forced = 0 < self.cfg.throughput_hold_windows <= held
        if self.comm_incident(job) if forced else self.comm_trouble(job, since_ns=tp.pending_fire):
            # A comm anomaly carries the loss. If the drop outlasts it, step re-arms.
            job.tp_suppressed = True
            tp.carried = tp.carried or self.comm_incident(job)
            tp.pending_fire = None
            return
        tp.held = 0
        start = tp.pending_fire
        tp.pending_fire = None
        self._raise(job, start, tp.fire_ts, held if forced else 0, out)

    def _raise(self, job: JobState, start: int, fire_ts: int, held: int, out: list) -> Incident:
        """Open and emit the job's ``throughput_drop`` over ``[start, fire_ts)`` (``held``:
        windows it waited for NCCL trouble that never became an anomaly)."""
        tp = job.throughput
        cfg = self.cfg
        base = tp.baseline.baseline
        inc = self.book.open(job, Verdict("throughput_drop", "unknown", scope=""), start, None)
        # The steps that made the drop, whatever arrived since: same numbers in any driver;
        # the work done over their time, as the user counts a loss.
        observed, n = tp.mean(start, fire_ts, by_time=True)
        effect = 1.0 - observed / base if observed is not None and base else 0.0
        inc.eff_sum, inc.eff_n, inc.peak = effect * n, n, effect
        inc.severity = "warning" if effect >= 2 * cfg.throughput_drop else "info"
        inc.throughput_delta = tp.delta(start, fire_ts, by_time=True)
        inc.evidence.update(
            {"tflops_baseline": base, "tflops_observed": observed, "threshold": cfg.throughput_drop,
             "after_comm_anomaly": job.tp_suppressed}
        )
        if tp.rule.flapping:
            inc.evidence["flapping"] = True  # slow windows with healthy ones between
        if held:
            # How long it waited for NCCL trouble that never became an anomaly.
            inc.evidence["held_s"] = held * (job.window_ns or DEFAULT_WINDOW_NS) / 1e9
        job.tp_suppressed = False
        detected = max(job.watermark, tp.ts_ns)
        inc.detected_ns = detected
        self.book.emit(inc.event("firing", detected), out)
        return inc
