"""One fault, one incident: whether a comm incident is its own cause or another's echo.

A fault shows in more places than where it is. A slower link makes its ranks reach their
next operation, on another communicator, at different times (a late rank there); a
slower GPU runs its NCCL kernels slower too (its links look slower); compute slowing on
every GPU slows every collective alike (the links look slower, but their share of a
step holds). The job stage raises one incident per cause: these rules, read by
:class:`~.pipeline.Pipeline` before it raises a link or straggler incident, say which
incidents only echo another. They read a :class:`~.job.JobState` and change nothing but
the name of a straggler's process (:func:`name_late_process`).
"""

from __future__ import annotations

from typing import Any

from ncclwatch.records import UNKNOWN_GPU
from ncclwatch.rules import NETWORK_TRANSPORTS

from .attribution import degraded_now, late_process, processes, rule_degraded
from .incidents import Incident
from .job import JobState
from .keys import KeyView

LINK_TYPES = frozenset({"network_path", "intra_node"})  # what slows the transfers themselves


def link_trouble(job: JobState, comm: str | None, late: float) -> bool:
    """Most keys of ``comm`` are degraded or in a link incident: its transfers slowed.

    A late rank slows one or two of its communicator's operations (those right
    after its extra work, where even its own kernel waits), while the others keep
    their speed on the rank that waited least; a slow link slows them all.
    """
    keys = [k for k in job.keys.values() if k.comm == comm and k.warm]
    # a key whose ranks now wait for one of them is that rank's doing, not the link's
    bad = sum((degraded_now(k) or k.incident is not None) and not rule_degraded(k.spread_rule)
              and k.last_spread < late for k in keys)
    return bool(keys) and 2 * bad > len(keys)

def echoed_links(job: JobState, inc: Incident, reopen_ns: int = 0) -> list[Incident]:
    """The job's link incidents that began no later than this straggler and have the
    late process as a rank of one of their keys: a slow transfer makes its ranks
    arrive at their next operation, on another communicator, at different times,
    which looks like a late rank there (one cause). A process that took no part in
    the slow transfers is a straggler of its own.

    Raised link incidents that resolved within ``reopen_ns`` (stream time) count too:
    an intermittent fault resolves between its pulses and reopens with the next, while
    the ranks it keeps apart stay apart; its straggler echo is no cause of its own for
    being still there in the pause."""
    named = named_key(job, inc)
    if named is None or inc.rank is None:
        return []
    host, proc = named.rank_host.get(inc.rank), processes(named).get(inc.rank)
    since = job.watermark - reopen_ns
    open_ = [o for o in job.incidents.values()
             if o is not inc and o.type in LINK_TYPES and o.start_ns <= inc.start_ns
             and any(has_process(job.keys.get(m[:4]), host, proc) for m in o.members)]
    if not reopen_ns:
        return open_
    # a resolved incident has no members left: the keys it listed say where it was
    paused = [o for o in job.resolved.values()
              if o.type in LINK_TYPES and o.end_ns is not None and o.end_ns >= since
              and o.start_ns <= inc.start_ns
              and any(has_process(job.keys.get(_key_of(d)), host, proc) for d in o.listed)]
    return open_ + paused


def _key_of(described: dict[str, Any]) -> tuple:
    """The key tuple of a key as events describe it (an incident's ``key``, its ``listed``)."""
    return (described["comm"], described["op"], described["size_bucket"], described["transport"])


def slow_gpu_echo(job: JobState, inc: Incident, late: float) -> bool:
    """A link incident that a straggler begun no later explains: the late process is a
    rank of every key of the incident, and an NVLink key it is in is degraded too, or
    the job's other network keys, those without it, hold. A slower GPU (another
    process's kernels on it, lower clocks) runs its NCCL kernels slower as well as its
    compute, so every collective it is in slows, NVLink ones included; a slower
    network leaves NVLink-only keys alone. A GPU slowed part of the time leaves its
    NVLink keys' fastest transfers as fast as before (they read as waiting, not
    degraded), but not the communicators without it: a network that slows slows
    theirs too. Where every network key has the process, the keys cannot tell the two
    apart, and the straggler raised first (confirmed, before the link incident began)
    is taken for the cause: one fault, one incident (a two-GPU job whose only network
    communicator has the slow GPU, 2026-11-28).

    A straggler that its own communicator's link trouble holds back
    (:func:`link_trouble`, ``late`` as there), or that is held as this very
    incident's echo (:func:`echoed_links`: both began in one window), explains
    nothing: taking the link incident for its echo in turn would hold both, and a
    fault that slows both the transfers and the ranks (another process's copies over
    a node's NVLink) would never be raised."""
    for s in job.incidents.values():
        if s.type != "straggler" or s.start_ns > inc.start_ns or s.rank is None:
            continue
        if not s.confirmed and (link_trouble(job, s.evidence.get("comm"), late)
                                or inc in echoed_links(job, s)):
            continue
        # its key, or (one named across keys) a key of the communicator it names
        named = named_key(job, s) or next(
            (v for v in job.keys.values() if v.comm == s.evidence.get("comm") and s.rank in v.rank_host), None)
        if named is None:
            continue
        host, proc = named.rank_host.get(s.rank), processes(named).get(s.rank)
        # where its GPU is not known, communicators a process late on its host may share it
        shared = comms_late_on(job, host) if proc is None or proc[1].startswith("pid ") else set()
        members = [job.keys.get(m[:4]) for m in inc.members]
        if not members or not all(has_process(v, host, proc, shared) for v in members):
            continue
        if any(v.transport == "nvlink" and degraded_now(v) and has_process(v, host, proc, shared)
               for v in job.keys.values()):
            return True
        since = job.watermark - job.recent_ns
        without = [v for v in job.keys.values() if v.transport in NETWORK_TRANSPORTS and v.warm
                   and v.last_end_ns >= since and not has_process(v, host, proc, shared)]
        if without and not any(degraded_now(v) for v in without):
            return True
        if not without and s.confirmed and s.start_ns < inc.start_ns:
            # Every network key has the process: the keys cannot tell its GPU from the
            # network, but the straggler was raised first, on its own evidence, and a
            # slower GPU slows the transfers it takes part in: one cause, not two.
            return True
    return False

def comms_late_on(job: JobState, host: str | None) -> set[str]:
    """Communicators whose ranks now wait for one of them on ``host`` whose GPU no
    window names: where it is not known, that process may share the straggler's GPU.

    A GPU can hold two ranks' processes (two communicators' ranks, or two ranks of one
    with ``NCCL_MULTI_RANK_GPU_ENABLE``), and NCCL Inspector's records name no GPU: a
    slower GPU then makes a second process late, in communicators the straggler's is
    not in, and slows the transfers it takes part in there. Only ranks on the
    straggler's host whose GPU is unknown count: one on another GPU is its own story.

    >>> from types import SimpleNamespace as K
    >>> late = K(firing=True, streak=3, sustain=3)
    >>> def key(comm, gpus, scores):
    ...     return K(comm=comm, rank_host={0: "a", 1: "a"}, rank_gpu=gpus, spread_rule=late,
    ...              spread_scores=scores)
    >>> job = K(keys={1: key("net", {}, [[1, 0.4], [0, -0.5]]),
    ...               2: key("nv", {1: "GPU-1"}, [[1, 0.4], [0, -0.5]])})
    >>> sorted(comms_late_on(job, "a")), sorted(comms_late_on(job, "b"))
    (['net'], [])
    """
    out: set[str] = set()
    for v in job.keys.values():
        if v.comm in out or not v.spread_scores or not rule_degraded(v.spread_rule):
            continue
        r = v.spread_scores[0][0]
        if v.rank_host.get(r) == host and v.rank_gpu.get(r, UNKNOWN_GPU) in ("", UNKNOWN_GPU):
            out.add(v.comm)
    return out


def name_late_process(job: JobState, inc: Incident) -> None:
    """Name the process every communicator's spread points at (:func:`late_process`),
    which may not be the rank the first key to fire named."""
    named = named_key(job, inc)
    if named is None or inc.rank is None:
        return
    view, rank = late_process(job.keys.values(), (named, inc.rank))
    if view is named and rank == inc.rank:
        return
    # kept from the first renaming: each check before the incident is raised may rename
    inc.evidence.setdefault("named_first", {"comm": named.comm, "rank": inc.rank})
    inc.rank, inc.host, inc.key = rank, view.rank_host.get(rank), view.describe()
    inc.evidence.update(comm=view.comm, rank_scores=view.spread_scores)
    inc.evidence.pop("gpu", None)
    inc.evidence.pop("pid", None)
    inc.evidence.update(process_evidence(view, rank))

def slowed_alike(job: JobState, network: bool, drop: float, rise: float) -> bool:
    """The job's network (or NVLink) operations slowed no more than the rest of its steps.

    A slower link costs the job the extra time its operations take, so the share of
    a rank's time spent in them rises: by ``drop * (e / b - 1)`` of their usual share
    ``b`` for a job losing ``drop`` of its throughput, ``e`` being the part of the
    lost time they account for (``e`` near 1 for a link fault). When everything
    slows alike (compute contending with NCCL's kernels on every GPU, a lower clock)
    their bus bandwidth falls as much as the job's speed, yet their share holds
    (``e = b``). So the class slowed alike when its share rose by less than
    ``link_share_rise * drop``: its keys account for less than ``1 + link_share_rise``
    times their usual share of the lost time, and for less than halfway from that
    share to all of it (``e < (1 + b) / 2``: where the class is most of a step, as in a
    communication-bound job, ``(1 + link_share_rise) * b`` would be most of the way
    to a link fault's ``e = 1``). Only where the check can tell: the
    class has keys with a share baseline, reporting now, whose usual shares add up to
    at most ``1 / (1 + link_share_rise)`` (beyond it a slower link moves the share too
    little to see). ``rise`` is ``link_share_rise``; 0 turns the check off.
    """
    if rise <= 0 or drop <= 0:
        return False
    fresh = job.watermark - job.recent_ns
    usual = recent = share = 0.0
    for view in job.keys.values():
        # Every key of the class, not an incident's members alone: a slower path costs
        # the job through all its keys, and the loss is the whole job's.
        b = view.busy_usual
        if ((view.transport in NETWORK_TRANSPORTS) != network or b is None
                or not view.busy_recent or view.last_end_ns < fresh):
            continue
        usual += b
        recent += sum(view.busy_recent) / len(view.busy_recent)
        # An upper bound on a rank's share: each key's ranks counted as if in all keys.
        share += b / view.window_ns
    if not usual or share > 1.0 / (1.0 + rise):
        return False
    # e < (1 + b) / 2 is a share rise under drop * (1 - b) / (2 * b)
    return recent / usual < 1.0 + min(rise, (1.0 - share) / (2.0 * share)) * drop

def hosts_of(job: JobState, members: list) -> list[str]:
    """The nodes whose ranks the incident's keys span (a network path's two ends)."""
    hosts: set[str] = set()
    for gk in members:
        ks = job.keys.get(gk[:4])
        if ks is not None:
            hosts.update(ks.rank_host.values())
    return sorted(hosts)

def named_key(job: JobState, inc: Incident) -> KeyView | None:
    """The job stage's view of the key an incident names (its ``key``)."""
    return job.keys.get(_key_of(inc.key))


def process_evidence(view: Any, rank: int) -> dict[str, Any]:
    """What an event says of a rank's process: its GPU and process id, where known."""
    out: dict[str, Any] = {}
    if (gpu := view.rank_gpu.get(rank)) and gpu != UNKNOWN_GPU:
        out["gpu"] = gpu
    if pid := view.rank_pid.get(rank):
        out["pid"] = pid
    return out


def has_process(view: KeyView | None, host: str | None, proc: tuple[str, str] | None,
                also: set[str] | frozenset[str] = frozenset()) -> bool:
    """The key has process ``proc`` among its ranks (:func:`processes`), or, where the
    process is not known, a rank on ``host``; or its communicator is one of ``also``."""
    if view is None:
        return False
    if view.comm in also:
        return True
    if proc is None:
        return host in view.rank_host.values()
    return proc in processes(view).values()
