"""DetectorMetrics: the names others depend on, bounded cardinality, series lifecycles."""

from __future__ import annotations

import dataclasses

from ncclwatch.detectors.metrics import DetectorMetrics
from ncclwatch.detectors.pipeline import Pipeline
from ncclwatch_testkit import scenarios
from prometheus_client import CollectorRegistry, generate_latest

from ncclwatch.config import DetectorConfig
from ncclwatch.records import AnomalyEvent, WindowSummary

S = 10**9
NAMES = [
    "ncclwatch_busbw_observed_bytes_per_second",
    "ncclwatch_busbw_baseline_bytes_per_second",
    "ncclwatch_degradation_ratio",
    "ncclwatch_exec_seconds",
    "ncclwatch_anomaly_active",
    "ncclwatch_anomalies_total",
    "ncclwatch_job_flops_per_second_per_gpu",
    "ncclwatch_rank_relative_exec_ratio",
    "ncclwatch_detector_records_total",
    "ncclwatch_detector_lag_seconds",
    "ncclwatch_detector_keys",
]


def run(name: str, registry: CollectorRegistry, stop_s: float | None = None, **kw):
    records, _ = scenarios.generate(scenarios.by_name(name))
    p = Pipeline(DetectorConfig())
    m = DetectorMetrics(registry, **kw).bind(p)
    events = []
    for rec in records:
        if stop_s is not None and rec.KIND == "window" and (
                rec.end_ns - scenarios.STREAM_START_NS) / S > stop_s:
            break
        events += p.process(rec)
    return p, m, events


def sample(reg, name, **labels):
    return reg.get_sample_value(name, labels)


def test_every_documented_metric_is_exported_with_its_labels():
    reg = CollectorRegistry()
    p, m, events = run("throughput_with_comm_2x8", reg, stop_s=70)  # mid-anomaly
    text = generate_latest(reg).decode()
    for name in NAMES:
        assert f"# TYPE {name} " in text, name
    job = "sim-throughput_with_comm_2x8"
    comm_info = scenarios.communicators(scenarios.by_name("throughput_with_comm_2x8"))[0]
    comm, comm_name = comm_info.hash, comm_info.name
    key = dict(training_job=job, comm=comm, comm_name=comm_name, op="AllReduce", size_bucket="64MiB", transport="mixed")
    observed = sample(reg, "ncclwatch_busbw_observed_bytes_per_second", **key)
    baseline = sample(reg, "ncclwatch_busbw_baseline_bytes_per_second", **key)
    ratio = sample(reg, "ncclwatch_degradation_ratio", **key)
    assert 0.3 < ratio < 0.5 and abs(ratio - (1 - observed / baseline)) < 1e-9
    # base units: bytes per second, the records' GB/s times 1e9
    assert 1e9 < observed < 1e12  # a 64 MiB AllReduce moves GB/s: base units, not GB/s
    (ev,) = events
    assert sample(reg, "ncclwatch_anomaly_active", training_job=job, anomaly_type="network_path",
                  comm=comm, comm_name=comm_name, op="AllReduce", size_bucket="64MiB",
                  transport="mixed", rank="", severity=ev.severity, node="",
                  Hostname="", UUID="") == 1.0  # a network path spans nodes
    assert sample(reg, "ncclwatch_anomalies_total", training_job=job, anomaly_type="network_path",
                  severity=ev.severity) == 1.0
    assert sample(reg, "ncclwatch_job_flops_per_second_per_gpu", training_job=job) > 200e12
    assert sample(reg, "ncclwatch_exec_seconds_count", training_job=job, op="AllReduce",
                  transport="mixed") > 0
    # node and Hostname: the rank's host, under Inspector's and DCGM's names (2 x 8 GPUs)
    host = scenarios.host_name(1)
    assert 0.5 < sample(reg, "ncclwatch_rank_relative_exec_ratio", training_job=job, comm=comm,
                        comm_name=comm_name, rank="11", node=host, Hostname=host, UUID="") < 1.5
    assert sample(reg, "ncclwatch_detector_records_total", kind="window") > 1000
    assert sample(reg, "ncclwatch_detector_keys") == p.key_count() == 14
    assert sample(reg, "ncclwatch_detector_lag_seconds") > 0  # replayed past data lags


def test_anomaly_series_are_removed_when_the_anomaly_resolves():
    reg = CollectorRegistry()
    _, _, events = run("network_step30_2x2", reg)
    assert [e.state for e in events] == ["firing", "resolved"]
    assert "ncclwatch_anomaly_active{" not in generate_latest(reg).decode()
    assert sample(reg, "ncclwatch_anomalies_total", training_job="sim-network_step30_2x2",
                  anomaly_type="network_path", severity="critical") == 1.0


def test_key_series_are_bounded_by_max_keys_evicting_the_least_recently_updated():
    reg = CollectorRegistry()
    p, m, _ = run("steady_2x8", reg, stop_s=20, max_keys=5)
    assert p.key_count() == 14 and m.key_series == 5
    text = generate_latest(reg).decode()
    assert text.count("ncclwatch_busbw_observed_bytes_per_second{") == 5
    assert text.count("ncclwatch_degradation_ratio{") == 5
    assert text.count("ncclwatch_rank_relative_exec_ratio{") == 5


def test_registry_is_private_unless_given():
    a, b = DetectorMetrics(), DetectorMetrics()
    a.record("window")
    assert a.registry is not b.registry
    assert b.registry.get_sample_value("ncclwatch_detector_records_total",
                                       {"kind": "window"}) is None


def test_a_forgotten_job_loses_its_series():
    reg = CollectorRegistry()
    p, m, _ = run("network_step30_2x2", reg, stop_s=70)
    assert "sim-network_step30_2x2" in generate_latest(reg).decode()
    p.advance(p.last_end_ns + int(p.cfg.job_evict_s + 100) * S)
    text = generate_latest(reg).decode()
    assert "sim-network_step30_2x2" not in text
    assert m.key_series == 0


def test_observe_binds_on_first_use_and_counts_each_record_and_anomaly_once():
    reg = CollectorRegistry()
    m = DetectorMetrics(reg)
    records, _ = scenarios.generate(scenarios.by_name("network_step30_2x2"))
    p = Pipeline(DetectorConfig())
    for rec in records:
        events = p.process(rec)
        m.observe(rec, p, events)
        m.worker_batch(type("Out", (), {"events": events})(), lag_s=1.5)
    windows = sum(1 for r in records if r.KIND == "window")
    assert sample(reg, "ncclwatch_detector_records_total", kind="window") == windows
    assert sample(reg, "ncclwatch_anomalies_total", training_job="sim-network_step30_2x2",
                  anomaly_type="network_path", severity="critical") == 1.0
    assert sample(reg, "ncclwatch_detector_lag_seconds") == 1.5


def test_two_open_anomalies_sharing_a_series_keep_it_until_both_resolve():
    m = DetectorMetrics()
    from ncclwatch.records import AnomalyEvent

    def ev(i, state):
        return AnomalyEvent(id=f"{i:016x}", type="telemetry_loss", state=state, job="j",
                            key={"comm": None, "comm_name": None, "op": None,
                                 "size_bucket": None, "transport": None},
                            host=f"h{i}", rank=None, start_ns=0,
                            end_ns=None if state == "firing" else 1, detected_ns=1,
                            baseline_busbw_gbs=None, observed_busbw_gbs=None, effect=0.0,
                            attribution="telemetry", throughput_delta=None, severity="warning",
                            evidence={})

    labels = dict(training_job="j", anomaly_type="telemetry_loss", comm="", comm_name="", op="",
                  size_bucket="", transport="", rank="", severity="warning", UUID="")
    # Each names its node: two series, each removed with its own anomaly.
    m.event(ev(1, "firing"))
    m.event(ev(2, "firing"))
    m.event(ev(1, "resolved"))
    assert m.registry.get_sample_value("ncclwatch_anomaly_active", {**labels, "node": "h1", "Hostname": "h1"}) is None
    assert m.registry.get_sample_value("ncclwatch_anomaly_active", {**labels, "node": "h2", "Hostname": "h2"}) == 1.0
    m.event(ev(2, "resolved"))
    assert m.registry.get_sample_value("ncclwatch_anomaly_active", {**labels, "node": "h2", "Hostname": "h2"}) is None
    # Two anomalies on one series (same node): it stays until the last one resolves.
    m.event(ev(3, "firing"))
    m.event(dataclasses.replace(ev(4, "firing"), host="h3"))
    m.event(ev(3, "resolved"))
    assert m.registry.get_sample_value("ncclwatch_anomaly_active", {**labels, "node": "h3", "Hostname": "h3"}) == 1.0
    m.event(dataclasses.replace(ev(4, "resolved"), host="h3"))
    assert m.registry.get_sample_value("ncclwatch_anomaly_active", {**labels, "node": "h3", "Hostname": "h3"}) is None


def test_window_with_unusual_label_values_is_exported_escaped():
    reg = CollectorRegistry()
    p = Pipeline(DetectorConfig(warmup_windows=2))
    DetectorMetrics(reg).bind(p)
    for t in range(5):
        for r in (0, 1):
            p.process(WindowSummary(
                job='a"b\\c\nd', host="h", comm="0x0000000000000001", comm_name="", op="Send",
                size_bucket="1KiB", transport="net", rank=r, nranks=2, start_ns=t * S,
                end_ns=(t + 1) * S, count=1, bytes=1024, exec_ns_min=1, exec_ns_p50=1000,
                exec_ns_p95=1, exec_ns_max=1, busbw_gbs_p50=1.0, first_seq=t, last_seq=t))
    text = generate_latest(reg).decode()
    assert 'training_job="a\\"b\\\\c\\nd"' in text


def test_the_active_series_carries_the_detector_s_severity_and_moves_when_it_rises():
    """Prometheus rules take the alert's severity from this label: they page exactly when
    the alert sink does."""
    m = DetectorMetrics()
    base = dict(id="a" * 16, type="network_path", job="j", key={"comm": "0x1", "op": "AllReduce",
                "size_bucket": "64MiB", "transport": "net"}, host=None, rank=None, start_ns=1,
                end_ns=None, detected_ns=2, baseline_busbw_gbs=None, observed_busbw_gbs=None,
                effect=0.3, attribution="network", throughput_delta=None, evidence={})
    labels = dict(training_job="j", anomaly_type="network_path", comm="0x1", comm_name="",
                  op="AllReduce", size_bucket="64MiB", transport="net", rank="", node="",
                  Hostname="", UUID="")
    m.event(AnomalyEvent(state="firing", severity="warning", **base))
    assert m.registry.get_sample_value("ncclwatch_anomaly_active",
                                       {**labels, "severity": "warning"}) == 1.0
    m.event(AnomalyEvent(state="firing", severity="critical", **base))
    assert m.registry.get_sample_value("ncclwatch_anomaly_active",
                                       {**labels, "severity": "warning"}) is None
    assert m.registry.get_sample_value("ncclwatch_anomaly_active",
                                       {**labels, "severity": "critical"}) == 1.0


def test_a_rank_s_gpu_from_its_windows_labels_its_series_and_the_straggler_it_is():
    """Windows that carry the plugin's GPU UUID put it on the rank series and on the
    straggler anomaly, under DCGM exporter's label name ``UUID``."""
    records, _ = scenarios.generate(scenarios.by_name("straggler_2x2"))
    reg = CollectorRegistry()
    p = Pipeline(DetectorConfig())
    DetectorMetrics(reg).bind(p)
    events = []
    for rec in records:
        if rec.KIND == "window":
            rec = dataclasses.replace(rec, gpu=f"GPU-{rec.host}-{rec.rank}")
        events += p.process(rec)
        if any(e.type == "straggler" for e in events):
            break
    (ev,) = [e for e in events if e.type == "straggler"]
    gpu = f"GPU-{ev.host}-{ev.rank}"
    assert ev.evidence["gpu"] == gpu
    text = generate_latest(reg).decode()
    active = [line for line in text.splitlines() if line.startswith("ncclwatch_anomaly_active{")]
    assert any(f'UUID="{gpu}"' in line and 'anomaly_type="straggler"' in line for line in active), active
    ranks = [line for line in text.splitlines() if line.startswith("ncclwatch_rank_relative_exec_ratio{")]
    assert ranks and all('UUID="GPU-' in line for line in ranks)
