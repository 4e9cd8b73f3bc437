"""Real 2×H100 runs of 2026-11-27 with point-to-point traffic (``Send``/``Recv`` between
pipeline-like stages), replayed through the detectors; tests/fixtures/gpu_runs/2026-11-27
has the README."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from ncclwatch.ingest.recording import ReadStats, read_recording

from ncclwatch.config import load

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "gpu_runs" / "2026-11-27"
sys.path.insert(0, str(ROOT / "bench" / "detectors"))
import eval_gpu_runs  # noqa: E402

CFG = load(None, environ={})
SPLIT = json.loads((FIXTURES / "split.json").read_text())


@pytest.fixture(scope="module")
def rows():
    return {r["run"]: r for r in eval_gpu_runs.evaluate(eval_gpu_runs.run_dirs([str(FIXTURES)], "all"), CFG, 5.0)}


def test_the_split_is_the_directory():
    assert {p.name.removesuffix(".tar.gz") for p in FIXTURES.glob("*.tar.gz")} == set(SPLIT["heldout"])


def test_point_to_point_runs_as_first_judged(rows):
    table = eval_gpu_runs.markdown(list(rows.values()))
    assert len(rows) == 3 and all(r["ok"] for r in rows.values()), table
    for name in ("i-p2p-tc-16g", "p-p2p-tc-16g"):
        assert rows[name]["got"] == "network_path" and rows[name]["severity"] == "critical", table
    assert rows["p-p2p-clean"]["got"] == "-" and rows["p-p2p-clean"]["false_alerts"] == [], table


@pytest.mark.parametrize("name", ["i-p2p-tc-16g", "p-p2p-clean"])
def test_the_recordings_carry_send_and_recv(name, tmp_path):
    run = eval_gpu_runs.unpacked(FIXTURES / f"{name}.tar.gz", tmp_path)
    srcs, options = eval_gpu_runs.sources(run)
    stats = ReadStats()
    ops = Counter((r.op, r.transport) for r in read_recording(srcs, stats, options) if r.KIND == "op")
    assert stats.quarantined == {}
    # Inspector records P2P on the network processes only; the plugin on both layers
    transports = ("net",) if name.startswith("i-") else ("net", "nvlink")
    for op in ("Send", "Recv"):
        for transport in transports:
            assert ops[(op, transport)] >= 400, ops


@pytest.mark.kafka
def test_worker_reports_what_local_mode_reports(kafka_bootstrap, tmp_path):
    """Send/Recv windows take the cluster path (forward -> Kafka -> worker) as well."""
    from ncclwatch_testkit.drivers import recorded_runs_through_worker, worker_and_local

    got = recorded_runs_through_worker(kafka_bootstrap, tmp_path, sorted(FIXTURES.glob("*.tar.gz")),
                                       eval_gpu_runs.sources)

    worker, local = worker_and_local(got)
    assert worker == local, (worker, local, got["log"][-3000:])
    assert {e[2] for e in worker} == {"network_path"}
