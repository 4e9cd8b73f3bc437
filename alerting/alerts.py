"""Anomaly events -> Alertmanager alerts: names, labels, annotations, links.

One anomaly (one ``AnomalyEvent.id``) is one alert. Its identity in Alertmanager is its
label set, so labels hold only what identifies the anomaly and routes it; the numbers go
into annotations, which may change between re-sends without creating a new alert.

Label scheme (docs/alerting.md says why):

``alertname``, ``job`` (the training job id, as in the metrics), ``severity``,
``anomaly_id``, ``source="ncclwatch"``, and where the anomaly is one place:
``comm`` (communicator hash), ``op``, ``size_bucket``, ``transport``, ``host``, ``rank``.
Members the anomaly spans several of are left out (Alertmanager treats an empty label
as absent), plus the static labels of ``config.alerting.alert_labels``.

>>> from ncclwatch.records import AnomalyEvent
>>> ev = AnomalyEvent(id="a1", type="network_path", state="firing", job="llm-7",
...     key={"comm": "0x00000000000000ab", "comm_name": "dp", "op": "AllReduce",
...          "size_bucket": "64MiB", "transport": "net"},
...     host="node-3", rank=None, start_ns=1_700_000_000_000_000_000, end_ns=None,
...     detected_ns=1_700_000_030_000_000_000, baseline_busbw_gbs=40.0,
...     observed_busbw_gbs=30.0, effect=0.25, attribution="network",
...     throughput_delta=-0.13, severity="critical", evidence={})
>>> a = alert_from_event(ev, AlertLinks())
>>> a["labels"]["alertname"], a["labels"]["severity"], a["labels"]["node"]
('NcclNetworkPathDegraded', 'critical', 'node-3')
>>> "rank" in a["labels"]
False
>>> print(a["annotations"]["summary"])
AllReduce 64MiB over net (comm dp 0x00000000000000ab) on node-3: bus bandwidth down 25%
(network path), job throughput -13.0%
>>> a["startsAt"]
'2023-11-14T22:13:20.000Z'
>>> format_line(a, "firing")
'ALERT firing critical NcclNetworkPathDegraded training_job=llm-7 comm=0x00000000000000ab ...'
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from ncclwatch.describe import stalled, where_of
from ncclwatch.records import AnomalyEvent

ALERT_NAMES: dict[str, str] = {
    "collective_degraded": "NcclCollectiveDegraded",
    "network_path": "NcclNetworkPathDegraded",
    "intra_node": "NcclIntraNodeDegraded",
    "straggler": "NcclStragglerRank",
    "telemetry_loss": "NcclTelemetryLoss",
    "throughput_drop": "NcclJobThroughputDrop",
}
TEST_ALERT_NAME = "NcclwatchTestAlert"

# Grafana dashboard uids, fixed by the dashboards component (dashboards/grafana/*.json).
DASHBOARD_JOB = "ncclwatch-job"
DASHBOARD_COMM = "ncclwatch-comm"
DASHBOARD_PIPELINE = "ncclwatch-pipeline"
# How far before the anomaly's start a dashboard link begins, so the healthy baseline shows.
DASHBOARD_LEAD_NS = 15 * 60 * 1_000_000_000

_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# Labels this module sets itself; static labels may not override them.
RESERVED_LABELS = frozenset(
    ("alertname", "training_job", "severity", "anomaly_id", "source", "comm", "op", "size_bucket",
     "transport", "node", "rank", "UUID")
)
MAX_EVIDENCE_CHARS = 1024


def parse_static_labels(text: str) -> dict[str, str]:
    """``"k=v,k2=v2"`` (``config.alerting.alert_labels``) as a dict, checked.

    >>> parse_static_labels("cluster=eu-1, team = infra")
    {'cluster': 'eu-1', 'team': 'infra'}
    >>> parse_static_labels("")
    {}
    >>> parse_static_labels("severity=low")
    Traceback (most recent call last):
    ...
    ValueError: alert_labels: 'severity' is set by ncclwatch itself
    """
    out: dict[str, str] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not _LABEL_NAME.match(name) or name.startswith("__") or not value:
            raise ValueError(f"alert_labels: {part.strip()!r} is not name=value")
        if name in RESERVED_LABELS:
            raise ValueError(f"alert_labels: {name!r} is set by ncclwatch itself")
        out[name] = value
    return out


@dataclass(frozen=True)
class AlertLinks:
    """Where alerts link to: Grafana and the runbooks (``config.alerting``), as on-call
    reaches them. Either may be empty: that link is left out, never guessed.

    >>> links = AlertLinks("https://grafana.example.com/", "https://wiki.example.com/runbooks")
    >>> links.runbook("NcclStragglerRank")
    'https://wiki.example.com/runbooks/NcclStragglerRank.md'
    >>> links.grafana("/d/ncclwatch-job?from=now-1h"), AlertLinks().grafana("/d/x"), AlertLinks().runbook("X")
    ('https://grafana.example.com/d/ncclwatch-job?from=now-1h', '', '')
    """

    grafana_url: str = ""
    runbook_base_url: str = ""

    def __post_init__(self) -> None:
        for name in ("grafana_url", "runbook_base_url"):
            url = getattr(self, name)
            # quotes and braces would break the YAML and templates the rules carry them in
            if url and (not url.startswith(("http://", "https://")) or set(url) & set('"{}\\ ')):
                raise ValueError(f"alerting.{name} must be an http(s):// URL, got {url!r}")

    def runbook(self, alertname: str) -> str:
        if not self.runbook_base_url:
            return ""
        return f"{self.runbook_base_url.rstrip('/')}/{alertname}.md"

    def grafana(self, path: str) -> str:
        """``path`` (``/d/<uid>?...``) under Grafana's URL; "" without one."""
        return f"{self.grafana_url.rstrip('/')}{path}" if self.grafana_url else ""

    def dashboard(
        self, uid: str, variables: dict[str, str], from_ns: int, to_ns: int | None
    ) -> str:
        """A Grafana link: ``/d/<uid>`` (Grafana adds the slug), template variables, range."""
        query: list[tuple[str, str]] = [(f"var-{k}", v) for k, v in variables.items() if v]
        query.append(("from", str(from_ns // 1_000_000)))
        query.append(("to", "now" if to_ns is None else str(to_ns // 1_000_000)))
        return self.grafana(f"/d/{uid}?{urlencode(query)}")


def iso(ts_ns: int) -> str:
    """RFC 3339 in UTC with milliseconds, as Alertmanager's API takes it.

    >>> iso(0)
    '1970-01-01T00:00:00.000Z'
    """
    dt = datetime.fromtimestamp(ts_ns // 1_000_000_000, UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S") + f".{(ts_ns // 1_000_000) % 1000:03d}Z"


def _dashboard_for(ev: AnomalyEvent, links: AlertLinks, cluster: str) -> str:
    key = ev.key
    from_ns = ev.start_ns - DASHBOARD_LEAD_NS
    # The dashboards filter on a `cluster` label too; a static alert label says which.
    variables = {"cluster": cluster, "job": ev.job}
    if ev.type == "telemetry_loss":
        return links.dashboard(DASHBOARD_PIPELINE, variables, from_ns, ev.end_ns)
    if ev.type == "throughput_drop" or not key.get("comm"):
        return links.dashboard(DASHBOARD_JOB, variables, from_ns, ev.end_ns)
    variables.update(
        comm=key.get("comm") or "", op=key.get("op") or "", transport=key.get("transport") or ""
    )
    return links.dashboard(DASHBOARD_COMM, variables, from_ns, ev.end_ns)


def _summary(ev: AnomalyEvent) -> str:
    tput = ""
    if ev.throughput_delta is not None:
        tput = f", job throughput {ev.throughput_delta * 100:+.1f}%"
    where = where_of(ev)
    if ev.type == "telemetry_loss":
        return f"ncclwatch telemetry lost for job {ev.job} ({where})"
    if ev.type == "throughput_drop":
        delta = ev.throughput_delta if ev.throughput_delta is not None else -ev.effect
        return f"job {ev.job} throughput {delta * 100:+.1f}% while NCCL degraded ({where})"
    if (stall := stalled(ev.evidence)) is not None:
        return f"{where}: {stall}{tput}"
    if ev.type == "straggler":
        what = ev.key.get("op") or "its collectives"
        return f"straggler: {where} slows {what} by {ev.effect:.0%}{tput}"
    why = {"network_path": "network path", "intra_node": "intra-node"}.get(ev.type, "")
    if why and ev.evidence.get("flapping") is True:
        why += ", flapping"
    why = f" ({why})" if why else ""
    return f"{where}: bus bandwidth down {ev.effect:.0%}{why}{tput}"


def _description(ev: AnomalyEvent) -> str:
    lines = []
    if ev.baseline_busbw_gbs is not None and ev.observed_busbw_gbs is not None:
        lines.append(
            f"Bus bandwidth {ev.observed_busbw_gbs:.2f} GB/s vs baseline "
            f"{ev.baseline_busbw_gbs:.2f} GB/s ({-ev.effect * 100:+.1f}%)."
        )
    elif (stall := stalled(ev.evidence)) is not None:
        lines.append(f"The communicator completes nothing: {stall} (the plugin's progress records).")
    else:
        lines.append(f"Effect {ev.effect * 100:.1f}% (relative loss).")
    since = iso(ev.start_ns)
    if ev.evidence.get("flapping") is True:
        lines.append("The link drops out and comes back (severe windows with healthy ones between), "
                     "not one sustained loss.")
    if ev.end_ns is None:
        lines.append(f"Degraded since {since}; detected at {iso(ev.detected_ns)}.")
    else:
        lines.append(f"Degraded from {since} to {iso(ev.end_ns)}.")
    if ev.throughput_delta is not None:
        lines.append(
            f"Job throughput changed {ev.throughput_delta * 100:+.1f}% vs before the anomaly."
        )
    else:
        lines.append("Job throughput impact unknown (no throughput reported).")
    lines.append(f"Attribution: {ev.attribution}.")
    return " ".join(lines)


def _utf8(text: str) -> str:
    """Valid UTF-8: JSON may decode to lone surrogates (``"\\udcff"``), which no encoder,
    URL or terminal accepts; each becomes ``?``, the same way every time."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _clean(ev: AnomalyEvent) -> AnomalyEvent:
    key = {k: (_utf8(v) if isinstance(v, str) else v) for k, v in ev.key.items()}
    host = _utf8(ev.host) if ev.host is not None else None
    return dataclasses.replace(ev, job=_utf8(ev.job), host=host, key=key, id=_utf8(ev.id))


def alert_from_event(
    ev: AnomalyEvent, links: AlertLinks, static_labels: dict[str, str] | None = None
) -> dict[str, Any]:
    """The Alertmanager alert for an event, without ``endsAt`` (set when it is sent)."""
    ev = _clean(ev)
    name = ALERT_NAMES[ev.type]
    labels: dict[str, str] = dict(static_labels or {})
    # Label names as on the metrics (docs/metrics.md), so Prometheus-rule alerts and these
    # group, inhibit and silence alike.
    labels.update(alertname=name, training_job=ev.job, severity=ev.severity, anomaly_id=ev.id,
                  source="ncclwatch")
    for member in ("comm", "op", "size_bucket", "transport"):
        if ev.key.get(member):
            labels[member] = str(ev.key[member])
    if ev.host:
        labels["node"] = ev.host
    if ev.rank is not None:
        labels["rank"] = str(ev.rank)
    if isinstance(gpu := ev.evidence.get("gpu"), str) and gpu:
        labels["UUID"] = _utf8(gpu)  # the straggler's GPU, under DCGM exporter's label name
    # An empty value is an absent label to Alertmanager; don't send it (e.g. job "").
    labels = {k: v for k, v in labels.items() if v}
    dashboard = _dashboard_for(ev, links, labels.get("cluster", ""))
    annotations = {
        "summary": _summary(ev),
        "description": _description(ev),
        "runbook_url": links.runbook(name),
        "dashboard_url": dashboard,
        "effect": f"{ev.effect:.4f}",
        "attribution": ev.attribution,
        "since": iso(ev.start_ns),
    }
    annotations = {k: v for k, v in annotations.items() if v}  # links not configured: none
    if ev.key.get("comm_name"):
        annotations["comm_name"] = ev.key["comm_name"]
    pid = ev.evidence.get("pid")
    if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
        # the straggler's process (an annotation: a label per process would split groups)
        annotations["pid"] = str(pid)
    if ev.baseline_busbw_gbs is not None:
        annotations["baseline_busbw_gbs"] = f"{ev.baseline_busbw_gbs:.3f}"
    if ev.observed_busbw_gbs is not None:
        annotations["observed_busbw_gbs"] = f"{ev.observed_busbw_gbs:.3f}"
    if ev.throughput_delta is not None:
        annotations["throughput_delta"] = f"{ev.throughput_delta:.4f}"
    if ev.evidence:
        text = json.dumps(ev.evidence, sort_keys=True, separators=(",", ":"), default=str)
        # Evidence is detector-specific and may be large; notifications have size limits.
        if len(text) > MAX_EVIDENCE_CHARS:
            text = text[:MAX_EVIDENCE_CHARS] + "…"
        annotations["evidence"] = text
    alert = {"labels": labels, "annotations": annotations, "startsAt": iso(ev.start_ns)}
    if dashboard:
        alert["generatorURL"] = dashboard
    return alert


def format_line(alert: dict[str, Any], state: str) -> str:
    """One readable line for a terminal (local mode without Alertmanager)."""
    labels = alert["labels"]
    shown = " ".join(
        f"{k}={labels[k]}"
        for k in ("training_job", "comm", "op", "size_bucket", "transport", "node", "rank")
        if k in labels
    )
    return (
        f"ALERT {state} {labels.get('severity', '?')} {labels['alertname']} {shown}: "
        f"{alert['annotations'].get('summary', '')} "
        f"[since {alert.get('startsAt', '?')}, id={labels.get('anomaly_id', '-')}]"
    )
