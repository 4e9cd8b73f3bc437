"""The C plugin's output obeys the record contract, checked from the Python side.

The plugin is built with ``make -C plugin`` and driven by ``tests/plugin/driver.c``, which
dlopens it and plays NCCL (scenarios: several communicators, threads, graph replays,
sampling, drops of every kind, exit without finalize, Inspector outputs). Every line it
wrote must parse with ``ncclwatch.records.parse_line`` into an OpRecord, DropRecord or
PluginStats (never Quarantined) and validate against ``ncclwatch/schemas/*.json``; ids,
bytes, bandwidths and transport classes must equal what ``ncclwatch.rules`` computes.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ncclwatch import records, rules

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "plugin"
BUILD = PLUGIN / "build" / "normal"
FIXTURE = ROOT / "tests" / "fixtures" / "plugin_spool"

# Callbacks played by the driver's stress scenario and ops per thread of its threads
# scenario: enough to force every drop path, few enough lines to validate in a few seconds
# (make -C plugin test plays 1,000,000 callbacks and 3000 ops per thread).
STRESS_EVENTS = 100_000
THREAD_OPS = 500

INSPECTOR_COLL_LABELS = {
    "version",
    "slurm_job_id",
    "node",
    "gpu",
    "comm_name",
    "n_nodes",
    "nranks",
    "collective",
    "message_size",
    "algo_proto",
}
INSPECTOR_P2P_LABELS = INSPECTOR_COLL_LABELS - {"collective", "algo_proto"} | {"p2p_operation"}


@pytest.fixture(scope="module")
def driver_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    targets = [f"build/normal/{t}" for t in ("libncclwatch-profiler.so", "driver", "cuda/libcuda.so.1")]
    subprocess.run(["make", "-s", "-C", str(PLUGIN), *targets], check=True, timeout=300)
    out = tmp_path_factory.mktemp("plugin-driver")
    env = {**os.environ, "NW_TEST_CUDA_DIR": str(BUILD / "cuda"), "NW_TEST_THREAD_OPS": str(THREAD_OPS)}
    run = subprocess.run(
        [str(BUILD / "driver"), str(BUILD / "libncclwatch-profiler.so"), str(out), str(STRESS_EVENTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return out


def _schemas() -> dict[str, jsonschema.protocols.Validator]:
    out = {}
    for kind in ("op", "drop", "plugin_stats", "progress"):
        schema = json.loads(records.schema_path(kind).read_text())
        out[kind] = jsonschema.Draft202012Validator(schema)
    return out


def _lines(path: Path) -> list[bytes]:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    assert data.endswith(b"\n"), f"{path}: last line not terminated"
    return data.split(b"\n")[:-1]


def _segments(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.name.endswith((".jsonl", ".jsonl.gz")))


def check_spool_lines(paths: list[Path]) -> Counter:
    """Validate every line; returns how many records of each kind were seen."""
    schemas = _schemas()
    kinds: Counter = Counter()
    for path in paths:
        for n, raw in enumerate(_lines(path)):
            where = f"{path.name}:{n + 1}"
            rec = records.parse_line(raw, source=str(path))
            assert isinstance(rec, records.OpRecord | records.DropRecord | records.PluginStats
                              | records.ProgressRecord), f"{where}: {rec}"
            obj = json.loads(raw)
            schemas[obj["kind"]].validate(obj)
            kinds[obj["kind"]] += 1
            if isinstance(rec, records.OpRecord):
                _check_op(rec, where)
            if n == 0:
                assert isinstance(rec, records.PluginStats), f"{where}: a segment opens with plugin_stats"
                assert path.name.split(".")[-2 if path.suffix == ".jsonl" else -3] == f"{rec.segment:06d}"
    return kinds


def _check_op(rec: records.OpRecord, where: str) -> None:
    assert rec.id == rules.record_id(rec.job, rec.host, rec.pid, rec.comm, rec.rank, rec.op, rec.peer, rec.seq), where
    if rec.dtype in rules.DTYPE_BYTES:
        assert rec.bytes == rules.message_bytes(rec.count, rec.dtype), where
    else:
        assert rec.bytes == 0, where
    # Bit-exact: the plugin computes with the same operations in the same order.
    assert (rec.algbw_gbs, rec.busbw_gbs) == rules.bandwidths_gbs(rec.op, rec.bytes, rec.nranks, rec.exec_ns), where
    assert rec.transport == rules.transport_class(rec.nranks, rec.nnodes), where
    assert rec.local_ranks == rules.local_ranks(rec.nranks, rec.nnodes), where
    if rec.timing == "host":
        assert rec.exec_ns == 0, where


def test_every_line_the_plugin_writes_is_a_valid_contract_record(driver_out: Path) -> None:
    paths = _segments(driver_out)
    kinds = check_spool_lines(paths)
    # The driver's scenarios produce ops, drops of several reasons and stats.
    assert kinds["op"] > 4 * THREAD_OPS and kinds["drop"] >= 5 and kinds["plugin_stats"] >= 13


def test_the_recorded_gpu_spool_is_valid_and_complete() -> None:
    """The spool recorded on 2xH200 (tests/fixtures/plugin_spool/README.md) obeys the contract."""
    paths = _segments(FIXTURE)
    assert len(paths) == 2, paths
    kinds = check_spool_lines(paths)
    assert kinds["op"] == 528 and kinds["drop"] == 0
    lines = [json.loads(x) for p in paths for x in _lines(p)]
    for pid in {x["pid"] for x in lines}:
        mine = [x for x in lines if x["pid"] == pid]
        stats = [x for x in mine if x["kind"] == "plugin_stats"]
        assert stats[-1]["recorded"] == sum(x["kind"] == "op" for x in mine) == 264
        assert set(stats[-1]["dropped"].values()) == {0}
        assert {x["gpu"] for x in mine} == {mine[0]["gpu"]} and mine[0]["gpu"].startswith("GPU-")
    ops = [x for x in lines if x["kind"] == "op"]
    gpu_timed = [x for x in ops if x["timing"] == "kernel_gpu"]
    # Everything but the AllToAll communicator's Send/Recv is GPU-timed, with nonzero time.
    assert len(gpu_timed) == 528 - 192 and all(x["exec_ns"] > 0 for x in gpu_timed)
    assert {x["op"] for x in ops} == {"AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "Send", "Recv"}


def test_user_strings_survive_escaping_and_name_files_safely(driver_out: Path) -> None:
    seg = _segments(driver_out / "basic")
    assert len(seg) == 1
    ops = [r for r in map(records.parse_line, _lines(seg[0])) if isinstance(r, records.OpRecord)]
    # The driver gave the job and communicator name quotes, backslashes, control bytes,
    # é and an invalid byte: invalid UTF-8 is replaced, everything else kept.
    assert {r.job for r in ops} == {'job "7"/\\\x01é\ufffd'}
    assert {r.comm_name for r in ops} == {'tp"0\\\n\x01é\ufffd'}
    assert seg[0].parent.name == rules.safe_filename('job "7"/\\\x01é\ufffd')
    host = ops[0].host
    assert seg[0].name == f"{rules.safe_filename(host)}-{ops[0].gpu}-{ops[0].pid}.000000.jsonl"


def test_drops_are_reported_and_add_up(driver_out: Path) -> None:
    lines = [json.loads(x) for p in _segments(driver_out / "stress") for x in _lines(p)]
    stats = [x for x in lines if x["kind"] == "plugin_stats"]
    drops = [x for x in lines if x["kind"] == "drop"]
    assert set(stats[-1]["dropped"]) == set(records.DROP_REASONS)
    assert stats[-1]["dropped"]["ring_full"] > 0 and stats[-1]["dropped"]["pool_full"] > 0
    # Drop records carry running totals that end at the final stats' counts.
    for reason in ("ring_full", "pool_full"):
        mine = [d for d in drops if d["reason"] == reason]
        assert mine and mine[-1]["total"] == stats[-1]["dropped"][reason]
        assert all(b["total"] - a["total"] == b["count"] for a, b in zip(mine, mine[1:], strict=False))


def test_gpu_uuid_names_the_segment_when_the_driver_answers(driver_out: Path) -> None:
    (seg,) = _segments(driver_out / "exit")
    uuid = "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f"
    assert f"-{uuid}-" in seg.name
    recs = [records.parse_line(x) for x in _lines(seg)]
    assert {r.gpu for r in recs} == {uuid}
    assert sum(isinstance(r, records.OpRecord) for r in recs) == 7


def test_inspector_json_has_inspectors_fields(driver_out: Path) -> None:
    (log,) = (driver_out / "inspector" / "json").glob("*-pid*.log")
    objs = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(objs) == 16
    for o in objs:
        assert set(o["header"]) == {"id", "comm_name", "rank", "n_ranks", "nnodes"}
        assert set(o["metadata"]) == {
            "inspector_output_format_version",
            "git_rev",
            "rec_mechanism",
            "dump_timestamp_us",
            "hostname",
            "pid",
        }
        (perf,) = {"coll_perf", "p2p_perf"} & set(o)
        p = perf.split("_")[0]
        want = {
            p,
            f"{p}_sn",
            f"{p}_msg_size_bytes",
            f"{p}_exec_time_us",
            f"{p}_timing_source",
            f"{p}_algobw_gbs",
            f"{p}_busbw_gbs",
        } | ({"p2p_peer"} if p == "p2p" else set())
        assert set(o[perf]) == want


def test_inspector_prometheus_file_parses_with_inspectors_names_and_labels(driver_out: Path) -> None:
    (prom,) = (driver_out / "inspector" / "prom").glob("nccl_inspector_metrics_*.prom")
    assert not list(prom.parent.glob(".*tmp")), "no temporary file left behind"
    families = {f.name: f for f in text_string_to_metric_families(prom.read_text())}
    coll = {"nccl_bus_bandwidth_gbs", "nccl_collective_exec_time_microseconds"}
    p2p = {"nccl_p2p_bus_bandwidth_gbs", "nccl_p2p_exec_time_microseconds"}
    extra = {f"nccl_collective_exec_time_microseconds_{s}" for s in ("count", "p50", "p95", "max")}
    extra |= {f"nccl_p2p_exec_time_microseconds_{s}" for s in ("count", "p50", "p95", "max")}
    extra |= {"nccl_bus_bandwidth_gbs_min", "nccl_p2p_bus_bandwidth_gbs_min"}
    assert coll | p2p | extra <= set(families)
    for name, fam in families.items():
        for s in fam.samples:
            want = INSPECTOR_P2P_LABELS if name.startswith("nccl_p2p") else INSPECTOR_COLL_LABELS
            assert set(s.labels) == want, (name, s.labels)
            assert s.labels["comm_name"] == 'dp "0"\n\\'
            assert math.isfinite(s.value)
    (count,) = families["nccl_collective_exec_time_microseconds_count"].samples
    (mx,) = families["nccl_collective_exec_time_microseconds_max"].samples
    (mean,) = families["nccl_collective_exec_time_microseconds"].samples
    assert (count.value, mx.value, mean.value) == (10, 19, 14.5)
    assert count.labels["message_size"] == rules.inspector_size_label(1 << 20)
