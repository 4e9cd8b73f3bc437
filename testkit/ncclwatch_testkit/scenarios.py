"""Labelled synthetic streams: window summaries and throughput with known faults.

A :class:`Scenario` is a job topology (nodes x GPUs per node), a duration and a list of
:class:`Fault` s; :func:`generate` turns it, deterministically from its seed, into the
records the forwarder would publish and the :class:`~ncclwatch.detectors.labels.LabelSet`
saying what a perfect detector would report. :func:`suite` is the standard set the tests and
``docs/evaluation.md`` use.

How the stream is simulated (per 1 s window, ``ops_per_s`` ops per key):

- communicators like a real 3-D-ish job: ``world`` (all ranks; ``nvlink`` on one node,
  ``net`` with one GPU per node, else ``mixed``), ``tp`` (the GPUs of one node, NVLink)
  and ``dp`` (one GPU per node, network), each with a couple of (op, size) keys;
- an op's true duration follows an alpha-beta model per transport
  (``alpha + bus_bytes / beta``), times lognormal per-op jitter (larger for latency-bound
  small ops) and a small per-window common factor; now and then one call is 10x slower
  (single slow calls);
- ranks *arrive* at each op with exponential jitter; every rank's kernel runs from its
  own arrival until the collective completes, so the last to arrive has the shortest
  kernel time. A straggler rank arrives late by ``m / (1 - m)`` op durations: the
  others' exec time grows by a factor ``1 / (1 - m)`` while the straggler's does not;
- network faults stretch ``net``/``mixed`` ops by ``1 / (1 - m)``; NVLink faults stretch
  ``nvlink`` ops of one node by that and ``mixed`` ops through the node by a third of it;
  spikes stretch whatever they name for at most two windows;
- job throughput: a step is 70 % compute and 30 % exposed communication, so comm faults
  cost TFLOP/s; compute faults cost TFLOP/s while NCCL is fine;
- telemetry faults: a node's windows vanish (silence) or drop records appear;
- each node's forwarder publishes a window ~1-2 s after it ends, so records of
  different nodes interleave as they would in Kafka.

``python -m ncclwatch_testkit.scenarios write DIR`` writes every suite scenario as
``DIR/<name>.records.jsonl`` (input for ``ncclwatch watch``/``replay``) and
``DIR/<name>.labels.json``.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from ncclwatch.detectors.labels import Label, LabelSet
from ncclwatch.detectors.model import bus_bytes

from ncclwatch.records import DropRecord, ThroughputRecord, WindowSummary, to_json
from ncclwatch.rules import comm_hex, fnv1a64, size_bucket, transport_class

STREAM_START_NS = 1_763_800_000 * 10**9  # a whole second, so windows align
# alpha (ns), beta (bus GB/s) per transport class: NVLink inside a node, a 400G-class
# NIC per GPU across nodes, and mixed rings that cross both.
LINKS = {"nvlink": (8_000.0, 350.0), "net": (25_000.0, 45.0), "mixed": (30_000.0, 40.0)}
COMM_FAULTS = ("network", "nvlink", "straggler")
FAULT_KINDS = (*COMM_FAULTS, "spike", "compute", "silence", "drops")
REQUIRED_EFFECT = 0.12  # comm faults below this on the key observation are optional labels
THRESHOLD = 0.10  # the detector threshold the labels' start times are computed for
THROUGHPUT_GATE = 0.05  # DetectorConfig.throughput_drop: the job loss a comm anomaly must cost


@dataclass(frozen=True)
class Fault:
    """One injected fault.

    ``magnitude`` is the busbw loss on the affected keys (comm faults, spikes) or the
    TFLOP/s loss (compute); ``ramp_s`` > 0 ramps it up linearly from ``start_s``.
    ``node`` is a node index (network: None = every node), ``rank`` a world rank.
    ``pulse_s`` = (on, off) switches it on and off from ``start_s`` (a flapping link).
    """

    kind: str
    start_s: float
    end_s: float
    magnitude: float = 0.0
    ramp_s: float = 0.0
    node: int | None = None
    rank: int | None = None
    transports: tuple[str, ...] = ()
    pulse_s: tuple[float, float] | None = None

    def __post_init__(self):
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}")
        if not 0 <= self.magnitude < 1:
            raise ValueError(f"magnitude must be in [0, 1), got {self.magnitude!r}")
        if self.end_s <= self.start_s:
            raise ValueError("a fault needs end_s > start_s")
        if self.pulse_s is not None and not min(self.pulse_s) > 0:
            raise ValueError(f"pulse_s needs on and off > 0 s, got {self.pulse_s!r}")

    def level(self, t_s: np.ndarray) -> np.ndarray:
        """The fault's magnitude at stream times ``t_s`` (seconds from the start)."""
        on = (t_s >= self.start_s) & (t_s < self.end_s)
        if self.pulse_s is not None:
            on &= (t_s - self.start_s) % sum(self.pulse_s) < self.pulse_s[0]
        if self.ramp_s > 0:
            ramp = np.clip((t_s - self.start_s) / self.ramp_s, 0.0, 1.0)
            return np.where(on, self.magnitude * ramp, 0.0)
        return np.where(on, self.magnitude, 0.0)


@dataclass(frozen=True)
class Scenario:
    name: str
    nodes: int
    gpus_per_node: int
    duration_s: int
    faults: tuple[Fault, ...] = ()
    seed: int = 0
    description: str = ""
    ops_per_s: int = 20
    op_sigma: float = 0.03  # per-op lognormal jitter of bandwidth-bound ops
    latency_sigma: float = 0.25  # extra jitter of latency-bound ops, times alpha / duration
    arrival_jitter: float = 0.03  # mean arrival spread, as a fraction of the op duration
    slow_call_p: float = 0.03  # chance per window and key of one 10x slower call
    tflops: float = 310.0
    exposed_comm: float = 0.3
    window_s: int = 1
    forwarder_delay_s: tuple[float, ...] = ()  # per node; default 1.0 + 0.35 x node

    @property
    def job(self) -> str:
        return f"sim-{self.name}"

    @property
    def nranks(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Comm:
    name: str
    hash: str
    transport: str
    ranks: list[int]  # world ranks; the index is the rank in this communicator
    keys: list[tuple[str, int]]  # (op, message bytes)
    nodes: set[int] = field(default_factory=set)


def host_name(node: int) -> str:
    return f"node{node}"


def communicators(sc: Scenario) -> list[Comm]:
    """The job's communicators, in a fixed order."""
    n, g = sc.nodes, sc.gpus_per_node

    def make(name: str, ranks: list[int], keys: list[tuple[str, int]]) -> Comm:
        nodes = {r // g for r in ranks}
        transport = transport_class(len(ranks), len(nodes))
        h = comm_hex(fnv1a64(f"{sc.job}/{name}".encode()))
        return Comm(name, h, transport, ranks, keys, nodes)

    world_keys = [("AllReduce", 64 << 20), ("AllReduce", 1 << 20)]
    tp_keys = [("AllGather", 16 << 20), ("ReduceScatter", 16 << 20)]
    dp_keys = [("AllReduce", 32 << 20)]
    comms = [make("world", list(range(n * g)), world_keys)]
    if n >= 2 and g >= 2:
        for node in range(n):
            comms.append(make(f"tp{node}", [node * g + i for i in range(g)], tp_keys))
        for i in range(g):
            comms.append(make(f"dp{i}", [node * g + i for node in range(n)], dp_keys))
    return comms


def _comm_slowdown(sc: Scenario, comm: Comm, t: np.ndarray) -> np.ndarray:
    """Multiplier on op durations from network, NVLink and spike faults."""
    slow = np.ones_like(t)
    for f in sc.faults:
        if f.kind == "network":
            if comm.transport in ("net", "mixed") and (f.node is None or f.node in comm.nodes):
                slow /= 1.0 - f.level(t)
        elif f.kind == "nvlink":
            if f.node in comm.nodes:
                if comm.transport == "nvlink":
                    slow /= 1.0 - f.level(t)
                elif comm.transport == "mixed":
                    slow /= 1.0 - f.level(t) / 3.0
        elif f.kind == "spike" and (not f.transports or comm.transport in f.transports):
            slow /= 1.0 - f.level(t)
    return slow


def _key_windows(sc: Scenario, comm: Comm, op: str, msg: int, seq_base: int, seq_stride: int,
                 rng: np.random.Generator) -> list[tuple[int, int, WindowSummary]]:
    W, C, R = sc.duration_s // sc.window_s, sc.ops_per_s * sc.window_s, len(comm.ranks)
    alpha, beta = LINKS[comm.transport]
    bb = bus_bytes(op, msg, R)
    t0 = alpha + bb / beta
    t = (np.arange(W)[:, None] + (np.arange(C)[None, :] + 0.5) / C) * sc.window_s
    true = t0 * _comm_slowdown(sc, comm, t)
    # Latency-bound (small) ops jitter more than bandwidth-bound ones, as launch and
    # synchronisation costs dominate them.
    sigma = sc.op_sigma + sc.latency_sigma * alpha / t0
    true *= rng.lognormal(0.0, sigma, (W, C)) * rng.lognormal(0.0, 0.01, (W, 1))
    slow_w = np.nonzero(rng.random(W) < sc.slow_call_p)[0]
    true[slow_w, rng.integers(0, C, len(slow_w))] *= 10.0
    mu = sc.arrival_jitter * t0
    arrival = rng.exponential(mu, (W, C, R))
    # Without a fault the last of R ranks already arrives mu * (H(R-1) - 1) after a
    # typical one; a straggler of magnitude m arrives m / (1 - m) op durations after that
    # last one, so the others' loss is about m whatever the communicator size.
    spread = mu * (sum(1.0 / k for k in range(1, R)) - 1.0)
    for f in sc.faults:
        if f.kind == "straggler" and f.rank in comm.ranks:
            lvl = f.level(t)
            late = true * lvl / (1.0 - lvl) + np.where(lvl > 0, spread, 0.0)
            arrival[:, :, comm.ranks.index(f.rank)] += late
    exec_ns = arrival.max(axis=2, keepdims=True) - arrival + true[:, :, None]
    ex = np.sort(exec_ns, axis=1)
    k50 = math.ceil(0.5 * C) - 1
    k95 = math.ceil(0.95 * C) - 1
    bucket = size_bucket(msg)
    out = []
    g = sc.gpus_per_node
    for w in range(W):
        start = STREAM_START_NS + w * sc.window_s * 10**9
        first = seq_base + w * C * seq_stride
        for r in range(R):
            col = ex[w, :, r]
            ws = WindowSummary(
                job=sc.job, host=host_name(comm.ranks[r] // g), comm=comm.hash,
                comm_name=comm.name, op=op, size_bucket=bucket, transport=comm.transport,
                rank=r, nranks=R, start_ns=start, end_ns=start + sc.window_s * 10**9,
                count=C, bytes=C * msg, exec_ns_min=int(col[0]), exec_ns_p50=int(col[k50]),
                exec_ns_p95=int(col[k95]), exec_ns_max=int(col[-1]),
                # nearest-rank p50 of per-op busbw = bus bytes over the mirrored exec rank
                busbw_gbs_p50=round(bb / float(col[C - 1 - k50]), 4),
                first_seq=first, last_seq=first + (C - 1) * seq_stride,
            )
            out.append((comm.ranks[r] // g, w, ws))
    return out


def _throughput(sc: Scenario, rng: np.random.Generator) -> list[ThroughputRecord]:
    out = []
    t_s, step = 0.0, 0
    comm_faults = [f for f in sc.faults if f.kind in (*COMM_FAULTS, "spike")]
    while True:
        probe = np.array([t_s + 0.5])
        comm_factor = 1.0
        for f in comm_faults:
            comm_factor = max(comm_factor, 1.0 / (1.0 - float(f.level(probe)[0])))
        compute = 1.0
        for f in sc.faults:
            if f.kind == "compute":
                compute /= 1.0 - float(f.level(probe)[0])
        step_s = ((1 - sc.exposed_comm) + sc.exposed_comm * comm_factor) * compute
        step_s *= float(rng.lognormal(0.0, 0.005))
        t_s += step_s
        if t_s >= sc.duration_s:
            return out
        out.append(
            ThroughputRecord(
                job=sc.job, host=host_name(0), rank=-1,
                ts_ns=STREAM_START_NS + int(t_s * 1e9), step=step,
                tflops_per_gpu=round(sc.tflops / step_s, 3), tokens_per_s=None, source="fixture",
            )
        )
        step += 1


def throughput_loss(sc: Scenario, m: float) -> float:
    """TFLOP/s loss when exposed communication is stretched by ``1 / (1 - m)``."""
    return 1.0 - 1.0 / ((1 - sc.exposed_comm) + sc.exposed_comm / (1.0 - m))


def gate_magnitude(sc: Scenario) -> float:
    """The comm loss ``m`` at which the job loses :data:`THROUGHPUT_GATE` (inverse of
    :func:`throughput_loss`)."""
    return 1.0 - sc.exposed_comm / (1.0 / (1.0 - THROUGHPUT_GATE) - (1 - sc.exposed_comm))


def generate(sc: Scenario) -> tuple[list[Any], LabelSet]:
    """The scenario's records in publication order, and its labels."""
    rng = np.random.default_rng(sc.seed)
    comms = communicators(sc)
    silent = [f for f in sc.faults if f.kind == "silence"]
    emitted: list[tuple[int, int, Any]] = []
    order = 0
    for comm in comms:
        ops = [op for op, _ in comm.keys]
        for k, (op, msg) in enumerate(comm.keys):
            stride = ops.count(op)
            base = [o for o, _ in comm.keys[:k]].count(op)
            for node, w, ws in _key_windows(sc, comm, op, msg, base, stride, rng):
                t_s = w * sc.window_s
                if any(f.node == node and f.start_s <= t_s < f.end_s for f in silent):
                    continue
                # Each node's forwarder publishes ~1-2 s after the window ends.
                delay = (sc.forwarder_delay_s[node] if node < len(sc.forwarder_delay_s)
                         else 1.0 + 0.35 * node)
                emit = ws.end_ns + int(delay * 1e9) + (w % 7) * 10_000_000
                emitted.append((emit, order, ws))
                order += 1
    for rec in _throughput(sc, rng):
        emitted.append((rec.ts_ns + 50_000_000, order, rec))
        order += 1
    for f in sc.faults:
        if f.kind == "drops":
            total = 0
            for s in range(int(f.start_s), int(f.end_s)):
                count = int(rng.integers(1, 50))
                total += count
                ts = STREAM_START_NS + s * 10**9 + 500_000_000
                emitted.append((ts, order, DropRecord(
                    job=sc.job, host=host_name(f.node or 0), pid=1000, gpu="GPU-sim",
                    rank=(f.node or 0) * sc.gpus_per_node, ts_ns=ts, reason="ring_full",
                    count=count, total=total)))
                order += 1
    # Publication order: by time, then within a time as each node's forwarder emits them.
    emitted.sort(key=lambda e: (e[0], e[1]))
    records = [e[2] for e in emitted]
    return records, labels_for(sc, comms, realized_effects(sc, comms, records))


def _affected(sc: Scenario, comms: list[Comm], f: Fault) -> list[Comm]:
    if f.kind == "network":
        return [c for c in comms if c.transport in ("net", "mixed")
                and (f.node is None or f.node in c.nodes)]
    if f.kind == "nvlink":
        return [c for c in comms if c.transport == "nvlink" and f.node in c.nodes]
    if f.kind == "straggler":
        return [c for c in comms if f.rank in c.ranks]
    return []


def realized_effects(sc: Scenario, comms: list[Comm], records: list[Any]) -> dict[int, float]:
    """Per comm fault (by index): the loss the stream really shows on its worst key.

    Median over the fault's windows (from the threshold crossing on; of a pulsed fault,
    those it is on in) of the key's median busbw over ranks, against the 30 s before the
    fault. Jitter can absorb part of a
    fault (a straggler late by less than the others' own spread costs little), so labels
    say what the data shows, not only what was injected.
    """
    per_key: dict[tuple[str, str, str], dict[int, list[float]]] = {}
    for r in records:
        if r.KIND == "window":
            per_key.setdefault((r.comm, r.op, r.size_bucket), {}).setdefault(
                r.start_ns, []).append(r.busbw_gbs_p50)
    out: dict[int, float] = {}
    for i, f in enumerate(sc.faults):
        if f.kind not in COMM_FAULTS:
            continue
        crossing = f.start_s + (f.ramp_s * min(1.0, THRESHOLD / f.magnitude) if f.ramp_s else 0)
        best = 0.0
        for c in _affected(sc, comms, f):
            for op, msg in c.keys:
                windows = per_key.get((c.hash, op, size_bucket(msg)), {})
                before, during = [], []
                for start, values in windows.items():
                    t_s = (start - STREAM_START_NS) / 1e9
                    med = float(np.median(values))
                    if f.start_s - 30 <= t_s < f.start_s:
                        before.append(med)
                    elif crossing <= t_s < f.end_s - 1 and (
                            f.pulse_s is None or f.level(np.array([t_s + sc.window_s / 2]))[0] > 0):
                        during.append(med)
                if before and during:
                    best = max(best, 1.0 - float(np.median(during)) / float(np.median(before)))
        out[i] = round(best, 4)
    return out


def labels_for(sc: Scenario, comms: list[Comm] | None = None,
               realized: dict[int, float] | None = None) -> LabelSet:
    """The labels of a scenario; ``realized`` (from :func:`realized_effects`) decides
    which comm faults are big enough to be required."""
    comms = comms if comms is not None else communicators(sc)
    realized = realized or {}
    to_ns = lambda s: STREAM_START_NS + int(round(s * 1e9))  # noqa: E731
    labels: list[Label] = []
    spikes: list[dict[str, Any]] = []
    has_nvlink = any(c.transport == "nvlink" for c in comms)
    world = comms[0]
    for i, f in enumerate(sc.faults):
        m = f.magnitude
        # A ramp becomes a fault once it is both over the key threshold and, for comm
        # faults, costing the job the throughput gate.
        onset = THRESHOLD
        if f.kind in COMM_FAULTS:
            onset = max(onset, gate_magnitude(sc))
        crossing = f.start_s + (f.ramp_s * min(1.0, onset / m) if f.ramp_s and m else 0.0)
        common = {"start_ns": to_ns(crossing), "end_ns": to_ns(f.end_s), "magnitude": m}
        if crossing != f.start_s:
            common["onset_ns"] = to_ns(f.start_s)
        affected = _affected(sc, comms, f)
        if f.kind in COMM_FAULTS:
            loss = throughput_loss(sc, m)
            # A comm fault is raised once it costs the job THROUGHPUT_GATE of its
            # throughput, and is then critical; within a point of the gate either
            # answer is right (the steps carry 0.5 % noise).
            sev = "critical" if loss >= THROUGHPUT_GATE + 0.01 else None
            common["severity"] = sev
            # Required only if the stream really shows it (two ranks: a straggler's
            # median over ranks is their mean, so half of it shows) and it costs the job.
            seen = realized.get(i, m)
            common["optional"] = seen < REQUIRED_EFFECT or loss < THROUGHPUT_GATE + 0.01
            common["note"] = (f"realized loss {seen:.1%} on the worst key, "
                              f"{loss:.1%} of the job's throughput")
        if f.kind == "network":
            if not affected:
                continue
            common["note"] += "; nvlink keys hold" if has_nvlink else "; no nvlink reference"
            labels.append(Label(type="network_path", attribution="network",
                                keys=_keys(affected), **common))
        elif f.kind == "nvlink":
            labels.append(Label(type="intra_node", attribution="intra_node",
                                host=host_name(f.node or 0), keys=_keys(affected), **common))
        elif f.kind == "straggler":
            labels.append(Label(type="straggler", attribution="straggler",
                                host=host_name(f.rank // sc.gpus_per_node), rank=f.rank,
                                comm=world.hash, keys=_keys(affected), **common))
        elif f.kind == "compute":
            sev = "warning" if m >= 0.12 else ("info" if m <= 0.08 else None)
            common["severity"] = sev
            labels.append(Label(type="throughput_drop", attribution="unknown",
                                optional=m < 0.08, **common))
        elif f.kind == "silence":
            rank = f.node * sc.gpus_per_node if sc.gpus_per_node == 1 else None
            labels.append(Label(type="telemetry_loss", attribution="telemetry",
                                host=host_name(f.node or 0), rank=rank, severity="warning",
                                optional=f.end_s - f.start_s < 15, **common))
        elif f.kind == "drops":
            labels.append(Label(type="telemetry_loss", attribution="telemetry",
                                host=host_name(f.node or 0), severity="info", **common))
        elif f.kind == "spike":
            spikes.append({"start_ns": to_ns(f.start_s), "end_ns": to_ns(f.end_s),
                           "magnitude": m, "transports": list(f.transports)})
    return LabelSet(
        scenario=sc.name,
        job=sc.job,
        labels=labels,
        description=sc.description,
        meta={
            "generator": "ncclwatch_testkit.scenarios",
            "seed": sc.seed,
            "topology": {"nodes": sc.nodes, "gpus_per_node": sc.gpus_per_node},
            "stream_start_ns": STREAM_START_NS,
            "stream_end_ns": to_ns(sc.duration_s),
            "window_s": sc.window_s,
            "spikes": spikes,
        },
    )


def _keys(comms: list[Comm]) -> list[dict[str, Any]]:
    return [
        {"comm": c.hash, "op": op, "size_bucket": size_bucket(msg), "transport": c.transport}
        for c in comms
        for op, msg in c.keys
    ]


def suite() -> list[Scenario]:
    """The standard labelled scenarios (the tests' and docs/evaluation.md's)."""
    F = Fault
    S = Scenario
    spikes = (
        F("spike", 40, 41, 0.5, transports=("net", "mixed")),
        F("spike", 70, 72, 0.4, transports=("nvlink",)),
        F("spike", 100.3, 100.9, 0.6),
        F("spike", 130, 132, 0.5),
        F("spike", 160.5, 161.0, 0.5, transports=("net", "mixed")),
    )
    return [
        S("steady_1x2", 1, 2, 300, seed=1, description="2 GPUs on one node, healthy"),
        S("steady_2x2", 2, 2, 300, seed=2, description="2 nodes x 2 GPUs, healthy"),
        S("steady_4x1", 4, 1, 300, seed=3, description="4 nodes x 1 GPU (net only), healthy"),
        S("steady_2x8", 2, 8, 180, seed=4, description="2 nodes x 8 GPUs, healthy"),
        S("steady_noisy_2x8", 2, 8, 300, seed=25, ops_per_s=8, op_sigma=0.08,
          latency_sigma=0.6, arrival_jitter=0.15, slow_call_p=0.5,
          description="16 GPUs, 8 ops per window, 8-30 % per-op jitter: healthy"),
        S("network_step15_noisy_2x2", 2, 2, 150, (F("network", 60, 110, 0.15),), seed=26,
          ops_per_s=8, op_sigma=0.08, latency_sigma=0.6, arrival_jitter=0.15,
          slow_call_p=0.5, description="network loses 15 % on a noisy job (the job ~5 %: "
                                       "at the gate, optional)"),
        S("network_step25_noisy_2x2", 2, 2, 150, (F("network", 60, 110, 0.25),), seed=30,
          ops_per_s=8, op_sigma=0.08, latency_sigma=0.6, arrival_jitter=0.15,
          slow_call_p=0.5, description="network loses 25 % on a noisy job"),
        S("spikes_2x2", 2, 2, 200, spikes, seed=5,
          description="1-2 window spikes of 40-60 % and sub-second ones: no alert"),
        S("spikes_2x8", 2, 8, 200, spikes, seed=6, description="the same spikes on 16 GPUs"),
        S("network_step30_2x2", 2, 2, 150, (F("network", 60, 110, 0.30),), seed=7,
          description="network loses 30 % (step)"),
        S("network_step12_2x2", 2, 2, 150, (F("network", 60, 110, 0.12),), seed=8,
          description="network loses 12 % (just above threshold) but the job only ~4 %: "
                      "below the throughput gate, optional"),
        S("network_ramp_2x2", 2, 2, 160, (F("network", 50, 120, 0.40, ramp_s=30),), seed=9,
          description="network loss ramps 0 -> 40 % over 30 s"),
        S("network_step20_2x8", 2, 8, 140, (F("network", 50, 100, 0.20),), seed=10,
          description="network loses 20 % on 16 GPUs"),
        S("network_step25_4x1", 4, 1, 150, (F("network", 60, 110, 0.25),), seed=11,
          description="network loses 25 %, net-only job (no NVLink reference)"),
        S("network_pulse_2x2", 2, 2, 150, (F("network", 60, 100, 0.6, pulse_s=(1.0, 3.0)),), seed=31,
          description="network drops out: 60 % lost for 1 s in every 4 (a flapping link)"),
        S("network_node1_2x8", 2, 8, 140, (F("network", 50, 100, 0.25, node=1),), seed=12,
          description="one node's NIC path loses 25 %"),
        S("network_slow_ramp_2x2", 2, 2, 260, (F("network", 50, 230, 0.30, ramp_s=120),),
          seed=27, description="network loss creeps 0 -> 30 % over two minutes"),
        S("network_late_forwarder_2x2", 2, 2, 150, (F("network", 60, 110, 0.20),), seed=28,
          forwarder_delay_s=(1.0, 4.5),
          description="node1's forwarder publishes 4.5 s late; network loses 20 %"),
        S("nvlink_step30_1x2", 1, 2, 150, (F("nvlink", 60, 110, 0.30, node=0),), seed=13,
          description="NVLink loses 30 % on a single node"),
        S("nvlink_node1_2x2", 2, 2, 150, (F("nvlink", 60, 110, 0.25, node=1),), seed=14,
          description="NVLink of node1 loses 25 %"),
        S("nvlink_ramp_2x8", 2, 8, 150, (F("nvlink", 50, 110, 0.35, ramp_s=15, node=0),), seed=15,
          description="NVLink of node0 ramps to 35 % loss over 15 s"),
        # 100 ops/s: at 20, a 64 MiB NVLink op of ~0.2 ms late by one op duration keeps its
        # partner waiting 0.4 % of the time, which could not cost the job what the
        # throughput model says it does (the detector asks straggler_min_wait of 1 %)
        S("straggler_1x2", 1, 2, 150, (F("straggler", 60, 110, 0.50, rank=1),), seed=16, ops_per_s=100,
          description="rank 1 arrives late: its partner waits 2x (median shows 25 %)"),
        S("straggler_2x2", 2, 2, 150, (F("straggler", 60, 110, 0.30, rank=3),), seed=17,
          description="rank 3 (node1) arrives late: the others lose 30 %"),
        S("straggler_2x8", 2, 8, 140, (F("straggler", 50, 100, 0.25, rank=11),), seed=18,
          description="rank 11 (node1) late, 25 % loss for the others"),
        S("straggler13_2x8", 2, 8, 140, (F("straggler", 50, 100, 0.13, rank=0),), seed=29,
          description="rank 0 (node0) late, 13 % loss for the others, ~4 % for the job: "
                      "optional"),
        S("subthreshold_2x2", 2, 2, 200,
          (F("network", 50, 90, 0.05), F("nvlink", 120, 160, 0.07, node=0)), seed=19,
          description="5 % and 7 % losses: below the 10 % threshold (optional labels)"),
        S("throughput_dip_2x2", 2, 2, 180,
          (F("compute", 60, 100, 0.15), F("compute", 130, 160, 0.03)), seed=20,
          description="compute slows 15 % (and 3 %) with NCCL healthy: throughput_drop"),
        S("throughput_with_comm_2x8", 2, 8, 140, (F("network", 50, 100, 0.40),), seed=21,
          description="network loses 40 %, job loses ~17 % TFLOP/s: critical"),
        S("telemetry_silence_2x2", 2, 2, 150, (F("silence", 60, 90, node=1),), seed=22,
          description="node1's forwarder goes silent for 30 s"),
        S("telemetry_drops_2x2", 2, 2, 120, (F("drops", 60, 70, node=0),), seed=23,
          description="node0's plugin drops records for 10 s"),
        S("multi_fault_2x8", 2, 8, 260,
          (F("network", 40, 70, 0.25), F("straggler", 110, 140, 0.30, rank=5),
           F("nvlink", 180, 210, 0.30, node=1)), seed=24,
          description="network, then a straggler, then NVLink on one job"),
    ]


def by_name(name: str) -> Scenario:
    for sc in suite():
        if sc.name == name:
            return sc
    raise KeyError(name)


def write(sc: Scenario, out_dir: Path) -> tuple[Path, Path]:
    records, labels = generate(sc)
    out_dir.mkdir(parents=True, exist_ok=True)
    rec_path = out_dir / f"{sc.name}.records.jsonl"
    with rec_path.open("w") as f:
        for rec in records:
            f.write(to_json(rec) + "\n")
    lab_path = out_dir / f"{sc.name}.labels.json"
    labels.save(lab_path)
    return rec_path, lab_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ncclwatch_testkit.scenarios")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list the suite's scenarios")
    w = sub.add_parser("write", help="write records and labels of the suite's scenarios")
    w.add_argument("out_dir", type=Path)
    w.add_argument("--only", action="append", help="scenario name (repeatable)")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        for sc in suite():
            topo = f"{sc.nodes}x{sc.gpus_per_node}"
            print(f"{sc.name:28} {topo:5} {sc.duration_s:4d}s  {sc.description}")
        return 0
    for sc in suite():
        if args.only and sc.name not in args.only:
            continue
        rec_path, lab_path = write(sc, args.out_dir)
        print(rec_path)
        print(lab_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
