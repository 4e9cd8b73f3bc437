"""The Kafka transport the worker's Faust app runs on: Faust's own (aiokafka), with its
livelock check made patient with a slow start, no made-up offset gaps, and no commit
past a message not acknowledged.

**A slow start.** faust-streaming 0.15.3's livelock check (``Consumer.verify_all_partitions_active``,
every 2.5 × ``broker_commit_interval`` unless the app is rebalancing) calls
``verify_event_path`` for every assigned partition, which reads aiokafka's position of
it. A partition assigned but not positioned yet (right after a rebalance, while a table
recovers from its changelog) fails aiokafka's ``assert self._position is not None`` and
Faust crashes the worker: a start that is merely slow kills the process. No setting
turns the check off (``broker_commit_livelock_soft_timeout`` only changes when it logs).

Here the assertion is tolerated for ``UNPOSITIONED_GRACE_S`` per partition and raised as
before after that (a partition never positioned is a worker that will never read it:
exit 1, for a supervisor to restart it).

**Offset gaps.** Faust takes a jump in the offsets it hands over (a message after the
last one read by more than one) for a gap in the log, as compaction or transaction
markers leave, and counts the skipped offsets as acknowledged. On the worker's inputs
(plain topics: no compaction, no transactions) a jump is Faust's seek racing its
fetcher around a rebalance (see ``faust_app.ReadOrder``): the skipped messages were
never processed, so committing past them loses them if the worker then stops, and when
:class:`~ncclwatch.detectors.faust_app.ReadOrder` reads them again and they are
acknowledged, each offset is in Faust's list twice, which stalls its commit (it
commits a run of consecutive offsets at a time, and a repeat ends a run: seen as a
windows partition committed at 172 of 24,400, gaining one or two offsets a second).
Here such a jump records no gap; the one real gap, messages retention deleted before
they were read, is skipped explicitly (:meth:`Consumer.skip_gone`).

**The first offset not acknowledged.** Faust's ``_new_offset`` takes the committed
offset for the last message processed, where Kafka's (and Faust's own commits) are the
next one to read: a message at exactly the committed offset, not acknowledged, does not
stop the commit passing it, and with nothing committed yet (or 0, which Faust keeps as
None) no check is made at all: the first run of acknowledged offsets is committed
whatever lies before it. The key stage holds the messages of a large communicator's
open groups unacknowledged while later messages are acknowledged, so the commit then
passed windows never folded into any state, and the partition's next owner closed
those groups without them (seen: a test's verdicts wrong from a communicator's first
window on). Here a commit waits until its first offset, the committed one or, before
any commit, where the worker began reading (:meth:`Consumer.reading_from`), is
acknowledged or a gap the worker declared (:meth:`Consumer.skip_gone`).

Faust's supported way to change a transport is a transport of one's own, found by the
broker URL's scheme through the ``faust.transports`` entry point (pyproject.toml
registers :class:`Transport` as ``ncclwatch-kafka``): Faust's aiokafka transport with
:class:`Consumer`, a subclass overriding three methods. Nothing of Faust or aiokafka is
patched.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from faust.transport.drivers import aiokafka as faust_aiokafka

log = logging.getLogger(__name__)

SCHEME = "ncclwatch-kafka"  # the broker URLs' scheme: kafka://host:port -> ncclwatch-kafka://host:port
UNPOSITIONED_GRACE_S = 60.0


class UnpositionedGrace:
    """How long each partition has failed the position check; whether to bear it.

    >>> grace = UnpositionedGrace(grace_s=60.0)
    >>> grace.failed("p", now=0.0), grace.failed("p", now=59.0), grace.failed("p", now=61.0)
    (True, True, False)
    >>> grace.passed("p")  # positioned: a later failure starts a new grace
    >>> grace.failed("p", now=100.0)
    True
    """

    def __init__(self, grace_s: float = UNPOSITIONED_GRACE_S):
        self.grace_s = grace_s
        self._since: dict[Any, float] = {}

    def failed(self, tp: Any, now: float) -> bool:
        """``tp`` has no position yet: True while that is still within the grace."""
        return now - self._since.setdefault(tp, now) <= self.grace_s

    def passed(self, tp: Any) -> None:
        self._since.pop(tp, None)


class Consumer(faust_aiokafka.Consumer):
    """Faust's aiokafka consumer, patient with a partition not positioned yet, that
    commits no offset past one not acknowledged."""

    _grace: UnpositionedGrace | None = None

    def verify_event_path(self, now: float, tp: Any) -> None:
        grace = self._grace
        if grace is None:
            grace = self._grace = UnpositionedGrace()
        try:
            result = super().verify_event_path(now, tp)
        except AssertionError:
            if grace.failed(tp, time.monotonic()):
                return None
            log.error("partition %s assigned over %.0f s ago and never positioned", tp, grace.grace_s)
            raise
        grace.passed(tp)
        return result

    _read_from: dict[Any, int] | None = None

    async def _add_gap(self, tp: Any, offset_from: int, offset_to: int) -> None:
        """A jump in offsets is not a gap on the worker's inputs (module docstring)."""

    async def skip_gone(self, tp: Any, offset_from: int, offset_to: int) -> None:
        """Offsets ``offset_from..offset_to`` of ``tp`` are gone from the log (retention):
        count them acknowledged, so the committed offset can pass them."""
        # not Faust's _add_gap: it starts a gap after the committed offset, which
        # would leave that offset neither acknowledged nor a gap (module docstring)
        gaps = self._gap[tp]
        gaps.addi(offset_from, offset_to + 1)
        gaps.merge_overlaps()

    def reading_from(self, offsets: dict[Any, int]) -> None:
        """Where the worker began reading each partition (after an assignment): the
        first offset a commit must cover while nothing is committed."""
        if self._read_from is None:
            self._read_from = {}
        self._read_from.update(offsets)

    def _new_offset(self, tp: Any) -> int | None:
        acked = self._acked[tp]
        if acked:
            head = self._committed_offset[tp]
            if head is None and self._read_from is not None:
                head = self._read_from.get(tp)
            if head is not None and not head_covered(self._acked_index[tp], self._gap[tp], head):
                return None
        return super()._new_offset(tp)


def head_covered(acked: Any, gaps: Any, head: int) -> bool:
    """Whether offset ``head``, the first a commit would pass, is acknowledged or in a
    gap (``gaps``: intervals with ``begin``/``end``, end excluded).

    >>> from types import SimpleNamespace as I
    >>> head_covered([11, 12], [], 10), head_covered([10, 12], [], 10)
    (False, True)
    >>> head_covered([12], [I(begin=9, end=12)], 10)  # 9..11 gone from the log
    True
    """
    if head in acked:
        return True
    return any(g.begin <= head < g.end for g in gaps)


class Transport(faust_aiokafka.Transport):
    """Faust's aiokafka transport with :class:`Consumer`."""

    Consumer = Consumer
