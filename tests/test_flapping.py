"""The flapping rule: a network key dropping out a window at a time fires, a spike does not.

A link that loses most of its bandwidth for a second or two, again and again, never
holds `sustain_windows` degraded windows in a row, yet costs the job as much as a
sustained fault (recorded: `p4-pulse-2-2-tc-10g-ac`, 2-s throttles every 4 s, 73 % of
the job's throughput over the pulses, raised only as a `throughput_drop` 15.6 s in
before this rule).
"""

from __future__ import annotations

import pytest
from ncclwatch.detectors.keys import KeyParams
from ncclwatch.detectors.pipeline import detect_all
from ncclwatch.detectors.sustained import FIRE, RESOLVE, SustainedRule
from ncclwatch_testkit import scenarios

from ncclwatch import config
from ncclwatch.config import DetectorConfig
from ncclwatch.records import ThroughputRecord

FLAP = {"threshold": 0.1, "sustain": 3, "recover_threshold": 0.05, "recover": 3,
        "flap_count": 2, "flap_windows": 6, "flap_threshold": 0.5}


def _run(rule: SustainedRule, effects: list[float]) -> list[tuple[int, str]]:
    out = []
    for i, e in enumerate(effects):
        t = rule.update(e, start_ns=i)
        if t:
            out.append((i, t))
    return out


def test_drop_outs_fire_on_the_second_and_their_gaps_do_not_resolve():
    rule = SustainedRule(**FLAP)
    pulses = ([0.0] * 3 + [0.8]) * 6  # one severe window in four
    got = _run(rule, [0.0] * 4 + pulses + [0.0] * 8)
    assert got == [(11, FIRE), (33, RESOLVE)]
    assert rule.start_ns == 7  # the first severe window
    assert rule.end_ns == 28  # the first of the six healthy windows after the last pulse


def test_a_two_window_spike_and_drop_outs_further_apart_than_the_windows_do_not_fire():
    rule = SustainedRule(**FLAP)
    assert _run(rule, [0.0, 0.9, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]) == []
    rule = SustainedRule(**FLAP)
    assert _run(rule, ([0.9] + [0.0] * 5) * 5) == []


def test_windows_under_the_flap_threshold_or_not_degraded_do_not_count():
    rule = SustainedRule(**FLAP)
    assert _run(rule, [0.4, 0.0, 0.4, 0.0, 0.4, 0.0]) == []
    rule = SustainedRule(**FLAP)  # a large loss within the baseline's noise is no degraded window
    for i in range(0, 16, 2):
        assert rule.update(0.9, i, degraded=False) is None
        assert rule.update(0.0, i + 1) is None


def test_a_sustained_streak_still_fires_and_resolves_as_before():
    rule = SustainedRule(**FLAP)
    assert _run(rule, [0.0, 0.3, 0.3, 0.3, 0.0, 0.0, 0.0]) == [(3, FIRE), (6, RESOLVE)]
    assert not rule.flapping


def test_state_round_trip_mid_pattern_and_from_a_state_saved_before_the_rule():
    rule = SustainedRule(**FLAP)
    _run(rule, [0.0, 0.8, 0.0, 0.0])
    copy = SustainedRule.from_state(rule.to_state(), **FLAP)
    assert copy.update(0.8, 4) == rule.update(0.8, 4) == FIRE
    assert copy.to_state() == rule.to_state() and copy.flapping
    old = {"firing": False, "streak": 0, "streak_start": None, "start": None, "end": None}
    legacy = SustainedRule.from_state(old, **FLAP)
    assert _run(legacy, [0.8, 0.0, 0.8]) == [(2, FIRE)]


@pytest.mark.parametrize("params", [
    {"flap_count": 1, "flap_windows": 6},
    {"flap_count": 7, "flap_windows": 6},
    {"flap_count": 2, "flap_windows": 6, "flap_threshold": 0.05},
    {"flap_count": 2, "flap_windows": 6, "flap_threshold": 1.0},
])
def test_bad_flap_parameters_are_refused(params):
    with pytest.raises(ValueError, match="flap_"):
        SustainedRule(threshold=0.1, **params)
    with pytest.raises(ValueError, match="detector.flap_"):
        DetectorConfig(**params)


def test_the_config_can_turn_it_off_and_an_env_value_reaches_it():
    assert DetectorConfig(flap_count=0).flap_count == 0
    cfg = config.load(None, environ={"NCCLWATCH_DETECTOR_FLAP_THRESHOLD": "0.6"})
    assert KeyParams(cfg.detector).rule_of("net")["flap_threshold"] == 0.6


def test_only_keys_that_cross_the_network_flap():
    p = KeyParams(DetectorConfig())
    assert p.rule_of("net")["flap_count"] == p.rule_of("mixed")["flap_count"] == 2
    assert "flap_count" not in p.rule_of("nvlink") and "flap_count" not in p.rule_of("single")


def _firing(events, kind=None):
    return [e for e in events if e.state == "firing" and (kind is None or e.type == kind)]


def test_a_pulsed_network_fault_is_raised_as_one_network_incident():
    sc = scenarios.by_name("network_pulse_2x2")
    records, labels = scenarios.generate(sc)
    events = detect_all(records, DetectorConfig())
    firing = _firing(events)
    assert [e.type for e in firing] == ["network_path"], [(e.type, e.state) for e in events]
    label = labels.labels[0]
    assert 0 <= (firing[0].detected_ns - label.start_ns) / 1e9 <= 6.0
    assert firing[0].severity == "critical"


def test_the_same_pulses_with_the_rule_off_are_no_network_incident():
    """What the rule adds: the scenario above is its evidence, not a fault found anyway."""
    sc = scenarios.by_name("network_pulse_2x2")
    records, _ = scenarios.generate(sc)
    cfg = DetectorConfig(flap_count=0)
    assert _firing(detect_all(records, cfg), "network_path") == []


def test_the_event_says_the_link_flaps_and_a_sustained_one_does_not():
    def network_events(name):
        records, _ = scenarios.generate(scenarios.by_name(name))
        return _firing(detect_all(records, DetectorConfig()), "network_path")

    assert network_events("network_pulse_2x2")[0].evidence.get("flapping") is True
    assert "flapping" not in network_events("network_step30_2x2")[0].evidence


def test_a_verdict_of_an_older_build_without_the_flag_decodes():
    import json

    from ncclwatch.detectors.keys import FireEvidence, Streak, decode_verdict, encode_verdict

    rule = SustainedRule(**FLAP)
    _run(rule, [0.8, 0.0, 0.8])
    sample = _verdict_with(FireEvidence(Streak(), 0.8, None, [], rule.flapping))
    line = json.loads(encode_verdict(sample, version=2))
    assert line[1]["fired"]["flapping"] is True
    del line[1]["fired"]["flapping"]
    assert decode_verdict(json.dumps(line).encode()).fired.flapping is False


def _verdict_with(fired):
    from ncclwatch.detectors.keys import KeyVerdict

    return KeyVerdict(
        job="j", key=("0x1", "AllReduce", "64MiB", "net"), comm_name="", window_ns=10**9,
        ranks=[(0, "h0"), (1, "h1")], start_ns=0, end_ns=10**9, observed=40.0, baseline=50.0,
        effect=0.8, degraded=True, drift=False, was_firing=False, transition=FIRE,
        spread_transition=None, spread_effect=0.0, exec_ns_p50=10**6, host=None, warm=True,
        baseline_after=50.0, closed_before=1, rule=(True, 0, 0, None),
        spread_rule=(False, 0, None, None), fired=fired)


@pytest.mark.parametrize("params", [
    {"throughput_flap_count": 1},
    {"throughput_flap_count": 7, "flap_windows": 6},
    {"throughput_flap_threshold": 0.01},
    {"throughput_flap_threshold": 1.0},
])
def test_bad_throughput_flap_parameters_are_refused(params):
    with pytest.raises(ValueError, match="detector.throughput_flap_"):
        DetectorConfig(**params)


def test_the_jobs_throughput_flaps_too_and_its_drop_says_so():
    """A job 30 % slower every other second (a GPU taken 1 s in 2): never three slow
    windows in a row, raised as its own drop on the second slow window, marked flapping;
    with the job's flapping rule off, nothing."""
    def events(cfg: DetectorConfig) -> list:
        steps = []
        for i in range(400):  # 10 steps a second; from 30 s every other second 30 % slower
            t = i * 10**8
            slow = t >= 30 * 10**9 and (t // 10**9) % 2 == 0
            steps.append(ThroughputRecord(job="j", host="h", rank=-1, ts_ns=t, step=i,
                                          tflops_per_gpu=210.0 if slow else 300.0,
                                          tokens_per_s=None, source="api"))
        return detect_all(steps, cfg)

    (ev, *rest) = events(DetectorConfig())
    assert ev.type == "throughput_drop" and ev.state == "firing" and ev.evidence["flapping"] is True
    assert 31 * 10**9 <= ev.detected_ns <= 33 * 10**9, ev.detected_ns
    assert events(DetectorConfig(throughput_flap_count=0)) == []
