"""What a two-stage detector topology would cost per stage, measured on today's Pipeline.

A two-stage topology (docs/architecture.md, "Two stages") would split the detector
library's work in two:

- **key stage**, keyed per communicator: gather one key's window summaries of all its
  ranks (``Pipeline._window``'s grouping), close the group, update the key's baselines,
  sustained rules and spread scorer (``_close_group`` and what it calls for the key);
- **job stage**, keyed per job: everything a closed group's verdict sets off (incidents,
  attribution across communicators, stragglers, throughput correlation, ticks,
  telemetry checks), and throughput records.

This bench times both parts of one ``Pipeline`` fed a healthy synthetic job
(``ncclwatch_testkit.scenarios``), with wrappers around the methods that mark the
boundary: key stage = ``_window`` minus the job-level calls made from it (``_tick``,
``_key_fired``, ``_key_resolved``, ``_spread_fired``, ``_spread_resolved``); job stage =
the rest of ``process``. It also counts the key stage's output: closed groups, one
verdict each, which is what the job stage would read instead of windows. CPU time of
this process (``time.process_time``), medians over ``--repeats``. ::

    .venv/bin/python bench/detectors/bench_stages.py [--repeats 3] [--cases 8x8,16x8]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime

from ncclwatch.detectors import pipeline
from ncclwatch.detectors.pipeline import Pipeline
from ncclwatch_testkit import scenarios

from ncclwatch.config import DetectorConfig

JOB_CALLS = ("_tick", "_key_fired", "_key_resolved", "_spread_fired", "_spread_resolved")


class StageClock:
    """Wraps Pipeline methods (on the class, for this process only) to split its time."""

    def __init__(self) -> None:
        self.window_s = 0.0  # inclusive time of _window
        self.job_in_window_s = 0.0  # job-level calls made while in _window
        self.by_call: dict[str, float] = dict.fromkeys(JOB_CALLS, 0.0)
        self.groups = 0
        self._depth = 0
        self._saved: dict[str, object] = {}

    def install(self) -> None:
        cls = pipeline.Pipeline
        clock = self
        self._saved = {name: getattr(cls, name) for name in ("_window", "_close_group", *JOB_CALLS)}
        window, close_group = self._saved["_window"], self._saved["_close_group"]

        def timed_window(self_, w, out):  # type: ignore[no-untyped-def]
            t = time.process_time()
            window(self_, w, out)
            clock.window_s += time.process_time() - t

        def counted_close_group(self_, *a):  # type: ignore[no-untyped-def]
            clock.groups += 1
            return close_group(self_, *a)

        def job_call(name, original):  # type: ignore[no-untyped-def]
            def timed(self_, *a, **kw):  # type: ignore[no-untyped-def]
                if clock._depth:
                    return original(self_, *a, **kw)
                clock._depth += 1
                t = time.process_time()
                try:
                    return original(self_, *a, **kw)
                finally:
                    dt = time.process_time() - t
                    clock.job_in_window_s += dt
                    clock.by_call[name] += dt
                    clock._depth -= 1
            return timed

        cls._window = timed_window
        cls._close_group = counted_close_group
        for name in JOB_CALLS:
            setattr(cls, name, job_call(name, self._saved[name]))

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(pipeline.Pipeline, name, fn)


def one_run(records: list) -> dict:
    clock = StageClock()
    clock.install()
    try:
        p = Pipeline(DetectorConfig())
        t = time.process_time()
        for r in records:
            p.process(r)
        p.flush()
        total = time.process_time() - t
    finally:
        clock.uninstall()
    key = clock.window_s - clock.job_in_window_s
    return {"total_s": total, "key_s": key, "job_s": total - key, "groups": clock.groups,
            "tick_s": clock.by_call["_tick"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default="8x8,16x8", help="NODESxGPUS, comma-separated")
    ap.add_argument("--seconds", type=int, default=60)
    args = ap.parse_args()
    print(json.dumps({"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.node(),
                      "python": platform.python_version()}), flush=True)
    for case in args.cases.split(","):
        nodes, gpus = (int(x) for x in case.split("x"))
        records, _ = scenarios.generate(scenarios.Scenario("stages", nodes, gpus, args.seconds, seed=7))
        windows = sum(1 for r in records if r.KIND == "window")
        runs = [one_run(records) for _ in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in ("total_s", "key_s", "job_s", "tick_s")}
        groups = runs[0]["groups"]
        print(json.dumps({
            "case": case, "ranks": nodes * gpus, "windows": windows, "groups": groups,
            "ranks_per_group": round(windows / groups, 1),
            "total_us_per_window": round(1e6 * med["total_s"] / windows, 2),
            "key_us_per_window": round(1e6 * med["key_s"] / windows, 2),
            "job_us_per_group": round(1e6 * med["job_s"] / groups, 2),
            "tick_share_of_job": round(med["tick_s"] / med["job_s"], 3),
            "tick_us_per_rank_second": round(1e6 * med["tick_s"] / (nodes * gpus * args.seconds), 2),
            "key_share": round(med["key_s"] / med["total_s"], 3),
            "spread_key_share": [round(r["key_s"] / r["total_s"], 3) for r in runs],
        }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
