"""Lightning and Hugging Face callbacks: TFLOP/s per GPU into the spool, read by the detectors.

The unit tests drive the hooks with stand-ins for the framework objects (the hooks touch
only a few attributes). The last two run a few real CPU training steps under Lightning and
the HF Trainer in the frameworks venv that scripts/setup.sh builds, and feed what lands in
the spool to the detectors.
"""

from __future__ import annotations

import os
import subprocess
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from ncclwatch.detectors.metrics import DetectorMetrics
from ncclwatch.detectors.pipeline import Pipeline
from ncclwatch.ingest.hf_callback import NcclwatchTrainerCallback
from ncclwatch.ingest.lightning_callback import NcclwatchCallback
from ncclwatch.ingest.tflops import TflopsMeter
from packaging_support import FRAMEWORKS_PYTHON, built_wheel, pip  # noqa: F401 (fixture)
from prometheus_client import CollectorRegistry

from ncclwatch.config import DetectorConfig
from ncclwatch.records import ThroughputRecord, parse_line

HERE = Path(__file__).resolve().parent


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, tflops, step, **kw):
        self.calls.append((round(tflops, 6), step, kw))


def ticking(*times):
    it = iter(times)
    return lambda: next(it)


class Tokens:
    def __init__(self, n):
        self.n = n

    def numel(self):
        return self.n


def param(n):
    return SimpleNamespace(numel=lambda: n, requires_grad=True)


def lightning_trainer(**kw):
    return SimpleNamespace(**{"global_step": 0, "is_global_zero": True, "global_rank": 0,
                              "world_size": 8, **kw})


def test_meter_rejects_non_positive_flops():
    with pytest.raises(ValueError, match="flops_per_token"):
        TflopsMeter(flops_per_token=0)


def test_lightning_reports_once_per_optimizer_step_with_accumulation():
    rec = Recorder()
    cb = NcclwatchCallback(report=rec, clock=ticking(0.0, 2.0, 3.0))
    trainer, module = lightning_trainer(), SimpleNamespace(parameters=lambda: [param(1_000_000_000)])
    cb.on_train_start(trainer, module)
    batch = {"input_ids": Tokens(4096)}
    cb.on_train_batch_end(trainer, module, None, batch, 0)  # accumulating: no step yet
    trainer.global_step = 1
    cb.on_train_batch_end(trainer, module, None, batch, 1)
    # 6 x 1e9 FLOPs/token x 8192 tokens in 2 s = 24.576 TFLOP/s on this GPU; 8 GPUs' tokens/s
    assert rec.calls == [(24.576, 1, {"tokens_per_s": 4096.0 * 8, "rank": -1})]
    trainer.global_step = 2
    cb.on_train_batch_end(trainer, module, None, batch, 2)
    assert rec.calls[1][:2] == (24.576, 2)  # 4096 tokens in 1 s


def test_lightning_explicit_flops_per_batch_and_every_n_steps():
    rec = Recorder()
    cb = NcclwatchCallback(flops_per_batch=5e12, every_n_steps=2, report=rec,
                           clock=ticking(0.0, 1.0, 2.0))
    trainer = lightning_trainer()
    cb.on_train_start(trainer, SimpleNamespace(parameters=list))
    for step in (1, 2):
        trainer.global_step = step
        cb.on_train_batch_end(trainer, None, None, (1, 2), step)
    assert rec.calls == [(5.0, 2, {"tokens_per_s": None, "rank": -1})]


def test_lightning_other_ranks_report_only_with_all_ranks():
    for all_ranks, want in ((False, []), (True, [3])):
        rec = Recorder()
        cb = NcclwatchCallback(flops_per_batch=1e12, all_ranks=all_ranks, report=rec,
                               clock=ticking(0.0, 1.0))
        trainer = lightning_trainer(is_global_zero=False, global_rank=3)
        cb.on_train_start(trainer, SimpleNamespace(parameters=list))
        trainer.global_step = 1
        cb.on_train_batch_end(trainer, None, None, None, 0)
        assert [c[2]["rank"] for c in rec.calls] == want


def test_lightning_without_flops_or_tokens_warns_once_and_reports_nothing():
    rec = Recorder()
    cb = NcclwatchCallback(report=rec, clock=ticking(0.0, 1.0, 2.0))
    trainer = lightning_trainer()
    cb.on_train_start(trainer, SimpleNamespace(parameters=lambda: [param(10)]))
    with pytest.warns(RuntimeWarning, match="tokens_per_batch"):
        trainer.global_step = 1
        cb.on_train_batch_end(trainer, None, None, (1, 2), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.global_step = 2
        cb.on_train_batch_end(trainer, None, None, (1, 2), 1)
    assert rec.calls == []


def hf_objects(tokens_seen=0, **args):
    args = SimpleNamespace(**{"world_size": 4, "per_device_train_batch_size": 2,
                              "gradient_accumulation_steps": 1, "process_index": 0, **args})
    state = SimpleNamespace(global_step=0, num_input_tokens_seen=tokens_seen, is_world_process_zero=True)
    model = SimpleNamespace(num_parameters=lambda exclude_embeddings: 1_000_000_000 if exclude_embeddings else 0)
    return args, state, model


def test_hf_uses_the_trainers_token_count_over_all_processes():
    rec = Recorder()
    cb = NcclwatchTrainerCallback(report=rec, clock=ticking(0.0, 2.0))
    args, state, model = hf_objects(tokens_seen=100)
    cb.on_train_begin(args, state, None, model=model)
    state.global_step, state.num_input_tokens_seen = 1, 100 + 4 * 8192
    cb.on_step_end(args, state, None)
    # 8192 tokens per GPU in 2 s x 6e9 FLOPs/token; tokens/s of the job
    assert rec.calls == [(24.576, 1, {"tokens_per_s": 4 * 4096.0, "rank": -1})]


def test_hf_falls_back_to_seq_len_times_the_global_batch():
    rec = Recorder()
    cb = NcclwatchTrainerCallback(seq_len=2048, report=rec, clock=ticking(0.0, 1.0))
    args, state, model = hf_objects(gradient_accumulation_steps=2)
    cb.on_train_begin(args, state, None, model=model)
    state.global_step = 1
    cb.on_step_end(args, state, None)
    assert rec.calls == [(49.152, 1, {"tokens_per_s": 2048 * 2 * 2 * 4.0, "rank": -1})]


def test_hf_without_tokens_warns_and_a_worker_process_stays_quiet():
    rec = Recorder()
    cb = NcclwatchTrainerCallback(report=rec, clock=ticking(0.0, 1.0))
    args, state, model = hf_objects()
    cb.on_train_begin(args, state, None, model=model)
    state.global_step = 1
    with pytest.warns(RuntimeWarning, match="include_num_input_tokens_seen"):
        cb.on_step_end(args, state, None)
    cb = NcclwatchTrainerCallback(flops_per_step=1e12, report=rec, clock=ticking(0.0, 1.0))
    state.is_world_process_zero = False
    cb.on_train_begin(args, state, None, model=model)
    cb.on_step_end(args, state, None)
    assert rec.calls == []


def test_every_n_steps_must_be_positive():
    with pytest.raises(ValueError, match="every_n_steps"):
        NcclwatchTrainerCallback(every_n_steps=0)


# --- the real frameworks, on the CPU ----------------------------------------------------

@pytest.fixture(scope="module")
def frameworks_site(built_wheel, tmp_path_factory):  # noqa: F811
    if not FRAMEWORKS_PYTHON.exists():
        if os.environ.get("CI") and os.environ.get("NCCLWATCH_SKIP_FRAMEWORKS") != "1":
            pytest.fail(f"no frameworks venv at {FRAMEWORKS_PYTHON}: scripts/setup.sh makes it")
        pytest.skip("no frameworks venv (scripts/setup.sh; NCCLWATCH_SKIP_FRAMEWORKS=1 skips it)")
    site = tmp_path_factory.mktemp("fw") / "site"
    pip("install", "--no-deps", "--target", str(site), str(built_wheel))
    return site


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["lightning", "hf"])
def test_real_framework_run_emits_throughput_the_detectors_read(frameworks_site, tmp_path, framework):
    spool, job = tmp_path / "spool", f"cb-{framework}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCLWATCH_", "PYTHON"))}
    env.update(PYTHONPATH=str(frameworks_site), NCCLWATCH_SPOOL_DIR=str(spool), NCCLWATCH_JOB_ID=job,
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([str(FRAMEWORKS_PYTHON), str(HERE / "frameworks_train.py"), framework,
                           str(tmp_path / "out")], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = (spool / job).glob("*-throughput-*.jsonl")
    records = [parse_line(line) for line in path.read_bytes().splitlines()]
    if framework == "lightning":  # it saved a checkpoint after its last step
        pause = records.pop()
        assert (pause.KIND, pause.state, pause.step, pause.job) == ("pause", "begin", 6, job), pause
    assert all(isinstance(r, ThroughputRecord) for r in records)
    assert [r.step for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r.job == job and r.rank == -1 and r.source == "api" for r in records)
    assert all(r.tflops_per_gpu > 0 and r.tokens_per_s > 0 for r in records)

    registry = CollectorRegistry()
    pipeline = Pipeline(DetectorConfig())
    DetectorMetrics(registry).bind(pipeline)
    for rec in records:
        pipeline.process(rec)
    got = registry.get_sample_value("ncclwatch_job_flops_per_second_per_gpu", {"training_job": job})
    assert got == pytest.approx(records[-1].tflops_per_gpu * 1e12)


def test_lightning_says_a_checkpoint_save_begins_from_rank_0_only():
    pauses = []
    cb = NcclwatchCallback(flops_per_batch=1e12, report=Recorder(), pause=lambda *a, **k: pauses.append(a))
    cb.on_save_checkpoint(lightning_trainer(global_step=40), None, {})
    cb.on_save_checkpoint(lightning_trainer(global_step=40, is_global_zero=False, global_rank=3), None, {})
    assert pauses == [("begin", 40)]


def test_report_pause_writes_a_pause_record_beside_the_steps(tmp_path):
    from ncclwatch.ingest.throughput import report_pause, report_throughput

    report_throughput(300.0, 39, rank=-1, spool_dir=str(tmp_path), job="j")
    report_pause("begin", 39, spool_dir=str(tmp_path), job="j")
    lines = [parse_line(line) for f in (tmp_path / "j").iterdir() for line in f.read_text().splitlines()]
    assert [(r.KIND, r.step) for r in lines] == [("throughput", 39), ("pause", 39)]
    with pytest.raises(ValueError):
        report_pause("halfway", 39, spool_dir=str(tmp_path), job="j")
