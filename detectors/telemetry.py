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
    __slots__ = ("rank_last", "rank_host", "drops", "plugin_dropped", "resumed")

    def __init__(self) -> None:
        self.rank_last: dict[tuple[str, int], int] = {}  # (comm, rank) -> last window end
        self.rank_host: dict[tuple[str, int], str] = {}
        # host -> [first_ts, last_ts, count, {reason: n}, reported by check() yet]
        self.drops: dict[str, list] = {}
        self.plugin_dropped: dict[str, int] = {}  # "host\x1fpid" -> last cumulative total
        self.resumed: dict[str, int] = {}  # host -> start of its first window after a gap

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
        # Every rank reported within the timeout (one pass in C): no silent rank or host,
        # and no need for the walk below, once a window over every rank of a large job.
        if self.rank_last and now_ns - min(self.rank_last.values()) > timeout_ns:
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

    def _check_silent(self, now_ns: int, timeout_ns: int, out: dict[str, dict[str, Any]]) -> None:
        comm_last: dict[str, int] = {}
        host_last: dict[str, int] = {}
        for (comm, rank), last in self.rank_last.items():
            if last > comm_last.get(comm, -1):
                comm_last[comm] = last
            host = self.rank_host[(comm, rank)]
            if last > host_last.get(host, -1):
                host_last[host] = last
        for (comm, rank), last in self.rank_last.items():
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
        return {
            "ranks": [
                [c, r, self.rank_host[(c, r)], last] for (c, r), last in self.rank_last.items()
            ],
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
        for h, first, last, count, reasons, *reported in state["drops"]:
            # states saved before the flag: not reported yet (an open incident for the
            # host keeps a second check from firing again)
            obj.drops[h] = [first, last, count, dict(reasons), bool(reported and reported[0])]
        obj.plugin_dropped = dict(state["plugin_dropped"])
        obj.resumed = dict(state["resumed"])
        return obj


def _problem(since_ns: int) -> dict[str, Any]:
    return {"since_ns": since_ns, "silent_host": False, "silent_ranks": [], "drops": None}
