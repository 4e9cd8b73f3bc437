"""Throughput parsed from training logs."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from ncclwatch.ingest.trainlog import ThroughputParser

MEGATRON = (" [2026-11-22 03:01:02] iteration      120/    5000 | consumed samples:  61440 | "
            "elapsed time per iteration (ms): 1893.2 | throughput per GPU (TFLOP/s/GPU): 310.2 | "
            "learning rate: 1.2E-04 |")


def test_megatron_line_gives_step_and_tflops_at_the_lines_own_time():
    r = ThroughputParser(job="j", host="h", timezone="UTC").parse(MEGATRON, 5)
    stamp_ns = int(datetime(2026, 11, 22, 3, 1, 2, tzinfo=UTC).timestamp()) * 10**9
    assert (r.step, r.tflops_per_gpu, r.ts_ns, r.source) == (120, 310.2, stamp_ns, "log")


def test_custom_regex_with_step_and_tokens():
    regex = r"step=(?P<step>\d+) tflops=(?P<tflops>[\d.]+) tok=(?P<tokens>[\d.]+)"
    p = ThroughputParser(job="j", host="h", regex=regex)
    r = p.parse("step=9 tflops=200.5 tok=12345.0", 1)
    assert (r.step, r.tflops_per_gpu, r.tokens_per_s) == (9, 200.5, 12345.0)


def test_without_a_step_steps_are_counted():
    p = ThroughputParser(job="j", host="h", regex=r"tf=(?P<tflops>[\d.]+)")
    assert [p.parse("tf=1", 0).step, p.parse("tf=2", 0).step] == [0, 1]
    assert p.parse("nothing here", 0) is None


def test_regex_without_tflops_group_is_rejected():
    with pytest.raises(ValueError):
        ThroughputParser(job="j", host="h", regex=r"(\d+)")


# What Megatron-LM prints at start (``print_args``, then the tokenizer's padded vocab),
# some lines behind torchrun's rank tag, and iteration lines without
# ``--log-throughput``: no TFLOP/s on them.
MEGATRON_ARGS = [
    "------------------------ arguments ------------------------",
    "  global_batch_size ............................... 256",
    "[default0]:  hidden_size ..................................... 2048",
    "  num_layers ...................................... 24",
    "  num_attention_heads ............................. 16",
    "  group_query_attention ........................... True",
    "  num_query_groups ................................ 4",
    "  kv_channels ..................................... None",
    "  ffn_hidden_size ................................. 5632",
    "  swiglu .......................................... True",
    "  num_experts ..................................... None",
    "  seq_length ...................................... 4096",
    "  world_size ...................................... 16",
    "-------------------- end of arguments ---------------------",
    " > padded vocab (size: 50257) with 175 dummy tokens (new size: 50432)",
]


def iteration(step: int, ms: float, second: int) -> str:
    return (f"[2026-11-22 03:01:{second:02d}.000000] iteration {step:8d}/ 5000 | consumed samples: "
            f"{step * 256:10d} | elapsed time per iteration (ms): {ms:.1f} | learning rate: 1.0E-04 | "
            "global batch size:   256 | lm loss: 2.5E+00 | loss scale: 1.0 |")


def megatron_flops_by_hand() -> float:
    """Megatron's ``num_floating_point_operations`` for MEGATRON_ARGS, written out:
    12 b s L h^2 ((1 + g/a + s/h) (d a / h) + f/h * 3/2 + V / (2 L h))."""
    b, s, L, h, a, g, f, V = 256, 4096, 24, 2048, 16, 4, 5632, 50432
    d = h / a
    return 12 * b * s * L * h * h * ((1 + g / a + s / h) * (d * a / h) + f / h * 1.5 + V / (2 * L * h))


def test_megatron_log_without_its_throughput_gets_tflops_from_the_iteration_time():
    p = ThroughputParser(job="j", host="h", timezone="UTC")
    assert all(p.parse(line, 0) is None for line in MEGATRON_ARGS)
    a, b = p.parse(iteration(10, 2000.0, 2), 0), p.parse(iteration(11, 2500.0, 5), 0)
    want = megatron_flops_by_hand() / (2.0 * 1e12 * 16)
    assert (a.step, b.step, a.source) == (10, 11, "log")
    assert a.tflops_per_gpu == pytest.approx(want, rel=1e-9)
    assert b.tflops_per_gpu == pytest.approx(want * 2000 / 2500, rel=1e-9)  # slower: fewer TFLOP/s
    assert p.computed == 2
    stamp_ns = int(datetime(2026, 11, 22, 3, 1, 5, tzinfo=UTC).timestamp()) * 10**9
    assert b.ts_ns == stamp_ns


def test_a_printed_throughput_wins_and_a_custom_pattern_is_taken_at_its_word():
    p = ThroughputParser(job="j", host="h", timezone="UTC")
    for line in MEGATRON_ARGS:
        p.parse(line, 0)
    assert p.parse(MEGATRON, 0).tflops_per_gpu == 310.2 and p.computed == 0
    custom = ThroughputParser(job="j", host="h", regex=r"tf=(?P<tflops>[\d.]+)")
    for line in MEGATRON_ARGS:
        custom.parse(line, 0)
    assert custom.parse(iteration(10, 2000.0, 2), 0) is None


def test_without_the_arguments_an_iteration_time_gives_nothing():
    p = ThroughputParser(job="j", host="h", timezone="UTC")
    assert p.parse(iteration(10, 2000.0, 2), 0) is None
    for line in MEGATRON_ARGS[:-3]:  # no world size, no vocab: still nothing per GPU
        if "world_size" not in line:
            p.parse(line, 0)
    assert p.parse(iteration(11, 2000.0, 3), 0) is None


def test_arguments_in_rank_0s_log_serve_the_last_ranks_iteration_lines(tmp_path):
    from ncclwatch.ingest.recording import Options, ReadStats, read_training_logs

    # Megatron prints its arguments on rank 0 and its iteration lines on the last rank;
    # the last rank's log is given first
    (tmp_path / "rank-0.log").write_text("\n".join(MEGATRON_ARGS + ["loss goes down"]) + "\n")
    (tmp_path / "rank-15.log").write_text("\n".join(iteration(i, 2000.0, i) for i in range(1, 6)) + "\n")
    out = read_training_logs([tmp_path / "rank-15.log", tmp_path / "rank-0.log"], job="j",
                             options=Options(timezone="UTC"), stats=ReadStats())
    assert [r.step for r in out] == [1, 2, 3, 4, 5]
    assert out[0].tflops_per_gpu == pytest.approx(megatron_flops_by_hand() / (2.0 * 1e12 * 16), rel=1e-9)


def test_a_nemo_log_is_found_as_a_training_log_and_read_for_its_throughput(tmp_path):
    """NeMo 2 prints ``TFLOPS_per_GPU`` on its progress line (NVIDIA's benchmark scripts
    read the same field); a Slurm ``.out`` of it is a training log of the recording. The
    lines here carry NeMo's logging prefix, which gives each its time."""
    from ncclwatch.ingest.recording import Options, ReadStats, is_training_log, read_training_logs

    log = tmp_path / "nemo_0.out"
    lines = ["[NeMo I 2026-11-22 03:00:00 nemo_logging:393] Experiment dir: /results"]
    lines += [f"[NeMo I 2026-11-22 03:00:{10 + i:02d} progress:1] Training epoch 0, iteration {i}/49 | "
              f"lr: 2.999e-05 | global_step: {i} | reduced_train_loss: 10.84 | train_step_timing in s: 4.395 | "
              f"consumed_samples: {512 * (i + 1)} | TFLOPS_per_GPU: {5.1e2 + i:.4g}" for i in range(5)]
    log.write_text("\n".join(lines) + "\n")
    assert is_training_log(log)
    out = read_training_logs([log], job="j", options=Options(timezone="UTC"), stats=ReadStats())
    assert [(r.step, r.tflops_per_gpu) for r in out] == [(i, float(f"{5.1e2 + i:.4g}")) for i in range(5)]
    assert out[1].ts_ns - out[0].ts_ns == 10**9  # each line at its own time


# Megatron core_v0.12 and later (``mtp_num_layers`` among the arguments): its
# ``num_floating_point_operations`` for a GPT model, written out as Megatron lays it out
# (12 = 3 passes x 2 GEMMs x 2 FLOPs; attention's s^2 term halved for the causal mask;
# experts of ``moe_ffn_hidden_size`` on the layers ``moe_layer_freq`` marks, and on the
# multi-token-prediction layers when the last layer has them).
def megatron_v012_flops(a: dict, batch: int) -> float:
    h, n, s, L = a["hidden_size"], a["num_attention_heads"], a["seq_length"], a["num_layers"]
    g = a.get("num_query_groups") if a.get("group_query_attention") else n
    q_ratio = a["kv_channels"] * n / h
    glu = 1.5 if a.get("swiglu") else 1.0
    if a.get("num_experts") is None:
        moe, dense, topk, last = 0, L, 0, 0
    else:
        freq = a.get("moe_layer_freq", 1)
        pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(L)]
        moe, dense, topk, last = sum(pattern), L - sum(pattern), a["moe_router_topk"], pattern[-1]
    mtp = a.get("mtp_num_layers") or 0
    moe, dense, layers = moe + last * mtp, dense + (1 - last) * mtp, L + mtp
    expert = a.get("moe_ffn_hidden_size") or a["ffn_hidden_size"]
    shared = a.get("moe_shared_expert_intermediate_size") or 0
    mlp = 12 * layers * h * (a["ffn_hidden_size"] * glu * dense / layers + expert * topk * glu * moe / layers
                             + shared * glu * moe / layers)
    attention = 12 * layers * h * h * ((1 + g / n + s / h / 2) * q_ratio)
    extra = 6 * mtp * (3 * h + 2 * h * h) + 6 * h * a["padded_vocab_size"] * (mtp + 1)
    return batch * s * (mlp + attention + extra)


MODELS = {  # printed as print_args prints them: Python reprs, lists with spaces
    "dense GQA, long sequences": dict(
        hidden_size=4096, num_layers=32, num_attention_heads=32, group_query_attention=True, num_query_groups=8,
        kv_channels=128, ffn_hidden_size=14336, swiglu=True, num_experts=None, seq_length=8192,
        mtp_num_layers=None, padded_vocab_size=128256),
    "fine-grained experts narrower than the dense MLP": dict(
        hidden_size=2048, num_layers=48, num_attention_heads=32, group_query_attention=True, num_query_groups=4,
        kv_channels=128, ffn_hidden_size=6144, swiglu=True, num_experts=128, moe_router_topk=8,
        moe_ffn_hidden_size=768, seq_length=4096, mtp_num_layers=None, padded_vocab_size=151936),
    "first layers dense, shared experts, one prediction layer": dict(
        hidden_size=7168, num_layers=61, num_attention_heads=128, group_query_attention=True, num_query_groups=8,
        kv_channels=128, ffn_hidden_size=18432, swiglu=True, num_experts=256, moe_router_topk=8,
        moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048, moe_layer_freq=[0] * 3 + [1] * 58,
        seq_length=4096, mtp_num_layers=1, padded_vocab_size=129280),
    "experts every other layer, no GLU": dict(
        hidden_size=1024, num_layers=8, num_attention_heads=16, group_query_attention=False, kv_channels=64,
        ffn_hidden_size=4096, swiglu=False, num_experts=8, moe_router_topk=2, moe_layer_freq=2, seq_length=2048,
        mtp_num_layers=None, padded_vocab_size=50304),
}


def printed_args(a: dict, prefix: str) -> list[str]:
    rows = [f"  {k} {'.' * (48 - len(k))} {None if k == 'padded_vocab_size' else v}" for k, v in a.items()]
    return [f"{prefix}------------------------ arguments ------------------------",
            *(prefix + r for r in sorted(rows)), f"{prefix}  world_size {'.' * 38} 64",
            f"{prefix}-------------------- end of arguments ---------------------",
            f"{prefix} > padded vocab (size: {a['padded_vocab_size'] - 3}) with 3 dummy tokens "
            f"(new size: {a['padded_vocab_size']})"]


@pytest.mark.parametrize("prefix", ["", "[default0]:", "0: [default0]:", "2026-11-22T03:00:01.5Z [default0]:"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_megatron_v012_and_later_flops_without_its_throughput(model, prefix):
    """The iteration time turned into TFLOP/s as Megatron core_v0.12+ would, whatever
    launchers and log shippers put before each line (``srun -l`` and torchrun's tag,
    ``kubectl logs --timestamps``)."""
    a = MODELS[model]
    p = ThroughputParser(job="j", host="h", timezone="UTC")
    assert all(p.parse(line, 0) is None for line in printed_args(a, prefix))
    r = p.parse(prefix + iteration(10, 10_000.0, 2), 0)
    want = megatron_v012_flops(a, 256) / (10.0 * 1e12 * 64)
    assert r is not None and r.step == 10
    assert r.tflops_per_gpu == pytest.approx(want, rel=1e-12)


def test_the_older_formula_is_kept_for_logs_of_megatron_before_012():
    """No ``mtp_num_layers`` printed: core_v0.11 or older, whose own figure counts full
    s^2 attention; a log of either kind gives what that Megatron would have printed."""
    old = ThroughputParser(job="j", host="h", timezone="UTC")
    new = ThroughputParser(job="j", host="h", timezone="UTC")
    for line in MEGATRON_ARGS:
        old.parse(line, 0)
        new.parse(line, 0)
    new.parse("  mtp_num_layers .................................. None", 0)
    a = old.parse(iteration(10, 2000.0, 2), 0).tflops_per_gpu
    b = new.parse(iteration(10, 2000.0, 2), 0).tflops_per_gpu
    assert a == pytest.approx(megatron_flops_by_hand() / (2.0 * 1e12 * 16), rel=1e-9)
    args = dict(hidden_size=2048, num_layers=24, num_attention_heads=16, group_query_attention=True,
                num_query_groups=4, kv_channels=128, ffn_hidden_size=5632, swiglu=True, num_experts=None,
                seq_length=4096, padded_vocab_size=50432)
    assert b == pytest.approx(megatron_v012_flops(args, 256) / (2.0 * 1e12 * 16), rel=1e-9) and b < a


def test_a_recording_reads_the_arguments_however_long_the_preamble(tmp_path):
    """Thousands of warnings before the arguments (a merged log of a large job): they are
    still read, and the scan stops at the first iteration."""
    from ncclwatch.ingest.recording import Options, ReadStats, read_training_logs

    a = MODELS["dense GQA, long sequences"]
    log = tmp_path / "rank-0.log"
    log.write_text("\n".join(["[default3]: UserWarning: something deprecated"] * 8000 + printed_args(a, "")
                             + [iteration(k, 10_000.0, k) for k in range(10, 13)]) + "\n")
    recs = read_training_logs([log], job="j", options=Options(job="j", timezone="UTC"), stats=ReadStats())
    assert [r.step for r in recs] == [10, 11, 12]
    assert recs[0].tflops_per_gpu == pytest.approx(megatron_v012_flops(a, 256) / (10.0 * 1e12 * 64), rel=1e-12)
