"""Spool discovery per poll, from 2 to 256 streams: listing every directory each poll
(what ``SpoolTailer.discover`` did before) against listing only changed directories.

A spool of ``--jobs`` job directories holding N streams of ``--segments`` segments each,
last modified a minute ago (a steady spool between segment rotations, where a forwarder
spends nearly all its polls). Microseconds per ``discover()``, median of ``--repeats``
rounds of 200 calls, both variants alternating.

    .venv/bin/python bench/ingest/bench_discover.py [--jobs 4] [--segments 3] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from ncclwatch.ingest.spool import SpoolTailer


class ListEverything(SpoolTailer):
    """The listing before: every directory, every poll."""

    RACY_S = float("inf")


def make_spool(root: Path, jobs: int, streams: int, segments: int) -> None:
    old = time.time() - 60
    for j in range(jobs):
        d = root / f"job{j}"
        d.mkdir()
        for s in range(streams // jobs or 1):
            for g in range(segments):
                (d / f"node{j}-GPU-{s:03d}-{1000 + s}.{g:06d}.jsonl").write_bytes(b"")
        os.utime(d, (old, old))
    os.utime(root, (old, old))


def per_call_us(t: SpoolTailer, calls: int = 200) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        t.discover()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--segments", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    print("| streams | segments | every directory, µs/poll (median, min–max) | changed ones only | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for streams in (2, 16, 64, 256):
        with tempfile.TemporaryDirectory() as tmp:
            make_spool(Path(tmp), min(args.jobs, streams), streams, args.segments)
            before, after = ListEverything(tmp), SpoolTailer(tmp)
            n = len(after.discover())
            assert before.discover() == after.discover() and n == streams
            a, b = [], []
            for i in range(args.repeats):
                for name, t in ([("a", before), ("b", after)] if i % 2 == 0 else [("b", after), ("a", before)]):
                    (a if name == "a" else b).append(per_call_us(t))
            print(f"| {streams} | {streams * args.segments} "
                  f"| {statistics.median(a):,.0f} ({min(a):,.0f}–{max(a):,.0f}) "
                  f"| {statistics.median(b):,.0f} ({min(b):,.0f}–{max(b):,.0f}) "
                  f"| {statistics.median(a) / statistics.median(b):.1f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
