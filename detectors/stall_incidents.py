"""A job's stalls as incidents: the rank holding a communicator up, raised while it holds.

:class:`~.stalls.StallTracker` says which communicator waits and for whom; here that
becomes a ``straggler`` incident naming the rank (its evidence says ``stalled``), raised
through the job's :class:`~.incident_book.IncidentBook` so that everything else the
stall causes (the job's throughput drop, its keys' dips once it resumes) is held as its
consequence, as for any straggler. It is raised only

- once the job has run steadily (a warm throughput baseline or a warm key): a job
  starting up waits for its slowest rank by design;
- after ``detector.stall_after_s`` of waiting, and ``stall_steps`` of the job's median
  step time (a job of 20-s steps waits seconds at a barrier now and then);
- for a communicator held by at most half its ranks (many silent ranks are lost
  telemetry, not a stall: that is ``telemetry_loss``'s).

When every rank waits, none behind or silent, what they wait on is raised instead, by
the communicator's transport class: ``network_path`` (a network path that stopped
carrying anything), ``intra_node`` (NVLink, one host), else ``collective_degraded``.

It ends once the job's windows pass the last record that showed it by
``sustain_windows`` windows (operations complete again) and the job's steps are back to
normal (its drop over the stall is then judged while it is open, whatever order a driver
delivers steps and windows in), or by ``throughput_hold_windows`` windows at most.
"""

from __future__ import annotations

from typing import Any

from ncclwatch.rules import NETWORK_TRANSPORTS

from .attribution import Verdict
from .incident_book import DEFAULT_WINDOW_NS, IncidentBook
from .incidents import Incident
from .job import JobState
from .stalls import MAX_LISTED, Stall


def is_stall(inc: Incident) -> bool:
    """An incident raised from progress records (it has no keys as members)."""
    return "stalled" in inc.evidence


class StallIncidents:
    """Raises, refreshes and ends a job's stall incidents through ``book``."""

    def __init__(self, book: IncidentBook):
        self.book = book
        self.cfg = book.cfg

    def see(self, job: JobState, rec: Any, out: list) -> None:
        """A progress record of the job. Judged as it comes once the job has run
        steadily; before that it is held (a recording's windows may reach the job stage
        after the progress records of their time) and judged, in order, once it has."""
        row = [rec.comm, rec.comm_name, rec.nranks, rec.rank, rec.ts_ns, rec.colls, rec.in_flight,
               rec.waiting_since_ns, rec.host, rec.pid]
        if not self._steady(job):
            job.stalls.hold(row)
            return
        if job.stalls.held:
            self.check(job, out)  # what was held first
        job.stalls.see_row(row)
        self._judge(job, out)
        self._report(job)

    def check(self, job: JobState, out: list) -> None:
        """After a window tick: judge the records held until the job ran steadily, then
        raise, refresh or end."""
        tracker = job.stalls
        if tracker.held and self._steady(job):
            held, tracker.held = tracker.held, []
            # Those from before the job's stream time now were its start-up's (a window
            # tick finds it steady within a window of its becoming so).
            for row in (r for r in held if r[4] >= job.watermark):
                tracker.see_row(row)
                self._judge(job, out)
        self._judge(job, out)
        self._report(job)

    def _report(self, job: JobState) -> None:
        """Tell the observer how long each communicator waits now (its gauge), whether or
        not that is a stall yet; a communicator whose records the job's windows have passed
        by two windows waits no more."""
        comm_waiting = getattr(self.book.observer, "comm_waiting", None)
        if comm_waiting is not None:
            window = job.window_ns or DEFAULT_WINDOW_NS
            comm_waiting(job.job, job.stalls.waits(job.watermark - 2 * window) if job.stalls.last else {})

    def _judge(self, job: JobState, out: list) -> None:
        cfg = self.cfg
        tracker = job.stalls
        window = job.window_ns or DEFAULT_WINDOW_NS
        tp = job.throughput
        for inc in [i for i in job.incidents.values() if is_stall(i)]:
            last = inc.evidence["stalled"]["last_ns"]
            # The job's own steps back to normal too (a drop the stall cost is judged while
            # it is open, in any driver's order), or long enough after.
            recovered = (not self.book.reports_throughput(job)
                         or tp.ts_ns > last and not tp.rule.firing and tp.pending_fire is None)
            after = max(cfg.sustain_windows, cfg.throughput_hold_windows if not recovered else 0)
            if job.watermark >= last + after * window:
                # Operations complete again (windows end past it): forget what the stall
                # wrote, so that the next one starts from the ranks' new records.
                tracker.forget_before(last + 1)
                inc.end_ns = last
                self.book.resolve(job, inc, out)
        if not cfg.stall_after_s or not tracker.last:
            return
        gap = job.throughput.step_gap_ns(tracker.now_ns)
        min_wait = max(int(cfg.stall_after_s * 1e9), int(cfg.stall_steps * gap))
        for st in tracker.stalls(min_wait):
            inc = next((i for i in job.incidents.values()
                        if is_stall(i) and i.evidence["stalled"]["comm"] == st.comm), None)
            if inc is not None:
                self._refresh(inc, st)
            elif tracker.was_raised(st.comm, st.since_ns):
                continue
            elif self.book.paused(job, st.since_ns, st.now_ns):
                # A checkpoint save: raised only if the ranks' records show the wait
                # outlasting it (not the job's windows passing a wait that ended with it).
                continue
            elif st.holders and len(st.holders) <= max(1, st.nranks // 2):
                tracker.note_raised(st.comm, st.since_ns)
                self._raise(job, st, out)
            elif not st.holders and len(st.waiting) == st.nranks:
                tracker.note_raised(st.comm, st.since_ns)
                self._raise_link(job, st, out)

    @staticmethod
    def _steady(job: JobState) -> bool:
        return job.throughput.baseline.warm or any(k.warm for k in job.keys.values())

    def _raise(self, job: JobState, st: Stall, out: list) -> None:
        rank = self._root(job, st)
        host, pid = self._process(job, st.comm, rank)
        v = Verdict("straggler", "straggler", scope=f"stall/{st.comm}/{rank}", host=host, rank=rank)
        inc = self.book.open(job, v, st.since_ns, None)
        inc.key = {"comm": st.comm, "comm_name": st.comm_name, "op": None, "size_bucket": None,
                   "transport": self._transport(job, st.comm)}
        inc.evidence = {"comm": st.comm}
        if pid:
            inc.evidence["pid"] = pid
        self._refresh(inc, st)
        inc.confirmed = True
        inc.severity = "critical"  # the communicator completes nothing: the job is stopped
        inc.detected_ns = st.now_ns
        self.book.emit(inc.event("firing", st.now_ns), out)

    def _raise_link(self, job: JobState, st: Stall, out: list) -> None:
        """Every rank waits in the same collective, none behind or silent: what they
        all wait on is the transport (a network path gone, NVLink hung), or a GPU that
        never started the kernel, which the records cannot tell; named by the
        communicator's transport class, as the link incident it most likely is."""
        transport = self._transport(job, st.comm)
        hosts = sorted({v[5] for (c, _), v in job.stalls.last.items() if c == st.comm})
        if transport in NETWORK_TRANSPORTS:
            v = Verdict("network_path", "network", scope="")
        elif transport == "nvlink" and len(hosts) == 1:
            v = Verdict("intra_node", "intra_node", scope=hosts[0], host=hosts[0])
        else:
            v = Verdict("collective_degraded", "unknown", scope=f"stall/{st.comm}")
        if job.find(v.type, v.scope) is not None:
            return  # raised already (a link degraded before it stopped altogether)
        inc = self.book.open(job, v, st.since_ns, None)
        inc.key = {"comm": st.comm, "comm_name": st.comm_name, "op": None, "size_bucket": None,
                   "transport": transport}
        inc.evidence = {"comm": st.comm, "every_rank_waits": True}
        if v.type == "network_path":
            inc.evidence["hosts"] = hosts[:MAX_LISTED]
        self._refresh(inc, st)
        inc.confirmed = True
        inc.severity = "critical"
        inc.detected_ns = st.now_ns
        self.book.emit(inc.event("firing", st.now_ns), out)

    @staticmethod
    def _refresh(inc: Incident, st: Stall) -> None:
        inc.evidence["stalled"] = {
            "comm": st.comm,
            "waiting_s": round((st.now_ns - st.since_ns) / 1e9, 3),
            "last_ns": st.now_ns,
            "collective": st.colls,  # the waiting ranks' count: the one they wait in
            "waiting_ranks": list(st.waiting[:MAX_LISTED]),
            "behind_ranks": list(st.behind[:MAX_LISTED]),
            "silent_ranks": list(st.silent[:MAX_LISTED]),
        }

    @staticmethod
    def _root(job: JobState, st: Stall) -> int:
        """The holder to name: a silent rank, else one behind that waits nowhere itself
        (one waiting in another communicator is held up in turn), else the first."""
        if st.silent:
            return st.silent[0]
        tracker = job.stalls
        for r in st.behind:
            host, pid = tracker.process_of(st.comm, r)
            if not any(v[3] > 0 and v[5] == host and v[6] == pid for v in tracker.last.values()):
                return r
        return st.behind[0]

    @staticmethod
    def _process(job: JobState, comm: str, rank: int) -> tuple[str | None, int | None]:
        """The rank's host and process id: from its own records, else from the windows."""
        host, pid = job.stalls.process_of(comm, rank)
        if host is not None:
            return host, pid
        for k in job.keys.values():
            if k.comm == comm and rank in k.rank_host:
                return k.rank_host[rank], k.rank_pid.get(rank)
        return job.telemetry.rank_host.get((comm, rank)), None

    @staticmethod
    def _transport(job: JobState, comm: str) -> Any:
        return next((k.transport for k in job.keys.values() if k.comm == comm), None)
