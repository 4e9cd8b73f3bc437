"""Where a record is published: its topic and its message key, by kind.

The forwarder publishes through these, ``ncclwatch replay --to-kafka`` republishes a
recording through them, and the worker's partitioning depends on them (docs/ingest.md,
"Topics and keys"), so they live here, below every component.

- ops on ``topics.ops``, keyed ``<job>|<comm>``: one communicator's ops stay in order in
  one partition (and pack into one message);
- windows, throughput (and the job's pauses), drops, plugin stats and progress (``topics.telemetry``) and anomalies on
  their own topics, keyed by the job: everything the worker reads lands in the job's
  partition, with no re-keying hop (topic contract v2; v1 put drops and plugin stats on
  ``topics.ops``, keyed ``<job>|<host>``);
- except windows when ``topics.window_key`` is ``"comm"`` (topic contract v3, the
  two-stage topology): keyed ``<job>|<comm>`` like ops, so a job's communicators spread
  over the partitions and the key-stage workers; the key stage's verdicts and progress
  marks then go on ``topics.verdicts``, keyed by job.

>>> from ncclwatch.config import TopicsConfig
>>> from ncclwatch.records import ThroughputRecord
>>> r = ThroughputRecord(job="llm", host="n1", rank=-1, ts_ns=1, step=1, tflops_per_gpu=300.0,
...                      tokens_per_s=None, source="api")
>>> topic_for(TopicsConfig(prefix="t1."), r.KIND), key_for(r)
('t1.job.throughput', b'llm')
>>> op_group("llm", "0x00000000000000ab")
'llm|0x00000000000000ab'
"""

from __future__ import annotations

from typing import Any

from ncclwatch.config import TopicsConfig


def topic_for(topics: TopicsConfig, kind: str) -> str:
    """The topic records of ``kind`` are published to (quarantined lines: the quarantine)."""
    if kind == "window":
        return topics.windows
    if kind in ("throughput", "pause"):
        return topics.throughput
    if kind == "anomaly":
        return topics.anomalies
    if kind == "quarantined":
        return topics.quarantine
    if kind in ("drop", "plugin_stats", "progress"):
        return topics.telemetry
    return topics.ops


def op_group(job: str, comm: str) -> str:
    """The key of an op's message, as text: ops of one group pack into one message."""
    return f"{job}|{comm}"


def key_for(record: Any, topics: TopicsConfig | None = None) -> bytes:
    """The message key of a record (not of a quarantined line: its key is its source).

    Windows are keyed ``<job>|<comm>`` when ``topics.window_key`` is ``"comm"`` (the
    two-stage topology spreads a job's communicators over the partitions), else by job.

    >>> from ncclwatch.config import TopicsConfig
    >>> class W: KIND, job, comm = "window", "llm", "0xab"
    >>> key_for(W()), key_for(W(), TopicsConfig(window_key="comm"))
    (b'llm', b'llm|0xab')
    """
    kind = record.KIND
    if kind == "op" or (kind == "window" and topics is not None and topics.window_key == "comm"):
        return op_group(record.job, record.comm).encode()
    return record.job.encode()
