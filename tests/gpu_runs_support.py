"""A folder of recorded GPU runs judged as `bench/detectors/eval_gpu_runs.py` judges them,
and its split into batches (``split.json``), for the tests that hold each folder's tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ncclwatch.config import load

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench" / "detectors"))
import eval_gpu_runs  # noqa: E402

__all__ = ["eval_gpu_runs", "fixtures", "judge", "split_of", "check_split_is_the_directory"]


def fixtures(name: str) -> Path:
    """``tests/fixtures/gpu_runs/<name>``."""
    return ROOT / "tests" / "fixtures" / "gpu_runs" / name


def split_of(folder: Path) -> dict[str, list[str]]:
    return json.loads((folder / "split.json").read_text())


def judge(folder: Path) -> dict[str, dict]:
    """Every run archive of ``folder`` judged with the default configuration, by run name."""
    cfg = load(None, environ={})
    return {r["run"]: r for r in eval_gpu_runs.evaluate(sorted(folder.glob("*.tar.gz")), cfg, 5.0)}


def check_split_is_the_directory(folder: Path) -> None:
    """Every archive is in exactly one batch of the split, and every batch's run is there."""
    halves = [set(v) for v in split_of(folder).values()]
    assert {p.name.removesuffix(".tar.gz") for p in folder.glob("*.tar.gz")} == set().union(*halves)
    assert sum(map(len, halves)) == len(set().union(*halves))  # no run in two halves
