"""Hugging Face ``Trainer`` callback: the job's TFLOP/s per GPU to ncclwatch after each step.

::

    from ncclwatch.ingest.hf_callback import NcclwatchTrainerCallback
    args = TrainingArguments(..., include_num_input_tokens_seen=True)
    Trainer(model, args, callbacks=[NcclwatchTrainerCallback()])

Tokens per step come from ``state.num_input_tokens_seen`` (the Trainer gathers it over
all processes when ``include_num_input_tokens_seen`` is on), else from ``seq_len`` x the
global batch, else ``tokens_per_step``. The class derives from ``TrainerCallback`` when
``transformers`` is installed; the module imports without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ncclwatch.ingest.tflops import StepReporter, TflopsMeter
from ncclwatch.ingest.throughput import report_throughput

try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - depends on what the training image has
    TrainerCallback = object  # transformers absent: nothing will call the hooks


class NcclwatchTrainerCallback(TrainerCallback):
    """Reports TFLOP/s per GPU (and tokens/s) through ``report_throughput``.

    Parameters
    ----------
    flops_per_step
        Model FLOPs (forward + backward) of one optimizer step on one GPU. When None,
        tokens per GPU times ``flops_per_token``.
    flops_per_token
        Default: 6 x ``model.num_parameters(exclude_embeddings=True)``, the count the
        Trainer's own ``floating_point_ops`` uses.
    tokens_per_step
        Tokens of one optimizer step over all GPUs, when neither the Trainer's token count
        nor ``seq_len`` gives it.
    seq_len
        Tokens per sample: tokens per step = seq_len x per-device batch x gradient
        accumulation x world size.
    every_n_steps, all_ranks, report, clock
        As for the Lightning callback: by default the main process reports as the job.
    """

    def __init__(
        self,
        *,
        flops_per_step: float | None = None,
        flops_per_token: float | None = None,
        tokens_per_step: int | None = None,
        seq_len: int | None = None,
        every_n_steps: int = 1,
        all_ranks: bool = False,
        report: Callable[..., None] = report_throughput,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self._reporter = StepReporter(
            report, every_n_steps=every_n_steps, all_ranks=all_ranks, clock=clock,
            missing="set include_num_input_tokens_seen=True, or give "
                    "NcclwatchTrainerCallback seq_len, tokens_per_step or flops_per_step")
        self.flops_per_step = flops_per_step
        self.flops_per_token = flops_per_token
        self.tokens_per_step = tokens_per_step
        self.seq_len = seq_len
        self._meter: TflopsMeter | None = None
        self._tokens_seen = 0
        self._world = 1

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._meter = self._reporter.start_meter(
            flops_per_batch=self.flops_per_step, flops_per_token=self.flops_per_token,
            trainable_params=lambda: _trainable_params(model))
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        self._world = max(1, int(getattr(args, "world_size", 1)))

    def _step_tokens(self, args: Any, state: Any) -> float | None:
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        delta, self._tokens_seen = seen - self._tokens_seen, seen
        if delta > 0:
            return delta
        if self.seq_len is not None:
            return (self.seq_len * args.per_device_train_batch_size
                    * args.gradient_accumulation_steps * self._world)
        return self.tokens_per_step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._meter is None:
            return
        tokens = self._step_tokens(args, state)
        self._meter.add(tokens=None if tokens is None else tokens / self._world)
        self._reporter.step_done(self._meter.finish_step(), step=state.global_step,
                                 is_main=state.is_world_process_zero, rank=args.process_index,
                                 world=self._world)


def _trainable_params(model: Any) -> int:
    if model is None:
        return 0
    if hasattr(model, "num_parameters"):
        return int(model.num_parameters(exclude_embeddings=True))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
