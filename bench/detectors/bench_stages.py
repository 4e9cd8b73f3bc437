"""What each of the detector library's two stages costs, per window and per verdict.

The library is split where a two-stage topology (docs/architecture.md, "Two stages")
would cut it:

- **key stage** (:mod:`ncclwatch.detectors.keys`), per communicator: gather one key's
  window summaries of all its ranks (``KeyState.add``), hand back the groups that are
  due (``take_upto``, ``due``) and close each into a ``KeyVerdict`` against the key's
  baselines, sustained rules and spread scorer (``KeyState.close``);
- **job stage** (:mod:`ncclwatch.detectors.pipeline`), per job: everything else
  ``Pipeline.process`` does: liveness and stream time, what each verdict sets off
  (incidents, attribution across communicators, stragglers, throughput correlation),
  the once-a-window tick, telemetry checks, throughput records.

This bench feeds a healthy synthetic job (``ncclwatch_testkit.scenarios``: 5 keys per
rank, 1 s windows) through a whole ``Pipeline``, then through the key stage alone
(:func:`key_stage`, closing groups on each communicator's own stream time, as a stage
keyed per communicator would); the job stage is the difference. No timer runs per call,
whose own cost would blur a split of microseconds. CPU time of this process
(``time.process_time``), medians over ``--repeats``; the verdict counts of both runs
are compared (they close the same groups on a healthy job). Large jobs need the forwarders'
publication delays bounded (``--delays``), as the scenario's default grows with the
node index. ::

    .venv/bin/python bench/detectors/bench_stages.py [--repeats 3] [--cases 8x8,16x8] [--seconds 60]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import time
from datetime import UTC, datetime

from ncclwatch.detectors.keys import KeyParams, KeyState
from ncclwatch.detectors.pipeline import Pipeline
from ncclwatch_testkit import scenarios

from ncclwatch.config import DetectorConfig


def key_stage(records: list, p: KeyParams, lateness_windows: int) -> tuple[int, int]:
    """The key stage alone, as a worker keyed per communicator would run it: group each
    key's windows, close complete groups, and at each window boundary of a
    communicator's stream time close its groups that waited ``lateness_windows``.
    Returns (keys, verdicts)."""
    keys: dict[tuple, KeyState] = {}
    comm_time: dict[tuple, list[int]] = {}  # (job, comm) -> [watermark, next tick]
    pending: dict[tuple, dict[tuple, KeyState]] = {}
    verdicts = 0
    for w in records:
        if w.KIND != "window" or w.transport == "single":
            continue
        ck = (w.job, w.comm)
        gk = (w.job, w.comm, w.op, w.size_bucket, w.transport)
        ks = keys.get(gk)
        if ks is None:
            ks = keys[gk] = KeyState(w, p)
        t = comm_time.get(ck)
        if t is None:
            t = comm_time[ck] = [-1, -1]
            pending[ck] = {}
        if w.end_ns > t[0]:
            t[0] = w.end_ns
        complete = ks.add(w)
        if complete is not None:
            pending[ck][gk] = ks
            if complete:
                for s, g in ks.take_upto(w.start_ns):
                    ks.close(s, g, p)
                    verdicts += 1
        if t[0] >= t[1]:
            win = ks.window_ns
            t[1] = t[0] - t[0] % win + win
            due = t[0] - lateness_windows * win
            for k, kst in list(pending[ck].items()):
                start = kst.due(due)
                if start is not None:
                    for s, g in kst.take_upto(start):
                        kst.close(s, g, p)
                        verdicts += 1
                if not kst.pending:
                    del pending[ck][k]
    return len(keys), verdicts


def one_run(records: list, cfg: DetectorConfig) -> dict:
    t = time.process_time()
    p = Pipeline(cfg)
    for r in records:
        p.process(r)
    p.flush()
    total = time.process_time() - t
    t = time.process_time()
    _, verdicts = key_stage(records, KeyParams(cfg), cfg.lateness_windows)
    key = time.process_time() - t
    return {"total_s": total, "key_s": key, "job_s": total - key, "verdicts": verdicts, "keys": p.key_count()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default="8x8,16x8", help="NODESxGPUS, comma-separated")
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--delays", type=int, default=0, metavar="N",
                    help="forwarder delays cycle over N values from 1.0 s in 0.35 s steps (0: the "
                         "scenario's default, 1.0 + 0.35 s x node)")
    args = ap.parse_args()
    print(json.dumps({"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.node(),
                      "python": platform.python_version()}), flush=True)
    for case in args.cases.split(","):
        nodes, gpus = (int(x) for x in case.split("x"))
        delays = tuple(1.0 + 0.35 * (i % args.delays) for i in range(nodes)) if args.delays else ()
        sc = scenarios.Scenario("stages", nodes, gpus, args.seconds, seed=7, forwarder_delay_s=delays)
        t = time.perf_counter()
        records, _ = scenarios.generate(sc)
        gen_s = time.perf_counter() - t
        windows = sum(1 for r in records if r.KIND == "window")
        runs = [one_run(records, DetectorConfig()) for _ in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in ("total_s", "key_s", "job_s")}
        verdicts = runs[0]["verdicts"]
        print(json.dumps({
            "case": case, "ranks": nodes * gpus, "seconds": args.seconds, "windows": windows,
            "keys": runs[0]["keys"], "verdicts": verdicts,
            "ranks_per_verdict": round(windows / verdicts, 1),
            "total_us_per_window": round(1e6 * med["total_s"] / windows, 2),
            "key_us_per_window": round(1e6 * med["key_s"] / windows, 2),
            "job_us_per_verdict": round(1e6 * med["job_s"] / verdicts, 2),
            "job_us_per_window": round(1e6 * med["job_s"] / windows, 2),
            "key_share": round(med["key_s"] / med["total_s"], 3),
            "spread_key_share": [round(r["key_s"] / r["total_s"], 3) for r in runs],
            "generate_s": round(gen_s, 1),
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
