"""DiskBuffer: the bounded spill queue survives restarts and torn writes."""

from __future__ import annotations

from ncclwatch.ingest.buffer import DiskBuffer


def test_batches_come_back_in_order_across_files_and_restarts(tmp_path):
    b = DiskBuffer(str(tmp_path), file_bytes=100)
    for i in range(5):
        b.append([("t", b"k", b"v%d" % i * 20)])
    assert b.peek() == [("t", b"k", b"v0" * 20)]
    b.advance()
    pos = b.position
    b2 = DiskBuffer(str(tmp_path), pos)
    got = []
    while (m := b2.peek()) is not None:
        got.append(m[0][2][:2])
        b2.advance()
    assert got == [b"v1", b"v2", b"v3", b"v4"]
    assert b2.empty()


def test_torn_tail_is_cut_on_open(tmp_path):
    b = DiskBuffer(str(tmp_path))
    b.append([("t", None, b"whole")])
    (f,) = list(tmp_path.glob("buffer.*.bin"))
    with open(f, "ab") as fh:
        fh.write(b"\x00\x00\x01\x00partial")  # a crash in the middle of append
    b2 = DiskBuffer(str(tmp_path))
    assert b2.peek() == [("t", None, b"whole")]
    b2.advance()
    assert b2.peek() is None


def test_collect_deletes_consumed_files_and_position_survives(tmp_path):
    b = DiskBuffer(str(tmp_path), file_bytes=10)
    b.append([("t", b"k", b"a" * 20)])
    b.append([("t", b"k", b"b" * 20)])
    b.peek()
    b.advance()
    b.peek()
    b.advance()
    pos = b.position
    b.collect()
    assert list(tmp_path.glob("buffer.*.bin")) == []
    b2 = DiskBuffer(str(tmp_path), pos)
    b2.append([("t", b"k", b"c")])
    assert b2.peek() == [("t", b"k", b"c")]
