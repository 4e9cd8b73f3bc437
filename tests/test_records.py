"""The record contract: dataclasses, generated JSON Schemas and parse_line agree."""

import json

import jsonschema
import pytest

from ncclwatch import records, rules


def op_dict(**overrides):
    d = {
        "v": 1, "kind": "op", "id": rules.record_id("j", "h", 7, "0x00000000000000aa", 1, "AllReduce", -1, 3),
        "job": "j", "host": "h", "pid": 7, "gpu": "GPU-1", "comm": "0x00000000000000aa",
        "comm_name": "tp", "rank": 1, "nranks": 2, "nnodes": 1, "local_ranks": 2,
        "transport": "nvlink", "op": "AllReduce", "seq": 3, "count": 262144,
        "dtype": "ncclFloat32", "bytes": 1048576, "peer": -1, "algo": "RING", "proto": "SIMPLE",
        "channels": 4, "start_ns": 1_700_000_000_000_000_000, "exec_ns": 10_000,
        "timing": "kernel_gpu", "algbw_gbs": 104.8576, "busbw_gbs": 104.8576, "graph": False,
    }
    d.update(overrides)
    return d


@pytest.mark.parametrize("kind", sorted(records.RECORD_TYPES))
def test_committed_schema_is_generated_from_the_dataclass(kind):
    committed = json.loads(records.schema_path(kind).read_text())
    assert committed == records.json_schema(records.RECORD_TYPES[kind]), (
        "schema out of date: run python -m ncclwatch.records --write-schemas"
    )


def test_valid_op_round_trips_and_passes_json_schema():
    rec = records.parse_line(json.dumps(op_dict()))
    assert isinstance(rec, records.OpRecord)
    again = json.loads(records.to_json(rec))
    assert again == op_dict()
    jsonschema.validate(again, json.loads(records.schema_path("op").read_text()))


def test_missing_field_is_rejected_with_its_name():
    d = op_dict()
    del d["exec_ns"]
    q = records.parse_line(json.dumps(d))
    assert isinstance(q, records.Quarantined)
    assert q.reason == "schema" and "missing field(s) exec_ns" in q.detail


def test_wrong_type_is_rejected_with_field_and_types():
    q = records.parse_line(json.dumps(op_dict(exec_ns="10")))
    assert q.reason == "schema"
    assert q.detail == "op.exec_ns: expected int, got str"


def test_bool_is_not_an_int():
    q = records.parse_line(json.dumps(op_dict(rank=True)))
    assert q.reason == "schema" and "op.rank" in q.detail


def test_unknown_version_is_its_own_reason():
    q = records.parse_line(json.dumps(op_dict(v=2)))
    assert q.reason == "unknown_version" and "2" in q.detail


def test_unknown_kind_and_extra_field_are_rejected():
    assert records.parse_line(json.dumps(op_dict(kind="opp"))).reason == "unknown_kind"
    q = records.parse_line(json.dumps(op_dict(colour="red")))
    assert q.reason == "schema" and "unknown field(s) colour" in q.detail


def test_enum_and_minimum_and_pattern_are_enforced():
    assert "transport" in records.parse_line(json.dumps(op_dict(transport="pcie"))).detail
    assert "below 0" in records.parse_line(json.dumps(op_dict(exec_ns=-1))).detail
    assert "comm" in records.parse_line(json.dumps(op_dict(comm="deadbeef"))).detail


@pytest.mark.parametrize(
    "mutation",
    [
        {"exec_ns": "10"}, {"v": 2}, {"transport": "pcie"}, {"rank": -1}, {"graph": 1},
        {"comm": "0xABC"}, {"busbw_gbs": None},
    ],
)
def test_json_schema_rejects_what_parse_line_rejects(mutation):
    schema = json.loads(records.schema_path("op").read_text())
    d = op_dict(**mutation)
    assert isinstance(records.parse_line(json.dumps(d)), records.Quarantined)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(d, schema)


def test_garbage_never_raises():
    for raw in (b"", b"\x00\x01", b"[]", b"null", b'"x"', b"{" * 10, b"\xff" * 100, b"1e999"):
        q = records.parse_line(raw, source="f.jsonl", offset=42)
        assert isinstance(q, records.Quarantined)
        assert q.source == "f.jsonl" and q.offset == 42


def test_oversized_line_is_quarantined_and_cut():
    q = records.parse_line(b"x" * (records.MAX_LINE_BYTES + 1))
    assert q.reason == "too_long" and len(q.raw) == 4096


def test_user_strings_survive_json_escaping():
    nasty = 'tp"\\\n\t\u2603\x01'
    rec = records.parse_line(json.dumps(op_dict(comm_name=nasty, job="a/b c")))
    line = records.to_json(rec)
    assert "\n" not in line
    assert records.parse_line(line).comm_name == nasty


def test_anomaly_event_allows_nulls_where_documented():
    ev = records.AnomalyEvent(
        id="a1", type="network_path", state="firing", job="j",
        key={"comm": None, "comm_name": None, "op": None, "size_bucket": None, "transport": "net"},
        host=None, rank=None, start_ns=1, end_ns=None, detected_ns=2, baseline_busbw_gbs=None,
        observed_busbw_gbs=None, effect=0.2, attribution="network", throughput_delta=None,
        severity="critical", evidence={},
    )
    assert records.parse_line(records.to_json(ev)) == ev
    schema = json.loads(records.schema_path("anomaly").read_text())
    jsonschema.validate(records.to_dict(ev), schema)
