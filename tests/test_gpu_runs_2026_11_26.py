"""The 6 real 2×H100 runs of 2026-11-26: faults the runs of 11-23 did not have.

``tests/fixtures/gpu_runs/2026-11-26`` (README there): a job on NVLink only with another
process's peer copies competing on both GPUs (one direction: the copies' destination GPU
becomes the slow one; both directions: both GPUs compute slower and no link is at fault),
a ``tc`` throttle switched on and off every 4 s, one of only 8 s, and a straggler on
global rank 0 (the rank that reports throughput). Every run was first judged by the
detectors of 924e91c: 2 of 6 right; the transfer check, the straggler rule measured against
the key's usual spread and reopening an incident that fires again came from them, so all 6
are tuning data, not held out.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ncclwatch.config import load

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "gpu_runs" / "2026-11-26"
sys.path.insert(0, str(ROOT / "bench" / "detectors"))
import eval_gpu_runs  # noqa: E402

CFG = load(None, environ={})


def test_the_runs_of_2026_11_26_are_judged_as_measured():
    rows = {r["run"]: r for r in eval_gpu_runs.evaluate(eval_gpu_runs.run_dirs([str(FIXTURES)], "all"),
                                                         CFG, 5.0)}
    assert len(rows) == 6
    table = eval_gpu_runs.markdown(list(rows.values()))
    for name in ("n-clean", "n-nvlink-1x1", "p-strag-proc0-2x", "p-tc-pulse-12g", "p-tc-short-16g"):
        assert rows[name]["ok"], table
    # An intermittent fault is one incident, found on its first pulse.
    assert rows["p-tc-pulse-12g"]["got"] == "network_path" and rows["p-tc-pulse-12g"]["false_alerts"] == []
    # Competing copies that slow one GPU: that GPU's process is named, not the link.
    assert rows["n-nvlink-1x1"]["got"] == "straggler rank 1"
    # Both GPUs slower, no link at fault: "not NCCL", a warning; found 0.5 s past the
    # 5 s bound (the throughput decision waits sustain_windows for comm evidence).
    slow = rows["n-nvlink-4x2"]
    assert slow["got"] == "throughput_drop" and slow["false_alerts"] == [], table
    assert slow["severity"] == "warning" and slow["delay_s"] <= 6.0, table
