"""The telemetry tracker's liveness: a whole communicator marked once a window, not once a rank."""

from __future__ import annotations

from ncclwatch.detectors.telemetry import TelemetryTracker

S = 10**9
RANKS = [(r, f"h{r // 8}") for r in range(64)]


def _whole(t: TelemetryTracker, comm: str, ends: range) -> None:
    for end in ends:
        t.see_all(comm, RANKS, (end - 1) * S, end * S, 5 * S)


def test_whole_groups_mark_the_communicator_and_the_saved_state_has_every_ranks_last_window():
    t = TelemetryTracker()
    _whole(t, "c", range(1, 30))
    assert {t.rank_last[("c", r)] for r, _ in RANKS} == {1 * S}  # each rank marked once, at first
    assert {t.last_seen("c", r) for r, _ in RANKS} == {29 * S}
    # an older build reads each rank's own last window: the state says the communicator's
    assert {last for _, _, _, last in t.to_state()["ranks"]} == {29 * S}
    assert t.check(30 * S, 5 * S) == {}


def test_a_rank_missing_from_the_groups_is_silent_after_whole_ones_and_after_a_restore():
    t = TelemetryTracker()
    _whole(t, "c", range(1, 10))
    for end in range(10, 20):  # rank 9 (host h1) stops reporting; the groups are partial
        t.see_ranks("c", [rk for rk in RANKS if rk[0] != 9], (end - 1) * S, end * S, 5 * S)
    for tracker in (t, TelemetryTracker.from_state(t.to_state())):
        problems = tracker.check(19 * S, 5 * S)
        assert list(problems) == ["h1"]
        assert problems["h1"]["silent_ranks"] == [["c", 9]]
        assert problems["h1"]["since_ns"] == 9 * S


def test_a_communicator_whole_again_after_a_silence_reports_its_hosts_resumed():
    t = TelemetryTracker()
    _whole(t, "c", range(1, 5))
    _whole(t, "c", range(12, 14))  # 8 s without a window: every host is back
    assert t.resumed == {f"h{i}": 11 * S for i in range(8)}
    assert t.check(13 * S, 5 * S) == {}


def test_a_communicator_never_whole_is_checked_rank_by_rank():
    t = TelemetryTracker()
    _whole(t, "c", range(1, 20))
    t.see_ranks("d", [(0, "x"), (1, "y")], 0, 1 * S, 5 * S)
    for end in range(2, 20):
        t.see_ranks("d", [(0, "x")], (end - 1) * S, end * S, 5 * S)
    assert list(t.check(19 * S, 5 * S)) == ["y"]
