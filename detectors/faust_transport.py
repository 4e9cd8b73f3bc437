"""The Kafka transport the worker's Faust app runs on: Faust's own (aiokafka), with its
livelock check made patient with a slow start and no made-up offset gaps.

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

Faust's supported way to change a transport is a transport of one's own, found by the
broker URL's scheme through the ``faust.transports`` entry point (pyproject.toml
registers :class:`Transport` as ``ncclwatch-kafka``): Faust's aiokafka transport with
:class:`Consumer`, a subclass overriding two methods. Nothing of Faust or aiokafka is
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
    """Faust's aiokafka consumer, patient with a partition not positioned yet."""

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

    async def _add_gap(self, tp: Any, offset_from: int, offset_to: int) -> None:
        """A jump in offsets is not a gap on the worker's inputs (module docstring)."""

    async def skip_gone(self, tp: Any, offset_from: int, offset_to: int) -> None:
        """Offsets ``offset_from..offset_to`` of ``tp`` are gone from the log (retention):
        count them acknowledged, so the committed offset can pass them."""
        await super()._add_gap(tp, offset_from, offset_to)


class Transport(faust_aiokafka.Transport):
    """Faust's aiokafka transport with :class:`Consumer`."""

    Consumer = Consumer
