"""Kafka messages as the worker and ``replay`` see them: one record per line, each line
decoded against the record contract and its topic's own (which kinds, which key), or
dead-lettered with the reason."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ncclwatch.detectors.keys import KeyVerdict, VerdictMark, decode_stage_line
from ncclwatch.ingest.parse import parse

from ncclwatch.records import (
    DropRecord,
    PauseRecord,
    PluginStats,
    ProgressRecord,
    Quarantined,
    ThroughputRecord,
    WindowSummary,
)

log = logging.getLogger(__name__)



# Which record kinds each input may carry; anything else breaks the contract of the topic.
DETECTOR_KINDS = (WindowSummary, ThroughputRecord, PauseRecord, DropRecord, PluginStats, ProgressRecord)
JOB_KINDS = (ThroughputRecord, PauseRecord)  # the job topic: its steps and its pauses
TELEMETRY_KINDS = (DropRecord, PluginStats, ProgressRecord)
STAGE_KINDS = (KeyVerdict, VerdictMark)  # the verdicts topic, between the two stages


@dataclass(frozen=True, slots=True)
class Message:
    """A Kafka message as the core sees it, whatever client delivered it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int | None = None


def message_lines(value: bytes) -> list[bytes]:
    """The records of one message: one JSON line, or several (JSON Lines).

    The forwarder packs many op records into one message (``--ops-per-message``) and a
    producer may pack windows the same way, which is what makes Kafka and Faust cheap
    per record; every input of the worker and of replay accepts both.

    >>> message_lines(b'{"a":1}'), message_lines(b'{"a":1}\\n{"b":2}\\n')
    ([b'{"a":1}'], [b'{"a":1}', b'{"b":2}'])
    """
    if b"\n" not in value:
        return [value]
    return [line for line in value.split(b"\n") if line]


def dead_letter(msg: Message, stage: str, reason: str, detail: str, raw_line: bytes | None = None) -> Quarantined:
    """A message (or one line of it) that cannot be used, with why and where it came from."""
    raw = (msg.value if raw_line is None else raw_line) or b""
    raw = raw[:4096].decode("utf-8", errors="replace")
    return Quarantined(
        stage=stage,
        reason=reason,
        detail=detail,
        source=f"kafka:{msg.topic}/{msg.partition}",
        offset=msg.offset,
        raw=raw,
    )


def decode_message(
    msg: Message, allowed: tuple[type, ...], *, line: bytes | None = None, key_of: Any = None
) -> Any:
    """The message's record (or that of ``line`` of it), or a :class:`Quarantined` saying
    why it is not usable here: :func:`decode_records` for one line.

    >>> line = (b'{"v":1,"kind":"throughput","job":"j","host":"h","rank":0,"ts_ns":1,"step":3,'
    ...         b'"tflops_per_gpu":310.2,"tokens_per_s":null,"source":"api"}')
    >>> decode_message(Message("job.throughput", 0, 7, b"j", line), DETECTOR_KINDS).step
    3
    >>> decode_message(Message("nccl.windows", 0, 7, b"j", line), (WindowSummary,)).detail
    'a throughput record does not belong on nccl.windows (window)'
    >>> decode_message(Message("job.throughput", 0, 7, b"k", line), DETECTOR_KINDS).reason
    'schema'
    """
    raw = msg.value if line is None else line
    return decode_records(msg, allowed, key_of=key_of, lines=None if raw is None else [raw])[0]


_KIND_SETS: dict[tuple[type, ...], frozenset[str]] = {}


def message_key(msg: Message) -> str | None:
    """The message's key as a string, to compare with a record's key: valid UTF-8
    exactly when it can equal one (invalid bytes become lone surrogates).

    >>> message_key(Message("t", 0, 0, b"j|0x1", None)), message_key(Message("t", 0, 0, None, None))
    ('j|0x1', None)
    """
    return None if msg.key is None else msg.key.decode("utf-8", "surrogateescape")


def decode_records(
    msg: Message, allowed: tuple[type, ...], *, key_of: Any = None, lines: list[bytes] | None = None
) -> list[Any]:
    """Each line's record, or a :class:`Quarantined` saying why that line is not usable
    here (a message without a value: one, for the tombstone). ``lines``: the message's
    lines, if not :func:`message_lines` of its value.

    Besides the record contract, a topic has its own: only some kinds belong on it, and
    its key is the record's job, which is what puts a whole job on one partition (a
    record on the wrong partition would split the job's state across workers).

    A good line comes back as the fast parser's struct (``ingest.parse``: the record
    dataclass's fields, validated alike), which the detectors take as they take the
    dataclass; building the frozen dataclass would cost twice the parse. On the verdicts
    topic (``allowed`` is ``STAGE_KINDS``) lines are verdicts and marks.

    ``key_of(record)`` is the key the record's message must have (default: its job;
    the key stage's windows: ``<job>|<comm>``). One pass over the message: this runs
    once per record of every input, the worker's hottest loop.
    """
    if lines is None:
        if msg.value is None:
            return [dead_letter(msg, "parse", "not_json", "message without a value (tombstone)")]
        lines = message_lines(msg.value)
    if allowed is STAGE_KINDS:
        recs = []
        for raw in lines:
            try:
                recs.append(decode_stage_line(raw))
            except ValueError as e:
                recs.append(dead_letter(msg, "parse", "schema", str(e), raw))
    else:
        source, offset = f"kafka:{msg.topic}/{msg.partition}", msg.offset
        recs = [parse(raw, source, offset) for raw in lines]
    kinds = _KIND_SETS.get(allowed)
    if kinds is None:
        kinds = _KIND_SETS[allowed] = frozenset(c.KIND for c in allowed)
    key, skey = msg.key, message_key(msg)
    for i, rec in enumerate(recs):
        if type(rec) is Quarantined:
            continue
        if rec.KIND not in kinds:
            names = ", ".join(sorted(kinds))
            detail = f"a {rec.KIND} record does not belong on {msg.topic} ({names})"
            recs[i] = dead_letter(msg, "schema", "schema", detail, lines[i])
        elif skey is not None:
            want = rec.job if key_of is None else key_of(rec)
            if want != skey:
                recs[i] = dead_letter(
                    msg,
                    "schema",
                    "schema",
                    f"message key {key[:200]!r} is not the record's {'job' if key_of is None else 'key'} "
                    f"{want!r}: its state would be split across partitions",
                    lines[i],
                )
    return recs
