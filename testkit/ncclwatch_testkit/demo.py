"""A synthetic recording to see the dashboards and reports without a GPU.

    python -m ncclwatch_testkit.demo --out var/spool
    ncclwatch watch var/spool --speed 5    # or: docker compose up, whose forwarder reads it

Writes a spool directory the way the plugin and ``report_throughput`` write one: a job of
2 nodes × 2 GPUs with a tensor-parallel communicator per node (``nvlink``), a
data-parallel one per rail (``net``) and one over all four ranks (``mixed``). Two faults
are injected: a straggler rank (it arrives late, so the others wait for it inside every
collective), then a degraded network path (network and mixed communicators lose
bandwidth, and the job 13 % of its throughput, as in NVIDIA's Inspector experiment).
They are returned as labels in the labelled-scenario format (``docs/scenarios.md``), which
``ncclwatch eval`` scores against and ``ncclwatch report`` draws.

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as d:
...     labels = write_demo_spool(Path(d), seconds=20, straggler_s=(5, 10), network_s=(12, 18))
...     n = sum(1 for p in Path(d).rglob("*.jsonl") for _ in p.open())
>>> [label["type"] for label in labels["labels"]], n
(['straggler', 'network_path'], 985)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ncclwatch.detectors.labels import Label, LabelSet

from ncclwatch.records import DropRecord, PauseRecord, PluginStats, ProgressRecord, ThroughputRecord, to_json
from ncclwatch.rules import (
    NETWORK_TRANSPORTS,
    bandwidths_gbs,
    message_bytes,
    size_bucket,
    transport_class,
)
from ncclwatch_testkit.synth import op_record

HOSTS = ("node-a", "node-b")
GPUS_PER_NODE = 2
OPS_PER_S = 4


@dataclass(frozen=True)
class Comm:
    comm: str  # hash as the plugin writes it
    name: str
    members: tuple[int, ...]  # global ranks, in communicator rank order
    op: str
    count: int  # float32 elements
    speed_gbs: float  # healthy bus bandwidth


def topology() -> list[Comm]:
    world = tuple(range(len(HOSTS) * GPUS_PER_NODE))
    comms = [
        Comm(
            f"0x00000000000000b{n}",
            "tp",
            tuple(n * GPUS_PER_NODE + g for g in range(GPUS_PER_NODE)),
            "AllReduce",
            256 << 10,
            160.0,
        )
        for n in range(len(HOSTS))
    ]
    comms += [
        Comm(
            f"0x00000000000000a{g}",
            "dp",
            tuple(n * GPUS_PER_NODE + g for n in range(len(HOSTS))),
            "AllReduce",
            8 << 20,
            22.0,
        )
        for g in range(GPUS_PER_NODE)
    ]
    comms.append(Comm("0x00000000000000c0", "world", world, "AllGather", 1 << 20, 30.0))
    return comms


def _exec_ns(op: str, nbytes: int, nranks: int, busbw_gbs: float) -> int:
    """The kernel time that gives this bus bandwidth."""
    _, bus_at_1ms = bandwidths_gbs(op, nbytes, nranks, 1_000_000)
    return max(1, int(1_000_000 * bus_at_1ms / busbw_gbs))


def write_demo_spool(
    spool: Path,
    *,
    job: str = "demo-job",
    seconds: int = 180,
    t0_ns: int | None = None,
    straggler_s: tuple[int, int] = (40, 70),
    straggler_rank: int = 1,
    straggler_late_ms: float = 10.0,
    network_s: tuple[int, int] = (100, 150),
    network_loss: float = 0.35,
    stall_s: tuple[int, int] | None = None,
    checkpoint_s: tuple[int, int] | None = None,
    seed: int = 7,
) -> dict:
    """Write the recording under ``spool/<job>/``; return its labels (docs/scenarios.md format).

    ``stall_s``: also stop the straggler's process over ``[start, end)``: nothing
    completes in the job, and the other ranks' plugins write ``progress`` records once a
    second, waiting in the world communicator's collective.

    ``checkpoint_s``: a checkpoint save over ``[start, end)``, as the job's training log
    says it (``pause`` records): global rank 0 writes it, nothing completes, the others
    wait for it as for a stop. Not a fault: no label.
    """
    rnd = random.Random(seed)
    t0_ns = t0_ns if t0_ns is not None else (time.time_ns() // 10**9 - seconds) * 10**9
    comms = topology()
    nranks_world = len(HOSTS) * GPUS_PER_NODE
    out = spool / job
    out.mkdir(parents=True, exist_ok=True)
    lines: dict[int, list[str]] = {g: [] for g in range(nranks_world)}

    def host_of(g: int) -> str:
        return HOSTS[g // GPUS_PER_NODE]

    def pid_of(g: int) -> int:
        return 4000 + g

    for g in range(nranks_world):
        lines[g].append(
            to_json(
                PluginStats(
                    job=job,
                    host=host_of(g),
                    pid=pid_of(g),
                    gpu=f"GPU-{g}",
                    ts_ns=t0_ns,
                    recorded=0,
                    dropped={},
                    segment=0,
                )
            )
        )
    # The straggler's slower step makes it late by the same time for every collective,
    # whatever its size: 10 ms at 4 ops/s keeps the others waiting 4 % of the time (the
    # job's 7 % loss below, spread over its communicators).
    late_ns = int(straggler_late_ms * 1e6)
    def saving(s: int) -> bool:
        return checkpoint_s is not None and checkpoint_s[0] <= s < checkpoint_s[1]

    def stopped(s: int) -> bool:
        return stall_s is not None and stall_s[0] <= s < stall_s[1] or saving(s)

    for s in range(seconds):
        if stopped(s):
            stop, rank = (checkpoint_s, 0) if saving(s) else (stall_s, straggler_rank)
            _progress_lines(lines, comms, s, stop, rank, job=job, t0_ns=t0_ns, host_of=host_of, pid_of=pid_of)
            continue
        straggling = straggler_s[0] <= s < straggler_s[1]
        degraded = network_s[0] <= s < network_s[1]
        for k in range(OPS_PER_S):
            seq = s * OPS_PER_S + k
            for c_i, c in enumerate(comms):
                nnodes = len({host_of(g) for g in c.members})
                transport = transport_class(len(c.members), nnodes)
                nbytes = message_bytes(c.count, "ncclFloat32")
                speed = c.speed_gbs * (1 - network_loss if degraded and transport in NETWORK_TRANSPORTS else 1)
                base_ns = _exec_ns(c.op, nbytes, len(c.members), speed)
                start = t0_ns + s * 10**9 + k * (10**9 // OPS_PER_S) + c_i * 20_000_000
                late = straggling and straggler_rank in c.members
                for rank, g in enumerate(c.members):
                    exec_ns = int(base_ns * rnd.uniform(0.97, 1.03))
                    start_ns = start
                    if late and g == straggler_rank:
                        start_ns += late_ns  # arrives late, waits least
                    elif late:
                        exec_ns += late_ns  # waits for the straggler
                    rec = op_record(job=job, host=host_of(g), pid=pid_of(g), gpu=f"GPU-{g}", comm=c.comm,
                                    rank=rank, seq=seq, start_ns=start_ns, op=c.op, nbytes=nbytes,
                                    nranks=len(c.members), nnodes=nnodes, exec_ns=exec_ns,
                                    comm_name=c.name, transport=transport)
                    lines[g].append(to_json(rec))
        if s == seconds // 3:  # the plugin's ring overflowed once on one rank
            lines[3].append(
                to_json(
                    DropRecord(
                        job=job,
                        host=host_of(3),
                        pid=pid_of(3),
                        gpu="GPU-3",
                        rank=1,
                        ts_ns=t0_ns + s * 10**9,
                        reason="ring_full",
                        count=12,
                        total=12,
                    )
                )
            )
    for g, recs in lines.items():
        (out / f"{host_of(g)}-GPU-{g}-{pid_of(g)}.000000.jsonl").write_text("\n".join(recs) + "\n")
    tp = []
    for s in range(seconds):
        if checkpoint_s is not None and s == checkpoint_s[0]:  # as Megatron logs a save
            tp += [to_json(PauseRecord(job=job, host=HOSTS[0], rank=-1, ts_ns=t0_ns + t_ms * 10**6,
                                       state=state, reason="checkpoint", step=s))
                   for t_ms, state in ((checkpoint_s[0] * 1000 + 100, "begin"), (checkpoint_s[1] * 1000, "end"))]
        if stopped(s):
            continue  # no step completes
        speed = 310.0
        if network_s[0] <= s < network_s[1]:
            speed *= 0.87
        elif straggler_s[0] <= s < straggler_s[1]:
            speed *= 0.93
        tp.append(
            to_json(
                ThroughputRecord(
                    job=job,
                    host=HOSTS[0],
                    rank=-1,
                    ts_ns=t0_ns + (s + 1) * 10**9,
                    step=s,
                    tflops_per_gpu=round(speed * rnd.uniform(0.99, 1.01), 2),
                    tokens_per_s=None,
                    source="fixture",
                )
            )
        )
    (out / f"{HOSTS[0]}-throughput-{pid_of(0)}.000000.jsonl").write_text("\n".join(tp) + "\n")
    world = next(c for c in comms if c.name == "world")
    network_keys = [
        {"comm": c.comm, "op": c.op, "size_bucket": size_bucket(message_bytes(c.count, "ncclFloat32")),
         "transport": transport_class(len(c.members), len({host_of(g) for g in c.members}))}
        for c in comms
    ]  # fmt: skip
    labels = LabelSet(
        scenario="demo",
        job=job,
        description="ncclwatch_testkit.demo: a straggler, then a degraded network path",
        labels=[
            Label(
                start_ns=t0_ns + straggler_s[0] * 10**9, end_ns=t0_ns + straggler_s[1] * 10**9,
                type="straggler", attribution="straggler", rank=world.members.index(straggler_rank),
                comm=world.comm, host=host_of(straggler_rank),
                note=f"global rank {straggler_rank} arrives {straggler_late_ms:g} ms late for every op",
            ),
            Label(
                start_ns=t0_ns + network_s[0] * 10**9, end_ns=t0_ns + network_s[1] * 10**9,
                type="network_path", attribution="network", magnitude=network_loss,
                keys=[k for k in network_keys if k["transport"] in NETWORK_TRANSPORTS],
            ),
        ],
    )  # fmt: skip
    if stall_s is not None:
        labels.labels.append(Label(
            start_ns=t0_ns + stall_s[0] * 10**9, end_ns=t0_ns + stall_s[1] * 10**9,
            type="straggler", attribution="straggler", rank=world.members.index(straggler_rank),
            comm=world.comm, host=host_of(straggler_rank),
            note=f"global rank {straggler_rank}'s process stopped; the others wait in {world.name}",
        ))
    return labels.to_dict()


def _progress_lines(lines: dict[int, list[str]], comms: list[Comm], s: int, stall_s: tuple[int, int],
                    stopped_rank: int, *, job: str, t0_ns: int, host_of, pid_of) -> None:
    """Second ``s`` of a stop: from a second into it, each other rank's plugin writes one
    record per communicator of its process, in flight in the world communicator's next
    collective (the one the stopped rank never calls), idle in the others."""
    if s == stall_s[0]:
        return  # an op must be in flight a second before the plugin says so
    done = stall_s[0] * OPS_PER_S
    since = t0_ns + stall_s[0] * 10**9
    for g in lines:
        if g == stopped_rank:
            continue
        for c in comms:
            if g not in c.members:
                continue
            waits = c.name == "world"
            lines[g].append(to_json(ProgressRecord(
                job=job, host=host_of(g), pid=pid_of(g), gpu=f"GPU-{g}", comm=c.comm, comm_name=c.name,
                rank=c.members.index(g), nranks=len(c.members), ts_ns=t0_ns + s * 10**9,
                issued=done + waits, colls=done + waits, done=done, in_flight=int(waits),
                waiting_since_ns=since, last_done_ns=since)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="spool directory to write into")
    p.add_argument("--job", default="demo-job")
    p.add_argument("--seconds", type=int, default=180)
    p.add_argument("--labels", type=Path, help="also write the injected faults here (NAME.labels.json)")
    args = p.parse_args(argv)
    labels = write_demo_spool(
        args.out,
        job=args.job,
        seconds=args.seconds,
        straggler_s=(args.seconds * 2 // 9, args.seconds * 7 // 18),
        network_s=(args.seconds * 5 // 9, args.seconds * 5 // 6),
    )
    if args.labels:
        args.labels.write_text(json.dumps(labels, indent=1) + "\n")
    print(f"wrote {args.seconds} s of job {args.job} under {args.out / args.job}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
