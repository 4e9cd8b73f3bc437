"""``ncclwatch watch``: the single-node mode, no Kafka.

Tails the plugin's spool directory, windows the op records in-process (the same
:class:`~ncclwatch.ingest.windows.Windower` the forwarder runs), feeds windows,
throughput, drop and plugin_stats records to one detector pipeline per job (the same
library the Faust worker runs), serves the same Prometheus metrics, sends the same
alerts through :class:`~ncclwatch.alerting.sink.AlertSink` when Alertmanager is
configured, and prints a status line every few seconds and one line per anomaly firing
or resolved.

Pointed at a recording (a spool directory with ``--speed``, a ``.tar.gz`` of one, or a
``.jsonl[.gz]`` file) it replays it in record-time order at ``--speed`` N× real time,
so detection can be seen without a GPU, then exits.

Baselines (and, live, the spool read positions) are saved to ``--state`` /
``config.detector.state_path`` every ``--save-every-s`` seconds and on exit, and
restored at start, so a restarted watch neither relearns nor re-reads. A replay starts
from nothing unless ``--state`` is given, so replaying a fixture twice gives the same
result.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ncclwatch.detectors.drivers import (
    KIND_ORDER,
    STATE_VERSION,
    EventsFile,
    JobDetectors,
    Pacer,
    ReadStats,
    TimeMerge,
    format_event,
    read_recording,
    record_time_ns,
    write_jsonl_atomic,
)

from ncclwatch.config import Config
from ncclwatch.records import AnomalyEvent, OpRecord, Quarantined, parse_line

log = logging.getLogger(__name__)

POLL_IDLE_S = 0.2
POLL_MAX_LINES = 5000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        nargs="?",
        help="spool directory to tail (default: config ingest.spool_dir), or a recording to "
        "replay: a spool directory (with --speed), a .tar.gz of one, a .jsonl or .jsonl.gz file",
    )
    p.add_argument(
        "--speed",
        type=float,
        default=None,
        metavar="N",
        help="replay the recording at N× real time by record timestamps (0: as fast as "
        "possible), then exit; files and archives replay at 0 unless given",
    )
    p.add_argument("--once", action="store_true", help="process what the spool holds now, flush, exit")
    p.add_argument("--events-out", metavar="FILE", help="append anomaly events here as JSON lines")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="Prometheus metrics on 127.0.0.1:PORT (default: config detector.metrics_port; "
        "0: a free port, printed at start; -1: no metrics endpoint)",
    )
    p.add_argument("--state", metavar="FILE", help="baseline state file (default: config detector.state_path)")
    p.add_argument("--save-every-s", type=float, default=30.0, help="save the state this often (default 30)")
    p.add_argument(
        "--status-every-s",
        type=float,
        default=5.0,
        help="print a status line this often (0: never; default 5)",
    )


class Watch:
    """The loop's state: windower, per-job pipelines, outputs and the live status.

    ``feed`` takes any parsed record; op records go through the windower, the rest
    straight to the detectors, as the forwarder and the worker do between them.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        out: TextIO | None = None,
        events_file: EventsFile | None = None,
        sink: Any = None,
        metrics: Any = None,
        detectors: JobDetectors | None = None,
    ):
        from ncclwatch.detectors.metrics import DetectorMetrics
        from ncclwatch.ingest.windows import Windower

        self.cfg = cfg
        self.out = out or sys.stdout
        self.events_file = events_file or EventsFile(None)
        self.sink = sink
        self.detectors = detectors or JobDetectors(cfg.detector, partitions=cfg.topics.partitions)
        # Metrics are kept even without an endpoint: the status lines read them.
        self.metrics = metrics or DetectorMetrics(max_keys=cfg.detector.max_metric_keys)
        self.metrics.bind(self.detectors)
        self.windower = Windower(cfg.ingest.window_s)
        self._merge = TimeMerge()
        self._streams: set[tuple] = set()
        self.stream_ns = 0
        self.counts = dict.fromkeys(("op", "window", "throughput", "drop", "plugin_stats"), 0)
        self.quarantined = 0
        self.windows_made = 0  # by our windower, from op records
        self.firing: dict[str, AnomalyEvent] = {}
        self.events_total = 0

    # -- records in --------------------------------------------------------------------

    def feed(self, record: Any) -> None:
        """One parsed line: op records are windowed, the rest go straight to detection.

        Windows leave the windower a window or two after their end (a window closes when
        its process has moved on), while throughput and telemetry are ready at once. To
        hand the detectors both in time order, as the worker's merge of the window and
        throughput topics does, they meet in a second :class:`TimeMerge`: each process's
        windows are an input bounded by its last closed window, the other records one
        more.
        """
        if isinstance(record, Quarantined):
            self.quarantined += 1
            return
        kind = record.KIND
        if kind not in self.counts:
            return  # anomaly records in a recording are output, not input
        self.counts[kind] += 1
        t = record_time_ns(record)
        self.stream_ns = max(self.stream_ns, t)
        merge = self._merge
        if isinstance(record, OpRecord):
            stream = (record.job, record.host, record.pid)
            for w in self.windower.add(record):
                self.windows_made += 1
                merge.add(stream, 0, w.end_ns, w, 0)
            if stream not in self._streams:
                self._streams.add(stream)
                merge.expect(stream, 0)  # nothing may pass a process not windowed yet
            merge.progress(stream, True)  # a live process always has a window open
        else:
            merge.add("records", 0, t, record, KIND_ORDER.get(kind, 3))
        for rec in merge.release():
            self.emit(self.detectors.process(rec))

    def flush(self) -> None:
        """End of input: close the open windows and the detectors' incomplete groups."""
        for w in self.windower.flush():
            self.windows_made += 1
            self._merge.add((w.job, w.host, -1), 0, w.end_ns, w, 0)
        for rec in self._merge.drain():
            self.emit(self.detectors.process(rec))
        self._streams.clear()
        self.emit(self.detectors.flush())

    # -- events out --------------------------------------------------------------------

    def emit(self, events: list[AnomalyEvent]) -> None:
        for ev in events:
            self.events_total += 1
            if ev.state == "firing":
                self.firing[ev.id] = ev
            else:
                self.firing.pop(ev.id, None)
            print(format_event(ev), file=self.out, flush=True)
            self.events_file.write(ev)
            if self.sink is not None:
                self.sink.handle(ev)

    # -- status ------------------------------------------------------------------------

    def status_lines(self, max_keys: int = 6) -> list[str]:
        """A compact picture: counts, then the keys furthest below their baseline."""
        c = self.counts
        clock = time.strftime("%H:%M:%S", time.localtime(self.stream_ns / 1e9))
        keys = self._key_bandwidths()
        head = (
            f"status {clock if self.stream_ns else '--:--:--'}"
            f"  jobs {len(self.detectors.pipelines)}  keys {self.detectors.key_count()}"
            f"  ops {c['op']}  windows {c['window'] + self.windows_made}"
            f"  throughput {c['throughput']}"
            f"  firing {len(self.firing)}  events {self.events_total}"
        )
        if self.quarantined:
            head += f"  quarantined {self.quarantined}"
        lines = [head]

        def loss(item: tuple) -> float:
            observed, base = item[1]
            return -(1 - observed / base) if base else 0.0

        for labels, (observed, base) in sorted(keys.items(), key=loss)[:max_keys]:
            job, comm, op, bucket, transport = labels
            text = f"  {job} {comm} {op} {bucket} {transport}: busbw {observed:.1f} GB/s"
            if base:
                text += f", baseline {base:.1f} ({observed / base - 1:+.0%})"
            else:
                text += ", baseline learning"
            lines.append(text)
        if len(keys) > max_keys:
            lines.append(f"  … {len(keys) - max_keys} more keys")
        return lines

    def _key_bandwidths(self) -> dict[tuple, tuple[float, float | None]]:
        """(observed, baseline) busbw per key, as the metrics last exported them."""
        observed: dict[tuple, float] = {}
        base: dict[tuple, float] = {}
        for metric, into in ((self.metrics.busbw_observed, observed), (self.metrics.busbw_baseline, base)):
            for family in metric.collect():
                for sample in family.samples:
                    lb = sample.labels
                    into[(lb["job"], lb["comm"], lb["op"], lb["size_bucket"], lb["transport"])] = sample.value
        return {k: (v, base.get(k)) for k, v in observed.items()}

    # -- state -------------------------------------------------------------------------

    def to_state(self, positions: Any = None) -> dict:
        return {"v": STATE_VERSION, "detectors": self.detectors.to_state(), "positions": positions}

    def restore(self, state: dict) -> Any:
        if state.get("v") != STATE_VERSION:
            raise ValueError(f"state version {state.get('v')!r}, this watch knows {STATE_VERSION}")
        self.detectors.restore(state["detectors"])
        return state.get("positions")


# --- the command ---------------------------------------------------------------------------


class _Stop:
    """SIGINT/SIGTERM set a flag; the loop finishes its batch, flushes and saves."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.requested = True


def _metrics(cfg: Config, port: int | None, out: TextIO) -> Any:
    """The detector metrics, served on 127.0.0.1 unless the port is negative."""
    from ncclwatch.detectors.metrics import DetectorMetrics
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    metrics = DetectorMetrics(registry, max_keys=cfg.detector.max_metric_keys)
    port = cfg.detector.metrics_port if port is None else port
    if port >= 0:
        server, _thread = start_http_server(port, addr=cfg.detector.metrics_addr, registry=registry)
        addr = f"{cfg.detector.metrics_addr}:{server.server_port}"
        print(f"metrics on http://{addr}/metrics", file=out, flush=True)
    return metrics


def _sink(cfg: Config) -> Any:
    # Without Alertmanager the FIRING/RESOLVED lines already are the printed alerts.
    if not cfg.alerting.alertmanager_url:
        return None
    from ncclwatch.alerting.sink import AlertSink

    state_dir = Path(cfg.detector.state_path).parent if cfg.detector.state_path else None
    return AlertSink.from_config(cfg.alerting, state_dir=state_dir)


def run(args: argparse.Namespace, cfg: Config, *, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    source = Path(args.source or cfg.ingest.spool_dir)
    if not source.exists():
        print(f"ncclwatch watch: {source}: no such file or directory", file=sys.stderr)
        return 2
    replay = source.is_file() or args.speed is not None
    state_path = args.state or ("" if replay else cfg.detector.state_path)
    metrics = _metrics(cfg, args.metrics_port, out)
    sink = _sink(cfg)
    events_file = EventsFile(args.events_out)
    watch = Watch(cfg, out=out, events_file=events_file, sink=sink, metrics=metrics)
    positions = None
    if state_path and Path(state_path).exists():
        positions = watch.restore(json.loads(Path(state_path).read_text()))
        print(
            f"restored baselines of {len(watch.detectors.pipelines)} job(s) from {state_path}",
            file=out,
        )
    stop = _Stop()
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if replay:
            _replay(watch, source, args, stop)
        else:
            positions = _tail(watch, source, args, stop, positions, state_path)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for line in watch.status_lines():
            print(line, file=out)
        if state_path:
            write_jsonl_atomic(state_path, watch.to_state(positions))
        events_file.close()
        if sink is not None:
            sink.close()
    return 0


def _every(interval_s: float) -> Any:
    """A callable that says True at most once per interval (never when interval is 0)."""
    last = [time.monotonic()]

    def due() -> bool:
        if interval_s <= 0:
            return False
        now = time.monotonic()
        if now - last[0] >= interval_s:
            last[0] = now
            return True
        return False

    return due


def _replay(watch: Watch, source: Path, args: argparse.Namespace, stop: _Stop) -> None:
    stats = ReadStats()
    records = read_recording([source], stats)
    speed = args.speed if args.speed is not None else 0.0
    span_s = (record_time_ns(records[-1]) - record_time_ns(records[0])) / 1e9 if records else 0.0
    print(
        f"replaying {len(records)} records ({span_s:.0f} s of recording) from {source} at "
        + ("full speed" if speed == 0 else f"{speed:g}× real time"),
        file=watch.out,
        flush=True,
    )
    if stats.quarantined:
        print(
            f"  left out {sum(stats.quarantined.values())} bad lines: {stats.quarantined}",
            file=watch.out,
        )
    pacer = Pacer(speed)
    status_due = _every(args.status_every_s)
    tick_due = _every(1.0)
    for rec in records:
        if stop.requested:
            break
        pacer.wait(record_time_ns(rec))
        watch.feed(rec)
        if status_due():
            for line in watch.status_lines():
                print(line, file=watch.out, flush=True)
        if watch.sink is not None and tick_due():
            watch.sink.tick()
    watch.flush()


def _tail(
    watch: Watch,
    source: Path,
    args: argparse.Namespace,
    stop: _Stop,
    positions: Any,
    state_path: str,
) -> Any:
    """Tail the spool; records of all files go through a time merge.

    The tailer reads files in turns, a chunk at a time: catching up on a spool (at start,
    after a restart, ``--once``) it can be minutes further in one file than in another.
    The merge lets a record go only when no file that still has unread bytes could hold
    an earlier one, so the detectors see the ranks of a job side by side, as they
    would have live. The saved positions are those of records processed, never of
    records still held.
    """
    from ncclwatch.ingest.spool import SpoolTailer

    tailer = SpoolTailer(str(source), positions or {})
    done = dict(positions or {})
    merge = TimeMerge()
    last_t: dict[str, int] = {}
    status_due = _every(args.status_every_s)
    save_due = _every(args.save_every_s)
    tick_due = _every(1.0)
    print(f"watching {source}", file=watch.out, flush=True)

    def feed(items: list) -> None:
        for line, rec in items:
            watch.feed(rec)
            done[line.source] = line.next_offset

    while not stop.requested:
        lines = tailer.poll(POLL_MAX_LINES)
        for line in lines:
            rec = parse_line(line.raw, source=str(line.source), offset=line.offset)
            # a bad line has no time of its own: it keeps its place in its file
            t = last_t.get(line.source, 0) if isinstance(rec, Quarantined) else record_time_ns(rec)
            last_t[line.source] = t
            rank = 0 if isinstance(rec, Quarantined) else KIND_ORDER.get(rec.KIND, 3)
            merge.add(line.source, 0, t, (line, rec), rank)
        # every file of the spool, read yet or not: one not read yet holds everything
        for path in (p for stream in tailer.discover() for p in stream):
            size = tailer.sizes.get(path)
            if size is None:
                try:
                    size = os.stat(path).st_size
                except FileNotFoundError:
                    continue
            behind = size > tailer.positions.get(path, 0)
            if path in last_t:
                merge.progress(path, behind)
            elif behind:
                merge.expect(path, 0)
        feed(merge.release())
        if status_due():
            for text in watch.status_lines():
                print(text, file=watch.out, flush=True)
        if watch.sink is not None and tick_due():
            watch.sink.tick()
        if state_path and save_due():
            write_jsonl_atomic(state_path, watch.to_state(done))
        if not lines:
            if args.once:
                break
            time.sleep(POLL_IDLE_S)
    feed(merge.drain())
    watch.flush()
    return done
