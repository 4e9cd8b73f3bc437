"""``ncclwatch watch``: the single-node mode, no Kafka.

Tails the plugin's spool directory, windows the op records in-process (the same
:class:`~ncclwatch.ingest.windows.Windower` the forwarder runs), feeds windows,
throughput, drop and plugin_stats records to one detector pipeline per job (the same
library the Faust worker runs), serves the same Prometheus metrics, sends the same
alerts through :class:`~ncclwatch.alerting.sink.AlertSink` when Alertmanager is
configured, and prints a status line every few seconds and one line per anomaly firing
or resolved.

Live, it tails NCCL Inspector's JSON output too (``SOURCE`` is an Inspector dump
directory, or ``--inspector-dir``) and training logs (``--training-log``, one file per
rank, globs allowed), as ``ncclwatch forward`` does.

Pointed at a recording (with ``--speed``, or a file or archive) it replays it in
record-time order at ``--speed`` N× real time, so detection can be seen without a GPU,
then exits. A recording is anything :mod:`ncclwatch.ingest.recording` reads: a spool, a
directory (or archive, or file) of Inspector JSON logs, a recorded run directory, with
``--training-log`` for the job's throughput.

Baselines (and, live, the spool read positions) are saved to ``--state`` /
``config.detector.state_path`` every ``--save-every-s`` seconds and on exit, and
restored at start, so a restarted watch neither relearns nor re-reads. A replay starts
from nothing unless ``--state`` is given, so replaying a fixture twice gives the same
result.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import signal
import sys
import time
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TextIO

from ncclwatch.detectors.console import format_event
from ncclwatch.detectors.metrics import GBS
from ncclwatch.detectors.playback import EventsFile, Pacer, write_jsonl_atomic
from ncclwatch.detectors.stream import STATE_VERSION, JobDetectors, TimeMerge
from ncclwatch.ingest.live import LiveSources
from ncclwatch.ingest.parse import to_record
from ncclwatch.ingest.recording import (
    INSPECTOR,
    INSPECTOR_LATENESS_S,
    KIND_ORDER,
    Options,
    ReadStats,
    RecordingError,
    SortedRecording,
    add_source_arguments,
    file_kind,
    record_time_ns,
)

from ncclwatch import progress
from ncclwatch.config import Config
from ncclwatch.records import AnomalyEvent, Quarantined

log = logging.getLogger(__name__)

POLL_IDLE_S = 0.2
POLL_MAX_LINES = 5000
_BAR_STEP = 1000  # records between progress-bar updates on a replay


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        nargs="?",
        help="what to tail (default: config ingest.spool_dir): a plugin spool or an NCCL "
        "Inspector dump directory; or a recording to replay: a spool or Inspector directory "
        "(with --speed), a recorded run directory, a .tar.gz of any of them, a .jsonl[.gz] "
        "spool file or one Inspector .log file",
    )
    add_source_arguments(p)
    p.add_argument(
        "--speed",
        type=float,
        default=None,
        metavar="N",
        help="replay the recording at N× real time by record timestamps (0: as fast as "
        "possible), then exit; files and archives replay at 0 unless given",
    )
    p.add_argument(
        "--inspector-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="live: also tail this NCCL Inspector dump directory (JSON *.log); repeatable",
    )
    p.add_argument("--once", action="store_true", help="process what the sources hold now, flush, exit")
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
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar while replaying a recording, even on a terminal")


class Watch:
    """The loop's state: windowers, per-job pipelines, outputs and the live status.

    ``feed`` takes any parsed record; op records go through a windower, the rest
    straight to the detectors, as the forwarder and the worker do between them. Inspector
    ops get the forwarder's Inspector windower: Inspector writes per communicator per
    dump, so its ops arrive out of order by up to a dump interval.
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
        self.metrics = metrics or DetectorMetrics(max_keys=cfg.detector.max_metric_keys, component="watch")
        self.metrics.bind(self.detectors)
        self.windower = Windower(cfg.ingest.window_s)
        self.inspector_windower = Windower(
            cfg.ingest.window_s, lateness_s=max(cfg.ingest.window_s, INSPECTOR_LATENESS_S)
        )
        self._merge = TimeMerge()
        self._streams: set[tuple] = set()
        self.stream_ns = 0
        self.counts = dict.fromkeys(("op", "window", "throughput", "pause", "drop", "plugin_stats", "progress"), 0)
        self.quarantined = 0
        self.windows_made = 0  # by our windower, from op records
        self.firing: dict[str, AnomalyEvent] = {}
        self.events_total = 0

    # -- records in --------------------------------------------------------------------

    def feed(self, record: Any) -> None:
        """One parsed record (a contract dataclass, or the fast parser's struct): op records
        are windowed, the rest go straight to detection.

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
        counts = self.counts
        if kind not in counts:
            return  # anomaly records in a recording are output, not input
        counts[kind] += 1
        if kind in ("progress", "pause"):
            # What the ranks are waiting in now (or that the job paused on purpose): it
            # must not wait in the merge behind the windows of a stopped process (those
            # are what it is about).
            self.emit(self.detectors.process(to_record(record)))
            return
        merge = self._merge
        if kind == "op":  # the windower takes the fast parser's structs as they are
            t = record.start_ns + record.exec_ns  # record_time_ns of an op, once per op
            if t > self.stream_ns:
                self.stream_ns = t
            windower = self.inspector_windower if record.timing == "inspector" else self.windower
            windows = windower.add(record)
            stream = (record.job, record.host, record.pid)
            if windows:
                self.windows_made += len(windows)
                for w in windows:
                    merge.add(stream, 0, w.end_ns, w, 0)
            if stream not in self._streams:
                self._streams.add(stream)
                merge.expect(stream, 0)  # nothing may pass a process not windowed yet
                # A live process always has a window open: it stays behind (until flush,
                # which forgets the streams), so telling the merge once is enough.
                merge.progress(stream, True)
        else:
            t = record_time_ns(record)
            if t > self.stream_ns:
                self.stream_ns = t
            merge.add("records", 0, t, to_record(record), KIND_ORDER.get(kind, 3))
        released = merge.release()  # every record: the merge's clock may free held windows
        if released:
            for rec in released:
                self.emit(self.detectors.process(rec))

    def flush(self) -> None:
        """End of input: close the open windows and the detectors' incomplete groups."""
        for w in [*self.windower.flush(), *self.inspector_windower.flush()]:
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
            progress.write(format_event(ev), file=self.out)  # above a progress bar, if one is drawn
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
        """(observed, baseline) busbw per key in GB/s, as the metrics last exported them."""
        observed: dict[tuple, float] = {}
        base: dict[tuple, float] = {}
        for metric, into in ((self.metrics.busbw_observed, observed), (self.metrics.busbw_baseline, base)):
            for family in metric.collect():
                for sample in family.samples:
                    lb = sample.labels
                    key = (lb["training_job"], lb["comm"], lb["op"], lb["size_bucket"], lb["transport"])
                    into[key] = sample.value / GBS
        return {k: (v, base.get(k)) for k, v in observed.items()}

    # -- state -------------------------------------------------------------------------

    def to_state(self, positions: Any = None) -> dict:
        return {"v": STATE_VERSION, "detectors": self.detectors.to_state(), "positions": positions}

    def restore(self, state: dict) -> Any:
        if state.get("v") != STATE_VERSION:
            raise ValueError(f"state version {state.get('v')!r}, this watch knows {STATE_VERSION}")
        self.detectors.restore(state["detectors"])
        return state.get("positions")


class EventList:
    """Stands in for the events file: keeps the events in memory."""

    def __init__(self) -> None:
        self.events: list[AnomalyEvent] = []

    def write(self, event: AnomalyEvent) -> None:
        self.events.append(event)

    def close(self) -> None:
        pass


def detect(cfg: Config, records: Iterable[Any], *, metrics: Any = None) -> list[AnomalyEvent]:
    """The anomaly events ``watch --speed 0`` gives for time-ordered ``records``.

    For the commands that judge a recording (``report``, ``eval``): the same loop, no
    output, no alerts.
    """
    sink = EventList()
    watch = Watch(cfg, out=io.StringIO(), events_file=sink, metrics=metrics)  # type: ignore[arg-type]
    for rec in records:
        watch.feed(rec)
    watch.flush()
    return sink.events


# --- the command ---------------------------------------------------------------------------


class _Stop:
    """SIGINT/SIGTERM set a flag; the loop finishes its batch, flushes and saves.

    Waits go through :meth:`sleep`, in slices: ``time.sleep`` resumes after a signal
    handler returns (PEP 475), so one long sleep through a gap in a recording would keep
    the process deaf to Ctrl-C until the gap is over.
    """

    SLICE_S = 0.1

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.requested = True

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.requested:
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, self.SLICE_S))


def _metrics(cfg: Config, port: int | None, out: TextIO, *, live: bool) -> Any:
    """The detector metrics, served on 127.0.0.1 unless the port is negative. ``live``
    is False on a replay, whose lag is the recording's age (the lag rule ignores it)."""
    from ncclwatch.detectors.metrics import DetectorMetrics
    from prometheus_client import CollectorRegistry

    from ncclwatch import exposition

    registry = CollectorRegistry()
    metrics = DetectorMetrics(registry, max_keys=cfg.detector.max_metric_keys, component="watch", live=live)
    server = exposition.serve_configured(registry, cfg.detector, port)
    if server is not None:
        print(f"metrics on {server.url}", file=out, flush=True)
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
    options = Options.from_config(cfg.ingest, training_logs=args.training_log, job=args.job)
    with ExitStack() as stack:
        recording = None
        if replay:
            try:
                recording = stack.enter_context(SortedRecording([source], ReadStats(), options, fast=True))
            except RecordingError as e:
                print(f"ncclwatch watch: {e}", file=sys.stderr)
                return 2
        return _run(args, cfg, out, source, recording, options)


def _run(
    args: argparse.Namespace,
    cfg: Config,
    out: TextIO,
    source: Path,
    recording: SortedRecording | None,
    options: Options,
) -> int:
    """Replay ``recording`` (entered, read once) or, without one, tail ``source``."""
    replay = recording is not None
    state_path = args.state or ("" if replay else cfg.detector.state_path)
    metrics = _metrics(cfg, args.metrics_port, out, live=not replay)
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
        if recording is not None:
            _replay(watch, source, recording, args, stop)
        else:
            positions = _tail(watch, source, args, stop, positions, state_path, options)
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


def _replay(watch: Watch, source: Path, recording: SortedRecording, args: argparse.Namespace, stop: _Stop) -> None:
    speed = args.speed if args.speed is not None else 0.0
    span_s = (recording.last_ns - recording.first_ns) / 1e9 if recording.total else 0.0  # type: ignore[operator]
    print(
        f"replaying {recording.total} records ({span_s:.0f} s of recording) from {source} at "
        + ("full speed" if speed == 0 else f"{speed:g}× real time"),
        file=watch.out,
        flush=True,
    )
    for note in recording.stats.notes():
        print(f"  {note}", file=watch.out)
    pacer = Pacer(speed, sleep=stop.sleep)
    status_due = _every(args.status_every_s)
    tick_due = _every(1.0)
    # What runs once per record is only what must: no pacing at full speed, no status
    # clock without status lines, no alert tick without a sink, the bar moved in steps.
    paced, status, sink, feed = speed != 0, args.status_every_s > 0, watch.sink, watch.feed
    with progress.bar(recording.total, "watch: replaying", enabled=False if args.no_progress else None) as bar:
        unbarred = 0
        for rec in recording.records():
            if stop.requested:
                break
            if paced:
                pacer.wait(record_time_ns(rec))
            feed(rec)
            unbarred += 1
            if unbarred == _BAR_STEP:
                bar.update(unbarred)
                unbarred = 0
            if status and status_due():
                for line in watch.status_lines():
                    progress.write(line, file=watch.out)
            if sink is not None and tick_due():
                sink.tick()
        bar.update(unbarred)
    watch.flush()
    if note := recording.late_note():
        print(f"  {note}", file=watch.out)


def _live_sources(source: Path, args: argparse.Namespace, cfg: Config, options: Options) -> LiveSources:
    """The spool (or Inspector dump directory) ``source``, plus the Inspector directories
    and training logs of the command line and the ``[ingest]`` configuration."""
    inspector_dirs = [*args.inspector_dir, *_split(cfg.ingest.inspector_dirs)]
    if source.name.startswith("nccl-inspector-") or any(file_kind(p) == INSPECTOR for p in source.glob("*.log")):
        inspector_dirs.insert(0, str(source))
        spool = None
    else:
        spool = str(source)
    logs = list(options.training_logs) or _split(cfg.ingest.training_log)
    return LiveSources(spool, inspector_dirs, logs, options)


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _tail(
    watch: Watch,
    source: Path,
    args: argparse.Namespace,
    stop: _Stop,
    positions: Any,
    state_path: str,
    options: Options,
) -> Any:
    """Tail the sources; records of all files go through a time merge.

    The tailers read files in turns, a chunk at a time: catching up on a spool (at start,
    after a restart, ``--once``) it can be minutes further in one file than in another.
    The merge lets a record go only when no file that still has unread bytes could hold
    an earlier one, so the detectors see the ranks of a job side by side, as they
    would have live. The saved positions are those of records processed, never of
    records still held.
    """
    live = _live_sources(source, args, watch.cfg, options)
    live.resume(positions or {})
    done = dict(positions or {})
    merge = TimeMerge()
    last_t: dict[str, int] = {}
    status_due = _every(args.status_every_s)
    save_due = _every(args.save_every_s)
    tick_due = _every(1.0)
    print(f"watching {live.describe()}", file=watch.out, flush=True)
    for where, n in sorted(live.prom_files().items()):
        # Inspector's Prometheus mode keeps means over >= 30 s, no operations: only the
        # forwarder maps them (to windows); say so rather than show zeros
        print(f"note: {where} holds {n} NCCL Inspector Prometheus file(s) (*.prom), which watch does "
              f"not read; `ncclwatch forward --inspector-dir {where}` sends them to the cluster path, "
              "and Inspector's JSON output (*.log) is what watch reads", file=sys.stderr, flush=True)

    def feed(items: list) -> None:
        for line, rec in items:
            watch.feed(rec)
            done[line.source] = line.next_offset

    while not stop.requested:
        n = 0
        for key, line, rec in live.poll(POLL_MAX_LINES):
            n += 1
            # a bad line has no time of its own: it keeps its place in its file
            t = last_t.get(key, 0) if isinstance(rec, Quarantined) else record_time_ns(rec)
            last_t[key] = t
            rank = 0 if isinstance(rec, Quarantined) else KIND_ORDER.get(rec.KIND, 3)
            merge.add(key, 0, t, (line, rec), rank)
        # every file, read yet or not: one not read yet holds everything
        for key, behind in live.behind():
            if key in last_t:
                merge.progress(key, behind)
            elif behind:
                merge.expect(key, 0)
        feed(merge.release())
        if status_due():
            for text in watch.status_lines():
                print(text, file=watch.out, flush=True)
        if watch.sink is not None and tick_due():
            watch.sink.tick()
        if state_path and save_due():
            done.update(live.positions())
            write_jsonl_atomic(state_path, watch.to_state(done))
        if not n:
            if args.once:
                break
            watch.emit(watch.detectors.quiet())  # jobs that ended (detector.quiet_end_s)
            stop.sleep(POLL_IDLE_S)
    for key, line, rec in live.flush():
        merge.add(key, 0, record_time_ns(rec), (line, rec), KIND_ORDER.get(rec.KIND, 3))
    feed(merge.drain())
    watch.flush()
    live.close()
    done.update(live.positions())
    return done
