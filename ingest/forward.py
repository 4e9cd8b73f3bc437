"""``ncclwatch forward``: the per-node forwarder (sources -> transforms -> Kafka).

Sources: the plugin spool (:class:`~ncclwatch.ingest.spool.SpoolTailer`; throughput API
files arrive through it too), NCCL Inspector JSON logs and ``.prom`` files, a training
log. Transforms: parse + validate (:mod:`ncclwatch.ingest.parse`), Inspector mapping,
windowing (:class:`~ncclwatch.ingest.windows.Windower`). Sinks: Kafka (acks=all), the
quarantine file and topic, the on-disk spill buffer.

Delivery (see docs/ingest.md): lines are read in batches; a batch is *done* once Kafka
acknowledged every message of it, or once it was fsynced into the spill buffer. File
positions are checkpointed as of the newest batch before which every batch is done, so a
``kill -9`` loses nothing and re-sends at most the batches that were not done. Ops that
feed still-open windows are re-read after a restart for windowing only (not re-sent), so
the windows come out whole.
"""

from __future__ import annotations

import argparse
import collections
import glob
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncclwatch.ingest import checkpoint, kafka_sink
from ncclwatch.ingest.alignment import NO_LIMIT, AlignedReads
from ncclwatch.ingest.buffer import DiskBuffer
from ncclwatch.ingest.delivery import Batch, Delivery
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
from ncclwatch.ingest.spool import FileTailer, SpoolTailer, Tailer
from ncclwatch.ingest.throughput import job_id
from ncclwatch.ingest.trainlog import RankLogs

from ncclwatch import private
from ncclwatch.config import Config, IngestConfig
from ncclwatch.records import Quarantined, to_json
from ncclwatch.routing import key_for, op_group, topic_for
from ncclwatch.rules import safe_filename

log = logging.getLogger("ncclwatch.forward")


_ING = IngestConfig()  # the documented defaults: Options starts from them, never its own


@dataclass
class Options:
    """One forwarder run: ``[ingest]`` configuration with the command line's overrides
    (:func:`options_from`) plus what only the command line or a test sets. Defaults that
    configuration also has are taken from :class:`~ncclwatch.config.IngestConfig`, so a
    forwarder built in code behaves like the documented defaults."""

    spool_dir: str
    state_dir: str
    node_id: str
    inspector_dirs: list[str] = field(default_factory=list)
    training_logs: list[str] = field(default_factory=list)  # paths or globs, one file per rank
    job: str = ""
    once: bool = False
    delete_acked: bool = True
    ops_per_message: int = _ING.ops_per_message
    windows_per_message: int = _ING.windows_per_message
    window_s: float = _ING.window_s
    batch_size: int = _ING.batch_size
    linger_ms: int = _ING.linger_ms
    compression: str = _ING.compression
    buffer_max_bytes: int = _ING.buffer_max_bytes
    max_inflight_batches: int = 8
    stall_s: float = 10.0
    poll_interval_s: float = 0.05
    checkpoint_interval_s: float = 0.5
    idle_flush_s: float = 5.0
    prom_poll_s: float = 2.0
    prom_settle_s: float = 1.0
    prom_interval_s: float = 30.0
    inspector_lateness_s: float = 10.0
    # How far ahead in stream time one spool stream may be read of the slowest one with
    # lines left (-1: half a window, so windows of a node reach Kafka in start order).
    align_s: float = -1.0
    shutdown_timeout_s: float = 15.0
    auth_attempts: int = 5  # Kafka refusing the credentials this often in a row: exit 1
    throughput_regex: str = ""  # "" = configuration's ingest.throughput_regex
    quarantine_file: str = ""


class Forwarder:
    """The forwarder's state machine; :meth:`run` loops until stopped (or drained)."""

    def __init__(self, cfg: Config, opts: Options, *, metrics: ForwarderMetrics | None = None,
                 clock=time.time):
        self.cfg = cfg
        self.opts = opts
        self.topics = cfg.topics
        self.metrics = metrics or ForwarderMetrics()
        self.clock = clock
        self.max_future_ns = int(cfg.ingest.max_future_s * 1e9)
        self.host = socket.gethostname()
        self.node_dir = os.path.join(opts.state_dir, safe_filename(opts.node_id))
        self.ckpt_path = checkpoint.path_for(opts.state_dir, opts.node_id)
        self.disk = DiskErrors(self.metrics)
        for tmp in checkpoint.remove_stale_temps(self.ckpt_path):
            log.warning("event=stale_temp_removed path=%s", tmp)
        state = checkpoint.load(self.ckpt_path)
        self.acked: dict[str, int] = dict(state.get("acked", {}))
        self.window_from: dict[str, int] = dict(state.get("window_from", {}))
        self.prom_sent: dict[str, list] = dict(state.get("prom", {}))
        inodes: dict[str, int] = dict(state.get("inodes", {}))
        # Lines ending at or before these offsets were delivered before a restart: they are
        # re-read only to rebuild open windows, never re-sent.
        self.floor: dict[str, int] = {
            p: a for p, a in self.acked.items() if self.window_from.get(p, a) < a
        }

        self.initial_closed_before = state.get("closed_before", [])
        self.windows = NodeWindows(opts.window_s, opts.inspector_lateness_s, self.initial_closed_before)
        self.window_ns = self.windows.window_ns
        self.last_seen: dict[str, float] = {}
        # Every source's streams read together in stream time (ingest/alignment.py):
        # they share the host clock.
        align_ns = int(round(opts.align_s * 1e9)) if opts.align_s >= 0 else self.window_ns // 2
        self.reads = AlignedReads(align_ns, clock, self.last_seen)
        self.aligned = self.reads.times

        self.sources: list[tuple[str, Tailer]] = []
        self.spool = SpoolTailer(opts.spool_dir, trust=cfg.ingest.spool_trust)
        # ingest.spool_trust=owner: a record must name the job of the directory it is in
        self.check_job = cfg.ingest.spool_trust == "owner"
        self._dir_jobs: dict[str, str | None] = {}  # segment dir -> its job's safe name
        self.sources.append(("spool", self.spool))
        self.inspector: FileTailer | None = None
        self.inspector_jobs: dict[str, str] = {}
        if opts.inspector_dirs:
            self.inspector = FileTailer([os.path.join(d, "*.log") for d in opts.inspector_dirs])
            self.sources.append(("inspector_json", self.inspector))
        self.trainlog: FileTailer | None = None
        # One parser per log (each counts steps of its own), one merge of all the ranks'
        # logs into the job's series (ingest/trainlog.py: the rule, shared with watch);
        # the regex is checked now, not at a line.
        self.tp_logs = RankLogs(job=opts.job or job_id(), host=self.host,
                                regex=opts.throughput_regex or cfg.ingest.throughput_regex,
                                timezone=cfg.ingest.trainlog_timezone, expect_new=True)
        self.tp_merge = self.tp_logs.merge
        self.inspector_skipped: collections.Counter = collections.Counter()
        if opts.training_logs:
            self.trainlog = FileTailer(list(opts.training_logs))
            self.sources.append(("training_log", self.trainlog))
        for name, tailer in self.sources:
            live = {p for s in tailer.discover() for p in s}
            if name == "training_log":
                for p in sorted(live):  # every rank's log counts before it is read
                    self.tp_merge.expect(p)
            for p in live:
                if p not in self.acked:
                    continue
                try:
                    st = os.stat(p)
                except FileNotFoundError:
                    continue
                if (p in inodes and st.st_ino != inodes[p]) or st.st_size < self.acked[p]:
                    # Replaced or truncated while we were down: the offsets belong to
                    # another file. Read this one from 0 and send all of it.
                    log.warning("event=file_changed_while_down path=%s; reading from 0", p)
                    self.floor.pop(p, None)
                    continue
                tailer.positions[p] = min(self.acked[p], self.window_from.get(p, self.acked[p]))
                tailer.inodes[p] = st.st_ino

        buf = state.get("buffer")
        self.delivery = Delivery(
            cfg, opts, DiskBuffer(os.path.join(self.node_dir, "buffer"), tuple(buf) if buf else None,
                                  max_bytes=opts.buffer_max_bytes),
            metrics=self.metrics, disk=self.disk, clock=clock)
        self.quarantine_path = opts.quarantine_file or os.path.join(self.node_dir,
                                                                    "quarantine.jsonl")
        self.stopping = False
        self.last_ckpt = 0.0
        self.last_idle_check = 0.0
        self.last_prom = 0.0
        self.last_progress = 0.0
        self.read_total = 0
        self.quarantined_total = 0
        self.quarantine_fd: int | None = None
        self.late_reported = 0
        if opts.once:
            opts.prom_settle_s = 0.0  # the input is complete: nothing is being written

    # -- reading -------------------------------------------------------------------------

    def _snapshot(self) -> dict:
        positions: dict[str, int] = {}
        inodes: dict[str, int] = {}
        for _, tailer in self.sources:
            positions.update(tailer.positions)
            inodes.update(tailer.inodes)
        return {"acked": positions, "window_from": self.windows.window_from(), "inodes": inodes,
                "prom": dict(self.prom_sent), "closed_before": self.windows.closed_before()}

    def _window_op(self, wname: str, rec: Any, src: str, off: int, starts: dict[int, int],
                   out: list) -> None:
        closed = self.windows.add(wname, rec, src, off, starts)
        if closed:
            self._emit_windows(closed, out)

    def _emit_windows(self, closed: list, out: list) -> None:
        """Windows onto ``out``, packed: one that closes right after a window of the same
        job joins its message (up to ``windows_per_message``), so a partition still gets
        its records in the order they closed."""
        wt = topic_for(self.topics, "window")
        k = self.opts.windows_per_message
        for s in closed:
            key, value = key_for(s, self.topics), to_json(s).encode()
            if k > 1 and out:
                topic, last_key, last = out[-1]
                if topic == wt and last_key == key and last.count(b"\n") + 1 < k:
                    out[-1] = (wt, key, last + b"\n" + value)
                    continue
            out.append((wt, key, value))

    def _quarantine(self, q: Quarantined, out: list) -> None:
        self.metrics.quarantined.labels(q.stage, q.reason).inc()
        self.quarantined_total += 1
        # "replace": a spool file name that is not UTF-8 comes back from the file system
        # with surrogate escapes, which must not make the forwarder raise.
        line = to_json(q).encode("utf-8", "replace")
        try:
            if self.quarantine_fd is None:
                private.makedirs(os.path.dirname(self.quarantine_path))
                self.quarantine_fd = private.open_append(self.quarantine_path)
            os.write(self.quarantine_fd, line + b"\n")
        except OSError as e:  # the file is a convenience copy: the topic has it all
            self.disk.failed("quarantine", self.quarantine_path, e)
        else:
            self.disk.ok("quarantine")
        out.append((self.topics.quarantine, q.source.encode("utf-8", "replace"), line))

    def _stream_ids(self) -> set[str]:
        return {sid for _, t in self.sources for sid in t.stream_ids}

    def _read_spool(self, chunks: list, out: list, ops: dict,
                    horizon: int = NO_LIMIT) -> tuple[int, set[str]]:
        """Process polled chunks up to each stream's horizon; (lines used, streams given
        back). Lines past a stream's horizon are given back to the tailer."""
        # The hot path of the forwarder: keep per-line work to parse, window, group.
        windows = self.windows
        wadd = windows.windowers["spool"].add
        opened, prune = windows.opened, windows.prune
        window_ns = self.window_ns
        fast_op = FastOpRecord
        sid_of = self.spool.stream_id
        st = self.aligned
        st_time = st.time
        n = 0
        now = self.clock()
        future = int(now * 1e9) + self.max_future_ns
        stopped: set[str] = set()
        rewound: set[str] = set()
        for chunk in chunks:
            src = chunk.source
            sid = sid_of(src)
            if sid in stopped:  # a stream given back: so is the rest of what was polled
                if src not in rewound:
                    self.spool.rewind(src, chunk.offset)
                    rewound.add(src)
                continue
            # A stream not known yet gives its first timed record back (a probe).
            hz = horizon if sid in st_time else -1
            hi = -1
            gave = -1
            st.path[sid] = src
            floor = self.floor.get(src, -1)
            starts = windows.starts(src)
            raws = chunk.raws
            self.last_seen[src] = now
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
                    rec = self._ahead_of_clock(end, now, raw, src, off)
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
                        self._emit_windows(closed, out)
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
                    t = (rec.start_ns + rec.exec_ns if kind == "op"
                         else rec.ts_ns if kind == "throughput" else -1)
                    if t > future:
                        rec, t, kind = self._ahead_of_clock(t, now, raw, src, off), -1, "quarantined"
                    if t > hz:
                        gave = t
                        break
                    if t > hi:
                        hi = t
                    if nxt > floor:
                        self._route_other(rec, raw, src, off, out, ops)
                    elif kind == "op":  # an op that took the slow path, replayed
                        self._window_op("spool", rec, src, off, starts, out)
                off = nxt
                used += 1
            n += used
            if gave >= 0:
                self.spool.rewind(src, off)
                rewound.add(src)
                stopped.add(sid)
                st_time[sid] = gave
            elif hi >= 0:
                t = st_time.get(sid, -1)
                if hi > t:
                    st_time[sid] = hi
            if floor >= 0 and off >= floor:
                del self.floor[src]
        return n, stopped

    def _dir_job(self, src: str) -> str | None:
        """The safe name of the job whose spool directory holds ``src`` (None directly
        in the spool directory: no job to check against)."""
        d = os.path.dirname(src)
        want = self._dir_jobs.get(d, "")
        if want == "":
            if len(self._dir_jobs) > 65536:
                self._dir_jobs.clear()
            inside = os.path.normpath(d) != os.path.normpath(self.spool.spool_dir)
            want = self._dir_jobs[d] = os.path.basename(d) if inside else None
        return want

    def _wrong_job(self, job: str, raw: bytes, src: str, off: int) -> Quarantined:
        return Quarantined(stage="origin", reason="wrong_job",
                           detail=f"record of job {job!r} in the spool directory of another job "
                                  "(ingest.spool_trust=owner)",
                           source=src, offset=off, raw=raw[:4096].decode("utf-8", errors="replace"))

    def _ahead_of_clock(self, t_ns: int, now: float, raw: bytes, src: str, off: int) -> Quarantined:
        ahead = t_ns / 1e9 - now
        return Quarantined(stage="schema", reason="out_of_range",
                           detail=f"record time {ahead:.0f} s ahead of this reader's clock "
                                  f"(ingest.max_future_s={self.cfg.ingest.max_future_s:g})",
                           source=src, offset=off, raw=raw[:4096].decode("utf-8", errors="replace"))

    def _route_other(self, rec: Any, raw: bytes, src: str, off: int, out: list,
                     ops: dict) -> None:
        """Everything but a fast-path op (slow-path records, quarantine, other kinds)."""
        kind = rec.KIND
        if kind == "op":
            self._window_op("spool", rec, src, off, self.windows.starts(src), out)
            ops.setdefault(op_group(rec.job, rec.comm), []).append(raw)
            return
        if kind == "quarantined":
            self._quarantine(rec, out)
            return
        if kind == "drop":
            self.metrics.plugin_drops(rec.job, rec.host, rec.pid, rec.reason, rec.total)
        elif kind == "plugin_stats":
            for reason, total in rec.dropped.items():
                if isinstance(total, int):
                    self.metrics.plugin_drops(rec.job, rec.host, rec.pid, reason, total)
        out.append((topic_for(self.topics, kind), key_for(rec), raw))

    def _inspector_job(self, src: str) -> str:
        job = self.inspector_jobs.get(src)
        if job is None:
            job = self.opts.job or inspector_job(Path(os.path.abspath(src))) or job_id()
            self.inspector_jobs[src] = job
        return job

    def _read_inspector(self, chunks: list, out: list, ops: dict,
                        horizon: int = NO_LIMIT) -> tuple[int, set[str]]:
        """Inspector lines -> ops, up to each file's horizon (as :meth:`_read_spool`)."""
        n = 0
        now = self.clock()
        st = self.aligned
        stopped: set[str] = set()
        for chunk in chunks:
            src = chunk.source
            if src in stopped:  # given back: so is the rest of what was polled
                continue
            hz = horizon if src in st.time else -1  # a file not known yet is probed
            hi = -1
            st.path[src] = src
            floor = self.floor.get(src, -1)
            starts = self.windows.starts(src)
            job = self._inspector_job(src)
            self.last_seen[src] = now
            for line in chunk.lines():
                send = line.next_offset > floor
                try:
                    rec = op_from_inspector(line.raw, job=job)
                except NotAnOp as e:  # a dump_stats marker: no op, nothing wrong
                    n += 1
                    self.inspector_skipped[e.what] += 1
                    continue
                except InspectorError as e:
                    n += 1
                    if send:
                        stage = "parse" if e.reason in ("not_json", "not_utf8") else "schema"
                        if len(line.raw) > self.spool.max_line_bytes:
                            e = InspectorError("too_long", f"line of {len(line.raw)}+ bytes")
                            stage = "size"
                        self._quarantine(quarantine(e, line.raw, src, line.offset, stage), out)
                    continue
                end = rec.start_ns + rec.exec_ns
                if end > now * 1e9 + self.max_future_ns:
                    n += 1
                    if send:
                        self._quarantine(self._ahead_of_clock(end, now, line.raw, src, line.offset), out)
                    continue
                if end > hz:
                    self.inspector.rewind(src, line.offset)
                    stopped.add(src)
                    st.time[src] = end
                    break
                n += 1
                hi = max(hi, end)
                self._window_op("inspector", rec, src, line.offset, starts, out)
                if send:
                    ops.setdefault(op_group(rec.job, rec.comm), []).append(to_json(rec).encode())
            else:
                if hi > st.time.get(src, -1):
                    st.time[src] = hi
                if chunk.next_offset >= floor:
                    self.floor.pop(src, None)
        return n, stopped

    def _read_trainlog(self, chunks: list, out: list, ops: dict,
                       horizon: int = NO_LIMIT) -> tuple[int, set[str]]:
        """Training-log lines -> the job's throughput series, stamped with the lines' own
        time (read time only for a line without one), the ranks' logs merged; a line
        stamped past its file's horizon is given back (as :meth:`_read_spool`)."""
        n = 0
        read_ns = time.time_ns()
        st = self.aligned
        stopped: set[str] = set()
        for chunk in chunks:
            src = chunk.source
            if src in stopped:
                continue
            hz = horizon if src in st.time else -1  # a log not known yet is probed
            hi = -1
            st.path[src] = src
            floor = self.floor.get(src, -1)
            parser = self.tp_logs.parser(src)
            for line in chunk.lines():
                if line.next_offset <= floor or len(line.raw) > self.spool.max_line_bytes:
                    if parser.megatron is not None and line.next_offset <= floor:
                        # sent before a restart: the arguments it printed still count
                        parser.megatron.read(line.raw.decode("utf-8", errors="replace"))
                    n += 1
                    continue
                untimed = parser.untimed
                rec = parser.parse(line.raw.decode("utf-8", errors="replace"), read_ns)
                if rec is not None and parser.untimed == untimed:  # its own time
                    if rec.ts_ns > hz:
                        self.trainlog.rewind(src, line.offset)
                        stopped.add(src)
                        st.time[src] = rec.ts_ns
                        break
                    hi = max(hi, rec.ts_ns)
                n += 1
                if rec is not None:
                    self.tp_merge.add(src, rec)
            else:
                if hi > st.time.get(src, -1):
                    st.time[src] = hi
                if chunk.next_offset >= floor:
                    self.floor.pop(src, None)
        # Every log was read up to the earliest of their times (the aligned read).
        times = [st.time.get(p) for p in self.tp_merge.sources]
        until = None if not times or None in times else min(times)
        self._emit_throughput(self.tp_merge.release(until), out)
        return n, stopped

    def _emit_throughput(self, records: list, out: list) -> None:
        for rec in records:
            out.append((topic_for(self.topics, "throughput"), key_for(rec), to_json(rec).encode()))

    def _poll_prom(self, out: list) -> int:
        n = 0
        now = self.clock()
        for d in self.opts.inspector_dirs:
            for path in sorted(glob.glob(os.path.join(d, "*.prom"))):
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                sig = [st.st_ino, st.st_mtime_ns, st.st_size]
                prev = self.prom_sent.get(path)
                if prev == sig or st.st_size == 0:
                    continue
                if now - st.st_mtime_ns / 1e9 < self.opts.prom_settle_s:
                    continue  # Inspector may still be writing it
                with open(path, "rb") as f:
                    data = f.read()
                end_ns = st.st_mtime_ns
                start_ns = prev[1] if prev and prev[0] == st.st_ino and prev[1] < end_ns else (
                    end_ns - int(self.opts.prom_interval_s * 1e9))
                wins, bad = windows_from_prom(data, start_ns=start_ns, end_ns=end_ns, source=path)
                self._emit_windows(wins, out)
                for q in bad:
                    self._quarantine(q, out)
                self.prom_sent[path] = sig
                n += len(wins) + len(bad)
                self.metrics.read.labels("inspector_prom").inc(len(wins) + len(bad))
        return n

    def _read_batch(self) -> tuple[Batch | None, int]:
        """Read up to batch_size lines from all sources into one batch."""
        out: list = []
        ops: dict[str, list[bytes]] = {}
        budget = self.opts.batch_size
        total = 0
        for name, tailer in self.sources:
            if budget <= 0:
                break
            read = (self._read_spool if name == "spool" else self._read_inspector
                    if name == "inspector_json" else self._read_trainlog)
            n = self.reads.read(tailer, read, budget, out, ops, self._stream_ids)
            self.metrics.read.labels(name).inc(n)
            budget -= n
            total += n
        now = self.clock()
        if self.opts.inspector_dirs and now - self.last_prom >= self.opts.prom_poll_s:
            self.last_prom = now
            total += self._poll_prom(out)
        if total == 0 and not out:
            return None, 0
        out.extend(self._pack(ops))
        self.read_total += total
        return Batch(out, self._snapshot()), total

    def _pack(self, ops: dict[str, list[bytes]]) -> list:
        topic = self.topics.ops
        k = self.opts.ops_per_message
        msgs = []
        for key, values in ops.items():
            kb = key.encode()
            if k <= 1:
                msgs.extend((topic, kb, v) for v in values)
            else:
                for i in range(0, len(values), k):
                    msgs.append((topic, kb, b"\n".join(values[i:i + k])))
        return msgs

    # -- housekeeping ----------------------------------------------------------------------

    def _checkpoint(self, force: bool = False) -> None:
        now = self.clock()
        d = self.delivery
        due = d.dirty and now - self.last_ckpt >= self.opts.checkpoint_interval_s
        if not force and not due:
            return
        c = d.committed
        if c is None:
            c = {"acked": dict(self.acked), "window_from": dict(self.window_from),
                 "inodes": {}, "prom": dict(self.prom_sent),
                 "closed_before": self.initial_closed_before}
            d.committed = c
        state = {"version": 1, **c, "buffer": list(d.buffer.position)}
        self.last_ckpt = now
        try:
            checkpoint.save(self.ckpt_path, state)
        except OSError as e:
            # Retried at the next interval. Consumed buffer files go anyway: they were
            # acknowledged, and deleting them before the checkpoint that says so costs
            # duplicates after a crash, never data; it frees the space the save needs.
            self.disk.failed("checkpoint", self.ckpt_path, e)
            d.buffer.collect()
            return
        self.disk.ok("checkpoint")
        d.buffer.collect()
        d.dirty = False
        if self.opts.delete_acked:
            self._delete_acked(c)

    def _delete_acked(self, c: dict) -> None:
        for path in list(self.spool.closed):
            size = self.spool.sizes.get(path)
            if size is None:
                continue
            if c["acked"].get(path, -1) >= size and c["window_from"].get(path, size) >= size:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("event=delete_failed path=%s error=%s", path, e)
                    continue
                self.spool.forget(path)
                self.windows.forget_source(path)
                for name in ("acked", "window_from", "inodes"):
                    c[name].pop(path, None)
                log.info("event=segment_deleted path=%s bytes=%d", path, size)

    def _flush_idle(self, force: bool = False) -> list:
        now = self.clock()
        if not force and now - self.last_idle_check < 1.0:
            return []
        self.last_idle_check = now
        out: list = []
        last_seen, idle_s = self.last_seen, self.opts.idle_flush_s
        flushed = self.windows.idle(lambda src: force or now - last_seen.get(src, 0) >= idle_s)
        if flushed:
            self._emit_windows(flushed, out)
        if force:  # the input is complete: iterations some rank never logged go too
            self._emit_throughput(self.tp_merge.flush(), out)
        return out

    def _gauges(self) -> None:
        self.metrics.bytes_behind.set(sum(t.bytes_behind() for _, t in self.sources))
        self.metrics.buffer_bytes.set(self.delivery.buffer.pending_bytes)
        self.metrics.untrusted_files.set(len(self.spool.untrusted))
        late = self.windows.late_total
        if late > self.late_reported:
            self.metrics.windows_late.inc(late - self.late_reported)
            self.late_reported = late

    def _progress(self) -> None:
        now = self.clock()
        if now - self.last_progress < 1.0 or not sys.stderr.isatty():
            return
        self.last_progress = now
        sys.stderr.write(
            f"\rread={self.read_total} sent={self.delivery.sent_total} quarantined={self.quarantined_total}"
            f" behind={sum(t.bytes_behind() for _, t in self.sources)}B"
            f" buffer={self.delivery.buffer.pending_bytes}B mode={self.delivery.mode}   ")
        sys.stderr.flush()

    # -- the loop --------------------------------------------------------------------------

    def stop(self, *_: Any) -> None:
        self.stopping = True

    def step(self) -> int:
        """One loop iteration; how many lines were read (-1: reading was paused)."""
        d = self.delivery
        d.collect()
        d.retry_held()
        d.drain()
        n = -1
        # Back-pressure: while a batch waits for room in the buffer, reading pauses and
        # the spool holds the rest (the plugin's node-local segments).
        if not self.stopping and not d.held() and d.inflight() < self.opts.max_inflight_batches:
            d.try_direct()
            batch, n = self._read_batch()
            idle = self._flush_idle()
            if idle:
                if batch is None:
                    batch = Batch(idle, self._snapshot())
                else:
                    batch.messages.extend(idle)
                    batch.snapshot = self._snapshot()
                    batch.done = False
            if batch is not None:
                d.enqueue(batch)
        d.collect()
        if d.fatal:
            self.stopping = True
        self._checkpoint()
        self._gauges()
        self._progress()
        return n

    def run(self) -> int:
        log.info("event=start node=%s spool=%s inspector_dirs=%d training_logs=%d mode=%s",
                 self.opts.node_id, self.opts.spool_dir, len(self.opts.inspector_dirs),
                 len(self.opts.training_logs), self.delivery.mode)
        try:
            while not self.stopping:
                n = self.step()
                if self.opts.once and n == 0:
                    # The input is complete: close every open window, then wait for acks.
                    rest = self._flush_idle(force=True)
                    if rest:
                        self.delivery.enqueue(Batch(rest, self._snapshot()))
                        continue
                    if self.delivery.idle():
                        break
                if n <= 0:
                    self._wait()
            return self._shutdown()
        finally:
            self.close()

    def _wait(self) -> None:
        if self.delivery.producer is not None and self.delivery.inflight():
            time.sleep(0.005)
        else:
            time.sleep(self.opts.poll_interval_s)

    def _shutdown(self) -> int:
        self.delivery.finish(self.opts.shutdown_timeout_s)
        self._checkpoint(force=True)
        log.info("event=stop read=%d sent=%d quarantined=%d buffer_bytes=%d",
                 self.read_total, self.delivery.sent_total, self.quarantined_total,
                 self.delivery.buffer.pending_bytes)
        if self.inspector_skipped or self.tp_merge.late:
            log.info("event=lines_without_a_record inspector=%s training_log_late=%d",
                     dict(self.inspector_skipped), self.tp_merge.late)
        if sys.stderr.isatty():
            sys.stderr.write("\n")
        if self.delivery.fatal:
            print(f"ncclwatch forward: {self.delivery.fatal}", file=sys.stderr)
            return 1
        return 0

    def close(self) -> None:
        for _, t in self.sources:
            t.close()
        if self.quarantine_fd is not None:
            os.close(self.quarantine_fd)
            self.quarantine_fd = None
        self.delivery.close()


# -- CLI ---------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spool", help="plugin spool directory (default: config ingest.spool_dir)")
    p.add_argument("--inspector-dir", action="append", default=[],
                   help="NCCL Inspector dump directory (JSON *.log and *.prom); repeatable")
    p.add_argument("--training-log", action="append", default=[], metavar="FILE|GLOB",
                   help="training log to parse throughput from, one file per rank; repeatable, "
                        "each a path or a quoted glob; the ranks' logs become one series")
    p.add_argument("--once", action="store_true",
                   help="drain what is there, close all windows, wait for Kafka, exit 0")
    p.add_argument("--delete-acked", action=argparse.BooleanOptionalAction, default=True,
                   help="delete closed spool segments once acknowledged (default: on)")
    p.add_argument("--state-dir", help="checkpoint and buffer directory (default: config)")
    p.add_argument("--node-id", default=socket.gethostname(), help="node id (default: hostname)")
    p.add_argument("--job", default="", help="job id for Inspector and training-log records")
    p.add_argument("--ops-per-message", type=int,
                   help="pack up to N op records of one communicator and batch into one Kafka "
                        "message (newline-separated JSON lines; default: config, 100; 1 = unpacked)")
    p.add_argument("--windows-per-message", type=int,
                   help="pack up to N window summaries of one job that close together into one "
                        "Kafka message (default: config, 50; 1 = unpacked)")
    p.add_argument("--batch-size", type=int, help="lines per batch (default: config)")
    p.add_argument("--compression", help="none, gzip, lz4, ... (default: config)")
    p.add_argument("--metrics-port", type=int,
                   help="Prometheus port (default: config; 0 = any free port; -1 = off)")
    p.add_argument("--quarantine-file", default="", help="default: <state>/<node>/quarantine.jsonl")


def options_from(args: argparse.Namespace, cfg: Config) -> Options:
    ing = cfg.ingest
    dirs = list(args.inspector_dir or [])
    dirs += [d.strip() for d in ing.inspector_dirs.split(",") if d.strip()]
    return Options(
        spool_dir=args.spool or ing.spool_dir,
        state_dir=args.state_dir or ing.state_dir,
        node_id=args.node_id,
        inspector_dirs=dirs,
        training_logs=list(args.training_log)
        or [p.strip() for p in ing.training_log.split(",") if p.strip()],
        job=args.job,
        once=args.once,
        delete_acked=args.delete_acked,
        ops_per_message=max(1, args.ops_per_message or ing.ops_per_message),
        windows_per_message=max(1, args.windows_per_message or ing.windows_per_message),
        window_s=ing.window_s,
        batch_size=args.batch_size or ing.batch_size,
        linger_ms=ing.linger_ms,
        compression=args.compression or ing.compression,
        buffer_max_bytes=ing.buffer_max_bytes,
        throughput_regex=ing.throughput_regex,
        quarantine_file=args.quarantine_file,
    )


def run(args: argparse.Namespace, cfg: Config) -> int:
    opts = options_from(args, cfg)
    kafka_sink.install_redaction(cfg.kafka)
    metrics = ForwarderMetrics()
    from ncclwatch import exposition

    server = exposition.serve_configured(metrics.registry, cfg.ingest, args.metrics_port)
    if server is not None:
        log.info("event=metrics_listening addr=%s port=%d scheme=%s", cfg.ingest.metrics_addr,
                 server.server_port, server.scheme)
    fwd = Forwarder(cfg, opts, metrics=metrics)
    signal.signal(signal.SIGTERM, fwd.stop)
    signal.signal(signal.SIGINT, fwd.stop)
    return fwd.run()
