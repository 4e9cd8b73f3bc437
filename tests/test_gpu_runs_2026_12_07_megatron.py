"""Real Megatron-LM runs of 2026-12-07 (core_v0.19.0, one H100, two pretend nodes):
checkpoint saves, and a pipeline-parallel throttle; tests/fixtures/gpu_runs/2026-12-07-megatron
has the README."""

from __future__ import annotations

import tarfile

import pytest
from gpu_runs_support import eval_gpu_runs, recorded_set

from ncclwatch.config import load

FIXTURES, SPLIT, rows, test_the_split_is_the_directory = recorded_set("2026-12-07-megatron")


def test_checkpoint_saves_raise_nothing(rows):
    """A rank writing a checkpoint while its peer waits 10 s in NCCL, and a 14.6-s save in
    which nothing completes: nothing raised, through the plugin and NCCL Inspector."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout"])])
    for name in SPLIT["heldout"]:
        assert (rows[name]["got"], rows[name]["false_alerts"]) == ("-", []), table


def test_the_same_saves_without_the_logs_save_lines_are_raised(tmp_path):
    """The control: the runs' logs without Megatron's save lines (as ncclwatch read them
    before pause records) raise a straggler and a telemetry loss."""
    copies = []
    for name in ("m1x2-ckpt-slow-8s-bj", "m1x2-ckpt-dist-bj"):
        with tarfile.open(FIXTURES / f"{name}.tar.gz") as tar:
            tar.extractall(tmp_path / "src", filter="data")
        for log in (tmp_path / "src" / name / "trainlogs").glob("*.log"):
            log.write_text("".join(line for line in log.read_text().splitlines(keepends=True)
                                   if "checkpoint" not in line))
        copies.append(tmp_path / f"{name}.tar.gz")
        with tarfile.open(copies[-1], "w:gz") as tar:
            tar.add(tmp_path / "src" / name, arcname=name)
    got = {r["run"]: r for r in eval_gpu_runs.evaluate(copies, load(None, environ={}), 5.0)}
    assert [a.split("@")[0] for a in got["m1x2-ckpt-slow-8s-bj"]["false_alerts"]] == ["straggler"]
    assert [a.split("@")[0] for a in got["m1x2-ckpt-dist-bj"]["false_alerts"]] == ["telemetry_loss"]


def test_the_pipeline_throttle_is_the_path(rows):
    """8-MiB activations pass a 16 Gbit/s shaper in bursts while the 125-MiB AllReduce runs
    at its rate: the path, not the AllReduce alone."""
    r = rows["m1x2-pp2-tc-16g-bk"]
    assert (r["got"], r["severity"], r["false_alerts"]) == ("network_path", "critical", []), r
    assert r["delay_s"] <= 4.0, r


def test_the_saves_are_in_the_logs():
    with tarfile.open(FIXTURES / "m1x2-ckpt-dist-bj.tar.gz") as tar:
        log = tar.extractfile("m1x2-ckpt-dist-bj/trainlogs/rank-0.log").read().decode()  # type: ignore[union-attr]
    assert log.count("saving checkpoint at iteration") == 2 and log.count("successfully saved checkpoint") == 2


@pytest.mark.kafka
def test_the_cluster_path_raises_what_local_mode_does(kafka_bootstrap, tmp_path):
    """``ncclwatch forward --once`` with each run's spool and Megatron's logs (the saves'
    pause records on the job topic) and one ``ncclwatch worker``: event for event what
    local mode raises: the pipeline throttle's path, and for the saves nothing."""
    from ncclwatch_testkit.drivers import recorded_runs_through_worker, worker_and_local

    names = ["m1x2-ckpt-slow-8s-bj", "m1x2-ckpt-dist-bj", "m1x2-pp2-tc-16g-bk"]
    got = recorded_runs_through_worker(kafka_bootstrap, tmp_path, [FIXTURES / f"{n}.tar.gz" for n in names],
                                       eval_gpu_runs.sources)
    worker, local = worker_and_local(got)
    assert worker == local, (worker, local, got["log"][-3000:])
    fired = {(e["job"], e["type"]) for e in got["events"] if e["state"] == "firing"}
    assert fired == {("gpu-m1x2-pp2-tc-16g-bk", "network_path")}, fired
