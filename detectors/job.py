"""A job's state in the job stage: its keys (and, running both stages, the key stage's),
open incidents, throughput and telemetry trackers and its stream time. The
:class:`~.pipeline.Pipeline` keeps one per job; :mod:`.causes` reads it."""

from __future__ import annotations

from ncclwatch.config import DetectorConfig

from .incidents import Incident, KeyTuple
from .keys import KeyState, KeyView
from .pauses import Pauses
from .stalls import StallTracker
from .telemetry import TelemetryTracker
from .throughput import ThroughputTracker


class JobState:
    __slots__ = (
        "job", "watermark", "next_tick_ns", "window_ns", "lateness_ns", "silent", "stage", "keys",
        "pending_keys", "telemetry", "throughput", "incidents", "tp_suppressed", "resolved", "stalls",
        "pauses",
    )

    def __init__(self, job: str, cfg: DetectorConfig):
        self.job = job
        self.watermark = -1  # the job's stream time: largest window end seen
        self.next_tick_ns = -1
        self.window_ns = 0
        self.lateness_ns = 0  # how long an incomplete group waits past its end
        self.silent = False
        self.stage: dict[KeyTuple, KeyState] = {}  # the key stage's keys
        self.keys: dict[KeyTuple, KeyView] = {}  # the job stage's view of them
        self.pending_keys: dict[KeyTuple, KeyState] = {}  # keys with groups still open
        self.telemetry = TelemetryTracker()
        self.throughput = ThroughputTracker(cfg)
        self.incidents: dict[str, Incident] = {}  # open ones, in opening order
        self.tp_suppressed = False
        # Raised comm incidents resolved within reopen_s, by (type, scope): what a key
        # firing again reopens.
        self.resolved: dict[tuple[str, str], Incident] = {}
        self.stalls = StallTracker()  # the plugin's progress records
        self.pauses = Pauses()  # its checkpoint saves, from its training log

    @property
    def recent_ns(self) -> int:
        """How long ago a key's last window may have ended and still say how it is now
        (a stalled or finished key says nothing)."""
        return self.lateness_ns + 2 * self.window_ns

    def find(self, type_: str, scope: str | None) -> Incident | None:
        for inc in self.incidents.values():
            if inc.type == type_ and (scope is None or inc.scope == scope):
                return inc
        return None
