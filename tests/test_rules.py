"""The shared rules against hand-computed vectors (the C plugin reads the same file)."""

import json
from pathlib import Path

import pytest

from ncclwatch import rules

VECTORS = json.loads((Path(__file__).parent / "vectors" / "rules.json").read_text())


@pytest.mark.parametrize("case", VECTORS["bandwidth"], ids=lambda c: f"{c['op']}-{c['nranks']}")
def test_bandwidth_matches_hand_computed(case):
    # e.g. AllReduce, 8 ranks: algbw = 1e6 B / 1000 ns = 1000 GB/s, busbw = 1000 * 2*7/8 = 1750.
    algbw, busbw = rules.bandwidths_gbs(case["op"], case["bytes"], case["nranks"], case["exec_ns"])
    assert algbw == pytest.approx(case["algbw_gbs"])
    assert busbw == pytest.approx(case["busbw_gbs"])


@pytest.mark.parametrize("nbytes,label", VECTORS["size_bucket"])
def test_size_bucket_is_power_of_two_at_or_below(nbytes, label):
    assert rules.size_bucket(nbytes) == label
    assert rules.size_bucket_bytes(label) <= nbytes or nbytes == 0


@pytest.mark.parametrize("nbytes,label", VECTORS["inspector_size_label"])
def test_inspector_label_matches_inspector_rule(nbytes, label):
    assert rules.inspector_size_label(nbytes) == label


@pytest.mark.parametrize("nranks,nnodes,cls", VECTORS["transport_class"])
def test_transport_class(nranks, nnodes, cls):
    assert rules.transport_class(nranks, nnodes) == cls


def test_transport_class_rejects_nonsense():
    with pytest.raises(ValueError):
        rules.transport_class(0, 1)


def test_record_id_vectors_are_stable():
    for c in VECTORS["record_id"]:
        got = rules.record_id(c["job"], c["host"], c["pid"], c["comm"], c["rank"], c["op"], c["peer"], c["seq"])
        assert got == c["id"]


def test_record_id_differs_by_peer_and_seq():
    base = ("j", "h", 1, "0x0000000000000001", 0, "Send")
    ids = {rules.record_id(*base, peer, seq) for peer in (0, 1) for seq in (0, 1)}
    assert len(ids) == 4


def test_fnv1a64_known_values():
    # Published FNV-1a 64 test vectors.
    assert rules.fnv1a64(b"") == 0xCBF29CE484222325
    assert rules.fnv1a64(b"foobar") == 0x85944171F73967E8


def test_safe_filename_escapes_traversal_and_keeps_distinct_names_distinct():
    assert "/" not in rules.safe_filename("../../etc/passwd")
    assert not rules.safe_filename("..").startswith(".")
    assert rules.safe_filename("a b") != rules.safe_filename("a_b")
    assert rules.safe_filename("job-42_x") == "job-42_x"


def test_bus_factor_allgather_and_reducescatter_are_n_minus_1_over_n():
    assert rules.bus_factor("AllGather", 8) == pytest.approx(7 / 8)
    assert rules.bus_factor("ReduceScatter", 2) == pytest.approx(0.5)
