"""SpoolTailer / FileTailer: byte-offset tailing of the plugin's spool and other files."""

from __future__ import annotations

import os

import pytest
from ncclwatch.ingest.spool import FileTailer, SpoolTailer

from ncclwatch.records import MAX_LINE_BYTES, parse_line


def seg(spool, stream="h-GPU-1-7", n=0, job="job"):
    d = spool / job
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{stream}.{n:06d}.jsonl"


def append(path, data: bytes):
    with open(path, "ab") as f:
        f.write(data)


def raws(lines):
    return [ln.raw for ln in lines]


def test_partial_last_line_is_held_until_its_newline(tmp_path):
    p = seg(tmp_path)
    append(p, b"one\ntw")
    t = SpoolTailer(str(tmp_path))
    assert raws(t.poll(10)) == [b"one"]
    assert raws(t.poll(10)) == []
    append(p, b"o\n")
    (ln,) = t.poll(10)
    assert (ln.raw, ln.offset, ln.next_offset) == (b"two", 4, 8)
    assert t.positions[str(p)] == 8


def test_segments_are_read_in_order_across_rotation(tmp_path):
    s0, s1, s2 = seg(tmp_path, n=0), seg(tmp_path, n=1), seg(tmp_path, n=2)
    append(s0, b"a\nb\n")
    append(s1, b"c\n")
    append(s2, b"d\n")
    t = SpoolTailer(str(tmp_path))
    assert raws(t.poll(1)) == [b"a"]
    assert raws(t.poll(2)) == [b"b", b"c"]
    assert raws(t.poll(10)) == [b"d"]
    assert t.is_done(str(s0)) and t.is_done(str(s1)) and not t.is_done(str(s2))


def test_new_segment_closes_the_previous_one_and_its_partial_tail_is_returned(tmp_path):
    s0 = seg(tmp_path, n=0)
    append(s0, b'{"ok":1}\n{"cut')
    t = SpoolTailer(str(tmp_path))
    assert raws(t.poll(10)) == [b'{"ok":1}']
    append(seg(tmp_path, n=1), b"next\n")
    lines = t.poll(10)
    assert raws(lines) == [b'{"cut', b"next"]
    assert (lines[0].offset, lines[0].next_offset) == (9, 14)
    assert parse_line(lines[0].raw).reason == "not_json"


def test_truncated_file_restarts_at_zero(tmp_path):
    p = seg(tmp_path)
    append(p, b"aaaa\nbbbb\n")
    t = SpoolTailer(str(tmp_path))
    assert len(t.poll(10)) == 2
    with open(p, "wb") as f:
        f.write(b"c\n")
    assert raws(t.poll(10)) == [b"c"]
    assert t.truncations_total == 1


def test_replaced_file_restarts_at_zero(tmp_path):
    p = seg(tmp_path)
    append(p, b"x\n")
    t = SpoolTailer(str(tmp_path))
    t.poll(10)
    tmp = tmp_path / "other"
    tmp.write_bytes(b"first\nsecond\n")
    os.replace(tmp, p)  # a longer file under the same name
    assert raws(t.poll(10)) == [b"first", b"second"]
    assert t.replaced_total == 1


def test_oversized_line_is_cut_for_quarantine_and_reading_goes_on(tmp_path):
    p = seg(tmp_path)
    big = b"x" * (3 << 20)  # longer than one read chunk
    append(p, b"before\n" + big + b"\nafter\n")
    t = SpoolTailer(str(tmp_path))
    lines = t.poll(10)
    assert raws(lines)[0] == b"before" and raws(lines)[2] == b"after"
    cut = lines[1]
    assert len(cut.raw) == MAX_LINE_BYTES + 1
    assert (cut.offset, cut.next_offset) == (7, 7 + len(big) + 1)
    assert parse_line(cut.raw).reason == "too_long"


def test_oversized_line_still_growing_is_not_rescanned_and_is_emitted_once_complete(tmp_path):
    p = seg(tmp_path)
    append(p, b"y" * (2 << 20))
    t = SpoolTailer(str(tmp_path))
    assert t.poll(10) == []
    append(p, b"y" * (1 << 20))
    assert t.poll(10) == []
    append(p, b"\nok\n")
    lines = t.poll(10)
    assert [len(ln.raw) for ln in lines] == [MAX_LINE_BYTES + 1, 2]
    assert lines[1].offset == (3 << 20) + 1


def test_long_line_within_one_chunk_is_passed_whole_to_the_parser(tmp_path):
    p = seg(tmp_path)
    append(p, b"z" * (MAX_LINE_BYTES + 10) + b"\n")
    t = SpoolTailer(str(tmp_path))
    (ln,) = t.poll(10)
    assert parse_line(ln.raw).reason == "too_long"


def test_binary_garbage_is_returned_as_lines_not_an_error(tmp_path):
    p = seg(tmp_path)
    append(p, bytes(range(256)) * 4 + b"\n")
    t = SpoolTailer(str(tmp_path))
    lines = t.poll(100)
    assert lines and all(isinstance(ln.raw, bytes) for ln in lines)
    assert t.positions[str(p)] == os.path.getsize(p)


def test_positions_resume_after_restart(tmp_path):
    p = seg(tmp_path)
    append(p, b"1\n2\n3\n")
    t = SpoolTailer(str(tmp_path))
    t.poll(2)
    saved = dict(t.positions)
    t2 = SpoolTailer(str(tmp_path), saved)
    assert raws(t2.poll(10)) == [b"3"]


def test_max_lines_is_respected_and_streams_are_served_fairly(tmp_path):
    for s in ("a", "b", "c"):
        append(seg(tmp_path, stream=s), b"".join(b"%s%d\n" % (s.encode(), i) for i in range(100)))
    t = SpoolTailer(str(tmp_path))
    seen = set()
    for _ in range(3):
        lines = t.poll(10)
        assert len(lines) == 10
        seen.update(os.path.basename(ln.source)[0] for ln in lines)
    assert seen == {"a", "b", "c"}


def test_vanished_file_is_forgotten_and_unread_bytes_counted(tmp_path):
    p = seg(tmp_path)
    append(p, b"1\n2\n")
    t = SpoolTailer(str(tmp_path))
    t.poll(1)
    os.unlink(p)
    assert t.poll(10) == []
    assert str(p) not in t.positions
    assert t.vanished_unread_bytes_total == 2


def test_non_segment_files_are_ignored(tmp_path):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "notes.txt").write_bytes(b"hello\n")
    assert SpoolTailer(str(tmp_path)).poll(10) == []


def test_missing_spool_dir_is_empty_not_an_error(tmp_path):
    assert SpoolTailer(str(tmp_path / "nope")).poll(10) == []


def test_bytes_behind_counts_unread_bytes(tmp_path):
    p = seg(tmp_path)
    append(p, b"12345\n" * 4)
    t = SpoolTailer(str(tmp_path))
    t.poll(1)
    assert t.bytes_behind() == 18


def test_file_tailer_follows_globs(tmp_path):
    a = tmp_path / "h-pid1.log"
    append(a, b"x\n")
    t = FileTailer([str(tmp_path / "*.log")])
    assert raws(t.poll(10)) == [b"x"]
    b = tmp_path / "h-pid2.log"
    append(b, b"y\n")
    append(a, b"z")
    assert raws(t.poll(10)) == [b"y"]


def test_chunk_size_must_exceed_line_limit():
    with pytest.raises(ValueError):
        SpoolTailer("/tmp", chunk_bytes=10, max_line_bytes=10)


def test_discovery_lists_only_directories_that_changed(tmp_path, monkeypatch):
    """A poll of an unchanged spool lists no directory (one stat per job directory); a new
    or deleted segment changes its directory's time and is seen at the next poll."""
    import os as os_mod
    import time as time_mod

    from ncclwatch.ingest import spool as spool_mod

    old = time_mod.time() - 60
    for job in ("a", "b", "c"):
        (tmp_path / job).mkdir()
        for pid in range(4):
            (tmp_path / job / f"h-GPU-0-{pid}.000000.jsonl").write_bytes(b"")
        os_mod.utime(tmp_path / job, (old, old))
    os_mod.utime(tmp_path, (old, old))
    t = spool_mod.SpoolTailer(str(tmp_path))
    assert len(t.discover()) == 12
    listed = []
    real = os_mod.scandir
    monkeypatch.setattr(spool_mod.os, "scandir", lambda d: listed.append(d) or real(d))
    assert len(t.discover()) == 12 and listed == []
    (tmp_path / "b" / "h-GPU-0-9.000000.jsonl").write_bytes(b"")  # a new stream in b
    streams = t.discover()
    assert len(streams) == 13 and listed == [str(tmp_path / "b")]
    (tmp_path / "b" / "h-GPU-0-9.000000.jsonl").unlink()
    (tmp_path / "d").mkdir()  # a new job
    (tmp_path / "d" / "h-GPU-1-1.000000.jsonl").write_bytes(b"")
    assert len(t.discover()) == 13
