"""The detector library's two stages run apart, in one process, the way a topology keyed
per communicator would spread them: tests and benches use it, the product does not.

Each communicator's windows go to one of ``shards`` key stages
(:class:`~ncclwatch.detectors.keys.KeyStage`), chosen by a stable hash of its id; the
job stage (:class:`~ncclwatch.detectors.pipeline.Pipeline` fed verdicts) reads every
shard's verdicts with the job's throughput and telemetry records in one canonical order:
by time (a verdict's window end, a record's timestamp), records before verdicts at the
same time, verdicts of one time by window start, job and key. That order does not depend
on how the communicators were spread, so neither do the events.

This is an offline merge of finished shards; the streaming one, driven by each key
stage's progress marks, is :class:`~ncclwatch.detectors.keys.VerdictMerge`.

>>> from ncclwatch_testkit import scenarios
>>> from ncclwatch.config import DetectorConfig
>>> records, _ = scenarios.generate(scenarios.by_name("network_step20_2x8"))
>>> one = run_two_stages(records, 1, DetectorConfig())
>>> [(e.type, e.state) for e in one]
[('network_path', 'firing'), ('network_path', 'resolved')]
>>> run_two_stages(records, 3, DetectorConfig()) == one
True
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from ncclwatch.detectors.keys import KeyStage, KeyVerdict
from ncclwatch.detectors.pipeline import detect_all

from ncclwatch.records import AnomalyEvent, WindowSummary


def shard_of(comm: str, shards: int) -> int:
    """The key stage a communicator's windows go to."""
    return zlib.crc32(comm.encode()) % shards


def key_stage(windows: Iterable[WindowSummary], cfg: Any, *, model: Any = None) -> list[KeyVerdict]:
    """One key stage over its windows, to the end (its open groups closed)."""
    stage = KeyStage(cfg, model=model)
    out: list[KeyVerdict] = []
    for w in windows:
        out += stage.process(w)
    out += stage.flush()
    return out


def job_stage_input(verdicts: Iterable[KeyVerdict], records: Iterable[Any]) -> list[Any]:
    """Verdicts and the job stage's other records (throughput, drops, plugin stats) in
    the canonical order; records of one time keep their given order."""
    keyed: list[tuple[tuple, Any]] = [
        ((getattr(r, "ts_ns", 0), 0, i), r) for i, r in enumerate(records)
    ]
    keyed += [((v.end_ns, 1, v.start_ns, v.job, v.key), v) for v in verdicts]
    keyed.sort(key=lambda kv: kv[0])
    return [r for _, r in keyed]


def job_stage(inputs: Sequence[Any], cfg: Any, *, model: Any = None) -> list[AnomalyEvent]:
    """The job stage over its inputs (``job_stage_input``), to the end."""
    return detect_all(inputs, cfg, model=model)


def split(records: Iterable[Any], shards: int) -> tuple[list[list[WindowSummary]], list[Any]]:
    """Windows per shard, in their given order, and the records the job stage reads."""
    parts: list[list[WindowSummary]] = [[] for _ in range(shards)]
    other: list[Any] = []
    for r in records:
        if r.KIND == WindowSummary.KIND:
            parts[shard_of(r.comm, shards)].append(r)
        elif r.KIND != "op":
            other.append(r)
    return parts, other


def run_two_stages(records: Iterable[Any], shards: int, cfg: Any, *, model: Any = None) -> list[AnomalyEvent]:
    """Every record through ``shards`` key stages and one job stage."""
    parts, other = split(records, shards)
    verdicts = [v for part in parts for v in key_stage(part, cfg, model=model)]
    return job_stage(job_stage_input(verdicts, other), cfg, model=model)
