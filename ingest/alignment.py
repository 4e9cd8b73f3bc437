"""Reading a node's streams together in stream time: the forwarder's sources.

Each stream (a spool process, an Inspector log, a rank's training log) has a *time*: the
end of the next op it holds that was read but given back (below), else the largest op
end (or throughput ``ts_ns``) taken from it. A stream is *behind* while it has complete
lines left to read. All streams of the node (every job: they share the host clock, so
this is the order a live forwarder saw) are read up to a common horizon, the smallest
time of the behind streams plus ``align_ns``; a record past the horizon is given back
(the tailer is rewound to it) and read again once the others caught up. A stream whose
time is not known yet is probed: its first timed record is given back at once. So a
backlog is read in stream-time order across processes, as a live forwarder would read
it, and op records and window summaries (which close on their own process's stream
time) reach Kafka at most ``align_ns`` apart in stream time across processes. A stream
that is caught up (no complete line left) holds nobody back.

NCCL Inspector's JSON logs (one file per process, dumped per communicator) and the
training logs (one per rank) are streams too, on the same horizon: a backlog of them
would otherwise reach Kafka one whole file after another, throughput far ahead of the
windows it should be judged with.

The runners (``watch``, the worker) order what they read with
:class:`~ncclwatch.detectors.stream.TimeMerge` instead: they hold records, where a
forwarder must not (it sends what it read, and re-reads after a crash).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from ncclwatch.ingest.spool import Tailer

NO_LIMIT = 1 << 63  # the horizon when no stream is behind

# read(chunks, out, ops, horizon) -> (lines used, streams given back)
ReadChunks = Callable[[list, list, dict, int], tuple[int, set[str]]]


@dataclass
class StreamTimes:
    """The node's streams, for reading them together in stream time."""

    time: dict[str, int] = field(default_factory=dict)  # the stream's time
    behind: dict[str, bool] = field(default_factory=dict)  # complete lines left to read
    path: dict[str, str] = field(default_factory=dict)  # the file it was last read from

    def prune(self, live: Collection[str]) -> None:
        """Forget streams the tailer no longer has (cheap when there are none)."""
        if len(self.time) > len(live) or len(self.behind) > len(live):
            for d in (self.time, self.behind, self.path):
                for sid in [s for s in d if s not in live]:
                    del d[sid]


class AlignedReads:
    """Reads a tailer's streams up to the node's common horizon (see the module).

    ``last_seen`` (file -> wall time) is the caller's idle-flush bookkeeping: a stream
    held back on purpose is marked seen, so its open windows are not flushed as idle.
    """

    def __init__(self, align_ns: int, clock: Callable[[], float], last_seen: dict[str, float]):
        self.align_ns = align_ns
        self.times = StreamTimes()
        self.clock = clock
        self.last_seen = last_seen

    def read(self, tailer: Tailer, read: ReadChunks, budget: int, out: list, ops: dict,
             live: Callable[[], Collection[str]]) -> int:
        """Lines used reading ``tailer``'s streams with ``read`` until they caught up to
        the horizon or ``budget`` is spent; ``live()``: every stream id of every source,
        for forgetting streams that are gone."""
        st = self.times
        total = 0
        # Streams found caught up are not polled again in this call (a stat per file per
        # round, for nothing, with hundreds of streams); the next call looks again.
        caught_up: set[str] = set()
        for _ in range(256):  # rounds; each one advances the slowest stream
            horizon, skip = self.plan()
            skip |= caught_up
            n_streams = max(1, len(tailer.stream_ids) - len(skip))
            per = max(64, budget // n_streams)
            chunks = tailer.poll_chunks(budget, per_stream=per, skip=skip)
            n, gave = read(chunks, out, ops, horizon)
            behind = st.behind
            limited = tailer.limited
            for sid in tailer.read_streams:
                behind[sid] = is_behind = sid in limited or sid in gave
                if not is_behind:
                    caught_up.add(sid)
            total += n
            budget -= n
            if budget <= 0 or (n == 0 and not gave) or not any(behind.values()):
                break
        st.prune(live())
        return total

    def plan(self) -> tuple[int, set[str]]:
        """The horizon, and the behind streams already past it."""
        st = self.times
        behind = [(sid, t) for sid, t in st.time.items() if st.behind.get(sid)]
        if not behind:
            return NO_LIMIT, set()
        horizon = min(t for _, t in behind) + self.align_ns
        skip = {sid for sid, t in behind if t > horizon}
        if skip:
            # Held back on purpose, not idle: keep the idle flush off its windows.
            now = self.clock()
            for sid in skip:
                path = st.path.get(sid)
                if path is not None:
                    self.last_seen[path] = now
        return horizon, skip


__all__ = ["AlignedReads", "NO_LIMIT", "ReadChunks", "StreamTimes"]
