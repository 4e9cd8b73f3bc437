"""Record parsing, lines per CPU-second: the contract parser against the fast parse.

``records.parse_line`` (the contract's authority, pure Python) and
``ingest.parse.parse_record`` (msgspec decode, the same dataclasses out, falling back to
``parse_line`` for anything it does not accept) on the same lines of a suite scenario,
alternating in every repeat. Checks first that both give equal records for every line.

    .venv/bin/python bench/ingest/bench_parse.py [--scenario steady_2x8] [--lines 20000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ncclwatch.ingest.parse import parse_record
from ncclwatch_testkit import scenarios

from ncclwatch.records import parse_line, to_json


def rate(fn, lines: list[bytes]) -> float:
    t = time.process_time()
    for line in lines:
        fn(line)
    return len(lines) / (time.process_time() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="steady_2x8")
    ap.add_argument("--lines", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    recs, _ = scenarios.generate(scenarios.by_name(args.scenario))
    lines = [to_json(r).encode() for r in recs][: args.lines]
    assert all(parse_line(x) == parse_record(x) for x in lines), "the two parsers disagree"
    kinds = sorted({r.KIND for r in recs[: args.lines]})
    rates: dict[str, list[float]] = {"parse_line": [], "parse_record": []}
    for i in range(args.repeats):
        order = [("parse_line", parse_line), ("parse_record", parse_record)]
        for name, fn in order if i % 2 == 0 else order[::-1]:
            rates[name].append(rate(fn, lines))
    print(f"{len(lines):,} lines ({', '.join(kinds)}) of {args.scenario}, {args.repeats} repeats")
    for name, r in rates.items():
        print(f"{name:<13} median {statistics.median(r):>9,.0f} lines/CPU-s  min {min(r):,.0f}  max {max(r):,.0f}")
    ratio = [b / a for a, b in zip(rates["parse_line"], rates["parse_record"], strict=True)]
    print(f"parse_record / parse_line per repeat: median {statistics.median(ratio):.2f}x "
          f"({min(ratio):.2f}-{max(ratio):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
