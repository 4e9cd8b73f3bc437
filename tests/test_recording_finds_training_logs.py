"""A recording's Megatron log is found wherever it lies in it (a Slurm ``.out`` beside
NCCL Inspector's directory, a rank's log under ``logs/``), as if given with
``--training-log``: without it, a recording of Inspector output and a training log
had no throughput, and a job's own slowdown went unseen.

The run is a real Inspector recording (4×H100, every rank 1.3× slower from 15 s,
tests/fixtures/gpu_runs/2026-11-27-x4/i4-slow-all-1.3x), laid out as users keep theirs.
"""

from __future__ import annotations

import gzip
import shutil
import tarfile
import tracemalloc
from datetime import datetime
from pathlib import Path

import pytest
from ncclwatch.detectors import watch
from ncclwatch.ingest.recording import (
    Options,
    ReadStats,
    RecordingError,
    find_sources,
    is_training_log,
    read_recording,
)
from ncclwatch.ingest.trainlog import LineClock

from ncclwatch.config import load
from ncclwatch.records import ThroughputRecord

RUN = Path(__file__).resolve().parent / "fixtures" / "gpu_runs" / "2026-11-27-x4" / "i4-slow-all-1.3x.tar.gz"
CFG = load(None, environ={})


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("run")
    with tarfile.open(RUN) as tar:
        tar.extractall(tmp, filter="data")
    return tmp / "i4-slow-all-1.3x"


def events(paths: list[Path], options: Options | None = None) -> list[tuple]:
    recs = read_recording([str(p) for p in paths], ReadStats(), options or Options())
    return [(e.type, e.state, e.start_ns) for e in watch.detect(CFG, recs)]


def test_a_slurm_out_beside_inspectors_directory_is_the_jobs_throughput(recorded, tmp_path):
    shutil.copytree(recorded / "inspector", tmp_path / "nccl-inspector-77")
    # Megatron prints its iteration lines on the last rank; a Slurm job's stdout has them
    shutil.copy(recorded / "trainlogs" / "rank-3.log", tmp_path / "slurm-77.out")
    (tmp_path / "nccl-debug.txt").write_text("vm:2920:2920 [0] NCCL INFO Bootstrap : Using eth0\n")

    stats = ReadStats()
    src = find_sources(tmp_path, stats)
    assert src.trainlogs == (tmp_path / "slurm-77.out",)
    assert stats.unrecognised == [str(tmp_path / "nccl-debug.txt")]

    found = events([tmp_path])
    given = events([tmp_path / "nccl-inspector-77"],
                   Options(training_logs=(str(tmp_path / "slurm-77.out"),)))
    assert found == given
    assert ("throughput_drop", "firing") in {e[:2] for e in found}, found


def test_a_run_directorys_log_kept_outside_trainlogs_is_read_and_gzip_too(recorded, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(recorded / "inspector", run / "inspector")
    shutil.copy(recorded / "run.json", run / "run.json")
    (run / "logs").mkdir()
    with open(recorded / "trainlogs" / "rank-3.log", "rb") as f, gzip.open(run / "logs" / "megatron.log.gz", "wb") as g:
        shutil.copyfileobj(f, g)

    assert find_sources(run, ReadStats()).trainlogs == (run / "logs" / "megatron.log.gz",)
    recs = list(read_recording([str(run)], ReadStats(), Options()))
    tp = [r for r in recs if isinstance(r, ThroughputRecord)]
    assert len(tp) > 100 and {r.source for r in tp} == {"log"}


def test_a_training_log_alone_is_a_throughput_only_recording_and_other_text_is_not(recorded, tmp_path):
    log = tmp_path / "train.log"
    shutil.copy(recorded / "trainlogs" / "rank-3.log", log)
    assert find_sources(log, ReadStats()).trainlogs == (log,)
    assert [e[:2] for e in events([log])][:1] == [("throughput_drop", "firing")]

    other = tmp_path / "notes.log"
    other.write_text("iteration 3 of the plan: nothing to see\n")
    with pytest.raises(RecordingError, match="not recognised"):
        list(read_recording([str(other)], ReadStats(), Options()))


def shifted_log(src: Path, dst: Path, shift_ns: int) -> None:
    """``src`` as if written by a process whose clock's zone was ``shift_ns`` ahead."""
    clock = LineClock("local")
    with open(src) as f, open(dst, "w") as g:
        for line in f:
            ns = clock.time_ns(line)
            if ns is not None and line.startswith("["):
                stamp = datetime.fromtimestamp((ns + shift_ns) / 1e9).strftime("%Y-%m-%d %H:%M:%S.%f")
                line = f"[{stamp}]{line.split(']', 1)[1]}"
            g.write(line)


def test_a_log_written_in_another_zone_is_laid_over_the_ops_and_said_so(recorded, tmp_path):
    # Written in UTC+5:30 and replayed here: its naive times read 5.5 h from the ops.
    zoned, plain = tmp_path / "zoned", tmp_path / "plain"
    shutil.copytree(recorded / "inspector", zoned / "nccl-inspector-77")
    shifted_log(recorded / "trainlogs" / "rank-3.log", zoned / "slurm-77.out", (5 * 3600 + 1800) * 10**9)
    stats = ReadStats()
    recs = list(read_recording([str(zoned)], stats, Options()))
    assert stats.trainlog_shift_ns == -(5 * 3600 + 1800) * 10**9
    assert any("moved -5:30" in n for n in stats.notes())

    shutil.copytree(recorded / "inspector", plain / "nccl-inspector-77")
    shutil.copy(recorded / "trainlogs" / "rank-3.log", plain / "slurm-77.out")
    assert [(e.type, e.state, e.start_ns) for e in watch.detect(CFG, recs)] == events([plain])

    # A zone given in the configuration is taken at its word.
    stats = ReadStats()
    list(read_recording([str(zoned)], stats, Options(timezone="UTC")))
    assert stats.trainlog_shift_ns == 0


def test_looking_for_a_training_log_reads_a_newline_free_file_in_bounded_pieces(tmp_path):
    # A binary dump named .txt has no lines: looking into it must not read it whole.
    dump = tmp_path / "core-dump.txt"
    dump.write_bytes(b"\x00" * (8 << 20))
    tracemalloc.start()
    try:
        assert not is_training_log(dump, limit=4 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
