"""When a job stopped training on purpose: its checkpoint saves, from its training log.

While one rank writes a checkpoint, the others wait for it in the save's collectives
and no step completes: by the plugin's progress records a stall naming the writer, by
the keys a collective that took seconds. A demanding user does not want a page for every
checkpoint, so trouble that *begins* inside a pause is not raised while the pause lasts
and for ``grace_ns`` after it ends (its aftermath); trouble that outlasts that is raised
as usual, from when it began.

>>> p = Pauses()
>>> p.begin(100); p.excuses(150, now_ns=160, grace_ns=10)    # waits since 150: the save's
True
>>> p.end(200); p.excuses(150, now_ns=205, grace_ns=10)      # its aftermath
True
>>> p.excuses(150, now_ns=215, grace_ns=10)                  # outlasted it: raised
False
>>> p.excuses(50, now_ns=160, grace_ns=10)                   # began before the save
False
>>> p.begin(300); p.stepped(340); p.spans                    # a logged step ends one too
True
[[100, 200], [300, 340]]
>>> p.begin(400); p.excuses(400 + MAX_OPEN_NS + 1, now_ns=400 + MAX_OPEN_NS + 2, grace_ns=10)
False
"""

from __future__ import annotations

from typing import Any

MAX_SPANS = 8  # ended pauses kept: trouble older than the last few is raised or gone
# A save whose end never reaches the detectors (its end line and the job's steps in a log
# they are not given) must not excuse everything after it: trouble that begins this long
# into an open pause is raised. Saves of the largest models to slow storage take minutes.
MAX_OPEN_NS = 30 * 60 * 10**9


class Pauses:
    """A job's pauses: the one going on (``open_since``, 0: none) and the last ended ones."""

    __slots__ = ("open_since", "spans")

    def __init__(self) -> None:
        self.open_since = 0
        self.spans: list[list[int]] = []

    def see(self, rec: Any) -> None:
        """A ``pause`` record."""
        if rec.state == "begin":
            self.begin(rec.ts_ns)
        else:
            self.end(rec.ts_ns)

    def begin(self, ts_ns: int) -> None:
        if not self.open_since:  # the first of several ranks' lines
            self.open_since = ts_ns

    def end(self, ts_ns: int) -> None:
        """Ended at ``ts_ns`` (nothing if none is open: an end whose begin was lost)."""
        if self.open_since and ts_ns >= self.open_since:
            self.spans.append([self.open_since, ts_ns])
            del self.spans[:-MAX_SPANS]
            self.open_since = 0

    def stepped(self, ts_ns: int) -> bool:
        """The job logged a step at ``ts_ns``: training again (True: that ended a pause)."""
        if self.open_since and ts_ns > self.open_since:
            self.end(ts_ns)
            return True
        return False

    def excuses(self, since_ns: int, now_ns: int, grace_ns: int) -> bool:
        """Whether trouble that began at ``since_ns`` is a pause's, as of ``now_ns``: it
        began within a pause (or ``grace_ns`` before one: ranks reach the save at their
        own pace), which goes on or ended less than ``grace_ns`` ago."""
        end = self.began_in(since_ns, grace_ns)
        return end is not None and now_ns < end + grace_ns

    def began_in(self, since_ns: int, grace_ns: int) -> float | None:
        """The end of the pause trouble that began at ``since_ns`` began in (``inf``: the
        one going on), None if none."""
        if self.open_since and self.open_since - grace_ns <= since_ns <= self.open_since + MAX_OPEN_NS:
            return float("inf")
        return next((end for start, end in reversed(self.spans) if start - grace_ns <= since_ns <= end), None)

    def to_state(self) -> dict[str, Any]:
        return {"open_since": self.open_since, "spans": [list(s) for s in self.spans]}

    @classmethod
    def from_state(cls, st: dict[str, Any]) -> Pauses:
        p = cls()
        p.open_since = st["open_since"]
        p.spans = [list(s) for s in st["spans"]]
        return p
