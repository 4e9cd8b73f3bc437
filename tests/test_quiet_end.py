"""A job that ended while an incident was open: live drivers end it after
``detector.quiet_end_s`` of wall-clock time in which its partition's stream time stood
still (``JobDetectors.quiet``), as newer records of other jobs would have."""

from __future__ import annotations

import pytest
from ncclwatch.detectors.stream import JobDetectors, job_partition
from ncclwatch.ingest.recording import record_time_ns
from ncclwatch_testkit.drivers import scenario_records

from ncclwatch.config import DetectorConfig

SCENARIO = "multi_fault_2x8"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _cut_while_firing(records: list) -> tuple[list, list]:
    """The records up to a few seconds after the first incident fired, and the rest."""
    d = JobDetectors(DetectorConfig(), partitions=4)
    for r in records:
        if any(e.state == "firing" for e in d.process(r)):
            cut = record_time_ns(r) + 3 * 10**9
            head = [x for x in records if record_time_ns(x) <= cut]
            return head, records[len(head):]
    raise AssertionError("the scenario raises nothing")


@pytest.fixture(scope="module")
def cut():
    return _cut_while_firing(scenario_records([SCENARIO]))


def _fed(records: list, clock: Clock, **cfg) -> tuple[JobDetectors, list]:
    d = JobDetectors(DetectorConfig(**cfg), partitions=4, clock=clock)
    events = [e for r in records for e in d.process(r)]
    return d, events


def test_a_job_that_ended_firing_is_resolved_after_quiet_end_s_of_wall_time(cut):
    head, _ = cut
    clock = Clock()
    d, events = _fed(head, clock, quiet_end_s=60.0)
    firing = {e.id for e in d.open_anomalies()}
    assert firing, "an incident is open where the records stop"
    clock.now += 59.0
    assert not d.quiet_due() and d.quiet() == []
    assert {e.id for e in d.open_anomalies()} == firing
    clock.now += 1.0
    assert d.quiet_due()
    ended = d.quiet()
    assert {e.id for e in ended if e.state == "resolved"} == firing
    assert all(e.evidence.get("resolved_because") == "job_silent" for e in ended if e.state == "resolved")
    assert d.open_anomalies() == []
    # its end is the job's last record, not the wall clock: what replays give
    last = max(record_time_ns(r) for r in head)
    assert all(e.end_ns <= last for e in ended)
    assert d.quiet() == []  # once


def test_what_quiet_ends_is_what_later_records_of_another_job_would_have_ended(cut):
    # Replays end a job that stopped when their stream time passes its silence: the
    # same events, whatever moved the time on.
    head, _ = cut
    job = head[0].job
    clock = Clock()
    d, _ = _fed(head, clock, quiet_end_s=60.0)
    clock.now += 60.0
    by_quiet = [(e.id, e.state, e.end_ns, e.evidence.get("resolved_because")) for e in d.quiet()]
    d2, _ = _fed(head, Clock(), quiet_end_s=0.0)
    group = job_partition(job, 4)
    later = max(record_time_ns(r) for r in head) + 60 * 10**9
    by_time = [(e.id, e.state, e.end_ns, e.evidence.get("resolved_because")) for e in d2.advance(later, group)]
    assert by_quiet == by_time and by_quiet


def test_records_that_come_after_a_quiet_end_are_not_late(cut):
    # a forwarder outage longer than quiet_end_s: the job ends, then goes on
    head, tail = cut
    clock = Clock()
    d, _ = _fed(head, clock, quiet_end_s=60.0)
    stream_before = dict(d.stream_ns)
    clock.now += 120.0
    assert d.quiet()
    assert d.stream_ns == stream_before  # the group's own time stayed
    job = head[0].job
    p = d.pipelines[job]
    late_before = p.late_windows
    after = [e for r in tail for e in d.process(r)]
    assert d.pipelines[job] is p and not p._jobs[job].silent
    # only windows of the rank groups open when it "ended" (closed incomplete then) come late
    last = max(record_time_ns(r) for r in head)
    stragglers = sum(r.KIND == "window" and r.end_ns <= last for r in tail)
    assert p.late_windows - late_before <= stragglers
    assert [e for e in after if e.state == "firing"], "the fault, still there, is raised again"


def test_off_and_busy_groups_are_left_alone(cut):
    head, _ = cut
    clock = Clock()
    d, _ = _fed(head, clock, quiet_end_s=0.0)
    clock.now += 10**6
    assert not d.quiet_due() and d.quiet() == []
    assert d.open_anomalies()
    # a group whose stream time keeps moving is not quiet, however long the job runs:
    # two seconds of wall time per instant of the records, minutes in all
    d, _ = _fed(head[: len(head) // 2], clock, quiet_end_s=60.0)
    start, last = clock.now, None
    for r in head[len(head) // 2:]:
        if record_time_ns(r) != last:
            clock.now += 2.0
            last = record_time_ns(r)
        d.process(r)
        assert not d.quiet_due()
    assert clock.now - start > 60.0


def test_a_quiet_group_stops_asking_once_its_jobs_are_forgotten(cut):
    # job_evict_s of quiet: the job is dropped, and the group is no longer quiet (the
    # worker's tick stops running batches for it)
    head, _ = cut
    clock = Clock()
    d, _ = _fed(head, clock, quiet_end_s=60.0, job_evict_s=600.0)
    clock.now += 60.0
    assert d.quiet() and d.quiet_due()
    clock.now += 600.0
    assert d.quiet() == [] and d.pipelines == {}
    assert d.evicted == [head[0].job]
    assert not d.quiet_due()


def test_the_knob_refuses_negative_values():
    with pytest.raises(ValueError, match="quiet_end_s"):
        DetectorConfig(quiet_end_s=-1.0)
