"""`ncclwatch fit`: a robust alpha-beta model from history, saved as JSON, used at cold start."""

from __future__ import annotations

import gzip
import json
import random

import pytest
from ncclwatch.detectors.fit import fit_from_records
from ncclwatch.detectors.model import BusbwModel, bus_bytes
from ncclwatch.detectors.pipeline import Pipeline
from ncclwatch_testkit import scenarios

from ncclwatch import cli
from ncclwatch.config import DetectorConfig
from ncclwatch.records import OpRecord, to_json
from ncclwatch.rules import bandwidths_gbs, record_id

TRUTH = {  # (transport, op): (alpha_ns, beta bus GB/s)
    ("nvlink", "AllReduce"): (9_000.0, 380.0),
    ("net", "AllReduce"): (30_000.0, 42.0),
    ("mixed", "AllGather"): (45_000.0, 36.0),
}


def ops(n_per_size: int = 40, seed: int = 0, outliers: float = 0.03):
    rng = random.Random(seed)
    seq = 0
    for (transport, op), (alpha, beta) in TRUTH.items():
        nranks = 8 if transport == "nvlink" else 16
        for k in range(12, 31, 2):  # 4 KiB .. 1 GiB
            msg = 1 << k
            for _ in range(n_per_size):
                exec_ns = (alpha + bus_bytes(op, msg, nranks) / beta) * rng.lognormvariate(0, 0.05)
                if rng.random() < outliers:
                    exec_ns *= 10  # the odd slow call
                exec_ns = int(exec_ns)
                algbw, busbw = bandwidths_gbs(op, msg, nranks, exec_ns)
                seq += 1
                yield OpRecord(
                    id=record_id("j", "h", 1, "0x" + "0" * 16, 0, op, -1, seq), job="j", host="h",
                    pid=1, gpu="g", comm="0x" + "0" * 16, comm_name="", rank=0, nranks=nranks,
                    nnodes=1 if transport == "nvlink" else 2, local_ranks=8, transport=transport,
                    op=op, seq=seq, count=msg // 4, dtype="ncclFloat32", bytes=msg, peer=-1,
                    algo="RING", proto="SIMPLE", channels=8, start_ns=seq * 10**6,
                    exec_ns=exec_ns, timing="kernel_gpu", algbw_gbs=algbw, busbw_gbs=busbw,
                    graph=False)


def test_fit_recovers_known_alpha_and_beta_despite_noise_and_slow_calls():
    model = fit_from_records(ops())
    assert set(model.entries) == set(TRUTH)
    for key, (alpha, beta) in TRUTH.items():
        e = model.entries[key]
        assert e.alpha_ns == pytest.approx(alpha, rel=0.10), key
        assert e.beta_gbs == pytest.approx(beta, rel=0.05), key
        assert e.rel_mad < 0.05
        assert len(e.buckets) == 10 and e.n_samples == 400


def test_model_predicts_busbw_for_unseen_sizes_from_the_line():
    model = fit_from_records(ops())
    msg, nranks = 3 << 27, 16  # 384 MiB: between fitted buckets
    alpha, beta = TRUTH[("net", "AllReduce")]
    bb = bus_bytes("AllReduce", msg, nranks)
    want = bb / (alpha + bb / beta)
    got = model.predict_busbw_gbs("net", "AllReduce", msg, nranks, size_bucket="256MiB-unseen")
    assert got == pytest.approx(want, rel=0.05)
    assert model.predict_busbw_gbs("net", "Broadcast", msg, nranks) is None


def test_model_file_is_json_and_round_trips(tmp_path):
    model = fit_from_records(ops())
    path = tmp_path / "model.json"
    model.save(path)
    doc = json.loads(path.read_text())  # plain JSON, no pickle
    assert doc["format"] == "ncclwatch.busbw_model" and doc["version"] == 1
    again = BusbwModel.load(path)
    assert again.entries == model.entries
    doc["version"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError):
        BusbwModel.load(path)


def test_fit_from_window_summaries_finds_the_simulated_links():
    records, _ = scenarios.generate(scenarios.by_name("steady_2x2"))
    model = fit_from_records(records)
    for transport in ("nvlink", "net", "mixed"):
        (op, e), *_ = [(o, e) for (t, o), e in model.entries.items() if t == transport]
        assert e.beta_gbs == pytest.approx(scenarios.LINKS[transport][1], rel=0.25), transport


def test_fit_command_reads_jsonl_gz_and_spool_dirs_and_writes_the_model(tmp_path, capsys):
    recs = list(ops(n_per_size=10))
    spool = tmp_path / "spool" / "node0"
    spool.mkdir(parents=True)
    half = len(recs) // 2
    (spool / "seg-0.jsonl").write_text("".join(to_json(r) + "\n" for r in recs[:half]))
    with gzip.open(tmp_path / "more.jsonl.gz", "wt") as f:
        f.write("".join(to_json(r) + "\n" for r in recs[half:]))
        f.write("{not json\n")
    out = tmp_path / "model.json"
    rc = cli.main(["fit", str(tmp_path / "spool"), str(tmp_path / "more.jsonl.gz"), "-o", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "AllGather" in text and "'bad': 1" in text
    model = BusbwModel.load(out)
    assert model.entries[("net", "AllReduce")].beta_gbs == pytest.approx(42.0, rel=0.1)


def test_pipeline_loads_the_model_from_config_for_cold_start(tmp_path):
    model = fit_from_records(scenarios.generate(scenarios.by_name("steady_2x2"))[0])
    path = tmp_path / "model.json"
    model.save(path)
    # the same job, but its network is 30 % down from the first second
    sc = scenarios.Scenario("cold", 2, 2, 40, (scenarios.Fault("network", 0, 40, 0.3),), seed=3)
    records, _ = scenarios.generate(sc)
    with_model = Pipeline(DetectorConfig(model_path=str(path)))
    events = [e for r in records for e in with_model.process(r)]
    assert [(e.type, e.start_ns - scenarios.STREAM_START_NS) for e in events] == [
        ("network_path", 0)]
    without = Pipeline(DetectorConfig())
    assert [e for r in records for e in without.process(r)] == []
