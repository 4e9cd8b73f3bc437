"""The key stage: one (comm, op, size bucket, transport) of a job, from its ranks'
window summaries to one verdict per window.

A :class:`KeyState` gathers the windows of one key and window start across the ranks of
its communicator (:meth:`KeyState.add`), hands back the groups that are due in start
order (:meth:`KeyState.take_upto`), and turns each into a :class:`KeyVerdict`
(:meth:`KeyState.close`): the key's observation against its own baseline, its sustained
rule's transition, and its ranks' spread against theirs. Everything here reads and writes
this one key only, so keys can be worked on apart; what a verdict sets off across the
job (incidents, attribution, throughput, telemetry) is :mod:`.pipeline`'s, which knows a
key only as the :class:`KeyView` its verdicts built.

:class:`KeyStage` runs the key stage on its own (groups waiting on each communicator's
stream time); :func:`encode_verdict`/:func:`decode_verdict` carry verdicts between
processes, and :class:`VerdictMerge` puts several key stages' verdicts back in one order
for a job stage, as far as their progress marks (:meth:`KeyStage.mark`) allow.
"""

from __future__ import annotations

import heapq
import math
import operator
import time
from collections import deque
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, get_type_hints

import msgspec

from ncclwatch.config import DetectorConfig
from ncclwatch.records import WindowSummary
from ncclwatch.rules import NETWORK_TRANSPORTS

from .attribution import rule_degraded
from .baseline import DriftEvidence, RatioBaseline, learn_or_hold
from .incidents import KeyTuple
from .straggler import MIN_REL, StragglerScorer, relative_exec
from .sustained import FIRE, RESOLVE, SustainedRule

_WS_FIELDS = tuple(f.name for f in fields(WindowSummary))
NEVER = -(1 << 62)  # before any time
TRANSFER_HOLD_MAX = 64  # degraded best-instance windows held back from the key's transfer baseline
BUSY_WARMUP = 10  # windows before a key's time share has a baseline (as `warmup_windows`)
BUSY_FADE = 0.02  # EW weight of a healthy window in that baseline (as the bus bandwidth's)


class KeyParams:
    """The key stage's hyperparameters, derived once from the ``[detector]`` config."""

    def __init__(self, cfg: DetectorConfig):
        self.threshold = cfg.threshold
        self.z_min = cfg.z_min
        self.straggler_score = cfg.straggler_score
        self.straggler_min_wait = cfg.straggler_min_wait
        self.transfer_confirm = cfg.transfer_confirm
        self.drift_freeze_windows = cfg.drift_freeze_windows
        self.silence_ns = int(cfg.telemetry_timeout_s * 1e9)
        self.baseline = {"warmup": cfg.warmup_windows}
        self.drift = {"min_instances": cfg.warmup_windows}
        self.rule = {
            "threshold": cfg.threshold,
            "sustain": cfg.sustain_windows,
            "recover_threshold": cfg.recover_threshold,
            "recover": cfg.recover_windows,
        }
        # Only a key that crosses the network flaps: an NVLink key's windows slow one at a
        # time when its GPU is shared or its rank runs late, which the spread rule and
        # the job stage's straggler checks judge (on every key, the rule turned 9 of the
        # recorded runs wrong; docs/detectors.md).
        self.rule_net = dict(self.rule, flap_count=cfg.flap_count, flap_windows=cfg.flap_windows,
                             flap_threshold=cfg.flap_threshold)
        self.straggler = {"threshold": cfg.straggler_score, "sustain": cfg.sustain_windows}
        self.spread_rule = {
            "threshold": cfg.straggler_score,
            "sustain": cfg.sustain_windows,
            "recover_threshold": cfg.straggler_score / 2,
            "recover": cfg.recover_windows,
        }

    def rule_of(self, transport: str) -> dict[str, Any]:
        """The sustained rule's parameters for a key of ``transport``."""
        return self.rule_net if transport in NETWORK_TRANSPORTS else self.rule

    def dropout(self, transport: str, degraded: bool, effect: float) -> bool:
        """Whether a window of a key of ``transport`` is one its flapping rule counts."""
        r = self.rule_of(transport)
        return SustainedRule.severe(effect, degraded, r.get("flap_count", 0), r.get("flap_threshold", 1.0))


@dataclass(slots=True)
class KeyVerdict:
    """What one closed group of a key says: the key stage's output, the job stage's input.

    Besides the window's scores it carries what the job stage needs to know of the key
    afterwards (its rules, whether it is warm, its baseline), so the job stage keeps
    its own :class:`KeyView` of every key and never reads a :class:`KeyState`.
    """

    KIND: ClassVar[str] = "key_verdict"

    job: str
    key: KeyTuple  # (comm, op, size_bucket, transport)
    comm_name: str
    window_ns: int
    # The group's (rank, host): the job stage's liveness. None: every rank of the
    # communicator, hosts as in the key's rank_host (a complete group; a list of them
    # was most of a verdict's bytes and of the job stage's decoding at 8,192 GPUs).
    ranks: list[tuple[int, str]] | None
    start_ns: int
    end_ns: int
    observed: float  # bus bandwidth of the group (its least-waiting rank), GB/s
    baseline: float | None  # the key's baseline before this window, GB/s (None: cold)
    effect: float  # 1 - observed / baseline (0 while cold)
    degraded: bool  # effect over threshold and far enough from the baseline's noise
    drift: bool  # Page-Hinkley sees the key drifting down
    was_firing: bool  # the key's rule was firing before this window
    transition: str | None  # the rule's: FIRE, RESOLVE or None
    spread_transition: str | None  # the spread rule's
    spread_effect: float
    exec_ns_p50: int  # median over the group's ranks of their exec p50
    # the key after this window
    host: str | None  # the one node all its ranks are on (None: several)
    warm: bool
    baseline_after: float | None
    closed_before: int
    rule: tuple[bool, int, int | None, int | None]  # (firing, streak, start, end): RuleView.of
    spread_rule: tuple[bool, int, int | None, int | None]
    rank_host: dict[int, str] | None = None  # a copy, only when it changed
    rank_gpu: dict[int, str] | None = None
    rank_pid: dict[int, int] | None = None  # likewise (absent in verdicts of older builds)
    fired: FireEvidence | None = None  # with transition FIRE
    spread_fired: SpreadEvidence | None = None  # with spread_transition FIRE
    # The straggler scorer's top ranks while the spread is degraded now (else None): what
    # the job stage compares across communicators to tell the late process from the
    # ones it made late (absent in verdicts of older builds)
    spread_scores: list[list] | None = None
    # The time a rank spent in the key's ops in this window (median over the group's ranks
    # of count x exec p50), which the job stage compares with the job's slowdown (absent
    # in verdicts of older builds)
    busy_ns: int | None = None


@dataclass(slots=True)
class FireEvidence:
    """What the key stage knows when a key's rule fires: the degraded streak it fired
    on, and the rank the key's straggler scorer names given the streak's loss."""

    streak: Streak
    effect: float  # the streak's mean loss (the window's, without a streak)
    straggler_rank: int | None
    rank_scores: list[list]  # the five highest [rank, score]
    # fired on severe windows with healthy ones between (SustainedRule's flapping), not
    # on one streak (absent in verdicts of older builds)
    flapping: bool = False


@dataclass(slots=True)
class SpreadEvidence:
    """The straggler scorer when the ranks' spread fires."""

    low_rank: int | None
    low_streak: int
    rank_scores: list[list]
    waiting: float = 0.0  # the firing window's waiting share (waiting_share); 0 in older verdicts


class RuleView:
    """The job stage's copy of a :class:`~.sustained.SustainedRule`'s public state.

    The job stage may end it (:meth:`force_resolve`) when the key goes silent; the key
    stage's rule ends by itself when its windows come back after the gap
    (:meth:`KeyState.close`).
    """

    __slots__ = ("firing", "streak", "sustain", "start_ns", "end_ns")

    def __init__(self, sustain: int, state: tuple[bool, int, int | None, int | None]):
        self.sustain = sustain
        self.firing, self.streak, self.start_ns, self.end_ns = state

    @staticmethod
    def of(rule: SustainedRule) -> tuple[bool, int, int | None, int | None]:
        return (rule.firing, rule.streak, rule.start_ns, rule.end_ns)

    def force_resolve(self, end_ns: int) -> None:
        self.firing = False
        self.end_ns = end_ns
        self.streak = 0

    def to_state(self) -> list:
        return [self.firing, self.streak, self.start_ns, self.end_ns]


def _top_scores(sc: StragglerScorer) -> list[list]:
    return [[r, round(s, 4)] for r, s in sorted(sc.rank_scores().items(), key=lambda kv: -kv[1])[:5]]


@dataclass(slots=True)
class Streak:
    """A key's degraded windows before its rule fires: what the anomaly starts with.

    >>> st = Streak()
    >>> st.add(0.2, 80.0, 100.0, drift=False); st.add(0.4, 60.0, 100.0, drift=True)
    >>> (st.windows, st.mean_effect(), st.peak, st.observed_sum, st.drift)
    (2, 0.30000000000000004, 0.4, 140.0, True)
    >>> Streak.from_state(st.to_state()).to_state() == st.to_state()
    True
    """

    windows: int = 0
    effect_sum: float = 0.0
    peak: float = 0.0
    observed_sum: float = 0.0
    baseline_sum: float = 0.0
    drift: bool = False  # Page-Hinkley saw the key drift down during the streak

    def add(self, effect: float, observed: float, baseline: float, *, drift: bool) -> None:
        self.windows += 1
        self.effect_sum += effect
        if effect > self.peak:
            self.peak = effect
        self.observed_sum += observed
        self.baseline_sum += baseline
        if drift:
            self.drift = True

    def mean_effect(self) -> float | None:
        return self.effect_sum / self.windows if self.windows else None

    def to_state(self) -> list:
        # a list, as state files have always held it
        return [self.windows, self.effect_sum, self.peak, self.observed_sum, self.baseline_sum, self.drift]

    @classmethod
    def from_state(cls, st: list) -> Streak:
        obj = cls()
        (obj.windows, obj.effect_sum, obj.peak, obj.observed_sum, obj.baseline_sum, drift) = st
        obj.drift = bool(drift)
        return obj


class KeyState:
    """Everything the key stage knows about one (comm, op, size_bucket, transport) of a job."""

    __slots__ = (
        "comm", "comm_name", "op", "size_bucket", "transport", "nranks", "window_ns",
        "host", "rank_host", "rank_gpu", "rank_pid", "baseline", "drift", "rule", "straggler", "pending",
        "closed_before", "last_end_ns", "last_effect", "last_observed", "streak",
        "unlearned", "frozen_until", "frozen_obs", "spread", "spread_rule", "spread_unlearned", "tags",
        "transfer", "transfer_unlearned",
    )

    def __init__(self, w: WindowSummary, p: KeyParams):
        self.comm = w.comm
        self.comm_name = w.comm_name
        self.op = w.op
        self.size_bucket = w.size_bucket
        self.transport = w.transport
        self.nranks = w.nranks
        self.window_ns = max(w.end_ns - w.start_ns, 1)
        self.host: str | None = w.host
        self.rank_host: dict[int, str] = {}
        self.rank_gpu: dict[int, str] = {}  # "GPU-<uuid>" where the windows carry it
        self.rank_pid: dict[int, int] = {}  # process ids, where the windows carry them
        self.baseline = RatioBaseline(**p.baseline)
        self.drift = DriftEvidence(**p.drift)
        self.rule = SustainedRule(**p.rule_of(w.transport))
        self.straggler = StragglerScorer(**p.straggler)
        self.pending: dict[int, dict[int, WindowSummary]] = {}
        self.closed_before = -(1 << 62)  # groups starting before this are closed
        self.last_end_ns = -1
        self.last_effect = 0.0
        self.last_observed: float | None = None
        self.streak = Streak()  # the current degraded streak, before it fires
        # Observations of a degraded streak that has not fired (yet): learned only if the
        # streak turns out to be a spike, so a sustained degradation is never learned.
        self.unlearned: list[float] = []
        # Page-Hinkley saw the key drift down: learn nothing until then, so a slow ramp
        # is measured against where it started rather than followed.
        self.frozen_until = -1
        self.frozen_obs: list[float] = []  # what the key did while frozen
        # The ranks' spread: the smallest relative exec of a group (the rank the others
        # waited for). Its own baseline learns a job's usual skew; a sustained drop of it
        # by straggler_score is a straggler even where the median busbw barely moves
        # (two ranks: the median mixes the waiting rank and the late one).
        self.spread = RatioBaseline(**p.baseline)
        self.spread_rule = SustainedRule(**p.spread_rule)
        self.spread_unlearned: list[float] = []
        self.tags: dict[int, list[Any]] = {}  # a held group's start -> its windows' messages
        # The group's best-instance bus bandwidth (each rank's p50 scaled by its p50 over
        # its fastest exec; the best rank): what the link does when nobody waits.
        self.transfer = RatioBaseline(**p.baseline)
        self.transfer_unlearned: list[float] = []

    @classmethod
    def new(cls, w: WindowSummary, p: KeyParams, model: Any = None) -> KeyState:
        """The key of window ``w``, its baseline primed by the cold-start ``model`` if any."""
        ks = cls(w, p)
        if model is not None and w.count > 0:
            ks.baseline.set_prior(
                model.predict_busbw_gbs(w.transport, w.op, w.bytes / w.count, w.nranks, w.size_bucket))
        return ks

    @property
    def warm(self) -> bool:
        return self.baseline.log_baseline is not None

    @property
    def tuple(self) -> KeyTuple:
        return (self.comm, self.op, self.size_bucket, self.transport)

    def describe(self) -> dict[str, Any]:
        return {
            "comm": self.comm,
            "comm_name": self.comm_name,
            "op": self.op,
            "size_bucket": self.size_bucket,
            "transport": self.transport,
        }

    # --- grouping and closing -------------------------------------------------------

    def add(self, w: WindowSummary) -> bool | None:
        """Put a window in its group: None if its group has closed already (late),
        else whether the group now holds every rank of the communicator."""
        start = w.start_ns
        if start < self.closed_before:
            return None
        group = self.pending.get(start)
        if group is None:
            group = self.pending[start] = {}
        group[w.rank] = w
        return len(group) >= w.nranks

    def take_upto(self, start: int) -> list[tuple[int, dict[int, WindowSummary]]]:
        """Remove and return the pending groups starting at or before ``start``, in order;
        windows of those starts arriving later are late."""
        pending = self.pending
        starts = [s for s in pending if s <= start]
        if len(starts) > 1:
            starts.sort()
        if start >= self.closed_before:
            self.closed_before = start + 1
        return [(s, pending.pop(s)) for s in starts]

    def due(self, due_ns: int) -> int | None:
        """The latest pending start whose window ended by ``due_ns`` (None: none)."""
        starts = [s for s in self.pending if s + self.window_ns <= due_ns]
        return max(starts) if starts else None

    def close(self, start: int, group: dict[int, WindowSummary], p: KeyParams) -> KeyVerdict:
        """Score one closed group against this key's baselines and advance its rules."""
        recs = list(group.values())
        n = len(recs)
        if self.last_end_ns >= 0 and start - self.last_end_ns > p.silence_ns:
            # Back after a silence: the job stage ended what this key had open when the
            # key went quiet, so its rules and its streak start over here too.
            if self.rule.firing:
                self.rule.force_resolve(self.last_end_ns)
            if self.spread_rule.firing:
                self.spread_rule.force_resolve(self.last_end_ns)
            self.streak = Streak()
        # The link's speed is what the rank that waited least saw: every other rank's
        # kernel also holds the time it waited for its peers (host skew, a late rank),
        # which makes per-rank levels alternate between ~1x and several x in a clean run.
        # Waiting is the straggler scorer's evidence (below), not the link's.
        obs = max(r.busbw_gbs_p50 for r in recs)
        best = max(r.busbw_gbs_p50 * r.exec_ns_p50 / r.exec_ns_min
                   if 0 < r.exec_ns_min <= r.exec_ns_p50 <= r.exec_ns_p95 <= r.exec_ns_max
                   else r.busbw_gbs_p50 for r in recs)  # incoherent statistics say nothing
        first = recs[0]
        end = first.end_ns
        h0 = first.host
        single_host = True
        rank_host = self.rank_host
        rank_gpu = self.rank_gpu
        rank_pid = self.rank_pid
        moved = False
        for r in recs:
            if r.host != h0:
                single_host = False
            if rank_host.get(r.rank) != r.host:
                rank_host[r.rank] = r.host
                moved = True
            if r.gpu and rank_gpu.get(r.rank) != r.gpu:
                rank_gpu[r.rank] = r.gpu
                moved = True
            if r.pid and rank_pid.get(r.rank) != r.pid:
                rank_pid[r.rank] = r.pid
                moved = True
        self.host = h0 if single_host else None
        spread = None
        wait = 0.0
        if n >= 2:
            aligned = aligned_exec(recs, n)
            rel = relative_exec(aligned)
            if rel:
                self.straggler.learn_relative(rel)
                spread = min(rel.values())
                wait = waiting_share(aligned, group, self.window_ns)

        base = self.baseline
        lb = base.log_baseline
        effect = 0.0
        degraded = False
        b = None
        if lb is not None and obs > 0:
            b = math.exp(lb)
            effect = 1.0 - obs / b
            if effect >= p.threshold:
                degraded = (lb - math.log(obs)) / base.rel_sigma >= p.z_min
            if base.warm:
                self.drift.update(math.log(obs) - lb)
                if self.drift.drift_detected and end > self.frozen_until:
                    self.frozen_until = end + p.drift_freeze_windows * self.window_ns
        tb = self.transfer.log_baseline
        best_effect = 1.0 - best / math.exp(tb) if tb is not None and best > 0 else 0.0
        if degraded and tb is not None and best > 0 and p.transfer_confirm > 0:
            # Slower in the typical instance but not in the best one: waiting, not transfer.
            degraded = best_effect >= p.threshold * p.transfer_confirm
        rule = self.rule
        was_firing = rule.firing
        transition = rule.update(effect, start, degraded)
        if not was_firing:
            if degraded:
                self.streak.add(effect, obs, b, drift=self.drift.drift_detected)
            elif self.streak.windows:
                self.streak = Streak()
        if transition is None and not rule.firing:
            if not degraded and end <= self.frozen_until:
                self.unlearned = []
                base.learn_one(obs, level=False)
                if len(self.frozen_obs) < p.drift_freeze_windows:
                    self.frozen_obs.append(obs)
            else:
                if not degraded and self.frozen_obs:
                    # The freeze ran out without a degradation: the drift stayed under
                    # the threshold, so where it settled is the new normal (else the
                    # key would sit just under the threshold, one wobble from alerting).
                    fo = sorted(self.frozen_obs)
                    base.relevel(fo[len(fo) // 2])
                    self.frozen_obs = []
                self.unlearned = learn_or_hold(base, self.unlearned, obs, degraded)
        else:
            self.unlearned = []
            self.frozen_obs = []
        if transition is not None or rule.firing:
            self.transfer_unlearned = []  # a fault's windows are not the link's normal
        elif best > 0:
            held = self.transfer_unlearned
            if len(held) >= TRANSFER_HOLD_MAX:
                # Slower at its best for this long without the key ever firing: the
                # ranks' usual arrival order changed, not the link; where it settled is normal.
                for v in held:
                    self.transfer.learn_one(v)
                held = []
            self.transfer_unlearned = learn_or_hold(self.transfer, held, best, best_effect >= p.threshold)
        self.last_end_ns = end
        self.last_effect = effect
        self.last_observed = obs
        spread_transition, spread_effect = None, 0.0
        if spread is not None:
            spread_transition, spread_effect = self._spread_window(max(spread, MIN_REL), wait, start, p)
        fired = spread_fired = None
        if transition == FIRE:
            mean = self.streak.mean_effect()
            fire_effect = effect if mean is None else mean
            usual = self.spread.log_baseline
            fired = FireEvidence(self.streak, fire_effect,
                                 self.straggler.straggler(effect=fire_effect,
                                                          usual=1.0 if usual is None else math.exp(usual)),
                                 _top_scores(self.straggler), rule.flapping)
            self.streak = Streak()
        elif transition == RESOLVE:
            self.streak = Streak()
        spread_scores = _top_scores(self.straggler) if rule_degraded(self.spread_rule) else None
        if spread_transition == FIRE:
            sc = self.straggler
            # firing is degraded, so spread_scores was just computed
            spread_fired = SpreadEvidence(sc.low_rank, sc.low_streak, spread_scores or [], round(wait, 6))
        ex = sorted([r.exec_ns_p50 for r in recs])
        busy = sorted([r.count * r.exec_ns_p50 for r in recs])
        return KeyVerdict(
            job=first.job, key=self.tuple, comm_name=self.comm_name, window_ns=self.window_ns,
            ranks=None if n >= first.nranks else [(r.rank, r.host) for r in recs], start_ns=start, end_ns=end,
            observed=obs,
            baseline=b, effect=effect, degraded=degraded, drift=self.drift.drift_detected,
            was_firing=was_firing, transition=transition, spread_transition=spread_transition,
            spread_effect=spread_effect, exec_ns_p50=ex[n >> 1], host=self.host,
            warm=base.log_baseline is not None, baseline_after=base.baseline,
            closed_before=self.closed_before, rule=RuleView.of(rule),
            spread_rule=RuleView.of(self.spread_rule), rank_host=dict(rank_host) if moved else None,
            rank_gpu=dict(rank_gpu) if moved else None,
            rank_pid=dict(rank_pid) if moved else None, fired=fired, spread_fired=spread_fired,
            spread_scores=spread_scores, busy_ns=busy[n >> 1],
        )

    def _spread_window(self, spread: float, wait: float, start: int, p: KeyParams
                       ) -> tuple[str | None, float]:
        """The ranks' spread of one group through its own baseline and sustained rule.

        ``wait`` is the share of the window the others spent waiting for the late rank
        (:func:`waiting_share`): a spread far below its baseline is degraded only if
        that waiting costs something.
        """
        sb = self.spread
        lb = sb.log_baseline
        effect = 0.0
        degraded = False
        if lb is not None:
            effect = 1.0 - spread / math.exp(lb)
            if effect >= p.straggler_score and wait >= p.straggler_min_wait:
                degraded = (lb - math.log(spread)) / sb.rel_sigma >= p.z_min
        rule = self.spread_rule
        transition = rule.update(effect, start, degraded)
        if transition is None and not rule.firing:
            self.spread_unlearned = learn_or_hold(sb, self.spread_unlearned, spread, degraded)
        elif self.spread_unlearned:
            self.spread_unlearned = []
        return transition, effect

    def to_state(self, pending: bool = True) -> dict[str, Any]:
        """JSON-ready; ``pending=False`` leaves the open groups' windows out (their
        messages are held unacknowledged instead: :class:`KeyStage` ``hold_ranks``)."""
        return {
            "comm_name": self.comm_name,
            "nranks": self.nranks,
            "window_ns": self.window_ns,
            "host": self.host,
            "rank_host": [[r, h] for r, h in self.rank_host.items()],
            "rank_gpu": [[r, g] for r, g in self.rank_gpu.items()],
            "rank_pid": [[r, p] for r, p in self.rank_pid.items()],
            "baseline": self.baseline.to_state(),
            "drift": self.drift.to_state(),
            "rule": self.rule.to_state(),
            "straggler": self.straggler.to_state(),
            "pending": [
                [s, [[getattr(w, f) for f in _WS_FIELDS] for w in g.values()]]
                for s, g in self.pending.items()
            ] if pending else [],
            "closed_before": self.closed_before,
            "last_end": self.last_end_ns,
            "last_effect": self.last_effect,
            "last_observed": self.last_observed,
            "acc": self.streak.to_state(),
            "unlearned": list(self.unlearned),
            "frozen_until": self.frozen_until,
            "frozen_obs": list(self.frozen_obs),
            "spread": self.spread.to_state(),
            "spread_rule": self.spread_rule.to_state(),
            "spread_unlearned": list(self.spread_unlearned),
            "transfer": self.transfer.to_state(),
            "transfer_unlearned": list(self.transfer_unlearned),
        }

    @classmethod
    def from_state(cls, key: list, st: dict[str, Any], p: KeyParams) -> KeyState:
        obj = cls.__new__(cls)
        obj.comm, obj.op, obj.size_bucket, obj.transport = key
        obj.comm_name = st["comm_name"]
        obj.nranks = st["nranks"]
        obj.window_ns = st["window_ns"]
        obj.host = st["host"]
        obj.rank_host = {int(r): h for r, h in st["rank_host"]}
        obj.rank_gpu = {int(r): g for r, g in st.get("rank_gpu", ())}  # absent before 2026-11-25
        obj.rank_pid = {int(r): int(p) for r, p in st.get("rank_pid", ())}  # before 2026-11-27
        obj.baseline = RatioBaseline.from_state(st["baseline"], **p.baseline)
        obj.drift = DriftEvidence.from_state(st["drift"], **p.drift)
        obj.rule = SustainedRule.from_state(st["rule"], **p.rule_of(obj.transport))
        obj.straggler = StragglerScorer.from_state(st["straggler"], **p.straggler)
        obj.pending = {}
        for s, group in st["pending"]:
            ws = [WindowSummary(*values) for values in group]
            obj.pending[int(s)] = {w.rank: w for w in ws}
        obj.closed_before = st["closed_before"]
        obj.last_end_ns = st["last_end"]
        obj.last_effect = st["last_effect"]
        obj.last_observed = st["last_observed"]
        obj.streak = Streak.from_state(st["acc"])
        obj.unlearned = list(st["unlearned"])
        obj.frozen_until = st["frozen_until"]
        obj.frozen_obs = list(st["frozen_obs"])
        obj.spread = RatioBaseline.from_state(st["spread"], **p.baseline)
        obj.spread_rule = SustainedRule.from_state(st["spread_rule"], **p.spread_rule)
        obj.spread_unlearned = list(st["spread_unlearned"])
        # absent before 2026-11-26: a key restored from then learns its transfer anew
        obj.transfer = (RatioBaseline.from_state(st["transfer"], **p.baseline) if "transfer" in st
                        else RatioBaseline(**p.baseline))
        obj.transfer_unlearned = list(st.get("transfer_unlearned", ()))
        obj.tags = {}
        return obj


class KeyView:
    """What the job stage knows of one key: what its verdicts said, and the job stage's
    own bookkeeping (the incident it is in, recovery windows on hold)."""

    __slots__ = (
        "comm", "comm_name", "op", "size_bucket", "transport", "window_ns", "host", "rank_host",
        "rank_gpu", "rank_pid", "warm", "baseline", "last_end_ns", "last_effect", "last_observed", "closed_before",
        "last_spread",
        "rule", "spread_rule", "fire_streak", "hold", "incident", "spread_incident", "degraded_ns", "dropout_ns",
        "slowed_ns", "spread_scores", "busy_log", "busy_n", "busy_recent",
    )

    def __init__(self, key: KeyTuple, comm_name: str, window_ns: int, sustain: int):
        """A key the job stage has heard nothing of but its name."""
        self.comm, self.op, self.size_bucket, self.transport = key
        self.comm_name = comm_name
        self.window_ns = window_ns
        self.host: str | None = None
        self.rank_host: dict[int, str] = {}
        self.rank_gpu: dict[int, str] = {}
        self.rank_pid: dict[int, int] = {}
        self.warm = False
        self.baseline: float | None = None
        self.last_end_ns = -1
        self.last_effect = 0.0
        self.last_observed: float | None = None
        self.closed_before = -(1 << 62)
        self.last_spread = 0.0  # the last window's spread effect: how far its ranks wait for one
        idle = (False, 0, None, None)
        self.rule = RuleView(sustain, idle)
        self.spread_rule = RuleView(sustain, idle)
        self.fire_streak = Streak()  # the streak the key's last firing started with
        # While firing, the windows of a recovery streak in progress [[effect, obs, base]]:
        # they belong to the anomaly only if the streak breaks.
        self.hold: list[list] = []
        self.incident: str | None = None
        self.spread_incident: str | None = None
        # End of the last window the key was degraded now in (firing, or one window
        # short): a throughput drop whose span holds one is not "not NCCL".
        self.degraded_ns = NEVER
        # Until when the key's last drop-out (a window a flapping network link fires on
        # once it recurs) explains a throughput drop; the pipeline sets it.
        self.dropout_ns = NEVER
        # End of the last window it lost a drop-out's share of its bandwidth in, degraded
        # or not: a pulse covering part of a window leaves its fastest instance fast, so
        # the transfer check takes it for waiting; it still slowed with its class.
        self.slowed_ns = NEVER
        self.spread_scores: list[list] | None = None  # the last verdict's (degraded spread only)
        # The time a rank spends in the key's ops per window, and its last `sustain`
        # windows (causes.slowed_alike). Its usual value is kept as RatioBaseline
        # keeps a bus bandwidth (in log space; the median of the first BUSY_WARMUP
        # healthy windows, then EW), inline: one of these is learned per verdict.
        self.busy_log: list[float] | float = []  # the warm-up's logs, then the log baseline
        self.busy_n = 0
        self.busy_recent: list[int] = []

    tuple = KeyState.tuple
    describe = KeyState.describe

    @classmethod
    def of(cls, ks: KeyState) -> KeyView:
        """A view of ``ks`` as it is (one process running both stages sees the key's
        window before any verdict of it: a cold-start prior makes it warm already)."""
        obj = cls(ks.tuple, ks.comm_name, ks.window_ns, ks.rule.sustain)
        obj.host = ks.host
        obj.rank_host = dict(ks.rank_host)
        obj.rank_gpu = dict(ks.rank_gpu)
        obj.rank_pid = dict(ks.rank_pid)
        obj.warm = ks.warm
        obj.baseline = ks.baseline.baseline
        obj.last_end_ns = ks.last_end_ns
        obj.last_effect = ks.last_effect
        obj.last_observed = ks.last_observed
        obj.closed_before = ks.closed_before
        obj.rule = RuleView(ks.rule.sustain, RuleView.of(ks.rule))
        obj.spread_rule = RuleView(ks.spread_rule.sustain, RuleView.of(ks.spread_rule))
        return obj

    def apply(self, v: KeyVerdict) -> None:
        self.host = v.host
        self.warm = v.warm
        self.baseline = v.baseline_after
        self.last_end_ns = v.end_ns
        self.last_effect = v.effect
        self.last_observed = v.observed
        self.closed_before = v.closed_before
        self.last_spread = v.spread_effect
        self.rule.firing, self.rule.streak, self.rule.start_ns, self.rule.end_ns = v.rule
        sr = self.spread_rule
        sr.firing, sr.streak, sr.start_ns, sr.end_ns = v.spread_rule
        if rule_degraded(self.rule) or rule_degraded(sr):
            self.degraded_ns = v.end_ns
        if v.rank_host is not None:
            self.rank_host = v.rank_host
        if v.rank_gpu is not None:
            self.rank_gpu = v.rank_gpu
        if v.rank_pid is not None:
            self.rank_pid = v.rank_pid
        if v.fired is not None:
            self.fire_streak = v.fired.streak
        self.spread_scores = v.spread_scores
        if v.busy_ns is not None:
            recent = self.busy_recent
            recent.append(v.busy_ns)
            if len(recent) > self.rule.sustain:
                del recent[0]
            # Healthy windows only: neither rule degraded (a late rank's waiting inflates
            # the others' busy time; it is not the key's usual).
            if v.busy_ns > 0 and not (v.degraded or v.was_firing or v.transition is not None
                                      or v.spread_transition is not None or rule_degraded(self.rule)
                                      or rule_degraded(sr)):
                self._learn_busy(math.log(v.busy_ns))

    def _learn_busy(self, lx: float) -> None:
        self.busy_n += 1
        lb = self.busy_log
        if isinstance(lb, list):
            lb.append(lx)
            if len(lb) >= BUSY_WARMUP:
                lb.sort()
                self.busy_log = lb[len(lb) // 2]
        else:
            self.busy_log = lb + (lx - lb) * max(BUSY_FADE, 1.0 / self.busy_n)

    @property
    def busy_usual(self) -> float | None:
        """The time a rank usually spends in the key's ops per window (None: still learning)."""
        lb = self.busy_log
        return None if isinstance(lb, list) else math.exp(lb)

    def to_state(self) -> dict[str, Any]:
        return {
            "comm_name": self.comm_name,
            "window_ns": self.window_ns,
            "host": self.host,
            "rank_host": [[r, h] for r, h in self.rank_host.items()],
            "rank_gpu": [[r, g] for r, g in self.rank_gpu.items()],
            "rank_pid": [[r, p] for r, p in self.rank_pid.items()],
            "warm": self.warm,
            "baseline": self.baseline,
            "last_end": self.last_end_ns,
            "last_effect": self.last_effect,
            "last_observed": self.last_observed,
            "closed_before": self.closed_before,
            "last_spread": self.last_spread,
            "rule": self.rule.to_state(),
            "spread_rule": self.spread_rule.to_state(),
            "fire_streak": self.fire_streak.to_state(),
            "hold": [list(h) for h in self.hold],
            "incident": self.incident,
            "spread_incident": self.spread_incident,
            "degraded_ns": self.degraded_ns,
            "dropout_ns": self.dropout_ns,
            "slowed_ns": self.slowed_ns,
            "spread_scores": self.spread_scores,
            "busy": [self.busy_log, self.busy_n, self.busy_recent],
        }

    @classmethod
    def from_state(cls, key: KeyTuple, st: dict[str, Any], sustain: int) -> KeyView:
        obj = cls(key, st["comm_name"], st["window_ns"], sustain)
        obj.host = st["host"]
        obj.rank_host = {int(r): h for r, h in st["rank_host"]}
        obj.rank_gpu = {int(r): g for r, g in st["rank_gpu"]}
        obj.rank_pid = {int(r): int(p) for r, p in st.get("rank_pid", ())}  # before 2026-11-27
        obj.warm = st["warm"]
        obj.baseline = st["baseline"]
        obj.last_end_ns = st["last_end"]
        obj.last_effect = st["last_effect"]
        obj.last_observed = st["last_observed"]
        obj.closed_before = st["closed_before"]
        obj.last_spread = st.get("last_spread", 0.0)  # absent before 2026-11-27 (evening)
        obj.rule = RuleView(sustain, tuple(st["rule"]))
        obj.spread_rule = RuleView(sustain, tuple(st["spread_rule"]))
        obj.fire_streak = Streak.from_state(st["fire_streak"])
        obj.hold = [list(h) for h in st["hold"]]
        obj.incident = st["incident"]
        obj.spread_incident = st["spread_incident"]
        obj.degraded_ns = st.get("degraded_ns", NEVER)  # absent before 2026-11-26
        obj.dropout_ns = st.get("dropout_ns", NEVER)  # absent before 2026-11-28
        obj.slowed_ns = st.get("slowed_ns", NEVER)  # absent before 2026-11-29
        obj.spread_scores = st.get("spread_scores")  # absent before 2026-11-27
        if "busy" in st:  # absent before 2026-11-27 (morning): learned anew
            lb, n, recent = st["busy"]
            obj.busy_log = list(lb) if isinstance(lb, list) else float(lb)
            obj.busy_n, obj.busy_recent = int(n), list(recent)
        return obj

    @classmethod
    def from_key_state(cls, ks: KeyState, key_state: dict[str, Any]) -> KeyView:
        """A key's view in a state saved before the two stages were split (no ``view``):
        what the key stage holds, and the job stage's part that the key kept then."""
        obj = cls.of(ks)
        obj.hold = [list(h) for h in key_state.get("hold", ())]
        obj.incident = key_state.get("incident")
        obj.spread_incident = key_state.get("spread_incident")
        return obj


class GroupClock:
    """The stream time groups wait on: one communicator's in a :class:`KeyStage`, the
    job's in a :class:`~.pipeline.Pipeline` running both stages (its ``JobState`` has the
    same four attributes)."""

    __slots__ = ("watermark", "next_tick_ns", "window_ns", "lateness_ns", "pending")

    def __init__(self, window_ns: int, lateness_ns: int):
        self.watermark = -1  # largest window end seen
        self.next_tick_ns = -1
        self.window_ns = window_ns
        self.lateness_ns = lateness_ns  # how long an incomplete group waits past its end
        self.pending: dict[tuple, KeyState] = {}  # keys with groups still open


def place(ks: KeyState, w: WindowSummary, clock: Any, pending: dict[Any, KeyState], key: Any,
          max_lateness_windows: int) -> bool | None:
    """Put ``w`` in its group of ``ks`` (and ``ks`` in ``pending`` under ``key``):
    whether the group is complete now, or None if ``w`` came after its group closed.
    A late window makes ``clock`` wait longer from now on (up to
    ``max_lateness_windows``), or a lagging forwarder's ranks would drop out of every
    group for good."""
    complete = ks.add(w)
    if complete is None:
        lag = clock.watermark - w.end_ns + clock.window_ns
        if lag > clock.lateness_ns:
            clock.lateness_ns = min(lag, max_lateness_windows * clock.window_ns)
    else:
        pending[key] = ks
    return complete


def due(clock: Any, pending: dict[Any, KeyState]) -> list[tuple[KeyState, int]]:
    """At a window boundary of ``clock``: set its next one, and return the pending keys
    whose groups waited ``lateness_ns`` past their end, with the latest such start."""
    now = clock.watermark
    clock.next_tick_ns = now - now % clock.window_ns + clock.window_ns
    due_ns = now - clock.lateness_ns
    return [(ks, start) for ks in list(pending.values()) if (start := ks.due(due_ns)) is not None]


class KeyStage:
    """The key stage on its own, for the communicators it is given: windows in,
    :class:`KeyVerdict` s out, for a job stage elsewhere (``Pipeline.process``).

    One process running both stages is :class:`~.pipeline.Pipeline` fed windows; this
    is the key stage of a topology keyed per communicator, where no process sees a
    whole job. So groups wait on their *communicator's* stream time, not the job's: a
    group whose ranks do not all arrive closes ``lateness_windows`` after the
    communicator's newest window (more, up to ``max_lateness_windows``, once windows of
    a lagging forwarder arrive late). A communicator's verdicts depend only on its own
    windows and their order, however communicators are spread over processes.
    Windows of single-rank communicators (transport ``single``) form no group and are
    left out.

    Examples
    --------
    >>> from ncclwatch.config import DetectorConfig
    >>> from ncclwatch.records import WindowSummary
    >>> stage = KeyStage(DetectorConfig())
    >>> def window(t, rank):
    ...     return WindowSummary(job="j", host=f"h{rank}", comm="0x" + "0" * 15 + "1",
    ...         comm_name="", op="AllReduce", size_bucket="64MiB", transport="net", rank=rank,
    ...         nranks=2, start_ns=t * 10**9, end_ns=(t + 1) * 10**9, count=10,
    ...         bytes=10 << 26, exec_ns_min=1, exec_ns_p50=1_000_000, exec_ns_p95=1,
    ...         exec_ns_max=1, busbw_gbs_p50=40.0, first_seq=10 * t, last_seq=10 * t + 9)
    >>> stage.process(window(0, 0))
    []
    >>> [(v.key[1], v.start_ns, v.observed, v.ranks, v.rank_host) for v in stage.process(window(0, 1))]
    [('AllReduce', 0, 40.0, None, {0: 'h0', 1: 'h1'})]
    """

    def __init__(self, cfg: Any, *, model: Any = None, hold_ranks: int | None = None):
        from .model import BusbwModel

        cfg = getattr(cfg, "detector", cfg)
        self.cfg = cfg
        self.model = BusbwModel.resolve(model, cfg.model_path)
        self._p = KeyParams(cfg)
        self._keys: dict[tuple, KeyState] = {}  # (job, *key tuple) -> state
        self._comms: dict[tuple[str, str], GroupClock] = {}
        self._newest = -1  # newest window end seen, of any communicator
        self._window_ns = 1
        self.late_windows = 0
        # Communicators of at least this many ranks hold their open groups' windows out
        # of their state (a 16,384-rank group alone is ~13 MB of JSON, past what one
        # Kafka message holds); the caller keeps their messages unacknowledged until
        # the group closes (``process``'s ``tag``, then ``released_tags``) and, after a
        # restart, gives the stage again those it has not ``folded`` in.
        self.hold_ranks = hold_ranks
        self.released_tags: list[Any] = []

    def holds(self, nranks: int) -> bool:
        return self.hold_ranks is not None and nranks >= self.hold_ranks

    def folded(self, w: WindowSummary) -> bool:
        """Whether ``w`` is in the stage's state: always, unless its communicator holds
        its open groups' windows and ``w``'s group is still open."""
        if w.transport == "single" or not self.holds(w.nranks):
            return True
        ks = self._keys.get((w.job, w.comm, w.op, w.size_bucket, w.transport))
        return ks is not None and w.start_ns < ks.closed_before

    def process(self, w: WindowSummary, tag: Any = None) -> list[KeyVerdict]:
        """Verdicts of the groups ``w`` closes. ``tag``: what to put in
        ``released_tags`` once ``w`` is folded into the state (at once, unless its
        communicator holds its windows: when its group closes)."""
        if tag is not None and (w.transport == "single" or not self.holds(w.nranks)):
            self.released_tags.append(tag)
            tag = None
        if w.transport == "single":
            return []
        out: list[KeyVerdict] = []
        ck = (w.job, w.comm)
        c = self._comms.get(ck)
        if c is None:
            window_ns = max(w.end_ns - w.start_ns, 1)
            c = self._comms[ck] = GroupClock(window_ns, self.cfg.lateness_windows * window_ns)
        if w.end_ns > c.watermark:
            c.watermark = w.end_ns
            if w.end_ns > self._newest:
                self._newest, self._window_ns = w.end_ns, c.window_ns
        gk = (w.job, w.comm, w.op, w.size_bucket, w.transport)
        ks = self._keys.get(gk)
        if ks is None:
            ks = self._keys[gk] = KeyState.new(w, self._p, self.model)
        complete = place(ks, w, c, c.pending, gk, self.cfg.max_lateness_windows)
        if complete is None:
            self.late_windows += 1
            if tag is not None:
                self.released_tags.append(tag)
        else:
            if tag is not None:
                ks.tags.setdefault(w.start_ns, []).append(tag)
            if complete:
                self._close(c, gk, ks, w.start_ns, out)
        if c.watermark >= c.next_tick_ns:
            for pks, start in due(c, c.pending):
                self._close(c, (w.job, *pks.tuple), pks, start, out)
        return out

    def flush(self) -> list[KeyVerdict]:
        """End of input: close every group still open."""
        out: list[KeyVerdict] = []
        for c in self._comms.values():
            for k, ks in list(c.pending.items()):
                if ks.pending:
                    self._close(c, k, ks, max(ks.pending), out)
        return out

    def key_count(self) -> int:
        return len(self._keys)

    def mark(self) -> int:
        """A progress mark for the job stage: every verdict this stage will still send
        ends after the returned time.

        A group closes at the latest ``max_lateness_windows`` after its end on its
        communicator's stream time, and a forwarder lagging more than that has its
        windows left out of their groups; so nothing still to come ends more than that
        (and one window) before the newest window here. A communicator that lags its key
        stage's newest window by more (all its ranks on one slow forwarder) reaches the
        job stage late: :class:`VerdictMerge` counts those.
        """
        if self._newest < 0:
            return NEVER
        return self._newest - (self.cfg.max_lateness_windows + 1) * self._window_ns - 1

    def caught_up_mark(self) -> int | None:
        """The mark once every window sent to this stage is in (its input read to the
        end): what it will still send ends after its earliest open group; None if it
        holds none (it is idle: nothing but windows yet to come can make a verdict)."""
        ends = [min(ks.pending) + c.window_ns for c in self._comms.values() for ks in c.pending.values()
                if ks.pending]
        return max(min(ends) - 1, self.mark()) if ends else None

    def comm_state(self, job: str, comm: str) -> dict[str, Any] | None:
        """One communicator's part of the stage (its clock and keys), JSON-ready; None
        if the stage holds nothing of it."""
        c = self._comms.get((job, comm))
        if c is None:
            return None
        ours = [(k, ks) for k, ks in self._keys.items() if k[0] == job and k[1] == comm]
        held = bool(ours) and self.holds(ours[0][1].nranks)
        return {
            "clock": [c.watermark, c.next_tick_ns, c.window_ns, c.lateness_ns],
            "keys": [[list(k[1:]), ks.to_state(pending=not held)] for k, ks in ours],
            "pending": [] if held else [list(k[1:]) for k in c.pending],
        }

    def restore_comm(self, job: str, comm: str, st: dict[str, Any]) -> None:
        """Put back what :meth:`comm_state` gave, replacing what the stage holds of it."""
        self.forget_comm(job, comm)
        c = GroupClock(1, 0)
        c.watermark, c.next_tick_ns, c.window_ns, c.lateness_ns = st["clock"]
        self._comms[(job, comm)] = c
        for key, kst in st["keys"]:
            self._keys[(job, *key)] = KeyState.from_state(key, kst, self._p)
        for key in st["pending"]:
            gk = (job, *key)
            c.pending[gk] = self._keys[gk]
        if c.watermark > self._newest:
            self._newest, self._window_ns = c.watermark, c.window_ns

    def forget_comm(self, job: str, comm: str) -> None:
        """Drop a communicator; the messages of windows it held are let go with it."""
        if self._comms.pop((job, comm), None) is not None:
            for k in [k for k in self._keys if k[0] == job and k[1] == comm]:
                for tags in self._keys.pop(k).tags.values():
                    self.released_tags += tags

    def comms(self) -> list[tuple[str, str]]:
        return list(self._comms)

    def clock(self, job: str, comm: str) -> GroupClock:
        return self._comms[(job, comm)]

    def _close(self, c: GroupClock, gk: tuple, ks: KeyState, start: int, out: list[KeyVerdict]) -> None:
        p = self._p
        for s, group in ks.take_upto(start):
            out.append(ks.close(s, group, p))
            if ks.tags:
                self.released_tags += ks.tags.pop(s, ())
        if not ks.pending:
            c.pending.pop(gk, None)


class VerdictMerge:
    """A job stage's input from several key stages (``sources``: one per partition of
    the windows), in the canonical order (time; at one time the job's other records,
    throughput, drops and plugin stats, before verdicts; verdicts by window start and
    key), let go as far as every key stage's progress mark (:meth:`KeyStage.mark`)
    allows, so the order, and with it the events, does not depend on which key stage
    answered first. A verdict's time is its window's end, a record's its timestamp.

    A source may say it is idle (its input read to the end, no group open): it holds
    nothing back until it marks again. When every source is idle, all that is held goes,
    each item once it has been held ``idle_wait_s`` (by ``clock``): a key stage idle
    until now and a job stage reading the job's throughput see the job's first records
    at different times (after a quiet spell, or a forwarder draining its spill), and
    what went before the key stage's first mark would make its verdicts late.

    A verdict ending at or before what was already let go (a key stage broke its mark:
    a forwarder lagging more than ``max_lateness_windows``, a key stage that joined
    late) goes out with the next release, in arrival order, and is counted in ``late``.

    >>> m = VerdictMerge(["a", "b"])
    >>> def v(end, comm):
    ...     return KeyVerdict(job="j", key=(comm, "AllReduce", "64MiB", "net"), comm_name="",
    ...         window_ns=1, ranks=[], start_ns=end - 1, end_ns=end, observed=1.0, baseline=None,
    ...         effect=0.0, degraded=False, drift=False, was_firing=False, transition=None,
    ...         spread_transition=None, spread_effect=0.0, exec_ns_p50=1, host=None, warm=False,
    ...         baseline_after=None, closed_before=end, rule=(False, 0, None, None),
    ...         spread_rule=(False, 0, None, None))
    >>> m.add(v(2, "c2")), m.add(v(1, "c9"))   # True: late
    (False, False)
    >>> m.mark("a", 2)
    >>> m.release()                     # b may still send something ending at 1
    []
    >>> m.add(v(1, "c1")); m.mark("b", 1)
    False
    >>> [(x.end_ns, x.key[0]) for x in m.release()]
    [(1, 'c1'), (1, 'c9')]
    >>> [(x.end_ns, x.key[0]) for x in m.release(flush=True)]
    [(2, 'c2')]
    """

    def __init__(self, sources: Any = (), *, idle_wait_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self._marks: dict[Any, int] = dict.fromkeys(sources, NEVER)
        self._idle: set[Any] = set()
        self._bound: Any = _STALE  # the lowest mark of a source not idle (None: no such source)
        self.idle_wait_s = idle_wait_s
        self.clock = clock
        self._arrived: deque[tuple[float, int]] = deque()  # (clock, time) of what was added
        self._waited_upto = NEVER  # every item up to this time was held idle_wait_s
        self._heap: list[tuple] = []
        self._seq = 0
        self._late: list[tuple[Any, Any]] = []
        self.released_upto = NEVER
        self.late = 0
        self.released_tags: list[Any] = []  # tags of what release() let go; the owner drains it

    def __len__(self) -> int:
        return len(self._heap) + len(self._late)

    def add(self, item: Any, tag: Any = None) -> bool:
        """A verdict, or a throughput, drop or plugin_stats record of the job; ``tag``
        (if not None) is put in ``released_tags`` when the item goes (the worker
        acknowledges an input message once all its records went). True if it is late."""
        if item.KIND == KeyVerdict.KIND:
            entry: tuple = (item.end_ns, item.start_ns, item.job, item.key)
        else:
            entry = (item.ts_ns, NEVER, item.job, ())
        if entry[0] <= self.released_upto:
            self._late.append((item, tag))
            self.late += item.KIND == KeyVerdict.KIND
            return True
        self._seq += 1
        heapq.heappush(self._heap, (*entry, self._seq, item, tag))
        if self.idle_wait_s > 0:
            self._arrived.append((self.clock(), entry[0]))
        return False

    def folded(self, item: Any) -> bool:
        """Whether ``item``, read before, went already: with :meth:`to_state` saving no
        held items, an input read again after a restart is either folded in (its time
        is at or before ``released_upto``) or was held, and is added again."""
        return record_end(item) <= self.released_upto

    def mark(self, source: Any, upto_ns: int | None) -> None:
        """``source`` has sent every verdict ending at or before ``upto_ns`` (None: it is
        idle, and what it sends next ends after what the others let go by then)."""
        self._bound = _STALE
        if upto_ns is None:
            self._idle.add(source)
            return
        if upto_ns > self._marks.get(source, NEVER - 1):
            self._marks[source] = upto_ns
        if upto_ns > NEVER:  # "nothing known yet" (a new owner) does not end idleness
            self._idle.discard(source)

    def _marks_bound(self) -> int | None:
        b = self._bound
        if b is _STALE:
            marks = [t for s, t in self._marks.items() if s not in self._idle]
            b = self._bound = min(marks) if marks else None
        return b

    def release(self, *, flush: bool = False) -> list[Any]:
        """What may go now, in order (``flush``: everything, at the end of input)."""
        marked = self._marks_bound()
        heap = self._heap
        if not (flush or self._late or self._arrived) and marked is not None \
                and (not heap or heap[0][0] > marked):
            # the common case, asked after every verdict added: nothing can go yet
            if marked > self.released_upto:
                self.released_upto = marked
            return []
        late, self._late = self._late, []
        out = [item for item, _ in late]
        tags = [tag for _, tag in late if tag is not None]
        bound: float = float("inf") if flush or marked is None else marked
        if self._arrived:
            self._waited()
            if marked is None and not flush and self._marks:
                bound = self._waited_upto
        while heap and heap[0][0] <= bound:
            entry = heapq.heappop(heap)
            out.append(entry[-2])
            if entry[-1] is not None:
                tags.append(entry[-1])
        if tags:
            self.released_tags += tags
        if not flush and self._marks:
            upto = bound if marked is not None else max((record_end(x) for x in out), default=NEVER)
            if upto > self.released_upto:
                self.released_upto = int(upto)
        return out

    def _waited(self) -> None:
        arrived, since = self._arrived, self.clock() - self.idle_wait_s
        while arrived and arrived[0][0] <= since:
            t = arrived.popleft()[1]
            if t > self._waited_upto:
                self._waited_upto = t

    def waiting(self) -> bool:
        """Whether items wait only for ``idle_wait_s`` to pass (every source idle)."""
        return bool(self._arrived) and bool(self._marks) and self._idle.issuperset(self._marks)

    def to_state(self) -> dict[str, Any]:
        """JSON-ready: the marks and how far the merge let go, not what it holds.

        Held items are not state: a key stage that lags holds a job's verdicts for as
        long as it lags, which no single saved value could take (Kafka caps a message
        at ~1 MB). The worker acknowledges an input message only once all its records
        went (``released_tags``), so what is held comes again after a restart and
        :meth:`folded` tells it from what went.
        """
        return {
            "marks": [[s, t, s in self._idle] for s, t in self._marks.items()],
            "released_upto": self.released_upto,
            "late": self.late,
        }

    @classmethod
    def from_state(cls, st: dict[str, Any]) -> VerdictMerge:
        obj = cls()
        obj._marks = {s: t for s, t, _ in st["marks"]}
        obj._idle = {s for s, _, idle in st["marks"] if idle}
        obj._bound = _STALE
        obj.late = st["late"]
        obj.released_upto = st["released_upto"]
        return obj


_STALE = object()  # VerdictMerge._bound after the marks changed


def record_end(x: Any) -> int:
    """The time a job stage input stands for in :class:`VerdictMerge`."""
    return x.end_ns if x.KIND == KeyVerdict.KIND else x.ts_ns


def aligned_exec(recs: list[WindowSummary], n: int) -> dict[int, float]:
    """Exec p50 per rank, keeping ranks whose windows cover the same op instances.

    A rank whose ``[first_seq, last_seq]`` overlaps the group's median range by less
    than half of its own span summarises different ops and is left out.
    """
    f0 = recs[0].first_seq
    l0 = recs[0].last_seq
    if all(r.first_seq == f0 and r.last_seq == l0 for r in recs):
        return {r.rank: r.exec_ns_p50 for r in recs}
    mf = sorted([r.first_seq for r in recs])[n >> 1]
    ml = sorted([r.last_seq for r in recs])[n >> 1]
    out = {}
    for r in recs:
        overlap = min(r.last_seq, ml) - max(r.first_seq, mf) + 1
        if 2 * overlap >= r.last_seq - r.first_seq + 1:
            out[r.rank] = r.exec_ns_p50
    return out


def waiting_share(aligned: dict[int, float], group: dict[int, WindowSummary], window_ns: int) -> float:
    """The share of a window the ranks spent waiting for its latest rank.

    The rank arriving last has the shortest kernel (its peers spin in theirs until it
    comes); each of its ops kept the others waiting about the median of their exec
    times minus its own. ``aligned`` is :func:`aligned_exec` of ``group``.

    >>> from types import SimpleNamespace as W
    >>> g = {0: W(count=10), 1: W(count=10), 2: W(count=10)}
    >>> waiting_share({0: 5e6, 1: 6e6, 2: 1e6}, g, 10**9)  # 10 ops, each 4.5 ms of waiting
    0.045
    >>> waiting_share({0: 5e6}, g, 10**9)
    0.0
    """
    if len(aligned) < 2:
        return 0.0
    late = min(aligned, key=aligned.__getitem__)
    others = sorted(v for r, v in aligned.items() if r != late)
    m = len(others)
    median = others[m >> 1] if m % 2 else (others[(m >> 1) - 1] + others[m >> 1]) / 2.0
    return group[late].count * (median - aligned[late]) / window_ns


# --- the wire format between the stages -----------------------------------------

# 2 (2026-11-28): `ranks` null for a complete group. 3 (2026-11-28): the fields as one
# array in KeyVerdict's field order instead of an object (field names were ~500 of a
# verdict's ~720 bytes); fields added later go at the end, with defaults. A job stage of
# this build reads 1, 2 and 3; one of an older build refuses 3 by its version (upgrade
# job-stage workers before key-stage ones).
VERDICT_VERSION = 3
VERDICT_VERSIONS_READ = (1, 2, 3)
_encoder = msgspec.json.Encoder()
_envelope = msgspec.json.Decoder(tuple[int, msgspec.Raw])
_verdict = msgspec.json.Decoder(KeyVerdict)
_VERDICT_FIELDS = tuple(f.name for f in fields(KeyVerdict))
_verdict_values = operator.attrgetter(*_VERDICT_FIELDS)


def _row_struct() -> type:
    """KeyVerdict's fields as an array-like msgspec struct: format 3's body, typed."""
    hints = get_type_hints(KeyVerdict)
    row = []
    for f in fields(KeyVerdict):
        if f.default is MISSING:
            row.append((f.name, hints[f.name]))
        else:
            row.append((f.name, hints[f.name], f.default))
    return msgspec.defstruct("KeyVerdictRow", row, array_like=True)


_verdict_row = msgspec.json.Decoder(_row_struct())
_astuple = msgspec.structs.astuple


def encode_verdict(v: KeyVerdict, version: int = VERDICT_VERSION) -> bytes:
    """A verdict as JSON, ``[3, [...fields in order]]``, for a job stage in another process;
    ``version=2`` writes ``[2, {...fields by name}]``, what job stages of older builds read.

    >>> from ncclwatch.config import DetectorConfig
    >>> v = KeyVerdict(job="j", key=("0x1", "AllReduce", "64MiB", "net"), comm_name="", window_ns=10**9,
    ...     ranks=[(0, "h0"), (1, "h1")], start_ns=0, end_ns=10**9, observed=40.0, baseline=None,
    ...     effect=0.0, degraded=False, drift=False, was_firing=False, transition=None,
    ...     spread_transition=None, spread_effect=0.0, exec_ns_p50=10**6, host=None, warm=False,
    ...     baseline_after=None, closed_before=1, rule=(False, 0, None, None),
    ...     spread_rule=(False, 0, None, None))
    >>> decode_verdict(encode_verdict(v)) == decode_verdict(encode_verdict(v, version=2)) == v
    True
    >>> encode_verdict(v)[:40]
    b'[3,["j",["0x1","AllReduce","64MiB","net"'
    >>> decode_verdict(b'[4, {}]')
    Traceback (most recent call last):
    ...
    ValueError: key verdict format version 4: this build reads versions 1, 2 and 3
    """
    if version == 3:
        return _encoder.encode((3, _verdict_values(v)))
    if version == 2:
        return _encoder.encode((2, v))
    raise ValueError(f"key verdict format version {version}: this build writes 2 and 3")


@dataclass(slots=True)
class VerdictMark:
    """A key stage's progress, for every job stage: every verdict it will still send
    ends after ``upto_ns`` (:meth:`KeyStage.mark`); None: it is idle
    (:meth:`KeyStage.caught_up_mark`). ``source`` names the key stage (its windows
    partition)."""

    KIND: ClassVar[str] = "verdict_mark"

    source: int
    upto_ns: int | None


_MARK_PREFIXES = tuple(b'[%d,"mark",' % v for v in VERDICT_VERSIONS_READ)
_mark = msgspec.json.Decoder(tuple[int, str, VerdictMark])


def encode_mark(m: VerdictMark) -> bytes:
    """A mark as JSON, ``[VERDICT_VERSION, "mark", {...}]``: it travels with the verdicts.

    >>> decode_stage_line(encode_mark(VerdictMark(3, 10)))
    VerdictMark(source=3, upto_ns=10)
    """
    return _encoder.encode((VERDICT_VERSION, "mark", m))


def decode_stage_line(data: bytes) -> KeyVerdict | VerdictMark:
    """A line of the verdicts topic: a verdict or a mark; ValueError otherwise."""
    if data.startswith(_MARK_PREFIXES):
        try:
            return _mark.decode(data)[2]
        except msgspec.DecodeError as e:
            raise ValueError(f"malformed verdict mark: {e}") from None
    return decode_verdict(data)


def decode_verdict(data: bytes) -> KeyVerdict:
    """:func:`encode_verdict`'s bytes back; ValueError (saying what is wrong) otherwise."""
    try:
        version, raw = _envelope.decode(data)
    except msgspec.DecodeError as e:
        raise ValueError(f"not a key verdict: {e}") from None
    if version not in VERDICT_VERSIONS_READ:
        *first, last = map(str, VERDICT_VERSIONS_READ)
        raise ValueError(f"key verdict format version {version}: this build reads versions "
                         f"{', '.join(first)} and {last}")
    try:
        if version == 3:
            return KeyVerdict(*_astuple(_verdict_row.decode(raw)))
        return _verdict.decode(raw)
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed key verdict: {e}") from None
