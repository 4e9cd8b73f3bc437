"""The sustained-degradation rule: fire after N degraded windows, resolve after M healthy.

One slow call or a one- or two-window spike is noise on a shared fabric; what an
operator wants to hear about is a loss that *holds*. So a key fires only after
``sustain`` consecutive degraded windows, and, once firing, resolves only after
``recover`` consecutive windows whose loss is under the lower ``recover_threshold``
(hysteresis, so a key hovering around the threshold does not flap).

A link that keeps dropping out for a second or two never holds a loss that long, yet
costs the job as much. So a key also fires on ``flap_count`` severe windows (a loss of
at least ``flap_threshold``) among its last ``flap_windows``, not all of one streak of
degraded windows (a spike two windows long stays a spike), and a key that fired so
resolves only after ``flap_windows`` healthy windows in a row: the quiet gaps between
drop-outs are part of the fault.
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
    flap_count
        Severe windows among the last ``flap_windows`` that fire (0: off).
    flap_windows
        How many recent windows ``flap_count`` counts over; a key that fired on them
        resolves after this many healthy windows in a row (at least ``recover``).
    flap_threshold
        Effect at or above which a degraded window is severe.

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

    Drop-outs a window long, three windows apart, fire on the second; the gaps between
    them do not resolve it:

    >>> r = SustainedRule(threshold=0.1, sustain=3, recover_threshold=0.05, recover=2,
    ...                   flap_count=2, flap_windows=6, flap_threshold=0.3)
    >>> effects = [0.0, 0.8, 0.0, 0.0, 0.8, 0.0, 0.0, 0.8] + [0.0] * 7
    >>> for i, e in enumerate(effects):
    ...     transition = r.update(e, start_ns=i)
    ...     if transition:
    ...         print(i, transition, r.flapping)
    4 fire True
    13 resolve False
    >>> r.start_ns, r.end_ns
    (1, 8)
    """

    def __init__(
        self,
        threshold: float = 0.10,
        sustain: int = 3,
        recover_threshold: float = 0.05,
        recover: int = 3,
        flap_count: int = 0,
        flap_windows: int = 0,
        flap_threshold: float = 0.3,
    ):
        if not 0 < threshold < 1:
            raise ValueError(f"threshold must be in (0, 1), got {threshold!r}")
        if not 0 <= recover_threshold <= threshold:
            raise ValueError(
                f"recover_threshold must be in [0, threshold], got {recover_threshold!r}"
            )
        if sustain < 1 or recover < 1:
            raise ValueError(f"sustain and recover must be >= 1, got {sustain!r}, {recover!r}")
        if flap_count and not 2 <= flap_count <= flap_windows:
            raise ValueError(
                f"flap_count must be 0 or in [2, flap_windows], got {flap_count!r} of {flap_windows!r}")
        if flap_count and not threshold <= flap_threshold < 1:
            raise ValueError(f"flap_threshold must be in [threshold, 1), got {flap_threshold!r}")
        self.threshold = threshold
        self.sustain = sustain
        self.recover_threshold = recover_threshold
        self.recover = recover
        self.flap_count = flap_count
        self.flap_windows = flap_windows
        self.flap_threshold = flap_threshold
        self._reset()

    def _reset(self) -> None:
        self._firing = False
        self._streak = 0  # consecutive degraded windows (not firing) / healthy (firing)
        self._streak_start: int | None = None
        self._start_ns: int | None = None
        self._end_ns: int | None = None
        # While not firing, the last flap_windows windows: the start of each severe one,
        # None for the others. While firing: whether it fired on them.
        self._recent: list[int | None] = []
        self._flapping = False

    @property
    def firing(self) -> bool:
        return self._firing

    @property
    def streak(self) -> int:
        """Consecutive degraded windows (while not firing) or healthy ones (while firing)."""
        return self._streak

    @property
    def flapping(self) -> bool:
        """Firing on severe windows with healthy ones between, not on one streak."""
        return self._firing and self._flapping

    @property
    def start_ns(self) -> int | None:
        """Start of the first degraded window of the streak that fired (of the first
        severe window, for a flapping key)."""
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
            if not bad:
                return 0.0
            score = (self._streak + 1) / self.sustain
            if self.severe(effect, bad, self.flap_count, self.flap_threshold):
                starts = [s for s in self._recent[1 - self.flap_windows:] if s is not None]
                if starts and (self._streak == 0 or starts[0] < self._streak_start):
                    score = max(score, (len(starts) + 1) / self.flap_count)
            return score
        if effect < self.recover_threshold:
            return (self._streak + 1) / self._recover_windows()
        return 0.0

    @staticmethod
    def severe(effect: float, degraded: bool, flap_count: int, flap_threshold: float) -> bool:
        """Whether a window counts towards flapping: a drop-out."""
        return degraded and flap_count > 0 and effect >= flap_threshold

    def _recover_windows(self) -> int:
        return max(self.recover, self.flap_windows) if self._flapping else self.recover

    def update(self, effect: float, start_ns: int, degraded: bool | None = None) -> str | None:
        """Account one window; ``degraded`` overrides ``effect >= threshold`` if given."""
        if not self._firing:
            bad = effect >= self.threshold if degraded is None else degraded
            severe = self.severe(effect, bad, self.flap_count, self.flap_threshold)
            if self.flap_count:
                recent = self._recent
                recent.append(start_ns if severe else None)
                if len(recent) > self.flap_windows:
                    del recent[0]
            if not bad:
                self._streak = 0
                return None
            if self._streak == 0:
                self._streak_start = start_ns
            self._streak += 1
            if self._streak >= self.sustain:
                self._fire(self._streak_start, flapping=False)
                return FIRE
            if severe:
                # Recurring, not one run: a spike two windows long is not a flapping link.
                starts = [s for s in self._recent if s is not None]
                if len(starts) >= self.flap_count and starts[0] < self._streak_start:
                    self._fire(starts[0], flapping=True)
                    return FIRE
            return None
        if effect >= self.recover_threshold:
            self._streak = 0
            return None
        if self._streak == 0:
            self._streak_start = start_ns
        self._streak += 1
        if self._streak < self._recover_windows():
            return None
        self.force_resolve(self._streak_start)
        return RESOLVE

    def _fire(self, start_ns: int | None, *, flapping: bool) -> None:
        self._firing = True
        self._flapping = flapping
        self._start_ns = start_ns
        self._end_ns = None
        self._streak = 0
        self._recent = []

    def force_resolve(self, end_ns: int | None) -> None:
        """End a firing anomaly without recovery windows (the key went silent)."""
        self._firing = False
        self._flapping = False
        self._end_ns = end_ns
        self._streak = 0

    def to_state(self) -> dict[str, Any]:
        return {
            "firing": self._firing,
            "streak": self._streak,
            "streak_start": self._streak_start,
            "start": self._start_ns,
            "end": self._end_ns,
            "recent": self._recent,
            "flapping": self._flapping,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], **params: Any) -> SustainedRule:
        obj = cls(**params)
        obj._firing = state["firing"]
        obj._streak = state["streak"]
        obj._streak_start = state["streak_start"]
        obj._start_ns = state["start"]
        obj._end_ns = state["end"]
        # absent in states saved by builds before the flapping rule
        obj._recent = list(state.get("recent", ()))[-obj.flap_windows:] if obj.flap_windows else []
        obj._flapping = bool(state.get("flapping", False))
        return obj
