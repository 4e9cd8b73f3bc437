"""The job's speed: step series, a protected baseline, drops, and deltas over intervals.

Throughput records arrive per step, from one reporter (``rank == -1``) or from several
ranks; the ranks' reports of one step are averaged. A step is complete when a job-level
record arrives or when a later step shows up. Completed steps are averaged per window
(the comm windows' length), so "sustained for N windows" means the same stream time for
throughput as for bus bandwidth whether a step takes 80 ms or 10 s: a step (or a
trainer's log line over several steps) reports the time since the one before it, so the
windows it spans without a step of their own take its value (marked *filled*: the rules
count them, the baseline learns the value once), up to ``MAX_FILL_WINDOWS`` (a longer
gap is a pause, not a rate). The window series feeds:

- a :class:`~.baseline.RatioBaseline` (same warm-up and protection as bus bandwidth:
  the pipeline holds degraded steps back and never feeds it a sustained drop);
- a :class:`~.sustained.SustainedRule` at ``throughput_drop`` for ``throughput_drop``
  anomalies (the job slowed while NCCL did not: "not NCCL"), flapping too: a job slowed
  a second at a time fires on ``throughput_flap_count`` windows losing
  ``throughput_flap_threshold`` among its last ``flap_windows``;
- a bounded history used for ``throughput_delta``: mean TFLOP/s over an anomaly
  against the mean over the minute before it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ncclwatch.config import DetectorConfig
from ncclwatch.records import ThroughputRecord

from .baseline import RatioBaseline
from .sustained import SustainedRule

HISTORY_STEPS = 1024
BEFORE_NS = 60 * 10**9  # how far back "the baseline before it" looks
MAX_FILL_WINDOWS = 60  # empty windows a step's value may span (a longer gap: a pause)


def _baseline_params(cfg: DetectorConfig) -> dict[str, Any]:
    return {"warmup": cfg.warmup_windows}


def _rule_params(cfg: DetectorConfig) -> dict[str, Any]:
    return {
        "threshold": cfg.throughput_drop,
        "sustain": cfg.sustain_windows,
        "recover_threshold": cfg.throughput_drop / 2,
        "recover": cfg.recover_windows,
        "flap_count": cfg.throughput_flap_count,
        "flap_windows": cfg.flap_windows,
        "flap_threshold": cfg.throughput_flap_threshold,
    }


class ThroughputTracker:
    """Per-job throughput state (plain object; the pipeline owns one per job)."""

    __slots__ = (
        "cfg", "baseline", "rule", "history", "step", "sum", "n", "ts_ns", "last", "unlearned",
        "pending_fire", "fire_ts", "fire_wait_ns", "win_start", "win_sum", "win_n", "clear", "clear_start",
        "held", "carried", "stalled",
    )

    def __init__(self, cfg: DetectorConfig):
        self.cfg = cfg
        self.baseline = RatioBaseline(**_baseline_params(cfg))
        self.rule = SustainedRule(**_rule_params(cfg))
        self.history: deque[tuple[int, float]] = deque(maxlen=HISTORY_STEPS)
        self.step = -1  # the step being accumulated
        self.sum = 0.0
        self.n = 0
        self.ts_ns = 0
        self.last: float | None = None  # latest completed step's TFLOP/s
        self.unlearned: list[float] = []  # a degraded streak held back from the baseline
        self.pending_fire: int | None = None  # start of a drop waiting for its windows
        self.fire_ts = 0  # the end of the window that completed it
        self.fire_wait_ns = 0  # how long past it the comm keys get to show theirs
        # After a comm anomaly carried a drop: degraded windows since NCCL is healthy again
        self.clear = 0
        self.clear_start = 0
        # Windows a drop has been held for NCCL's trouble while no comm anomaly was raised
        self.held = 0
        # A raised comm anomaly carried (some of) the drop's cost since it began
        self.carried = False
        # The drop's degraded windows that one step spanned whole: seconds without a step
        self.stalled = 0
        self.win_start = -1  # the window being averaged
        self.win_sum = 0.0
        self.win_n = 0

    def add(self, rec: ThroughputRecord) -> list[tuple[int, float]]:
        """Account one record; return the steps it completed as ``(ts_ns, tflops)``."""
        out: list[tuple[int, float]] = []
        if rec.step < self.step:
            return out  # a straggling report of a completed step
        if rec.step > self.step:
            if self.n:
                out.append(self._complete())
            self.step, self.sum, self.n, self.ts_ns = rec.step, 0.0, 0, rec.ts_ns
        self.sum += rec.tflops_per_gpu
        self.n += 1
        self.ts_ns = max(self.ts_ns, rec.ts_ns)
        if rec.rank == -1:
            out.append(self._complete())
        return out

    def windows(self, steps: list[tuple[int, float]], window_ns: int) -> list[tuple[int, float, bool]]:
        """Average completed steps per window; return completed windows
        ``(end_ns, mean, filled)``.

        A window completes when a step of a later window arrives; the windows between
        that step's and the last one with a step are *filled* with its value (it reports
        their time), unless there are more than ``MAX_FILL_WINDOWS`` of them.

        >>> from ncclwatch.config import DetectorConfig
        >>> tp = ThroughputTracker(DetectorConfig())
        >>> tp.windows([(500, 10.0), (3_500, 8.0), (3_900, 6.0), (4_200, 9.0)], 1_000)
        [(1000, 10.0, False), (2000, 8.0, True), (3000, 8.0, True), (4000, 7.0, False)]
        """
        out = []
        for ts, value in steps:
            start = ts - ts % window_ns
            if start > self.win_start:
                if self.win_n:
                    out.append((self.win_start + window_ns, self.win_sum / self.win_n, False))
                    gap = (start - self.win_start) // window_ns - 1
                    if 0 < gap <= MAX_FILL_WINDOWS:
                        out.extend((self.win_start + (i + 2) * window_ns, value, True) for i in range(gap))
                self.win_start, self.win_sum, self.win_n = start, 0.0, 0
            elif start < self.win_start:
                continue  # a step from an already closed window
            self.win_sum += value
            self.win_n += 1
        return out

    def _complete(self) -> tuple[int, float]:
        value = self.sum / self.n
        self.n = 0
        self.sum = 0.0
        self.history.append((self.ts_ns, value))
        self.last = value
        return self.ts_ns, value

    def step_gap_ns(self, until_ns: int, last: int = 8) -> int:
        """Median time between the latest steps completed by ``until_ns`` (a trainer's
        log lines), 0 with fewer than two.

        >>> tp = ThroughputTracker(DetectorConfig())
        >>> tp.history.extend([(0, 1.0), (5, 1.0), (10, 1.0), (16, 1.0), (30, 1.0)])
        >>> tp.step_gap_ns(until_ns=20)
        5
        """
        ts = [t for t, _ in self.history if t <= until_ns][-last:]
        gaps = sorted(b - a for a, b in zip(ts, ts[1:], strict=False))
        return gaps[len(gaps) // 2] if gaps else 0

    def mean(self, start_ns: int, end_ns: int | None, *, by_time: bool = False) -> tuple[float | None, int]:
        """TFLOP/s over the steps that ended in ``[start, end]`` and how many there were.

        ``by_time``: each step counts for the time it took (since the step before it), so
        this is the work done over the time. The plain mean of steps, which the decisions
        use, overstates a job whose few slow steps hold most of the time: a process
        stopped 1 s of every 2 lost 49 % of its work while its mean step said 7 %.

        >>> from ncclwatch.config import DetectorConfig
        >>> tp = ThroughputTracker(DetectorConfig())
        >>> tp.history.extend([(0, 100.0), (100, 100.0), (200, 100.0), (1200, 10.0)])
        >>> tp.mean(100, None), tp.mean(100, None, by_time=True)  # 100 for 200 ns, 10 for 1,000
        ((70.0, 3), (25.0, 3))
        """
        total = weight = plain = 0.0
        n = 0
        prev = None
        for ts, v in self.history:
            if ts >= start_ns and (end_ns is None or ts <= end_ns):
                n += 1
                plain += v
                if by_time and prev is not None and ts > prev:
                    total += v * (ts - prev)
                    weight += ts - prev
            prev = ts
        if not n:
            return None, 0
        return (total / weight if weight else plain / n), n

    def delta(self, start_ns: int, end_ns: int | None, *, before_ns: int | None = None,
              by_time: bool = False) -> float | None:
        """Relative TFLOP/s change over ``[start, end]`` against the minute before
        ``before_ns`` (default: before ``start``); ``by_time`` as for :meth:`mean`."""
        during, _ = self.mean(start_ns, end_ns, by_time=by_time)
        if during is None:
            return None
        ref_end = start_ns if before_ns is None else before_ns
        ref, _ = self.mean(ref_end - BEFORE_NS, ref_end - 1, by_time=by_time)
        if ref is None:
            ref = self.baseline.baseline
        if not ref:
            return None
        return during / ref - 1.0

    def to_state(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline.to_state(),
            "rule": self.rule.to_state(),
            "history": [list(p) for p in self.history],
            "step": self.step,
            "sum": self.sum,
            "n": self.n,
            "ts": self.ts_ns,
            "last": self.last,
            "unlearned": list(self.unlearned),
            "pending_fire": self.pending_fire,
            "fire_ts": self.fire_ts,
            "fire_wait_ns": self.fire_wait_ns,
            "win": [self.win_start, self.win_sum, self.win_n],
            "clear": [self.clear, self.clear_start, self.held, self.carried, self.stalled],
        }

    @classmethod
    def from_state(cls, cfg: DetectorConfig, state: dict[str, Any]) -> ThroughputTracker:
        obj = cls(cfg)
        obj.baseline = RatioBaseline.from_state(state["baseline"], **_baseline_params(cfg))
        obj.rule = SustainedRule.from_state(state["rule"], **_rule_params(cfg))
        obj.history.extend((int(ts), v) for ts, v in state["history"])
        obj.step, obj.sum, obj.n, obj.ts_ns = state["step"], state["sum"], state["n"], state["ts"]
        obj.last = state["last"]
        obj.unlearned = list(state["unlearned"])
        obj.pending_fire = state["pending_fire"]
        obj.fire_ts = state["fire_ts"]
        obj.fire_wait_ns = state.get("fire_wait_ns", 0)  # absent in states saved before it
        obj.win_start, obj.win_sum, obj.win_n = state["win"]
        obj.clear, obj.clear_start, *held = state["clear"]
        obj.held = held[0] if held else 0  # absent before 2026-11-29
        obj.carried = bool(held[1]) if len(held) > 1 else True  # absent before: say nothing more
        obj.stalled = held[2] if len(held) > 2 else 0
        return obj
