"""Where is the problem? Attribution of a sustained degradation within one job.

When a key has been degraded long enough to fire, the job's other keys say where the
trouble is, with this precedence:

1. **straggler**: one rank of the key's communicator is consistently the fastest to
   finish (everyone waits for it) and that explains the loss (:mod:`.straggler`);
2. **intra_node**: the key is an NVLink key, or some NVLink key of the job is degraded
   right now: traffic inside a node is slow, whatever the network does;
3. **network_path**: only network keys (``rules.NETWORK_TRANSPORTS``: ``net``, ``mixed``)
   are degraded while the job's NVLink keys hold. A job without NVLink keys has no such
   reference; there several network keys degrading together still point at the path,
   while a single network key degrading alone among healthy ones does not (healthy
   ones that move bytes at the link's pace: a key of latency-bound messages,
   ``rules.bandwidth_bound``, or one far faster than the link carries, a Broadcast
   root's, holds through any loss of bandwidth, so it counts for nothing;
   :func:`measures_link`);
4. **collective_degraded** (attribution ``unknown``): anything else.

The inputs are the job stage's views of its keys (:class:`~.keys.KeyView`) and what the
firing key's verdict said of its ranks; this module only reads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ncclwatch.records import UNKNOWN_GPU  # in windows of forwarders before 2026-11-27
from ncclwatch.rules import NETWORK_TRANSPORTS, bandwidth_bound, size_bucket_bytes


class KeyView(Protocol):
    """What attribution reads of a key (the job stage's :class:`~.keys.KeyView`)."""

    comm: str
    op: str
    size_bucket: str
    transport: str
    host: str | None
    last_end_ns: int
    rank_host: dict[int, str]
    rank_gpu: dict[int, str]
    rank_pid: dict[int, int]
    rule: Any  # firing, streak, sustain
    spread_rule: Any
    spread_scores: list[list] | None  # the straggler scorer's top [rank, score] while degraded
    warm: bool


@dataclass(frozen=True)
class Verdict:
    type: str
    attribution: str
    scope: str  # what makes two firing keys the same incident within the job
    host: str | None = None
    rank: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)


def key_scope(k: KeyView) -> str:
    return f"{k.comm}/{k.op}/{k.size_bucket}/{k.transport}"


def degraded_now(k: KeyView) -> bool:
    """Firing, or degraded for all but the last of the windows it needs to fire.

    One window over the threshold is what noise does now and then; a key that is one
    window from firing is what a real fault starting at the same time looks like.
    """
    return rule_degraded(k.rule)


def rule_degraded(rule: Any) -> bool:
    """:func:`degraded_now` for any sustained rule (a key's spread rule too)."""
    return rule.firing or rule.streak >= max(1, rule.sustain - 1)


def attribute(
    key: KeyView,
    job_keys: Iterable[KeyView],
    *,
    straggler_rank: int | None,
    rank_scores: list[list],
    now_ns: int,
    recent_ns: int,
) -> Verdict:
    """Classify the firing ``key`` given every key of its job.

    ``straggler_rank`` is the rank the key's straggler scorer names given the loss the
    key fired on (:meth:`~.straggler.StragglerScorer.straggler`), ``rank_scores`` its
    highest scores: the key stage's, from the verdict that fired.

    Other keys count as *degraded now* (:func:`degraded_now`) or *holding* only if warm
    and their latest window ended within ``recent_ns`` of ``now_ns`` (a key that
    stopped reporting says nothing).
    """
    rank = straggler_rank
    if rank is not None:
        host = key.rank_host.get(rank)
        return Verdict(
            type="straggler",
            attribution="straggler",
            scope=host if host is not None else f"{key.comm}/{rank}",
            host=host,
            rank=rank,
            evidence={"rank_scores": rank_scores, "comm": key.comm},
        )
    nv_degraded: list[KeyView] = []
    nv_holding = 0
    net_degraded = 0
    net_total = 0
    for k in job_keys:
        if not k.warm or now_ns - k.last_end_ns > recent_ns:
            continue
        bad = k is key or degraded_now(k)
        if k.transport == "nvlink":
            if bad:
                nv_degraded.append(k)
            else:
                nv_holding += 1
        elif k.transport in NETWORK_TRANSPORTS and (bad or measures_link(k, key.baseline, key.size_bucket)):
            # a key holding that does not move bytes at the link's pace (a few bytes'
            # all-reduce, a broadcast's root) says nothing of the path
            net_total += 1
            net_degraded += bad
    counts = {
        "nvlink_keys_degraded": len(nv_degraded),
        "nvlink_keys_holding": nv_holding,
        "network_keys_degraded": net_degraded,
        "network_keys": net_total,
    }
    if key.transport == "nvlink" or nv_degraded:
        src = key if key.transport == "nvlink" else nv_degraded[0]
        host = src.host
        return Verdict("intra_node", "intra_node", scope=host or "", host=host, evidence=counts)
    if key.transport in NETWORK_TRANSPORTS and (
        nv_holding > 0 or net_degraded >= 2 or net_total <= 1
    ):
        return Verdict("network_path", "network", scope="", evidence=counts)
    return Verdict(
        "collective_degraded", "unknown", scope=key_scope(key), host=key.host, evidence=counts
    )


# A holding network key whose usual bus bandwidth is this many times the degraded one's
# is not moving its bytes at the link's pace (a Broadcast root's kernel is done once its
# data is in the transport's buffers): it says nothing of the link either.
LINK_PACE_RATIO = 8.0


# A holding network key whose messages are this many times smaller than the degraded
# key's may pass in bursts that a shaped or queued link lets through at full speed (a
# token bucket refilled between a pipeline's 8-MiB activations, where a 125-MiB gradient
# all-reduce runs at the shaped rate): it says nothing of the link's sustained bandwidth.
LINK_BURST_RATIO = 4


def measures_link(k: KeyView, ref_baseline: float | None, ref_bucket: str | None = None) -> bool:
    """Whether network key ``k`` holding says the link kept its bandwidth, next to a
    degraded key whose baseline is ``ref_baseline`` and size bucket ``ref_bucket``: it
    moves bytes (``rules.bandwidth_bound``) at about the link's pace, in messages not far
    smaller than the degraded key's.

    >>> from types import SimpleNamespace as K
    >>> measures_link(K(size_bucket="8MiB", baseline=2.1), 2.0), measures_link(K(size_bucket="8B", baseline=0.0), 2.0)
    (True, False)
    >>> measures_link(K(size_bucket="4MiB", baseline=44.0), 2.0)   # a Broadcast's root
    False
    >>> measures_link(K(size_bucket="8MiB", baseline=2.5), 1.9, "64MiB")   # bursts through a shaper
    False
    """
    if not bandwidth_bound(k.size_bucket):
        return False
    if ref_bucket is not None and size_bucket_bytes(k.size_bucket) * LINK_BURST_RATIO < size_bucket_bytes(ref_bucket):
        return False
    return ref_baseline is None or k.baseline is None or k.baseline <= LINK_PACE_RATIO * ref_baseline


def processes(k: KeyView) -> dict[int, tuple[str, str]]:
    """Each rank's process, as far as the key's windows tell: (host, GPU) where they name
    the GPU, else (host, ``"pid N"``) where they carry process ids and no two of the key's
    ranks share one on a host (one process driving several GPUs is not one rank); ranks
    with neither are left out, never matched across keys.

    >>> from types import SimpleNamespace as K
    >>> processes(K(rank_host={0: "a", 1: "a"}, rank_gpu={0: "GPU-0"}, rank_pid={0: 7, 1: 8}))
    {0: ('a', 'GPU-0'), 1: ('a', 'pid 8')}
    >>> processes(K(rank_host={0: "a", 1: "a"}, rank_gpu={}, rank_pid={0: 7, 1: 7}))
    {}
    >>> processes(K(rank_host={0: "a"}, rank_gpu={0: "unknown"}, rank_pid={0: 7}))  # older forwarders
    {0: ('a', 'pid 7')}
    """
    gpus, pids = k.rank_gpu, k.rank_pid
    unique = len({(k.rank_host.get(r), p) for r, p in pids.items()}) == len(pids)
    out: dict[int, tuple[str, str]] = {}
    for r, h in k.rank_host.items():
        if (g := gpus.get(r)) and g != UNKNOWN_GPU:
            out[r] = (h, g)
        elif unique and (p := pids.get(r)):
            out[r] = (h, f"pid {p}")
    return out


def late_process(keys: Iterable[KeyView], named: tuple[KeyView, int]) -> tuple[KeyView, int]:
    """Which process the others wait for, by every communicator's spread, not one.

    ``named`` is the key (and its rank) a straggler incident names so far. A late
    process makes its communicator peers late for their *next* operation too: a rank
    of the same node that waited for it in a tensor-parallel collective arrives at the
    next data-parallel one as late as the straggler itself, and may even look later
    there. But in the communicator they share it is the one *waiting*. So each process
    named by a key whose spread is degraded now gets, as support, its lowest score over
    those keys it is a rank of (a key that lists it not among its top ranks: none); the
    best supported process is the late one. Processes are told apart by
    :func:`processes`. Returns the key (and rank in it)
    that names that process best, or ``named`` when nothing says otherwise.

    >>> from types import SimpleNamespace as K
    >>> degraded = K(firing=True, streak=0, sustain=3)
    >>> def key(comm, gpus, scores):
    ...     return K(comm=comm, rank_host={r: "h" for r in range(len(gpus))}, rank_pid={},
    ...              rank_gpu=dict(enumerate(gpus)), spread_rule=degraded, spread_scores=scores)
    >>> dp = key("dp", ["g0", "g1", "g2", "g3"], [[3, 0.32], [2, 0.25], [1, -0.35], [0, -0.42]])
    >>> tp = key("tp", ["g2", "g3"], [[0, 0.96], [1, -271.0]])  # g3 waits for g2 here
    >>> k, rank = late_process([dp, tp], (dp, 3))
    >>> k.comm, rank, k.rank_gpu[rank]
    ('tp', 0, 'g2')
    >>> other = key("pp", ["g8", "g9"], None)  # named by a key whose spread is not degraded
    >>> late_process([dp, tp], (other, 1))[0].comm  # g9 is in neither: nothing against it
    'pp'
    """
    views = [k for k in keys if k.spread_scores and rule_degraded(k.spread_rule)]
    if len(views) < 2:
        return named

    procs = [processes(k) for k in views]
    listed = [{p: score for r, score in k.spread_scores or () if (p := ps.get(r)) is not None}
              for k, ps in zip(views, procs, strict=True)]
    members = [set(ps.values()) for ps in procs]

    def support(p: tuple[str, str]) -> float:
        # a process no degraded key has among its ranks has nothing against it
        return min((ls.get(p, -math.inf) for ls, ms in zip(listed, members, strict=True) if p in ms),
                   default=math.inf)

    current = processes(named[0]).get(named[1])
    if current is None:  # nothing to match it by
        return named
    candidates = {p for ls in listed for p in list(ls)[:1]} | {current}
    best = max(sorted(candidates), key=support)
    if best == current or support(best) <= support(current):
        return named
    # the key that scores it best names it (its rank there)
    i = max((i for i, ls in enumerate(listed) if best in ls), key=lambda i: listed[i][best])
    return views[i], next(r for r, p in procs[i].items() if p == best)
