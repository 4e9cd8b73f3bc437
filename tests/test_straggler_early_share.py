"""A rank late since before the job's loss began takes no blame for it.

Recorded: `i1x2-sync-ramp-24-12-6` (one H200 shared by two pretend nodes, steps
synchronised by a 16-B AllReduce, a 24 -> 12 -> 6 Gbit/s ramp through Inspector). Rank 0
arrives last at the sync AllReduce now and then in clean runs too; here its straggler
incident opened 1.6 s before the ramp, and the ramp's first step then cost the job 5 %:
the straggler was raised for it, 3.4 s in. In its first windows the job had lost only
half of that (every true straggler recorded: at least 0.74 of it), so with
`detector.straggler_early_share` (0.6) it is held, and the ramp is the `network_path`.
The share is of twice the gate at most: a 4x straggler replayed with sampled GPU timing
(tests/test_gpu_runs_2026_11_23.py) lost 34 % early against 71 % now, its sparse steps
straddling the incident's start.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ncclwatch.detectors.evaluate import events_of
from ncclwatch.ingest.recording import Options

from ncclwatch import config
from ncclwatch.config import DetectorConfig

GPU_RUNS = Path(__file__).parent / "fixtures" / "gpu_runs"
RAMP = GPU_RUNS / "2026-11-29-x1" / "i1x2-sync-ramp-24-12-6.tar.gz"
# a 1.25x straggler through Inspector whose first windows cost 0.85 of its loss now
STRAGGLER = GPU_RUNS / "2026-11-28-x2" / "i2-strag-r0-1.25x-aj.tar.gz"


def _firing(run: Path, environ: dict[str, str]) -> list[tuple[str, int | None]]:
    cfg = config.load(None, environ=environ)
    return [(e.type, e.rank) for e in events_of(run, cfg, Options()) if e.state == "firing"]


def test_a_rank_late_before_the_ramp_is_not_blamed_for_it():
    assert _firing(RAMP, {}) == [("network_path", None)]


def test_with_the_check_off_the_late_rank_is_blamed():
    fired = _firing(RAMP, {"NCCLWATCH_DETECTOR_STRAGGLER_EARLY_SHARE": "0"})
    assert fired == [("straggler", 0), ("network_path", None)]


def test_a_straggler_that_costs_from_its_start_is_still_raised():
    assert _firing(STRAGGLER, {}) == [("straggler", 0)]
    # held only by a share above what its first windows cost: then the loss has no
    # comm cause left and goes out as the job's own drop
    assert _firing(STRAGGLER, {"NCCLWATCH_DETECTOR_STRAGGLER_EARLY_SHARE": "0.95"}) == [("throughput_drop", None)]


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_a_share_outside_0_to_1_is_refused(share):
    with pytest.raises(ValueError, match="detector.straggler_early_share"):
        DetectorConfig(straggler_early_share=share)
