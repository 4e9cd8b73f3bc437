"""The sink stage: anomaly events in, Alertmanager alerts out.

``handle(event)`` turns an :class:`~ncclwatch.records.AnomalyEvent` into an alert and
tries to deliver it; ``tick()`` (call it every second or so) re-sends active alerts every
``resend_interval_s`` and retries what could not be delivered, with the client's
exponential backoff. Everything not yet settled lives in the :class:`Outbox`, a JSONL
journal in ``state_dir``: a restarted process re-sends active alerts and delivers
pending resolutions.

Firing alerts are sent with ``endsAt`` = now + 4 resend intervals (as Prometheus does):
if ncclwatch dies, Alertmanager resolves them on its own instead of keeping them forever;
while ncclwatch lives, re-sends push ``endsAt`` ahead.

An anomaly that fires and resolves while Alertmanager is unreachable is still
notified: Alertmanager drops the resolution of an alert it never had firing, so the
outbox keeps such a resolution with ``fire_first``; once Alertmanager answers the firing
alert is delivered, and the resolution only ``resolve_hold_s`` later, when Alertmanager
has notified the firing one (its group_wait, or group_interval for a group already
notified).

With no Alertmanager (``client=None``, the local-mode default) each firing and each
resolution is printed as one line instead.

Drivers::

    sink = AlertSink.from_config(cfg.alerting, state_dir=...)   # once
    sink.handle(event)          # per AnomalyEvent (Faust: in loop.run_in_executor)
    sink.tick()                 # every ~1 s (Faust: an app.timer, also in the executor)
    sink.close()                # at shutdown

Both methods are thread-safe and never raise on Alertmanager outages.

>>> import io
>>> out = io.StringIO()
>>> sink = AlertSink(client=None, out=out)
>>> from ncclwatch.records import AnomalyEvent
>>> ev = AnomalyEvent(id="s1", type="straggler", state="firing", job="j", key={"comm":
...     "0x00000000000000aa", "comm_name": "", "op": "AllGather", "size_bucket": "1MiB",
...     "transport": "nvlink"}, host="h1", rank=5, start_ns=0, end_ns=None, detected_ns=0,
...     baseline_busbw_gbs=100.0, observed_busbw_gbs=60.0, effect=0.4,
...     attribution="straggler", throughput_delta=None, severity="warning", evidence={})
>>> sink.handle(ev)
>>> print(out.getvalue().strip())
ALERT firing warning NcclStragglerRank training_job=j comm=0x00000000000000aa op=AllGather
size_bucket=1MiB transport=nvlink node=h1 rank=5: straggler: ... [since ..., id=s1]
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from ncclwatch.alerting.alertmanager import AlertmanagerClient, AlertmanagerRejected
from ncclwatch.alerting.alerts import (
    AlertLinks,
    alert_from_event,
    format_line,
    iso,
    parse_static_labels,
)
from ncclwatch.alerting.outbox import JOURNAL_NAME, Entry, Outbox

from ncclwatch.records import AnomalyEvent

log = logging.getLogger(__name__)

# Firing alerts say they end this many resend intervals ahead (Prometheus uses 4 too):
# enough to survive a few lost re-sends, short enough to clear if ncclwatch dies.
ENDS_AT_RESENDS = 4


class AlertSink:
    """Delivers anomaly events to Alertmanager (or prints them).

    Parameters
    ----------
    client
        An :class:`AlertmanagerClient`, or None to print alerts to ``out``.
    links
        Grafana and runbook base URLs.
    static_labels
        Added to every alert (``config.alerting.alert_labels``).
    resend_interval_s
        How often active alerts are re-sent; keep it well below Alertmanager's
        ``resolve_timeout`` and ``endsAt`` horizon (4 intervals).
    state_dir
        Where the outbox journal lives; None keeps it in memory (lost on restart).
    max_outbox
        Bound on outbox entries (see :mod:`ncclwatch.alerting.outbox` for what happens
        when full).
    batch_size
        Alerts per POST.
    resolve_hold_s
        How long after its firing alert was first accepted a resolution that fired and
        resolved during an outage is held back: at least Alertmanager's ``group_wait``
        plus ``group_interval`` (the shipped config: 30 s + 5 min), so Alertmanager has
        notified the firing alert before it learns that it ended.
    clock, now_ns
        Monotonic seconds (re-send schedule) and wall-clock ns (``endsAt``).
    out
        Where print mode writes (default stdout).
    """

    def __init__(
        self,
        *,
        client: AlertmanagerClient | None,
        links: AlertLinks | None = None,
        static_labels: dict[str, str] | None = None,
        resend_interval_s: float = 60.0,
        state_dir: str | Path | None = None,
        max_outbox: int = 10_000,
        batch_size: int = 200,
        resolve_hold_s: float = 330.0,
        clock: Callable[[], float] = time.monotonic,
        now_ns: Callable[[], int] = time.time_ns,
        out: TextIO | None = None,
    ):
        if resend_interval_s <= 0:
            raise ValueError("resend_interval_s must be > 0")
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if resolve_hold_s < 0:
            raise ValueError("resolve_hold_s must be >= 0")
        self.client = client
        self.links = links or AlertLinks()
        self.static_labels = dict(static_labels or {})
        self.resend_interval_s = resend_interval_s
        self.state_dir = state_dir
        self.max_outbox = max_outbox
        self.batch_size = batch_size
        self.resolve_hold_s = resolve_hold_s
        self.clock = clock
        self.now_ns = now_ns
        self.out = out
        self.sent = 0  # alerts accepted by Alertmanager (re-sends included)
        self.rejected = 0  # alerts Alertmanager refused as invalid, dropped
        self.printed = 0
        self._lock = threading.Lock()
        self._sent_at: dict[str, float] = {}  # key -> clock() of the last accepted send
        # fire_first key -> clock() when its firing alert was first accepted (this process)
        self._fired_at: dict[str, float] = {}
        path = Path(state_dir) / JOURNAL_NAME if (state_dir is not None and client) else None
        self._outbox = Outbox(path, max_entries=max_outbox)
        for e in self._outbox.entries():
            if e.fire_first and e.delivered:  # accepted before the restart: hold from now
                self._fired_at[e.key] = clock()
        if len(self._outbox):
            log.info("alert outbox: %d alert(s) from before the restart to (re)deliver",
                     len(self._outbox))

    @classmethod
    def from_config(
        cls, cfg: Any, *, state_dir: str | Path | None = None, **kwargs: Any
    ) -> AlertSink:
        """Build from ``config.alerting``; no ``alertmanager_url`` means print mode."""
        client = AlertmanagerClient.from_config(cfg) if cfg.alertmanager_url else None
        return cls(
            client=client,
            links=AlertLinks(cfg.grafana_url, cfg.runbook_base_url),
            static_labels=parse_static_labels(cfg.alert_labels),
            resend_interval_s=cfg.resend_interval_s,
            resolve_hold_s=cfg.resolve_hold_s,
            state_dir=state_dir if state_dir is not None else (getattr(cfg, "state_dir", "") or None),
            **kwargs,
        )

    # -- the stage -------------------------------------------------------------------
    def handle(self, event: AnomalyEvent) -> None:
        """Record the event's alert and try to deliver it now."""
        alert = alert_from_event(event, self.links, self.static_labels)
        # Stream time comes from the training nodes' clocks; one running ahead of ours
        # would make startsAt > endsAt on resolution, which Alertmanager rejects.
        alert["startsAt"] = iso(min(event.start_ns, self.now_ns()))
        if self.client is None:
            self._print(alert, event.state)
            return
        key = event.id
        with self._lock:
            old = self._outbox.get(key)
            if old is not None and old.state == "firing" and old.alert["labels"] != alert["labels"]:
                # Labels are the alert's identity in Alertmanager: a changed severity is a
                # new alert there, so the old one is resolved rather than left to expire.
                self._supersede(old)
            same = old is not None and old.alert["labels"] == alert["labels"]
            delivered = same and old.delivered
            if event.state == "resolved":
                ends_ns = event.end_ns if event.end_ns is not None else event.detected_ns
                # Alertmanager treats endsAt <= now as resolved; a replayed anomaly that
                # "ended" in the future of wall time must still read as resolved.
                ends_ns = min(ends_ns, self.now_ns())
                # Never accepted firing (it fired and resolved during an outage):
                # Alertmanager would drop the bare resolution, so fire it first.
                fire_first = same and (old.fire_first or not old.delivered)
                stored = self._outbox.put(key, alert, "resolved", ends_ns,
                                          fire_first=fire_first, delivered=delivered)
            else:
                stored = self._outbox.put(key, alert, "firing", delivered=delivered)
            self._sent_at.pop(key, None)  # changed: deliver now, not at the next re-send
            if not stored:
                return
            self._deliver()

    def tick(self) -> None:
        """Re-send what is due, retry what failed (subject to the backoff)."""
        if self.client is None:
            return
        with self._lock:
            self._deliver()

    def pending(self) -> int:
        """Outbox entries not yet accepted by Alertmanager (0 when all delivered)."""
        with self._lock:
            return sum(1 for e in self._outbox.entries() if e.key not in self._sent_at)

    def active(self) -> int:
        """Firing alerts held (and re-sent)."""
        with self._lock:
            return sum(1 for e in self._outbox.entries() if e.state == "firing")

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "outbox": len(self._outbox),
                "sent": self.sent,
                "printed": self.printed,
                "post_failures": self.client.failures if self.client else 0,
                "rejected": self.rejected,
                "evicted_resolutions": self._outbox.evicted,
                "refused": self._outbox.refused,
            }

    def close(self) -> None:
        """Try a last delivery, then close the journal (pending entries stay in it)."""
        self.tick()
        self._outbox.close()

    # -- internals -------------------------------------------------------------------
    def _print(self, alert: dict[str, Any], state: str) -> None:
        print(format_line(alert, state), file=self.out or sys.stdout, flush=True)
        self.printed += 1

    def _supersede(self, old: Entry) -> None:
        digest = hashlib.sha1(
            json.dumps(old.alert["labels"], sort_keys=True).encode()
        ).hexdigest()[:12]
        self._outbox.put(f"{old.key}~{digest}", old.alert, "resolved", self.now_ns())

    def _resolving(self, e: Entry) -> bool:
        """Whether the entry goes out as resolved now (else as firing)."""
        if e.state != "resolved":
            return False
        if not e.fire_first:
            return True
        fired = self._fired_at.get(e.key)
        return fired is not None and self.clock() - fired >= self.resolve_hold_s

    def _due(self, e: Entry, now: float) -> bool:
        sent = self._sent_at.get(e.key)
        if sent is None or now - sent >= self.resend_interval_s:
            return True
        # a held resolution whose firing alert has been out long enough
        return e.fire_first and self._resolving(e)

    def _payload(self, e: Entry) -> dict[str, Any]:
        alert = dict(e.alert)
        if self._resolving(e):
            alert["endsAt"] = iso(e.ends_at_ns or self.now_ns())
        else:
            horizon_ns = int(ENDS_AT_RESENDS * self.resend_interval_s * 1e9)
            alert["endsAt"] = iso(self.now_ns() + horizon_ns)
        return alert

    def _deliver(self) -> None:
        assert self.client is not None
        now = self.clock()
        due = [e for e in self._outbox.entries() if self._due(e, now)]
        for i in range(0, len(due), self.batch_size):
            batch = due[i : i + self.batch_size]
            try:
                if not self.client.try_post([self._payload(e) for e in batch]):
                    return  # backing off; everything stays in the outbox
            except AlertmanagerRejected:
                # One invalid alert must not block the others forever: find it alone.
                if not self._deliver_one_by_one(batch):
                    return
                continue
            self._delivered(batch)

    def _deliver_one_by_one(self, batch: list[Entry]) -> bool:
        for e in batch:
            try:
                assert self.client is not None
                if not self.client.try_post([self._payload(e)]):
                    return False
            except AlertmanagerRejected as err:
                self.rejected += 1
                log.error("alertmanager rejected alert %s %s, dropping it: %s",
                          e.key, e.alert.get("labels"), err)
                self._outbox.remove(e.key)
                self._sent_at.pop(e.key, None)
                continue
            self._delivered([e])
        return True

    def _delivered(self, batch: list[Entry]) -> None:
        sent_at = self.clock()
        self.sent += len(batch)
        for e in batch:
            if self._resolving(e):
                self._outbox.remove(e.key)
                self._sent_at.pop(e.key, None)
                self._fired_at.pop(e.key, None)
            else:
                self._sent_at[e.key] = sent_at
                if e.fire_first:
                    self._fired_at.setdefault(e.key, sent_at)
                self._outbox.mark_delivered(e.key)
