"""Source mapping: a training log's text lines -> ``throughput`` records.

The default pattern is Megatron-LM / NeMo's iteration line::

     [2026-11-22 03:01:02] iteration      120/  5000 | consumed samples: 61440 | ...
     | throughput per GPU (TFLOP/s/GPU): 310.2 | ...

``config.ingest.throughput_regex`` replaces it; its named group ``tflops`` is required,
``step`` and ``tokens`` are optional. Without a ``step`` group the step is read from
``iteration <n>`` on the same line, else counted from 0. Lines that do not match are not
errors: a training log is mostly other text. The log has no reliable clock, so ``ts_ns``
is when the forwarder read the line (at most one poll interval late).

>>> p = ThroughputParser(job="j", host="h")
>>> r = p.parse(" iteration      120/  5000 | throughput per GPU (TFLOP/s/GPU): 310.2 |", 7)
>>> r.step, r.tflops_per_gpu, r.source, r.rank
(120, 310.2, 'log', -1)
>>> p.parse("loss 1.23", 8) is None
True
"""

from __future__ import annotations

import math
import re

from ncclwatch.config import IngestConfig
from ncclwatch.records import ThroughputRecord

DEFAULT_REGEX = IngestConfig.throughput_regex
_STEP = re.compile(r"\biteration\s+(\d+)")


class ThroughputParser:
    """Turn matching log lines into throughput records.

    Parameters
    ----------
    job, host
        Labels of the records (the log carries neither).
    regex
        Pattern with a ``tflops`` group (optional ``step``, ``tokens``).
    """

    def __init__(self, *, job: str, host: str, regex: str = DEFAULT_REGEX):
        self.job = job
        self.host = host
        self.regex = regex
        self._pattern = re.compile(regex)
        if "tflops" not in self._pattern.groupindex:
            raise ValueError(f"throughput regex needs a (?P<tflops>...) group: {regex!r}")
        self._next_step = 0

    def parse(self, line: str, ts_ns: int) -> ThroughputRecord | None:
        m = self._pattern.search(line)
        if m is None:
            return None
        try:
            tflops = float(m.group("tflops"))
        except (TypeError, ValueError):
            return None
        if not math.isfinite(tflops) or tflops < 0:
            return None
        groups = self._pattern.groupindex
        step = None
        if "step" in groups and m.group("step"):
            step = int(m.group("step"))
        else:
            s = _STEP.search(line)
            if s:
                step = int(s.group(1))
        if step is None:
            step = self._next_step
        self._next_step = step + 1
        tokens = None
        if "tokens" in groups and m.group("tokens"):
            try:
                tokens = float(m.group("tokens"))
            except ValueError:
                tokens = None
            if tokens is not None and (not math.isfinite(tokens) or tokens < 0):
                tokens = None
        return ThroughputRecord(job=self.job, host=self.host, rank=-1, ts_ns=ts_ns, step=step,
                                tflops_per_gpu=tflops, tokens_per_s=tokens, source="log")
