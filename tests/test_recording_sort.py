"""Recordings are replayed in bounded memory: sorted runs spill to disk and merge.

The spilled order must be the in-memory order, record for record, and every command
that replays a recording (``watch``, ``replay --files``, ``report``) must give the
same output with spills as without.
"""

from __future__ import annotations

import json
import tarfile
import tempfile
from pathlib import Path

import pytest
from ncclwatch.ingest import recording
from ncclwatch.ingest.recording import (
    Options,
    ReadStats,
    SortedRecording,
    iter_records,
    order_key,
)

from ncclwatch import cli

ROOT = Path(__file__).resolve().parents[1]
GPU_RUNS = ROOT / "tests" / "fixtures" / "gpu_runs" / "2026-11-23"
# a plugin run (spool, throughput through the API) and an Inspector run (JSON logs,
# per-rank training logs): both readers, every record kind they hold
PLUGIN_RUN = GPU_RUNS / "p-clean-1.tar.gz"
INSPECTOR_RUN = GPU_RUNS / "i-tc-12g.tar.gz"


def _where(entry: tuple) -> tuple:
    """(file inside the archive, offset, raw line): archives unpack into a new temp dir."""
    source, offset, raw = entry[:3]
    return source.split("ncclwatch-replay-", 1)[-1].split("/", 1)[-1], offset, raw


def _sorted(paths: list[Path], run_records: int, *, stream: bool = True) -> tuple[SortedRecording, list]:
    with SortedRecording(paths, ReadStats(), Options(), run_records=run_records, stream=stream) as rec:
        return rec, list(rec)


@pytest.mark.parametrize("run", [PLUGIN_RUN, INSPECTOR_RUN], ids=["plugin", "inspector"])
def test_spilled_runs_merge_into_the_in_memory_order_record_for_record(run):
    whole, in_memory = _sorted([run], 10**9)
    # everything through the sort (a spool file would mostly stream): runs spill
    spilled, merged = _sorted([run], 997, stream=False)
    assert whole.runs == 0 and spilled.runs > 3
    assert len(merged) == len(in_memory) == whole.total == spilled.total > 997
    for a, b in zip(merged, in_memory, strict=True):
        assert _where(a) == _where(b)
        assert a[3] == b[3]  # the record, parsed again from the spill
    assert spilled.first_ns == whole.first_ns and spilled.last_ns == whole.last_ns
    assert spilled.kinds == whole.kinds


def test_the_order_is_a_stable_sort_by_stream_time_then_kind():
    stats = ReadStats()
    expected = sorted(iter_records([INSPECTOR_RUN], stats), key=lambda e: order_key(e[3]))
    _, merged = _sorted([INSPECTOR_RUN], 500)
    assert [_where(e) for e in merged] == [_where(e) for e in expected]
    times = [order_key(e[3]) for e in merged]
    assert times == sorted(times)


def test_keep_leaves_records_out_before_they_are_counted():
    with SortedRecording([PLUGIN_RUN], ReadStats(), keep=lambda r: r.KIND == "throughput",
                         run_records=50) as rec:
        kept = list(rec)
        assert rec.total == len(kept) == rec.kinds["throughput"] > 50
        assert set(rec.kinds) == {"throughput"}


def test_the_spill_directory_is_gone_after_the_recording_is_closed():
    with SortedRecording([PLUGIN_RUN], ReadStats(), run_records=1000, stream=False) as rec:
        spill_dir = rec.spill_dir
        assert spill_dir is not None and any(spill_dir.iterdir())
        next(iter(rec))
    assert not spill_dir.exists()


def _commands(tmp: Path, tag: str) -> dict[str, str]:
    """What watch, replay --files and report write for the Inspector run."""
    events = tmp / f"{tag}.events.jsonl"
    assert cli.main(["watch", str(INSPECTOR_RUN), "--events-out", str(events),
                     "--metrics-port", "-1", "--status-every-s", "0", "--no-progress"]) == 0
    replayed = tmp / f"{tag}.replay.jsonl"
    assert cli.main(["replay", "--files", str(INSPECTOR_RUN), "--out", str(replayed), "--no-progress"]) == 0
    detected = tmp / f"{tag}.detect.jsonl"
    assert cli.main(["replay", "--files", str(INSPECTOR_RUN), "--detect", "--events-out", str(detected),
                     "--no-progress"]) == 0
    report = tmp / f"{tag}-report"
    assert cli.main(["report", str(INSPECTOR_RUN), "--out", str(report)]) == 0
    md = next(report.glob("*.md")).read_text()
    return {
        "watch": events.read_text(),
        "replay": replayed.read_text(),
        "detect": detected.read_text(),
        "report": md.replace(str(report), "REPORT"),
    }


def test_watch_replay_and_report_give_the_same_output_when_the_recording_spills(tmp_path, monkeypatch):
    whole = _commands(tmp_path, "whole")
    monkeypatch.setattr(recording, "SORT_RUN_RECORDS", 700)
    spilled = _commands(tmp_path, "spilled")
    assert [json.loads(x)["state"] for x in whole["watch"].splitlines()].count("firing") >= 1
    assert whole["replay"].count("\n") > 700 * 3
    for what in whole:
        assert spilled[what] == whole[what], what


def test_many_runs_are_merged_into_one_before_too_many_files_are_open(monkeypatch):
    monkeypatch.setattr(recording, "MAX_OPEN_RUNS", 4)
    whole, in_memory = _sorted([INSPECTOR_RUN], 10**9)
    with SortedRecording([INSPECTOR_RUN], ReadStats(), Options(), run_records=300) as spilled:
        files = sorted(p.name for p in spilled.spill_dir.iterdir())  # as the merge finds them
        merged = list(spilled)
    assert spilled.runs > 8 and 1 <= len(files) < 4, files
    assert any(f.startswith("merged-") for f in files)
    assert [_where(e) for e in merged] == [_where(e) for e in in_memory]


def test_a_full_disk_under_the_sort_is_a_clear_error_and_leaves_nothing_behind(small_fs, tmp_path,
                                                                             monkeypatch, capsys):
    run = tmp_path / "run"
    # Inspector's records are all sorted (a plugin spool in order streams from its files)
    with tarfile.open(INSPECTOR_RUN) as tar:  # unpacked here, on a disk with room
        tar.extractall(run, filter="data")
    (small_fs / "filler").write_bytes(b"\0" * (8 * 2**20 - 64 * 2**10))  # 64 KiB left
    monkeypatch.setattr(tempfile, "tempdir", str(small_fs))
    monkeypatch.setattr(recording, "SORT_RUN_RECORDS", 2000)  # runs far larger than what is left
    out = tmp_path / "replayed.jsonl"
    assert cli.main(["replay", "--files", str(run), "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "needs temporary space" in err and str(small_fs) in err and "TMPDIR" in err, err
    assert "Traceback" not in err
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]  # the spill directory is gone


def test_a_full_disk_under_an_archive_is_a_clear_error(small_fs, tmp_path, monkeypatch, capsys):
    (small_fs / "filler").write_bytes(b"\0" * (8 * 2**20 - 64 * 2**10))  # 64 KiB left
    monkeypatch.setattr(tempfile, "tempdir", str(small_fs))
    assert cli.main(["replay", "--files", str(PLUGIN_RUN), "--out", str(tmp_path / "o.jsonl"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unpacking it into" in err and "TMPDIR" in err and "Traceback" not in err, err
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]
