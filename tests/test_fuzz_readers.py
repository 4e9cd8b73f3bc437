"""Fuzzing every reader of records: quarantine or accept, never an exception.

Hypothesis throws generated lines at ``records.parse_line`` (forwarder slow path,
``watch``, ``replay``, ``report``), the forwarder's fast msgspec parse and the worker's
``decode_message``. Lines are arbitrary bytes, JSON documents with odd values in every
position, and good records with one field replaced by something hostile (huge and
negative integers, NaN, overflowing floats, lone surrogate escapes, deep nesting).

What must hold for every input:

- nothing raises;
- a rejection is a ``Quarantined`` with a stage and a reason from the closed sets, and
  it serialises to strict, encodable JSON (it goes to a file and a topic);
- an accepted record survives what its consumers do with it: strict JSON out
  (``allow_nan=False``), UTF-8 encoding of every string, and parses back to itself;
- the fast parse accepts exactly what the contract accepts, with the same result.

Bounded in time: ``NCCLWATCH_FUZZ_EXAMPLES`` examples per property (default 400), no
example database, and a pytest timeout.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ncclwatch.detectors.messages import DETECTOR_KINDS, Message, decode_message, message_lines
from ncclwatch.ingest.parse import parse, to_record
from ncclwatch_testkit.synth import stream_lines

from ncclwatch import records
from ncclwatch.records import (
    DropRecord,
    PluginStats,
    Quarantined,
    ThroughputRecord,
    WindowSummary,
    to_json,
)

EXAMPLES = int(os.environ.get("NCCLWATCH_FUZZ_EXAMPLES", "400"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
pytestmark = pytest.mark.timeout(300)

GOOD_OP = json.loads(stream_lines(job="j", host="h", pid=1, gpu="g", rank=0, n=1)[0])
GOOD = [
    GOOD_OP,
    records.to_dict(DropRecord(job="j", host="h", pid=1, gpu="g", rank=-1, ts_ns=5,
                               reason="pool_full", count=2, total=9)),
    records.to_dict(PluginStats(job="j", host="h", pid=1, gpu="g", ts_ns=5, recorded=10,
                                dropped={"pool_full": 9, "ring_full": 0}, segment=1)),
    records.to_dict(ThroughputRecord(job="j", host="h", rank=0, ts_ns=1, step=2,
                                     tflops_per_gpu=300.5, tokens_per_s=None, source="api")),
    records.to_dict(WindowSummary(job="j", host="h", comm="0x00000000000000ab", comm_name="dp",
                                  op="AllReduce", size_bucket="1MiB", transport="nvlink", rank=0,
                                  nranks=2, start_ns=10**18, end_ns=10**18 + 10**9, count=3,
                                  bytes=3 << 20, exec_ns_min=1, exec_ns_p50=2, exec_ns_p95=3,
                                  exec_ns_max=4, busbw_gbs_p50=100.0, first_seq=0, last_seq=2)),
]

# JSON text fragments that are hostile on their own.
HOSTILE_TEXT = [
    "NaN", "-NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999", "2e308",
    str(2**63), str(-(2**63) - 1), str(2**63 - 1), str(2**64), str(2**70), "9" * 5000,
    '"\\ud800"', '"\\udcff"', '"a\\udcffb"', '"\\ud83d\\ude00"', '"\\u0000"', '"\\\\udcff"',
    "[" * 20000, "{" * 100, '{"a":' * 40 + "1" + "}" * 40, "[" * 17 + "]" * 17,
    "true", "false", "null", '""', "{}", "[]", "-0", "0.0", "1.0", "-1", "0",
]

json_leaf = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


@st.composite
def mutated_records(draw) -> bytes:
    """A good record with one field replaced (or added) by a value or hostile text."""
    good = dict(draw(st.sampled_from(GOOD)))
    name = draw(st.sampled_from([*good, "extra"]))
    marker = "\x00MARK\x00"
    if draw(st.booleans()):
        good[name] = draw(json_value)
        return json.dumps(good, ensure_ascii=draw(st.booleans())).encode()
    good[name] = marker
    text = json.dumps(good).replace(json.dumps(marker), draw(st.sampled_from(HOSTILE_TEXT)))
    return text.encode()


@st.composite
def spliced(draw) -> bytes:
    """A good line cut and joined with random bytes."""
    line = json.dumps(draw(st.sampled_from(GOOD))).encode()
    i = draw(st.integers(0, len(line)))
    j = draw(st.integers(i, len(line)))
    return line[:i] + draw(st.binary(max_size=16)) + line[j:]


lines = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")),
    json_value.map(lambda v: json.dumps(v).encode()),
    mutated_records(),
    spliced(),
    st.sampled_from(HOSTILE_TEXT).map(str.encode),
)


def assert_usable(rec) -> None:
    """What the forwarder, the detectors and the sinks do with a result must work."""
    text = json.dumps(records.to_dict(rec), ensure_ascii=False, allow_nan=False)
    text.encode("utf-8")  # raises on a lone surrogate
    if isinstance(rec, Quarantined):
        assert rec.stage in ("parse", "schema", "size")
        assert rec.reason in records.QUARANTINE_REASONS
        return
    assert records.parse_line(text.encode()) == rec  # strict JSON, back to itself
    for value in records.to_dict(rec).values():
        if isinstance(value, int) and not isinstance(value, bool):
            assert -(2**63) <= value < 2**63
        if isinstance(value, float):
            assert math.isfinite(value)


@FUZZ
@given(lines)
def test_parse_line_quarantines_or_accepts_and_never_raises(raw):
    rec = records.parse_line(raw, source="fuzz", offset=1)
    assert_usable(rec)
    # readers also hand it str (watch's text mode, tests): the same answer
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return
    again = records.parse_line(text, source="fuzz", offset=1)
    assert type(again) is type(rec)
    if not isinstance(rec, Quarantined):
        assert again == rec


@FUZZ
@given(lines)
def test_fast_parse_agrees_with_the_contract_and_never_raises(raw):
    slow = records.parse_line(raw, source="fuzz", offset=2)
    fast = parse(raw, source="fuzz", offset=2)
    if isinstance(slow, Quarantined):
        assert fast == slow
    else:
        assert to_record(fast) == slow
    assert_usable(to_record(fast))


@FUZZ
@given(
    value=st.one_of(st.none(), lines, st.lists(lines, min_size=1, max_size=4).map(b"\n".join)),
    key=st.one_of(st.none(), st.binary(max_size=12), st.just(b"j")),
    allowed=st.sampled_from([DETECTOR_KINDS, (WindowSummary,), (ThroughputRecord,)]),
)
def test_worker_decode_dead_letters_or_accepts_and_never_raises(value, key, allowed):
    msg = Message("nccl.windows", 0, 7, key, value, 0)
    parts = [None] if value is None else message_lines(value)
    for line in parts:
        rec = decode_message(msg, allowed, line=line)
        if isinstance(rec, Quarantined):
            # the worker sends exactly this to the dead-letter topic
            to_json(rec).encode()
            assert rec.reason in records.QUARANTINE_REASONS
        else:
            # the fast parser's struct (ingest/parse.py), the contract's record in value
            record = to_record(rec)
            assert isinstance(record, allowed)
            assert key is None or key == rec.job.encode()
            assert records.to_dict(rec) == records.to_dict(record)
            assert_usable(record)
