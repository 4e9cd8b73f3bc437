"""Real recorded runs whose Megatron logs print no TFLOP/s (Megatron without
``--log-throughput``, its default): the throughput computed from the iteration times
(``ingest.trainlog.MegatronFlops``) gives the detectors what the printed figure gave.

The runs are Inspector recordings of 2026-11-26 (tests/fixtures/gpu_runs/2026-11-26):
a job every rank of which slowed (found only through its throughput), a straggler (its
severity rests on the throughput), a network throttle and a clean run. Their logs are
rewritten here as Megatron prints them without the option: the TFLOP/s column removed,
Megatron's argument block at the head of rank 0's log.
"""

from __future__ import annotations

import re
import sys
import tarfile
from pathlib import Path

import pytest

from ncclwatch.config import load

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "gpu_runs" / "2026-11-26"
sys.path.insert(0, str(ROOT / "bench" / "detectors"))
import eval_gpu_runs  # noqa: E402

CFG = load(None, environ={})
RUNS = ("i-slow-all-1.3x", "i-strag-proc0-3x", "i-tc-short-12g", "i-clean-3")
ARGUMENTS = """------------------------ arguments ------------------------
  hidden_size ..................................... 8192
  num_layers ...................................... 4
  num_attention_heads ............................. 64
  seq_length ...................................... 2048
  ffn_hidden_size ................................. 28672
  swiglu .......................................... True
  world_size ...................................... 4
-------------------- end of arguments ---------------------
 > padded vocab (size: 32000) with 0 dummy tokens (new size: 32000)
"""
PRINTED = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): [0-9.]+ \| ")


def unpack(name: str, into: Path) -> Path:
    with tarfile.open(FIXTURES / f"{name}.tar.gz") as tar:
        tar.extractall(into, filter="data")
    return into / name


def without_printed_throughput(run: Path, arguments: bool) -> None:
    for log in sorted((run / "trainlogs").glob("rank-*.log")):
        text, n = PRINTED.subn("", log.read_text())
        assert n > 0, log  # the recording printed it: this is what changes
        if arguments and log.name == "rank-0.log":
            text = ARGUMENTS + text
        log.write_text(text)


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    rows = {}
    for variant in ("printed", "computed", "neither"):
        tmp = tmp_path_factory.mktemp(variant)
        runs = [unpack(name, tmp) for name in RUNS]
        if variant != "printed":
            for run in runs:
                without_printed_throughput(run, arguments=variant == "computed")
        rows[variant] = {r["run"]: r for r in eval_gpu_runs.evaluate(runs, CFG, 5.0)}
    return rows


@pytest.mark.parametrize("name", RUNS)
def test_the_computed_throughput_judges_as_the_printed_one(judged, name):
    printed, computed = judged["printed"][name], judged["computed"][name]
    assert printed["ok"], printed
    assert computed["ok"], computed
    assert (computed["got"], computed["severity"]) == (printed["got"], printed["severity"])
    if printed["delay_s"] is not None:
        assert abs(computed["delay_s"] - printed["delay_s"]) <= 1.0, (printed, computed)
    if printed.get("throughput_delta") is not None:
        assert computed["throughput_delta"] == pytest.approx(printed["throughput_delta"], abs=0.01)


def test_without_either_the_jobs_own_slowdown_goes_unseen(judged):
    # what the computed figure is for: a log with neither gives the detectors no
    # throughput, and a job whose every rank slowed raises nothing
    assert judged["neither"]["i-slow-all-1.3x"]["got"] == "-"
    assert not judged["neither"]["i-slow-all-1.3x"]["ok"]
