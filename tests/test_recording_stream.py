"""Spool files are streamed, not sorted: the order must be the sorted order exactly.

:class:`SortedRecording` reads a spool file's in-order records from the file again while
iterating and sorts only the rest (records written late, and everything that is no spool
line). ``stream=False`` sorts everything, as before; both must give the same records in
the same order, whatever the disorder, ties, bad lines and filters.
"""

from __future__ import annotations

import gzip
import random
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ncclwatch.ingest.recording import ReadStats, SortedRecording, order_key
from ncclwatch_testkit.synth import T0_NS, op_record

from ncclwatch.records import DropRecord, ThroughputRecord, to_json


def _op(stream: int, seq: int, end_ns: int) -> bytes:
    exec_ns = 40_000
    return to_json(op_record(job="j", host="h", pid=1000 + stream, gpu=f"GPU-{stream}", comm=0xAB + seq % 2,
                             rank=stream, seq=seq, start_ns=end_ns - exec_ns, exec_ns=exec_ns)).encode()


def _both(paths: list[Path], **kw) -> tuple[list, list, SortedRecording, SortedRecording]:
    out = []
    for stream in (True, False):
        with SortedRecording(paths, ReadStats(), stream=stream, **kw) as rec:
            out.append((rec, list(rec)))
    (streamed, a), (sorted_, b) = out
    return a, b, streamed, sorted_


def _assert_same(a: list, b: list) -> None:
    assert [(s, o, raw) for s, o, raw, _ in a] == [(s, o, raw) for s, o, raw, _ in b]
    assert [r for *_, r in a] == [r for *_, r in b]
    keys = [order_key(r) for *_, r in a]
    assert keys == sorted(keys)


def test_an_ordered_spool_is_streamed_whole_and_sorts_nothing(tmp_path):
    for s in range(3):
        (tmp_path / f"s{s}.jsonl").write_bytes(b"".join(_op(s, i, T0_NS + i * 1000 + s) + b"\n" for i in range(200)))
    a, b, streamed, sorted_ = _both([tmp_path])
    _assert_same(a, b)
    assert streamed.sorted_records == 0 and sorted_.sorted_records == 600 == streamed.total


def test_records_written_late_go_through_the_sort_and_land_in_their_place(tmp_path):
    lines = [_op(0, i, T0_NS + i * 1000) for i in range(300)]
    lines.insert(250, _op(0, 999, T0_NS + 10 * 1000 + 1))  # far too late: belongs near the start
    lines.insert(100, _op(0, 998, T0_NS + 98_500))  # late by one record
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "b.jsonl").write_bytes(b"".join(_op(1, i, T0_NS + i * 1000) + b"\n" for i in range(300)))
    a, b, streamed, _ = _both([tmp_path], run_records=1)
    _assert_same(a, b)
    assert streamed.sorted_records == 2 and streamed.runs == 2  # the two late ones, spilled


def test_a_reversed_file_is_all_sorted_and_still_merges_exactly(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b"".join(_op(0, i, T0_NS + i * 1000) + b"\n" for i in reversed(range(100))))
    (tmp_path / "b.jsonl").write_bytes(b"".join(_op(1, i, T0_NS + i * 1000) + b"\n" for i in range(100)))
    a, b, streamed, _ = _both([tmp_path], run_records=7)
    _assert_same(a, b)
    assert streamed.sorted_records == 99  # all but the first of the reversed file


def test_equal_times_keep_the_read_order_across_files_and_kinds(tmp_path):
    t = T0_NS + 5000
    thr = to_json(ThroughputRecord(job="j", host="h", rank=0, ts_ns=t, step=1, tflops_per_gpu=1.0,
                                   tokens_per_s=None, source="api")).encode()
    drop = to_json(DropRecord(job="j", host="h", pid=1, gpu="g", rank=0, ts_ns=t, reason="pool_full",
                              count=1, total=1)).encode()
    (tmp_path / "a.jsonl").write_bytes(b"\n".join([thr, _op(0, 0, t), drop, _op(0, 1, t)]) + b"\n")
    (tmp_path / "b.jsonl").write_bytes(b"\n".join([_op(1, 0, t), drop, thr]) + b"\n")
    a, b, _, _ = _both([tmp_path])
    _assert_same(a, b)
    assert [r.KIND for *_, r in a] == ["op", "op", "op", "drop", "drop", "throughput", "throughput"]


def test_bad_lines_keep_and_a_partial_last_line_are_left_out_alike(tmp_path):
    lines = [_op(0, i, T0_NS + i * 1000) for i in range(50)]
    lines[10] = b'{"v":1,"kind":"op"}'
    lines[20] = b""
    lines[30] = b"not json"
    body = b"\n".join(lines) + b"\n" + _op(0, 99, T0_NS)[:40]  # still being written
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(body))
    (tmp_path / "b.jsonl").write_bytes(b"".join(_op(1, i, T0_NS + i * 999) + b"\n" for i in range(50)))
    a, b, streamed, _ = _both([tmp_path], keep=lambda r: r.seq % 3 != 1)
    _assert_same(a, b)
    assert streamed.sorted_records == 0 and streamed.total == len(a) == 64
    assert streamed.stats.quarantined and streamed.stats.partial_lines == 1


def _looks_right(line: bytes) -> bytes:
    """An op line whose version, job and time are fine and whose communicator is not:
    the first pass's look takes it for a record, the parse refuses it."""
    out = line.replace(b'"comm":"0x', b'"comm":"0X', 1)
    assert out != line
    return out


def test_lines_that_look_right_but_are_refused_are_left_out_and_uncounted(tmp_path):
    lines = [_op(0, i, T0_NS + i * 1000) for i in range(60)]
    lines[5] = _looks_right(lines[5])  # in order
    lines.insert(40, _looks_right(_op(0, 97, T0_NS + 3_500)))  # late: went to the sort's check
    lines.insert(41, _op(0, 98, T0_NS + 3_500))  # late and good, at the same time
    lines[50] = _looks_right(_op(0, 99, T0_NS + 49_000))  # in order, equal to the next one's time
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "b.jsonl").write_bytes(b"".join(_op(1, i, T0_NS + i * 1000) + b"\n" for i in range(60)))
    a, b, streamed, sorted_ = _both([tmp_path])
    _assert_same(a, b)
    assert streamed.refused_late == 2  # the two in order; the late one was parsed whole then
    assert streamed.total == sorted_.total == len(a) == 119
    assert streamed.stats.records == sorted_.stats.records == 119
    assert streamed.kinds == sorted_.kinds
    assert streamed.stats.quarantined == sorted_.stats.quarantined == {"schema": 3}


def test_bad_lines_and_a_partial_last_line_without_keep_are_left_out_alike(tmp_path):
    # without keep the first pass only looks at op lines: gzipped, cut and bad ones too
    lines = [_op(0, i, T0_NS + i * 1000) for i in range(50)]
    lines[10] = b'{"v":1,"kind":"op"}'
    lines[20] = b""
    lines[30] = b"not json"
    lines[40] = _looks_right(lines[40])
    lines[45] = lines[45].replace(b'"v":1', b'"v":9')  # a version this build does not read
    body = b"\n".join(lines) + b"\n" + _op(0, 99, T0_NS)[:40]  # still being written
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(body))
    (tmp_path / "b.jsonl").write_bytes(b"".join(_op(1, i, T0_NS + i * 999) + b"\n" for i in range(50)))
    a, b, streamed, sorted_ = _both([tmp_path])
    _assert_same(a, b)
    assert streamed.sorted_records == 0 and streamed.total == len(a) == 95
    assert streamed.stats.quarantined == sorted_.stats.quarantined
    assert sum(streamed.stats.quarantined.values()) == 5 and streamed.stats.partial_lines == 1


def test_a_file_that_grew_after_the_first_pass_replays_what_was_counted(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_bytes(b"".join(_op(0, i, T0_NS + i * 1000) + b"\n" for i in range(40)))
    with SortedRecording([tmp_path], ReadStats()) as rec:
        with f.open("ab") as out:
            out.write(b"".join(_op(0, i, T0_NS + i * 1000) + b"\n" for i in range(40, 60)))
        assert rec.total == len(list(rec)) == 40


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32), files=st.integers(1, 5), jitter=st.sampled_from([0, 1, 3, 50, 10_000]),
       run_records=st.sampled_from([1, 5, 10**6]))
def test_streaming_gives_the_sorted_order_on_random_spools(tmp_path_factory, seed, files, jitter, run_records):
    rnd = random.Random(seed)
    d = tmp_path_factory.mktemp("spool")
    for s in range(files):
        n = rnd.randint(0, 60)
        ends = [T0_NS + i * 1000 + rnd.randint(0, jitter) * 1000 for i in range(n)]  # some out of order
        if rnd.random() < 0.3:
            ends = [T0_NS + rnd.randint(0, 3) * 1000 for _ in range(n)]  # many equal times
        lines = [_op(s, i, e) for i, e in enumerate(ends)]
        if lines and rnd.random() < 0.3:
            lines[rnd.randrange(len(lines))] = b"{broken"
        for _ in range(rnd.choice([0, 0, 1, 3])):
            if lines:
                i = rnd.randrange(len(lines))
                lines[i] = _looks_right(lines[i]) if b'"comm":"0x' in lines[i] else lines[i]
        (d / f"s{s}.{rnd.randint(0, 1):06d}.jsonl").write_bytes(b"".join(x + b"\n" for x in lines))
    if not any(d.iterdir()):
        return
    a, b, streamed, sorted_ = _both([d], run_records=run_records)
    _assert_same(a, b)
    assert streamed.total == len(a)
    assert streamed.stats.quarantined == sorted_.stats.quarantined


def test_lines_split_across_small_reads_stream_the_same(tmp_path, monkeypatch):
    from ncclwatch.ingest import recording

    monkeypatch.setattr(recording, "_READ_BYTES", 97)  # smaller than a line: every line spans reads
    monkeypatch.setattr(recording, "_MIN_READ_BYTES", 1)
    for s in range(4):
        (tmp_path / f"s{s}.jsonl").write_bytes(b"".join(_op(s, i, T0_NS + i * 700 + s * 333) + b"\n"
                                                        for i in range(80)))
    a, b, streamed, _ = _both([tmp_path])
    _assert_same(a, b)
    assert streamed.sorted_records == 0 and len(a) == 320
