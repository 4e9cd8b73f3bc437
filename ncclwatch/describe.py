"""How people are told where an anomaly is: one phrasing for the console, the alerts and
the report.

>>> where({"op": "AllReduce", "size_bucket": "32MiB", "transport": "net",
...        "comm": "0x00000000000000ab", "comm_name": "tp"}, host="node7", rank=1)
'AllReduce 32MiB over net (comm tp 0x00000000000000ab) rank 1 on node7'
>>> where({"comm": "0x00000000000000ab", "comm_name": ""})
'(comm 0x00000000000000ab)'
>>> where({}), where({}, whole="whole job")
('all collectives', 'whole job')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def where(key: Mapping[str, Any] | None, *, host: str | None = None, rank: int | None = None,
          whole: str = "all collectives") -> str:
    """The key's operation, size, transport and communicator, then the rank and host when
    the anomaly names them; ``whole`` when it names none of these (a job-wide anomaly)."""
    key = key or {}
    parts = [str(key[k]) for k in ("op", "size_bucket") if key.get(k)]
    if key.get("transport"):
        parts.append(f"over {key['transport']}")
    comm, name = key.get("comm"), key.get("comm_name")
    if comm or name:
        parts.append(f"(comm {' '.join(str(x) for x in (name, comm) if x)})")
    if rank is not None:
        parts.append(f"rank {rank}")
    if host:
        parts.append(f"on {host}")
    return " ".join(parts) or whole


def where_of(event: Any, whole: str = "all collectives") -> str:
    """:func:`where` of an ``AnomalyEvent``; a network path names the nodes at its ends
    (``evidence["hosts"]``) when the event names no single host."""
    host = event.host
    if host is None and (event.evidence or {}).get("hosts"):
        host = ", ".join(event.evidence["hosts"])
    return where(event.key, host=host, rank=event.rank, whole=whole)


def stalled(evidence: Mapping[str, Any] | None) -> str | None:
    """What a stall's evidence says (a straggler raised from progress records), or None.

    >>> stalled({"stalled": {"waiting_s": 12.5, "collective": 533, "waiting_ranks": [0],
    ...                      "behind_ranks": [], "silent_ranks": [1]}})
    'stalled: rank 1 silent while rank 0 waits 12.5 s in collective #533'
    >>> stalled({}) is None
    True
    """
    s = (evidence or {}).get("stalled")
    if not isinstance(s, Mapping):
        return None

    def ranks(key: str) -> str:
        rs = [str(r) for r in s.get(key) or ()]
        return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(rs) if rs else ""

    holders = " and ".join(f"{ranks(k)} {how}" for k, how in (("silent_ranks", "silent"),
                                                               ("behind_ranks", "behind")) if s.get(k))
    verb = "waits" if len(s.get("waiting_ranks") or ()) == 1 else "wait"
    return (f"stalled: {holders or 'no rank named'} while {ranks('waiting_ranks')} {verb} "
            f"{s.get('waiting_s', 0):g} s in collective #{s.get('collective')}")
