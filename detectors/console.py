"""The one line a person reads per firing or resolved anomaly, on a terminal or in a log."""

from __future__ import annotations

import logging
from datetime import datetime

from ncclwatch.describe import stalled, where_of
from ncclwatch.records import (
    AnomalyEvent,
)

log = logging.getLogger(__name__)


def _clock(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9).strftime("%H:%M:%S")


def _duration(ns: int) -> str:
    s = max(0, round(ns / 1e9))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_event(event: AnomalyEvent) -> str:
    """One line per firing or resolved anomaly, for people watching a terminal.

    >>> ev = AnomalyEvent(id="a1", type="network_path", state="firing", job="llm-7",
    ...     key={"comm": "0x00000000000000ab", "comm_name": "", "op": "AllReduce",
    ...          "size_bucket": "32MiB", "transport": "net"}, host=None, rank=None,
    ...     start_ns=0, end_ns=None, detected_ns=0, baseline_busbw_gbs=18.2,
    ...     observed_busbw_gbs=12.1, effect=0.335, attribution="network",
    ...     throughput_delta=-0.128, severity="critical", evidence={})
    >>> print(format_event(ev))
    FIRING network_path job=llm-7 AllReduce 32MiB over net (comm 0x00000000000000ab):
    busbw 18.2 → 12.1 GB/s (-34%) since ..., throughput -12.8% [critical]
    """
    head = f"{event.state.upper()} {event.type} job={event.job} {where_of(event, whole='(whole job)')}"
    stall = stalled(event.evidence)
    if stall is not None:
        what = stall  # a rank that holds its communicator up: no bandwidth to compare
    elif event.baseline_busbw_gbs is not None and event.observed_busbw_gbs is not None:
        what = f"busbw {event.baseline_busbw_gbs:.1f} → {event.observed_busbw_gbs:.1f} GB/s ({-event.effect:+.0%})"
    else:
        what = f"{event.attribution} loss {event.effect:.0%}"
    if event.state == "firing":
        what += f" since {_clock(event.start_ns)}"
    else:
        end_ns = event.end_ns if event.end_ns is not None else event.detected_ns
        span = f"{_clock(event.start_ns)}–{_clock(end_ns)}"
        what += f", lasted {_duration(end_ns - event.start_ns)} ({span})"
    if event.throughput_delta is not None:
        what += f", throughput {event.throughput_delta:+.1%}"
    return f"{head}: {what} [{event.severity}]"
