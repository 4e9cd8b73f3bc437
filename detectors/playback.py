"""Replaying and recording for the local drivers: pacing by record time, and the
files they write (``--events-out``, the state file) atomically or append-only."""

from __future__ import annotations

import io
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ncclwatch import private
from ncclwatch.records import (
    AnomalyEvent,
)

log = logging.getLogger(__name__)


class Pacer:
    """Hold records back so they come out at ``speed``× the rate they were written.

    ``speed`` 0 means as fast as possible. The first record sets the origin; a record
    older than the previous one is let through at once (spools are only roughly ordered).

    >>> slept = []
    >>> p = Pacer(10.0, clock=lambda: 0.0, sleep=slept.append)
    >>> p.wait(1_000_000_000); p.wait(3_000_000_000)
    >>> slept
    [0.2]
    """

    def __init__(
        self,
        speed: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] = time.sleep,
    ):
        if speed < 0:
            raise ValueError(f"speed must be >= 0, got {speed}")
        self.speed = speed
        self.clock = clock
        self.sleep = sleep
        self._origin: tuple[int, float] | None = None

    def delay_s(self, t_ns: int) -> float:
        """Seconds to wait before the record of time ``t_ns`` is due."""
        if self.speed == 0:
            return 0.0
        if self._origin is None:
            self._origin = (t_ns, self.clock())
            return 0.0
        t0_ns, wall0 = self._origin
        due = wall0 + (t_ns - t0_ns) / 1e9 / self.speed
        return max(0.0, due - self.clock())

    def wait(self, t_ns: int) -> None:
        d = self.delay_s(t_ns)
        if d > 0:
            self.sleep(d)


def write_jsonl_atomic(path: str | Path, obj: Any) -> None:
    """Write a JSON document so a crash leaves the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class EventsFile:
    """Anomaly events appended as JSON lines (``--events-out``), flushed per event."""

    def __init__(self, path: str | Path | None):
        self._f: io.TextIOBase | None = None
        if path:
            private.makedirs(Path(path).parent)
            # 0600 whatever the umask: events name jobs, hosts and communicators
            self._f = os.fdopen(private.open_append(path), "a", encoding="utf-8")

    def write(self, event: AnomalyEvent) -> None:
        if self._f is not None:
            from ncclwatch.records import to_json

            self._f.write(to_json(event) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
