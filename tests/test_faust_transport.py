"""The worker's Faust transport (``detectors/faust_transport.py``): found by its scheme
through the installed entry point, and it counts no offset acknowledged on a jump.

No broker: a Faust consumer is built without connecting. The gap bookkeeping is
Faust's own (``Consumer._gap``), read here because it is what Faust commits from.
"""

from __future__ import annotations

import asyncio

import faust
import faust.transport
from faust.types import TP
from ncclwatch.detectors import faust_transport


def test_the_scheme_finds_the_transport_through_the_entry_point():
    transport = faust.transport.by_url(f"{faust_transport.SCHEME}://127.0.0.1:9092")
    assert transport is faust_transport.Transport
    assert transport.Consumer is faust_transport.Consumer


def test_a_jump_in_offsets_counts_nothing_acknowledged_and_skip_gone_does():
    async def gaps() -> tuple[list, list]:
        app = faust.App("t", broker=f"{faust_transport.SCHEME}://127.0.0.1:1", store="memory://",
                        web_enabled=False)
        consumer = app.consumer
        tp = TP("windows", 0)
        # what Faust's fetch loop calls when it hands over offset 11 after offset 4
        await consumer._add_gap(tp, 5, 10)
        after_jump = sorted(consumer._gap.get(tp, []))
        await consumer.skip_gone(tp, 5, 10)
        return after_jump, [(i.begin, i.end) for i in sorted(consumer._gap[tp])]

    after_jump, after_skip = asyncio.run(gaps())
    assert after_jump == []
    assert after_skip == [(5, 11)]  # 5..10 count as acknowledged: commits can pass them
