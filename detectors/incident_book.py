"""A job's incidents from open to resolved: the one place that raises and ends them.

The job stage (:class:`~.pipeline.Pipeline`) decides *that* a key fired, a rank
straggles or the throughput dropped; :class:`IncidentBook` keeps what follows: which open
incident a key joins (or which recent one fires again), when a quiet incident is worth a
page (:meth:`IncidentBook.confirm`: its cost to the job's throughput, the transport class
that degraded now, the causes that explain it as another's echo), and how it ends.
Nothing here reads a clock: times are the job's stream time.
"""

from __future__ import annotations

from typing import Any

from ncclwatch.config import DetectorConfig
from ncclwatch.records import AnomalyEvent
from ncclwatch.rules import NETWORK_TRANSPORTS, size_bucket_bytes

from .attribution import Verdict, degraded_now, measures_link
from .causes import LINK_TYPES, echoed_links, hosts_of, link_trouble, name_late_process, slow_gpu_echo, slowed_alike
from .incidents import MAX_LISTED_KEYS, Incident, incident_id
from .job import JobState
from .keys import KeyView

DEFAULT_WINDOW_NS = 10**9  # throughput windows of a job that has sent no window summary yet
COMM_TYPES = frozenset({"collective_degraded", "network_path", "intra_node", "straggler"})


# Slowing alike (a lower clock, compute contending with NCCL on every GPU) costs NCCL's
# bandwidth what it costs the job's speed; a link's own fault costs its keys more than
# the job, and most more where the job waits on them least.
SLOWER_THAN_ALIKE = 1.4


class IncidentBook:
    """Opens, joins, raises and resolves the incidents of the jobs it is handed.

    It keeps no state of its own (a job's incidents are in its
    :class:`~.job.JobState`), so a restored pipeline needs none of it saved; ``observer``
    (the pipeline's) hears every event it emits.
    """

    def __init__(self, cfg: DetectorConfig):
        self.cfg = cfg
        self.observer: Any = None
        self._timeout_ns = int(cfg.telemetry_timeout_s * 1e9)

    def early_span_ns(self, job: JobState) -> int:
        """How long after its start an incident must show its cost to be raised."""
        return self.cfg.sustain_windows * (job.window_ns or DEFAULT_WINDOW_NS)

    def paused(self, job: JobState, since_ns: int, now_ns: int | None = None) -> bool:
        """Trouble that began at ``since_ns`` is the job's checkpoint save or its
        aftermath as of ``now_ns`` (default: the job's stream time) (:class:`~.pauses.Pauses`,
        grace: the early span): held, not raised."""
        return job.pauses.excuses(since_ns, job.watermark if now_ns is None else now_ns, self.early_span_ns(job))

    def find_live(self, job: JobState, type_: str, scope: str | None) -> Incident | None:
        """An open incident a newly fired key can join: raised, or still young.

        One that stayed quiet past its early span was harmless; a key firing now has a
        cause of its own and opens its own incident.
        """
        late = job.watermark - self.early_span_ns(job) - job.lateness_ns
        for inc in job.incidents.values():
            if (inc.type == type_ and (scope is None or inc.scope == scope)
                    and (inc.confirmed or inc.start_ns >= late)):
                return inc
        return None

    def reopen(self, job: JobState, type_: str, scope: str | None, out: list) -> Incident | None:
        """The incident of this type and scope that resolved within ``reopen_s``, firing
        again under its own id (an intermittent fault, not a new one), or None."""
        since = job.watermark - int(self.cfg.reopen_s * 1e9)
        for k, inc in list(job.resolved.items()):
            if inc.end_ns is None or inc.end_ns < since:
                del job.resolved[k]
        found = next((k for k in job.resolved if k[0] == type_ and (scope is None or k[1] == scope)),
                     None)
        if found is None:
            return None
        inc = job.resolved.pop(found)
        inc.end_ns = None
        inc.members = []
        inc.evidence.pop("resolved_because", None)
        inc.evidence["reopened"] = inc.evidence.get("reopened", 0) + 1
        inc.detected_ns = job.watermark
        job.incidents[inc.id] = inc
        self.emit(inc.event("firing", job.watermark), out)
        return inc

    def reports_throughput(self, job: JobState) -> bool:
        ts = job.throughput.ts_ns
        return ts > 0 and job.watermark - ts <= self._timeout_ns

    def confirm(self, job: JobState, inc: Incident, out: list) -> None:
        """Raise a comm incident once it is worth a page, else keep it quiet.

        A job that reports its throughput: once the job lost at least
        ``throughput_drop`` of it since the incident began (then it is critical). A
        job that does not, or has no throughput from before the incident (a cold
        start): once the loss of bus bandwidth reached ``threshold_without_throughput``
        (a warning: its cost is unknown). Until then
        the incident's keys stay out of their baselines, so a slow start is not learned.
        """
        cfg = self.cfg
        if self.paused(job, inc.start_ns):
            return  # a rank writing a checkpoint, the others waiting for it
        if (job.pauses.began_in(inc.start_ns, self.early_span_ns(job)) is not None
                and not any(job.keys[gk].last_effect >= cfg.recover_threshold
                            for gk in inc.members if gk in job.keys)):
            return  # begun in a save and over with it: its keys recover quietly
        loss = self.job_loss(job, inc)
        measured = loss is not None
        if loss is not None:
            now, early = loss
            if now > -cfg.throughput_drop or early > -cfg.throughput_drop / 2:
                return
        elif inc.peak < cfg.threshold_without_throughput:
            return  # no throughput, or none from before the incident (a cold start)
        if inc.type == "collective_degraded":
            if job.watermark <= inc.detected_ns:
                return  # opened by its window's first key: the others may say "the path"
            if not self.widened(job, inc):
                return  # merged into the network incident
        if inc.type in LINK_TYPES:
            if not self.reattribute(job, inc):
                return
            if slow_gpu_echo(job, inc, cfg.straggler_score):
                return  # the straggler's GPU slows its own transfers too: one cause
            if loss is not None and slowed_alike(job, inc.type == "network_path", -loss[0], self.cfg.link_share_rise):
                return  # the job's own slowdown (throughput_drop), not its links'
        if inc.type == "straggler":
            # Ranks also wait differently when the transfer itself slows: give the
            # communicator's links the windows they need to say so before naming a rank.
            window = job.window_ns or DEFAULT_WINDOW_NS
            if job.watermark < inc.start_ns + (cfg.sustain_windows + 1) * window:
                return
            # Late since before the loss began: something later costs the job. Past twice
            # the gate the first windows need only show a clear loss: a badly slowed job's
            # sparse steps straddle the incident's start and dilute its early measure.
            if loss is not None and loss[1] > -cfg.straggler_early_share * min(-loss[0], 2 * cfg.throughput_drop):
                return
            name_late_process(job, inc)
            if (link_trouble(job, inc.evidence.get("comm"), cfg.straggler_score)
                    or echoed_links(job, inc, int(cfg.reopen_s * 1e9))):
                return  # one cause: the link
        if inc.id not in job.incidents:
            return  # merged into an open incident of the same cause
        inc.confirmed = True
        inc.detected_ns = job.watermark
        self.set_throughput(job, inc)
        if measured:
            inc.severity = "critical"  # it costs the job at least throughput_drop
        self.emit(inc.event("firing", job.watermark), out)

    def job_loss(self, job: JobState, inc: Incident) -> tuple[float, float] | None:
        """``(now, early)``: the job's throughput change over its last ``sustain_windows``
        windows and over the incident's first ones, each against the minute before the
        incident; None when the job reports none from before it."""
        if not self.reports_throughput(job):
            return None
        # Now: a ramp is raised when it costs the gate, not when its average since onset
        # does. Early: a degradation that had been harmless for a while (a rank-order
        # flip, a drift) does not take the blame for a loss something else started later.
        tp = job.throughput
        # Steps (or a trainer's log lines) sparser than the span: each side spans the
        # time between two of them at least, and a step counts for the incident when
        # most of the time it reports (since the one before) came after its start.
        now_ns = job.watermark
        gap = tp.step_gap_ns(now_ns)
        span = max(self.early_span_ns(job), gap)
        start = inc.start_ns + gap // 2
        now = tp.delta(max(start, now_ns - span), now_ns, before_ns=inc.start_ns)
        early = tp.delta(start, min(now_ns, start + span))
        return None if now is None or early is None else (now, early)

    def excused(self, job: JobState, inc: Incident) -> bool:
        """A quiet incident that is not NCCL's trouble: a link incident whose class slowed
        alike with the job (:func:`~.causes.slowed_alike`), or a straggler that only echoes such
        link incidents (:func:`~.causes.echoed_links`)."""
        if inc.confirmed:
            return False
        if inc.type == "straggler":
            links = echoed_links(job, inc)
            return bool(links) and all(self.excused(job, o) for o in links)
        if inc.type not in LINK_TYPES:
            return False
        loss = self.job_loss(job, inc)
        if loss is None or inc.effect > SLOWER_THAN_ALIKE * -loss[0]:
            # Its keys lost far more bandwidth than the job lost speed: whatever their
            # share of a window says (a job of one or two syncs a second measures it in
            # whole operations), that is not everything slowing alike.
            return False
        return slowed_alike(job, inc.type == "network_path", -loss[0], self.cfg.link_share_rise)

    def reattribute(self, job: JobState, inc: Incident) -> bool:
        """Name the transport class that degraded now, whichever key fired first.

        Returns False while it names no class: only a minority of the NVLink keys
        dipping while the network keys hold.
        """
        nv_bad, nv_ok, net_bad, net_ok = self._class_counts(job, inc)
        # NVLink first (a node's trouble slows its mixed keys too), unless the network
        # keys degraded more widely: starved proxies slow every network key and one of
        # two NVLink keys, which is the network's trouble reaching into the node.
        if nv_bad and nv_bad >= nv_ok and nv_bad * (net_bad + net_ok) >= net_bad * (nv_bad + nv_ok):
            want = "intra_node"
        elif net_bad:
            want = "network_path"
        elif nv_bad and self._only_echoes(job, inc):
            # Every straggler that would explain the dip is held as this incident's echo
            # in turn: one of them must be the cause, or a fault that slows a node's
            # NVLink and makes its ranks late (another process's copies over it) is
            # never raised at all. The transfer that slowed on its least-waiting rank is.
            want = "intra_node"
        else:
            # A few NVLink keys dipping while most hold is not the node's NVLink: it is
            # what a late rank does to the operation it is late for (the straggler is
            # its own incident), or noise.
            return False
        inc.evidence.update({"nvlink_keys_degraded": nv_bad, "nvlink_keys_holding": nv_ok,
                             "network_keys_degraded": net_bad})
        return self._retype(job, inc, want)

    def widened(self, job: JobState, inc: Incident) -> bool:
        """A ``collective_degraded`` incident of network keys whose class has degraded
        more widely since its key fired: it is the path's trouble (a job without
        NVLink keys has no holding class to tell it sooner, so the first network key
        to fire stands alone for a window or two). Retyped, or merged into the open
        ``network_path`` incident (then False: it is gone)."""
        if not inc.members or any(len(gk) != 4 or gk[3] not in NETWORK_TRANSPORTS for gk in inc.members):
            return True
        # A network key that lost a drop-out's share since counts too (1-s pulses never
        # hold two keys degraded at once; KeyView.slowed_ns).
        nv_bad, _, net_bad, _ = self._class_counts(job, inc, slowed_since=inc.start_ns)
        if nv_bad or net_bad < 2:
            return True
        inc.evidence.update({"network_keys_degraded": net_bad, "widened_from": "collective_degraded"})
        return self._retype(job, inc, "network_path")

    def _class_counts(self, job: JobState, inc: Incident, slowed_since: int | None = None
                      ) -> tuple[int, int, int, int]:
        """``(nvlink degraded, nvlink holding, network degraded, network holding)``
        among the job's live keys, ``inc``'s own counted degraded; with
        ``slowed_since``, a key that lost a drop-out's share since then too."""
        now = job.watermark
        recent = job.recent_ns
        # Keys that were degraded well before this incident began are another story.
        since = inc.start_ns - self.early_span_ns(job)
        nv_bad = nv_ok = net_bad = net_ok = 0
        # the pace of the link the incident's keys cross: what a holding key is held to
        ref = max((k.baseline for k in job.keys.values() if k.incident == inc.id and k.baseline), default=None)
        # ... and the size of its messages (the largest of its keys')
        bucket = max((k.size_bucket for k in job.keys.values() if k.incident == inc.id),
                     key=size_bucket_bytes, default=None)
        for k in job.keys.values():
            if not k.warm or now - k.last_end_ns > recent:
                continue
            bad = k.incident == inc.id or slowed_since is not None and k.slowed_ns >= slowed_since
            if not bad and degraded_now(k):
                started = k.rule.start_ns if k.rule.firing else None
                if started is not None and started < since:
                    continue
                bad = True
            if k.transport == "nvlink":
                nv_bad += bad
                nv_ok += not bad
            elif k.transport in NETWORK_TRANSPORTS:
                net_bad += bad
                net_ok += not bad and measures_link(k, ref, bucket)
        return nv_bad, nv_ok, net_bad, net_ok

    def _retype(self, job: JobState, inc: Incident, want: str) -> bool:
        """Make ``inc`` a ``want`` (link) incident: in place, or its keys joining the
        open incident of that type (then False: ``inc`` is gone)."""
        if want == inc.type:
            return True
        other = next((i for i in job.incidents.values()
                      if i is not inc and i.type == want), None)
        if other is not None:  # the cause already has an incident: the keys join it
            for gk in inc.members:
                ks = job.keys.get(gk[:4])
                if ks is not None and len(gk) == 4:
                    ks.incident = other.id
                other.members.append(gk)
                other.n_members += 1
            other.listed.extend(inc.listed[:max(0, MAX_LISTED_KEYS - len(other.listed))])
            if want == "network_path":
                other.evidence["hosts"] = hosts_of(job, other.members)
            del job.incidents[inc.id]
            return False
        del job.incidents[inc.id]
        inc.type = want
        inc.attribution = "network" if want == "network_path" else "intra_node"
        inc.scope = "" if want == "network_path" else (inc.host or "")
        if want == "network_path":
            inc.host = None  # a path between nodes: the nodes are in evidence["hosts"]
            inc.evidence["hosts"] = hosts_of(job, inc.members)
        inc.id = incident_id(job.job, inc.type, inc.scope, inc.start_ns)
        job.incidents[inc.id] = inc
        for gk in inc.members:
            ks = job.keys.get(gk[:4])
            if ks is not None and len(gk) == 4:
                ks.incident = inc.id
        return True

    @staticmethod
    def _only_echoes(job: JobState, inc: Incident) -> bool:
        """The job has straggler incidents, none raised, and each is held as an echo of
        ``inc`` (:func:`~.causes.echoed_links`): a late rank cannot be what explains
        ``inc`` when ``inc`` is what explains the late rank."""
        late = [s for s in job.incidents.values() if s.type == "straggler"]
        return bool(late) and all(not s.confirmed and inc in echoed_links(job, s) for s in late)

    def open(self, job: JobState, v: Verdict, start: int, ks: KeyView | None) -> Incident:
        cfg = self.cfg
        inc = Incident(
            id=incident_id(job.job, v.type, v.scope, start),
            type=v.type,
            attribution=v.attribution,
            scope=v.scope,
            job=job.job,
            host=v.host,
            rank=v.rank,
            start_ns=start,
            detected_ns=job.watermark,
            severity="warning",
            evidence={
                **v.evidence,
                "threshold": cfg.threshold,
                "sustain_windows": cfg.sustain_windows,
            },
        )
        if ks is not None:
            inc.key = ks.describe()
            inc.trigger = ks.tuple
        job.incidents[inc.id] = inc
        return inc

    def join(self, inc: Incident, ks: KeyView) -> None:
        gk = ks.tuple
        st = ks.fire_streak
        inc.eff_sum += st.effect_sum
        inc.eff_n += st.windows
        inc.peak = max(inc.peak, st.peak)
        if inc.trigger == gk:
            inc.obs_sum += st.observed_sum
            inc.base_sum += st.baseline_sum
            inc.ob_n += st.windows
        inc.drift = inc.drift or st.drift
        inc.members.append(gk)
        inc.n_members += 1
        if len(inc.listed) < MAX_LISTED_KEYS:
            d = ks.describe()
            mean = st.mean_effect()
            d["effect"] = None if mean is None else round(mean, 6)
            inc.listed.append(d)
        desc = ks.describe()
        for f, val in desc.items():
            if inc.key.get(f) != val:
                inc.key[f] = None
        ks.incident = inc.id
        if inc.type == "network_path":
            inc.evidence["hosts"] = sorted(set(inc.evidence.get("hosts", ())) | set(ks.rank_host.values()))

    def key_resolved(self, job: JobState, ks: KeyView, end_ns: int | None, out: list) -> None:
        inc = job.incidents.get(ks.incident) if ks.incident else None
        ks.incident = None
        ks.hold = []
        if inc is None:
            return
        gk = ks.tuple
        if gk in inc.members:
            inc.members.remove(gk)
        end = end_ns if end_ns is not None else job.watermark
        inc.end_ns = max(inc.end_ns or end, end)
        if not inc.members:
            self.resolve(job, inc, out)

    def resolve(self, job: JobState, inc: Incident, out: list, reason: str | None = None) -> None:
        if not inc.confirmed:  # never raised: ends as quietly as it began
            del job.incidents[inc.id]
            return
        if inc.end_ns is None:
            inc.end_ns = job.watermark
        inc.end_ns = max(inc.end_ns, inc.start_ns)
        if inc.type in COMM_TYPES or inc.type == "throughput_drop":
            d = job.throughput.delta(inc.start_ns, inc.end_ns)
            if d is not None:
                inc.throughput_delta = d
        if reason:
            inc.evidence["resolved_because"] = reason
        del job.incidents[inc.id]
        self.emit(inc.event("resolved", max(job.watermark, inc.end_ns)), out)
        if self.cfg.reopen_s > 0 and inc.type in COMM_TYPES and not reason:
            if len(job.resolved) >= 64:
                del job.resolved[next(iter(job.resolved))]
            job.resolved[(inc.type, inc.scope)] = inc

    def set_throughput(self, job: JobState, inc: Incident) -> bool:
        """Refresh a comm incident's throughput delta; True if its severity rose.

        Only steps up to the job's window stream time count: throughput records reach
        the detector sooner than windows, by an amount that depends on the driver, and
        the verdict must not (watch, the worker and replay give the same events).
        """
        d = job.throughput.delta(inc.start_ns, job.watermark)
        inc.throughput_delta = d
        if d is not None and d <= -self.cfg.throughput_drop and inc.severity != "critical":
            inc.severity = "critical"
            return True
        return False

    def emit(self, ev: AnomalyEvent, out: list) -> None:
        out.append(ev)
        if self.observer is not None:
            self.observer.event(ev)

    def refresh(self, job: JobState, out: list) -> None:
        tinc = job.find("throughput_drop", "")
        if tinc is not None and tinc.severity == "info":
            # Raised on its first windows: a drop that deepens past twice the gate over
            # sustain_windows windows is a warning (the same id fires again). Steps up to
            # the windows' stream time only, as _set_throughput.
            now = job.watermark
            d = job.throughput.delta(max(tinc.start_ns, now - self.early_span_ns(job)), now,
                                     before_ns=tinc.start_ns)
            if d is not None and d <= -2 * self.cfg.throughput_drop:
                tinc.severity = "warning"
                self.emit(tinc.event("firing", now), out)
        for inc in list(job.incidents.values()):
            if inc.type not in COMM_TYPES or inc.id not in job.incidents:
                continue
            if not inc.confirmed:
                self.confirm(job, inc, out)
            elif self.set_throughput(job, inc):
                self.emit(inc.event("firing", job.watermark), out)
