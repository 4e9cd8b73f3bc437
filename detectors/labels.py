"""The labelled scenario format: when, where and what the faults in a stream were.

One JSON file per scenario (``<name>.labels.json``), written by the synthetic generator
(:mod:`.scenarios`) and by whoever records a real run with injected faults; read by
``ncclwatch eval`` and ``ncclwatch report``. ``docs/scenarios.md`` documents every field.

A recorded run's own ``labels.json`` (``bench/scenarios/record.py``:
``{"scenario", "job", "faults": [...]}``, each fault with ``type``, ``start_ns``,
``end_ns`` and what the recorder knew) is read too, by :meth:`LabelSet.from_run`. A file
without ``job`` is about whatever job its events are of.

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
_ATTRIBUTION_OF = {"network_path": "network", "intra_node": "intra_node", "straggler": "straggler",
                   "telemetry_loss": "telemetry"}
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
        """Either shape: ``{"labels": [...]}`` (this format) or a run's ``{"faults": [...]}``."""
        if not isinstance(d, dict):
            raise ValueError("a labels file is a JSON object")
        if "labels" not in d and "faults" in d:
            return cls.from_run(d)
        for name in ("scenario", "labels"):
            if name not in d:
                raise ValueError(f"labels file lacks {name!r}")
        if d.get("version", LABELS_VERSION) != LABELS_VERSION:
            raise ValueError(f"unknown labels version {d.get('version')!r}")
        labels = [_label(i, raw) for i, raw in enumerate(d["labels"])]
        known = {"scenario", "job", "labels", "description", "version"}
        meta = {k: v for k, v in d.items() if k not in known}
        return cls(
            scenario=str(d["scenario"]),
            job=str(d.get("job", "")),
            labels=labels,
            description=str(d.get("description", "")),
            meta=meta,
        )

    @classmethod
    def from_run(cls, d: dict[str, Any]) -> LabelSet:
        """A recorded run's ``labels.json`` (``bench/scenarios/record.py``).

        Each fault keeps its interval, type and attribution (by type when absent); a
        straggler's rank is its rank in the first communicator of ``comm_ranks`` (the
        one it stalls, as the detector reports ranks), a network fault's communicator
        the one in ``comms`` when there is one. What the recorder knew besides (global
        ranks, pids, injector) goes to the note.

        >>> ls = LabelSet.from_run({"scenario": "straggler", "job": "gpu-s", "faults": [
        ...     {"type": "straggler", "attribution": "straggler", "global_rank": 1,
        ...      "start_ns": 10, "end_ns": 20, "host": "vm", "pid": 885, "gpu": 1,
        ...      "comm_ranks": {"0x20501219d149b3fe": 1}}]})
        >>> lb = ls.labels[0]
        >>> ls.job, lb.type, lb.rank, lb.comm, lb.host
        ('gpu-s', 'straggler', 1, '0x20501219d149b3fe', 'vm')
        """
        faults = d.get("faults")
        if not isinstance(faults, list):
            raise ValueError("a run's labels.json holds a list of 'faults'")
        labels = []
        for i, f in enumerate(faults):
            if not isinstance(f, dict):
                raise ValueError(f"fault {i}: expected an object")
            kind = f.get("type")
            raw: dict[str, Any] = {
                "start_ns": f.get("start_ns"),
                "end_ns": f.get("end_ns"),
                "type": kind,
                "attribution": f.get("attribution", _ATTRIBUTION_OF.get(kind, "unknown")),
            }
            comm_ranks = f.get("comm_ranks") or {}
            if comm_ranks:
                raw["comm"], raw["rank"] = next(iter(comm_ranks.items()))
            comms = f.get("comms") or {}
            if len(comms) == 1:
                raw["comm"] = next(iter(comms.values())).get("comm")
            if f.get("host"):
                raw["host"] = f["host"]
            known = {"start_ns", "end_ns", "type", "attribution", "comm_ranks", "comms", "host"}
            raw["note"] = ", ".join(f"{k} {v}" for k, v in f.items() if k not in known and v is not None)
            labels.append(_label(i, raw))
        return cls(
            scenario=str(d.get("scenario", "")),
            job=str(d.get("job", "")),
            labels=labels,
            description="a recorded run's labels.json",
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
        """Read a labels file of either shape (raises ValueError or OSError, naming it)."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON: {e}") from None
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

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
