"""Protected, warm-started baselines of a positive quantity (bus bandwidth, TFLOP/s).

The detectors compare what a key does now with what it usually does. "Usually" is an
exponentially weighted mean of the log of the observations, learned online, with three
guards taken from river's habits:

- a warm-up (river's ``grace_period``): the first ``warmup`` observations only build the
  baseline, whose starting value is their *median*, so one slow window at job start does
  not become the reference;
- robustness: a learned observation is clipped to ``clip_sigmas`` noise sigmas around
  the baseline, so one spike moves it by little;
- protection (river's ``protect_anomaly_detector``): the caller does not feed it the
  windows of a sustained degradation (the pipeline holds a degraded streak back until it
  knows whether it fired), and optionally ``protect`` refuses single observations that
  far below the baseline. A per-window gate alone would cut off the low tail of the
  noise and shrink the noise estimate; holding back streaks does not;
- a cold-start prior: a value from the ``ncclwatch fit`` model that scores observations
  before the warm-up is over.

The statistics are river's ``stats.EWMean`` / ``stats.EWVar`` (Finch's incremental
formulas), rewritten here in a few lines: river 0.26 implements those two in Rust and
their state cannot be written as JSON, which Faust tables and ``--state`` files need.
``tests/test_detector_contract.py`` checks both give the same numbers. Page-Hinkley
(:class:`DriftEvidence`) is river's, rewritten the same way: importing ``river.drift``
imports river's datasets, scikit-learn and SciPy (1.7 s of every command's start), and
river keeps the test's sums in private attributes a saved state would have to reach into;
the same test holds it to river's ``drift.PageHinkley`` value for value.
"""

from __future__ import annotations

import math
from typing import Any

from river import base

# Values of its own a warm-up needs however many windows they stood for (``span_warmup``):
# three give two successive differences and a median that one start-up value cannot move.
MIN_WARM_VALUES = 3


class EWMeanVar(base.Base):
    """Exponentially weighted mean and variance, as river's ``EWMean`` and ``EWVar``.

    Parameters
    ----------
    fading_factor
        Weight of the newest value, in (0, 1]; river's convention (closer to 1 adapts faster).

    Examples
    --------
    >>> s = EWMeanVar(fading_factor=0.5)
    >>> for x in [1, 3, 5, 4, 6, 8, 7, 9, 11]:
    ...     s.update(x)
    >>> s.mean, s.var
    (9.4296875, 3.56536865234375)
    """

    def __init__(self, fading_factor: float = 0.5):
        if not 0 < fading_factor <= 1:
            raise ValueError(f"fading_factor must be in (0, 1], got {fading_factor!r}")
        self.fading_factor = fading_factor
        self._reset()

    def _reset(self) -> None:
        self._n = 0
        self._mean = 0.0
        self._var = 0.0

    @property
    def n(self) -> int:
        return self._n

    @property
    def mean(self) -> float:
        return self._mean

    @property
    def var(self) -> float:
        return self._var

    def update(self, x: float, weight: float | None = None) -> None:
        """Learn ``x``; ``weight`` overrides the fading factor for this update."""
        if self._n == 0:
            self._mean = x
        else:
            diff = x - self._mean
            a = self.fading_factor if weight is None else weight
            incr = a * diff
            self._mean += incr
            self._var = (1.0 - a) * (self._var + diff * incr)
        self._n += 1

    def to_state(self) -> dict[str, Any]:
        return {"n": self._n, "mean": self._mean, "var": self._var}

    def load_state(self, state: dict[str, Any]) -> None:
        self._n, self._mean, self._var = state["n"], state["mean"], state["var"]


class RatioBaseline(base.Base):
    """Online baseline of a positive quantity; scores the relative loss against it.

    ``score_one(x)`` is the *effect* ``1 - x / baseline`` (0.25 = 25 % below baseline),
    high meaning anomalous, and 0 while there is no baseline yet. The baseline lives in
    log space, so a 2x slowdown and a 2x speed-up are equally far from it.

    Parameters
    ----------
    warmup
        Observations learned before the baseline exists (river's ``grace_period``).
    fading_factor
        EW weight of a new observation once warm. 0.02 per 1 s window is a time constant
        of ~50 s: slow enough that a ramp over tens of seconds is still seen against
        what came before it.
    clip_sigmas
        A learned observation is clipped to this many noise sigmas from the baseline.
    protect
        If set, an observation whose effect is at least this is not learned at all.
    min_rel_sigma
        Floor of the relative noise used by :meth:`zscore`, so a very steady key does
        not make a 1 % wobble look like 10 sigma.

    Examples
    --------
    >>> import random
    >>> rng = random.Random(7)
    >>> b = RatioBaseline(warmup=10, protect=0.1)
    >>> for _ in range(200):
    ...     b.learn_one(100.0 * rng.lognormvariate(0, 0.02))
    >>> b.baseline
    99.9...
    >>> b.score_one(75.0)
    0.25...
    >>> b.learn_one(75.0)   # protected: a degraded value is not learned
    >>> b.baseline
    99.9...
    >>> RatioBaseline(warmup=10).score_one(75.0)   # no baseline, no opinion
    0.0
    """

    def __init__(
        self,
        warmup: int = 10,
        fading_factor: float = 0.02,
        clip_sigmas: float = 3.0,
        protect: float | None = None,
        min_rel_sigma: float = 0.01,
    ):
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1, got {warmup!r}")
        if not 0 < fading_factor <= 1:
            raise ValueError(f"fading_factor must be in (0, 1], got {fading_factor!r}")
        if not clip_sigmas > 0:
            raise ValueError(f"clip_sigmas must be > 0, got {clip_sigmas!r}")
        if protect is not None and not 0 < protect < 1:
            raise ValueError(f"protect must be in (0, 1) or None, got {protect!r}")
        if not min_rel_sigma > 0:
            raise ValueError(f"min_rel_sigma must be > 0, got {min_rel_sigma!r}")
        self.warmup = warmup
        self.fading_factor = fading_factor
        self.clip_sigmas = clip_sigmas
        self.protect = protect
        self.min_rel_sigma = min_rel_sigma
        self._reset()

    def _reset(self) -> None:
        self._warm: list[float] = []  # log observations while warming up
        self._warm_spanned = 0  # observations counted by `span_warmup`, not learned
        self._stats = EWMeanVar(self.fading_factor)  # of log observations, once warm
        # Noise: EW mean of half the squared difference of successive learned logs. A
        # slow drift barely moves successive differences, while it inflates the spread
        # around the mean, which would mute the z-score exactly when a ramp needs it.
        self._noise_var = 0.0
        self._prev: float | None = None
        self._prior: float | None = None  # log of the cold-start value
        self._skipped = 0  # protected observations, for evidence

    # --- reading ------------------------------------------------------------------

    @property
    def warm(self) -> bool:
        return self._stats.n > 0

    @property
    def log_baseline(self) -> float | None:
        if self._stats.n:
            return self._stats.mean
        return self._prior

    @property
    def baseline(self) -> float | None:
        lb = self.log_baseline
        return None if lb is None else math.exp(lb)

    @property
    def rel_sigma(self) -> float:
        """Relative noise of one observation (std of the log, from successive differences)."""
        return max(math.sqrt(self._noise_var), self.min_rel_sigma)

    def score_one(self, x: float) -> float:
        lb = self.log_baseline
        if lb is None or not x > 0:
            return 0.0
        return 1.0 - x / math.exp(lb)

    def zscore(self, x: float) -> float:
        """How many noise sigmas ``x`` lies below the baseline (0 without a baseline)."""
        lb = self.log_baseline
        if lb is None or not x > 0:
            return 0.0
        return (lb - math.log(x)) / self.rel_sigma

    # --- learning -----------------------------------------------------------------

    def relevel(self, value: float) -> None:
        """Move the baseline to ``value`` at once (noise estimate kept): a level the caller
        watched for a while without it ever being a degradation is the new normal."""
        if self._stats.n and value > 0:
            self._stats._mean = math.log(value)

    def set_prior(self, value: float | None) -> None:
        """Cold-start value (e.g. from the fitted model), used until the warm-up ends."""
        self._prior = math.log(value) if value is not None and value > 0 else None

    def learn_one(self, x: float, level: bool = True) -> None:
        """Learn ``x``; with ``level=False`` only its noise (the baseline level is held)."""
        if not x > 0 or x == math.inf:
            return
        lx = math.log(x)
        stats = self._stats
        if stats.n == 0:
            self._warm.append(lx)
            self._maybe_finish_warmup()
            return
        resid = lx - stats.mean
        if self.protect is not None and 1.0 - math.exp(resid) >= self.protect:
            self._skipped += 1
            return
        sigma = self.rel_sigma
        # A running mean while young (the warm-up estimate weighs `warmup` windows), then
        # EW: the first minutes are not judged by ten windows' median and noise.
        a = max(self.fading_factor, 1.0 / (self.warmup + stats.n))
        if self._prev is not None:
            # Raw differences, capped at clip_sigmas of their own spread (sqrt 2 sigma):
            # a spike counts little, and an underestimate still grows back.
            cap = self.clip_sigmas * 1.4142 * sigma
            d = min(max(lx - self._prev, -cap), cap)
            self._noise_var += a * (0.5 * d * d - self._noise_var)
        self._prev = lx
        if level:
            limit = self.clip_sigmas * sigma
            stats.update(stats.mean + min(max(resid, -limit), limit), a)

    def span_warmup(self, n: int = 1) -> None:
        """Count ``n`` more observations towards the warm-up without learning a value: the
        last one learned stood for them too (a log line that reports several windows).

        The warm-up still needs ``MIN_WARM_VALUES`` values of its own, for a noise estimate.

        >>> b = RatioBaseline(warmup=10)
        >>> for v in (100.0, 101.0, 99.0):
        ...     b.learn_one(v)
        ...     b.span_warmup(4)              # each value reported five windows
        >>> b.warm, round(b.baseline)
        (True, 100)
        """
        if self._stats.n == 0 and n > 0:
            self._warm_spanned += n
            self._maybe_finish_warmup()

    def _maybe_finish_warmup(self) -> None:
        if len(self._warm) >= min(MIN_WARM_VALUES, self.warmup) and \
                len(self._warm) + self._warm_spanned >= self.warmup:
            self._finish_warmup()

    def _finish_warmup(self) -> None:
        order = self._warm
        warm = sorted(order)
        n = len(warm)
        median = warm[n // 2]
        devs = sorted(abs(v - median) for v in warm)
        mad = devs[n // 2]
        # Successive differences without the two largest (one spike makes two): robust
        # to a spike and to a drift during the warm-up.
        diffs = sorted(0.5 * (b - a) ** 2 for a, b in zip(order, order[1:], strict=False))
        kept = diffs[:-2] if len(diffs) >= 5 else diffs
        # Neither differences nor deviations beyond three robust sigmas count (a job's
        # first steps are often far slower: start-up, not noise).
        far = (3 * 1.4826 * mad) ** 2
        if mad > 0:
            kept = [d for d in kept if d <= far]  # half a squared difference: sigma^2
        diff_var = sum(kept) / len(kept) if kept else 0.0
        # And the spread around the median without the largest deviation.
        trimmed = devs[:-1] if n >= 5 else devs
        if mad > 0:
            trimmed = [d for d in trimmed if d * d <= far]
        spread_var = sum(d * d for d in trimmed) / max(len(trimmed) - 1, 1)
        start = median
        prior = self._prior
        gate = self.protect if self.protect is not None else 0.10
        if prior is not None and 1.0 - math.exp(median - prior) >= gate:
            # The whole warm-up looks degraded against the fitted model: trust the model
            # rather than learn a degraded period as normal.
            start = prior
        self._stats.update(start)
        # The largest of three estimates: ten windows often give one far below the true
        # noise, and an underestimate means false alarms.
        self._noise_var = max((1.4826 * mad) ** 2, diff_var, spread_var)
        self._prev = order[-1]
        self._warm = []
        self._warm_spanned = 0

    # --- persistence --------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        return {
            "warm": list(self._warm),
            "warm_spanned": self._warm_spanned,
            "stats": self._stats.to_state(),
            "noise_var": self._noise_var,
            "prev": self._prev,
            "prior": self._prior,
            "skipped": self._skipped,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], **params: Any) -> RatioBaseline:
        obj = cls(**params)
        obj._warm = list(state["warm"])
        obj._warm_spanned = state.get("warm_spanned", 0)  # absent in states saved before it
        obj._stats.load_state(state["stats"])
        obj._noise_var = state["noise_var"]
        obj._prev = state["prev"]
        obj._prior = state["prior"]
        obj._skipped = state["skipped"]
        return obj


def learn_or_hold(model: Any, held: list[float], value: float, degraded: bool) -> list[float]:
    """Learn ``value`` unless it is degraded; return the values still held back.

    A degraded value may be the start of an incident, which must not move the baseline
    it is judged against, nor be lost if it proves a blip: it is held back, and once a
    healthy value comes (the streak never became an incident) the held ones are learned
    first, in order. The caller drops what is held when a rule fires instead.

    >>> b = RatioBaseline(warmup=1)
    >>> held = learn_or_hold(b, [], 100.0, degraded=False)
    >>> held = learn_or_hold(b, held, 80.0, degraded=True)
    >>> held, round(b.baseline, 6)          # held back: the baseline has not moved
    ([80.0], 100.0)
    >>> held = learn_or_hold(b, held, 100.0, degraded=False)
    >>> held, b.baseline < 100.0            # a blip after all: learned, then the new one
    ([], True)
    """
    if degraded:
        held.append(value)
        return held
    for v in held:
        model.learn_one(v)
    model.learn_one(value)
    return []


class DriftEvidence(base.Base):
    """Page-Hinkley (river's ``drift.PageHinkley``, mode "down") on log residuals, kept as
    supporting evidence.

    Fed ``log(observed / baseline)`` once per window, it says whether the mean of the
    residuals has shifted down; the sustained-threshold rule decides, this only adds
    ``page_hinkley: true`` to an anomaly's evidence.

    Parameters
    ----------
    min_instances
        Windows before the test may detect.
    threshold
        Page-Hinkley's lambda on the cumulative log residual (0.25 ~ two windows at -12 %).
    delta
        Tolerated drift per window.
    alpha
        Forgetting factor of the cumulative sums.

    Examples
    --------
    >>> import random
    >>> rng = random.Random(3)
    >>> ph = DriftEvidence(min_instances=10)
    >>> for i in range(60):
    ...     ph.update(rng.gauss(0, 0.01) - (0.2 if i >= 50 else 0.0))
    ...     if ph.drift_detected:
    ...         print("drift at window", i)
    ...         break
    drift at window 51
    """

    def __init__(
        self,
        min_instances: int = 10,
        threshold: float = 0.25,
        delta: float = 0.005,
        alpha: float = 1 - 1e-3,
    ):
        self.min_instances = min_instances
        self.threshold = threshold
        self.delta = delta
        self.alpha = alpha
        self._reset()

    def _reset(self) -> None:
        # river's PageHinkley(mode="down") state: its running mean (weight, value), the
        # faded cumulative sums and their extremes (river starts the maximum at -1)
        self._n = 0.0
        self._mean = 0.0
        self._sum_increase = 0.0
        self._sum_decrease = 0.0
        self._min_increase = math.inf
        self._max_decrease: float = -1
        self._drift = False

    @property
    def drift_detected(self) -> bool:
        return self._drift

    def update(self, residual: float) -> None:
        # river's PageHinkley.update, operation for operation (so the floats agree)
        if self._drift:
            self._reset()
        self._n += 1.0
        self._mean += (1.0 / self._n) * (residual - self._mean)
        dev = residual - self._mean
        self._sum_increase = self.alpha * self._sum_increase + dev - self.delta
        self._sum_decrease = self.alpha * self._sum_decrease + dev + self.delta
        if self._sum_increase < self._min_increase:
            self._min_increase = self._sum_increase
        if self._sum_decrease > self._max_decrease:
            self._max_decrease = self._sum_decrease
        if self._n >= self.min_instances:
            self._drift = self._max_decrease - self._sum_decrease > self.threshold

    def to_state(self) -> dict[str, Any]:
        mi = self._min_increase
        return {
            "n": self._n,
            "mean": self._mean,
            "si": self._sum_increase,
            "sd": self._sum_decrease,
            # JSON has no infinity; None stands for the initial +inf.
            "mi": None if mi == math.inf else mi,
            "md": self._max_decrease,
            "drift": self._drift,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], **params: Any) -> DriftEvidence:
        obj = cls(**params)
        obj._n = state["n"]
        obj._mean = state["mean"]
        obj._sum_increase = state["si"]
        obj._sum_decrease = state["sd"]
        obj._min_increase = math.inf if state["mi"] is None else state["mi"]
        obj._max_decrease = state["md"]
        obj._drift = bool(state["drift"])
        return obj
