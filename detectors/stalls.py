"""Stalls: a rank that holds its communicator up, from the plugin's progress records.

Windows come from completed operations, so a job in which nothing completes (a rank's
process stopped, stuck in compute or I/O, or hung) says nothing through them: its keys
fall silent alike on every rank, and the rank everyone waits for cannot be told from the
ranks that wait. The plugin writes a ``progress`` record for each communicator of a
process that has had an operation in flight, finishing nothing, for a second or more
(:class:`~ncclwatch.records.ProgressRecord`). Per communicator, then:

- ranks *waiting*: an operation in flight for at least the stall time;
- ranks *behind*: fresh records, but fewer collectives issued than the waiting ranks
  (collectives are issued in the same order on every rank: it has not called the one
  they wait in);
- ranks *silent*: no fresh record at all, while the others write one a second or so (its
  process is stopped, or gone).

Behind and silent ranks are the ones holding the communicator up. :class:`StallTracker`
keeps the latest record of each rank and says so; the job stage (:mod:`.pipeline`) raises
the incident. Times are the records' own (the plugin's clock), never a wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_LISTED = 20
MAX_HELD = 4096  # progress records of a job not yet running steadily (its start-up)
# A rank's record is fresh while no older than this many of the waiting ranks' own
# spacing between records (NCCLWATCH_PROGRESS_MS as they write it), and at least 1 s.
FRESH_SPACINGS = 2.5
MIN_FRESH_NS = 10**9


@dataclass(frozen=True, slots=True)
class Stall:
    """One communicator held up: who waits, since when, and who holds it."""

    comm: str
    comm_name: str
    nranks: int
    since_ns: int  # the earliest wait began
    now_ns: int
    waiting: tuple[int, ...]
    behind: tuple[int, ...]
    silent: tuple[int, ...]
    colls: int  # collectives the waiting ranks have issued (the one they wait in is the last)

    @property
    def holders(self) -> tuple[int, ...]:
        return tuple(sorted(self.behind + self.silent))


class StallTracker:
    """The latest progress record of each (communicator, rank) of one job.

    >>> s = 10**9
    >>> t = StallTracker()
    >>> for now in (1, 2, 3, 4):   # rank 0 waits in its 7th collective since t = 0.5 s
    ...     t.see("c", "tp", 2, 0, now * s, colls=7, in_flight=1, waiting_since_ns=s // 2,
    ...           host="a", pid=10)
    >>> [(x.comm, x.waiting, x.silent, x.behind) for x in t.stalls(min_wait_ns=3 * s)]
    [('c', (0,), (1,), ())]
    >>> t.see("c", "tp", 2, 1, 4 * s, colls=6, in_flight=0, waiting_since_ns=0, host="b", pid=11)
    >>> [(x.silent, x.behind, x.colls) for x in t.stalls(min_wait_ns=3 * s)]   # 1 has not called it
    [((), (1,), 7)]
    >>> t.stalls(min_wait_ns=4 * s)    # waiting 3.5 s: not yet
    []
    """

    __slots__ = ("last", "meta", "now_ns", "raised", "held")

    def __init__(self) -> None:
        # (comm, rank) -> [ts_ns, prev_ts_ns, colls, in_flight, waiting_since_ns, host, pid]
        self.last: dict[tuple[str, int], list] = {}
        self.meta: dict[str, list] = {}  # comm -> [comm_name, nranks]
        self.now_ns = 0  # the newest record's time: the tracker's clock
        # (comm, since_ns) of the stalls raised: one stall is raised once, whatever is
        # read of it after it ended (a worker catching up reads its records late)
        self.raised: list[list] = []
        # records read before the job ran steadily, to be judged in order once it has
        # (see_row's arguments)
        self.held: list[list] = []

    def hold(self, row: list) -> None:
        if len(self.held) >= MAX_HELD:
            del self.held[0]
        self.held.append(row)

    def see_row(self, row: list) -> None:
        """:meth:`see` of a held row: ``[comm, comm_name, nranks, rank, ts_ns, colls,
        in_flight, waiting_since_ns, host, pid]``."""
        comm, name, nranks, rank, ts, colls, in_flight, since, host, pid = row
        self.see(comm, name, nranks, rank, ts, colls=colls, in_flight=in_flight, waiting_since_ns=since,
                 host=host, pid=pid)

    def was_raised(self, comm: str, since_ns: int) -> bool:
        return [comm, since_ns] in self.raised

    def note_raised(self, comm: str, since_ns: int) -> None:
        self.raised = [*self.raised[-(MAX_LISTED - 1):], [comm, since_ns]]

    def see(self, comm: str, comm_name: str, nranks: int, rank: int, ts_ns: int, *, colls: int,
            in_flight: int, waiting_since_ns: int, host: str, pid: int) -> None:
        prev = self.last.get((comm, rank))
        if prev is not None and ts_ns < prev[0]:
            return  # an older record read late
        self.last[(comm, rank)] = [ts_ns, prev[0] if prev else 0, colls, in_flight, waiting_since_ns, host, pid]
        self.meta[comm] = [comm_name, nranks]
        if ts_ns > self.now_ns:
            self.now_ns = ts_ns

    def forget_before(self, ts_ns: int) -> None:
        """Drop records older than ``ts_ns`` (the communicator completed ops since)."""
        for k in [k for k, v in self.last.items() if v[0] < ts_ns]:
            del self.last[k]
        live = {c for c, _ in self.last}
        for c in [c for c in self.meta if c not in live]:
            del self.meta[c]

    def process_of(self, comm: str, rank: int) -> tuple[str | None, int | None]:
        """The host and process id a rank's own records gave, where it wrote any."""
        v = self.last.get((comm, rank))
        return (v[5], v[6]) if v is not None else (None, None)

    def stalls(self, min_wait_ns: int) -> list[Stall]:
        """The communicators some rank has waited in for ``min_wait_ns`` or more, now."""
        now = self.now_ns
        by_comm: dict[str, list[tuple[int, list]]] = {}
        for (comm, rank), v in self.last.items():
            by_comm.setdefault(comm, []).append((rank, v))
        out = []
        for comm, ranks in by_comm.items():
            # Waiting: seen so twice (a stopped process, resumed, writes one record of the
            # wait it slept through before its op completes: that is not a wait seen).
            waiting = [(r, v) for r, v in ranks
                       if v[3] > 0 and v[4] and v[1] >= v[4] and now - v[4] >= min_wait_ns]
            if not waiting:
                continue
            spacing = sorted(v[0] - v[1] for _, v in waiting if v[1])
            fresh_ns = max(MIN_FRESH_NS, int(FRESH_SPACINGS * spacing[len(spacing) // 2])) if spacing \
                else MIN_FRESH_NS
            fresh = {r: v for r, v in ranks if now - v[0] <= fresh_ns}
            waiting = [(r, v) for r, v in waiting if r in fresh]
            if not waiting:
                continue
            colls = max(v[2] for _, v in waiting)
            name, nranks = self.meta[comm]
            behind = tuple(sorted(r for r, v in fresh.items() if v[2] < colls and v[3] == 0))
            silent = tuple(r for r in range(nranks) if r not in fresh)
            out.append(Stall(comm, name, nranks, min(v[4] for _, v in waiting), now,
                             tuple(sorted(r for r, _ in waiting)), behind, silent, colls))
        return out

    def waits(self, since_ns: int) -> dict[str, tuple[str, float]]:
        """``comm -> (comm_name, seconds)``: the longest any rank of the communicator has
        had an operation in flight without completing it, as of its records, for the
        communicators whose newest record is at ``since_ns`` or later (a communicator
        that stopped writing them completes operations again, or is gone).

        >>> s = 10**9
        >>> t = StallTracker()
        >>> t.see("c", "tp", 2, 0, 4 * s, colls=7, in_flight=1, waiting_since_ns=s, host="a", pid=1)
        >>> t.see("c", "tp", 2, 1, 4 * s, colls=6, in_flight=0, waiting_since_ns=0, host="b", pid=2)
        >>> t.waits(0), t.waits(5 * s)
        ({'c': ('tp', 3.0)}, {})
        """
        newest: dict[str, int] = {}
        longest: dict[str, int] = {}
        for (comm, _), v in self.last.items():
            if v[0] > newest.get(comm, -1):
                newest[comm] = v[0]
            if v[3] > 0 and v[4]:
                longest[comm] = max(longest.get(comm, 0), v[0] - v[4])
        return {c: (self.meta[c][0], ns / 1e9) for c, ns in longest.items() if newest[c] >= since_ns}

    def to_state(self) -> dict[str, Any]:
        return {"last": [[c, r, *v] for (c, r), v in self.last.items()],
                "meta": [[c, *m] for c, m in self.meta.items()], "now_ns": self.now_ns,
                "raised": [list(x) for x in self.raised], "held": [list(x) for x in self.held]}

    @classmethod
    def from_state(cls, st: dict[str, Any]) -> StallTracker:
        t = cls()
        t.last = {(row[0], int(row[1])): list(row[2:]) for row in st["last"]}
        t.meta = {row[0]: list(row[1:]) for row in st["meta"]}
        t.now_ns = st["now_ns"]
        t.raised = [list(x) for x in st.get("raised", ())]
        t.held = [list(x) for x in st.get("held", ())]
        return t
