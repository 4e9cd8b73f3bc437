"""Incidents: what becomes one anomaly event (firing, then resolved with the same id).

Several keys degrading for one reason (a network path carries every network key of the
job) are one incident, not one alert per key: keys join the open incident of their
verdict's ``(type, scope)`` and the incident resolves when its last member recovers.
The id is a hash of ``job, type, scope, start_ns``, so replaying the same records, or
restoring a saved pipeline, gives the same ids.
"""

from __future__ import annotations

from typing import Any

from ncclwatch.records import AnomalyEvent
from ncclwatch.rules import fnv1a64

MAX_LISTED_KEYS = 20
SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}

# (comm, op, size_bucket, transport), with a fifth member "spread" when the key belongs to
# a straggler incident through its ranks' spread rather than its bus bandwidth.
KeyTuple = tuple[str, ...]


def incident_id(job: str, type_: str, scope: str, start_ns: int) -> str:
    """Stable id of an incident.

    >>> incident_id("j", "network_path", "", 1_000_000_000)
    '...'
    >>> incident_id("j", "network_path", "", 1) == incident_id("j", "network_path", "", 1)
    True
    """
    raw = "\x1f".join((job, type_, scope, str(start_ns))).encode("utf-8")
    return f"{fnv1a64(raw):016x}"


class Incident:
    """One open anomaly and everything its events report."""

    __slots__ = (
        "id", "type", "attribution", "scope", "job", "key", "host", "rank",
        "start_ns", "detected_ns", "end_ns", "severity", "members", "listed", "n_members",
        "eff_sum", "eff_n", "peak", "obs_sum", "base_sum", "ob_n", "trigger",
        "throughput_delta", "evidence", "drift", "confirmed",
    )

    def __init__(self, **kw: Any):
        self.members: list[KeyTuple] = []  # keys still degraded
        self.listed: list[dict[str, Any]] = []  # keys ever affected (bounded), for evidence
        self.n_members = 0
        self.eff_sum = 0.0
        self.eff_n = 0
        self.peak = 0.0
        self.obs_sum = 0.0
        self.base_sum = 0.0
        self.ob_n = 0
        self.trigger: KeyTuple | None = None
        self.end_ns: int | None = None
        self.throughput_delta: float | None = None
        self.drift = False
        # A comm incident is open (its keys join it, baselines hold) before it is raised:
        # it is emitted only once confirmed (:meth:`~.incident_book.IncidentBook.confirm`); an unconfirmed
        # one ends silently.
        self.confirmed = True
        self.key: dict[str, Any] = {
            "comm": None, "comm_name": None, "op": None, "size_bucket": None, "transport": None,
        }
        self.host: str | None = None
        self.rank: int | None = None
        self.evidence: dict[str, Any] = {}
        for k, v in kw.items():
            setattr(self, k, v)

    # --- accounting ---------------------------------------------------------------

    def add_window(self, effect: float, observed: float | None, baseline: float | None,
                   trigger: bool) -> None:
        self.eff_sum += effect
        self.eff_n += 1
        if effect > self.peak:
            self.peak = effect
        if trigger and observed is not None and baseline is not None:
            self.obs_sum += observed
            self.base_sum += baseline
            self.ob_n += 1

    @property
    def effect(self) -> float:
        return self.eff_sum / self.eff_n if self.eff_n else 0.0

    def event(self, state: str, detected_ns: int) -> AnomalyEvent:
        evidence = dict(self.evidence)
        if self.eff_n:
            evidence["windows"] = self.eff_n
            evidence["peak_effect"] = round(self.peak, 6)
        if self.listed:
            evidence["keys_affected"] = self.n_members
            evidence["keys"] = [dict(k) for k in self.listed]
        if self.drift:
            evidence["page_hinkley"] = True
        return AnomalyEvent(
            id=self.id,
            type=self.type,
            state=state,
            job=self.job,
            key=dict(self.key),
            host=self.host,
            rank=self.rank,
            start_ns=self.start_ns,
            end_ns=self.end_ns if state == "resolved" else None,
            detected_ns=detected_ns,
            baseline_busbw_gbs=self.base_sum / self.ob_n if self.ob_n else None,
            observed_busbw_gbs=self.obs_sum / self.ob_n if self.ob_n else None,
            effect=round(self.effect, 6),
            attribution=self.attribution,
            throughput_delta=(
                None if self.throughput_delta is None else round(self.throughput_delta, 6)
            ),
            severity=self.severity,
            evidence=evidence,
        )

    # --- persistence --------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}
        out["members"] = [list(m) for m in self.members]
        out["trigger"] = list(self.trigger) if self.trigger else None
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Incident:
        kw = dict(state)
        kw["members"] = [tuple(m) for m in state["members"]]
        kw["trigger"] = tuple(state["trigger"]) if state["trigger"] else None
        return cls(**kw)
