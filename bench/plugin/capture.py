"""PyTorch workload for the plugin's capture and accuracy check (run under torchrun).

Every rank issues AllReduce, AllGather, ReduceScatter, Broadcast, Reduce, AllToAll and a
Send/Recv pair (``batch_isend_irecv``) at each size, ``--calls`` times per (op, size), in two
modes: ``sync`` (a CPU barrier over gloo and a device spin before every call, so calls are
isolated) and ``b2b`` (back to back). Each call is bracketed by CUDA events on the current
stream; the host wall-clock window of each (mode, op, size) is written too, so
``analyze_capture.py`` can match the plugin's records to calls afterwards. Warm-up calls
fall outside the windows. Optionally (``--graph``) a CUDA-graph-captured loop of AllReduces
is replayed.

    torchrun --standalone --nproc_per_node=2 bench/plugin/capture.py --out DIR

Writes DIR/calls-rank<r>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

SIZES = [1 << 10, 32 << 10, 1 << 20, 32 << 20, 1 << 30]
# AllToAll last and on its own communicator: PyTorch's all_to_all includes a Send/Recv to
# self, after which NCCL 2.27-2.30's per-channel profiler counters of that communicator are
# out of step (the plugin then records its ops host-timed); the other ops keep GPU timing.
OPS = ["AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "SendRecv", "AllToAll"]
# ~200 us of device spin before each sync-mode call: the host has queued the collective
# behind the start event by then, so the events bracket the GPU work, not the launch.
SPIN_CYCLES = 400_000


def make_op(op: str, nbytes: int, rank: int, world: int, dev: torch.device, a2a_group=None):
    """Buffers and a closure issuing one call; ``nbytes`` is the per-rank message size."""
    n = max(nbytes // 4, 1)
    x = torch.ones(n, dtype=torch.int32, device=dev)
    peer = (rank + 1) % world
    if op == "AllReduce":
        return lambda: dist.all_reduce(x)
    if op == "AllGather":
        out = torch.empty(n * world, dtype=torch.int32, device=dev)
        return lambda: dist.all_gather_into_tensor(out, x)
    if op == "ReduceScatter":
        big = torch.ones(n * world, dtype=torch.int32, device=dev)
        return lambda: dist.reduce_scatter_tensor(x, big)
    if op == "Broadcast":
        return lambda: dist.broadcast(x, src=0)
    if op == "Reduce":
        return lambda: dist.reduce(x, dst=0)
    if op == "AllToAll":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x, group=a2a_group)
    if op == "SendRecv":
        r = torch.empty_like(x)
        src = (rank - 1) % world

        def sendrecv():
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, r, src)])
            for q in reqs:
                q.wait()

        return sendrecv
    raise ValueError(op)


def run_config(
    mode: str,
    op: str,
    nbytes: int,
    calls: int,
    warmup: int,
    rank: int,
    world: int,
    dev: torch.device,
    cpu_group,
    a2a_group=None,
) -> dict:
    fn = make_op(op, nbytes, rank, world, dev, a2a_group)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier(group=cpu_group)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    spin = getattr(torch.cuda, "_sleep", None)
    launch_ns = []
    t0 = time.time_ns()
    for i in range(calls):
        if mode == "sync":
            torch.cuda.synchronize()
            dist.barrier(group=cpu_group)
            if spin is not None:
                spin(SPIN_CYCLES)
        starts[i].record()
        launch_ns.append(time.time_ns())
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    t1 = time.time_ns()
    event_ns = [int(s.elapsed_time(e) * 1e6) for s, e in zip(starts, ends, strict=True)]
    dist.barrier(group=cpu_group)
    return {
        "mode": mode,
        "op": op,
        "bytes": nbytes,
        "calls": calls,
        "t0_ns": t0,
        "t1_ns": t1,
        "event_ns": event_ns,
        "launch_ns": launch_ns,
    }


def run_graph(rank: int, world: int, dev: torch.device, cpu_group, per_graph: int, replays: int) -> dict:
    x = torch.ones(1 << 18, dtype=torch.int32, device=dev)  # 1 MiB
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            dist.all_reduce(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            dist.all_reduce(x)
    torch.cuda.synchronize()
    dist.barrier(group=cpu_group)
    t0 = time.time_ns()
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    t1 = time.time_ns()
    dist.barrier(group=cpu_group)
    return {"op": "AllReduce", "bytes": 1 << 20, "replays": replays, "per_graph": per_graph, "t0_ns": t0, "t1_ns": t1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--modes", default="sync,b2b")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--graph", action="store_true")
    args = ap.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    cpu_group = dist.new_group(backend="gloo")
    a2a_group = dist.new_group(ranks=list(range(world)), backend="nccl")
    out = {
        "world": world,
        "rank": rank,
        "pid": os.getpid(),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "configs": [],
        "graph": None,
    }
    for mode in args.modes.split(","):
        for op in args.ops.split(","):
            for nbytes in map(int, args.sizes.split(",")):
                out["configs"].append(
                    run_config(mode, op, nbytes, args.calls, args.warmup, rank, world, dev, cpu_group, a2a_group)
                )
                torch.cuda.empty_cache()
    if args.graph:
        try:
            out["graph"] = run_graph(rank, world, dev, cpu_group, per_graph=20, replays=10)
        except Exception as e:  # noqa: BLE001 - report, the rest of the results still count
            out["graph"] = {"error": repr(e)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"calls-rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier(group=cpu_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
