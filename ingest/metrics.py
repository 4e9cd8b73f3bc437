"""The forwarder's own Prometheus metrics, in a registry of its own (tests make fresh ones)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from ncclwatch import build_info


class ForwarderMetrics:
    """Counters and gauges of one forwarder; label values stay a small closed set
    except ``ncclwatch_plugin_dropped_total``'s training job and node, bounded by the node's
    jobs. The training job is ``training_job`` and the host ``node`` (and ``Hostname``), as on
    the detectors' metrics (``docs/metrics.md``)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        build_info.register(r, "forward")
        self.read = Counter("ncclwatch_forwarder_records_read_total",
                            "Lines read from sources", ["source"], registry=r)
        self.sent = Counter("ncclwatch_forwarder_records_sent_total",
                            "Records acknowledged by Kafka", ["topic"], registry=r)
        self.quarantined = Counter("ncclwatch_forwarder_records_quarantined_total",
                                   "Lines that failed parsing or validation",
                                   ["stage", "reason"], registry=r)
        self.bytes_behind = Gauge("ncclwatch_forwarder_bytes_behind",
                                  "Bytes written to source files but not read yet", registry=r)
        self.buffer_bytes = Gauge("ncclwatch_forwarder_buffer_bytes",
                                  "Bytes waiting in the on-disk buffer for Kafka", registry=r)
        self.last_send = Gauge("ncclwatch_forwarder_last_send_timestamp_seconds",
                               "When Kafka last acknowledged a batch (Unix time)", registry=r)
        self.plugin_dropped = Counter("ncclwatch_plugin_dropped_total",
                                      "Ops the profiler plugin could not record",
                                      ["training_job", "node", "Hostname", "reason"], registry=r)
        self.disk_errors = Counter("ncclwatch_forwarder_disk_write_errors_total",
                                   "Writes to the state directory that failed (and are retried)",
                                   ["where", "errno"], registry=r)
        self.disk_failing = Gauge("ncclwatch_forwarder_disk_write_failing",
                                  "1 while writes to this part of the state directory fail",
                                  ["where"], registry=r)
        self.untrusted_files = Gauge("ncclwatch_forwarder_untrusted_files",
                                     "Spool segments left unread: owned by another user than "
                                     "their job directory's (ingest.spool_trust=owner)", registry=r)
        self.kafka_spills = Counter("ncclwatch_forwarder_kafka_spills_total",
                                    "Times Kafka failed or stalled and the unfinished batches "
                                    "went to the disk buffer (some records may reach Kafka "
                                    "twice, and later than records read after them)",
                                    ["reason"], registry=r)
        self.windows_late = Counter("ncclwatch_forwarder_window_late_ops_total",
                                    "Ops that arrived after their window had closed",
                                    registry=r)
        # (job, host, pid, reason) -> highest cumulative drop count seen; drop and
        # plugin_stats records both carry cumulative totals, so take deltas of the max.
        self._drop_totals: dict[tuple[str, str, int, str], int] = {}

    def plugin_drops(self, job: str, host: str, pid: int, reason: str, total: int) -> None:
        key = (job, host, pid, reason)
        last = self._drop_totals.get(key, 0)
        if total > last:
            self._drop_totals[key] = total
            self.plugin_dropped.labels(job, host, host, reason).inc(total - last)
