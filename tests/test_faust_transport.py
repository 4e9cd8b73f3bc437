"""The worker's Faust transport (``detectors/faust_transport.py``): found by its scheme
through the installed entry point, it counts no offset acknowledged on a jump, and no
commit passes a message not acknowledged (Faust's own check misses the first one).

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


def _consumer_with_acks(acked: list[int]):
    app = faust.App("t", broker=f"{faust_transport.SCHEME}://127.0.0.1:1", store="memory://",
                    web_enabled=False)
    consumer = app.consumer
    tp = TP("windows", 0)
    consumer._acked[tp].extend(acked)
    consumer._acked_index[tp].update(acked)
    return consumer, tp


def test_nothing_committed_yet_a_commit_waits_for_the_first_message_read():
    # Faust alone commits 6 here, passing messages 0..2 held unacknowledged (a large
    # communicator's open groups): the partition's next owner would never read them.
    consumer, tp = _consumer_with_acks([3, 4, 5])
    consumer.reading_from({tp: 0})
    assert consumer._new_offset(tp) is None
    for off in (0, 1, 2):
        consumer._acked[tp].append(off)
        consumer._acked_index[tp].add(off)
    assert consumer._new_offset(tp) == 6


def test_a_message_at_the_committed_offset_unacknowledged_stops_the_commit():
    # Faust takes the committed offset for the last one processed: it would pass 10
    consumer, tp = _consumer_with_acks([11, 12])
    consumer._committed_offset[tp] = 10
    assert consumer._new_offset(tp) is None
    consumer, tp = _consumer_with_acks([10, 11, 12])
    consumer._committed_offset[tp] = 10
    assert consumer._new_offset(tp) == 13


def test_a_gap_gone_from_the_log_at_the_committed_offset_lets_the_commit_pass():
    consumer, tp = _consumer_with_acks([15])
    consumer._committed_offset[tp] = 10
    asyncio.run(consumer.skip_gone(tp, 10, 14))
    assert consumer._new_offset(tp) == 16
