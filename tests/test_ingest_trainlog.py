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
