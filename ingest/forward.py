"""``ncclwatch forward``: the per-node forwarder (sources -> transforms -> Kafka).

Sources (:mod:`ncclwatch.ingest.sources`, each with its transform): the plugin spool
(throughput API files arrive through it too), NCCL Inspector JSON logs and ``.prom``
files, the ranks' training logs; read together in stream time
(:mod:`ncclwatch.ingest.alignment`), windowed per node
(:mod:`ncclwatch.ingest.node_windows`). Sinks: Kafka (acks=all,
:mod:`ncclwatch.ingest.delivery`), the quarantine file and topic, the on-disk spill buffer.
This module is the loop: batches, restart positions, checkpoints, segment deletion.

Delivery (see docs/ingest.md): lines are read in batches; a batch is *done* once Kafka
acknowledged every message of it, or once it was fsynced into the spill buffer. File
positions are checkpointed as of the newest batch before which every batch is done, so a
``kill -9`` loses nothing and re-sends at most the batches that were not done. Ops that
feed still-open windows are re-read after a restart for windowing only (not re-sent), so
the windows come out whole.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ncclwatch.ingest import checkpoint, kafka_sink
from ncclwatch.ingest.alignment import AlignedReads
from ncclwatch.ingest.buffer import DiskBuffer
from ncclwatch.ingest.delivery import Batch, Delivery
from ncclwatch.ingest.disk_errors import DiskErrors
from ncclwatch.ingest.metrics import ForwarderMetrics
from ncclwatch.ingest.node_windows import NodeWindows
from ncclwatch.ingest.sources import (
    InspectorSource,
    Intake,
    LineSource,
    PromFiles,
    QuarantineSink,
    SpoolSource,
    TrainlogSource,
)
from ncclwatch.ingest.spool import FileTailer, SpoolTailer
from ncclwatch.ingest.throughput import job_id
from ncclwatch.ingest.trainlog import RankLogs

from ncclwatch.config import Config, IngestConfig
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
        self.host = socket.gethostname()
        self.node_dir = os.path.join(opts.state_dir, safe_filename(opts.node_id))
        self.ckpt_path = checkpoint.path_for(opts.state_dir, opts.node_id)
        self.disk = DiskErrors(self.metrics)
        for tmp in checkpoint.remove_stale_temps(self.ckpt_path):
            log.warning("event=stale_temp_removed path=%s", tmp)
        state = checkpoint.load(self.ckpt_path)
        self.acked: dict[str, int] = dict(state.get("acked", {}))
        self.window_from: dict[str, int] = dict(state.get("window_from", {}))
        prom_sent: dict[str, list] = dict(state.get("prom", {}))
        inodes: dict[str, int] = dict(state.get("inodes", {}))
        # Lines ending at or before these offsets were delivered before a restart: they are
        # re-read only to rebuild open windows, never re-sent.
        floor: dict[str, int] = {
            p: a for p, a in self.acked.items() if self.window_from.get(p, a) < a
        }

        self.initial_closed_before = state.get("closed_before", [])
        windows = NodeWindows(opts.window_s, opts.inspector_lateness_s, self.initial_closed_before)
        self.windows = windows
        self.window_ns = windows.window_ns
        # Every source's streams read together in stream time (ingest/alignment.py):
        # they share the host clock.
        align_ns = int(round(opts.align_s * 1e9)) if opts.align_s >= 0 else self.window_ns // 2
        self.spool = SpoolTailer(opts.spool_dir, trust=cfg.ingest.spool_trust)
        self.quarantine = QuarantineSink(
            opts.quarantine_file or os.path.join(self.node_dir, "quarantine.jsonl"),
            self.topics.quarantine, self.metrics, self.disk)
        self.last_seen: dict[str, float] = {}  # file -> wall time it was last read
        self.reads = AlignedReads(align_ns, clock, self.last_seen)
        self.intake = Intake(windows, self.reads.times, self.quarantine, self.topics, clock,
                             cfg.ingest.max_future_s, opts.windows_per_message,
                             self.spool.max_line_bytes, floor=floor, last_seen=self.last_seen)
        self.sources: list[LineSource] = [
            SpoolSource(self.intake, self.spool, self.metrics,
                        check_job=cfg.ingest.spool_trust == "owner")]
        self.inspector: InspectorSource | None = None
        if opts.inspector_dirs:
            self.inspector = InspectorSource(
                self.intake, FileTailer([os.path.join(d, "*.log") for d in opts.inspector_dirs]),
                job=opts.job)
            self.sources.append(self.inspector)
        # One parser per log (each counts steps of its own), one merge of all the ranks'
        # logs into the job's series (ingest/trainlog.py: the rule, shared with watch);
        # the regex is checked now, not at a line.
        logs = RankLogs(job=opts.job or job_id(), host=self.host,
                        regex=opts.throughput_regex or cfg.ingest.throughput_regex,
                        timezone=cfg.ingest.trainlog_timezone, expect_new=True)
        self.trainlog = TrainlogSource(self.intake, FileTailer(list(opts.training_logs)), logs)
        if opts.training_logs:
            self.sources.append(self.trainlog)
        for source in self.sources:
            tailer = source.tailer
            live = {p for s in tailer.discover() for p in s}
            if source is self.trainlog:
                for p in sorted(live):  # every rank's log counts before it is read
                    logs.merge.expect(p)
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
                    floor.pop(p, None)
                    continue
                tailer.positions[p] = min(self.acked[p], self.window_from.get(p, self.acked[p]))
                tailer.inodes[p] = st.st_ino

        buf = state.get("buffer")
        self.delivery = Delivery(
            cfg, opts, DiskBuffer(os.path.join(self.node_dir, "buffer"), tuple(buf) if buf else None,
                                  max_bytes=opts.buffer_max_bytes),
            metrics=self.metrics, disk=self.disk, clock=clock)
        self.stopping = False
        self.last_ckpt = 0.0
        self.last_idle_check = 0.0
        self.last_prom = 0.0
        self.last_progress = 0.0
        self.read_total = 0
        self.late_reported = 0
        if opts.once:
            opts.prom_settle_s = 0.0  # the input is complete: nothing is being written
        self.prom = PromFiles(self.intake, self.metrics, opts.inspector_dirs, sent=prom_sent,
                              settle_s=opts.prom_settle_s, interval_s=opts.prom_interval_s)

    # -- reading -------------------------------------------------------------------------

    def _snapshot(self) -> dict:
        positions: dict[str, int] = {}
        inodes: dict[str, int] = {}
        for source in self.sources:
            positions.update(source.tailer.positions)
            inodes.update(source.tailer.inodes)
        return {"acked": positions, "window_from": self.windows.window_from(), "inodes": inodes,
                "prom": dict(self.prom.sent), "closed_before": self.windows.closed_before()}

    def _stream_ids(self) -> set[str]:
        return {sid for s in self.sources for sid in s.tailer.stream_ids}

    def _read_batch(self) -> tuple[Batch | None, int]:
        """Read up to batch_size lines from all sources into one batch."""
        out: list = []
        ops: dict[str, list[bytes]] = {}
        budget = self.opts.batch_size
        total = 0
        for source in self.sources:
            if budget <= 0:
                break
            n = self.reads.read(source.tailer, source.read, budget, out, ops, self._stream_ids)
            self.metrics.read.labels(source.name).inc(n)
            budget -= n
            total += n
        now = self.clock()
        if self.opts.inspector_dirs and now - self.last_prom >= self.opts.prom_poll_s:
            self.last_prom = now
            total += self.prom.poll(out)
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
                 "inodes": {}, "prom": dict(self.prom.sent),
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
            self.intake.emit_windows(flushed, out)
        if force:  # the input is complete: iterations some rank never logged go too
            self.trainlog.flush(out)
        return out

    def _gauges(self) -> None:
        self.metrics.bytes_behind.set(sum(s.tailer.bytes_behind() for s in self.sources))
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
            f"\rread={self.read_total} sent={self.delivery.sent_total} quarantined={self.quarantine.total}"
            f" behind={sum(s.tailer.bytes_behind() for s in self.sources)}B"
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
                 self.read_total, self.delivery.sent_total, self.quarantine.total,
                 self.delivery.buffer.pending_bytes)
        skipped = self.inspector.skipped if self.inspector is not None else {}
        late = self.trainlog.logs.merge.late
        if skipped or late:
            log.info("event=lines_without_a_record inspector=%s training_log_late=%d",
                     dict(skipped), late)
        if sys.stderr.isatty():
            sys.stderr.write("\n")
        if self.delivery.fatal:
            print(f"ncclwatch forward: {self.delivery.fatal}", file=sys.stderr)
            return 1
        return 0

    def close(self) -> None:
        for source in self.sources:
            source.tailer.close()
        self.quarantine.close()
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
