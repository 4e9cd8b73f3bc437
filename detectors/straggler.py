"""Which rank is everyone waiting for?

In a collective every rank's kernel starts when that rank arrives and ends when the
slowest one has delivered its data, so the rank that arrives *late* spends the *least*
time in the kernel while the others spin waiting for it. The straggler is therefore the
rank whose execution time is consistently the shortest for the same op instances.

The score follows NVIDIA Resiliency Extension's relative performance score: a rank's
time divided by a reference of the ranks' times. The reference here is the median of
the *other* ranks (leave-one-out), which is the NVRx median for large communicators and
still separates the two ranks of a 2-rank communicator.
"""

from __future__ import annotations

import math
from typing import Any

from river import base

MIN_REL = 1e-6  # a rank with a zero exec time still has a finite log score


def relative_exec(x: dict[int, float]) -> dict[int, float]:
    """Each rank's time over the median of the other ranks' times.

    >>> relative_exec({0: 10.0, 1: 10.0, 2: 10.0, 3: 7.5})
    {0: 1.0, 1: 1.0, 2: 1.0, 3: 0.75}
    >>> relative_exec({0: 8.0, 1: 10.0})
    {0: 0.8, 1: 1.25}
    >>> relative_exec({0: 5.0})
    {}
    """
    n = len(x)
    if n < 2:
        return {}
    order = sorted(x.items(), key=lambda kv: kv[1])
    values = [v for _, v in order]
    m = n - 1  # the size of every leave-one-out set
    half = m // 2
    out: dict[int, float] = {}
    for k, (rank, v) in enumerate(order):
        # Index j of the remaining sorted values is values[j] below k, values[j + 1] from k on.
        hi = values[half] if half < k else values[half + 1]
        if m % 2:
            ref = hi
        else:
            lo = values[half - 1] if half - 1 < k else values[half]
            ref = (lo + hi) / 2.0
        out[rank] = v / ref if ref > 0 else 1.0
    return {r: out[r] for r in x}


class StragglerScorer(base.Base):
    """Per-rank relative execution time over successive op-instance groups of one key.

    ``learn_one(x)`` takes ``{rank: exec_ns}`` for one group (the same op instances on
    every rank, e.g. one window's p50 per rank). ``rank_scores()`` gives each rank's
    score, ``1 - EW(relative exec)``: high means the others keep waiting for that rank.
    ``score_one(x)`` is the score of the most straggling rank in ``x`` alone. The EW mean
    is geometric (of the log): with two ranks one waiting 400x longer than the other
    (measured on H200s), an arithmetic mean would take dozens of windows to notice the
    roles swap.

    Parameters
    ----------
    threshold
        A rank whose EW relative exec stays below ``1 - threshold`` is a straggler
        (``config.detector.straggler_score``).
    sustain
        Consecutive groups the same rank must be the fastest-finishing by a margin.
    fading_factor
        EW weight of a new group.
    margin
        Minimum shortfall (``1 - relative``) for a group to count towards ``sustain``;
        healthy jitter stays under it.
    max_ranks
        Bound on the ranks remembered (oldest forgotten first).

    Examples
    --------
    >>> import random
    >>> rng = random.Random(1)
    >>> s = StragglerScorer(threshold=0.2, sustain=3)
    >>> for _ in range(20):   # rank 5 arrives 40 % late: the others wait for it
    ...     s.learn_one({r: (1.0 if r == 5 else 1.4) * rng.lognormvariate(0, 0.02)
    ...                  for r in range(8)})
    >>> s.straggler()
    5
    >>> round(s.rank_scores()[5], 2), round(s.rank_scores()[0], 2)
    (0.29, 0.0)
    """

    def __init__(
        self,
        threshold: float = 0.2,
        sustain: int = 3,
        fading_factor: float = 0.3,
        margin: float = 0.05,
        max_ranks: int = 4096,
    ):
        if not 0 < threshold < 1:
            raise ValueError(f"threshold must be in (0, 1), got {threshold!r}")
        if sustain < 1:
            raise ValueError(f"sustain must be >= 1, got {sustain!r}")
        if not 0 < fading_factor <= 1:
            raise ValueError(f"fading_factor must be in (0, 1], got {fading_factor!r}")
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin!r}")
        if max_ranks < 2:
            raise ValueError(f"max_ranks must be >= 2, got {max_ranks!r}")
        self.threshold = threshold
        self.sustain = sustain
        self.fading_factor = fading_factor
        self.margin = margin
        self.max_ranks = max_ranks
        self._reset()

    def _reset(self) -> None:
        self._rel: dict[int, float] = {}  # rank -> EW of log relative exec
        self._low_rank: int | None = None  # fastest-finishing rank of the current run
        self._low_streak = 0

    def score_one(self, x: dict[int, float]) -> float:
        rel = relative_exec(x)
        return 1.0 - min(rel.values()) if rel else 0.0

    def learn_one(self, x: dict[int, float]) -> None:
        self.learn_relative(relative_exec(x))

    def learn_relative(self, rel: dict[int, float]) -> None:
        """Learn one group given as :func:`relative_exec` of it (saves computing it twice)."""
        if not rel:
            return
        a = self.fading_factor
        ew = self._rel
        for r, v in rel.items():
            lv = math.log(max(v, MIN_REL))
            old = ew.get(r)
            if old is None:
                if len(ew) >= self.max_ranks:
                    del ew[next(iter(ew))]
                ew[r] = a * lv
            else:
                ew[r] = old + a * (lv - old)
        low = min(rel, key=rel.__getitem__)
        if rel[low] <= 1.0 - self.margin:
            if low == self._low_rank:
                self._low_streak += 1
            else:
                self._low_rank, self._low_streak = low, 1
        else:
            self._low_rank, self._low_streak = None, 0

    def rank_scores(self) -> dict[int, float]:
        return {r: 1.0 - math.exp(v) for r, v in self._rel.items()}

    def relative(self) -> dict[int, float]:
        """EW (geometric) relative exec per rank (1.0 = like the others)."""
        return {r: math.exp(v) for r, v in self._rel.items()}

    @property
    def low_rank(self) -> int | None:
        """The rank that has been the fastest to finish for the last ``low_streak`` groups."""
        return self._low_rank

    @property
    def low_streak(self) -> int:
        return self._low_streak

    def straggler(self, effect: float = 0.0, usual: float = 1.0) -> int | None:
        """The straggling rank, or None.

        A rank is the straggler when it has been the fastest-finishing rank by more than
        ``margin`` for ``sustain - 1`` groups (the first group of a fault is often only
        partly affected) and either its EW relative exec is below
        ``1 - threshold`` (NVRx's rule) or it accounts for at least half of the
        key's observed loss ``effect`` (a straggler costing 15 % leaves the late rank at
        ~0.85 while a uniform slowdown leaves every rank at ~1.0).

        ``usual`` is the key's usual spread (the lowest relative exec of a healthy group,
        :class:`~.keys.KeyState`'s spread baseline): the relative exec is judged against
        it, since a rank that always arrives last (it does more host work every step)
        is how the job runs, not a new straggler.

        >>> s = StragglerScorer(threshold=0.2, sustain=3)
        >>> for _ in range(10):   # rank 0 always finishes at 0.6 of rank 1
        ...     s.learn_one({0: 0.6, 1: 1.0})
        >>> s.straggler(), s.straggler(usual=0.6)
        (0, None)
        >>> for _ in range(5):    # then much later than usual
        ...     s.learn_one({0: 0.1, 1: 1.0})
        >>> s.straggler(usual=0.6)
        0
        """
        r = self._low_rank
        if r is None or self._low_streak < max(1, self.sustain - 1):
            return None
        v = math.exp(self._rel.get(r, 0.0)) / min(1.0, max(usual, MIN_REL))
        if v < 1.0 - self.threshold or v <= 1.0 - max(self.margin, effect / 2.0):
            return r
        return None

    def to_state(self) -> dict[str, Any]:
        return {
            # JSON object keys are strings; keep ranks as ints in a list of pairs.
            "rel": [[r, v] for r, v in self._rel.items()],
            "low_rank": self._low_rank,
            "low_streak": self._low_streak,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], **params: Any) -> StragglerScorer:
        obj = cls(**params)
        obj._rel = {int(r): v for r, v in state["rel"]}
        obj._low_rank = state["low_rank"]
        obj._low_streak = state["low_streak"]
        return obj
