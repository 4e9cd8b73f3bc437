"""Prometheus metrics of a running Pipeline.

:class:`DetectorMetrics` is the pipeline's observer: bound with :meth:`bind`, it is
called back as records flow and keeps these metrics (alert rules and dashboards
depend on the names):

============================================  =========  ===========================================
name                                          type       labels
============================================  =========  ===========================================
ncclwatch_busbw_observed_bytes_per_second     gauge      training_job, comm, comm_name, op, size_bucket, transport
ncclwatch_busbw_baseline_bytes_per_second     gauge      (same)
ncclwatch_degradation_ratio                   gauge      (same) (effect: 1 - observed/baseline)
ncclwatch_exec_seconds                        histogram  training_job, op, transport (window median exec)
ncclwatch_anomaly_active                      gauge      training_job, anomaly_type, comm, comm_name, op, size_bucket,
                                                         transport, rank, severity, node, Hostname, UUID
ncclwatch_anomalies_total                     counter    training_job, anomaly_type, severity
ncclwatch_job_flops_per_second_per_gpu        gauge      training_job
ncclwatch_rank_relative_exec_ratio            gauge      training_job, comm, comm_name, rank, node, Hostname, UUID
ncclwatch_comm_waiting_seconds                gauge      training_job, comm, comm_name (only while a rank waits)
ncclwatch_detector_records_total              counter    kind
ncclwatch_detector_lag_seconds                gauge      (wall clock - newest record time)
ncclwatch_detector_input_live                 gauge      (1 live input, 0 a replay: lag is its age)
ncclwatch_detector_keys                       gauge      (keys tracked)
ncclwatch_build_info                          gauge      version, contract, component, python (always 1)
process_*, python_info                        (prometheus_client's process and platform collectors)
============================================  =========  ===========================================

Names are in base units (bytes per second, seconds, FLOP/s, ratios); ``docs/metrics.md``
maps them to NCCL Inspector's (``nccl_bus_bandwidth_gbs`` is GB/s, so
``ncclwatch_busbw_observed_bytes_per_second / 1e9`` compares with it). The training job
is ``training_job``, never ``job``: Prometheus owns ``job`` (the scrape job), and a
target's ``job`` label would be renamed ``exported_job`` unless scraped with
``honor_labels``.

Cardinality is bounded: at most ``max_keys`` key series (the five-label busbw
family) and ``max_keys`` rank series are kept; the least recently updated is evicted
and its series removed. ``ncclwatch_anomaly_active`` series exist only while their
anomaly fires (removed on resolve). A job the pipeline forgets loses all its series.
Labels that an anomaly spans (``null`` in the event) are exported as ``""``. ``node`` and
``Hostname`` are both the host name the plugin saw (``gethostname``): Inspector calls it
``node`` and DCGM exporter ``Hostname``, so a rank's or an anomaly's series joins either
one's with ``on (node)`` or ``on (Hostname)``, no ``label_replace``. ``UUID`` is the
rank's GPU (``GPU-<uuid>``, DCGM exporter's ``UUID``) where the windows carry it, else
``""``; on an anomaly, the straggler's GPU. ``comm_name`` is Inspector's label for the
communicator's name (``""`` when NCCL has none).
``ncclwatch_anomalies_total`` counts an anomaly once, at its first firing event, with
that event's severity. ``ncclwatch_comm_waiting_seconds`` is the longest a rank of the
communicator has had an operation in flight without completing it, from the plugin's
``progress`` records (written only while that lasts a second or more); its series exists
while the communicator waits and is removed once operations complete again.

>>> from prometheus_client import CollectorRegistry
>>> reg = CollectorRegistry()
>>> m = DetectorMetrics(reg, max_keys=10)
>>> m.record("window")
>>> reg.get_sample_value("ncclwatch_detector_records_total", {"kind": "window"})
1.0
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ncclwatch import build_info
from ncclwatch.records import AnomalyEvent

COUNTED_IDS = 100_000  # anomaly ids remembered so each is counted once
KEY_LABELS = ("training_job", "comm", "comm_name", "op", "size_bucket", "transport")
# severity: the detector's, so Prometheus rules page exactly when the alert sink does
ANOMALY_LABELS = ("training_job", "anomaly_type", "comm", "comm_name", "op", "size_bucket",
                  "transport", "rank", "severity", "node", "Hostname", "UUID")
RANK_LABELS = ("training_job", "comm", "comm_name", "rank", "node", "Hostname", "UUID")
GBS = 1e9  # the records' GB/s (NCCL's and Inspector's unit) in bytes per second
# 10 us .. ~100 s, factor ~3: NCCL ops span small-message latency to huge transfers.
EXEC_BUCKETS = (
    1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0,
)


class DetectorMetrics:
    """Updates prometheus_client metrics from a :class:`~.pipeline.Pipeline`.

    Parameters
    ----------
    registry
        Where the metrics live; a fresh private ``CollectorRegistry`` by default (never
        the global one, so two pipelines or tests never collide).
    max_keys
        Bound on key series and on rank series (``config.detector.max_metric_keys``).
    clock
        Wall clock (seconds) for the lag gauge.
    live
        Whether the input is live (a running job) or a replay of a recording, whose lag
        is the recording's age rather than lateness; alert rules on lag look at it.
    component
        The ``component`` label of ``ncclwatch_build_info`` (``watch``, ``worker``, ...).
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        max_keys: int = 2000,
        clock: Callable[[], float] = time.time,
        live: bool = True,
        component: str = "detectors",
    ):
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys!r}")
        self.registry = registry if registry is not None else CollectorRegistry()
        build_info.register(self.registry, component)
        self.max_keys = max_keys
        self.clock = clock
        r = self.registry
        self.busbw_observed = Gauge(
            "ncclwatch_busbw_observed_bytes_per_second",
            "Bus bandwidth of the key's latest window (median over ranks of busbw p50), bytes/s",
            KEY_LABELS, registry=r)
        self.busbw_baseline = Gauge(
            "ncclwatch_busbw_baseline_bytes_per_second",
            "The key's learned (or cold-start) baseline bus bandwidth, bytes/s",
            KEY_LABELS, registry=r)
        self.degradation = Gauge(
            "ncclwatch_degradation_ratio",
            "Relative loss of the key's latest window, 1 - observed/baseline",
            KEY_LABELS, registry=r)
        self.exec_seconds = Histogram(
            "ncclwatch_exec_seconds",
            "Median over ranks of the window's median op execution time, seconds",
            ("training_job", "op", "transport"), buckets=EXEC_BUCKETS, registry=r)
        self.anomaly_active = Gauge(
            "ncclwatch_anomaly_active",
            "1 while an anomaly fires (series removed when it resolves)",
            ANOMALY_LABELS, registry=r)
        self.anomalies_total = Counter(
            "ncclwatch_anomalies_total",
            "Anomalies that fired, by their severity at first firing",
            ("training_job", "anomaly_type", "severity"), registry=r)
        self.job_tflops = Gauge(
            "ncclwatch_job_flops_per_second_per_gpu",
            "The training job's FLOP/s per GPU over its latest completed step",
            ("training_job",), registry=r)
        self.rank_relative = Gauge(
            "ncclwatch_rank_relative_exec_ratio",
            "A rank's EW exec time over the median of the other ranks' (straggler when low)",
            RANK_LABELS, registry=r)
        self.comm_waiting_seconds = Gauge(
            "ncclwatch_comm_waiting_seconds",
            "Longest a rank of the communicator has waited in one operation that has not "
            "completed, seconds (from the plugin's progress records; only while it waits)",
            ("training_job", "comm", "comm_name"), registry=r)
        self.job_checkpoint_saving = Gauge(
            "ncclwatch_job_checkpoint_saving",
            "1 while the job saves a checkpoint (its training log's save lines), else 0: what "
            "begins then is not raised",
            ("training_job",), registry=r)
        self.records_total = Counter(
            "ncclwatch_detector_records_total",
            "Records the detector processed, by kind",
            ("kind",), registry=r)
        self.lag_seconds = Gauge(
            "ncclwatch_detector_lag_seconds",
            "Wall clock minus the newest record time the detector has seen, seconds",
            registry=r)
        self.keys = Gauge(
            "ncclwatch_detector_keys", "Keys the detector tracks", registry=r)
        self.input_live = Gauge(
            "ncclwatch_detector_input_live",
            "1 while the detector reads live input, 0 while it replays a recording",
            registry=r)
        self.input_live.set(1 if live else 0)
        self._pipelines: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lag_override: float | None = None
        self._key_lru: OrderedDict[tuple[str, ...], tuple[Any, Any, Any]] = OrderedDict()
        self._rank_lru: OrderedDict[tuple[str, ...], Any] = OrderedDict()
        self._rank_updated: dict[tuple[str, str], int] = {}
        self._exec_children: dict[tuple[str, str, str], Any] = {}
        self._record_children: dict[str, Any] = {}
        self._active: dict[str, tuple[str, ...]] = {}  # anomaly id -> its series labels
        self._series_users: dict[tuple[str, ...], int] = {}  # series -> open anomalies on it
        self._counted: OrderedDict[str, None] = OrderedDict()  # ids counted (bounded)
        self._waiting: dict[str, dict[str, tuple[str, ...]]] = {}  # job -> comm -> its series
        self.lag_seconds.set_function(self._lag)
        self.keys.set_function(lambda: sum(p.key_count() for p in list(self._pipelines)))

    def bind(self, pipeline: Any) -> DetectorMetrics:
        """Observe ``pipeline``: its callbacks keep every metric current.

        Several pipelines (one per job, as the drivers keep them) may be bound; bind a
        pipeline restored from state again. Pipelines are held weakly, so one a driver
        replaces stops counting towards ``ncclwatch_detector_keys``.
        """
        pipeline.observer = self
        self._pipelines.add(pipeline)
        for ev in pipeline.open_anomalies():
            self._fire(ev, count=False)
        return self

    def observe(self, record: Any, pipeline: Any, events: list[AnomalyEvent]) -> None:
        """For drivers that call after ``pipeline.process(record)`` returned ``events``.

        The first call for a pipeline binds to it (later records flow through the
        callbacks) and accounts this record and its events, which the pipeline
        processed before it had an observer; later calls do nothing more.
        """
        if pipeline.observer is self:
            return
        self.bind(pipeline)
        self.record(record.KIND)
        if record.KIND == "throughput" and record.rank == -1:
            self.throughput(record.job, record.tflops_per_gpu)
        for ev in events:
            self.event(ev)

    def worker_batch(self, out: Any, *, lag_s: float | None = None,
                     consumer_lag: Any = None, stats: Any = None) -> None:
        """For a worker that processes batches: account the batch's events and the lag.

        Events are counted once per anomaly id even if a bound pipeline already
        reported them; ``lag_s`` (wall clock minus the batch's newest record time)
        replaces the computed lag. ``consumer_lag`` and ``stats`` are the worker's own.
        """
        for ev in getattr(out, "events", ()):
            self.event(ev)
        if lag_s is not None:
            self._lag_override = lag_s

    def _lag(self) -> float:
        if self._lag_override is not None:
            return self._lag_override
        ends = [p.last_end_ns for p in list(self._pipelines) if p.last_end_ns >= 0]
        if not ends:
            return 0.0
        return self.clock() - max(ends) / 1e9

    # --- observer callbacks -------------------------------------------------------

    def record(self, kind: str) -> None:
        child = self._record_children.get(kind)
        if child is None:
            child = self._record_children[kind] = self.records_total.labels(kind)
        child.inc()

    def key_window(self, job: str, ks: Any, observed: float, baseline: float | None,
                   effect: float, exec_ns: int, end_ns: int) -> None:
        labels = (job, ks.comm, ks.comm_name, ks.op, ks.size_bucket, ks.transport)
        lru = self._key_lru
        children = lru.get(labels)
        if children is None:
            children = lru[labels] = (
                self.busbw_observed.labels(*labels),
                self.busbw_baseline.labels(*labels),
                self.degradation.labels(*labels),
            )
            if len(lru) > self.max_keys:
                old, _ = lru.popitem(last=False)
                for g in (self.busbw_observed, self.busbw_baseline, self.degradation):
                    g.remove(*old)
        else:
            lru.move_to_end(labels)
        children[0].set(observed * GBS)
        if baseline is not None:
            children[1].set(baseline * GBS)
        children[2].set(effect)
        ek = (job, ks.op, ks.transport)
        h = self._exec_children.get(ek)
        if h is None:
            h = self._exec_children[ek] = self.exec_seconds.labels(*ek)
        h.observe(exec_ns / 1e9)
        # Rank gauges once per communicator and window, not once per key.
        ck = (job, ks.comm)
        if self._rank_updated.get(ck) != end_ns:
            self._rank_updated[ck] = end_ns
            hosts, gpus = ks.rank_host, ks.rank_gpu
            for rank, rel in ks.straggler.relative().items():
                node = hosts.get(rank, "")
                self._rank((job, ks.comm, ks.comm_name, str(rank), node, node, gpus.get(rank, ""))).set(rel)

    def _rank(self, labels: tuple[str, ...]) -> Any:
        lru = self._rank_lru
        child = lru.get(labels)
        if child is None:
            child = lru[labels] = self.rank_relative.labels(*labels)
            if len(lru) > self.max_keys:
                old, _ = lru.popitem(last=False)
                self.rank_relative.remove(*old)
        else:
            lru.move_to_end(labels)
        return child

    def throughput(self, job: str, tflops: float) -> None:
        self.job_tflops.labels(job).set(tflops * 1e12)

    def job_pause(self, job: str, saving: bool) -> None:
        """The job began (``saving``) or ended a checkpoint save."""
        self.job_checkpoint_saving.labels(job).set(1 if saving else 0)

    def comm_waiting(self, job: str, waits: dict[str, tuple[str, float]]) -> None:
        """The job's communicators waiting now, ``comm -> (comm_name, seconds)``: each
        series set, those of communicators no longer waiting removed.

        >>> from prometheus_client import CollectorRegistry
        >>> m = DetectorMetrics(CollectorRegistry())
        >>> m.comm_waiting("j", {"0x1": ("dp", 4.5)})
        >>> m.registry.get_sample_value("ncclwatch_comm_waiting_seconds",
        ...     {"training_job": "j", "comm": "0x1", "comm_name": "dp"})
        4.5
        >>> m.comm_waiting("j", {})
        >>> m.registry.get_sample_value("ncclwatch_comm_waiting_seconds",
        ...     {"training_job": "j", "comm": "0x1", "comm_name": "dp"}) is None
        True
        """
        shown = self._waiting.get(job)
        if not waits and not shown:
            return
        now: dict[str, tuple[str, ...]] = {}
        for comm, (name, seconds) in waits.items():
            labels = now[comm] = (job, comm, name)
            self.comm_waiting_seconds.labels(*labels).set(seconds)
        for comm, labels in (shown or {}).items():
            if now.get(comm) != labels:
                self.comm_waiting_seconds.remove(*labels)
        if now:
            self._waiting[job] = now
        else:
            self._waiting.pop(job, None)

    def event(self, ev: AnomalyEvent) -> None:
        if ev.state == "firing":
            self._fire(ev, count=ev.id not in self._active)
        else:
            labels = self._active.pop(ev.id, None)
            if labels is not None:
                self._release(labels)

    def _release(self, labels: tuple[str, ...]) -> None:
        # Two open anomalies can share a series (telemetry_loss on two hosts): remove
        # it only when the last of them is gone.
        self._series_users[labels] -= 1
        if not self._series_users[labels]:
            del self._series_users[labels]
            self.anomaly_active.remove(*labels)

    def _fire(self, ev: AnomalyEvent, count: bool) -> None:
        k = ev.key or {}
        node = ev.host or ""
        labels = (
            ev.job, ev.type, k.get("comm") or "", k.get("comm_name") or "", k.get("op") or "",
            k.get("size_bucket") or "", k.get("transport") or "",
            "" if ev.rank is None else str(ev.rank), ev.severity, node, node,
            str((ev.evidence or {}).get("gpu") or ""),
        )
        old = self._active.get(ev.id)
        if old != labels:
            if old is not None:  # a re-fired anomaly whose key narrowed: move its series
                self._release(old)
            self._active[ev.id] = labels
            self._series_users[labels] = self._series_users.get(labels, 0) + 1
        self.anomaly_active.labels(*labels).set(1)
        if count and ev.id not in self._counted:
            self._counted[ev.id] = None
            if len(self._counted) > COUNTED_IDS:
                self._counted.popitem(last=False)
            self.anomalies_total.labels(ev.job, ev.type, ev.severity).inc()

    def job_evicted(self, job: str) -> None:
        for metric in (self.busbw_observed, self.busbw_baseline, self.degradation,
                       self.exec_seconds, self.anomaly_active, self.anomalies_total,
                       self.job_tflops, self.rank_relative, self.comm_waiting_seconds,
                       self.job_checkpoint_saving):
            metric.remove_by_labels({"training_job": job})
        self._waiting.pop(job, None)
        for lru in (self._key_lru, self._rank_lru):
            for labels in [lb for lb in lru if lb[0] == job]:
                del lru[labels]
        for d in (self._rank_updated, self._exec_children):
            for key in [k for k in d if k[0] == job]:
                del d[key]
        for aid in [a for a, lb in self._active.items() if lb[0] == job]:
            del self._active[aid]
        for labels in [lb for lb in self._series_users if lb[0] == job]:
            del self._series_users[labels]

    @property
    def key_series(self) -> int:
        """Key series currently exported (bounded by ``max_keys``)."""
        return len(self._key_lru)
