"""Windower: aligned stream-time windows with nearest-rank statistics."""

from __future__ import annotations

import random

import pytest
from ncclwatch.ingest.windows import Windower, nearest_rank

from ncclwatch.records import OpRecord, WindowSummary, from_json, to_dict

S = 1_000_000_000


def op(seq=0, *, end_ns, exec_ns=1000, busbw=100.0, nbytes=1 << 20, comm=1, rank=0,
       name="AllReduce", pid=1, host="h", job="j"):
    return OpRecord(
        id="0" * 16, job=job, host=host, pid=pid, gpu="g", comm=f"0x{comm:016x}",
        comm_name="dp", rank=rank, nranks=8, nnodes=1, local_ranks=8, transport="nvlink",
        op=name, seq=seq, count=nbytes // 4, dtype="ncclFloat32", bytes=nbytes, peer=-1,
        algo="RING", proto="SIMPLE", channels=4, start_ns=end_ns - exec_ns, exec_ns=exec_ns,
        timing="kernel_gpu", algbw_gbs=busbw / 1.75, busbw_gbs=busbw, graph=False,
    )


def test_quantiles_are_nearest_rank_hand_computed():
    w = Windower(1.0)
    # ten ops in window [0, 1 s): exec 10..100 us shuffled, busbw 1..10
    execs = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    order = list(range(10))
    random.Random(3).shuffle(order)
    for i in order:
        assert w.add(op(seq=100 + i, end_ns=S // 2 + i, exec_ns=execs[i] * 1000,
                        busbw=float(i + 1))) == []
    (s,) = w.flush()
    # n=10: p50 -> rank ceil(5)=5 -> 50 us; p95 -> rank ceil(9.5)=10 -> 100 us
    assert (s.count, s.exec_ns_min, s.exec_ns_p50, s.exec_ns_p95, s.exec_ns_max) == (
        10, 10_000, 50_000, 100_000, 100_000)
    assert s.busbw_gbs_p50 == 5.0
    assert (s.first_seq, s.last_seq) == (100, 109)
    assert s.bytes == 10 << 20
    assert (s.start_ns, s.end_ns, s.size_bucket) == (0, S, "1MiB")


def test_p95_of_twenty_values_is_the_nineteenth():
    w = Windower(1.0)
    for i in range(20):
        w.add(op(seq=i, end_ns=S + 1000 * i, exec_ns=(i + 1) * 1000, busbw=float(20 - i)))
    (s,) = w.flush()
    # ceil(0.95 * 20) = 19 -> 19 us; ceil(0.5 * 20) = 10 -> 10 us; busbw sorted 1..20 -> 10
    assert (s.exec_ns_p50, s.exec_ns_p95, s.busbw_gbs_p50) == (10_000, 19_000, 10.0)


def test_nearest_rank_small_samples():
    assert nearest_rank([5], 95) == 5
    assert nearest_rank([1, 2], 50) == 1
    assert nearest_rank([1, 2, 3], 50) == 2
    with pytest.raises(ValueError):
        nearest_rank([], 50)


def test_window_closes_only_one_window_after_its_end():
    w = Windower(1.0)
    assert w.add(op(0, end_ns=S // 2)) == []
    assert w.add(op(1, end_ns=S + S // 2)) == []  # window 1 opens; window 0 still open
    assert w.add(op(2, end_ns=2 * S - 1)) == []  # still below 0 s end + 1 s
    closed = w.add(op(3, end_ns=2 * S))  # exactly window end + window length
    assert [(c.start_ns, c.count) for c in closed] == [(0, 1)]


def test_op_belongs_to_the_window_of_its_end_time():
    w = Windower(1.0)
    w.add(op(0, end_ns=S + 10, exec_ns=S // 2))  # started in window 0, ended in window 1
    (s,) = w.flush()
    assert s.start_ns == S


def test_keys_are_separated_by_comm_op_bucket_and_rank():
    w = Windower(1.0)
    w.add(op(0, end_ns=10, comm=1))
    w.add(op(0, end_ns=11, comm=2))
    w.add(op(0, end_ns=12, name="AllGather"))
    w.add(op(1, end_ns=13, nbytes=3 << 20))  # 2MiB bucket
    w.add(op(0, end_ns=14, rank=1, pid=2))
    w.add(op(1, end_ns=15, nbytes=(1 << 20) + 5))  # same 1MiB bucket as the first
    out = w.flush()
    keys = {(s.comm[-1], s.op, s.size_bucket, s.rank): s.count for s in out}
    assert keys == {
        ("1", "AllReduce", "1MiB", 0): 2,
        ("2", "AllReduce", "1MiB", 0): 1,
        ("1", "AllGather", "1MiB", 0): 1,
        ("1", "AllReduce", "2MiB", 0): 1,
        ("1", "AllReduce", "1MiB", 1): 1,
    }


def test_one_process_clock_never_closes_another_process_windows():
    w = Windower(1.0)
    w.add(op(0, end_ns=S // 2, pid=1))
    assert w.add(op(0, end_ns=10 * S, pid=2)) == []  # far ahead, but another process
    assert w.add(op(1, end_ns=S // 2 + 5, pid=1)) == []  # pid 1's window 0 is still open
    closed = w.add(op(2, end_ns=3 * S, pid=1))
    assert [(c.start_ns, c.count) for c in closed] == [(0, 2)]


def test_late_op_is_counted_not_windowed():
    w = Windower(1.0)
    w.add(op(0, end_ns=S // 2))
    w.add(op(1, end_ns=3 * S))  # closes window 0
    assert w.add(op(2, end_ns=S // 3)) == []
    assert w.late_total == 1
    assert [s.count for s in w.flush()] == [1]


def test_windows_are_aligned_to_multiples_of_the_length():
    w = Windower(0.25)
    w.add(op(0, end_ns=1_300_000_000))
    (s,) = w.flush()
    assert (s.start_ns, s.end_ns) == (1_250_000_000, 1_500_000_000)


def test_summaries_are_valid_contract_records():
    w = Windower(1.0)
    out = [s for i in range(50) for s in w.add(op(i, end_ns=i * S // 10, busbw=50.0 + i))]
    out += w.flush()
    assert out and all(isinstance(s, WindowSummary) for s in out)
    for s in out:
        assert from_json(to_dict(s)) == s
    assert sum(s.count for s in out) == 50


def test_same_input_gives_same_windows():
    ops = [op(i, end_ns=i * 37_000_000, exec_ns=1000 + i) for i in range(200)]
    a, b = Windower(1.0), Windower(1.0)
    out_a = [s for o in ops for s in a.add(o)] + a.flush()
    out_b = [s for o in ops for s in b.add(o)] + b.flush()
    assert out_a == out_b


def test_bad_window_length_raises():
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            Windower(bad)


@pytest.mark.parametrize("timing", ["host", "sampled_out"])
def test_ops_without_gpu_timing_count_nowhere_but_move_stream_time(timing):
    """A sampled-out or host-timed op carries exec 0 and busbw 0: in the percentiles it
    would read as an infinitely fast op; it only advances its stream's time."""
    import dataclasses

    w = Windower(1.0, lateness_s=0.0)
    timed = [op(seq=i, end_ns=S // 2 + i, exec_ns=(i + 1) * 1000, busbw=10.0) for i in range(3)]
    untimed = [dataclasses.replace(op(seq=10 + i, end_ns=S // 2 + 10 + i, exec_ns=0, busbw=0.0),
                                   timing=timing, algbw_gbs=0.0) for i in range(30)]
    for o in timed + untimed:
        assert w.add(o) == []
    # An untimed op past the window's end closes it, as a timed one would.
    closing = dataclasses.replace(op(seq=99, end_ns=S + S // 2, exec_ns=0, busbw=0.0),
                                  timing=timing, algbw_gbs=0.0)
    (s,) = w.add(closing)
    assert (s.count, s.exec_ns_min, s.exec_ns_p50, s.busbw_gbs_p50) == (3, 1000, 2000, 10.0)
    assert (s.first_seq, s.last_seq) == (0, 2)
    # A window holding only untimed ops emits nothing.
    assert w.flush() == []
