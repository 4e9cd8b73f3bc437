"""``ncclwatch report RUN``: PNG plots and a Markdown summary of a recorded run.

For people who want a picture without Grafana: bus bandwidth over time per key
(communicator, op, size bucket, transport) with anomalies shaded and the job's throughput
overlaid, a per-rank straggler heatmap, and a summary of what was detected.

RUN is anything :mod:`ncclwatch.ingest.recording` reads: a spool directory, NCCL
Inspector JSON logs (a dump directory, one file), a scenario run directory (``spool/``
or ``inspector/`` beside ``labels.json``), a ``.tar.gz`` of any of them, or one
``.jsonl[.gz]`` file; ``--training-log`` adds the job's throughput. Anomaly events come from
``--events`` (``ncclwatch watch --events-out``), or else from running the same detector
pipeline as ``ncclwatch watch`` in-process over the recording. Injected faults
(``labels.json``, ``--labels``) are drawn hatched, so detections can be judged by eye.

Everything but the drawing lives here; :mod:`ncclwatch.dashboards.plots` draws.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ncclwatch.dashboards.run import Run, key_series, key_weight, throughput_in
from ncclwatch.detectors import watch
from ncclwatch.detectors.metrics import DetectorMetrics
from ncclwatch.ingest.recording import (
    Options,
    ReadStats,
    RecordingError,
    SortedRecording,
    add_source_arguments,
    opened_recording,
    run_dir_of,
)

from ncclwatch.config import Config
from ncclwatch.describe import where
from ncclwatch.records import (
    AnomalyEvent,
    DropRecord,
    OpRecord,
    ThroughputRecord,
    WindowSummary,
    parse_line,
)
from ncclwatch.rules import safe_filename


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run",
        help="a spool directory, NCCL Inspector JSON logs, a run directory (spool/ or inspector/ + "
        "labels.json), a .tar.gz of one, or a .jsonl[.gz] file",
    )
    add_source_arguments(p, job=False)
    p.add_argument(
        "--events",
        metavar="FILE",
        help="anomaly events as JSON lines (ncclwatch watch --events-out); default: run the "
        "detectors over the recording, as `ncclwatch watch` would",
    )
    p.add_argument(
        "--labels",
        metavar="FILE",
        help="injected faults: a labels file (docs/scenarios.md) or a run's labels.json; "
        "default: RUN/labels.json, or NAME.labels.json beside NAME.tar.gz",
    )
    p.add_argument("--out", metavar="DIR", help="output directory (default: report-<RUN name>)")
    p.add_argument(
        "--job",
        default="",
        help="only this job (default: every job in the recording); also the job of Inspector ops "
        "and training-log throughput, which carry none",
    )
    p.add_argument("--max-keys", type=int, default=12, help="plot at most this many keys per job (default 12)")


def load_labels(path: Path) -> list[dict]:
    """Fault intervals (type, start_ns, end_ns, job) from a labels file.

    Either shape :class:`~ncclwatch.detectors.labels.LabelSet` reads: the
    labelled-scenario format that ``ncclwatch eval`` reads (``docs/scenarios.md``:
    ``{"labels": [...]}``), or the raw ``labels.json`` a scenario run directory holds
    (``{"scenario", "job", "faults": [...]}``). A label without a job is about any job.
    """
    from ncclwatch.detectors.labels import LabelSet

    try:
        ls = LabelSet.load(path)
    except OSError as e:
        raise ValueError(f"{path}: {e}") from None
    return [
        {"type": lb.type, "start_ns": lb.start_ns, "end_ns": lb.end_ns, "job": lb.job_or(ls.job) or None}
        for lb in ls.labels
    ]


@contextmanager
def read_run(
    path: Path, options: Options | None = None, *, job: str = ""
) -> Iterator[tuple[Run, SortedRecording, list[dict]]]:
    """The recording's records in time order (of ``job`` only, if given; streamed in
    bounded memory), and the labels found with them.

    Labels: ``labels.json`` in a run directory, or ``<name>.labels.json`` beside a
    ``<name>.tar.gz`` (how the committed GPU-run fixtures are laid out).
    """
    run = Run(name=path.name.removesuffix(".tar.gz").removesuffix(".tgz"), source=str(path))
    labels: list[dict] = []
    stats = ReadStats()
    keep = (lambda rec: getattr(rec, "job", None) == job) if job else None
    with opened_recording(path) as root:
        top = run_dir_of(root)
        if top is not None and (top / "labels.json").is_file():
            labels = load_labels(top / "labels.json")
        if top is not None and top != root:
            run.name = top.name
        beside = path.with_name(f"{run.name}.labels.json")
        if not labels and beside.is_file():
            labels = load_labels(beside)
        with SortedRecording([root], stats, options, keep=keep) as recording:
            run.quarantined = sum(stats.quarantined.values())
            run.notes = stats.notes()
            yield run, recording, labels


def read_events(path: Path) -> list[AnomalyEvent]:
    events = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        rec = parse_line(line, source=str(path))
        if not isinstance(rec, AnomalyEvent):
            raise ValueError(f"{path}:{n}: not an anomaly event: {rec}")
        events.append(rec)
    return events


class BandMetrics(DetectorMetrics):
    """The watch's metrics, keeping also the baseline every key's window was judged
    against: the band the plots draw.

    The pipeline hands each window's observed and baseline bus bandwidth to its
    observer (``key_window``, what ``ncclwatch_busbw_baseline_bytes_per_second`` shows live), so the
    band is read where the detector published it, not from its internals.
    """

    def __init__(self, run: Run, threshold: float, **kwargs: Any):
        super().__init__(**kwargs)
        self.run = run
        run.threshold = threshold

    def key_window(self, job: str, ks: Any, observed: float, baseline: float | None, effect: float,
                   exec_ns: int, end_ns: int) -> None:
        super().key_window(job, ks, observed, baseline, effect, exec_ns, end_ns)
        if baseline:
            key = (job, ks.comm, ks.op, ks.size_bucket, ks.transport)
            self.run.baselines.setdefault(key, []).append((end_ns, float(baseline)))


def detect(records: Iterable[Any], cfg: Config, run: Run) -> list[AnomalyEvent]:
    """Run the detectors exactly as ``ncclwatch watch`` replays a recording, keeping each
    key's baseline per window (:class:`BandMetrics`) so the plots can draw the band the
    detector used."""
    metrics = BandMetrics(run, cfg.detector.threshold, max_keys=cfg.detector.max_metric_keys)
    return watch.detect(cfg, records, metrics=metrics)


def load(args: argparse.Namespace, cfg: Config) -> Run:
    """The run model of a recording, read once: windows for the plots, throughput, drops,
    and the anomaly events (given, recorded, or detected in the same pass)."""
    options = Options.from_config(cfg.ingest, training_logs=args.training_log, job=args.job)
    try:
        with read_run(Path(args.run), options, job=args.job) as (run, recording, labels):
            return _load(args, cfg, run, recording, labels)
    except RecordingError as e:
        raise ValueError(str(e)) from None


def _load(args: argparse.Namespace, cfg: Config, run: Run, recording: SortedRecording, labels: list[dict]) -> Run:
    from ncclwatch.ingest.windows import Windower

    if not recording.total:
        raise ValueError(f"{args.run}: no records" + (f" of job {args.job}" if args.job else ""))
    labels_path = Path(args.labels) if args.labels else None
    run.labels = load_labels(labels_path) if labels_path else labels
    run.t0_ns, run.t1_ns = recording.first_ns or 0, recording.last_ns or 0
    windower = Windower(cfg.ingest.window_s)

    def add_window(w: WindowSummary) -> None:
        key = (w.job, w.comm, w.op, w.size_bucket, w.transport)
        run.windows.setdefault(key, {}).setdefault(w.start_ns, {})[w.rank] = w

    def tallied() -> Iterator[Any]:
        for _, _, _, rec in recording:
            run.kinds[rec.KIND] += 1
            if isinstance(rec, OpRecord):
                for w in windower.add(rec):
                    add_window(w)
            elif isinstance(rec, WindowSummary):
                add_window(rec)
            elif isinstance(rec, ThroughputRecord):
                run.throughput.setdefault(rec.job, []).append(rec)
            elif isinstance(rec, DropRecord):
                run.drops.setdefault(rec.job, Counter())[rec.reason] += rec.count
            elif isinstance(rec, AnomalyEvent):
                run.events.append(rec)  # a recording of the anomalies topic
            yield rec

    if args.events or recording.kinds["anomaly"]:
        for _ in tallied():
            pass
    else:
        # one pass: the detectors see the records as they are tallied
        run.events = detect(tallied(), cfg, run)
        run.events_source = "detectors run over the recording (as `ncclwatch watch`)"
    for w in windower.flush():
        add_window(w)
    run.late_ops = windower.late_total
    if recording.refused_late:  # bad lines the first pass only looked at: found while reading
        run.quarantined = sum(recording.stats.quarantined.values())
        run.notes = recording.stats.notes()
    if args.events:
        run.events = [e for e in read_events(Path(args.events)) if not args.job or e.job == args.job]
        run.events_source = args.events
    elif recording.kinds["anomaly"]:
        run.events_source = "anomaly records in the recording"
    return run


# ----------------------------------------------------------------------------- Markdown


def _clock(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _rel(run: Run, ns: int) -> str:
    return f"+{(ns - run.t0_ns) / 1e9:.0f} s"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.1%}"


def markdown(run: Run, figures: dict[str, dict[str, str]]) -> str:
    span_s = (run.t1_ns - run.t0_ns) / 1e9
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(run.kinds.items()))
    lines = [
        f"# ncclwatch report: {run.name}",
        "",
        f"- source: `{run.source}`",
        f"- recorded: {_clock(run.t0_ns)}, {span_s:.0f} s",
        f"- records: {kinds}",
        *(f"- {note}" for note in run.notes),  # bad lines, skipped lines, unrecognised files
        f"- anomaly events: {len(run.events)}, from {run.events_source}",
    ]
    if run.late_ops:
        lines.append(f"- {run.late_ops} op records arrived after their window closed (left out)")
    for job in run.jobs:
        lines += _job_section(run, job, figures.get(job, {}))
    return "\n".join(lines) + "\n"


def _job_section(run: Run, job: str, figs: dict[str, str]) -> list[str]:
    spans = run.intervals(job)
    out = ["", f"## Job `{job}`", ""]
    before = throughput_in(run, job, spans, inside=False)
    during = throughput_in(run, job, spans, inside=True)
    if before is not None:
        text = f"Throughput: median {before:.1f} TFLOP/s per GPU outside anomalies"
        if during is not None:
            text += f", {during:.1f} while an anomaly was active ({during / before - 1:+.1%})"
        out.append(text + ".")
    else:
        out.append("No throughput records: the job did not report its speed.")
    if run.drops.get(job):
        drops = ", ".join(f"{n} {r}" for r, n in sorted(run.drops[job].items()))
        out.append(f"The plugin dropped ops ({drops}): the detectors saw part of the traffic.")
    if "overview" in figs:
        out += ["", f"![overview]({figs['overview']})"]
    out += ["", "### Anomalies", ""]
    if spans:
        out += [
            "| # | type | where | from | for | busbw baseline → observed | effect | throughput | severity |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for n, i in enumerate(spans, 1):
            ev = i.event
            assert ev is not None  # anomaly intervals always carry their event
            bw = "–"
            if ev.baseline_busbw_gbs is not None and ev.observed_busbw_gbs is not None:
                bw = f"{ev.baseline_busbw_gbs:.1f} → {ev.observed_busbw_gbs:.1f} GB/s"
            dur = f"{(i.end_ns - i.start_ns) / 1e9:.0f} s" + (" (still firing)" if i.open else "")
            place = where(i.key, host=ev.host, rank=ev.rank, whole="whole job")
            out.append(
                f"| {n} | {i.kind} | {place} | {_rel(run, i.start_ns)} | {dur} | {bw} "
                f"| {ev.effect:.0%} | {_pct(ev.throughput_delta)} | {ev.severity} |"
            )
    else:
        out.append("None detected.")
    faults = run.fault_intervals(job)
    if faults:
        out += [
            "",
            "### Injected faults (labels)",
            "",
            "| fault | from | to | first overlapping anomaly |",
        ]
        out.append("|---|---|---|---|")
        for f in faults:
            hit = [i for i in spans if i.start_ns <= f.end_ns and i.end_ns >= f.start_ns]
            first = min(hit, key=lambda i: i.detected_ns or i.start_ns) if hit else None
            found = "none"
            if first is not None and first.detected_ns is not None:
                delay = (first.detected_ns - f.start_ns) / 1e9
                found = f"{first.kind}, detected {delay:.0f} s after the fault began"
            out.append(f"| {f.kind} | {_rel(run, f.start_ns)} | {_rel(run, f.end_ns)} | {found} |")
    out += ["", "### Keys (by bytes moved)", ""]
    out += ["| comm | op | size | transport | ranks | windows | busbw median | p5 | min |"]
    out.append("|---|---|---|---|---|---|---|---|---|")
    for key in sorted(run.keys(job), key=lambda k: -key_weight(run, k))[:30]:
        series = key_series(run, key)
        med = sorted(s[1] for s in series)
        ranks = max(len(r) for r in run.windows[key].values())
        p5 = med[max(0, int(0.05 * len(med)) - 1)] if len(med) >= 20 else med[0]
        out.append(
            f"| {key[1]} | {key[2]} | {key[3]} | {key[4]} | {ranks} | {len(series)} "
            f"| {statistics.median(med):.1f} GB/s | {p5:.1f} | {min(s[2] for s in series):.1f} |"
        )
    for name, caption in (("keys", "keys"), ("ranks", "per-rank relative exec time")):
        if name in figs:
            out += ["", f"![{caption}]({figs[name]})"]
    return out


# ----------------------------------------------------------------------------- command


def write_report(run: Run, out_dir: Path, max_keys: int = 12) -> list[Path]:
    from ncclwatch.dashboards import plots

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    figures: dict[str, dict[str, str]] = {}
    for job in run.jobs:
        stem = safe_filename(job)
        figs = figures.setdefault(job, {})
        for name, draw in (
            ("overview", plots.overview),
            ("keys", plots.keys),
            ("ranks", plots.ranks),
        ):
            path = out_dir / f"{name}-{stem}.png"
            kwargs = {"max_keys": max_keys} if name != "ranks" else {}
            if draw(run, job, path, **kwargs):
                figs[name] = path.name
                written.append(path)
    md = out_dir / "report.md"
    md.write_text(markdown(run, figures))
    return [md, *written]


def run(args: argparse.Namespace, cfg: Config) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("ncclwatch report needs matplotlib: pip install 'ncclwatch[report]'", file=sys.stderr)
        return 2
    source = Path(args.run)
    if not source.exists():
        print(f"ncclwatch report: {source}: no such file or directory", file=sys.stderr)
        return 2
    try:
        data = load(args, cfg)
    except ValueError as e:
        print(f"ncclwatch report: {e}", file=sys.stderr)
        return 2
    out_dir = Path(args.out) if args.out else Path(f"report-{data.name}")
    for path in write_report(data, out_dir, args.max_keys):
        print(path)
    return 0
