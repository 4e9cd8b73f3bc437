"""``ncclwatch worker --until-caught-up``: stop once the inputs are read to where they ended.

At start the worker notes the end offset of every partition of its input topics. It is
caught up when its consumer group has *committed* at least that offset on each of them:
committed, not fetched, because the worker commits a message only after its anomaly
events are published and its state is saved, so nothing read is left half done.
Messages that arrive after the start do not hold the worker back: a drain processes a
backlog (a replay into fresh topics, a batch re-run), it does not wait for a live stream
to end. Several workers of one group each stop once the group is caught up.

>>> d = Drain({("w", 0): 10, ("w", 1): 0})
>>> d.remaining({("w", 0): 4}), d.remaining({("w", 0): 10})
(6, 0)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

Offsets = dict[tuple[str, int], int]


class Drain:
    """When a consumer group has committed every partition up to its target offset.

    Parameters
    ----------
    targets
        ``(topic, partition) -> end offset`` seen at start.
    """

    def __init__(self, targets: Offsets):
        self.targets = dict(targets)

    def remaining(self, committed: Offsets) -> int:
        """Messages between the committed offsets and the targets."""
        return sum(max(0, end - committed.get(tp, 0)) for tp, end in self.targets.items())


class KafkaOffsets:
    """End offsets of topics and a group's committed offsets, with kafka-python clients."""

    def __init__(self, client_kwargs: dict[str, Any]):
        from kafka import KafkaAdminClient, KafkaConsumer

        self._consumer = KafkaConsumer(**client_kwargs, enable_auto_commit=False)
        self._admin = KafkaAdminClient(**client_kwargs)

    def ends(self, topics: Iterable[str]) -> Offsets:
        from kafka import TopicPartition

        tps = [TopicPartition(t, p) for t in topics for p in sorted(self._consumer.partitions_for_topic(t) or ())]
        return {(tp.topic, tp.partition): off for tp, off in self._consumer.end_offsets(tps).items()}

    def committed(self, group: str) -> Offsets:
        offsets = self._admin.list_group_offsets(group).get(group, {})  # kafka-python 3: by group
        return {(tp.topic, tp.partition): om.offset for tp, om in offsets.items() if om.offset >= 0}

    def close(self) -> None:
        self._consumer.close()
        self._admin.close()


def drain_check(offsets: KafkaOffsets, drain: Drain, group: str, progress: Callable[[int], None]) -> bool:
    """One look: report what is left, and whether the group is caught up."""
    left = drain.remaining(offsets.committed(group))
    progress(left)
    return left == 0
