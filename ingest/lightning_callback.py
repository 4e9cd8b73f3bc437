"""PyTorch Lightning callback: the job's TFLOP/s per GPU to ncclwatch after each step,
and its checkpoint saves (``report_pause``: while rank 0 writes, the others wait for it
in NCCL, which is not NCCL's trouble; the next step reported ends the pause).

::

    from ncclwatch.ingest.lightning_callback import NcclwatchCallback
    trainer = L.Trainer(callbacks=[NcclwatchCallback()])  # batches with "input_ids"
    trainer = L.Trainer(callbacks=[NcclwatchCallback(flops_per_batch=measure_flops(...))])

NeMo trains through Lightning, so the callback works there too. The class derives from
Lightning's ``Callback`` when ``lightning`` (or ``pytorch_lightning``) is installed; the
module imports without it, so ncclwatch itself never depends on a framework.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from ncclwatch.ingest.tflops import StepReporter, TflopsMeter
from ncclwatch.ingest.throughput import report_pause, report_throughput

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - depends on what the training image has
    try:
        from pytorch_lightning.callbacks import Callback
    except ImportError:
        Callback = object  # Lightning absent: nothing will call the hooks


def batch_tokens(batch: Any) -> int | None:
    """Tokens in a batch that is a mapping with ``input_ids`` (the Hugging Face layout).

    >>> batch_tokens({"labels": 1}) is None
    True
    """
    if isinstance(batch, Mapping) and "input_ids" in batch:
        return int(batch["input_ids"].numel())
    return None


class NcclwatchCallback(Callback):
    """Reports TFLOP/s per GPU (and tokens/s) through ``report_throughput``.

    Parameters
    ----------
    flops_per_batch
        Model FLOPs (forward + backward) of one micro-batch on one GPU. When None, the
        FLOPs come from the tokens of each batch times ``flops_per_token``.
    flops_per_token
        Default: 6 x the module's trainable parameters (a dense model).
    tokens_per_batch
        Tokens of one micro-batch on one GPU: a number, or a function of the batch. Default:
        ``batch["input_ids"].numel()`` when the batch is a mapping with ``input_ids``.
    every_n_steps
        Report every n-th optimizer step.
    all_ranks
        By default only global rank 0 reports, as the job (``rank=-1``): in synchronous
        training its pace is the job's. With True every rank reports its own.
    report, pause, clock
        Where step and pause records go and the monotonic clock (tests inject them).
    """

    def __init__(
        self,
        *,
        flops_per_batch: float | None = None,
        flops_per_token: float | None = None,
        tokens_per_batch: int | Callable[[Any], int | None] | None = None,
        every_n_steps: int = 1,
        all_ranks: bool = False,
        report: Callable[..., None] = report_throughput,
        pause: Callable[..., None] = report_pause,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self._reporter = StepReporter(
            report, every_n_steps=every_n_steps, all_ranks=all_ranks, clock=clock,
            missing="give NcclwatchCallback flops_per_batch, or tokens_per_batch "
                    "(batches without input_ids)")
        super().__init__()
        self.flops_per_batch = flops_per_batch
        self.flops_per_token = flops_per_token
        self.tokens_per_batch = tokens_per_batch
        self._meter: TflopsMeter | None = None
        self._step = 0
        self._world = 1
        self._pause = pause

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._meter = self._reporter.start_meter(
            flops_per_batch=self.flops_per_batch, flops_per_token=self.flops_per_token,
            trainable_params=lambda: sum(p.numel() for p in pl_module.parameters() if p.requires_grad))
        self._step = trainer.global_step
        self._world = max(1, int(getattr(trainer, "world_size", 1)))

    def _tokens(self, batch: Any) -> int | None:
        if self.tokens_per_batch is None:
            return batch_tokens(batch)
        if callable(self.tokens_per_batch):
            return self.tokens_per_batch(batch)
        return self.tokens_per_batch

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._meter is None:
            return
        self._meter.add(tokens=self._tokens(batch))
        step = trainer.global_step
        if step == self._step:  # accumulating gradients: the optimizer has not stepped
            return
        self._step = step
        self._reporter.step_done(self._meter.finish_step(), step=step,
                                 is_main=trainer.is_global_zero, rank=trainer.global_rank,
                                 world=self._world)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        """Lightning builds the checkpoint to save: the job pauses until its next step."""
        if trainer.is_global_zero:
            self._pause("begin", int(trainer.global_step))
