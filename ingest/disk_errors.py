"""Failed writes to the state directory: one log line, a metric, a retry, never a crash.

A full disk (``ENOSPC``), a quota (``EDQUOT``) or an I/O error on the spill buffer, the
checkpoint or the quarantine file must not stop the forwarder: every such write is
retried, and what it protects stays in the spool until it succeeds. So each place that
writes reports here: the first failure logs one error line (where, the errno, the free
space left, what happens meanwhile), every failure counts in
``ncclwatch_forwarder_disk_write_errors_total{where,errno}``, the gauge
``ncclwatch_forwarder_disk_write_failing{where}`` is 1 until a write there succeeds
again, which logs one line more.

>>> import errno
>>> from ncclwatch.ingest.metrics import ForwarderMetrics
>>> m = ForwarderMetrics()
>>> d = DiskErrors(m, clock=lambda: 10.0)
>>> d.failed("buffer", "/nonexistent", OSError(errno.ENOSPC, "No space left on device"))
>>> d.failed("buffer", "/nonexistent", OSError(errno.ENOSPC, "No space left on device"))
>>> m.registry.get_sample_value("ncclwatch_forwarder_disk_write_errors_total",
...                             {"where": "buffer", "errno": "ENOSPC"})
2.0
>>> d.failing("buffer"), d.retry_due("buffer")
(True, False)
>>> d.ok("buffer"); d.failing("buffer")
False
"""

from __future__ import annotations

import errno as errno_mod
import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger("ncclwatch.forward")

WHERE = ("buffer", "checkpoint", "quarantine")
# errno label values: a closed set, everything else is "other"
ERRNOS = ("ENOSPC", "EDQUOT", "EIO", "EROFS", "EACCES", "EFBIG")
WHAT_HAPPENS = {
    "buffer": "batches wait in memory and reading pauses; the spool keeps the rest",
    "checkpoint": "positions are kept in memory; a restart now re-sends, never loses",
    "quarantine": "quarantined lines still go to the quarantine topic",
}


def errno_name(err: OSError) -> str:
    name = errno_mod.errorcode.get(err.errno or 0, "")
    return name if name in ERRNOS else "other"


def free_bytes(path: str) -> int:
    """Free bytes on the file system of ``path`` (its nearest existing parent), or -1."""
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


class DiskErrors:
    """Per ``where``: failing since when; retries are paced by ``retry_s``."""

    def __init__(self, metrics, *, retry_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.metrics = metrics
        self.retry_s = retry_s
        self.clock = clock
        self._since: dict[str, float] = {}
        self._last_try: dict[str, float] = {}

    def failed(self, where: str, path: str, err: OSError) -> None:
        name = errno_name(err)
        now = self.clock()
        self.metrics.disk_errors.labels(where, name).inc()
        self.metrics.disk_failing.labels(where).set(1)
        self._last_try[where] = now
        if where not in self._since:
            self._since[where] = now
            log.error("event=disk_write_failed where=%s path=%s errno=%s free_bytes=%d "
                      "action=retry_every_s=%.0f (%s) error=%s", where, path, name,
                      free_bytes(path), self.retry_s, WHAT_HAPPENS.get(where, ""), err.strerror)

    def ok(self, where: str) -> None:
        since = self._since.pop(where, None)
        self._last_try.pop(where, None)
        if since is not None:
            self.metrics.disk_failing.labels(where).set(0)
            log.warning("event=disk_write_recovered where=%s failed_for_s=%.1f",
                        where, self.clock() - since)

    def failing(self, where: str) -> bool:
        return where in self._since

    def retry_due(self, where: str) -> bool:
        """Whether a write that failed here may be tried again now."""
        last = self._last_try.get(where)
        return last is None or self.clock() - last >= self.retry_s
