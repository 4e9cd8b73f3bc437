"""Detector throughput (window summaries / s through one Pipeline) and detection delays.

    .venv/bin/python bench/detectors/bench_pipeline.py --repeats 5 --out docs/bench/detectors.md

Throughput: synthetic streams from ``ncclwatch_testkit.scenarios`` (healthy, with
throughput records; generation is not timed), fed record by record to a fresh
``Pipeline`` (``process`` for each record, ``flush`` at the end), per topology, without
and with ``DetectorMetrics`` bound. Rates are window summaries per CPU-second of this
process (``time.process_time``: the machine is shared, wall time is given too); medians
over repeats with min-max. State: size and time of ``to_state()`` + ``json.dumps`` at
the end of the stream (the Faust worker saves a job's state after every batch).

Delays: the suite with several seeds; detection delay of every detected required label.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ncclwatch.detectors.evaluate import evaluate, percentile
from ncclwatch.detectors.metrics import DetectorMetrics
from ncclwatch.detectors.pipeline import Pipeline, detect_all
from ncclwatch_testkit import scenarios

from ncclwatch.config import DetectorConfig

CASES = [  # (name, nodes, gpus per node, seconds)
    ("1x2 (2 ranks, 2 keys)", 1, 2, 600),
    ("2x8 (16 ranks, 14 keys)", 2, 8, 300),
    ("8x8 (64 ranks, 26 keys)", 8, 8, 60),
]
COMM = {"network_path", "intra_node", "straggler", "collective_degraded"}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def one_run(records, with_metrics: bool):
    cfg = DetectorConfig()
    p = Pipeline(cfg)
    if with_metrics:
        DetectorMetrics(max_keys=cfg.max_metric_keys).bind(p)
    c0, w0 = time.process_time(), time.perf_counter()
    for r in records:
        p.process(r)
    p.flush()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    t0 = time.perf_counter()
    text = json.dumps(p.to_state())
    state_s = time.perf_counter() - t0
    return cpu, wall, len(text), state_s


def bench_throughput(repeats: int) -> list[dict]:
    rows = []
    for name, nodes, gpus, seconds in CASES:
        sc = scenarios.Scenario("bench", nodes, gpus, seconds, seed=7)
        records, _ = scenarios.generate(sc)
        windows = sum(1 for r in records if r.KIND == "window")
        for with_metrics in (False, True):
            runs = [one_run(records, with_metrics) for _ in range(repeats)]
            rates = sorted(windows / r[0] for r in runs)
            walls = sorted(windows / r[1] for r in runs)
            rows.append({
                "case": name, "metrics": with_metrics, "windows": windows,
                "records": len(records), "median": statistics.median(rates),
                "min": rates[0], "max": rates[-1], "wall": statistics.median(walls),
                "state_kb": runs[-1][2] / 1024,
                "state_ms": 1000 * statistics.median(r[3] for r in runs),
            })
            print(rows[-1], file=sys.stderr)
    return rows


def bench_delays(seeds: range) -> dict:
    pairs = []
    for sc in scenarios.suite():
        for s in seeds:
            sc2 = dataclasses.replace(sc, seed=s, name=f"{sc.name}@{s}")
            records, labels = scenarios.generate(sc2)
            pairs.append((labels, detect_all(records, DetectorConfig())))
    report = evaluate(pairs)
    by_group: dict[str, list[float]] = {"comm degradations": [], "throughput_drop": [],
                                        "telemetry_loss": []}
    for s in report["scenarios"]:
        for m in s["matches"]:
            if not m["detected"]:
                continue
            group = "comm degradations" if m["type"] in COMM else m["type"]
            by_group[group].append(m["delay_s"])
    return {"report": report, "delays": {k: sorted(v) for k, v in by_group.items()},
            "streams": len(pairs)}


def render(rows: list[dict], delays: dict, repeats: int, seeds: range) -> str:
    today = dt.date.today().isoformat()
    py = platform.python_version()
    out = [
        f"Measured {today} on `nproc`={subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()}, "
        f"{cpu_model()}, Python {py}; {repeats} repeats per row (fresh Pipeline each).",
        "",
        "| stream | metrics bound | windows | windows / CPU-s, median | min – max "
        "| windows / s wall, median | state JSON | to_state + dumps |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        out.append(
            f"| {r['case']} | {'yes' if r['metrics'] else 'no'} | {r['windows']:,} | "
            f"{r['median']:,.0f} | {r['min']:,.0f} – {r['max']:,.0f} | {r['wall']:,.0f} | "
            f"{r['state_kb']:.0f} KiB | {r['state_ms']:.1f} ms |"
        )
    out += [
        "",
        f"Detection delay (stream time, label start → `detected_ns`), suite × seeds "
        f"{seeds.start}–{seeds.stop - 1} ({delays['streams']} streams):",
        "",
        "| labels | detected | p50 s | p90 s | p99 s | max s | ≤ 3 s | ≤ 4 s | ≤ 5 s | ≤ 8 s | > 8 s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for group, d in delays["delays"].items():
        if not d:
            continue
        buckets = [sum(1 for x in d if x <= lim) for lim in (3, 4, 5, 8)]
        out.append(
            f"| {group} | {len(d)} | {percentile(d, 50):.1f} | {percentile(d, 90):.1f} | "
            f"{percentile(d, 99):.1f} | {d[-1]:.1f} | " + " | ".join(str(b) for b in buckets)
            + f" | {len(d) - buckets[-1]} |"
        )
    t = delays["report"]["total"]
    out += ["", f"Over those streams: recall {t['recall']:.1%}, precision "
            f"{t['precision']:.1%} ({t['anomalies_fp']} false alarms), attribution "
            f"{t['attribution_accuracy']:.1%}."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=5, help="seeds for the delay distribution")
    ap.add_argument("--out", type=Path, help="update the marked section of this Markdown file")
    args = ap.parse_args(argv)
    rows = bench_throughput(args.repeats)
    seeds = range(2000, 2000 + args.seeds)
    delays = bench_delays(seeds)
    text = render(rows, delays, args.repeats, seeds)
    print(text)
    if args.out:
        doc = args.out.read_text()
        new = re.sub(r"<!-- bench:start -->.*<!-- bench:end -->",
                     lambda _: f"<!-- bench:start -->\n{text}<!-- bench:end -->", doc, flags=re.S)
        args.out.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
