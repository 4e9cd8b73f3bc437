"""What one save of a large job's state costs the job worker, with and without garbage
collection while it is built (``stream.collection_paused``, which ``StreamCore`` uses).

The job is ``bench_stages.py``'s synthetic one (``--nodes`` × 8 GPUs, 5 keys per rank,
1 s windows, ``--seconds`` of it), its windows through the library's key stage and its
verdicts into one job stage (``Pipeline``), in a process set up as the worker is
(``collect_less_often`` first). Each save is what the worker does per job: the job
stage's ``to_state()`` and the table codec's entries (``detectors/saved.py``). Sides
alternate; CPU seconds per save, medians. ::

    .venv/bin/python bench/worker/bench_save.py --nodes 6144 --seconds 8 --repeats 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from datetime import UTC, datetime

from bench_stages import job_records
from bench_worker import cpu_model
from ncclwatch.detectors.pipeline import Pipeline
from ncclwatch.detectors.saved import StateCodec
from ncclwatch.detectors.stream import collect_less_often, collection_paused
from ncclwatch_testkit import stages

from ncclwatch.config import DetectorConfig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--nodes", type=int, default=2048)
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    collect_less_often()  # as the worker, before anything it holds is built
    cfg = DetectorConfig()
    records = job_records(args.nodes, 8, args.seconds, args.seconds // 2)
    parts, other = stages.split(records, 1)
    inputs = stages.job_stage_input([v for part in parts for v in stages.key_stage(part, cfg)], other)
    del records, parts
    job_stage = Pipeline(cfg)
    for r in inputs:
        job_stage.process(r)
    del inputs
    codec = StateCodec()
    print(json.dumps({"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.node(),
                      "cpu": cpu_model(), "python": platform.python_version(),
                      "command": "bench/worker/bench_save.py", "args": vars(args)}), flush=True)
    sides = {"collecting": contextlib.nullcontext, "paused": collection_paused}
    cost: dict[str, list[float]] = {side: [] for side in sides}
    for i in range(args.repeats):
        for side in list(sides) if i % 2 == 0 else list(sides)[::-1]:
            t = time.process_time()
            with sides[side]():
                state = job_stage.to_state()
            size = sum(len(v or b"") for _, v in codec.entries("job", state))
            cost[side].append(time.process_time() - t)
            print(json.dumps({"side": side, "cpu_s": round(cost[side][-1], 3), "bytes": size}), flush=True)
    print(json.dumps({side: {"median_cpu_s": round(statistics.median(c), 3), "min": round(min(c), 3),
                             "max": round(max(c), 3)} for side, c in cost.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
