"""NCCL Inspector JSON-mode lines and .prom files mapped into the record contract."""

from __future__ import annotations

from pathlib import Path

import pytest
from ncclwatch.ingest.inspector import (
    InspectorError,
    message_size_lower_bytes,
    op_from_inspector,
    windows_from_prom,
)

from ncclwatch import rules
from ncclwatch.records import from_json, to_dict

FIXTURES = Path(__file__).parent / "fixtures" / "inspector"
LOG = next(FIXTURES.glob("*.log"))
PROM = next(FIXTURES.glob("*.prom"))


def lines():
    return LOG.read_bytes().splitlines()


def test_every_fixture_line_maps_to_a_valid_op_record():
    ops = [op_from_inspector(line, job="j") for line in lines()]
    for op in ops:
        assert from_json(to_dict(op)) == op
        assert op.timing == "inspector"
        assert op.id == rules.record_id("j", op.host, op.pid, op.comm, op.rank, op.op, op.peer,
                                        op.seq)
    assert {op.op for op in ops} == {"AllReduce", "AllGather", "ReduceScatter", "Send"}


def test_collective_fields_and_start_time_without_trace():
    op = op_from_inspector(lines()[0], job="j")
    assert op.comm == "0x007f8c496ae9f661"  # Inspector prints "0x%lx", unpadded
    assert (op.rank, op.nranks, op.nnodes, op.transport) == (2, 8, 1, "nvlink")
    assert (op.comm_name, op.seq, op.bytes, op.exec_ns) == ("DP Group 0", 1400, 1 << 20, 61_000)
    # no trace: the op ended at or before the dump, so start = dump - exec
    assert op.start_ns == 1763790000000000 * 1000 - 61_000
    alg, bus = rules.bandwidths_gbs("AllReduce", 1 << 20, 8, 61_000)
    assert op.busbw_gbs == pytest.approx(bus) and op.busbw_gbs == pytest.approx(30.082098, 1e-6)


def test_verbose_trace_gives_first_kernel_start_and_channels():
    (line,) = [x for x in lines() if b"event_trace_ts" in x]
    op = op_from_inspector(line, job="j")
    assert op.start_ns == (1763790000000000 + 3000120) * 1000
    assert op.channels == 2


def test_unnamed_comm_and_multi_node_transport():
    (line,) = [x for x in lines() if b'"coll_sn":77' in x]
    op = op_from_inspector(line, job="j")
    assert (op.comm_name, op.transport, op.local_ranks) == ("", "mixed", 8)


def test_p2p_line_keeps_its_peer():
    (line,) = [x for x in lines() if b"p2p_perf" in x]
    op = op_from_inspector(line, job="j")
    assert (op.op, op.peer, op.transport, op.bytes) == ("Send", 1, "net", 1572864)


@pytest.mark.parametrize("raw,reason", [
    (b"{bad", "not_json"),
    (b'{"header":{}, "metadata":{"inspector_output_format_version":"v3.0"}}', "unknown_version"),
    (b'{"header":{}, "metadata":{"inspector_output_format_version":"v4.0"}}', "unknown_kind"),
    (b"\xff\xff", "not_utf8"),
])
def test_bad_lines_raise_with_a_reason(raw, reason):
    with pytest.raises(InspectorError) as e:
        op_from_inspector(raw, job="j")
    assert e.value.reason == reason


def test_missing_field_is_a_schema_error():
    line = lines()[0].replace(b'"coll_sn":1400,', b"")
    with pytest.raises(InspectorError) as e:
        op_from_inspector(line, job="j")
    assert e.value.reason == "schema"


def test_prom_file_maps_to_windows_with_honest_counts():
    wins, bad = windows_from_prom(PROM.read_bytes(), start_ns=10, end_ns=20, source=str(PROM))
    assert bad == []
    for w in wins:
        assert from_json(to_dict(w)) == w
    by_op = {w.op: w for w in wins}
    assert set(by_op) == {"ReduceScatter", "AllReduce", "Send", "Recv"}
    rs = by_op["ReduceScatter"]  # two algo_proto buckets share one window key
    assert (rs.count, rs.exec_ns_min, rs.exec_ns_max) == (2, 104_164_000, 113_000_000)
    assert rs.busbw_gbs_p50 == 40.5  # nearest rank of [40.5, 44.1181]
    assert (rs.transport, rs.nranks, rs.size_bucket, rs.job, rs.host, rs.rank) == (
        "mixed", 32, "128MiB", "1670760", "nvl72033-T01", 0)
    ar = by_op["AllReduce"]
    assert (ar.count, ar.exec_ns_p50, ar.busbw_gbs_p50, ar.comm_name) == (1, 9_498_470, 678.263,
                                                                         "DP Group 0")
    assert (ar.start_ns, ar.end_ns) == (10, 20)


def test_prom_garbage_is_reported_not_raised():
    data = PROM.read_bytes() + (b"nccl_bus_bandwidth_gbs{broken 1\n"
                                b'nccl_bus_bandwidth_gbs{a="1"} x\n')
    wins, bad = windows_from_prom(data, start_ns=0, end_ns=1)
    assert len(wins) == 4
    assert len(bad) >= 2


def test_message_size_labels():
    assert message_size_lower_bytes("4-5GB") == 4 << 30
    assert message_size_lower_bytes("1023-1024B") == 1023
    with pytest.raises(InspectorError):
        message_size_lower_bytes("big")


def _line(perf: dict, kind: str = "coll") -> bytes:
    import json

    return json.dumps({
        "header": {"id": "0xab", "comm_name": "dp", "rank": 1, "n_ranks": 8, "nnodes": 2},
        "metadata": {"inspector_output_format_version": "v4.0", "git_rev": "", "hostname": "h", "pid": 9,
                     "rec_mechanism": "nccl_profiler_interface", "dump_timestamp_us": 2_000_000},
        f"{kind}_perf": perf}).encode()


@pytest.mark.parametrize("source,exec_us,timing", [
    ("kernel_gpu", 100, "inspector"),
    ("kernel_cpu", 100, "host"),       # NCCL_INSPECTOR_REQUIRE_KERNEL_TIMING=0: launch included
    ("collective_cpu", 100, "host"),
    ("kernel_gpu", 0, "host"),         # nothing usable (a Send/Recv without timestamps), or < 1 us
])
def test_only_gpu_timed_ops_carry_a_duration(source, exec_us, timing):
    """An op Inspector timed on the host, or could not time, is counted but measures
    nothing: no 0 in a window's kernel times, no bandwidth of 0, no launch time in a
    baseline of kernel times."""
    for kind, perf in (("coll", {"coll": "AllReduce", "coll_sn": 5, "coll_msg_size_bytes": 1 << 20}),
                       ("p2p", {"p2p": "Send", "p2p_sn": 3, "p2p_peer": 2, "p2p_msg_size_bytes": 1 << 20})):
        perf |= {f"{kind}_exec_time_us": exec_us, f"{kind}_timing_source": source,
                 f"{kind}_algobw_gbs": "nan", f"{kind}_busbw_gbs": "nan"}
        op = op_from_inspector(_line(perf, kind), job="j")
        assert op.timing == timing
        if timing == "host":
            assert (op.exec_ns, op.busbw_gbs, op.algbw_gbs) == (0, 0.0, 0.0)
            assert op.start_ns == 2_000_000_000 - exec_us * 1000  # still placed in time
        else:
            assert op.exec_ns == 100_000 and op.busbw_gbs > 0


def test_allgatherv_bandwidth_as_inspector_counts_it():
    """Inspector's AllGatherV: the per-rank message times the ranks, (n - 1)/n on the bus,
    as for AllGather."""
    perf = {"coll": "AllGatherV", "coll_sn": 1, "coll_msg_size_bytes": 1_000_000, "coll_exec_time_us": 100,
            "coll_timing_source": "kernel_gpu", "coll_algobw_gbs": 80.0, "coll_busbw_gbs": 70.0}
    op = op_from_inspector(_line(perf), job="j")
    assert (op.algbw_gbs, op.busbw_gbs) == (80.0, 70.0)


def test_an_op_inspector_cannot_name_is_counted_not_measured():
    """Inspector writes "Invalid" for an op it has no name for; a key of those would mix
    AlltoAll, Gather and Scatter in one baseline."""
    from ncclwatch.ingest.inspector import NotAnOp

    perf = {"coll": "Invalid", "coll_sn": 1, "coll_msg_size_bytes": 1 << 20, "coll_exec_time_us": 100,
            "coll_timing_source": "kernel_gpu", "coll_algobw_gbs": 1.0, "coll_busbw_gbs": 1.0}
    with pytest.raises(NotAnOp) as e:
        op_from_inspector(_line(perf), job="j")
    assert e.value.what == "invalid_op"
