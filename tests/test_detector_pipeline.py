"""Pipeline behaviour on small hand-built streams: when it fires, what it says, when not."""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import replace

from ncclwatch.detectors.model import BusbwModel, ModelEntry
from ncclwatch.detectors.pipeline import Pipeline
from ncclwatch.detectors.telemetry import TelemetryTracker

from ncclwatch.config import DetectorConfig
from ncclwatch.records import (
    DropRecord,
    OpRecord,
    PluginStats,
    ThroughputRecord,
    WindowSummary,
)

S = 10**9
T0 = 1_700_000_000  # seconds
NET = "0x00000000000000a1"
NET2 = "0x00000000000000a3"
NV = "0x00000000000000b1"
NV2 = "0x00000000000000b2"
CFG = DetectorConfig(warmup_windows=5)


def win(t, rank, busbw, *, comm=NET, op="AllReduce", bucket="64MiB", transport="net",
        nranks=2, host=None, exec_ns=None, job="j", seq=None, count=10) -> WindowSummary:
    first = 10 * t if seq is None else seq
    return WindowSummary(
        job=job, host=host if host is not None else f"h{rank}", comm=comm, comm_name="",
        op=op, size_bucket=bucket, transport=transport, rank=rank, nranks=nranks,
        start_ns=(T0 + t) * S, end_ns=(T0 + t + 1) * S, count=count, bytes=count << 26,
        exec_ns_min=1, exec_ns_p50=exec_ns if exec_ns is not None else int(67e6 / busbw),
        exec_ns_p95=1, exec_ns_max=1, busbw_gbs_p50=busbw, first_seq=first, last_seq=first + 9,
    )


def feed(p: Pipeline, seconds, make) -> list:
    out = []
    for t in seconds:
        for rec in make(t):
            out += p.process(rec)
    return out


def two_ranks(busbw_at, **kw):
    return lambda t: [win(t, r, busbw_at(t), **kw) for r in (0, 1)]


def s(ns):
    return None if ns is None else ns // S - T0


def test_sustained_loss_fires_after_sustain_windows_from_the_first_degraded_window():
    p = Pipeline(CFG)
    events = feed(p, range(40), two_ranks(lambda t: 28.0 if t >= 20 else 40.0))
    assert [(e.state, s(e.start_ns), s(e.detected_ns)) for e in events] == [("firing", 20, 23)]
    ev = events[0]
    assert ev.effect == 0.3 and ev.baseline_busbw_gbs == 40.0 and ev.observed_busbw_gbs == 28.0
    assert ev.key["op"] == "AllReduce" and ev.end_ns is None


def test_one_and_two_window_spikes_and_single_slow_windows_never_fire():
    p = Pipeline(CFG)
    bad = {12, 20, 21, 30, 40, 41, 50}  # 1- and 2-window spikes of -50 %
    events = feed(p, range(80), two_ranks(lambda t: 20.0 if t in bad else 40.0))
    assert events == []


def test_resolves_after_recover_windows_with_the_same_id_and_end_at_recovery():
    p = Pipeline(CFG)
    events = feed(p, range(60), two_ranks(lambda t: 28.0 if 20 <= t < 35 else 40.0))
    firing, resolved = events
    assert resolved.state == "resolved" and resolved.id == firing.id
    assert s(resolved.end_ns) == 35 and s(resolved.detected_ns) == 38
    assert resolved.effect == firing.effect == 0.3


def test_hysteresis_keeps_a_firing_anomaly_open_between_the_two_thresholds():
    p = Pipeline(CFG)
    # 30 % loss, then 7 % (under the 10 % threshold but over the 5 % recovery one)
    events = feed(p, range(60), two_ranks(lambda t: 28.0 if 20 <= t < 25 else
                                          (37.2 if t >= 25 else 40.0)))
    assert [e.state for e in events] == ["firing"]


def test_baseline_does_not_learn_a_long_degradation_as_normal():
    p = Pipeline(CFG)
    events = feed(p, range(400), two_ranks(lambda t: 28.0 if 20 <= t < 380 else 40.0))
    assert [(e.state, s(e.start_ns), s(e.end_ns)) for e in events] == [
        ("firing", 20, None), ("resolved", 20, 380)]
    assert p._jobs["j"].stage[(NET, "AllReduce", "64MiB", "net")].baseline.baseline == 40.0


def test_busbw_is_the_best_rank_s_so_one_waiting_rank_cannot_fire_a_key():
    p = Pipeline(CFG)
    events = feed(p, range(50), lambda t: [
        win(t, r, 20.0 if (r == 3 and t >= 20) else 40.0, nranks=4, exec_ns=1_000_000)
        for r in range(4)])
    assert events == []


def job_keys(t, net_bw, nv_bw, net2_bw=40.0):
    out = [win(t, r, net_bw, comm=NET) for r in (0, 1)]
    out += [win(t, r, net2_bw, comm=NET2, op="AllGather", bucket="16MiB") for r in (0, 1)]
    out += [win(t, r, nv_bw, comm=NV, op="ReduceScatter", transport="nvlink", host="n0")
            for r in (0, 1)]
    return out


def test_network_keys_degrading_while_nvlink_holds_is_one_network_path_anomaly():
    p = Pipeline(CFG)
    events = feed(p, range(40), lambda t: job_keys(t, 28.0 if t >= 20 else 40.0, 100.0,
                                                 30.0 if t >= 20 else 40.0))
    assert len(events) == 1
    ev = events[0]
    assert (ev.type, ev.attribution, ev.host) == ("network_path", "network", None)
    assert ev.evidence["nvlink_keys_holding"] == 1
    late = p.open_anomalies()[0]
    assert late.evidence["keys_affected"] == 2  # the second network key joined, no new event
    assert late.key["comm"] is None and late.key["transport"] == "net"


def test_nvlink_key_degrading_is_intra_node_on_its_host():
    p = Pipeline(CFG)
    events = feed(p, range(40), lambda t: job_keys(t, 40.0, 70.0 if t >= 20 else 100.0))
    assert [(e.type, e.attribution, e.host) for e in events] == [
        ("intra_node", "intra_node", "n0")]


def two_nodes(t, net_bw, nv_bw, nv2_bw):
    """Two network keys, and an NVLink key on each of two nodes."""
    return [*job_keys(t, net_bw, nv_bw, net_bw),
            *(win(t, r, nv2_bw, comm=NV2, op="AllReduce", bucket="4MiB", transport="nvlink", host="n1")
              for r in (0, 1))]


def test_every_network_key_and_one_of_two_nvlink_keys_degrading_is_the_network_path():
    # starved proxies: the network keys all slow, and one node's NVLink key with them
    events = feed(Pipeline(CFG), range(40), lambda t: two_nodes(
        t, 26.0 if t >= 20 else 40.0, 65.0 if t >= 20 else 100.0, 100.0))
    assert [(e.type, e.attribution) for e in events] == [("network_path", "network")]
    assert events[0].evidence["nvlink_keys_degraded"] == 1 and events[0].evidence["network_keys_degraded"] == 2
    # every NVLink key too: the node's trouble first, as before
    events = feed(Pipeline(CFG), range(40), lambda t: two_nodes(
        t, 26.0 if t >= 20 else 40.0, 65.0 if t >= 20 else 100.0, 65.0 if t >= 20 else 100.0))
    assert {e.type for e in events} == {"intra_node"}


def test_one_network_key_degrading_while_other_network_keys_hold_is_collective_degraded():
    p = Pipeline(CFG)
    events = feed(p, range(40), lambda t: [
        w for w in job_keys(t, 28.0 if t >= 20 else 40.0, 100.0) if w.transport != "nvlink"])
    assert [(e.type, e.attribution) for e in events] == [("collective_degraded", "unknown")]
    assert events[0].key == {"comm": NET, "comm_name": "", "op": "AllReduce",
                             "size_bucket": "64MiB", "transport": "net"}


def test_latency_bound_keys_holding_do_not_keep_the_one_big_network_key_from_the_path():
    """Megatron-LM's data-parallel job on two nodes (recorded 2026-11-29): one gradient
    all-reduce of 512 MiB beside all-reduces of a few bytes (the loss, the grad norm). A
    throttled link slows the one and cannot slow the others; they hold, but say nothing
    of the path's bandwidth. A second key that moves bytes in messages of about the same
    size and holds still does; one of messages far smaller (which a shaped link lets
    through in bursts, ``LINK_BURST_RATIO``) does not."""
    def job(t, big_bw, small_bucket="8B"):
        out = [win(t, r, big_bw, bucket="512MiB") for r in (0, 1)]
        return out + [win(t, r, 0.001, comm=NET2, bucket=small_bucket, exec_ns=40_000) for r in (0, 1)]

    events = feed(Pipeline(CFG), range(40), lambda t: job(t, 28.0 if t >= 20 else 40.0))
    assert [(e.type, e.attribution) for e in events] == [("network_path", "network")]
    events = feed(Pipeline(CFG), range(40), lambda t: job(t, 28.0 if t >= 20 else 40.0, "128MiB"))
    assert [(e.type, e.attribution) for e in events] == [("collective_degraded", "unknown")]
    events = feed(Pipeline(CFG), range(40), lambda t: job(t, 28.0 if t >= 20 else 40.0, "4MiB"))
    assert [(e.type, e.attribution) for e in events] == [("network_path", "network")]


def test_the_rank_with_the_shortest_exec_is_the_straggler():
    p = Pipeline(CFG)

    def make(t):
        late = t >= 20
        # rank 2 arrives late: the others wait 40 % longer, rank 2's kernel is short
        # (10 ops a window: the others wait 2 % of the time for it)
        return [win(t, r, 40.0 / (3.0 if late and r != 2 else 1.0), comm=NET, nranks=4,
                    exec_ns=int((1.0 if r == 2 or not late else 3.0) * 1e6),
                    host="nA" if r < 2 else "nB") for r in range(4)]

    events = feed(p, range(40), make)
    assert [(e.type, e.attribution, e.rank, e.host) for e in events] == [
        ("straggler", "straggler", 2, "nB")]
    assert events[0].evidence["rank_scores"][0][0] == 2


def test_ranks_with_other_op_instances_are_left_out_of_the_straggler_score():
    p = Pipeline(CFG)

    def make(t):
        # rank 3's window covers other seqs (misaligned): its short time must not count
        return [win(t, r, 40.0, nranks=4, exec_ns=500_000 if r == 3 else 1_000_000,
                    seq=10 * t + (100 if r == 3 else 0)) for r in range(4)]

    feed(p, range(30), make)
    scorer = p._jobs["j"].stage[(NET, "AllReduce", "64MiB", "net")].straggler
    assert 3 not in scorer.rank_scores()


def tp(t, tflops, job="j"):
    return ThroughputRecord(job=job, host="h0", rank=-1, ts_ns=(T0 + t) * S + S // 2, step=t,
                            tflops_per_gpu=tflops, tokens_per_s=None, source="fixture")


def test_throughput_loss_during_a_comm_anomaly_makes_it_critical():
    p = Pipeline(CFG)
    events = feed(p, range(60), lambda t: [*two_ranks(
        lambda t: 28.0 if 20 <= t < 40 else 40.0)(t), tp(t, 268.0 if 20 <= t < 40 else 310.0)])
    firing = [e for e in events if e.state == "firing"]
    assert {e.type for e in events} == {"network_path"}
    assert firing[-1].severity == "critical"
    resolved = events[-1]
    assert resolved.state == "resolved" and resolved.severity == "critical"
    assert abs(resolved.throughput_delta - (268 / 310 - 1)) < 0.01


def test_a_comm_degradation_that_costs_the_job_under_the_gate_raises_nothing():
    # the network loses 30 % but the job only 1.6 %: nothing worth a page
    p = Pipeline(CFG)
    events = feed(p, range(40), lambda t: [*two_ranks(
        lambda t: 28.0 if t >= 20 else 40.0)(t), tp(t, 305.0 if t >= 20 else 310.0)])
    assert events == []
    assert p.open_anomalies() == []


def test_without_throughput_only_a_large_loss_is_raised_and_as_a_warning():
    small = feed(Pipeline(CFG), range(40), two_ranks(lambda t: 34.0 if t >= 20 else 40.0))
    assert small == []  # 15 %: under threshold_without_throughput
    large = feed(Pipeline(CFG), range(40), two_ranks(lambda t: 26.0 if t >= 20 else 40.0))
    assert [(e.type, e.severity) for e in large] == [("network_path", "warning")]


def test_a_harmless_degradation_does_not_take_the_blame_for_a_later_loss():
    # An NVLink key sags 30 % at t=20 without costing the job; at t=40 the network keys
    # lose 30 % and the job 15 %: one network_path incident, nothing intra-node.
    p = Pipeline(CFG)
    events = feed(p, range(70), lambda t: [
        *job_keys(t, 28.0 if t >= 40 else 40.0, 70.0 if t >= 20 else 100.0,
                  28.0 if t >= 40 else 40.0),
        tp(t, 264.0 if t >= 40 else 310.0)])
    assert [(e.type, e.state, e.severity) for e in events] == [
        ("network_path", "firing", "critical")]
    assert s(events[0].start_ns) == 40


def test_throughput_drop_with_healthy_nccl_is_reported_as_not_nccl():
    p = Pipeline(CFG)
    events = feed(p, range(60), lambda t: [*two_ranks(lambda t: 40.0)(t),
                                           tp(t, 250.0 if 20 <= t < 40 else 310.0)])
    assert [(e.type, e.attribution, e.state) for e in events] == [
        ("throughput_drop", "unknown", "firing"), ("throughput_drop", "unknown", "resolved")]
    assert events[0].severity == "warning" and events[0].baseline_busbw_gbs is None
    assert abs(events[0].throughput_delta - (250 / 310 - 1)) < 0.01


def test_a_slow_start_does_not_make_the_throughput_baseline_deaf_to_a_small_drop():
    # A job's first steps are slow (start-up: 300 and 280 against ~346 TFLOP/s, as the
    # recorded Inspector run i4-slow-all-1.2x), then ~1 % noise; a 7 % loss from t=30
    # must still be raised: the warm-up's noise estimate leaves the start-up out.
    rnd = random.Random(3)
    def make(t):
        level = 300.0 if t == 0 else 280.0 if t == 1 else 322.0 if 30 <= t < 50 else 346.0
        return [*two_ranks(lambda t: 40.0)(t), tp(t, level * rnd.uniform(0.99, 1.01))]
    events = feed(Pipeline(CFG), range(70), make)
    assert [(e.type, e.state) for e in events] == [
        ("throughput_drop", "firing"), ("throughput_drop", "resolved")]
    assert 30 <= s(events[0].start_ns) <= 31


def test_steps_longer_than_a_window_count_for_every_window_they_span():
    # One step every 3 s (a trainer's log line, or a long step): a 20 % drop from t=30
    # is sustained after the same stream time as with a step per window, not after
    # three steps (9 s); the baseline learns each step once (no false alert before).
    def found_at(every):
        p = Pipeline(CFG)
        events = feed(p, range(80), lambda t: [*two_ranks(lambda t: 40.0)(t)] + (
            [tp(t, 250.0 if 30 <= t < 60 else 310.0)] if t % every == every - 1 else []))
        assert [(e.type, e.state) for e in events] == [
            ("throughput_drop", "firing"), ("throughput_drop", "resolved")], events
        return s(events[0].detected_ns)
    assert found_at(3) <= found_at(1) + 2


def logged_every_5_s(level_at):
    """A job whose trainer logs once per 5 s: the line at t reports the mean over
    (t - 5, t] of ``level_at``, as Megatron's TFLOP/s over its log interval."""
    def line(t):
        if t % 5 != 4:
            return []
        return [tp(t, 5 / sum(1 / level_at(u) for u in range(t - 4, t + 1)))]
    return line


def test_a_job_logging_every_5_s_has_a_baseline_after_the_warmup_s_time_not_its_lines():
    # Ten windows of warm-up at one line per 5 s were 50 s of job: a drop at 30 s went
    # into the warm-up and was never found. Each line counts for the windows it spans.
    rnd = random.Random(5)
    noise = {t: rnd.uniform(0.995, 1.005) for t in range(-5, 100)}
    line = logged_every_5_s(lambda t: (260.0 if 30 <= t < 60 else 310.0) * noise[t])
    events = feed(Pipeline(DetectorConfig()), range(100),
                  lambda t: [*two_ranks(lambda t: 40.0)(t), *line(t)])
    assert [(e.type, e.state) for e in events] == [
        ("throughput_drop", "firing"), ("throughput_drop", "resolved")], events
    assert s(events[0].detected_ns) <= 40


def test_a_log_line_whose_loss_began_in_its_last_second_waits_for_nccl_to_show_it():
    # The network slows 4x from t=74; the line at t=74 spans 70-74 and is 15 % down from
    # that one second alone. Its windows 70-73 look degraded with NCCL healthy, but the
    # loss is the network's: one network_path incident, no "not NCCL" drop.
    line = logged_every_5_s(lambda t: 78.0 if t >= 74 else 310.0)
    events = feed(Pipeline(DetectorConfig()), range(100), lambda t: [
        *job_keys(t, 10.0 if t >= 74 else 40.0, 100.0, 10.0 if t >= 74 else 40.0), *line(t)])
    assert [(e.type, e.state) for e in events] == [("network_path", "firing")], events


def test_a_link_fault_in_a_job_logging_every_5_s_is_judged_by_the_lines_after_it_began():
    # The network keys lose 20 % from t=74 and the job 10 %, one line per 5 s: the line
    # at 74 reports 70-74, one second of the fault (-2 %), and made the fault's first
    # seconds look harmless, so it was never raised. A line counts for an incident when
    # most of the time it reports came after the incident began.
    line = logged_every_5_s(lambda t: 279.0 if t >= 74 else 310.0)
    events = feed(Pipeline(DetectorConfig()), range(100), lambda t: [
        *job_keys(t, 32.0 if t >= 74 else 40.0, 100.0, 32.0 if t >= 74 else 40.0), *line(t)])
    firing = [e for e in events if e.state == "firing"]
    assert [(e.type, e.severity) for e in firing] == [("network_path", "critical")], events
    assert s(firing[0].start_ns) == 74 and s(firing[0].detected_ns) <= 81
    assert firing[0].throughput_delta <= -DetectorConfig().throughput_drop


def test_a_pause_longer_than_the_fill_limit_is_not_a_sustained_drop():
    # A step that took 90 s (a checkpoint, say) reports one low value: not 90 windows of it.
    p = Pipeline(CFG)
    events = feed(p, range(160), lambda t: [*two_ranks(lambda t: 40.0)(t)] + (
        [] if 40 <= t < 130 else [tp(t, 3.0 if t == 130 else 310.0)]))
    assert [e for e in events if e.type == "throughput_drop"] == []


def slowed_job(link_share_rises: bool):
    """Every rank 1.3x slower from t=20 to 40: the network keys' bus bandwidth and the
    job's TFLOP/s both fall by 1/1.3. With ``link_share_rises`` the steps keep their
    count of network ops per window (the ops alone slowed: their share of the time
    rises); without, the steps slowed alike and fit 1/1.3 as many ops in a window."""
    def make(t):
        slow = 20 <= t < 40
        count = 10 if link_share_rises or not slow else 8  # 10 / 1.3, rounded up
        bw = 40.0 / 1.3 if slow else 40.0
        return [*(win(t, r, bw, count=count) for r in (0, 1)),
                *(win(t, r, bw, comm=NET2, op="AllGather", bucket="16MiB", count=count) for r in (0, 1)),
                tp(t, 310.0 / 1.3 if slow else 310.0)]
    return make


def test_network_ops_slowing_alike_with_the_whole_step_are_the_jobs_drop_not_the_links():
    events = feed(Pipeline(CFG), range(60), slowed_job(link_share_rises=False))
    assert [(e.type, e.state) for e in events] == [
        ("throughput_drop", "firing"), ("throughput_drop", "resolved")]
    # the same losses with the network ops' share of the time rising: the link's doing
    events = feed(Pipeline(CFG), range(60), slowed_job(link_share_rises=True))
    assert [(e.type, e.state, e.severity) for e in events] == [
        ("network_path", "firing", "critical"), ("network_path", "resolved", "critical")]
    # and with the check off, the slowed-alike job reads as a network path, as before it
    off = feed(Pipeline(replace(CFG, link_share_rise=0.0)), range(60), slowed_job(link_share_rises=False))
    assert {e.type for e in off} == {"network_path"}


def test_a_throughput_drop_that_deepens_past_twice_the_gate_fires_again_as_a_warning():
    # 7 % for ten windows (info), then 14 %: the same incident, now a warning
    p = Pipeline(CFG)
    events = feed(p, range(60), lambda t: [*two_ranks(lambda t: 40.0)(t), tp(
        t, 310.0 * (0.93 if 20 <= t < 30 else 0.86 if 30 <= t < 40 else 1.0))])
    assert [(e.type, e.state, e.severity) for e in events] == [
        ("throughput_drop", "firing", "info"), ("throughput_drop", "firing", "warning"),
        ("throughput_drop", "resolved", "warning")]
    assert len({e.id for e in events}) == 1
    assert 30 < s(events[1].detected_ns) <= 34


def test_silent_host_is_telemetry_loss_after_the_timeout_and_resolves_when_back():
    p = Pipeline(DetectorConfig(warmup_windows=5, telemetry_timeout_s=5))
    events = feed(p, range(60), lambda t: [
        win(t, r, 40.0, nranks=4, exec_ns=1_000_000) for r in range(4)
        if not (r == 3 and 20 <= t < 40)])
    assert [(e.type, e.state, e.host, e.rank, e.severity) for e in events] == [
        ("telemetry_loss", "firing", "h3", 3, "warning"),
        ("telemetry_loss", "resolved", "h3", 3, "warning")]
    firing, resolved = events
    assert s(firing.start_ns) == 20 and 25 <= s(firing.detected_ns) <= 27
    assert s(resolved.end_ns) == 40


def test_drop_records_are_telemetry_loss_at_info():
    p = Pipeline(DetectorConfig(warmup_windows=5, telemetry_timeout_s=5))

    def make(t):
        recs = two_ranks(lambda t: 40.0)(t)
        if t == 20:
            recs.append(DropRecord(job="j", host="h1", pid=7, gpu="g", rank=1,
                                   ts_ns=(T0 + t) * S, reason="ring_full", count=12, total=12))
        return recs

    events = feed(p, range(40), make)
    assert [(e.type, e.state, e.host, e.severity) for e in events] == [
        ("telemetry_loss", "firing", "h1", "info"), ("telemetry_loss", "resolved", "h1", "info")]
    assert events[0].evidence["drops"]["count"] == 12


def test_drop_records_read_after_their_timeout_are_still_reported_once():
    """The telemetry topic lagged: the drops of t = 20 s are read with the windows of
    t = 31 s, past the 5-s timeout. They happened: one firing with their own start, and
    its resolution, not silence (seen: a catching-up Faust worker whose time merge let
    the windows pass a stuck telemetry partition)."""
    p = Pipeline(DetectorConfig(warmup_windows=5, telemetry_timeout_s=5))

    def make(t):
        recs = two_ranks(lambda t: 40.0)(t)
        if t == 31:
            recs.append(DropRecord(job="j", host="h1", pid=7, gpu="g", rank=1,
                                   ts_ns=(T0 + 20) * S, reason="ring_full", count=12, total=12))
        return recs

    events = feed(p, range(40), make)
    assert [(e.type, e.state, e.host) for e in events] == [
        ("telemetry_loss", "firing", "h1"), ("telemetry_loss", "resolved", "h1")]
    firing, resolved = events
    assert s(firing.start_ns) == 20 and s(firing.detected_ns) >= 31
    assert s(resolved.end_ns) == 20 and firing.evidence["drops"]["count"] == 12


def test_a_saved_state_keeps_whether_its_drops_were_reported():
    tracker = TelemetryTracker()
    tracker.see_drop("h1", 20 * S, 3, "ring_full")
    assert set(tracker.check(40 * S, 5 * S)) == {"h1"}  # late: reported once
    again = TelemetryTracker.from_state(json.loads(json.dumps(tracker.to_state())))
    assert again.check(41 * S, 5 * S) == {}  # not a second time after a restart
    old = {**tracker.to_state(), "drops": [["h1", 20 * S, 20 * S, 3, {"ring_full": 3}]]}
    assert set(TelemetryTracker.from_state(old).check(41 * S, 5 * S)) == {"h1"}  # saved before the flag
    tracker.see_drop("h1", 21 * S, 3, "ring_full")  # more drops of that reported episode: news again
    assert tracker.check(40 * S, 5 * S)["h1"]["drops"]["count"] == 6
    assert tracker.check(41 * S, 5 * S) == {}


def test_growing_plugin_stats_drop_counters_count_as_drops():
    p = Pipeline(DetectorConfig(warmup_windows=5, telemetry_timeout_s=5))

    def make(t):
        recs = two_ranks(lambda t: 40.0)(t)
        if t in (10, 20):
            recs.append(PluginStats(job="j", host="h0", pid=7, gpu="g", ts_ns=(T0 + t) * S,
                                    recorded=100 * t, dropped={"pool_full": 0 if t == 10 else 5},
                                    segment=t))
        return recs

    events = feed(p, range(30), make)
    assert [(e.type, e.state, e.host, e.severity) for e in events] == [
        ("telemetry_loss", "firing", "h0", "info"), ("telemetry_loss", "resolved", "h0", "info")]
    assert events[0].evidence["drops"]["reasons"] == {"plugin_stats": 5}


def test_a_job_that_goes_silent_has_its_anomalies_resolved_on_advance():
    p = Pipeline(dataclasses.replace(CFG, job_evict_s=100))
    events = feed(p, range(30), two_ranks(lambda t: 28.0 if t >= 20 else 40.0))
    assert [e.state for e in events] == ["firing"]
    assert p.advance((T0 + 35) * S) == []  # within the telemetry timeout
    (resolved,) = p.advance((T0 + 45) * S)
    assert resolved.state == "resolved" and resolved.evidence["resolved_because"] == "job_silent"
    assert s(resolved.end_ns) == 30
    p.advance((T0 + 200) * S)
    assert p.jobs() == []


def test_windows_for_an_already_closed_group_are_late_and_ignored():
    p = Pipeline(CFG)
    feed(p, range(10), two_ranks(lambda t: 40.0))
    assert p.process(win(3, 0, 1.0)) == []
    assert p.late_windows == 1


def test_an_incomplete_rank_group_closes_after_the_lateness_and_still_detects():
    p = Pipeline(CFG)
    # rank 1 of a 3-rank comm never reports key windows: groups close by lateness
    events = feed(p, range(40), lambda t: [
        win(t, r, 28.0 if t >= 20 else 40.0, nranks=3, exec_ns=1_000_000) for r in (0, 2)])
    assert [(e.type, s(e.start_ns)) for e in events] == [("network_path", 20)]
    assert s(events[0].detected_ns) <= 26


def test_a_cold_start_model_detects_a_loss_present_from_the_first_windows():
    model = BusbwModel({("net", "AllReduce"): ModelEntry(alpha_ns=0.0, beta_gbs=40.0,
                                                         buckets={"64MiB": 40.0})})
    events = feed(Pipeline(CFG, model=model), range(20), two_ranks(lambda t: 28.0))
    assert [(e.type, s(e.start_ns)) for e in events] == [("network_path", 0)]
    assert feed(Pipeline(CFG), range(20), two_ranks(lambda t: 28.0)) == []


def test_event_times_are_stream_times_whatever_the_wall_clock_says():
    p = Pipeline(CFG, clock=lambda: 0.0)
    events = feed(p, range(30), two_ranks(lambda t: 28.0 if t >= 20 else 40.0))
    assert s(events[0].detected_ns) == 23
    assert p.lag_s() == -(T0 + 30)


def test_op_records_and_single_rank_keys_are_accepted_and_ignored():
    p = Pipeline(CFG)
    op = OpRecord(id="0" * 16, job="j", host="h", pid=1, gpu="g", comm=NET, comm_name="",
                  rank=0, nranks=2, nnodes=2, local_ranks=1, transport="net", op="AllReduce",
                  seq=1, count=1, dtype="ncclFloat32", bytes=4, peer=-1, algo="RING",
                  proto="LL", channels=1, start_ns=T0 * S, exec_ns=10, timing="kernel_gpu",
                  algbw_gbs=0.4, busbw_gbs=0.4, graph=False)
    assert p.process(op) == []
    events = feed(p, range(30), lambda t: [win(t, 0, 1.0 if t > 20 else 40.0, nranks=1,
                                                transport="single")])
    assert events == [] and p.key_count() == 0
    assert p.records_total == {"op": 1, "window": 30}


def test_a_slow_ramp_is_measured_against_where_it_started():
    # 0 -> 30 % over 120 s: each window is within noise of the one before
    ramp = lambda t: 40.0 * (1 - 0.3 * min(max(t - 30, 0) / 120, 1.0))  # noqa: E731
    # No throughput: raised once the loss reaches threshold_without_throughput of the
    # pre-ramp level
    crossing = 30 + 120 * CFG.threshold_without_throughput / 0.30
    p = Pipeline(CFG)
    events = feed(p, range(200), two_ranks(ramp))
    assert [e.type for e in events][:1] == ["network_path"]
    assert s(events[0].detected_ns) <= crossing + 8
    # without Page-Hinkley's freeze the baseline follows the ramp for longer
    follower = Pipeline(dataclasses.replace(CFG, drift_freeze_windows=0))
    late = feed(follower, range(200), two_ranks(ramp))
    assert not late or s(late[0].detected_ns) >= s(events[0].detected_ns) + 4


def test_jitter_on_a_noisy_key_is_not_a_degradation():
    import random

    rng = random.Random(4)
    p = Pipeline(CFG)
    events = feed(p, range(600), two_ranks(lambda t: 40.0 * rng.lognormvariate(0, 0.08)))
    assert events == []


def test_a_lagging_forwarders_ranks_are_waited_for_not_dropped():
    p = Pipeline(CFG)

    def window(t, r):
        late = r >= 2  # ranks 2, 3 on a node whose forwarder lags 4 windows
        return win(t, r, 40.0 / (3.0 if t >= 40 and r != 3 else 1.0), nranks=4,
                   exec_ns=int((1.0 if r == 3 or t < 40 else 3.0) * 1e6),
                   host="slow" if late else "fast")

    events = []
    for t in range(80):
        for r in (0, 1):
            events += p.process(window(t, r))
        if t >= 4:
            for r in (2, 3):
                events += p.process(window(t - 4, r))
    late_after_warmup = p.late_windows
    assert late_after_warmup <= 12  # only until the lateness has grown
    assert [(e.type, e.rank, e.host) for e in events] == [("straggler", 3, "slow")]


def test_throughput_drop_is_not_reported_when_comm_windows_arriving_later_explain_it():
    p = Pipeline(CFG)
    events = []
    for t in range(60):
        # throughput is published at once, windows two seconds after they end
        events += p.process(tp(t, 268.0 if t >= 30 else 310.0))
        if t >= 2:
            events += feed(p, [t - 2], two_ranks(lambda u: 28.0 if u >= 30 else 40.0))
    assert [e.type for e in events] == ["network_path"]
    assert events[-1].severity == "critical"


def test_a_job_with_only_throughput_records_is_also_forgotten_when_silent():
    p = Pipeline(dataclasses.replace(CFG, job_evict_s=30))
    events = feed(p, range(60), lambda t: [tp(t, 250.0 if t >= 30 else 310.0)])
    assert [(e.type, e.state) for e in events] == [("throughput_drop", "firing")]
    (resolved,) = p.advance((T0 + 80) * S)
    assert resolved.evidence["resolved_because"] == "job_silent"
    p.advance((T0 + 100) * S)
    assert p.jobs() == []


def test_a_late_rank_of_two_is_found_by_the_spread_when_the_median_barely_moves():
    # Measured on two H200s: before the fault rank 0 arrives ~0.5 ms late (rank 1 waits),
    # during it rank 1 arrives 17 ms late (rank 0 waits). The median of two ranks' busbw
    # (their mean) moves by 8 %: only the ranks' spread shows the straggler.
    p = Pipeline(CFG)

    def make(t):
        late1 = 20 <= t < 40
        ex = {0: 17_000_000 if late1 else 36_000, 1: 37_000 if late1 else 500_000}
        return [win(t, r, 4.2e6 / ex[r], comm=NV, transport="nvlink", op="AllReduce",
                    bucket="4MiB", exec_ns=ex[r], host="vm") for r in (0, 1)]

    events = feed(p, range(60), make)
    assert [(e.type, e.state, e.rank, e.host) for e in events] == [
        ("straggler", "firing", 1, "vm"), ("straggler", "resolved", 1, "vm")]
    assert s(events[0].detected_ns) <= 24 and events[0].evidence["spread_effect"] > 0.9
    # 10 ops a second, each keeping rank 0 waiting ~17 ms: 17 % of the time
    assert 0.16 < events[0].evidence["waiting_share"] < 0.18
    assert abs(events[0].effect) < 0.1  # the busbw median barely moved


def test_a_rank_late_by_a_sliver_of_a_small_kernel_is_no_straggler():
    # Measured on two H100s (every rank 1.3x slower, two processes per GPU): on a 16 MiB
    # NVLink key rank 1 went from arriving with rank 0 to arriving ~0.1 ms after it, so
    # the ranks' spread fell by 60 %, yet the others waited 0.2 % of the time. Nobody is
    # held up; with straggler_min_wait 0 the spread alone names rank 1.
    def make(t):
        late1 = t >= 20
        ex = {0: 200_000 if late1 else 150_000, 1: 80_000 if late1 else 150_000}
        return [win(t, r, 4.2e6 / ex[r], comm=NV, transport="nvlink", op="ReduceScatter",
                    bucket="16MiB", exec_ns=ex[r], host="vm") for r in (0, 1)]

    assert feed(Pipeline(CFG), range(60), make) == []
    events = feed(Pipeline(replace(CFG, straggler_min_wait=0.0)), range(60), make)
    assert [(e.type, e.state, e.rank) for e in events] == [("straggler", "firing", 1)]


def test_a_throughput_drop_without_comm_trouble_waits_its_grace_windows():
    def detected(grace):
        p = Pipeline(replace(CFG, throughput_grace_windows=grace))
        events = feed(p, range(60), lambda t: [*two_ranks(lambda t: 40.0)(t), tp(t, 250.0 if t >= 30 else 310.0)])
        assert [(e.type, e.state) for e in events] == [("throughput_drop", "firing")]
        return s(events[0].detected_ns)

    # Grace 0 still waits for every key to close the window of the drop's last step.
    assert detected(0) <= detected(1) == detected(2) - 1 == detected(3) - 2
    assert detected(1) - 30 <= 4  # the drop starts at 30 and needs 3 windows


def test_a_throughput_drop_that_outlasts_its_comm_anomaly_is_reported_after_it():
    p = Pipeline(CFG)
    events = feed(p, range(80), lambda t: [
        *two_ranks(lambda t: 28.0 if 20 <= t < 35 else 40.0)(t),
        tp(t, 250.0 if 20 <= t < 60 else 310.0)])
    assert [(e.type, e.state) for e in events] == [
        ("network_path", "firing"), ("network_path", "resolved"),
        ("throughput_drop", "firing"), ("throughput_drop", "resolved")]
    drop = events[2]
    assert 35 <= s(drop.start_ns) <= 40 and drop.evidence["after_comm_anomaly"] is True


def test_a_key_back_from_silence_still_degraded_fires_a_new_anomaly():
    # The job stage ends the anomaly of a key that went quiet (the job went on); the key
    # stage, which never hears of that, starts the key's rule over when its windows
    # come back after the gap, so a loss that is still there is raised again.
    p = Pipeline(DetectorConfig(warmup_windows=5, telemetry_timeout_s=5))

    def make(t):
        recs = [win(t, r, 40.0, comm=NET2) for r in (0, 1)]
        if not 30 <= t < 45:
            recs += [win(t, r, 28.0 if t >= 20 else 40.0) for r in (0, 1)]
        return recs

    events = feed(p, range(60), make)
    comm = [(e.state, s(e.start_ns), s(e.end_ns), e.evidence.get("resolved_because"))
            for e in events if e.type != "telemetry_loss"]
    assert comm == [("firing", 20, None, None), ("resolved", 20, 30, "keys_silent"),
                    ("firing", 45, None, None)]


def test_a_fault_that_comes_back_soon_after_resolving_reopens_the_same_incident():
    """An intermittent link (on 6 s, off 6 s) is one incident that fires and resolves
    with one id, not a new page per pulse; with reopen_s 0 every pulse is its own."""
    def bad(t):
        return 20 <= t < 56 and (t - 20) % 12 < 6
    events = feed(Pipeline(CFG), range(90), two_ranks(lambda t: 24.0 if bad(t) else 40.0))
    assert len({e.id for e in events}) == 1
    states = [e.state for e in events]
    assert states.count("firing") == 3 and states[-1] == "resolved"
    assert events[-1].evidence["reopened"] == 2 and s(events[-1].start_ns) == 20
    apart = feed(Pipeline(replace(CFG, reopen_s=0.0)), range(90),
                 two_ranks(lambda t: 24.0 if bad(t) else 40.0))
    assert len({e.id for e in apart}) == 3


def test_a_drop_only_in_the_typical_instance_is_waiting_not_a_slower_link():
    """The ranks' p50 bus bandwidth falls 30 % while each rank's fastest instance keeps
    the link's speed (they arrive further apart): no link incident; when the fastest
    instances slow too, it fires."""
    def waiting(t, rank, slow_p50, slow_min):
        w = win(t, rank, 40.0 * (0.7 if slow_p50 else 1.0))
        fast = int(67e6 / (40.0 * (0.7 if slow_min else 1.0)))
        return replace(w, exec_ns_min=fast, exec_ns_p95=w.exec_ns_p50, exec_ns_max=w.exec_ns_p50)
    quiet = feed(Pipeline(CFG), range(50), lambda t: [waiting(t, r, t >= 20, False) for r in (0, 1)])
    assert quiet == []
    unchecked = feed(Pipeline(replace(CFG, transfer_confirm=0.0)), range(50),
                     lambda t: [waiting(t, r, t >= 20, False) for r in (0, 1)])
    assert [e.state for e in unchecked] == ["firing"]  # what the check keeps quiet
    slow = feed(Pipeline(CFG), range(50), lambda t: [waiting(t, r, t >= 20, t >= 20) for r in (0, 1)])
    assert [(e.state, s(e.start_ns)) for e in slow] == [("firing", 20)]


def test_a_long_fault_neither_grows_nor_teaches_the_transfer_baseline():
    """Held-back best-instance windows are dropped while the key fires (as the main
    baseline's are), so a long fault keeps no growing list and leaves the link's normal
    where it was."""
    def both_slow(t, rank):
        w = win(t, rank, 24.0 if 20 <= t < 220 else 40.0)
        return replace(w, exec_ns_min=w.exec_ns_p50, exec_ns_p95=w.exec_ns_p50, exec_ns_max=w.exec_ns_p50)
    p = Pipeline(CFG)
    events = feed(p, range(260), lambda t: [both_slow(t, r) for r in (0, 1)])
    assert [e.state for e in events] == ["firing", "resolved"]
    (ks,) = p._jobs["j"].stage.values()
    assert len(ks.transfer_unlearned) == 0 and abs(ks.transfer.baseline - 40.0) < 0.5


def test_a_late_ranks_waiting_is_not_learned_as_the_keys_usual_busy_time(tmp_path):
    """The demo: a straggler keeps the others waiting (their busy time inflated) for 20 s,
    then the network path degrades. Learned as usual, that waiting made the network keys'
    later busy time look unchanged and the fault the job's own drop (link_share_rise)."""
    from ncclwatch.detectors import watch
    from ncclwatch.ingest.recording import Options, ReadStats, read_recording
    from ncclwatch_testkit import demo

    from ncclwatch.config import load

    t0 = T0 * S
    demo.write_demo_spool(tmp_path, job="d", seconds=120, t0_ns=t0, straggler_s=(25, 45), network_s=(65, 100))
    events = watch.detect(load(None, environ={}), read_recording([tmp_path], ReadStats(), Options(job="d")))
    firing = [(e.type, s(e.detected_ns)) for e in events if e.state == "firing" and e.type != "telemetry_loss"]
    assert [t for t, _ in firing] == ["straggler", "network_path"], firing
    assert 65 <= firing[1][1] <= 70
