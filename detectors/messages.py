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
    PluginStats,
    Quarantined,
    ThroughputRecord,
    WindowSummary,
)

log = logging.getLogger(__name__)



# Which record kinds each input may carry; anything else breaks the contract of the topic.
DETECTOR_KINDS = (WindowSummary, ThroughputRecord, DropRecord, PluginStats)
TELEMETRY_KINDS = (DropRecord, PluginStats)
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
    why it is not usable here.

    Besides the record contract, a topic has its own: only some kinds belong on it, and
    its key is the record's job, which is what puts a whole job on one partition (a
    record on the wrong partition would split the job's state across workers).

    A good line comes back as the fast parser's struct (``ingest.parse``: the record
    dataclass's fields, validated alike), which the detectors take as they take the
    dataclass; building the frozen dataclass would cost twice the parse. On the verdicts
    topic (``allowed`` is ``STAGE_KINDS``) lines are verdicts and marks.

    ``key_of(record)`` is the key the record's message must have (default: its job;
    the key stage's windows: ``<job>|<comm>``).
    """
    raw = msg.value if line is None else line
    if raw is None:
        return dead_letter(msg, "parse", "not_json", "message without a value (tombstone)")
    if allowed is STAGE_KINDS:
        try:
            rec = decode_stage_line(raw)
        except ValueError as e:
            return dead_letter(msg, "parse", "schema", str(e), raw)
    else:
        rec = parse(raw, source=f"kafka:{msg.topic}/{msg.partition}", offset=msg.offset)
    if type(rec) is Quarantined:
        return rec
    if not any(rec.KIND == c.KIND for c in allowed):
        kinds = ", ".join(sorted(c.KIND for c in allowed))
        detail = f"a {rec.KIND} record does not belong on {msg.topic} ({kinds})"
        return dead_letter(msg, "schema", "schema", detail, raw)
    if msg.key is not None:
        want = rec.job if key_of is None else key_of(rec)
        if msg.key != want.encode("utf-8"):
            return dead_letter(
                msg,
                "schema",
                "schema",
                f"message key {msg.key[:200]!r} is not the record's {'job' if key_of is None else 'key'} {want!r}: "
                "its state would be split across partitions",
                raw,
            )
    return rec
