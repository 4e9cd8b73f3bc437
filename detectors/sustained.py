"""The sustained-degradation rule: fire after N degraded windows, resolve after M healthy.

One slow call or a one- or two-window spike is noise on a shared fabric; what an
operator wants to hear about is a loss that *holds*. So a key fires only after
``sustain`` consecutive degraded windows, and, once firing, resolves only after
``recover`` consecutive windows whose loss is under the lower ``recover_threshold``
(hysteresis, so a key hovering around the threshold does not flap).
"""

from __future__ import annotations

from typing import Any

from river import base

FIRE = "fire"
RESOLVE = "resolve"


class SustainedRule(base.Base):
    """Hysteresis state machine over per-window effects.

    ``update(effect, start_ns)`` returns ``"fire"``, ``"resolve"`` or ``None``.
    ``start_ns`` of the anomaly is the start of the first degraded window of the streak
    that fired; ``end_ns`` is the start of the first window of the recovery streak.

    Parameters
    ----------
    threshold
        Effect (relative loss) at or above which a window is degraded.
    sustain
        Consecutive degraded windows needed to fire.
    recover_threshold
        While firing, a window is healthy when its effect is below this.
    recover
        Consecutive healthy windows needed to resolve.

    Examples
    --------
    >>> r = SustainedRule(threshold=0.1, sustain=3, recover_threshold=0.05, recover=2)
    >>> effects = [0.0, 0.3, 0.3, 0.0, 0.2, 0.25, 0.2, 0.08, 0.01, 0.02]
    >>> for i, e in enumerate(effects):
    ...     transition = r.update(e, start_ns=i)
    ...     if transition:
    ...         print(i, transition)
    6 fire
    9 resolve
    >>> r.start_ns, r.end_ns
    (4, 8)
    """

    def __init__(
        self,
        threshold: float = 0.10,
        sustain: int = 3,
        recover_threshold: float = 0.05,
        recover: int = 3,
    ):
        if not 0 < threshold < 1:
            raise ValueError(f"threshold must be in (0, 1), got {threshold!r}")
        if not 0 <= recover_threshold <= threshold:
            raise ValueError(
                f"recover_threshold must be in [0, threshold], got {recover_threshold!r}"
            )
        if sustain < 1 or recover < 1:
            raise ValueError(f"sustain and recover must be >= 1, got {sustain!r}, {recover!r}")
        self.threshold = threshold
        self.sustain = sustain
        self.recover_threshold = recover_threshold
        self.recover = recover
        self._reset()

    def _reset(self) -> None:
        self._firing = False
        self._streak = 0  # consecutive degraded windows (not firing) / healthy (firing)
        self._streak_start: int | None = None
        self._start_ns: int | None = None
        self._end_ns: int | None = None

    @property
    def firing(self) -> bool:
        return self._firing

    @property
    def streak(self) -> int:
        """Consecutive degraded windows (while not firing) or healthy ones (while firing)."""
        return self._streak

    @property
    def start_ns(self) -> int | None:
        """Start of the first degraded window of the streak that fired."""
        return self._start_ns

    @property
    def end_ns(self) -> int | None:
        """Start of the first window of the recovery streak that resolved."""
        return self._end_ns

    def score_one(self, effect: float, degraded: bool | None = None) -> float:
        """Progress towards the next transition if ``effect`` were the next window.

        1.0 or more means the window would fire (or resolve); it changes nothing.
        """
        if not self._firing:
            bad = effect >= self.threshold if degraded is None else degraded
            return (self._streak + 1) / self.sustain if bad else 0.0
        if effect < self.recover_threshold:
            return (self._streak + 1) / self.recover
        return 0.0

    def update(self, effect: float, start_ns: int, degraded: bool | None = None) -> str | None:
        """Account one window; ``degraded`` overrides ``effect >= threshold`` if given."""
        if not self._firing:
            bad = effect >= self.threshold if degraded is None else degraded
            if not bad:
                self._streak = 0
                return None
            if self._streak == 0:
                self._streak_start = start_ns
            self._streak += 1
            if self._streak < self.sustain:
                return None
            self._firing = True
            self._start_ns = self._streak_start
            self._end_ns = None
            self._streak = 0
            return FIRE
        if effect >= self.recover_threshold:
            self._streak = 0
            return None
        if self._streak == 0:
            self._streak_start = start_ns
        self._streak += 1
        if self._streak < self.recover:
            return None
        self._firing = False
        self._end_ns = self._streak_start
        self._streak = 0
        return RESOLVE

    def force_resolve(self, end_ns: int) -> None:
        """End a firing anomaly without recovery windows (the key went silent)."""
        self._firing = False
        self._end_ns = end_ns
        self._streak = 0

    def to_state(self) -> dict[str, Any]:
        return {
            "firing": self._firing,
            "streak": self._streak,
            "streak_start": self._streak_start,
            "start": self._start_ns,
            "end": self._end_ns,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], **params: Any) -> SustainedRule:
        obj = cls(**params)
        obj._firing = state["firing"]
        obj._streak = state["streak"]
        obj._streak_start = state["streak_start"]
        obj._start_ns = state["start"]
        obj._end_ns = state["end"]
        return obj
