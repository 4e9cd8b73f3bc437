"""What ``ncclwatch report`` knows about a recorded run, and the numbers drawn from it.

:mod:`ncclwatch.dashboards.report` reads a recording into a :class:`Run`;
:mod:`ncclwatch.dashboards.plots` draws it. Both import this module and not each other.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from ncclwatch.detectors.straggler import relative_exec

from ncclwatch.records import AnomalyEvent, ThroughputRecord, WindowSummary
from ncclwatch.rules import NETWORK_TRANSPORTS, size_bucket_bytes

Key = tuple[str, str, str, str, str]  # (job, comm, op, size_bucket, transport)


# ----------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class Interval:
    """An anomaly (or an injected fault) over ``[start_ns, end_ns]``."""

    kind: str
    start_ns: int
    end_ns: int
    job: str
    key: dict = field(default_factory=dict)  # comm/op/size_bucket/transport, None = any
    event: AnomalyEvent | None = None  # the last event of the anomaly (resolved, if it was)
    detected_ns: int | None = None  # when the detector first said so
    open: bool = False  # still firing when the recording ended

    def covers(self, key: Key) -> bool:
        job, comm, op, bucket, transport = key
        want = {"comm": comm, "op": op, "size_bucket": bucket, "transport": transport}
        return self.job == job and all(self.key.get(k) in (None, v) for k, v in want.items())


@dataclass
class Run:
    name: str
    source: str
    t0_ns: int = 0
    t1_ns: int = 0
    kinds: Counter = field(default_factory=Counter)
    quarantined: int = 0
    late_ops: int = 0
    # key -> window start -> rank -> window summary
    windows: dict[Key, dict[int, dict[int, WindowSummary]]] = field(default_factory=dict)
    throughput: dict[str, list[ThroughputRecord]] = field(default_factory=dict)
    drops: dict[str, Counter] = field(default_factory=dict)  # job -> reason -> ops dropped
    events: list[AnomalyEvent] = field(default_factory=list)
    events_source: str = ""
    labels: list[dict] = field(default_factory=list)
    # key -> [(window end, baseline busbw)] as the detector judged each window (empty with
    # --events); below baseline × (1 - threshold) a window counts as degraded
    baselines: dict[Key, list[tuple[int, float]]] = field(default_factory=dict)
    threshold: float | None = None
    notes: list[str] = field(default_factory=list)  # what reading the recording met

    @property
    def jobs(self) -> list[str]:
        jobs = {k[0] for k in self.windows} | set(self.throughput) | {e.job for e in self.events}
        return sorted(jobs)

    def keys(self, job: str) -> list[Key]:
        return sorted(k for k in self.windows if k[0] == job)

    def intervals(self, job: str) -> list[Interval]:
        return [i for i in anomaly_intervals(self.events, self.t1_ns) if i.job == job]

    def fault_intervals(self, job: str) -> list[Interval]:
        out = []
        for f in self.labels:
            if f.get("job") not in (None, job):
                continue
            out.append(Interval(f.get("type", "fault"), int(f["start_ns"]), int(f["end_ns"]), job))
        return out


def anomaly_intervals(events: list[AnomalyEvent], end_ns: int) -> list[Interval]:
    """Pair firing and resolved events by id; an anomaly still firing runs to ``end_ns``."""
    firing: dict[str, AnomalyEvent] = {}
    out = []
    for ev in sorted(events, key=lambda e: e.detected_ns):
        if ev.state == "firing":
            firing.setdefault(ev.id, ev)
            continue
        first = firing.pop(ev.id, ev)
        end = ev.end_ns if ev.end_ns is not None else ev.detected_ns
        out.append(Interval(ev.type, first.start_ns, end, ev.job, ev.key or {}, ev, first.detected_ns))
    for ev in firing.values():
        out.append(Interval(ev.type, ev.start_ns, end_ns, ev.job, ev.key or {}, ev, ev.detected_ns, open=True))
    return sorted(out, key=lambda i: (i.start_ns, i.kind))


# ----------------------------------------------------------------------------- numbers


def key_series(run: Run, key: Key) -> list[tuple[int, float, float, float]]:
    """(window start, median, min, max) over the ranks of the key's per-window busbw."""
    out = []
    for start, ranks in sorted(run.windows[key].items()):
        values = sorted(w.busbw_gbs_p50 for w in ranks.values())
        out.append((start, statistics.median(values), values[0], values[-1]))
    return out


def key_weight(run: Run, key: Key) -> int:
    """Bytes the key moved: plots and tables show the keys that matter to the job first."""
    return sum(w.bytes for ranks in run.windows[key].values() for w in ranks.values())


def top_keys(run: Run, job: str, n: int) -> list[Key]:
    keys = sorted(run.keys(job), key=lambda k: -key_weight(run, k))[:n]
    # then by transport class, op and size, so related keys sit next to each other
    return sorted(keys, key=lambda k: (k[4] not in NETWORK_TRANSPORTS, k[2], size_bucket_bytes(k[3]), k[1]))


def rank_matrix(run: Run, job: str, comm: str) -> tuple[list[int], list[int], list[list[float]]]:
    """Per-rank exec time over the other ranks' median, per window, for the comm's busiest key.

    The quantity behind ``ncclwatch_rank_relative_exec_ratio``. The rank the others wait for
    arrives late and spends the least time in the kernel: a straggler stays below 1.
    """
    keys = [k for k in run.keys(job) if k[1] == comm]
    key = max(keys, key=lambda k: key_weight(run, k))
    starts = sorted(run.windows[key])
    ranks = sorted({r for s in starts for r in run.windows[key][s]})
    matrix = [[float("nan")] * len(starts) for _ in ranks]
    for j, s in enumerate(starts):
        rel = relative_exec({r: w.exec_ns_p50 for r, w in run.windows[key][s].items()})
        for i, r in enumerate(ranks):
            if r in rel:
                matrix[i][j] = rel[r]
    return ranks, starts, matrix


def comms_by_size(run: Run, job: str) -> list[str]:
    """Multi-rank communicators, most ranks first."""
    nranks: dict[str, int] = defaultdict(int)
    for k in run.keys(job):
        for ranks in run.windows[k].values():
            nranks[k[1]] = max(nranks[k[1]], len(ranks))
    return sorted((c for c, n in nranks.items() if n > 1), key=lambda c: (-nranks[c], c))


def comm_label(run: Run, job: str, comm: str) -> str:
    """``tp (nvlink, 2 ranks) 0x…00b0``: how a person recognises a communicator."""
    for key in run.keys(job):
        if key[1] == comm:
            w = next(iter(next(iter(run.windows[key].values())).values()))
            name = f"{w.comm_name} " if w.comm_name else ""
            return f"{name}({w.transport}, {w.nranks} ranks) {comm}"
    return comm


def throughput_in(run: Run, job: str, spans: list[Interval], inside: bool) -> float | None:
    values = [
        t.tflops_per_gpu
        for t in run.throughput.get(job, [])
        if any(i.start_ns <= t.ts_ns <= i.end_ns for i in spans) == inside
    ]
    return statistics.median(values) if values else None
