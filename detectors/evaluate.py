"""``ncclwatch eval``: score anomaly events against labelled fault intervals.

Matching is event-level, by time overlap within one job:

- an *anomaly* is every event sharing one ``id``; its interval is ``[start_ns, end_ns]``
  of its resolved event, open-ended while it never resolved; its detection time is its
  first firing event's ``detected_ns``; its type, attribution, host and rank come from
  that first firing event, its severity is the highest any of its events reached;
- an anomaly *matches* a label of the same job when the anomaly's interval overlaps
  ``[label.start_ns - tolerance, label.end_ns + tolerance]``;
- an anomaly matching a required label is a true positive; one matching only optional
  labels is not counted either way; any other is a false positive. Precision is
  TP / (TP + FP);
- a required label matched by at least one anomaly is detected. Recall is detected /
  required labels; F1 their harmonic mean;
- detection delay of a detected label: the earliest matching ``detected_ns`` minus the
  label's ``start_ns``, in seconds;
- attribution of a detected label is correct when its earliest matching anomaly has the
  label's type and attribution, the label's host if it names one, and the label's rank
  if it names one (and the anomaly is on the label's ``comm``, when both name a comm);
- severity of a detected label, when the label names one, is correct when the highest
  severity of its matching anomalies equals it;
- a labels file without a ``job`` is about whatever job its events are of: its labels
  match anomalies of any job.

LABELS is either labels shape (:class:`~.labels.LabelSet`: the labelled-scenario format
or a recorded run's ``labels.json``). EVENTS is an anomaly-events file (``watch
--events-out``), or a recording (anything :mod:`ncclwatch.ingest.recording` reads:
spool, NCCL Inspector logs, a run directory, an archive; ``--training-log`` for the
throughput), over which the detectors then run as ``watch --speed 0`` would.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncclwatch.detectors import watch
from ncclwatch.ingest.recording import (
    Options,
    ReadStats,
    add_source_arguments,
    is_archive,
    read_recording,
)

from ncclwatch import config
from ncclwatch.records import AnomalyEvent, parse_line

from .incidents import SEVERITY_RANK
from .labels import Label, LabelSet

DEFAULT_TOLERANCE_S = 5.0


@dataclass
class Anomaly:
    """All events of one anomaly id, folded."""

    id: str
    job: str
    type: str
    attribution: str
    host: str | None
    rank: int | None
    comm: str | None
    start_ns: int
    end_ns: int | None
    detected_ns: int
    severity: str

    @classmethod
    def fold(cls, events: Iterable[AnomalyEvent]) -> list[Anomaly]:
        out: dict[str, Anomaly] = {}
        for ev in events:
            a = out.get(ev.id)
            if a is None:
                a = out[ev.id] = cls(
                    id=ev.id, job=ev.job, type=ev.type, attribution=ev.attribution,
                    host=ev.host, rank=ev.rank, comm=(ev.key or {}).get("comm"),
                    start_ns=ev.start_ns, end_ns=None, detected_ns=ev.detected_ns,
                    severity=ev.severity,
                )
            if SEVERITY_RANK[ev.severity] > SEVERITY_RANK[a.severity]:
                a.severity = ev.severity
            if ev.state == "firing":
                a.detected_ns = min(a.detected_ns, ev.detected_ns)
            else:
                a.end_ns = ev.end_ns if ev.end_ns is not None else ev.detected_ns
        return list(out.values())

    def overlaps(self, lb: Label, tolerance_ns: int) -> bool:
        end = self.end_ns if self.end_ns is not None else math.inf
        return self.start_ns <= lb.end_ns + tolerance_ns and end >= lb.start_ns - tolerance_ns


def attribution_correct(a: Anomaly, lb: Label) -> bool:
    if a.type != lb.type or a.attribution != lb.attribution:
        return False
    if lb.host is not None and a.host != lb.host:
        return False
    return not (
        lb.rank is not None
        and (lb.comm is None or a.comm is None or a.comm == lb.comm)
        and a.rank != lb.rank
    )


@dataclass
class Tally:
    """Counts for one scenario, one label type, or everything."""

    labels: int = 0  # required labels
    detected: int = 0
    tp: int = 0
    fp: int = 0
    attributed: int = 0
    severity_checked: int = 0
    severity_ok: int = 0
    delays_s: list[float] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.labels += other.labels
        self.detected += other.detected
        self.tp += other.tp
        self.fp += other.fp
        self.attributed += other.attributed
        self.severity_checked += other.severity_checked
        self.severity_ok += other.severity_ok
        self.delays_s.extend(other.delays_s)

    def summary(self) -> dict[str, Any]:
        precision = self.tp / (self.tp + self.fp) if self.tp + self.fp else None
        recall = self.detected / self.labels if self.labels else None
        f1 = (
            2 * precision * recall / (precision + recall)
            if precision is not None and recall is not None and precision + recall > 0
            else None
        )
        d = sorted(self.delays_s)
        return {
            "labels": self.labels,
            "detected": self.detected,
            "anomalies_tp": self.tp,
            "anomalies_fp": self.fp,
            "precision": precision,
            "recall": recall,
            "f1": f1,
            "attribution_accuracy": self.attributed / self.detected if self.detected else None,
            "severity_accuracy": (
                self.severity_ok / self.severity_checked if self.severity_checked else None
            ),
            "delay_s": {
                "n": len(d),
                "p50": percentile(d, 50),
                "p90": percentile(d, 90),
                "max": d[-1] if d else None,
                "mean": sum(d) / len(d) if d else None,
            },
        }


def percentile(sorted_values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (None for no values).

    >>> percentile([1.0, 2.0, 3.0, 4.0], 90), percentile([], 50)
    (4.0, None)
    """
    if not sorted_values:
        return None
    return sorted_values[max(1, math.ceil(p / 100 * len(sorted_values))) - 1]


@dataclass
class ScenarioResult:
    scenario: str
    total: Tally
    by_type: dict[str, Tally]
    matches: list[dict[str, Any]]
    false_positives: list[dict[str, Any]]


def evaluate_one(labels: LabelSet, events: Iterable[AnomalyEvent],
                 tolerance_s: float = DEFAULT_TOLERANCE_S) -> ScenarioResult:
    tol = int(tolerance_s * 1e9)
    anomalies = Anomaly.fold(events)
    total = Tally()
    by_type: dict[str, Tally] = {}
    matches: list[dict[str, Any]] = []
    for lb in labels.labels:
        job = lb.job_or(labels.job)
        hits = [a for a in anomalies if job in ("", a.job) and a.overlaps(lb, tol)]
        if lb.optional:
            continue
        t = by_type.setdefault(lb.type, Tally())
        t.labels += 1
        row: dict[str, Any] = {"type": lb.type, "start_ns": lb.start_ns, "detected": bool(hits)}
        if hits:
            first = min(hits, key=lambda a: (a.detected_ns, a.id))
            t.detected += 1
            delay = (first.detected_ns - lb.start_ns) / 1e9
            t.delays_s.append(delay)
            ok = attribution_correct(first, lb)
            t.attributed += ok
            row.update(delay_s=delay, anomaly=first.id, got_type=first.type,
                       got_attribution=first.attribution, attribution_ok=ok)
            if lb.severity is not None:
                sev = max((a.severity for a in hits), key=SEVERITY_RANK.__getitem__)
                t.severity_checked += 1
                t.severity_ok += sev == lb.severity
                row.update(severity=sev, severity_ok=sev == lb.severity)
        matches.append(row)
    fps = []
    for a in anomalies:
        matched = [
            lb for lb in labels.labels
            if lb.job_or(labels.job) in ("", a.job) and a.overlaps(lb, tol)
        ]
        if not matched:
            by_type.setdefault(a.type, Tally()).fp += 1
            fps.append({"id": a.id, "type": a.type, "start_ns": a.start_ns,
                        "detected_ns": a.detected_ns})
        elif any(not lb.optional for lb in matched):
            # A TP is credited to the type of the label it matched, first required one.
            lb = next(lb for lb in matched if not lb.optional)
            by_type.setdefault(lb.type, Tally()).tp += 1
    for t in by_type.values():
        total.add(t)
    return ScenarioResult(labels.scenario, total, by_type, matches, fps)


def evaluate(pairs: list[tuple[LabelSet, list[AnomalyEvent]]],
             tolerance_s: float = DEFAULT_TOLERANCE_S) -> dict[str, Any]:
    """Score several scenarios; the JSON report ``--json`` prints."""
    results = [evaluate_one(ls, evs, tolerance_s) for ls, evs in pairs]
    total = Tally()
    by_type: dict[str, Tally] = {}
    for r in results:
        total.add(r.total)
        for k, t in r.by_type.items():
            by_type.setdefault(k, Tally()).add(t)
    return {
        "tolerance_s": tolerance_s,
        "total": total.summary(),
        "by_type": {k: by_type[k].summary() for k in sorted(by_type)},
        "scenarios": [
            {
                "scenario": r.scenario,
                **r.total.summary(),
                "matches": r.matches,
                "false_positives": r.false_positives,
            }
            for r in results
        ],
    }


# --- presentation --------------------------------------------------------------------

def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{100 * v:.0f}%"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


def table(report: dict[str, Any], markdown: bool = False) -> str:
    """The report as an aligned text table (or a Markdown one)."""
    head = ["", "labels", "detected", "recall", "TP", "FP", "precision", "F1",
            "delay p50 s", "delay p90 s", "delay max s", "attribution", "severity"]

    def row(name: str, s: dict[str, Any]) -> list[str]:
        d = s["delay_s"]
        return [name, str(s["labels"]), str(s["detected"]), _fmt(s["recall"], True),
                str(s["anomalies_tp"]), str(s["anomalies_fp"]), _fmt(s["precision"], True),
                _fmt(s["f1"], True), _fmt(d["p50"]), _fmt(d["p90"]), _fmt(d["max"]),
                _fmt(s["attribution_accuracy"], True), _fmt(s["severity_accuracy"], True)]

    sections: list[tuple[str, list[list[str]]]] = [
        ("scenario", [row(s["scenario"], s) for s in report["scenarios"]]),
        ("label type", [row(k, v) for k, v in report["by_type"].items()]),
    ]
    out = []
    for title, rows in sections:
        rows = rows + [row("TOTAL", report["total"])]
        hdr = [title, *head[1:]]
        if markdown:
            out.append("| " + " | ".join(hdr) + " |")
            out.append("|" + "|".join(["---"] + ["---:"] * (len(hdr) - 1)) + "|")
            out.extend("| " + " | ".join(r) + " |" for r in rows)
        else:
            widths = [max(len(x) for x in col) for col in zip(hdr, *rows, strict=True)]
            out.append(_aligned(hdr, widths))
            out.extend(_aligned(r, widths) for r in rows)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _aligned(cells: list[str], widths: list[int]) -> str:
    return "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )


# --- reading files ---------------------------------------------------------------------

def read_events(path: str | Path) -> list[AnomalyEvent]:
    """AnomalyEvents from a JSONL file (``.gz`` too); other record kinds are skipped."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    out = []
    with opener(p, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            rec = parse_line(line, source=str(p), offset=n)
            if isinstance(rec, AnomalyEvent):
                out.append(rec)
            elif rec.KIND == "quarantined":
                raise ValueError(f"{p}:{n}: not a valid record: {rec.reason}: {rec.detail}")
    return out


def is_events_file(path: Path) -> bool:
    """A file whose first record is an anomaly event (an empty file: no events)."""
    if not path.is_file() or is_archive(path):
        return False
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                rec = parse_line(line.strip())
                return rec.KIND == "anomaly"
    return True


def events_of(path: Path, cfg: Any, options: Options) -> list[AnomalyEvent]:
    """The anomaly events a file holds, or those the detectors find in a recording."""
    if is_events_file(path):
        return read_events(path)
    stats = ReadStats()
    records = read_recording([path], stats, options)
    for note in stats.notes():
        print(f"{path}: {note}", file=sys.stderr)
    return watch.detect(cfg, records)


def pairs_from_dir(d: Path) -> list[tuple[Path, Path]]:
    """``<name>.labels.json`` with ``<name>.events.jsonl`` in one directory."""
    out = []
    for lab in sorted(d.glob("*.labels.json")):
        ev = lab.with_name(lab.name[: -len(".labels.json")] + ".events.jsonl")
        if not ev.exists():
            raise FileNotFoundError(f"{lab} has no {ev.name} next to it")
        out.append((lab, ev))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "files", nargs="*", type=Path, metavar="LABELS EVENTS",
        help="pairs of a labels file (.labels.json, or a run's labels.json) and an anomaly "
        "events file (JSONL) or a recording to run the detectors over (a spool, NCCL "
        "Inspector logs, a run directory, a .tar.gz of one)",
    )
    add_source_arguments(parser)
    parser.add_argument("--dir", type=Path, action="append", default=[],
                        help="a directory of <name>.labels.json + <name>.events.jsonl pairs")
    parser.add_argument("--tolerance-s", type=float, default=DEFAULT_TOLERANCE_S,
                        help="overlap tolerance around label intervals (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the JSON report")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")


def run(args: argparse.Namespace, cfg: Any = None) -> int:
    if len(args.files) % 2:
        print("ncclwatch eval: give LABELS EVENTS in pairs", file=sys.stderr)
        return 2
    paths = [(args.files[i], args.files[i + 1]) for i in range(0, len(args.files), 2)]
    for d in args.dir:
        paths.extend(pairs_from_dir(d))
    if not paths:
        print("ncclwatch eval: nothing to evaluate (give LABELS EVENTS or --dir)", file=sys.stderr)
        return 2
    if args.training_log and len(paths) > 1:
        print("ncclwatch eval: --training-log belongs to one recording: give one pair", file=sys.stderr)
        return 2
    cfg = cfg if cfg is not None else config.load(None)
    pairs = []
    try:
        for lab, ev in paths:
            labels = LabelSet.load(lab)
            # Inspector ops and training logs carry no job: the labels say which it is.
            options = Options.from_config(cfg.ingest, training_logs=args.training_log,
                                          job=args.job or labels.job)
            pairs.append((labels, events_of(ev, cfg, options)))
    except (ValueError, OSError) as e:  # RecordingError too: a bad file, said plainly
        print(f"ncclwatch eval: {e}", file=sys.stderr)
        return 2
    report = evaluate(pairs, args.tolerance_s)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(table(report, markdown=args.markdown), end="")
    return 0
