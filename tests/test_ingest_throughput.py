"""report_throughput: the training loop's one call into ncclwatch."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
from ncclwatch.ingest import throughput

import ncclwatch
from ncclwatch.records import ThroughputRecord, parse_line
from ncclwatch.rules import safe_filename


def _lines(spool: Path, job: str) -> list[bytes]:
    files = list((spool / safe_filename(job)).glob("*-throughput-*.000000.jsonl"))
    assert len(files) == 1
    data = files[0].read_bytes()
    assert data.endswith(b"\n")
    return data.splitlines()


def test_report_appends_one_valid_line_per_call(tmp_path):
    for step in range(3):
        ncclwatch.report_throughput(300.0 + step, step=step, rank=2, spool_dir=str(tmp_path),
                                    job="j/1", tokens_per_s=1e5)
    lines = _lines(tmp_path, "j/1")
    recs = [parse_line(line) for line in lines]
    assert all(isinstance(r, ThroughputRecord) for r in recs)
    assert [r.step for r in recs] == [0, 1, 2]
    assert [r.tflops_per_gpu for r in recs] == [300.0, 301.0, 302.0]
    assert {(r.job, r.rank, r.source, r.tokens_per_s) for r in recs} == {("j/1", 2, "api", 1e5)}
    assert recs[0].host == socket.gethostname()


def test_file_name_follows_the_spool_layout(tmp_path):
    throughput.report_throughput(1.0, 0, spool_dir=str(tmp_path), job="a b")
    name = f"{safe_filename(socket.gethostname())}-throughput-{os.getpid()}.000000.jsonl"
    assert (tmp_path / "a%20b" / name).is_file()


def test_defaults_come_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCLWATCH_SPOOL_DIR", str(tmp_path))
    monkeypatch.delenv("NCCLWATCH_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "elastic-9")
    monkeypatch.setenv("RANK", "5")
    throughput.report_throughput(12.5, 4)
    (rec,) = [parse_line(line) for line in _lines(tmp_path, "elastic-9")]
    assert (rec.job, rec.rank, rec.tokens_per_s) == ("elastic-9", 5, None)


def test_missing_rank_means_job_level(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    throughput.report_throughput(1.0, 0, spool_dir=str(tmp_path), job="j")
    (rec,) = [parse_line(line) for line in _lines(tmp_path, "j")]
    assert rec.rank == -1


def test_unwritable_spool_never_raises_and_is_counted(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the spool directory should be
    before = throughput.errors_total
    with pytest.warns(RuntimeWarning) if not throughput._warned else _nothing():
        throughput.report_throughput(1.0, 0, spool_dir=str(blocker), job="j")
    throughput.report_throughput(1.0, 1, spool_dir=str(blocker), job="j")
    assert throughput.errors_total == before + 2


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_full_disk_never_raises_and_is_counted(tmp_path):
    # /dev/full answers every write with ENOSPC, for root too: a full disk without filling one.
    target = Path(throughput.spool_path(str(tmp_path), "j", socket.gethostname(), os.getpid()))
    target.parent.mkdir(parents=True)
    target.symlink_to("/dev/full")
    before = throughput.errors_total
    throughput.report_throughput(1.0, 0, spool_dir=str(tmp_path), job="j")
    assert throughput.errors_total == before + 1


def test_contract_violations_are_programmer_errors(tmp_path):
    with pytest.raises(ValueError):
        throughput.report_throughput(-1.0, 0, spool_dir=str(tmp_path))
    with pytest.raises(ValueError):
        throughput.report_throughput(float("nan"), 0, spool_dir=str(tmp_path))
    with pytest.raises(ValueError):
        throughput.report_throughput(1.0, -3, spool_dir=str(tmp_path))


def test_concurrent_reporters_never_interleave_lines(tmp_path):
    def worker(rank):
        for step in range(200):
            throughput.report_throughput(
                float(step), step, rank=rank, spool_dir=str(tmp_path), job="c"
            )

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    recs = [parse_line(line) for line in _lines(tmp_path, "c")]
    assert all(isinstance(r, ThroughputRecord) for r in recs)
    assert sorted((r.rank, r.step) for r in recs) == [(r, s) for r in range(4) for s in range(200)]
