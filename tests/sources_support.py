"""Recordings laid out as NCCL Inspector and Megatron write them, from the drivers' spool.

``write_inspector_run`` turns the synthetic 2-node job of ``ncclwatch_testkit.drivers.write_spool``
(network path 35 % slower from second 40, throughput 13 % lower) into what a user with
only NCCL Inspector has: ``<dump dir>/<host>-pid<pid>.log`` JSON-mode files (each dump
starting with a ``dump_stats`` marker, as NCCL 2.30 writes them) and one Megatron-format
training log per rank, each line stamped with its local wall-clock time.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from ncclwatch_testkit.drivers import write_spool

from ncclwatch.records import parse_line


def inspector_line(r, *, dump_us: int | None = None) -> str:
    """One Inspector v4 JSON line for op record ``r`` (non-verbose: the op ends at the dump)."""
    end_us = (r.start_ns + r.exec_ns) // 1000
    return json.dumps(
        {
            "header": {"id": hex(int(r.comm, 16)), "comm_name": r.comm_name, "rank": r.rank,
                       "n_ranks": r.nranks, "nnodes": r.nnodes},
            "metadata": {"inspector_output_format_version": "v4.0", "git_rev": "",
                         "rec_mechanism": "nccl_profiler_interface",
                         "dump_timestamp_us": end_us if dump_us is None else dump_us,
                         "hostname": r.host, "pid": r.pid},
            "coll_perf": {"coll": r.op, "coll_sn": r.seq, "coll_msg_size_bytes": r.bytes,
                          "coll_exec_time_us": round(r.exec_ns / 1000), "coll_timing_source": "kernel_gpu",
                          "coll_algobw_gbs": r.algbw_gbs, "coll_busbw_gbs": r.busbw_gbs},
        },
        separators=(",", ":"),
    )


def dump_stats_line(r, n: int) -> str:
    """The marker NCCL 2.30's Inspector writes before a communicator's ``n`` records."""
    return json.dumps(
        {
            "header": {"id": hex(int(r.comm, 16)), "comm_name": r.comm_name, "rank": r.rank,
                       "n_ranks": r.nranks, "nnodes": r.nnodes},
            "metadata": {"inspector_output_format_version": "v4.0", "git_rev": "",
                         "rec_mechanism": "nccl_profiler_interface",
                         "dump_timestamp_us": (r.start_ns + r.exec_ns) // 1000, "hostname": r.host, "pid": r.pid},
            "dump_stats": {"coll_records": n, "coll_dropped_total": 0, "coll_dropped_since_last_dump": 0,
                           "p2p_records": 0, "p2p_dropped_total": 0, "p2p_dropped_since_last_dump": 0},
        },
        separators=(",", ":"),
    )


def megatron_line(ts_ns: int, step: int, tflops: float) -> str:
    stamp = datetime.fromtimestamp(ts_ns / 1e9).strftime("%Y-%m-%d %H:%M:%S.%f")
    return (f"[{stamp}] iteration {step:8d}/ 1000000 | consumed samples: {step * 256:12d} | "
            f"elapsed time per iteration (ms): 1000.0 | throughput per GPU (TFLOP/s/GPU): {tflops:.1f} | "
            "learning rate: 1.000000E-04 | global batch size:   256 |\n")


def write_inspector_run(root: Path, *, ranks: int = 2, **spool_kw) -> dict:
    """``root/inspector/*.log`` and ``root/logs/rank-<r>.log``; the spool's info dict plus
    the op and throughput counts and the spool (for comparisons)."""
    spool = root / "plugin-spool"
    info = write_spool(spool, **spool_kw)
    insp = root / "inspector"
    logs = root / "logs"
    insp.mkdir(parents=True, exist_ok=True)
    logs.mkdir(exist_ok=True)
    n_ops = 0
    tps = []
    for f in sorted(spool.rglob("*.jsonl")):
        recs = [parse_line(line) for line in f.read_bytes().splitlines()]
        ops = [r for r in recs if r.KIND == "op"]
        tps += [r for r in recs if r.KIND == "throughput"]
        if not ops:
            continue
        lines = []
        for i in range(0, len(ops), 8):  # one dump per 8 ops, each with its marker
            batch = ops[i:i + 8]
            lines.append(dump_stats_line(batch[0], len(batch)))
            lines += [inspector_line(r) for r in batch]
        (insp / f"{ops[0].host}-pid{ops[0].pid}.log").write_text("\n".join(lines) + "\n")
        n_ops += len(ops)
    # every rank logs every iteration, a little apart, rank r 1 TFLOP/s above rank 0
    for rank in range(ranks):
        (logs / f"rank-{rank}.log").write_text("".join(
            "some other line of the training log\n" + megatron_line(t.ts_ns + rank * 7_000_000, t.step,
                                                                    t.tflops_per_gpu + rank)
            for t in tps))
    return {**info, "ops": n_ops, "steps": len(tps), "spool": spool, "throughput": tps}
