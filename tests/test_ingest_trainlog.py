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
