"""Transform: one raw line -> a validated record or a ``Quarantined`` saying why not.

``records.parse_line`` is the authority on what the contract accepts; it costs ~18 µs a
line. The forwarder's hot path first tries a C decoder (msgspec) built *from the record
dataclasses themselves* (types, enums, minimums; patterns are checked here with the same
regular expressions), which validates a good line in ~2 µs. Anything it does not accept
goes to ``records.parse_line``, which decides: so the set of accepted lines and the
quarantine reasons are exactly the contract's, and the fast path only changes speed.

Fast results are msgspec structs with the same attribute names as the dataclasses (and a
``KIND``), so code that reads attributes (the Windower, routing) takes either.

>>> r = parse(b'{"v":1,"kind":"throughput","job":"j","host":"h","rank":0,"ts_ns":1,'
...           b'"step":3,"tflops_per_gpu":310.2,"tokens_per_s":null,"source":"api"}')
>>> r.KIND, r.step, r.tflops_per_gpu
('throughput', 3, 310.2)
>>> parse(b'{"v":1,"kind":"op"}', source="s", offset=7).reason
'schema'
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, Literal, Union, get_type_hints

import msgspec

from ncclwatch import records
from ncclwatch.records import Quarantined

# The kinds the spool carries, plus those a file replayed into the forwarder may hold.
FAST_KINDS = ("op", "drop", "plugin_stats", "progress", "throughput", "pause", "window")
# Below 2^53 every integer is exactly a float: an integer literal in a float field then
# decodes to the same number the contract parser keeps; larger ones go to that parser.
_FLOAT_EXACT = float(1 << 53)


def _struct_for(cls: type, only: tuple[str, ...] = ()) -> tuple[type, tuple[tuple[str, Any], ...]]:
    """A msgspec Struct mirroring a record dataclass (or ``only`` those of its fields,
    other fields then ignored), and its pattern checks.

    The struct may reject more than the contract (the line then goes to the contract
    parser, which decides) but never less: integers carry the contract's int64, time
    and duration bounds; floats are bounded by 2^53, because the contract reads every
    integer literal of a line as an int64 and msgspec turns one into a float, which is
    the same number only below 2^53; closed maps become ``dict[Literal[...], int]``. msgspec itself refuses
    NaN, Infinity, numbers that overflow and lone surrogate escapes.
    """
    hints = get_type_hints(cls)
    fields: list[tuple[Any, ...]] = [("v", Literal[records.VERSION])]  # type: ignore[valid-type]
    patterns = []
    for f in dataclasses.fields(cls):
        if only and f.name not in only:
            continue
        hint = hints[f.name]
        args = getattr(hint, "__args__", None)
        nullable = args is not None and type(None) in args
        base = next(a for a in args if a is not type(None)) if nullable else hint
        t: Any = base
        meta = f.metadata
        if "enum" in meta:
            t = Literal[tuple(meta["enum"])]  # type: ignore[valid-type]
        elif base is int:
            t = Annotated[int, msgspec.Meta(ge=meta.get("minimum", records.INT64_MIN),
                                            le=meta.get("maximum", records.INT64_MAX))]
        elif base is float:
            t = Annotated[float, msgspec.Meta(ge=meta.get("minimum", -_FLOAT_EXACT), lt=_FLOAT_EXACT)]
        elif "keys" in meta:
            t = dict[Literal[tuple(meta["keys"])],  # type: ignore[valid-type]
                     Annotated[int, msgspec.Meta(ge=0, le=records.INT64_MAX)]]
        if "pattern" in meta:
            patterns.append((f.name, re.compile(meta["pattern"]).match))
        if nullable:
            t = Union[t, None]  # noqa: UP007 - built at run time
        # An optional field (a default) may be absent, as in the contract parser.
        fields.append((f.name, t) if f.default is dataclasses.MISSING else (f.name, t, f.default))
    struct = msgspec.defstruct(
        f"{'Part' if only else 'Fast'}{cls.__name__}",
        fields,
        tag_field="kind",
        tag=cls.KIND,
        forbid_unknown_fields=not only,
        frozen=True,
        # Records hold only scalars (and a flat dict): they cannot form reference cycles,
        # so keeping them out of the cycle collector saves its work on every batch.
        gc=False,
    )
    struct.KIND = cls.KIND  # type: ignore[attr-defined]
    return struct, tuple(patterns)


_STRUCTS: dict[type, tuple[tuple[str, Any], ...]] = {}
for _kind in FAST_KINDS:
    _s, _p = _struct_for(records.RECORD_TYPES[_kind])
    _STRUCTS[_s] = _p
_decode = msgspec.json.Decoder(Union[tuple(_STRUCTS)]).decode  # type: ignore[misc]  # noqa: UP007
_PATTERNS = {s: p for s, p in _STRUCTS.items()}
FAST_TYPES: dict[str, type] = {s.KIND: s for s in _STRUCTS}  # kind -> its struct
FastOpRecord = FAST_TYPES["op"]
_op_patterns = dict(_PATTERNS[FastOpRecord])
assert set(_op_patterns) == {"id", "comm"}, "the op fast path checks exactly these patterns"
_HEX = "0123456789abcdef"
assert _op_patterns["id"].__self__.pattern == "^[0-9a-f]{16}$", "update the id fast check"
_comm_match = _op_patterns["comm"]

# Communicator hashes and size buckets repeat on every line: remember the values already
# checked (ids are unique per line: not worth it).
_good_comms: set[str] = set()
_GOOD_MAX = 65536
_good_values: dict[str, set[str]] = {"comm": _good_comms, "size_bucket": set()}


def parse(raw: bytes, source: str = "", offset: int = 0) -> Any:
    """Parse and validate one line; never raises on bad input."""
    if len(raw) > records.MAX_LINE_BYTES:
        return records.parse_line(raw, source=source, offset=offset)
    try:
        rec = _decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return records.parse_line(raw, source=source, offset=offset)
    if type(rec) is FastOpRecord:  # the hot path: one pattern cached, one checked
        comm = rec.comm
        if comm not in _good_comms and not _matches(comm, _comm_match, _good_comms):
            return records.parse_line(raw, source=source, offset=offset)
        rid = rec.id
        # Same as the id pattern (16 lowercase hex digits) at a quarter of a regex's cost;
        # anything else is left to the contract parser.
        if len(rid) != 16 or rid.strip(_HEX):
            return records.parse_line(raw, source=source, offset=offset)
        return rec
    for name, match in _PATTERNS[type(rec)]:
        value = getattr(rec, name)
        good = _good_values.get(name)
        if good is None:
            if not match(value):
                return records.parse_line(raw, source=source, offset=offset)
        elif value not in good and not _matches(value, match, good):
            return records.parse_line(raw, source=source, offset=offset)
    return rec


# What a first look at an op line needs: its version, job and stream time, decoded at
# ~40 % of the whole line's cost (the other fields are skipped, not built).
OpTime, _ = _struct_for(records.OpRecord, only=("job", "start_ns", "exec_ns"))
_op_time_decode = msgspec.json.Decoder(OpTime).decode


def op_time(raw: bytes) -> Any:
    """The version, job and time fields of a line that holds them as an op record's are
    held, else None: a first look, not validation (:func:`parse` may still refuse the
    line). Its result has ``KIND`` "op", ``job``, ``start_ns`` and ``exec_ns``.

    >>> op = op_time(b'{"v":1,"kind":"op","job":"j","start_ns":5,"exec_ns":2,"comm":"?"}')
    >>> op.KIND, op.job, op.start_ns + op.exec_ns
    ('op', 'j', 7)
    >>> op_time(b'{"v":2,"kind":"op","job":"j","start_ns":5,"exec_ns":2}') is None
    True
    """
    if len(raw) > records.MAX_LINE_BYTES:
        return None
    try:
        return _op_time_decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return None


def _matches(value: str, match: Any, good: set[str]) -> bool:
    """Whether ``value`` matches its pattern; one that does is remembered in ``good``."""
    if not match(value):
        return False
    if len(good) >= _GOOD_MAX:
        good.clear()
    good.add(value)
    return True


def is_quarantined(rec: Any) -> bool:
    return type(rec) is Quarantined


def to_record(rec: Any) -> Any:
    """The dataclass record for a fast result (for callers that need the real type)."""
    if isinstance(rec, msgspec.Struct):
        # one C call for the values, in the dataclass's field order after "v"
        return records.RECORD_TYPES[rec.KIND](*_astuple(rec)[1:])
    return rec


_astuple = msgspec.structs.astuple
for _s in _STRUCTS:
    assert _s.__struct_fields__ == ("v", *(f.name for f in dataclasses.fields(records.RECORD_TYPES[_s.KIND]))), _s


def parse_record(raw: bytes, source: str = "", offset: int = 0) -> Any:
    """:func:`ncclwatch.records.parse_line`, at the fast path's speed: the same record
    dataclass (or ``Quarantined``) for every line. What every reader but the forwarder's
    hot path (which keeps the structs) uses: the worker, ``watch``, ``replay``, ``report``.

    >>> parse_record(b'{"v":1,"kind":"throughput","job":"j","host":"h","rank":0,"ts_ns":1,'
    ...              b'"step":3,"tflops_per_gpu":310.2,"tokens_per_s":null,"source":"api"}')
    ThroughputRecord(job='j', host='h', rank=0, ts_ns=1, step=3, tflops_per_gpu=310.2, tokens_per_s=None, source='api')
    """
    return to_record(parse(raw, source, offset))

