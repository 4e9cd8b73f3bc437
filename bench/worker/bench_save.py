"""What one save of a large job's state costs the job worker: built with garbage
collection on (``collecting``); built inside ``stream.collection_paused`` and encoded
after it (``paused``, StreamCore before 2026-11-28 afternoon); built, encoded and freed
inside it (``encoded_in_pause``, StreamCore's ``encode_state``, as the worker saves now).
Each side ends with the young collection that the worker's next allocation sets off
(``gc.collect(0)``): it walks whatever the pause left alive.

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
import gc
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
    def collecting() -> list:
        return codec.entries("job", job_stage.to_state())

    def paused() -> list:
        with collection_paused():
            state = job_stage.to_state()
        gc.collect(0)  # the state still alive
        return codec.entries("job", state)

    def encoded_in_pause() -> list:
        with collection_paused():
            entries = codec.entries("job", job_stage.to_state())
        gc.collect(0)
        return entries

    sides = {"collecting": collecting, "paused": paused, "encoded_in_pause": encoded_in_pause}
    cost: dict[str, list[float]] = {side: [] for side in sides}
    for i in range(args.repeats):
        for side in list(sides) if i % 2 == 0 else list(sides)[::-1]:
            t = time.process_time()
            entries = sides[side]()
            cost[side].append(time.process_time() - t)
            size = sum(len(v or b"") for _, v in entries)
            del entries
            print(json.dumps({"side": side, "cpu_s": round(cost[side][-1], 3), "bytes": size}), flush=True)
    print(json.dumps({side: {"median_cpu_s": round(statistics.median(c), 3), "min": round(min(c), 3),
                             "max": round(max(c), 3)} for side, c in cost.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
