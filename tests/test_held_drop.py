"""A job's drop held for NCCL's trouble that never becomes an anomaly is raised in the end.

A drop is held while a comm key is degraded or has dropped out since it began, so that
the comm anomaly carries its cost. Where that trouble never turns into a raised anomaly
(recorded: `p2-freeze-r3-0.5-p2-at`, one rank's process stopped 1 s of every 2, 49 % of
the job's work; the network keys drop out with its stopped proxy, a different one each
time, and none fires), the drop was held for good and the run was silent.
`detector.throughput_hold_windows` raises it as the job's own after that many windows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ncclwatch.detectors.evaluate import events_of
from ncclwatch.detectors.throughput import ThroughputTracker
from ncclwatch.ingest.recording import Options

from ncclwatch import config
from ncclwatch.config import DetectorConfig

RUN = Path(__file__).parent / "fixtures" / "gpu_runs" / "2026-11-28-x2" / "p2-freeze-r3-0.5-p2-at.tar.gz"


def _firing(environ: dict[str, str]) -> list:
    cfg = config.load(None, environ=environ)
    return [e for e in events_of(RUN, cfg, Options()) if e.state == "firing"]


def test_the_stalled_process_run_raises_its_drop_after_the_hold():
    (ev,) = _firing({})
    assert (ev.type, ev.attribution) == ("throughput_drop", "unknown")
    assert ev.evidence["held_s"] == 10.0
    assert ev.evidence["flapping"] is True  # slow and healthy windows alternate
    # raised ten windows (plus the grace window) after it was first held, not at once
    assert 10 * 10**9 <= ev.detected_ns - ev.start_ns <= 16 * 10**9


def test_with_the_hold_off_the_drop_stays_held():
    assert _firing({"NCCLWATCH_DETECTOR_THROUGHPUT_HOLD_WINDOWS": "0"}) == []


def test_a_longer_hold_raises_it_later():
    (short,) = _firing({"NCCLWATCH_DETECTOR_THROUGHPUT_HOLD_WINDOWS": "5"})
    (long,) = _firing({"NCCLWATCH_DETECTOR_THROUGHPUT_HOLD_WINDOWS": "12"})
    assert short.evidence["held_s"] == 5.0 and long.evidence["held_s"] == 12.0
    assert long.detected_ns - short.detected_ns == 7 * 10**9


def test_a_negative_hold_is_refused():
    with pytest.raises(ValueError, match="detector.throughput_hold_windows"):
        DetectorConfig(throughput_hold_windows=-1)


def test_the_held_count_survives_a_restart_and_older_states_read():
    cfg = DetectorConfig()
    tp = ThroughputTracker(cfg)
    tp.held, tp.clear, tp.clear_start = 7, 1, 42
    back = ThroughputTracker.from_state(cfg, tp.to_state())
    assert (back.held, back.clear, back.clear_start) == (7, 1, 42)
    old = tp.to_state()
    old["clear"] = old["clear"][:2]  # a state saved before the count existed
    assert ThroughputTracker.from_state(cfg, old).held == 0
