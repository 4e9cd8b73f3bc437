"""Op records -> window summaries: a pure, stream-time windower.

Windows are ``[start, start + window)`` with ``start`` a multiple of the window length
(epoch-aligned), and an op belongs to the window holding its *end* time
(``start_ns + exec_ns``): an op is known only once it finished.

Closing rule (stream time, one window of lateness by default): each process, identified
by ``(job, host, pid)``, has its own stream time, the largest op end seen from it. Window
``[s, s + w)`` of that process closes when an op arrives whose end is ``>= s + 2w``,
that is one full window after the window's end (``lateness_s`` changes that slack).
Ops of one process reach the spool in about completion order, so a window of slack
absorbs the usual reordering between its communicators; the clocks of different
processes never close each other's windows, so a forwarder reading one file ahead of
another cannot cut a window short. An op that
arrives for an already closed window is *late*: it is counted in ``late_total`` and left
out of every window (its raw op record is still forwarded), so no window is ever
emitted twice with different contents.

``flush()`` emits the open windows (at the end of input, or for a process that stopped
writing) and marks them closed.

Statistics use the nearest-rank method: the p-th percentile of ``n`` sorted values is
the value at rank ``ceil(p/100 * n)`` (1-based), so every reported value was observed.

The class does no I/O and reads no clock: the same inputs give the same outputs, which
is what makes re-reading the spool after a crash reproduce the same windows.

>>> from ncclwatch.records import OpRecord
>>> def op(seq, start_ms, exec_us, busbw):
...     return OpRecord(id="0" * 16, job="j", host="h", pid=1, gpu="g", comm="0x" + "0" * 15 + "1",
...         comm_name="dp", rank=0, nranks=8, nnodes=1, local_ranks=8, transport="nvlink",
...         op="AllReduce", seq=seq, count=262144, dtype="ncclFloat32", bytes=1 << 20, peer=-1,
...         algo="RING", proto="SIMPLE", channels=8, start_ns=start_ms * 10**6,
...         exec_ns=exec_us * 1000, timing="kernel_gpu", algbw_gbs=busbw / 1.75,
...         busbw_gbs=busbw, graph=False)
>>> w = Windower(window_s=1.0)
>>> w.add(op(0, 100, 50, 100.0)) + w.add(op(1, 600, 70, 90.0)) + w.add(op(2, 1500, 40, 120.0))
[]
>>> (s,) = w.add(op(3, 2000, 60, 110.0))   # end >= 0 s window end + 1 s: window 0 closes
>>> s.start_ns, s.end_ns, s.count, s.exec_ns_p50, s.exec_ns_max, s.busbw_gbs_p50, s.last_seq
(0, 1000000000, 2, 50000, 70000, 90.0, 1)
>>> [(s.start_ns // 10**9, s.count) for s in w.flush()]
[(1, 1), (2, 1)]
>>> w.add(op(4, 10, 5, 1.0)), w.late_total
([], 1)
"""

from __future__ import annotations

import math
from collections.abc import Hashable

from ncclwatch.records import UNKNOWN_GPU, UNTIMED, OpRecord, WindowSummary
from ncclwatch.rules import size_bucket

Stream = tuple[str, str, int]  # (job, host, pid)
_WindowKey = tuple[str, str, str, str, int]  # (comm, op, size_bucket, transport, rank)

_BUCKET_CACHE_MAX = 4096


def nearest_rank(sorted_values: list, p: float):
    """The p-th percentile of already sorted values, nearest-rank method.

    >>> nearest_rank([10, 20, 30, 40], 50), nearest_rank([10, 20, 30, 40], 95)
    (20, 40)
    >>> nearest_rank([7], 50)
    7
    """
    n = len(sorted_values)
    if n == 0:
        raise ValueError("no values")
    return sorted_values[max(1, math.ceil(p / 100.0 * n)) - 1]


class _Acc:
    """What one open window keeps: its first op's labels and the raw values."""

    __slots__ = ("first", "exec_ns", "busbw", "bytes", "seq_min", "seq_max")

    def __init__(self, op: OpRecord):
        self.first = op
        self.exec_ns: list[int] = []
        self.busbw: list[float] = []
        self.bytes = 0
        self.seq_min = op.seq
        self.seq_max = op.seq

    def summary(self, bucket: str, start_ns: int, window_ns: int) -> WindowSummary:
        first = self.first
        exec_ns = sorted(self.exec_ns)
        busbw = sorted(self.busbw)
        return WindowSummary(
            job=first.job,
            host=first.host,
            comm=first.comm,
            comm_name=first.comm_name,
            op=first.op,
            size_bucket=bucket,
            transport=first.transport,
            rank=first.rank,
            nranks=first.nranks,
            start_ns=start_ns,
            end_ns=start_ns + window_ns,
            count=len(exec_ns),
            bytes=self.bytes,
            exec_ns_min=exec_ns[0],
            exec_ns_p50=nearest_rank(exec_ns, 50),
            exec_ns_p95=nearest_rank(exec_ns, 95),
            exec_ns_max=exec_ns[-1],
            busbw_gbs_p50=nearest_rank(busbw, 50),
            first_seq=self.seq_min,
            last_seq=self.seq_max,
            gpu="" if first.gpu == UNKNOWN_GPU else first.gpu,
            pid=first.pid,
        )


class _StreamState:
    __slots__ = ("max_end_ns", "closed_before_ns", "open")

    def __init__(self) -> None:
        self.max_end_ns = -1
        # Windows starting before this are closed; ops for them are late.
        self.closed_before_ns = -(1 << 62)
        # window start -> key -> accumulator
        self.open: dict[int, dict[_WindowKey, _Acc]] = {}


class Windower:
    """Group op records into fixed, aligned windows per key and rank.

    Parameters
    ----------
    window_s
        Window length in seconds (> 0). Windows are aligned to multiples of it.
    lateness_s
        How long after its end a window waits for stragglers, in stream time (default:
        one window). Sources whose records arrive in coarse batches (NCCL Inspector dumps
        per communicator) need more.

    The window key is ``(job, comm, op, size_bucket, transport, rank)``; ``host``,
    ``comm_name`` and ``nranks`` are taken from the window's first op. Closed windows
    are returned by :meth:`add` in ``(start_ns, comm, op, size_bucket, transport, rank)``
    order.

    Examples
    --------
    See the module docstring.
    """

    def __init__(self, window_s: float, lateness_s: float | None = None):
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
        if lateness_s is not None and not (lateness_s >= 0 and math.isfinite(lateness_s)):
            raise ValueError(f"lateness_s must be a number of seconds >= 0, got {lateness_s!r}")
        self.window_s = window_s
        self.lateness_s = lateness_s
        self._reset()

    def _reset(self) -> None:
        self._window_ns = int(round(self.window_s * 1e9))
        if self._window_ns <= 0:
            raise ValueError(f"window_s {self.window_s!r} is below one nanosecond")
        self._lateness_ns = (self._window_ns if self.lateness_s is None
                             else int(round(self.lateness_s * 1e9)))
        self._streams: dict[Stream, _StreamState] = {}
        self._buckets: dict[int, str] = {}
        self.late_total = 0
        self._last_st: _StreamState | None = None
        self._last_pid = self._last_host = self._last_job = None

    # -- the hot path ---------------------------------------------------------------

    def add(self, op: OpRecord) -> list[WindowSummary]:
        """Account one op; return the windows its arrival closed (usually none)."""
        w = self._window_ns
        end = op.start_ns + op.exec_ns
        start = end - end % w
        # Consecutive ops mostly come from the same process: skip the stream lookup then.
        pid = op.pid
        st = self._last_st
        if st is None or pid != self._last_pid or op.host != self._last_host \
                or op.job != self._last_job:
            stream = (op.job, op.host, pid)
            st = self._streams.get(stream)
            if st is None:
                st = self._streams[stream] = _StreamState()
            self._last_st, self._last_pid = st, pid
            self._last_host, self._last_job = op.host, op.job
        if start < st.closed_before_ns:
            self.late_total += 1
            return []
        nbytes = op.bytes
        bucket = self._buckets.get(nbytes)
        if bucket is None:
            if len(self._buckets) >= _BUCKET_CACHE_MAX:
                self._buckets.clear()
            bucket = self._buckets[nbytes] = size_bucket(nbytes)
        # An op without a duration (host-timed, or sampled out of GPU timing) would put a
        # zero into the window's percentiles: it only moves stream time.
        if op.timing not in UNTIMED:
            key = (op.comm, op.op, bucket, op.transport, op.rank)
            by_key = st.open.get(start)
            if by_key is None:
                by_key = st.open[start] = {}
            acc = by_key.get(key)
            if acc is None:
                acc = by_key[key] = _Acc(op)
            acc.exec_ns.append(op.exec_ns)
            acc.busbw.append(op.busbw_gbs)
            acc.bytes += nbytes
            seq = op.seq
            if seq < acc.seq_min:
                acc.seq_min = seq
            elif seq > acc.seq_max:
                acc.seq_max = seq
        if end <= st.max_end_ns:
            return []
        st.max_end_ns = end
        # [s, s + w) closes once end >= s + w + lateness: for every s below this.
        lag = end - self._lateness_ns
        closed_before = lag - lag % w
        if closed_before <= st.closed_before_ns:
            return []
        st.closed_before_ns = closed_before
        return self._emit(st, closed_before)

    def _emit(self, st: _StreamState, before_ns: int | None) -> list[WindowSummary]:
        out: list[WindowSummary] = []
        w = self._window_ns
        for start in sorted(st.open):
            if before_ns is not None and start >= before_ns:
                continue
            by_key = st.open.pop(start)
            for key in sorted(by_key):
                out.append(by_key[key].summary(key[2], start, w))
        return out

    # -- end of input and bookkeeping ---------------------------------------------------

    def flush(self, stream: Stream | None = None) -> list[WindowSummary]:
        """Emit every open window (of one process, or all) and mark them closed.

        Later ops that fall into a flushed window are counted as late.
        """
        streams = [stream] if stream is not None else sorted(self._streams)
        out: list[WindowSummary] = []
        for s in streams:
            st = self._streams.get(s)
            if st is None or not st.open:
                continue
            last = max(st.open)
            out.extend(self._emit(st, None))
            st.closed_before_ns = max(st.closed_before_ns, last + self._window_ns)
        out.sort(key=lambda s: (s.start_ns, s.job, s.host, s.comm, s.op, s.size_bucket,
                                s.transport, s.rank))
        return out

    def streams(self) -> list[Stream]:
        """Processes ``(job, host, pid)`` seen so far."""
        return list(self._streams)

    def closed_before_ns(self, stream: Hashable) -> int | None:
        """Windows of ``stream`` starting before this time are closed (None: unseen)."""
        st = self._streams.get(stream)  # type: ignore[arg-type]
        if st is None:
            return None
        return st.closed_before_ns

    def window_start_ns(self, op: OpRecord) -> int:
        """Start of the window ``op`` falls into.

        >>> from types import SimpleNamespace as NS
        >>> Windower(2.0).window_start_ns(NS(start_ns=5_500_000_000, exec_ns=0))
        4000000000
        """
        end = op.start_ns + op.exec_ns
        return end - end % self._window_ns

    @property
    def open_windows(self) -> int:
        """How many (window, key) accumulators are open."""
        return sum(len(by_key) for st in self._streams.values() for by_key in st.open.values())

    def closed_before_all(self) -> dict[Stream, int]:
        """Every process's closing horizon, to checkpoint with the source positions."""
        return {s: st.closed_before_ns for s, st in self._streams.items()
                if st.closed_before_ns > -(1 << 62)}

    def resume(self, stream: Stream, closed_before_ns: int) -> None:
        """After a restart: windows of ``stream`` before this were already emitted.

        Ops re-read from the spool that fall into them count as late instead of opening
        a second, partial copy of a window.
        """
        st = self._streams.get(stream)
        if st is None:
            st = self._streams[stream] = _StreamState()
        st.closed_before_ns = max(st.closed_before_ns, closed_before_ns)

    def forget(self, stream: Stream) -> None:
        """Drop a finished process's state (after :meth:`flush` of it)."""
        self._streams.pop(stream, None)
        self._last_st = None
