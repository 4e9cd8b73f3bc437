"""Real GPU runs replayed as if the trainer logged its throughput once per 5 s
(``eval_gpu_runs.coarser_throughput``: Megatron's TFLOP/s over a log interval), the way
a job with a log interval of a few steps, or with steps of seconds, reports it."""

from __future__ import annotations

import sys
from pathlib import Path

from ncclwatch.config import load

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "tests" / "fixtures" / "gpu_runs"
sys.path.insert(0, str(ROOT / "bench" / "detectors"))
import eval_gpu_runs  # noqa: E402


def judged(names: list[str], max_delay_s: float) -> tuple[list[dict], str]:
    rows = eval_gpu_runs.evaluate([RUNS / f"{n}.tar.gz" for n in names], load(None, environ={}),
                                  max_delay_s, log_interval_s=5.0)
    return rows, eval_gpu_runs.markdown(rows)


def test_every_rank_slower_is_found_with_one_throughput_line_per_5_s():
    """Ten lines of baseline warm-up were 50 s of these 44-s runs: nothing was found.
    A line counts for the windows it spans, so the warm-up takes its ten windows' time
    (and three lines of its own); the drop is found within two lines of its start."""
    rows, table = judged(["2026-11-26/p-slow-all-1.5x", "2026-11-27-x4/p4-slow-all-1.2x",
                          "2026-11-27-x4/i4n4-slow-all-1.3x"], 11.0)
    for r in rows:
        assert r["ok"] and r["got"] == "throughput_drop" and r["false_alerts"] == [], table


def test_a_line_that_caught_a_comm_faults_first_second_is_not_called_not_nccl():
    """A line whose interval ends a second into a straggler or a network fault is down
    over its whole span; NCCL is judged on the windows up to the line, with the time its
    keys need to call the fault sustained, so the comm anomaly carries the loss."""
    rows, table = judged(["2026-11-23/p-strag-gpu-4x", "2026-11-23/p-strag-proc-2x",
                          "2026-11-23/i-strag-proc-4x", "2026-11-27-x4/i4-tc-24g",
                          "2026-11-27-x4/i4-cpu-k2", "2026-11-27-x4/p4-strag-r3-1.5x"], 5.0)
    for r in rows:
        assert r["ok"] and r["false_alerts"] == [], table
