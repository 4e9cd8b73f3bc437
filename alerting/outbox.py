"""The alert outbox: every alert not yet known to be settled, kept in a JSONL journal.

An entry is either a *firing* alert (kept, and re-sent, until its resolution arrives) or
a *resolved* alert (kept until Alertmanager accepted it, then removed). A resolution
whose firing alert never reached Alertmanager (it fired and resolved during an outage)
is kept with ``fire_first``: the sink delivers the firing alert first, then the
resolution, because Alertmanager drops the resolution of an alert it never saw firing.
``delivered`` records that Alertmanager accepted the entry's firing alert once. Each change is
one appended, fsynced JSON line, so a process killed at any point comes back with the
same outbox: pending resolutions are delivered after a restart, active alerts keep
being re-sent. The journal is rewritten compactly (temp file + rename) once it holds
more than twice as many lines as live entries. The journal holds alert content, so it
is 0600 in a 0700 directory. A write that fails (a full disk) is logged once and
leaves the outbox working in memory; the next write that works rewrites the whole
journal, so it never misses a change.

Bounded by ``max_entries``. When full, a new alert first evicts the oldest pending
*resolution* (harmless: every firing alert was sent with an ``endsAt`` a few resend
intervals ahead, so Alertmanager resolves it by itself at that time, only later);
if no resolution can be evicted, the new alert is refused and ``put`` returns False.

>>> ob = Outbox(None, max_entries=2)
>>> ob.put("a", {"labels": {}}, "firing"), ob.put("b", {"labels": {}}, "resolved", 5)
(True, True)
>>> ob.put("c", {"labels": {}}, "firing")  # full: evicts the resolution of b
True
>>> sorted(e.key for e in ob.entries()), ob.evicted
(['a', 'c'], 1)
>>> ob.put("d", {"labels": {}}, "firing")  # full of firing alerts: refused
False
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncclwatch import private

log = logging.getLogger(__name__)

JOURNAL_NAME = "alert-outbox.jsonl"


@dataclass
class Entry:
    key: str
    alert: dict[str, Any]  # labels, annotations, startsAt, generatorURL (no endsAt)
    state: str  # "firing" or "resolved"
    ends_at_ns: int | None  # when resolved
    seq: int  # order of arrival, for eviction
    fire_first: bool = False  # resolved, but Alertmanager never had it firing
    delivered: bool = False  # Alertmanager accepted its firing alert at least once


class Outbox:
    """A durable map key -> :class:`Entry` (``path=None``: in memory only)."""

    def __init__(self, path: str | Path | None, *, max_entries: int = 10_000):
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.path = Path(path) if path is not None else None
        self.max_entries = max_entries
        self.evicted = 0  # pending resolutions evicted because the outbox was full
        self.refused = 0  # alerts refused because the outbox was full of firing alerts
        self._entries: dict[str, Entry] = {}
        self._seq = 0
        self._lines = 0
        self._file = None
        self._journal_failing = False
        if self.path is not None:
            private.makedirs(self.path.parent)
            self._load()
            try:
                self._compact()
            except OSError as e:
                log.error("alert outbox %s cannot be written (%s): alerts are kept in memory "
                          "and the journal is rewritten once writing works again", self.path, e)
                self._journal_failing = True

    # -- queries ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def entries(self) -> list[Entry]:
        return sorted(self._entries.values(), key=lambda e: e.seq)

    # -- changes ---------------------------------------------------------------------
    def put(
        self, key: str, alert: dict[str, Any], state: str, ends_at_ns: int | None = None,
        *, fire_first: bool = False, delivered: bool = False,
    ) -> bool:
        """Add or replace an entry; False when refused because the outbox is full."""
        if state not in ("firing", "resolved"):
            raise ValueError(f"state must be firing or resolved, got {state!r}")
        if key not in self._entries and len(self._entries) >= self.max_entries:
            victim = next((e for e in self.entries() if e.state == "resolved"), None)
            if victim is None:
                self.refused += 1
                log.error("alert outbox full (%d firing alerts): refusing alert %s",
                          self.max_entries, key)
                return False
            self.evicted += 1
            log.error("alert outbox full: dropping the pending resolution of %s "
                      "(Alertmanager resolves it at its last endsAt)", victim.key)
            self.remove(victim.key)
        self._seq += 1
        entry = Entry(key, alert, state, ends_at_ns, self._seq, fire_first, delivered)
        self._entries[key] = entry
        self._append(self._put_line(entry))
        return True

    def mark_delivered(self, key: str) -> None:
        """Alertmanager accepted this entry's firing alert."""
        e = self._entries.get(key)
        if e is not None and not e.delivered:
            e.delivered = True
            self._append({"op": "delivered", "key": key})

    @staticmethod
    def _put_line(e: Entry) -> dict[str, Any]:
        return {"op": "put", "key": e.key, "state": e.state, "ends_at_ns": e.ends_at_ns,
                "fire_first": e.fire_first, "delivered": e.delivered, "alert": e.alert}

    def remove(self, key: str) -> None:
        if self._entries.pop(key, None) is not None:
            self._append({"op": "done", "key": key})
            if self._lines > 2 * len(self._entries) + 64:
                self._compact()

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            # every change was flushed and fsynced already; a close that fails can only
            # be the retry of a write that failed (and was reported) before
            with contextlib.suppress(OSError):
                f.close()

    # -- the journal -----------------------------------------------------------------
    def _append(self, obj: dict[str, Any]) -> None:
        if self.path is None:
            return
        try:
            if self._journal_failing:
                self._compact()  # catches up on every change the failed writes missed
            else:
                if self._file is None:
                    self._file = os.fdopen(private.open_append(self.path), "a", encoding="utf-8")
                self._file.write(json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n")
                self._file.flush()
                # fsync per change: alert state changes are rare (anomalies, not ops), and
                # a resolution acknowledged to nobody must survive a power cut.
                os.fsync(self._file.fileno())
                self._lines += 1
        except OSError as e:
            if not self._journal_failing:
                log.error("alert outbox %s cannot be written (%s): alerts are kept in memory "
                          "and the journal is rewritten once writing works again", self.path, e)
            self._journal_failing = True
            self.close()
            return
        if self._journal_failing:
            log.warning("alert outbox %s written again", self.path)
            self._journal_failing = False

    def _load(self) -> None:
        assert self.path is not None
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        for n, raw in enumerate(data.split(b"\n"), 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
                key = obj["key"]
                if obj["op"] == "put":
                    self._seq += 1
                    self._entries[key] = Entry(
                        key, obj["alert"], obj["state"], obj.get("ends_at_ns"), self._seq,
                        bool(obj.get("fire_first", False)), bool(obj.get("delivered", False)),
                    )
                elif obj["op"] == "delivered" and key in self._entries:
                    self._entries[key].delivered = True
                elif obj["op"] == "done":
                    self._entries.pop(key, None)
            except (ValueError, KeyError, TypeError) as e:
                # Only a crash in the middle of a write leaves a bad line, and only the last.
                log.warning("%s:%d: skipping unreadable outbox line (%s)", self.path, n, e)

    def _compact(self) -> None:
        """Rewrite the journal from memory (raises OSError, temp file removed)."""
        if self.path is None:
            return
        self.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with os.fdopen(private.open_truncate(tmp), "w", encoding="utf-8") as f:
                for e in self.entries():
                    f.write(json.dumps(self._put_line(e), ensure_ascii=False,
                                       separators=(",", ":")) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._lines = len(self._entries)
