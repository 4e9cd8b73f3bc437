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
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, get_type_hints

VERSION = 1
MAX_LINE_BYTES = 64 * 1024
# Records nest at most four levels (an anomaly's evidence holds lists of pairs); the
# bound is checked on the raw bytes *before* decoding, because Python's JSON decoder and
# msgspec both recurse, and a line of 20,000 '[' raises RecursionError inside them.
MAX_DEPTH = 16
# Every integer is a signed 64-bit integer, as the C plugin and the JVM read them.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# Times (``*_ns`` instants) lie in [1970-01-01, 2100-01-01): an op stamped near 2^63 ns
# would push its process's stream time past every later op and stop its windows.
TIME_MAX_NS = 4_102_444_800 * 10**9 - 1
# Durations (``exec_ns*``) are at most one day: start + duration stays a valid time.
DURATION_MAX_NS = 86_400 * 10**9

TRANSPORTS = ("single", "nvlink", "net", "mixed")
TIMINGS = ("kernel_gpu", "host", "inspector", "sampled_out")
UNKNOWN_GPU = "unknown"  # an op's gpu where none is known (a window's is "")
# Timings whose ops carry no duration (exec_ns 0, bandwidths 0): counted, never measured.
UNTIMED = frozenset(("host", "sampled_out"))
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
    "too_deep",
    "not_finite",
    "not_unicode",
    "out_of_range",
    "unknown_version",
    "unknown_kind",
    "schema",
    "wrong_job",
)


class RecordError(ValueError):
    """A record that breaks the contract; ``reason`` is one of QUARANTINE_REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _f(*, enum: tuple[str, ...] | None = None, minimum: int | None = None,
       maximum: int | None = None, pattern: str | None = None,
       keys: tuple[str, ...] | None = None, default: Any = dataclasses.MISSING):
    """Field constraints. ``keys`` makes a dict field a closed map: keys from that set,
    values integers >= 0 (counters). A ``default`` makes the field optional: a line
    without it is read with the default, so a field can be added within a contract
    version (readers of this version accept lines from writers before it)."""
    meta: dict[str, Any] = {}
    if enum is not None:
        meta["enum"] = enum
    if minimum is not None:
        meta["minimum"] = minimum
    if maximum is not None:
        meta["maximum"] = maximum
    if pattern is not None:
        meta["pattern"] = pattern
    if keys is not None:
        meta["keys"] = keys
    if default is not dataclasses.MISSING:
        return field(default=default, metadata=meta)
    return field(metadata=meta)


def _time():
    return _f(minimum=0, maximum=TIME_MAX_NS)


def _duration():
    return _f(minimum=0, maximum=DURATION_MAX_NS)


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
    start_ns: int = _time()
    exec_ns: int = _duration()
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
    ts_ns: int = _time()
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
    ts_ns: int = _time()
    recorded: int = _f(minimum=0)
    dropped: dict = _f(keys=DROP_REASONS)
    segment: int = _f(minimum=0)


@dataclass(frozen=True, slots=True)
class ProgressRecord:
    """One communicator of a process that is waiting: written by the plugin, at most once
    a ``NCCLWATCH_PROGRESS_MS``, for every communicator of a process one of whose
    communicators has had an op in flight that long without completing anything.

    Nothing is written while ops complete, so a healthy job writes none. A rank that
    writes none while its peers wait is stopped or busy elsewhere; one whose ``colls``
    is below theirs has not called the collective they wait in (collectives are issued
    in the same order on every rank of a communicator).
    """

    KIND: ClassVar[str] = "progress"
    job: str
    host: str
    pid: int = _f(minimum=0)
    gpu: str
    comm: str = _f(pattern="^0x[0-9a-f]{16}$")
    comm_name: str
    rank: int = _f(minimum=0)
    nranks: int = _f(minimum=1)
    ts_ns: int = _time()
    issued: int = _f(minimum=0)  # ops (collectives and P2P) this process started on it
    colls: int = _f(minimum=0)  # of which collectives
    done: int = _f(minimum=0)  # ops that completed (or were dropped)
    in_flight: int = _f(minimum=0)
    waiting_since_ns: int = _time()  # since when it has had work and finished none; 0: none in flight
    last_done_ns: int = _time()  # 0: none yet


@dataclass(frozen=True, slots=True)
class ThroughputRecord:
    """The job's speed over one training step."""

    KIND: ClassVar[str] = "throughput"
    job: str
    host: str
    rank: int
    ts_ns: int = _time()
    step: int = _f(minimum=0)
    tflops_per_gpu: float = _f(minimum=0)
    tokens_per_s: float | None = _f(minimum=0)
    source: str = _f(enum=("api", "log", "fixture"))


PAUSE_REASONS = ("checkpoint",)
PAUSE_STATES = ("begin", "end")


@dataclass(frozen=True, slots=True)
class PauseRecord:
    """The job stops training on purpose for a while (``begin``) or has stopped doing so
    (``end``); read from its training log (Megatron-LM's checkpoint save lines).

    While a rank writes a checkpoint the others wait for it in the save's collectives,
    and no step completes: a stall and a throughput drop by every other sign, but not
    NCCL's trouble. A step logged after a ``begin`` ends the pause as well (an ``end``
    line may be missing: an asynchronous save, an older log format).
    """

    KIND: ClassVar[str] = "pause"
    job: str
    host: str
    rank: int  # -1: the job (a log that speaks for it)
    ts_ns: int = _time()  # when the pause began (``begin``) or ended (``end``)
    state: str = _f(enum=PAUSE_STATES)
    reason: str = _f(enum=PAUSE_REASONS)
    step: int = _f(minimum=0)  # the iteration the job had completed


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
    start_ns: int = _time()
    end_ns: int = _time()
    count: int = _f(minimum=1)
    bytes: int = _f(minimum=0)
    exec_ns_min: int = _duration()
    exec_ns_p50: int = _duration()
    exec_ns_p95: int = _duration()
    exec_ns_max: int = _duration()
    busbw_gbs_p50: float = _f(minimum=0)
    first_seq: int = _f(minimum=0)
    last_seq: int = _f(minimum=0)
    # Optional (added within contract 1): the rank's GPU as the plugin saw it, "GPU-<uuid>"
    # (DCGM's UUID), or "" where unknown (Inspector input, older forwarders).
    gpu: str = _f(default="")
    # Optional (added within contract 1, 2026-11-27): the rank's process id as in its ops,
    # or 0 where unknown. With the host it tells one process from another where no GPU is
    # known (NCCL Inspector input), so that a straggler seen in several communicators is
    # matched to one process.
    pid: int = _f(minimum=0, default=0)


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
    start_ns: int = _time()
    end_ns: int | None = _time()
    detected_ns: int = _time()
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
    stage: str = _f(enum=("parse", "schema", "size", "origin"))
    reason: str = _f(enum=QUARANTINE_REASONS)
    detail: str
    source: str
    offset: int
    raw: str


Record = (OpRecord | DropRecord | PluginStats | ProgressRecord | ThroughputRecord | PauseRecord | WindowSummary
          | AnomalyEvent)
RECORD_TYPES: dict[str, type] = {
    cls.KIND: cls
    for cls in (OpRecord, DropRecord, PluginStats, ProgressRecord, ThroughputRecord, PauseRecord, WindowSummary,
                AnomalyEvent, Quarantined)
}


# --- field checks, compiled once per class -------------------------------------------

@dataclass(frozen=True, slots=True)
class _FieldCheck:
    name: str
    types: tuple[type, ...]
    nullable: bool
    enum: frozenset[str] | None
    minimum: int | None
    maximum: int | None
    pattern: Any
    keys: frozenset[str] | None
    default: Any  # dataclasses.MISSING: required


def _compile(cls: type) -> tuple[frozenset[str], tuple[_FieldCheck, ...]]:
    hints = get_type_hints(cls)
    checks = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = getattr(hint, "__args__", None)
        nullable = args is not None and type(None) in args
        base = next(a for a in args if a is not type(None)) if nullable else hint
        types: tuple[type, ...] = (int, float) if base is float else (base,)
        pattern = f.metadata.get("pattern")
        minimum, maximum = f.metadata.get("minimum"), f.metadata.get("maximum")
        if base is int:  # every integer is an int64
            minimum = INT64_MIN if minimum is None else minimum
            maximum = INT64_MAX if maximum is None else maximum
        checks.append(
            _FieldCheck(
                name=f.name,
                types=types,
                nullable=nullable,
                enum=frozenset(f.metadata["enum"]) if "enum" in f.metadata else None,
                minimum=minimum,
                maximum=maximum,
                pattern=re.compile(pattern) if pattern else None,
                keys=frozenset(f.metadata["keys"]) if "keys" in f.metadata else None,
                default=f.default,
            )
        )
    names = frozenset(["v", "kind", *(c.name for c in checks)])
    return names, tuple(checks)


_CHECKS = {kind: _compile(cls) for kind, cls in RECORD_TYPES.items()}


def from_json(obj: Any) -> Any:
    """Build a record from a decoded JSON object, or raise :class:`RecordError`.

    Checks the fields (types, enums, ranges, patterns, closed maps); strings and
    numbers nested in objects are checked by :func:`parse_line` (or :func:`check`).

    >>> try:
    ...     from_json({"v": 1, "kind": "throughput", "job": "j"})
    ... except RecordError as e:
    ...     print(e)
    schema: throughput record: missing field(s) host, rank, ...
    """
    if not isinstance(obj, dict):
        raise RecordError("schema", f"a record is a JSON object, got {type(obj).__name__}")
    v = obj.get("v")
    if type(v) is not int or v != VERSION:
        raise RecordError("unknown_version", f"contract version {v!r} (this reader knows {VERSION})")
    kind = obj.get("kind")
    cls = RECORD_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RecordError("unknown_kind", f"unknown record kind {kind!r}")
    names, checks = _CHECKS[kind]
    if obj.keys() != names and not _only_optional_missing(obj, names, checks):
        missing = [c.name for c in checks if c.name not in obj and c.default is dataclasses.MISSING]
        extra = sorted(k for k in obj if k not in names)
        parts = []
        if missing:
            parts.append("missing field(s) " + ", ".join(missing))
        if extra:
            parts.append("unknown field(s) " + ", ".join(extra))
        raise RecordError("schema", f"{kind} record: " + "; ".join(parts))
    values = []
    for c in checks:
        value = obj.get(c.name, c.default)
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
            # Below a documented minimum (a negative count) breaks the schema; outside
            # int64 or a time window is a range error of its own.
            reason = "out_of_range" if c.maximum not in (None, INT64_MAX) or value < INT64_MIN else "schema"
            raise RecordError(reason, f"{kind}.{c.name}: {value!r} is below {c.minimum}")
        if c.maximum is not None and value > c.maximum:
            raise RecordError("out_of_range", f"{kind}.{c.name}: {value!r} is above {c.maximum}")
        if type(value) is float and not math.isfinite(value):
            raise RecordError("not_finite", f"{kind}.{c.name}: {value!r} is not a finite number")
        if c.pattern is not None and not c.pattern.match(value):
            raise RecordError("schema", f"{kind}.{c.name}: {value!r} does not match {c.pattern.pattern}")
        if c.keys is not None:
            _check_counters(kind, c, value)
        values.append(value)
    return cls(*values)


def _only_optional_missing(obj: dict, names: frozenset[str], checks: tuple[_FieldCheck, ...]) -> bool:
    """The keys differ from the full set only by optional fields left out."""
    return obj.keys() <= names and all(
        c.name in obj or c.default is not dataclasses.MISSING for c in checks)


def _check_counters(kind: str, c: _FieldCheck, value: dict) -> None:
    """A closed map of counters: keys from the field's set, values int64 >= 0."""
    assert c.keys is not None
    for k, n in value.items():
        if k not in c.keys:
            raise RecordError("schema", f"{kind}.{c.name}: key {k!r} is not one of {sorted(c.keys)}")
        if not isinstance(n, int) or isinstance(n, bool):
            raise RecordError("schema", f"{kind}.{c.name}.{k}: expected int, got {type(n).__name__}")
        if not 0 <= n <= INT64_MAX:
            raise RecordError("out_of_range", f"{kind}.{c.name}.{k}: {n!r} is not in [0, 2^63)")


def check(record: Any) -> Any:
    """The record itself if it keeps the contract, else :class:`RecordError`.

    For records built in code from outside input (the Inspector mapping): the same
    checks :func:`parse_line` makes on a line, on the finished record.
    """
    obj = to_dict(record)
    _check_tree(obj, 0)
    from_json(obj)
    return record


def to_dict(record: Any) -> dict[str, Any]:
    """The record as a JSON-ready dict, ``v`` and ``kind`` first (of a record dataclass,
    or of anything with its kind's fields: the fast parser's structs)."""
    out: dict[str, Any] = {"v": VERSION, "kind": record.KIND}
    cls = record if dataclasses.is_dataclass(record) else RECORD_TYPES[record.KIND]
    for f in dataclasses.fields(cls):
        out[f.name] = getattr(record, f.name)
    return out


def to_json(record: Any) -> str:
    """One JSON line (without the newline); non-ASCII kept, everything else escaped by JSON."""
    return json.dumps(to_dict(record), ensure_ascii=False, separators=(",", ":"))


# --- reading lines: bounded before decoding, strict while decoding ---------------------

# A JSON string (escapes included): removed before counting brackets, so that brackets
# inside strings do not count. The two alternatives cannot overlap, so this is linear.
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nesting_depth(data: bytes) -> int:
    """How deeply the arrays and objects of a JSON text nest, without decoding it.

    >>> nesting_depth(b'{"a":[1,{"b":"[[[["}]}'), nesting_depth(b"[" * 20000)
    (3, 20000)
    """
    if data.count(b"[") + data.count(b"{") <= 1:
        return 1 if b"[" in data or b"{" in data else 0
    depth = deepest = 0
    for c in _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS):
        if c in b"[{":
            depth += 1
            if depth > deepest:
                deepest = depth
        else:
            depth -= 1
    return deepest


def _reject_constant(name: str) -> Any:
    raise RecordError("not_finite", f"{name} is not JSON (strict JSON has no NaN or Infinity)")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise RecordError("not_finite", f"{text[:40]} overflows a double")
    return value


def _parse_int(text: str) -> int:
    # 20 characters hold every int64 (and a sign); longer is out of range, and checking
    # the length first keeps a 5,000-digit number from costing a big-integer conversion.
    value = int(text) if len(text) <= 20 else INT64_MAX + 1
    if not INT64_MIN <= value <= INT64_MAX:
        raise RecordError("out_of_range", f"integer {text[:40]} does not fit in 64 bits")
    return value


_decode_strict = json.JSONDecoder(
    parse_float=_parse_float, parse_int=_parse_int, parse_constant=_reject_constant
).decode


def _check_tree(obj: Any, depth: int) -> None:
    """Every string (keys too) a sequence of Unicode scalar values, every float finite.

    JSON text can escape a lone surrogate (``"\\udcff"``): valid JSON, but not Unicode,
    so it cannot be encoded as UTF-8 again, and every later ``.encode()`` (Kafka keys,
    Prometheus labels, files) would raise on it.
    """
    if depth > MAX_DEPTH:
        raise RecordError("too_deep", f"nested deeper than {MAX_DEPTH}")
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            raise RecordError("not_unicode", f"string {ascii(obj[:60])} holds a lone surrogate") from None
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _check_tree(k, depth + 1)
            _check_tree(v, depth + 1)
    elif isinstance(obj, list):
        for v in obj:
            _check_tree(v, depth + 1)
    elif isinstance(obj, float) and not math.isfinite(obj):
        raise RecordError("not_finite", f"{obj!r} is not a finite number")


def parse_line(
    line: bytes | str, *, source: str = "", offset: int = 0
) -> Any:
    """Parse one JSON line into a record, or a :class:`Quarantined` saying why not.

    Never raises on bad input: garbage is data to be quarantined, not an error. Before
    decoding, the line's size and nesting depth are bounded; decoding is strict JSON
    (no NaN, no Infinity, no number that overflows); every string must be Unicode
    scalar values and every integer an int64; then the fields are checked.

    >>> parse_line(b"\\xff\\xfe").reason
    'not_utf8'
    >>> parse_line("{not json").reason
    'not_json'
    >>> parse_line(b"[" * 20000).reason
    'too_deep'
    >>> parse_line(b'{"v": 1, "kind": NaN}').reason
    'not_finite'
    """
    raw_len = len(line)
    if raw_len > MAX_LINE_BYTES:
        return _quarantine("size", "too_long", f"line of {raw_len} bytes > {MAX_LINE_BYTES}", line, source, offset)
    if isinstance(line, str):
        try:
            data = line.encode("utf-8")
        except UnicodeEncodeError as e:
            return _quarantine("parse", "not_unicode", str(e), line, source, offset)
        if len(data) > MAX_LINE_BYTES:
            return _quarantine("size", "too_long", f"line of {len(data)} bytes > {MAX_LINE_BYTES}", line, source,
                               offset)
        text = line
    else:
        data = bytes(line)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            return _quarantine("parse", "not_utf8", str(e), line, source, offset)
    depth = nesting_depth(data)
    if depth > MAX_DEPTH:
        return _quarantine("size", "too_deep", f"nested {depth} deep > {MAX_DEPTH}", line, source, offset)
    try:
        obj = _decode_strict(text)
        # Only an escape can make a lone surrogate (the text itself was UTF-8), and
        # non-finite floats only come from the hooks above: walk the tree only then.
        if b"\\u" in data:
            _check_tree(obj, 0)
        return from_json(obj)
    except RecordError as e:
        stage = "schema" if e.reason in ("schema", "out_of_range", "unknown_version", "unknown_kind") else "parse"
        return _quarantine(stage, e.reason, e.detail, line, source, offset)
    except ValueError as e:  # JSONDecodeError, and int() past Python's digit limit
        return _quarantine("parse", "not_json", str(e), line, source, offset)


def _clean(text: str) -> str:
    """``text`` as valid Unicode (lone surrogates replaced), safe to encode anywhere."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def _quarantine(stage: str, reason: str, detail: str, line: bytes | str, source: str, offset: int) -> Quarantined:
    raw = line[:4096]
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes | bytearray | memoryview) else _clean(raw)
    return Quarantined(stage=stage, reason=reason, detail=_clean(detail), source=_clean(source), offset=offset,
                       raw=text)


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
        if c.maximum is not None:
            prop["maximum"] = c.maximum
        if c.pattern is not None:
            prop["pattern"] = c.pattern.pattern
        if c.keys is not None:
            prop["propertyNames"] = {"enum": sorted(c.keys)}
            prop["additionalProperties"] = {"type": "integer", "minimum": 0, "maximum": INT64_MAX}
        if c.default is not dataclasses.MISSING:
            prop["default"] = c.default  # optional: absent on lines of older writers
        props[c.name] = prop
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://ncclwatch.dev/schemas/{cls.KIND}.v{VERSION}.schema.json",
        "title": f"ncclwatch {cls.KIND} record, contract version {VERSION}",
        "description": (cls.__doc__ or "").strip().splitlines()[0],
        "type": "object",
        "required": ["v", "kind", *(c.name for c in checks if c.default is dataclasses.MISSING)],
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
