"""Is the job's telemetry complete? Silent ranks and hosts, and drop records.

A detector that stops hearing from a rank must say so rather than report "all healthy":
the rank's windows also vanish from every median. Per job the tracker remembers when
each (communicator, rank) last reported (stream time: window end) and on which host.
On each check, against the job's stream time ``now``:

- a rank is *silent* when it has not reported for ``timeout`` while its communicator
  still reports (other ranks of it are fresh), so an op that simply stopped being
  called, or the job ending, is not a loss;
- a host is *silent* when none of its ranks reported for ``timeout`` (the job's stream
  time only advances while other hosts still report);
- a host *drops* when drop records (or growing ``plugin_stats.dropped`` counters)
  arrived within ``timeout``. Drops read after that (their topic lagged behind the
  windows, or a catching-up worker's time merge let the windows pass them) are still
  reported, once: they happened, and forgetting them would say "nothing was lost".

Problems are reported per host, which is what an operator can go and look at.
"""

from __future__ import annotations

from typing import Any

MAX_LISTED = 20


class TelemetryTracker:
    """Liveness of a job's ranks, and its drops.

    A complete group (every rank of a communicator, what a key stage's verdict says
    without listing them) marks the communicator, not each rank: a rank was last seen
    at the later of its own mark and its communicator's. At 100k GPUs that is one
    update a communicator a window instead of one a rank.

    >>> t, s = TelemetryTracker(), 10**9
    >>> t.see_ranks("c", [(0, "a"), (1, "b")], 0, 1 * s, 5 * s)
    >>> t.see_all("c", [(0, "a"), (1, "b")], 1 * s, 2 * s, 5 * s)   # both, as one mark
    >>> for end in range(3, 10):                                     # rank 1 stops
    ...     t.see_ranks("c", [(0, "a")], (end - 1) * s, end * s, 5 * s)
    >>> t.last_seen("c", 1) == 2 * s, sorted(t.check(9 * s, 5 * s))
    (True, ['b'])
    >>> t.see_all("c", [(0, "a"), (1, "b")], 9 * s, 10 * s, 5 * s)  # back after 7 s
    >>> t.resumed, t.check(10 * s, 5 * s)
    ({'b': 9000000000}, {})
    """

    __slots__ = ("rank_last", "rank_host", "comm_all", "comms", "drops", "plugin_dropped", "resumed")

    def __init__(self) -> None:
        self.rank_last: dict[tuple[str, int], int] = {}  # (comm, rank) -> its own last window end
        self.rank_host: dict[tuple[str, int], str] = {}
        # comm -> end of the last window every rank of it reported (not saved: the
        # ranks' own marks are, at the later of the two)
        self.comm_all: dict[str, int] = {}
        self.comms: set[str] = set()
        # host -> [first_ts, last_ts, count, {reason: n}, reported by check() yet]
        self.drops: dict[str, list] = {}
        self.plugin_dropped: dict[str, int] = {}  # "host\x1fpid" -> last cumulative total
        self.resumed: dict[str, int] = {}  # host -> start of its first window after a gap

    def see_ranks(self, comm: str, ranks: Any, start: int, end: int, timeout_ns: int) -> None:
        """Ranks ``[(rank, host), ...]`` of ``comm`` reported a window ``[start, end)``."""
        rank_last, rank_host, resumed = self.rank_last, self.rank_host, self.resumed
        floor = self.comm_all.get(comm, -1)
        for rank, host in ranks:
            rk = (comm, rank)
            last = rank_last.get(rk)
            if last is None:
                if floor < 0:
                    self.comms.add(comm)
                rank_host[rk] = host
                rank_last[rk] = end
                continue
            if floor > last:
                last = floor
            if end > last:
                if end - last > timeout_ns:
                    resumed.setdefault(host, start)
                rank_last[rk] = end

    def see_all(self, comm: str, ranks: Any, start: int, end: int, timeout_ns: int) -> None:
        """Every rank of ``comm`` (``ranks``, all of them) reported a window ``[start, end)``."""
        prev = self.comm_all.get(comm)
        if prev is not None and end - timeout_ns <= prev:
            if end > prev:  # nobody can have been away longer than the timeout
                self.comm_all[comm] = end
            return
        # the first such mark, or after a silence: each rank's own (new ranks, resumed hosts)
        self.see_ranks(comm, ranks, start, end, timeout_ns)
        self.comms.add(comm)
        self.comm_all[comm] = end

    def last_seen(self, comm: str, rank: int) -> int | None:
        last = self.rank_last.get((comm, rank))
        return None if last is None else max(last, self.comm_all.get(comm, -1))  # as _lasts()

    def see_drop(self, host: str, ts_ns: int, count: int, reason: str) -> None:
        d = self.drops.get(host)
        if d is None:
            d = self.drops[host] = [ts_ns, ts_ns, 0, {}, False]
        d[0] = min(d[0], ts_ns)
        d[1] = max(d[1], ts_ns)
        d[2] += count
        d[3][reason] = d[3].get(reason, 0) + count
        d[4] = False  # news for the next check, however old

    def see_plugin_stats(self, host: str, pid: int, ts_ns: int, dropped: dict) -> None:
        total = sum(v for v in dropped.values() if isinstance(v, int))
        key = f"{host}\x1f{pid}"
        prev = self.plugin_dropped.get(key)
        self.plugin_dropped[key] = total
        if prev is not None and total > prev:
            self.see_drop(host, ts_ns, total - prev, "plugin_stats")

    def check(self, now_ns: int, timeout_ns: int) -> dict[str, dict[str, Any]]:
        """Hosts with a problem now: host -> {since_ns, silent_host, silent_ranks, drops}."""
        out: dict[str, dict[str, Any]] = {}
        # Every communicator reported whole within the timeout: no silent rank or host,
        # and no need for the walk below, once a window over every rank of a large job.
        if self.rank_last and not self._all_fresh(now_ns, timeout_ns):
            self._check_silent(now_ns, timeout_ns, out)
        for host, d in list(self.drops.items()):
            first, last, count, reasons, reported = d
            if now_ns - last > timeout_ns and reported:
                del self.drops[host]  # old news: a later drop starts a new episode
                continue
            d[4] = True
            p = out.get(host)
            if p is None:
                p = out[host] = _problem(first)
                p["since_ns"] = first
            p["drops"] = {"count": count, "reasons": dict(sorted(reasons.items())), "last_ns": last}
        return out

    def _all_fresh(self, now_ns: int, timeout_ns: int) -> bool:
        comm_all = self.comm_all
        if len(comm_all) == len(self.comms):  # every communicator has been whole
            return now_ns - min(comm_all.values()) <= timeout_ns
        # some never were (windows of part of them only): each rank's own, in one C pass
        return now_ns - min(self._lasts().values()) <= timeout_ns

    def _lasts(self) -> dict[tuple[str, int], int]:
        """Each rank's last window end: its own mark or its communicator's, the later."""
        comm_all = self.comm_all
        if not comm_all:
            return self.rank_last
        return {rk: max(last, comm_all.get(rk[0], -1)) for rk, last in self.rank_last.items()}

    def _check_silent(self, now_ns: int, timeout_ns: int, out: dict[str, dict[str, Any]]) -> None:
        comm_last: dict[str, int] = {}
        host_last: dict[str, int] = {}
        lasts = self._lasts()
        for (comm, rank), last in lasts.items():
            if last > comm_last.get(comm, -1):
                comm_last[comm] = last
            host = self.rank_host[(comm, rank)]
            if last > host_last.get(host, -1):
                host_last[host] = last
        for (comm, rank), last in lasts.items():
            if now_ns - last > timeout_ns and now_ns - comm_last[comm] <= timeout_ns:
                host = self.rank_host[(comm, rank)]
                p = out.setdefault(host, _problem(host_last[host]))
                p["since_ns"] = min(p["since_ns"], last)
                if len(p["silent_ranks"]) < MAX_LISTED:
                    p["silent_ranks"].append([comm, rank])
        for host, last in host_last.items():
            if now_ns - last > timeout_ns:
                p = out.setdefault(host, _problem(last))
                p["silent_host"] = True

    def to_state(self) -> dict[str, Any]:
        host = self.rank_host
        return {
            # each rank's own last window or its communicator's, the later: what an
            # older build, which marks every rank, reads
            "ranks": [[c, r, host[rk], last] for rk, last in self._lasts().items() for c, r in (rk,)],
            "drops": [[h, *d] for h, d in self.drops.items()],
            "plugin_dropped": dict(self.plugin_dropped),
            "resumed": dict(self.resumed),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> TelemetryTracker:
        obj = cls()
        for c, r, h, last in state["ranks"]:
            obj.rank_last[(c, r)] = last
            obj.rank_host[(c, r)] = h
            obj.comms.add(c)
        for h, first, last, count, reasons, *reported in state["drops"]:
            # states saved before the flag: not reported yet (an open incident for the
            # host keeps a second check from firing again)
            obj.drops[h] = [first, last, count, dict(reasons), bool(reported and reported[0])]
        obj.plugin_dropped = dict(state["plugin_dropped"])
        obj.resumed = dict(state["resumed"])
        return obj


def _problem(since_ns: int) -> dict[str, Any]:
    return {"since_ns": since_ns, "silent_host": False, "silent_ranks": [], "drops": None}
