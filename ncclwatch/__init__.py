"""ncclwatch: live detection of NCCL communication degradation in training jobs.

The training-process API is deliberately tiny and has no Kafka client in it:
``ncclwatch.report_throughput(tflops_per_gpu, step=...)`` appends one throughput record
to the node's spool, where the forwarder (or ``ncclwatch watch``) picks it up.
"""

from __future__ import annotations

__version__ = "0.1.0"


def report_throughput(tflops_per_gpu: float, step: int, **kwargs):
    """Record the job's TFLOP/s per GPU for one step (see ``ncclwatch.ingest.throughput``)."""
    from ncclwatch.ingest.throughput import report_throughput as _report

    return _report(tflops_per_gpu, step=step, **kwargs)
