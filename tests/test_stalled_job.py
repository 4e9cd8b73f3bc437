"""A job that completed no step for seconds is not left unsaid because NCCL went quiet too.

Recorded (tests/fixtures/gpu_runs/2026-11-29-x1, split `tune`: these runs shaped the
change): one rank's process stopped once for 10 s (`SIGSTOP`, then `SIGCONT`), through
the plugin and through Inspector, steps synchronised in NCCL; and once for 5 s with
gloo's barrier. No op completes anywhere while it is stopped, so every key drops out,
which holds the job's drop for NCCL's trouble; the drop ended before
`detector.throughput_hold_windows` let it go, and the 10-s stalls raised nothing. A held
drop in which one step spanned `sustain_windows` windows (no step done for that long)
and no comm anomaly was raised is now raised as it ends.
"""

from __future__ import annotations

from pathlib import Path

from gpu_runs_support import eval_gpu_runs
from ncclwatch.detectors.evaluate import events_of
from ncclwatch.detectors.throughput import ThroughputTracker
from ncclwatch.ingest.recording import Options

from ncclwatch import config
from ncclwatch.config import DetectorConfig

RUNS = Path(__file__).parent / "fixtures" / "gpu_runs" / "2026-11-29-x1"


def _events(name: str, environ: dict[str, str] | None = None) -> list:
    cfg = config.load(None, environ=environ or {})
    return events_of(RUNS / f"{name}.tar.gz", cfg, Options())


def test_a_10s_stall_is_raised_as_the_job_s_drop_when_it_ends():
    for name in ("p1x2-sync-stall-r1-10s", "i1x2-sync-stall-r0-10s"):
        events = _events(name)
        assert [(e.type, e.state, e.attribution) for e in events] == [
            ("throughput_drop", "firing", "unknown"), ("throughput_drop", "resolved", "unknown")], name
        fired = events[0]
        assert fired.severity == "warning" and fired.throughput_delta < -0.5, name
        # raised once the stall is over (10 s and the recovery windows), not before
        assert 12e9 <= fired.detected_ns - fired.start_ns <= 15e9, name


def test_with_the_hold_off_a_stall_stays_held():
    assert _events("p1x2-sync-stall-r1-10s", {"NCCLWATCH_DETECTOR_THROUGHPUT_HOLD_WINDOWS": "0"}) == []


def test_the_stall_s_loss_is_measured_as_work_not_missed():
    """The judge counts a step's work over its own time: no step ends inside a 10-s stall,
    which the judge of before took for no loss at all."""
    rows = eval_gpu_runs.evaluate([RUNS / "p1x2-sync-stall-r1-10s.tar.gz"], config.load(None, environ={}), 5.0)
    assert rows[0]["drop"] > 0.9 and rows[0]["expected"] == "straggler"


def test_the_drop_s_stall_count_survives_a_restart_and_older_states_say_nothing_more():
    cfg = DetectorConfig()
    tp = ThroughputTracker(cfg)
    tp.held, tp.carried, tp.stalled = 3, False, 4
    back = ThroughputTracker.from_state(cfg, tp.to_state())
    assert (back.held, back.carried, back.stalled) == (3, False, 4)
    old = tp.to_state()
    old["clear"] = old["clear"][:3]  # saved before these existed: not raised at its end
    back = ThroughputTracker.from_state(cfg, old)
    assert (back.held, back.carried, back.stalled) == (3, True, 0)
