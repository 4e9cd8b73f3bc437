"""A folder of recorded GPU runs judged as `bench/detectors/eval_gpu_runs.py` judges them,
and its split into batches (``split.json``), for the tests that hold each folder's tables."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ncclwatch.config import load

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench" / "detectors"))
import eval_gpu_runs  # noqa: E402

__all__ = ["eval_gpu_runs", "fixtures", "judge", "split_of", "check_split_is_the_directory", "recorded_set"]


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


def recorded_set(name: str) -> tuple[Path, dict[str, list[str]], Any, Callable[[], None]]:
    """What the test module of one recorded set starts with: its folder, its split, a
    module-scoped ``rows`` fixture (every run judged once) and the test that the split is
    the folder, to be bound to module names for pytest to collect::

        FIXTURES, SPLIT, rows, test_the_split_is_the_directory = recorded_set("2026-11-29-x1")
    """
    folder = fixtures(name)

    @pytest.fixture(scope="module")
    def rows() -> dict[str, dict]:
        return judge(folder)

    def test_the_split_is_the_directory() -> None:
        check_split_is_the_directory(folder)

    return folder, split_of(folder), rows, test_the_split_is_the_directory
