"""Synthetic spools in the plugin's exact layout, for tests and the benchmark.

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> paths = write_spool(d, job="j", streams=2, ops_per_stream=10, segment_ops=4)
>>> len(paths), sum(1 for p in paths for _ in open(p))
(6, 20)
"""

from __future__ import annotations

import os

from ncclwatch import rules
from ncclwatch.records import DropRecord, OpRecord, PluginStats, to_json
from ncclwatch.rules import safe_filename

T0_NS = 1_763_790_000_000_000_000
OPS = ("AllReduce", "AllGather", "ReduceScatter")


def op_record(*, job: str, host: str, pid: int, gpu: str, comm: int | str, rank: int, seq: int,
              start_ns: int, op: str = "AllReduce", nbytes: int = 1 << 20, nranks: int = 8,
              nnodes: int = 1, exec_ns: int = 50_000, comm_name: str | None = None,
              transport: str | None = None) -> OpRecord:
    """One op record as the plugin writes it (``comm``: a number, or the hex string as it
    stands; the transport class follows from ranks and nodes unless given)."""
    comm_s = comm if isinstance(comm, str) else rules.comm_hex(comm)
    algbw, busbw = rules.bandwidths_gbs(op, nbytes, nranks, exec_ns)
    return OpRecord(
        id=rules.record_id(job, host, pid, comm_s, rank, op, -1, seq), job=job, host=host,
        pid=pid, gpu=gpu, comm=comm_s, comm_name=f"c{comm}" if comm_name is None else comm_name,
        rank=rank, nranks=nranks, nnodes=nnodes, local_ranks=rules.local_ranks(nranks, nnodes),
        transport=transport or rules.transport_class(nranks, nnodes), op=op, seq=seq,
        count=nbytes // 4, dtype="ncclFloat32", bytes=nbytes, peer=-1, algo="RING", proto="SIMPLE",
        channels=8, start_ns=start_ns, exec_ns=exec_ns, timing="kernel_gpu", algbw_gbs=algbw,
        busbw_gbs=busbw, graph=False)


def stream_lines(*, job: str, host: str, pid: int, gpu: str, rank: int, n: int,
                 comms: int = 2, interval_ns: int = 1_000_000, t0_ns: int = T0_NS,
                 seq0: int = 0) -> list[bytes]:
    """``n`` op lines of one process over ``comms`` communicators, in completion order."""
    out = []
    seqs = [seq0] * comms
    for i in range(n):
        c = i % comms
        op = OPS[c % len(OPS)]
        rec = op_record(job=job, host=host, pid=pid, gpu=gpu, comm=0xABC0 + c, rank=rank,
                        seq=seqs[c], start_ns=t0_ns + i * interval_ns, op=op,
                        exec_ns=40_000 + (i * 7919) % 20_000)
        seqs[c] += 1
        out.append(to_json(rec).encode())
    return out


def write_spool(spool_dir: str, *, job: str = "job-1", host: str = "node001", streams: int = 2,
                ops_per_stream: int = 1000, segment_ops: int = 0, comms: int = 2,
                with_stats: bool = False) -> list[str]:
    """Write complete segments; returns the paths (segment_ops=0: one segment each)."""
    d = os.path.join(spool_dir, safe_filename(job))
    os.makedirs(d, exist_ok=True)
    paths = []
    for s in range(streams):
        pid = 1000 + s
        gpu = f"GPU-{s:04d}"
        lines = stream_lines(job=job, host=host, pid=pid, gpu=gpu, rank=s, n=ops_per_stream,
                             comms=comms)
        if with_stats:
            lines.insert(0, to_json(PluginStats(job=job, host=host, pid=pid, gpu=gpu,
                                                ts_ns=T0_NS, recorded=0, dropped={},
                                                segment=0)).encode())
            lines.append(to_json(DropRecord(job=job, host=host, pid=pid, gpu=gpu, rank=s,
                                            ts_ns=T0_NS + 1, reason="pool_full", count=3,
                                            total=3)).encode())
        per = segment_ops or len(lines)
        stream = f"{safe_filename(host)}-{gpu}-{pid}"
        for i, k in enumerate(range(0, len(lines), per)):
            path = os.path.join(d, f"{stream}.{i:06d}.jsonl")
            with open(path, "wb") as f:
                f.write(b"\n".join(lines[k:k + per]) + b"\n")
            paths.append(path)
    return paths
