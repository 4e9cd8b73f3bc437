"""The record contract (version 1): one dataclass per record kind.

Everything in ncclwatch imports its record types from here; ``docs/records.md`` says
what each field means and ``ncclwatch/schemas/*.v1.schema.json`` are generated from
these classes (``python -m ncclwatch.records --write-schemas``), so the three cannot
drift apart without a test failing.

Parsing checks every field by hand rather than through ``jsonschema``: the forwarder
parses hundreds of thousands of lines a second and a generic validator costs ~20x more.

>>> line = to_json(ThroughputRecord(job="j", host="h", rank=0, ts_ns=1, step=3,
...                                 tflops_per_gpu=310.2, tokens_per_s=None, source="api"))
>>> parse_line(line).tflops_per_gpu
310.2
>>> parse_line('{"v": 2, "kind": "op"}')
Quarantined(stage='schema', reason='unknown_version', ...)
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, get_type_hints

VERSION = 1
MAX_LINE_BYTES = 64 * 1024

TRANSPORTS = ("single", "nvlink", "net", "mixed")
TIMINGS = ("kernel_gpu", "host", "inspector")
DROP_REASONS = ("pool_full", "ring_full", "disk_full", "write_error", "untimed", "quarantined", "other")
ANOMALY_TYPES = (
    "collective_degraded",
    "network_path",
    "intra_node",
    "straggler",
    "telemetry_loss",
    "throughput_drop",
)
ATTRIBUTIONS = ("network", "intra_node", "straggler", "telemetry", "unknown")
SEVERITIES = ("info", "warning", "critical")
QUARANTINE_REASONS = (
    "not_json",
    "not_utf8",
    "too_long",
    "unknown_version",
    "unknown_kind",
    "schema",
)


class RecordError(ValueError):
    """A record that breaks the contract; ``reason`` is one of QUARANTINE_REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _f(*, enum: tuple[str, ...] | None = None, minimum: int | None = None, pattern: str | None = None):
    meta: dict[str, Any] = {}
    if enum is not None:
        meta["enum"] = enum
    if minimum is not None:
        meta["minimum"] = minimum
    if pattern is not None:
        meta["pattern"] = pattern
    return field(metadata=meta)


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One completed NCCL operation on one rank."""

    KIND: ClassVar[str] = "op"
    id: str = _f(pattern="^[0-9a-f]{16}$")
    job: str
    host: str
    pid: int = _f(minimum=0)
    gpu: str
    comm: str = _f(pattern="^0x[0-9a-f]{16}$")
    comm_name: str
    rank: int = _f(minimum=0)
    nranks: int = _f(minimum=1)
    nnodes: int = _f(minimum=1)
    local_ranks: int = _f(minimum=1)
    transport: str = _f(enum=TRANSPORTS)
    op: str
    seq: int = _f(minimum=0)
    count: int = _f(minimum=0)
    dtype: str
    bytes: int = _f(minimum=0)
    peer: int
    algo: str
    proto: str
    channels: int = _f(minimum=0)
    start_ns: int
    exec_ns: int = _f(minimum=0)
    timing: str = _f(enum=TIMINGS)
    algbw_gbs: float = _f(minimum=0)
    busbw_gbs: float = _f(minimum=0)
    graph: bool


@dataclass(frozen=True, slots=True)
class DropRecord:
    """How many ops a process could not record, and why."""

    KIND: ClassVar[str] = "drop"
    job: str
    host: str
    pid: int = _f(minimum=0)
    gpu: str
    rank: int
    ts_ns: int
    reason: str = _f(enum=DROP_REASONS)
    count: int = _f(minimum=1)
    total: int = _f(minimum=1)


@dataclass(frozen=True, slots=True)
class PluginStats:
    """The plugin's own counters, written at each segment start and at finalize."""

    KIND: ClassVar[str] = "plugin_stats"
    job: str
    host: str
    pid: int = _f(minimum=0)
    gpu: str
    ts_ns: int
    recorded: int = _f(minimum=0)
    dropped: dict
    segment: int = _f(minimum=0)


@dataclass(frozen=True, slots=True)
class ThroughputRecord:
    """The job's speed over one training step."""

    KIND: ClassVar[str] = "throughput"
    job: str
    host: str
    rank: int
    ts_ns: int
    step: int = _f(minimum=0)
    tflops_per_gpu: float = _f(minimum=0)
    tokens_per_s: float | None = _f(minimum=0)
    source: str = _f(enum=("api", "log", "fixture"))


@dataclass(frozen=True, slots=True)
class WindowSummary:
    """One key on one rank over a short window."""

    KIND: ClassVar[str] = "window"
    job: str
    host: str
    comm: str = _f(pattern="^0x[0-9a-f]{16}$")
    comm_name: str
    op: str
    size_bucket: str = _f(pattern="^[0-9]+(B|KiB|MiB|GiB|TiB|PiB)$")
    transport: str = _f(enum=TRANSPORTS)
    rank: int = _f(minimum=0)
    nranks: int = _f(minimum=1)
    start_ns: int
    end_ns: int
    count: int = _f(minimum=1)
    bytes: int = _f(minimum=0)
    exec_ns_min: int = _f(minimum=0)
    exec_ns_p50: int = _f(minimum=0)
    exec_ns_p95: int = _f(minimum=0)
    exec_ns_max: int = _f(minimum=0)
    busbw_gbs_p50: float = _f(minimum=0)
    first_seq: int = _f(minimum=0)
    last_seq: int = _f(minimum=0)


@dataclass(frozen=True, slots=True)
class AnomalyEvent:
    """A detector's finding, firing or resolved."""

    KIND: ClassVar[str] = "anomaly"
    id: str
    type: str = _f(enum=ANOMALY_TYPES)
    state: str = _f(enum=("firing", "resolved"))
    job: str
    key: dict
    host: str | None
    rank: int | None
    start_ns: int
    end_ns: int | None
    detected_ns: int
    baseline_busbw_gbs: float | None
    observed_busbw_gbs: float | None
    effect: float
    attribution: str = _f(enum=ATTRIBUTIONS)
    throughput_delta: float | None
    severity: str = _f(enum=SEVERITIES)
    evidence: dict


@dataclass(frozen=True, slots=True)
class Quarantined:
    """A line the forwarder could not accept, kept with the reason and where it came from."""

    KIND: ClassVar[str] = "quarantined"
    stage: str = _f(enum=("parse", "schema", "size"))
    reason: str = _f(enum=QUARANTINE_REASONS)
    detail: str
    source: str
    offset: int
    raw: str


Record = OpRecord | DropRecord | PluginStats | ThroughputRecord | WindowSummary | AnomalyEvent
RECORD_TYPES: dict[str, type] = {
    cls.KIND: cls
    for cls in (OpRecord, DropRecord, PluginStats, ThroughputRecord, WindowSummary, AnomalyEvent, Quarantined)
}


# --- field checks, compiled once per class -------------------------------------------

@dataclass(frozen=True, slots=True)
class _FieldCheck:
    name: str
    types: tuple[type, ...]
    nullable: bool
    enum: frozenset[str] | None
    minimum: int | None
    pattern: Any


def _compile(cls: type) -> tuple[frozenset[str], tuple[_FieldCheck, ...]]:
    import re

    hints = get_type_hints(cls)
    checks = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = getattr(hint, "__args__", None)
        nullable = args is not None and type(None) in args
        base = next(a for a in args if a is not type(None)) if nullable else hint
        types: tuple[type, ...] = (int, float) if base is float else (base,)
        pattern = f.metadata.get("pattern")
        checks.append(
            _FieldCheck(
                name=f.name,
                types=types,
                nullable=nullable,
                enum=frozenset(f.metadata["enum"]) if "enum" in f.metadata else None,
                minimum=f.metadata.get("minimum"),
                pattern=re.compile(pattern) if pattern else None,
            )
        )
    names = frozenset(["v", "kind", *(c.name for c in checks)])
    return names, tuple(checks)


_CHECKS = {kind: _compile(cls) for kind, cls in RECORD_TYPES.items()}


def from_json(obj: Any) -> Any:
    """Build a record from a decoded JSON object, or raise :class:`RecordError`.

    >>> try:
    ...     from_json({"v": 1, "kind": "throughput", "job": "j"})
    ... except RecordError as e:
    ...     print(e)
    schema: throughput record: missing field(s) host, rank, ...
    """
    if not isinstance(obj, dict):
        raise RecordError("schema", f"a record is a JSON object, got {type(obj).__name__}")
    v = obj.get("v")
    if v != VERSION:
        raise RecordError("unknown_version", f"contract version {v!r} (this reader knows {VERSION})")
    kind = obj.get("kind")
    cls = RECORD_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RecordError("unknown_kind", f"unknown record kind {kind!r}")
    names, checks = _CHECKS[kind]
    if obj.keys() != names:
        missing = [c.name for c in checks if c.name not in obj]
        extra = sorted(k for k in obj if k not in names)
        parts = []
        if missing:
            parts.append("missing field(s) " + ", ".join(missing))
        if extra:
            parts.append("unknown field(s) " + ", ".join(extra))
        raise RecordError("schema", f"{kind} record: " + "; ".join(parts))
    values = []
    for c in checks:
        value = obj[c.name]
        if value is None:
            if not c.nullable:
                raise RecordError("schema", f"{kind}.{c.name}: null not allowed")
            values.append(None)
            continue
        # bool is an int in Python but not in JSON Schema.
        if not isinstance(value, c.types) or (isinstance(value, bool) and bool not in c.types):
            want = " or ".join(t.__name__ for t in c.types)
            raise RecordError("schema", f"{kind}.{c.name}: expected {want}, got {type(value).__name__}")
        if c.enum is not None and value not in c.enum:
            raise RecordError("schema", f"{kind}.{c.name}: {value!r} is not one of {sorted(c.enum)}")
        if c.minimum is not None and value < c.minimum:
            raise RecordError("schema", f"{kind}.{c.name}: {value!r} is below {c.minimum}")
        if c.pattern is not None and not c.pattern.match(value):
            raise RecordError("schema", f"{kind}.{c.name}: {value!r} does not match {c.pattern.pattern}")
        values.append(value)
    return cls(*values)


def to_dict(record: Any) -> dict[str, Any]:
    """The record as a JSON-ready dict, ``v`` and ``kind`` first."""
    out: dict[str, Any] = {"v": VERSION, "kind": record.KIND}
    for f in dataclasses.fields(record):
        out[f.name] = getattr(record, f.name)
    return out


def to_json(record: Any) -> str:
    """One JSON line (without the newline); non-ASCII kept, everything else escaped by JSON."""
    return json.dumps(to_dict(record), ensure_ascii=False, separators=(",", ":"))


def parse_line(
    line: bytes | str, *, source: str = "", offset: int = 0
) -> Any:
    """Parse one JSON line into a record, or a :class:`Quarantined` saying why not.

    Never raises on bad input: garbage is data to be quarantined, not an error.

    >>> parse_line(b"\\xff\\xfe").reason
    'not_utf8'
    >>> parse_line("{not json").reason
    'not_json'
    """
    raw_len = len(line)
    if raw_len > MAX_LINE_BYTES:
        return _quarantine("size", "too_long", f"line of {raw_len} bytes > {MAX_LINE_BYTES}", line, source, offset)
    if isinstance(line, bytes):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            return _quarantine("parse", "not_utf8", str(e), line, source, offset)
    else:
        text = line
    try:
        obj = json.loads(text)
    except ValueError as e:
        return _quarantine("parse", "not_json", str(e), line, source, offset)
    try:
        return from_json(obj)
    except RecordError as e:
        return _quarantine("schema", e.reason, e.detail, line, source, offset)


def _quarantine(stage: str, reason: str, detail: str, line: bytes | str, source: str, offset: int) -> Quarantined:
    raw = line[:4096]
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    return Quarantined(stage=stage, reason=reason, detail=detail, source=source, offset=offset, raw=text)


# --- JSON Schema generation ----------------------------------------------------------

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", dict: "object"}


def json_schema(cls: type) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one record kind, derived from its dataclass."""
    names, checks = _CHECKS[cls.KIND]
    props: dict[str, Any] = {
        "v": {"const": VERSION},
        "kind": {"const": cls.KIND},
    }
    for c in checks:
        t = _JSON_TYPES[c.types[-1]]
        prop: dict[str, Any] = {"type": [t, "null"] if c.nullable else t}
        if c.enum is not None:
            prop["enum"] = sorted(c.enum) + ([None] if c.nullable else [])
        if c.minimum is not None:
            prop["minimum"] = c.minimum
        if c.pattern is not None:
            prop["pattern"] = c.pattern.pattern
        props[c.name] = prop
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://ncclwatch.dev/schemas/{cls.KIND}.v{VERSION}.schema.json",
        "title": f"ncclwatch {cls.KIND} record, contract version {VERSION}",
        "description": (cls.__doc__ or "").strip().splitlines()[0],
        "type": "object",
        "required": ["v", "kind", *(c.name for c in checks)],
        "additionalProperties": False,
        "properties": props,
    }


def schema_path(kind: str):
    from pathlib import Path

    return Path(__file__).parent / "schemas" / f"{kind}.v{VERSION}.schema.json"


def write_schemas() -> None:
    for kind, cls in RECORD_TYPES.items():
        schema_path(kind).write_text(json.dumps(json_schema(cls), indent=2) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-schemas"]:
        write_schemas()
    else:
        sys.exit("usage: python -m ncclwatch.records --write-schemas")
