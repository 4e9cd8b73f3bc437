"""The labelled scenario format: when, where and what the faults in a stream were.

One JSON file per scenario (``<name>.labels.json``), written by the synthetic generator
(:mod:`.scenarios`) and by whoever records a real run with injected faults; read by
``ncclwatch eval``. ``docs/scenarios.md`` documents every field.

>>> ls = LabelSet.from_dict({"scenario": "s", "job": "j", "labels": [
...     {"start_ns": 10, "end_ns": 20, "type": "network_path", "attribution": "network"}]})
>>> ls.labels[0].optional, ls.labels[0].job_or(ls.job)
(False, 'j')
>>> LabelSet.from_dict({"scenario": "s", "job": "j", "labels": [
...     {"start_ns": 10, "end_ns": 20, "type": "slow", "attribution": "network"}]})
Traceback (most recent call last):
...
ValueError: label 0: type 'slow' is not one of ...
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ncclwatch.records import ANOMALY_TYPES, ATTRIBUTIONS, SEVERITIES

LABELS_VERSION = 1


@dataclass(frozen=True)
class Label:
    """One fault interval that a detector should (or may) report."""

    start_ns: int  # when the fault became detectable (e.g. a ramp crossing the threshold)
    end_ns: int  # when it ended
    type: str  # the AnomalyEvent type a perfect detector would emit
    attribution: str  # the AnomalyEvent attribution it would carry
    rank: int | None = None  # straggler / lost rank (in ``comm`` when given)
    host: str | None = None  # the node at fault, when it is one node
    comm: str | None = None  # the communicator ``rank`` refers to
    keys: list[dict[str, Any]] | None = None  # affected keys {comm, op, size_bucket, transport}
    job: str | None = None  # defaults to the file's ``job``
    optional: bool = False  # detecting it is neither required nor a false alarm
    severity: str | None = None  # the severity expected, when the run makes it clear
    onset_ns: int | None = None  # when the fault began, if earlier than start_ns (ramps)
    magnitude: float | None = None  # e.g. relative busbw loss on the affected keys
    note: str = ""

    def job_or(self, default: str) -> str:
        return self.job if self.job is not None else default

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        # Leave defaults out so hand-written and generated files look alike.
        return {k: v for k, v in d.items() if v not in (None, False, "") or k in _REQUIRED}


_REQUIRED = ("start_ns", "end_ns", "type", "attribution")
_LABEL_FIELDS = {f.name for f in fields(Label)}


@dataclass
class LabelSet:
    """A scenario's labels plus what describes the stream."""

    scenario: str
    job: str
    labels: list[Label]
    description: str = ""
    version: int = LABELS_VERSION
    meta: dict[str, Any] = field(default_factory=dict)  # anything else: seed, topology, spikes

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LabelSet:
        for name in ("scenario", "job", "labels"):
            if name not in d:
                raise ValueError(f"labels file lacks {name!r}")
        if d.get("version", LABELS_VERSION) != LABELS_VERSION:
            raise ValueError(f"unknown labels version {d.get('version')!r}")
        labels = [_label(i, raw) for i, raw in enumerate(d["labels"])]
        known = {"scenario", "job", "labels", "description", "version"}
        meta = {k: v for k, v in d.items() if k not in known}
        return cls(
            scenario=str(d["scenario"]),
            job=str(d["job"]),
            labels=labels,
            description=str(d.get("description", "")),
            meta=meta,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "scenario": self.scenario,
            "job": self.job,
            "description": self.description,
            **self.meta,
            "labels": [lb.to_dict() for lb in self.labels],
        }

    @classmethod
    def load(cls, path: str | Path) -> LabelSet:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def _label(i: int, raw: Any) -> Label:
    if not isinstance(raw, dict):
        raise ValueError(f"label {i}: expected an object")
    unknown = sorted(set(raw) - _LABEL_FIELDS)
    if unknown:
        raise ValueError(f"label {i}: unknown field(s) {', '.join(unknown)}")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"label {i}: missing field(s) {', '.join(missing)}")
    lb = Label(**raw)
    if lb.type not in ANOMALY_TYPES:
        raise ValueError(f"label {i}: type {lb.type!r} is not one of {list(ANOMALY_TYPES)}")
    if lb.attribution not in ATTRIBUTIONS:
        raise ValueError(
            f"label {i}: attribution {lb.attribution!r} is not one of {list(ATTRIBUTIONS)}"
        )
    if lb.severity is not None and lb.severity not in SEVERITIES:
        raise ValueError(f"label {i}: severity {lb.severity!r} is not one of {list(SEVERITIES)}")
    if not (isinstance(lb.start_ns, int) and isinstance(lb.end_ns, int)) or lb.end_ns < lb.start_ns:
        raise ValueError(f"label {i}: needs integer start_ns <= end_ns")
    return lb
