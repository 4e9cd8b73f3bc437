"""The forwarder's sources: what turns polled lines of a node's files into Kafka messages.

Four sources, each one class (in Vector's words, a source with its transform):

* :class:`SpoolSource`: the plugin spool (op, throughput, drop and plugin_stats lines of
  the contract); ops are windowed and grouped by communicator, the rest routed by kind;
* :class:`InspectorSource`: NCCL Inspector's JSON logs, mapped to op records;
* :class:`TrainlogSource`: the ranks' training logs, merged into the job's throughput;
* :class:`PromFiles`: Inspector's ``.prom`` files, polled whole (no lines, no stream time).

The three line sources share one :class:`Intake`: the node's windows, the stream times
they are read together in (:mod:`ncclwatch.ingest.alignment`), the offsets below which a
line was delivered before a restart (re-read for windowing only), the clock and the
quarantine. Each ``read(chunks, out, ops, horizon)`` appends messages ``(topic, key,
value)`` to ``out`` and op lines to ``ops`` (grouped by job and communicator, packed by
the forwarder), and returns ``(lines used, streams given back)``
(:data:`~ncclwatch.ingest.alignment.ReadChunks`).
"""

from __future__ import annotations

import collections
import glob
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncclwatch.ingest.alignment import NO_LIMIT, StreamTimes
from ncclwatch.ingest.disk_errors import DiskErrors
from ncclwatch.ingest.inspector import (
    InspectorError,
    NotAnOp,
    op_from_inspector,
    quarantine,
    windows_from_prom,
)
from ncclwatch.ingest.metrics import ForwarderMetrics
from ncclwatch.ingest.node_windows import NodeWindows
from ncclwatch.ingest.parse import FastOpRecord, parse
from ncclwatch.ingest.recording import inspector_job
from ncclwatch.ingest.spool import FileTailer, SpoolTailer
from ncclwatch.ingest.throughput import job_id
from ncclwatch.ingest.trainlog import RankLogs

from ncclwatch import private
from ncclwatch.config import TopicsConfig
from ncclwatch.records import Quarantined, to_json
from ncclwatch.routing import key_for, op_group, topic_for
from ncclwatch.rules import safe_filename


class QuarantineSink:
    """Lines that are not records: counted, appended to the node's quarantine file (a
    convenience copy) and sent to the quarantine topic (the full record)."""

    def __init__(self, path: str, topic: str, metrics: ForwarderMetrics, disk: DiskErrors):
        self.path = path
        self.topic = topic
        self.metrics = metrics
        self.disk = disk
        self.total = 0
        self.fd: int | None = None

    def put(self, q: Quarantined, out: list) -> None:
        self.metrics.quarantined.labels(q.stage, q.reason).inc()
        self.total += 1
        # "replace": a spool file name that is not UTF-8 comes back from the file system
        # with surrogate escapes, which must not make the forwarder raise.
        line = to_json(q).encode("utf-8", "replace")
        try:
            if self.fd is None:
                private.makedirs(os.path.dirname(self.path))
                self.fd = private.open_append(self.path)
            os.write(self.fd, line + b"\n")
        except OSError as e:  # the file is a convenience copy: the topic has it all
            self.disk.failed("quarantine", self.path, e)
        else:
            self.disk.ok("quarantine")
        out.append((self.topic, q.source.encode("utf-8", "replace"), line))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@dataclass
class Intake:
    """What the line sources share: the node's windows and stream times, the delivered
    floor, the clock, the quarantine, and how windows are packed into messages."""

    windows: NodeWindows
    times: StreamTimes
    quarantine: QuarantineSink
    topics: TopicsConfig
    clock: Callable[[], float]
    max_future_s: float
    windows_per_message: int
    max_line_bytes: int
    # Lines ending at or before these offsets were delivered before a restart: they are
    # re-read only to rebuild open windows, never re-sent.
    floor: dict[str, int] = field(default_factory=dict)
    last_seen: dict[str, float] = field(default_factory=dict)  # file -> wall time read

    @property
    def max_future_ns(self) -> int:
        return int(self.max_future_s * 1e9)

    def emit_windows(self, closed: list, out: list) -> None:
        """Windows onto ``out``, packed: one that closes right after a window of the same
        job joins its message (up to ``windows_per_message``), so a partition still gets
        its records in the order they closed."""
        wt = topic_for(self.topics, "window")
        k = self.windows_per_message
        for s in closed:
            key, value = key_for(s, self.topics), to_json(s).encode()
            if k > 1 and out:
                topic, last_key, last = out[-1]
                if topic == wt and last_key == key and last.count(b"\n") + 1 < k:
                    out[-1] = (wt, key, last + b"\n" + value)
                    continue
            out.append((wt, key, value))

    def emit_throughput(self, records: list, out: list) -> None:
        """The job's steps and pauses (one topic: :func:`~ncclwatch.routing.topic_for`)."""
        for rec in records:
            out.append((topic_for(self.topics, rec.KIND), key_for(rec), to_json(rec).encode()))

    def window_op(self, wname: str, rec: Any, src: str, off: int, starts: dict[int, int],
                  out: list) -> None:
        closed = self.windows.add(wname, rec, src, off, starts)
        if closed:
            self.emit_windows(closed, out)

    # A file source's chunk (an Inspector log, a training log: one stream per file).

    def open_file(self, src: str, horizon: int) -> tuple[int, int]:
        """``(horizon, floor)`` for a chunk of ``src``; a file not known yet is probed
        (horizon -1: its first timed line is given back)."""
        st = self.times
        st.path[src] = src
        return (horizon if src in st.time else -1), self.floor.get(src, -1)

    def give_back(self, tailer: FileTailer, src: str, offset: int, t_ns: int, stopped: set[str]) -> None:
        """A line stamped ``t_ns`` past the horizon: ``src`` is read again from it later."""
        tailer.rewind(src, offset)
        stopped.add(src)
        self.times.time[src] = t_ns

    def read_through(self, src: str, hi: int, next_offset: int, floor: int) -> None:
        """A chunk of ``src`` used to its end: its time is its newest record's."""
        if hi > self.times.time.get(src, -1):
            self.times.time[src] = hi
        if next_offset >= floor:
            self.floor.pop(src, None)

    def ahead_of_clock(self, t_ns: int, now: float, raw: bytes, src: str, off: int) -> Quarantined:
        ahead = t_ns / 1e9 - now
        return Quarantined(stage="schema", reason="out_of_range",
                           detail=f"record time {ahead:.0f} s ahead of this reader's clock "
                                  f"(ingest.max_future_s={self.max_future_s:g})",
                           source=src, offset=off, raw=raw[:4096].decode("utf-8", errors="replace"))


class SpoolSource:
    """The plugin spool: every line parsed (the fast path for ops), ops windowed and
    grouped, other kinds routed to their topics, bad lines quarantined.

    ``check_job`` (``ingest.spool_trust=owner``): a record must name the job of the
    directory it is in.
    """

    name = "spool"

    def __init__(self, intake: Intake, tailer: SpoolTailer, metrics: ForwarderMetrics, *,
                 check_job: bool):
        self.intake = intake
        self.tailer = tailer
        self.metrics = metrics
        self.check_job = check_job
        self._dir_jobs: dict[str, str | None] = {}  # segment dir -> its job's safe name

    def read(self, chunks: list, out: list, ops: dict, horizon: int = NO_LIMIT) -> tuple[int, set[str]]:
        """Process polled chunks up to each stream's horizon; (lines used, streams given
        back). Lines past a stream's horizon are given back to the tailer."""
        # The hot path of the forwarder: keep per-line work to parse, window, group.
        intake = self.intake
        windows = intake.windows
        wadd = windows.windowers["spool"].add
        opened, prune = windows.opened, windows.prune
        window_ns = windows.window_ns
        emit_windows = intake.emit_windows
        fast_op = FastOpRecord
        tailer = self.tailer
        sid_of = tailer.stream_id
        st = intake.times
        st_time = st.time
        floors = intake.floor
        n = 0
        now = intake.clock()
        future = int(now * 1e9) + intake.max_future_ns
        stopped: set[str] = set()
        rewound: set[str] = set()
        for chunk in chunks:
            src = chunk.source
            sid = sid_of(src)
            if sid in stopped:  # a stream given back: so is the rest of what was polled
                if src not in rewound:
                    tailer.rewind(src, chunk.offset)
                    rewound.add(src)
                continue
            # A stream not known yet gives its first timed record back (a probe).
            hz = horizon if sid in st_time else -1
            hi = -1
            gave = -1
            st.path[sid] = src
            floor = floors.get(src, -1)
            starts = windows.starts(src)
            raws = chunk.raws
            intake.last_seen[src] = now
            want = self._dir_job(src) if self.check_job else None
            ok_job = None  # the last job seen to match `want` in this chunk
            # A chunk of one cut or unterminated line says where that line ended.
            ends = [chunk.next_offset] if len(raws) == 1 else None
            off = chunk.offset
            used = 0
            for raw in raws:
                nxt = off + len(raw) + 1 if ends is None else ends[0]
                rec = parse(raw, src, off)
                if want is not None and (job := getattr(rec, "job", ok_job)) != ok_job:
                    if safe_filename(job) == want:
                        ok_job = job
                    else:
                        rec = self._wrong_job(job, raw, src, off)
                if type(rec) is fast_op and (end := rec.start_ns + rec.exec_ns) > future:
                    rec = intake.ahead_of_clock(end, now, raw, src, off)
                if type(rec) is fast_op:
                    if end > hz:
                        gave = end
                        break
                    if end > hi:
                        hi = end
                    ws = end - end % window_ns  # NodeWindows.add, inlined: once per op
                    if ws not in starts:
                        opened("spool", rec, src, off, starts, ws)
                    closed = wadd(rec)
                    if closed:
                        emit_windows(closed, out)
                        prune(("spool", (rec.job, rec.host, rec.pid)))
                    if nxt > floor:
                        key = op_group(rec.job, rec.comm)
                        group = ops.get(key)
                        if group is None:
                            ops[key] = [raw]
                        else:
                            group.append(raw)
                else:
                    kind = rec.KIND
                    # Progress records are timed too: a backlog of them (a stall, read after
                    # it) must reach Kafka in time order across the node's processes, or the
                    # detectors hear one process wait long before they hear the others.
                    t = (rec.start_ns + rec.exec_ns if kind == "op"
                         else rec.ts_ns if kind in ("throughput", "pause", "progress") else -1)
                    if t > future:
                        rec, t, kind = intake.ahead_of_clock(t, now, raw, src, off), -1, "quarantined"
                    if t > hz:
                        gave = t
                        break
                    if t > hi:
                        hi = t
                    if nxt > floor:
                        self._route_other(rec, raw, src, off, out, ops)
                    elif kind == "op":  # an op that took the slow path, replayed
                        intake.window_op("spool", rec, src, off, starts, out)
                off = nxt
                used += 1
            n += used
            if gave >= 0:
                tailer.rewind(src, off)
                rewound.add(src)
                stopped.add(sid)
                st_time[sid] = gave
            elif hi >= 0:
                t = st_time.get(sid, -1)
                if hi > t:
                    st_time[sid] = hi
            if floor >= 0 and off >= floor:
                del floors[src]
        return n, stopped

    def _dir_job(self, src: str) -> str | None:
        """The safe name of the job whose spool directory holds ``src`` (None directly
        in the spool directory: no job to check against)."""
        d = os.path.dirname(src)
        want = self._dir_jobs.get(d, "")
        if want == "":
            if len(self._dir_jobs) > 65536:
                self._dir_jobs.clear()
            inside = os.path.normpath(d) != os.path.normpath(self.tailer.spool_dir)
            want = self._dir_jobs[d] = os.path.basename(d) if inside else None
        return want

    @staticmethod
    def _wrong_job(job: str, raw: bytes, src: str, off: int) -> Quarantined:
        return Quarantined(stage="origin", reason="wrong_job",
                           detail=f"record of job {job!r} in the spool directory of another job "
                                  "(ingest.spool_trust=owner)",
                           source=src, offset=off, raw=raw[:4096].decode("utf-8", errors="replace"))

    def _route_other(self, rec: Any, raw: bytes, src: str, off: int, out: list,
                     ops: dict) -> None:
        """Everything but a fast-path op (slow-path records, quarantine, other kinds)."""
        intake = self.intake
        kind = rec.KIND
        if kind == "op":
            intake.window_op("spool", rec, src, off, intake.windows.starts(src), out)
            ops.setdefault(op_group(rec.job, rec.comm), []).append(raw)
            return
        if kind == "quarantined":
            intake.quarantine.put(rec, out)
            return
        if kind == "drop":
            self.metrics.plugin_drops(rec.job, rec.host, rec.pid, rec.reason, rec.total)
        elif kind == "plugin_stats":
            for reason, total in rec.dropped.items():
                if isinstance(total, int):
                    self.metrics.plugin_drops(rec.job, rec.host, rec.pid, reason, total)
        out.append((topic_for(intake.topics, kind), key_for(rec), raw))


class InspectorSource:
    """NCCL Inspector's JSON logs: each line an op record of the contract (windowed by
    the Inspector windower, which waits out Inspector's per-communicator dumps); the job
    is ``job`` or Inspector's job directory's name."""

    name = "inspector_json"

    def __init__(self, intake: Intake, tailer: FileTailer, *, job: str = ""):
        self.intake = intake
        self.tailer = tailer
        self.job = job
        self.jobs: dict[str, str] = {}  # file -> its job
        self.skipped: collections.Counter = collections.Counter()  # lines that are no op

    def job_of(self, src: str) -> str:
        job = self.jobs.get(src)
        if job is None:
            job = self.job or inspector_job(Path(os.path.abspath(src))) or job_id()
            self.jobs[src] = job
        return job

    def read(self, chunks: list, out: list, ops: dict, horizon: int = NO_LIMIT) -> tuple[int, set[str]]:
        """Inspector lines -> ops, up to each file's horizon (as :meth:`SpoolSource.read`)."""
        intake = self.intake
        n = 0
        now = intake.clock()
        future = now * 1e9 + intake.max_future_ns
        stopped: set[str] = set()
        for chunk in chunks:
            src = chunk.source
            if src in stopped:  # given back: so is the rest of what was polled
                continue
            hz, floor = intake.open_file(src, horizon)
            hi = -1
            starts = intake.windows.starts(src)
            job = self.job_of(src)
            intake.last_seen[src] = now
            for line in chunk.lines():
                send = line.next_offset > floor
                try:
                    rec = op_from_inspector(line.raw, job=job)
                except NotAnOp as e:  # a dump_stats marker: no op, nothing wrong
                    n += 1
                    self.skipped[e.what] += 1
                    continue
                except InspectorError as e:
                    n += 1
                    if send:
                        stage = "parse" if e.reason in ("not_json", "not_utf8") else "schema"
                        if len(line.raw) > intake.max_line_bytes:
                            e = InspectorError("too_long", f"line of {len(line.raw)}+ bytes")
                            stage = "size"
                        intake.quarantine.put(quarantine(e, line.raw, src, line.offset, stage), out)
                    continue
                end = rec.start_ns + rec.exec_ns
                if end > future:
                    n += 1
                    if send:
                        intake.quarantine.put(intake.ahead_of_clock(end, now, line.raw, src, line.offset), out)
                    continue
                if end > hz:
                    intake.give_back(self.tailer, src, line.offset, end, stopped)
                    break
                n += 1
                hi = max(hi, end)
                intake.window_op("inspector", rec, src, line.offset, starts, out)
                if send:
                    ops.setdefault(op_group(rec.job, rec.comm), []).append(to_json(rec).encode())
            else:
                intake.read_through(src, hi, chunk.next_offset, floor)
        return n, stopped


class TrainlogSource:
    """The ranks' training logs -> the job's throughput series (:class:`RankLogs`: a
    parser per log, the ranks merged), stamped with the lines' own time (read time only
    for a line without one)."""

    name = "training_log"

    def __init__(self, intake: Intake, tailer: FileTailer, logs: RankLogs):
        self.intake = intake
        self.tailer = tailer
        self.logs = logs

    def read(self, chunks: list, out: list, ops: dict, horizon: int = NO_LIMIT) -> tuple[int, set[str]]:
        """A line stamped past its file's horizon is given back (as
        :meth:`SpoolSource.read`); the merge releases what every log was read up to."""
        intake = self.intake
        n = 0
        read_ns = time.time_ns()
        st = intake.times
        stopped: set[str] = set()
        merge = self.logs.merge
        for chunk in chunks:
            src = chunk.source
            if src in stopped:
                continue
            hz, floor = intake.open_file(src, horizon)
            hi = -1
            parser = self.logs.parser(src)
            for line in chunk.lines():
                if line.next_offset <= floor or len(line.raw) > intake.max_line_bytes:
                    if parser.megatron is not None and line.next_offset <= floor:
                        # sent before a restart: the arguments it printed still count
                        parser.megatron.read(line.raw.decode("utf-8", errors="replace"))
                    n += 1
                    continue
                untimed = parser.untimed
                rec = parser.parse(line.raw.decode("utf-8", errors="replace"), read_ns)
                if rec is not None and parser.untimed == untimed:  # its own time
                    if rec.ts_ns > hz:
                        intake.give_back(self.tailer, src, line.offset, rec.ts_ns, stopped)
                        break
                    hi = max(hi, rec.ts_ns)
                n += 1
                if rec is not None:
                    merge.add(src, rec)
            else:
                intake.read_through(src, hi, chunk.next_offset, floor)
        # Every log was read up to the earliest of their times (the aligned read).
        times = [st.time.get(p) for p in merge.sources]
        until = None if not times or None in times else min(times)
        intake.emit_throughput(merge.release(until), out)
        return n, stopped

    def flush(self, out: list) -> None:
        """The input is complete: iterations some rank never logged go too."""
        self.intake.emit_throughput(self.logs.merge.flush(), out)


class PromFiles:
    """Inspector's ``.prom`` files in ``dirs``: each new version of a file (inode, mtime,
    size) becomes window summaries over the time since its last version, once it has
    not changed for ``settle_s``. ``sent``: the versions already sent (checkpointed)."""

    def __init__(self, intake: Intake, metrics: ForwarderMetrics, dirs: list[str], *,
                 sent: dict[str, list], settle_s: float, interval_s: float):
        self.intake = intake
        self.metrics = metrics
        self.dirs = dirs
        self.sent = sent
        self.settle_s = settle_s
        self.interval_s = interval_s

    def poll(self, out: list) -> int:
        intake = self.intake
        n = 0
        now = intake.clock()
        for d in self.dirs:
            for path in sorted(glob.glob(os.path.join(d, "*.prom"))):
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                sig = [st.st_ino, st.st_mtime_ns, st.st_size]
                prev = self.sent.get(path)
                if prev == sig or st.st_size == 0:
                    continue
                if now - st.st_mtime_ns / 1e9 < self.settle_s:
                    continue  # Inspector may still be writing it
                with open(path, "rb") as f:
                    data = f.read()
                end_ns = st.st_mtime_ns
                start_ns = prev[1] if prev and prev[0] == st.st_ino and prev[1] < end_ns else (
                    end_ns - int(self.interval_s * 1e9))
                wins, bad = windows_from_prom(data, start_ns=start_ns, end_ns=end_ns, source=path)
                intake.emit_windows(wins, out)
                for q in bad:
                    intake.quarantine.put(q, out)
                self.sent[path] = sig
                n += len(wins) + len(bad)
                self.metrics.read.labels("inspector_prom").inc(len(wins) + len(bad))
        return n


LineSource = SpoolSource | InspectorSource | TrainlogSource

__all__ = ["InspectorSource", "Intake", "LineSource", "PromFiles", "QuarantineSink", "SpoolSource",
           "TrainlogSource"]
