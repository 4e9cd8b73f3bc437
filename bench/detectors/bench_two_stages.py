"""One large job through the detector library's two stages, its key stage spread over
1, 2, 4 ... processes: how the rate grows with processes, what the job stage costs, and
whether the events stay the same.

The job is ``ncclwatch_testkit.scenarios``' synthetic job (5 keys per rank: a world
communicator, one per node, one per local GPU index; 1 s windows) with a network fault
on one node, its forwarders' publication delays bounded to 1-3.5 s. Its windows are
split by communicator (``ncclwatch_testkit.stages.shard_of``) before timing; then

- **key stage**: ``--processes`` forked processes run a
  :class:`~ncclwatch.detectors.keys.KeyStage` each over their share and send their
  verdicts back in their wire format (``encode_verdict``) through a pipe. Timed: wall
  clock from the start of the first to the return of the last (the rate), and each
  process's CPU time, encoding included;
- **job stage**: one ``Pipeline`` decodes every verdict and reads them with the job's
  throughput records in the canonical order (``stages.job_stage_input``). Timed: CPU
  time, decoding and ordering included;
- **one process**: a ``Pipeline`` fed the windows (both stages), for reference.

This runs the library's stages as a two-stage topology would, with processes and pipes
in place of Kafka: it measures how the detector work divides, not the Faust worker
(docs/architecture.md says what of that is built). ::

    .venv/bin/python bench/detectors/bench_two_stages.py --nodes 2048 --gpus 8 --seconds 30 \\
        --processes 1,2,4 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import platform
import resource
import statistics
import time
from datetime import UTC, datetime

from ncclwatch.detectors.keys import decode_verdict, encode_verdict
from ncclwatch.detectors.pipeline import Pipeline
from ncclwatch_testkit import scenarios, stages

from ncclwatch.config import DetectorConfig

CFG = DetectorConfig()
_PARTS: list[list] = []  # the windows per shard, inherited by forked processes


def _key_stage(shard: int) -> tuple[list[bytes], float]:
    t = time.process_time()
    verdicts = [encode_verdict(v) for v in stages.key_stage(_PARTS[shard], CFG)]
    return verdicts, time.process_time() - t


def key_stages(parts: list[list], processes: int) -> tuple[list, float, list[float]]:
    """Every shard through its own process; (verdicts, wall seconds, CPU seconds each)."""
    global _PARTS
    _PARTS = parts
    ctx = multiprocessing.get_context("fork")
    t = time.perf_counter()
    with ctx.Pool(processes) as pool:
        results = pool.map(_key_stage, range(len(parts)), chunksize=1)
    wall = time.perf_counter() - t
    verdicts = [v for blobs, _ in results for v in blobs]
    return verdicts, wall, [cpu for _, cpu in results]


def one_process(records: list) -> tuple[list, float]:
    t = time.process_time()
    p = Pipeline(CFG)
    events = []
    for r in records:
        events += p.process(r)
    events += p.flush()
    return events, time.process_time() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--nodes", type=int, default=256)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--processes", default="1,2,4", help="key stage process counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-one-process", action="store_true")
    args = ap.parse_args()
    counts = [int(x) for x in args.processes.split(",")]
    print(json.dumps({"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.node(),
                      "cpus": os.cpu_count(), "python": platform.python_version(),
                      "command": "bench/detectors/bench_two_stages.py", "args": vars(args)}), flush=True)
    fault_start = max(15, args.seconds // 2)
    sc = scenarios.Scenario(
        "two-stages", args.nodes, args.gpus, args.seconds, seed=11,
        faults=(scenarios.Fault("network", fault_start, args.seconds, 0.3, node=1),),
        forwarder_delay_s=tuple(1.0 + 0.35 * (i % 8) for i in range(args.nodes)),
    )
    t = time.perf_counter()
    records, _ = scenarios.generate(sc)
    # The input is the harness's, not a stage's: keep the cyclic GC from walking its
    # millions of objects in every stage (and from copying them into each forked one).
    gc.freeze()
    windows = sum(1 for r in records if r.KIND == "window")
    print(json.dumps({"ranks": sc.nranks, "windows": windows, "windows_per_s": windows // args.seconds,
                      "generate_s": round(time.perf_counter() - t, 1)}), flush=True)

    reference = None
    if not args.skip_one_process:
        runs = [one_process(records) for _ in range(args.repeats)]
        reference = runs[0][0]
        cpu = [c for _, c in runs]
        print(json.dumps({"stage": "one process", "cpu_s": [round(c, 2) for c in cpu],
                          "windows_per_cpu_s": round(windows / statistics.median(cpu)),
                          "events": [(e.type, e.state) for e in reference]}), flush=True)

    results: dict[int, dict] = {}
    events_by_count: dict[int, list] = {}
    for _ in range(args.repeats):
        for n in counts:  # interleaved, so machine noise spreads over every count
            parts, other = stages.split(records, n)
            gc.freeze()
            blobs, wall, cpus = key_stages(parts, n)
            t = time.process_time()
            verdicts = [decode_verdict(b) for b in blobs]
            events = stages.job_stage(stages.job_stage_input(verdicts, other), CFG)
            job_cpu = time.process_time() - t
            r = results.setdefault(n, {"wall": [], "key_cpu": [], "job_cpu": [], "verdicts": len(verdicts)})
            r["wall"].append(wall)
            r["key_cpu"].append(sum(cpus))
            r["job_cpu"].append(job_cpu)
            events_by_count.setdefault(n, events)
            assert events == events_by_count[n], "a repeat gave other events"
    base = events_by_count[counts[0]]
    rate1 = windows / statistics.median(results[counts[0]]["wall"])
    for n in counts:
        r = results[n]
        wall = statistics.median(r["wall"])
        rate = windows / wall
        print(json.dumps({
            "stage": "key", "processes": n, "wall_s": [round(x, 2) for x in r["wall"]],
            "windows_per_s": round(rate), "speedup": round(rate / rate1, 2),
            "per_process_efficiency": round(rate / rate1 / (n / counts[0]), 2),
            "windows_per_cpu_s": round(windows / statistics.median(r["key_cpu"])),
            "verdicts": r["verdicts"],
            "job_stage_cpu_s": [round(x, 2) for x in r["job_cpu"]],
            "job_stage_verdicts_per_cpu_s": round(r["verdicts"] / statistics.median(r["job_cpu"])),
            "job_stage_job_seconds_per_cpu_s": round(args.seconds / statistics.median(r["job_cpu"]), 2),
            "events_same_as_first_count": events_by_count[n] == base,
            "events": [(e.type, e.state, e.host) for e in events_by_count[n]],
        }), flush=True)
    if reference is not None:
        same = [(e.type, e.state, e.host, e.start_ns) for e in reference] == [
            (e.type, e.state, e.host, e.start_ns) for e in base]
        print(json.dumps({"same_incidents_as_one_process": same}), flush=True)
    print(json.dumps({"max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
