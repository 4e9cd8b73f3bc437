"""Model FLOPs between two optimizer steps -> TFLOP/s per GPU, for the framework callbacks.

"Model FLOPs" is the work the model needs, not what the GPU ran: forward plus backward,
without recomputation, so TFLOP/s stays comparable across parallelism and checkpointing
settings (the convention of MFU). Either the caller knows the FLOPs of one micro-batch on
one GPU (Lightning's ``measure_flops`` gives them), or the FLOPs per token and the tokens:
``6 * parameters`` per token for a dense transformer (Kaplan et al. 2020, "Scaling Laws";
2 for the forward pass, 4 for the backward), which is also what Hugging Face's
``Trainer.floating_point_ops`` counts.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable

log = logging.getLogger(__name__)

DENSE_FLOPS_PER_PARAM_TOKEN = 6  # forward 2 + backward 4 (Kaplan et al. 2020)


class TflopsMeter:
    """TFLOP/s per GPU over each optimizer step, from the micro-batches it was made of.

    Parameters
    ----------
    flops_per_batch
        Model FLOPs (forward + backward) of one micro-batch on one GPU. Takes precedence.
    flops_per_token
        Model FLOPs per token, used with the token counts given to :meth:`add`.
    clock
        Monotonic seconds. A step lasts from the end of the previous one (or
        :meth:`start`) to its own end, so data loading and the optimizer count too: the
        pace the job really runs at.

    Examples
    --------
    >>> ticks = iter([10.0, 12.0])
    >>> meter = TflopsMeter(flops_per_token=6e9, clock=lambda: next(ticks))
    >>> meter.start()
    >>> meter.add(tokens=4096)
    >>> meter.add(tokens=4096)  # gradient accumulation: two micro-batches, one step
    >>> meter.finish_step()  # (TFLOP/s per GPU, tokens/s on this GPU)
    (24.576, 4096.0)
    """

    def __init__(
        self,
        *,
        flops_per_batch: float | None = None,
        flops_per_token: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        for name, value in (("flops_per_batch", flops_per_batch), ("flops_per_token", flops_per_token)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        self.flops_per_batch = flops_per_batch
        self.flops_per_token = flops_per_token
        self.clock = clock
        self._reset()

    def _reset(self) -> None:
        self._t0: float | None = None
        self._batches = 0
        self._tokens = 0.0
        self._tokens_known = True

    def start(self) -> None:
        """Mark the start of the first step (later steps start where the previous ended)."""
        self._t0 = self.clock()

    def add(self, tokens: float | None = None, batches: int = 1) -> None:
        """Count micro-batches of the current step on this GPU, with their tokens if known."""
        if self._t0 is None:
            self._t0 = self.clock()
        self._batches += batches
        if tokens is None:
            self._tokens_known = False
        else:
            self._tokens += tokens

    def finish_step(self) -> tuple[float, float | None] | None:
        """(TFLOP/s per GPU, tokens/s on this GPU or None) of the step that just ended,
        or None when it cannot be told (no FLOPs known, or no time elapsed)."""
        now = self.clock()
        t0, batches, tokens, known = self._t0, self._batches, self._tokens, self._tokens_known
        self._reset()
        self._t0 = now
        if t0 is None or now <= t0 or batches == 0:
            return None
        dt = now - t0
        tokens_per_s = tokens / dt if known and tokens > 0 else None
        if self.flops_per_batch is not None:
            flops = self.flops_per_batch * batches
        elif self.flops_per_token is not None and tokens_per_s is not None:
            flops = self.flops_per_token * tokens
        else:
            return None
        return flops / dt / 1e12, tokens_per_s


def dense_flops_per_token(parameters: int) -> float:
    """Model FLOPs per token of a dense model with that many parameters.

    >>> dense_flops_per_token(7_000_000_000)
    42000000000.0
    """
    return float(DENSE_FLOPS_PER_PARAM_TOKEN * parameters)


class StepReporter:
    """What a framework callback does once an optimizer step ended: the meter's TFLOP/s
    go to ``report`` every ``every_n_steps`` steps from the reporting rank, or one
    warning (never an exception in the training loop) when they cannot be computed.

    Parameters
    ----------
    report
        ``report_throughput`` or a stand-in.
    every_n_steps
        Report every n-th optimizer step.
    all_ranks
        Every rank reports its own rank; else only the main one, as the job (``rank=-1``).
    missing
        The warning when TFLOP/s cannot be computed: what the user should give.

    Examples
    --------
    >>> got = []
    >>> r = StepReporter(lambda *a, **k: got.append((a, k)), every_n_steps=2, all_ranks=False,
    ...                  missing="give flops")
    >>> r.step_done((300.0, 1000.0), step=2, is_main=True, rank=0, world=8)
    >>> r.step_done((300.0, 1000.0), step=3, is_main=True, rank=0, world=8)  # not every 2nd
    >>> got
    [((300.0, 2), {'tokens_per_s': 8000.0, 'rank': -1})]
    """

    def __init__(self, report: Callable[..., None], *, every_n_steps: int, all_ranks: bool,
                 missing: str, clock: Callable[[], float] = time.perf_counter):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps!r}")
        self.report = report
        self.every_n_steps = every_n_steps
        self.all_ranks = all_ranks
        self.missing = missing
        self.clock = clock
        self._warned = False

    def start_meter(self, *, flops_per_batch: float | None, flops_per_token: float | None,
                    trainable_params: Callable[[], int]) -> TflopsMeter:
        """A started meter: FLOPs per batch as given, else per token as given, else a
        dense model's per token from the trainable parameters (only then counted)."""
        per_token = flops_per_token
        if per_token is None and flops_per_batch is None:
            params = trainable_params()
            per_token = dense_flops_per_token(params) if params else None
        meter = TflopsMeter(flops_per_batch=flops_per_batch, flops_per_token=per_token, clock=self.clock)
        meter.start()
        return meter

    def step_done(self, result: tuple[float, float | None] | None, *, step: int, is_main: bool,
                  rank: int, world: int) -> None:
        """``result``: the meter's ``finish_step()``; tokens/s is per GPU, reported for
        the job (times ``world``)."""
        if result is None:
            if not self._warned:
                self._warned = True
                msg = f"ncclwatch: cannot compute TFLOP/s: {self.missing}"
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
                log.warning(msg)
            return
        if step % self.every_n_steps or not (self.all_ranks or is_main):
            return
        tflops, tokens_per_s = result
        self.report(tflops, step,
                    tokens_per_s=None if tokens_per_s is None else tokens_per_s * world,
                    rank=rank if self.all_ranks else -1)
