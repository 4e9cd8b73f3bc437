"""The contract every detector estimator and the Pipeline keep (river's check suite, ours).

For each estimator: its state survives JSON and gives identical future scores,
``score_one`` changes neither its input nor its state, its memory stays bounded over
100k updates, and what we inject as anomalous (a degraded value, a straggler rank)
scores above everything normal. For the Pipeline: the same records give the same
events, and a pipeline saved and restored anywhere mid-stream gives exactly the events
of the uninterrupted run.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from ncclwatch.detectors.baseline import DriftEvidence, EWMeanVar, RatioBaseline
from ncclwatch.detectors.pipeline import Pipeline, detect_all
from ncclwatch.detectors.straggler import StragglerScorer
from ncclwatch.detectors.sustained import SustainedRule
from ncclwatch_testkit import scenarios
from river import stats as river_stats

from ncclwatch.config import DetectorConfig
from ncclwatch.records import to_json


@dataclass
class Case:
    name: str
    make: Callable[[], Any]
    restore: Callable[[dict], Any]
    learn: Callable[[Any, Any], None]
    score: Callable[[Any, Any], float]
    normal: Callable[[random.Random], Any]
    anomalous: Callable[[random.Random], Any]


def _ranks(rng: random.Random, late: int | None = None, n: int = 8) -> dict[int, float]:
    # exec per rank: the late rank spends the least time in the kernel
    return {r: (0.7 if r == late else 1.0) * rng.lognormvariate(0, 0.03) for r in range(n)}


CASES = [
    Case(
        "RatioBaseline",
        make=lambda: RatioBaseline(warmup=10),
        restore=lambda s: RatioBaseline.from_state(s, warmup=10),
        learn=lambda e, x: e.learn_one(x),
        score=lambda e, x: e.score_one(x),
        normal=lambda rng: 100.0 * rng.lognormvariate(0, 0.02),
        anomalous=lambda rng: 70.0 * rng.lognormvariate(0, 0.02),
    ),
    Case(
        "SustainedRule",
        make=lambda: SustainedRule(),
        restore=lambda s: SustainedRule.from_state(s),
        learn=lambda e, x: e.update(x[0], x[1]),
        score=lambda e, x: e.score_one(x[0]),
        normal=lambda rng: (rng.uniform(-0.03, 0.03), rng.randrange(10**9)),
        anomalous=lambda rng: (rng.uniform(0.2, 0.4), rng.randrange(10**9)),
    ),
    Case(
        "SustainedRule(flapping)",
        make=lambda: SustainedRule(flap_count=2, flap_windows=6, flap_threshold=0.5),
        restore=lambda s: SustainedRule.from_state(s, flap_count=2, flap_windows=6, flap_threshold=0.5),
        learn=lambda e, x: e.update(x[0], x[1]),
        score=lambda e, x: e.score_one(x[0]),
        normal=lambda rng: (rng.uniform(-0.03, 0.03), rng.randrange(10**9)),
        anomalous=lambda rng: (rng.uniform(0.6, 0.9), rng.randrange(10**9)),
    ),
    Case(
        "StragglerScorer",
        make=lambda: StragglerScorer(),
        restore=lambda s: StragglerScorer.from_state(s),
        learn=lambda e, x: e.learn_one(x),
        score=lambda e, x: e.score_one(x),
        normal=lambda rng: _ranks(rng),
        anomalous=lambda rng: _ranks(rng, late=5),
    ),
    Case(
        "DriftEvidence",
        make=lambda: DriftEvidence(),
        restore=lambda s: DriftEvidence.from_state(s),
        learn=lambda e, x: e.update(x),
        score=lambda e, x: float(e.drift_detected),
        normal=lambda rng: rng.gauss(0, 0.01),
        anomalous=lambda rng: rng.gauss(-0.3, 0.01),
    ),
]
IDS = [c.name for c in CASES]


def _trained(case: Case, n: int, seed: int = 0) -> tuple[Any, random.Random]:
    rng = random.Random(seed)
    est = case.make()
    for i in range(n):
        # mostly normal, with anomalous stretches so every state path is exercised
        x = case.anomalous(rng) if (i // 50) % 7 == 3 else case.normal(rng)
        case.learn(est, x)
    return est, rng


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_state_round_trip_gives_identical_future_scores(case: Case):
    est, rng = _trained(case, 700)
    state = json.loads(json.dumps(est.to_state()))  # plain JSON types only
    twin = case.restore(state)
    assert twin.to_state() == est.to_state()
    for i in range(400):
        x = case.anomalous(rng) if i % 60 < 10 else case.normal(rng)
        assert case.score(twin, x) == case.score(est, x)
        case.learn(est, x)
        case.learn(twin, x)
    assert twin.to_state() == est.to_state()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_score_one_changes_neither_its_input_nor_its_state(case: Case):
    est, rng = _trained(case, 300)
    for x in (case.normal(rng), case.anomalous(rng)):
        before_x = copy.deepcopy(x)
        before = json.dumps(est.to_state())
        case.score(est, x)
        assert x == before_x
        assert json.dumps(est.to_state()) == before


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_memory_stays_bounded_over_100k_updates(case: Case):
    est, rng = _trained(case, 1_000)
    small = len(json.dumps(est.to_state()))
    for i in range(99_000):
        case.learn(est, case.anomalous(rng) if i % 1000 < 40 else case.normal(rng))
    assert len(json.dumps(est.to_state())) <= 1.5 * small + 200


def test_straggler_scorer_forgets_ranks_beyond_its_bound():
    rng = random.Random(2)
    s = StragglerScorer(max_ranks=64)
    for _ in range(5_000):
        s.learn_one({rng.randrange(10**6): rng.random() + 0.5 for _ in range(4)})
    assert len(s.rank_scores()) <= 64


def test_injected_degradation_scores_above_every_normal_value():
    est, rng = _trained(CASES[0], 500)
    normal = [est.score_one(CASES[0].normal(rng)) for _ in range(1000)]
    degraded = [est.score_one(CASES[0].anomalous(rng)) for _ in range(100)]
    assert min(degraded) > max(normal)
    assert min(degraded) > 0.2


@pytest.mark.parametrize("nranks", [2, 4, 16, 64])
def test_injected_straggler_ranks_highest(nranks: int):
    rng = random.Random(nranks)
    late = nranks - 1
    s = StragglerScorer()
    for _ in range(50):
        s.learn_one(_ranks(rng, n=nranks))
    for _ in range(10):
        s.learn_one(_ranks(rng, late=late, n=nranks))
    scores = s.rank_scores()
    assert max(scores, key=scores.__getitem__) == late
    assert s.straggler() == late
    normal = [s.score_one(_ranks(rng, n=nranks)) for _ in range(200)]
    assert s.score_one(_ranks(rng, late=late, n=nranks)) > max(normal)


def test_uniform_slowdown_has_no_straggler():
    rng = random.Random(5)
    s = StragglerScorer()
    for i in range(200):
        slow = 1.4 if i > 100 else 1.0  # every rank slower: a network problem, not a rank
        s.learn_one({r: v * slow for r, v in _ranks(rng).items()})
    assert s.straggler(effect=0.3) is None


def test_ew_statistics_match_rivers_ewmean_and_ewvar():
    rng = random.Random(11)
    ours = EWMeanVar(fading_factor=0.1)
    mean, var = river_stats.EWMean(fading_factor=0.1), river_stats.EWVar(fading_factor=0.1)
    for _ in range(1000):
        x = rng.gauss(5, 2)
        ours.update(x)
        mean.update(x)
        var.update(x)
        assert ours.mean == pytest.approx(mean.get(), rel=1e-9)
        assert ours.var == pytest.approx(var.get(), rel=1e-6, abs=1e-12)


def test_drift_evidence_is_rivers_page_hinkley_value_for_value():
    from river.drift import PageHinkley  # the import DriftEvidence avoids (SciPy, scikit-learn)

    rng = random.Random(5)
    for params in ({}, {"min_instances": 3, "threshold": 0.05, "delta": 0.0, "alpha": 0.9}):
        ours = DriftEvidence(**params)
        theirs = PageHinkley(**{"min_instances": 10, "threshold": 0.25, "delta": 0.005,
                                "alpha": 1 - 1e-3, **params}, mode="down")
        detections = 0
        for i in range(3000):
            # steps down and back up, so it detects, resets and detects again
            x = rng.gauss(0, 0.02) - (0.3 if (i // 150) % 3 == 2 else 0.0)
            ours.update(x)
            theirs.update(x)
            assert ours.drift_detected == theirs.drift_detected, i
            detections += ours.drift_detected
            state = ours.to_state()
            assert (state["n"], state["mean"]) == (theirs._x_mean.n, theirs._x_mean.get())
            assert (state["si"], state["sd"], state["md"]) == (
                theirs._sum_increase, theirs._sum_decrease, theirs._max_decrease)
            if i % 500 == 499:  # a saved state carries on the same
                ours = DriftEvidence.from_state(json.loads(json.dumps(state)), **params)
        assert detections >= 5


@pytest.mark.parametrize(
    "make",
    [
        lambda: RatioBaseline(warmup=0),
        lambda: RatioBaseline(fading_factor=0),
        lambda: RatioBaseline(protect=1.5),
        lambda: RatioBaseline(min_rel_sigma=0),
        lambda: RatioBaseline(clip_sigmas=0),
        lambda: SustainedRule(threshold=0),
        lambda: SustainedRule(recover_threshold=0.2, threshold=0.1),
        lambda: SustainedRule(sustain=0),
        lambda: SustainedRule(flap_count=3, flap_windows=2),
        lambda: SustainedRule(flap_count=2, flap_windows=6, flap_threshold=0.05),
        lambda: StragglerScorer(threshold=1.0),
        lambda: StragglerScorer(sustain=0),
        lambda: StragglerScorer(max_ranks=1),
        lambda: EWMeanVar(fading_factor=2),
    ],
)
def test_bad_parameters_raise_value_error(make):
    with pytest.raises(ValueError):
        make()


def test_estimators_keep_constructor_arguments_as_public_attributes():
    b = RatioBaseline(warmup=7, fading_factor=0.05, clip_sigmas=2.0, protect=0.2,
                      min_rel_sigma=0.02)
    assert b._get_params() == {"warmup": 7, "fading_factor": 0.05, "clip_sigmas": 2.0,
                               "protect": 0.2, "min_rel_sigma": 0.02}
    fresh = b.clone()
    b.learn_one(5.0)
    assert fresh.to_state()["warm"] == [] and b.to_state()["warm"] != []


# --- the Pipeline ------------------------------------------------------------------------

STREAMS = ["multi_fault_2x8", "telemetry_silence_2x2", "throughput_dip_2x2",
           "telemetry_drops_2x2", "network_ramp_2x2", "network_pulse_2x2"]


@pytest.fixture(scope="module")
def streams() -> dict[str, list]:
    return {name: scenarios.generate(scenarios.by_name(name))[0] for name in STREAMS}


def _lines(events) -> list[str]:
    return [to_json(e) for e in events]


def test_pipeline_gives_the_same_events_and_ids_for_the_same_records(streams):
    cfg = DetectorConfig()
    for records in streams.values():
        first = _lines(detect_all(records, cfg))
        assert first, "every stream here has anomalies"
        assert _lines(detect_all(records, cfg)) == first


@pytest.mark.parametrize("name", STREAMS)
def test_pipeline_restored_mid_stream_emits_exactly_the_uninterrupted_events(streams, name):
    cfg = DetectorConfig()
    records = streams[name]
    whole = _lines(detect_all(records, cfg))
    n = len(records)
    for cut in (1, n // 7, n // 3, n // 2 + 13, (4 * n) // 5, n - 1):
        p = Pipeline(cfg)
        got = []
        for rec in records[:cut]:
            got += p.process(rec)
        state = json.loads(json.dumps(p.to_state()))
        q = Pipeline.from_state(cfg, state)
        assert q.to_state() == state
        for rec in records[cut:]:
            got += q.process(rec)
        got += q.flush()
        assert _lines(got) == whole, f"cut at record {cut} of {n}"


def test_pipeline_state_is_plain_json_and_restores_without_rewarming(streams):
    cfg = DetectorConfig()
    p = Pipeline(cfg)
    for rec in streams["multi_fault_2x8"][:8000]:
        p.process(rec)
    text = json.dumps(p.to_state(), allow_nan=False)
    q = Pipeline.from_state(cfg, json.loads(text))
    job = q._jobs[q.jobs()[0]]
    assert all(ks.baseline.warm for ks in job.stage.values())


def _record_time(r) -> int:
    return r.end_ns if r.KIND == "window" else r.ts_ns


def _summary(events) -> list[tuple]:
    return [(e.id, e.type, e.state, e.start_ns, e.end_ns, e.attribution, e.severity, e.rank,
             e.host) for e in events]


@pytest.mark.parametrize("name", ["multi_fault_2x8", "throughput_with_comm_2x8",
                                  "network_late_forwarder_2x2", "throughput_dip_2x2",
                                  "telemetry_silence_2x2"])
def test_publication_order_time_order_and_time_sorted_batches_give_the_same_anomalies(name):
    """watch reads records in time order, the worker in Kafka batches sorted by time,
    the forwarders publish windows a second or two after throughput: same anomalies."""
    records, _ = scenarios.generate(scenarios.by_name(name))
    cfg = DetectorConfig()
    published = _summary(detect_all(records, cfg))
    by_time = _summary(detect_all(sorted(records, key=_record_time), cfg))
    batches = []
    for i in range(0, len(records), 700):
        batches += sorted(records[i:i + 700], key=_record_time)
    batched = _summary(detect_all(batches, cfg))
    assert published and sorted(by_time) == sorted(published) == sorted(batched)
