"""Transform: a node's op records -> window summaries, remembering what a restart re-reads.

The forwarder windows two kinds of source apart: spool ops arrive in about completion
order, Inspector dumps per communicator, so Inspector's windows wait longer for their
stragglers (``inspector_lateness_s``). Both are :class:`~ncclwatch.ingest.windows.Windower`
s; what this class adds is the bookkeeping that makes the windows survive a crash:

- per source file, the byte offset of the first op of each window still open
  (``window_from``): the checkpoint keeps it, and a restart re-reads the file from there,
  for windowing only, so an open window comes out whole, not cut at the restart;
- per process, the windows already closed (``closed_before``), so ops re-read after a
  restart that fall into them count as late instead of emitting a window twice;
- which source files hold which process's ops, so a process that stopped writing
  (:meth:`idle`) has its windows flushed and its files' offsets dropped together.

>>> from ncclwatch.records import OpRecord
>>> nw = NodeWindows(window_s=1.0, inspector_lateness_s=10.0)
>>> def op(i):
...     return OpRecord(id="0" * 16, job="j", host="h", pid=1, gpu="g", comm="0x" + "0" * 15 + "1",
...         comm_name="dp", rank=0, nranks=8, nnodes=1, local_ranks=8, transport="nvlink",
...         op="AllReduce", seq=i, count=1, dtype="ncclFloat32", bytes=4, peer=-1, algo="RING",
...         proto="SIMPLE", channels=8, start_ns=i * 10**9, exec_ns=1000, timing="kernel_gpu",
...         algbw_gbs=1.0, busbw_gbs=1.0, graph=False)
>>> [nw.add("spool", op(i), "f", 100 * i) for i in range(2)]
[[], []]
>>> nw.window_from()                         # a restart re-reads "f" from the first op
{'f': 0}
>>> [w.count for w in nw.add("spool", op(2), "f", 200)]   # the first window closes
[1]
>>> nw.window_from()
{'f': 100}
>>> [w.count for w in nw.idle(lambda src: True)], nw.window_from()
([1, 1], {})
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from ncclwatch.ingest.windows import Stream, Windower

from ncclwatch.records import WindowSummary

StreamKey = tuple[str, Stream]  # (windower name, (job, host, pid))


class NodeWindows:
    """The forwarder's windowers (``"spool"``, ``"inspector"``) and what restarts need of them.

    ``closed_before``: a checkpoint's ``[[windower, job, host, pid, before_ns], ...]``.
    """

    def __init__(self, window_s: float, inspector_lateness_s: float,
                 closed_before: list | None = None) -> None:
        self.windowers = {
            "spool": Windower(window_s),
            "inspector": Windower(window_s, lateness_s=max(window_s, inspector_lateness_s)),
        }
        self.window_ns = int(round(window_s * 1e9))
        self.open_first: dict[str, dict[int, int]] = {}  # source -> window start -> 1st offset
        # (windower name, (job, host, pid)) <-> sources holding that process's ops
        self.src_stream: dict[str, StreamKey] = {}
        self.stream_srcs: dict[StreamKey, set[str]] = collections.defaultdict(set)
        for wname, job, host, pid, before in closed_before or ():
            self.windowers[wname].resume((job, host, pid), before)

    def starts(self, src: str) -> dict[int, int]:
        """``src``'s open windows: start -> offset of their first op (the hot path keeps it)."""
        return self.open_first.setdefault(src, {})

    def add(self, wname: str, rec: Any, src: str, off: int,
            starts: dict[int, int] | None = None) -> list[WindowSummary]:
        """Window one op read at ``off`` of ``src``; the windows its arrival closed."""
        if starts is None:
            starts = self.starts(src)
        end = rec.start_ns + rec.exec_ns
        ws = end - end % self.window_ns
        if ws not in starts:
            self.opened(wname, rec, src, off, starts, ws)
        closed = self.windowers[wname].add(rec)
        if closed:
            self.prune((wname, (rec.job, rec.host, rec.pid)))
        return closed

    def opened(self, wname: str, rec: Any, src: str, off: int, starts: dict[int, int], ws: int) -> None:
        """A window starting at ``ws`` got its first op from ``src`` at ``off``."""
        starts[ws] = off
        if src not in self.src_stream:
            key = (wname, (rec.job, rec.host, rec.pid))
            self.src_stream[src] = key
            self.stream_srcs[key].add(src)

    def prune(self, key: StreamKey) -> None:
        """Forget the offsets of the windows of process ``key`` that closed."""
        before = self.windowers[key[0]].closed_before_ns(key[1])
        if before is None:
            return
        for src in self.stream_srcs.get(key, ()):
            starts = self.open_first.get(src)
            if starts:
                for ws in [ws for ws in starts if ws < before]:
                    del starts[ws]

    def window_from(self) -> dict[str, int]:
        """Per source, the offset a restart re-reads it from to rebuild its open windows."""
        return {src: min(starts.values()) for src, starts in self.open_first.items() if starts}

    def closed_before(self) -> list[list]:
        """Every process's closing horizon, as the checkpoint keeps it."""
        return [[wname, *s, t] for wname, w in self.windowers.items()
                for s, t in w.closed_before_all().items()]

    def idle(self, is_idle: Callable[[str], bool]) -> list[WindowSummary]:
        """Flush the windows of every process all of whose sources ``is_idle``, in time
        order across processes (as they would have closed: a partition is a FIFO, and the
        worker can only merge other inputs around what it holds)."""
        flushed: list[WindowSummary] = []
        for key in list(self.stream_srcs):
            srcs = self.stream_srcs[key]
            if all(is_idle(s) for s in srcs):
                flushed += self.windowers[key[0]].flush(key[1])
                for s in srcs:
                    self.open_first.pop(s, None)
                    self.src_stream.pop(s, None)
                # The windower keeps the stream's closing horizon, so a process that
                # resumes cannot reopen (and re-emit) a flushed window.
                del self.stream_srcs[key]
        flushed.sort(key=lambda w: (w.end_ns, w.job, w.host, w.comm, w.op, w.rank))
        return flushed

    def forget_source(self, src: str) -> None:
        """A source file deleted once everything of it was delivered."""
        self.open_first.pop(src, None)

    @property
    def late_total(self) -> int:
        """Ops that arrived for windows already closed, over every windower."""
        return sum(w.late_total for w in self.windowers.values())
