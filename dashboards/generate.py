"""Generate the Grafana dashboards (``dashboards/grafana/*.json``) from one place.

Three dashboards, provisioned from ``dashboards/provisioning``:

- ``ncclwatch-job``: job overview. Job throughput (FLOP/s per GPU) beside communication
  health, bus bandwidth split NVLink-only vs network/mixed (the first split NVIDIA's
  Inspector dashboards make), active anomalies as annotations and a table, and NCCL
  Inspector's own metrics from node-exporter's textfile collector.
- ``ncclwatch-comm``: communicator drill-down. Bus bandwidth per op and size bucket
  against the learned baseline band, execution-time quantiles from the histogram, and a
  per-rank heatmap of relative exec time, where a straggler shows as the rank below 1.
- ``ncclwatch-pipeline``: pipeline health. Plugin drops, forwarder lag and buffer, worker
  lag, records per second.

The JSON is committed; regenerate with ``python -m ncclwatch.dashboards.generate`` and a
test fails when the committed files differ from what this module builds.

>>> dash = build_all()["ncclwatch-comm"]
>>> dash["uid"], dash["refresh"], dash["schemaVersion"] >= 39
('ncclwatch-comm', '5s', True)
>>> sorted(v["name"] for v in dash["templating"]["list"])[:3]
['cluster', 'comm', 'datasource']
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ncclwatch.dashboards.panels import (
    DS,
    constant_var,
    dashboard,
    datasource_var,
    query_var,
    render,
    row,
    srate,
    stat,
    table,
    target,
    targets,
    thresholds,
    timeseries,
)

from ncclwatch.config import DetectorConfig
from ncclwatch.rules import NETWORK_TRANSPORTS

GRAFANA_DIR = Path(__file__).resolve().parent / "grafana"

NETWORK_RE = "|".join(sorted(NETWORK_TRANSPORTS))  # "mixed|net"
NVLINK_RE = "nvlink"

# Selectors shared by the queries. Regex matchers so that "All" (allValue ".*") also
# matches series without the label, e.g. no `cluster` label on a single-cluster setup.
JOB = 'cluster=~"$cluster", training_job=~"$job"'
KEY = JOB + ', comm=~"$comm", op=~"$op", transport=~"$transport"'
# ncclwatch_exec_seconds is labelled {training_job, op, transport} only: a histogram per
# communicator would multiply the series by the bucket count.
EXEC = JOB + ', op=~"$op", transport=~"$transport"'
# Anomalies that span several communicators (or ops, transports) have those labels empty:
# a drill-down into one communicator still shows them.
ANOMALY = JOB + ', comm=~"$comm|", op=~"$op|", transport=~"$transport|"'
# NCCL Inspector's files label the job `slurm_job_id` and have no transport label: its
# dashboards split single-node (NVLink-only) from multi-node by `n_nodes`.
INSPECTOR = 'cluster=~"$cluster", slurm_job_id=~"$job"'


def key_vars(*, comm_multi: bool = True) -> list[dict[str, Any]]:
    """cluster, job, comm, op, transport: the names alert links use (var-job=…)."""
    metric = "ncclwatch_busbw_observed_bytes_per_second"
    return [
        datasource_var(),
        query_var("cluster", "Cluster", f"label_values({metric}, cluster)"),
        query_var("job", "Job", f'label_values({metric}{{cluster=~"$cluster"}}, training_job)'),
        query_var(
            "comm",
            "Communicator",
            f"label_values({metric}{{{JOB}}}, comm)",
            multi=comm_multi,
            include_all=comm_multi,
        ),
        query_var("op", "Op", f'label_values({metric}{{{JOB}, comm=~"$comm"}}, op)'),
        query_var(
            "transport",
            "Transport",
            f'label_values({metric}{{{JOB}, comm=~"$comm", op=~"$op"}}, transport)',
        ),
        constant_var(
            "threshold",
            repr(DetectorConfig().threshold),
            "relative busbw loss the detector counts as degraded ([detector] threshold)",
        ),
    ]


def annotation(name: str, expr: str, *, color: str, title: str, text: str, tags: str) -> dict[str, Any]:
    """Shade the time ``expr`` (a gauge that is 1 while something lasts) returns series."""
    return {
        "name": name,
        "datasource": DS,
        "enable": True,
        "hide": False,
        "iconColor": color,
        "expr": expr,
        "step": "15s",
        "titleFormat": title,
        "textFormat": text,
        "tagKeys": tags,
        "useValueForTime": False,
    }


def anomaly_annotation(selector: str) -> dict[str, Any]:
    """The time an anomaly is active (the gauge is 1 while firing)."""
    return annotation("Active anomalies", f"ncclwatch_anomaly_active{{{selector}}} > 0", color="red",
                      title="{{anomaly_type}}", text="{{comm}} {{op}} {{size_bucket}} {{transport}} rank {{rank}}",
                      tags="anomaly_type,transport")


def checkpoint_annotation(selector: str) -> dict[str, Any]:
    """The job's checkpoint saves (what begins in one is not raised)."""
    return annotation("Checkpoint saves", f"ncclwatch_job_checkpoint_saving{{{selector}}} > 0", color="blue",
                      title="checkpoint save", text="{{training_job}}", tags="training_job")


def comm_link(title: str = "Communicator drill-down") -> dict[str, Any]:
    """A table-cell link from an anomaly row to the communicator dashboard."""
    return {
        "title": title,
        "url": "/d/ncclwatch-comm/ncclwatch-communicator?${__url_time_range}"
        "&var-datasource=${datasource}&var-cluster=${cluster}"
        "&var-job=${__data.fields.training_job}&var-comm=${__data.fields.comm}"
        "&var-op=${__data.fields.op}&var-transport=${__data.fields.transport}",
    }


# ----------------------------------------------------------------------------- dashboards


def loss_steps(below: str = "transparent") -> tuple[tuple[float | None, str], ...]:
    """Red from the threshold up: the loss at which the detector counts a window degraded."""
    return ((None, below), (DetectorConfig().threshold, "red"))


def job_dashboard() -> dict[str, Any]:
    busbw = "ncclwatch_busbw_observed_bytes_per_second"
    by_key = "avg by (op, size_bucket, transport)"  # comm and rank left out: bounded series
    panels = [
        row("Job impact"),
        stat(
            "Throughput per GPU (FLOP/s)",
            [target(f"avg by (training_job) (ncclwatch_job_flops_per_second_per_gpu{{{JOB}}})", "{{training_job}}")],
            unit="flops",
            decimals=1,
            description="Model FLOP/s per GPU as the job reports it (ncclwatch.report_throughput "
            "or its training log).",
        ),
        stat(
            "Active anomalies",
            [target(f"sum by (anomaly_type) (ncclwatch_anomaly_active{{{JOB}}})", "{{anomaly_type}}")],
            unit="none",
            steps=((None, "green"), (1, "red")),
            no_value="0",
        ),
        stat(
            "Worst busbw loss vs baseline",
            [target(f"max(ncclwatch_degradation_ratio{{{KEY}}})", "worst key")],
            unit="percentunit",
            steps=loss_steps(below="green"),
            description="1 − observed / learned baseline bus bandwidth, worst key. From the "
            "threshold up the detector counts a window as degraded.",
        ),
        stat(
            "Anomalies in range",
            [
                target(
                    f"sum by (severity) (increase(ncclwatch_anomalies_total{{{JOB}}}[$__range]))",
                    "{{severity}}",
                )
            ],
            unit="none",
            decimals=0,
            steps=((None, "green"), (1, "orange")),
            no_value="0",
        ),
        timeseries(
            "Job throughput",
            targets((f"ncclwatch_job_flops_per_second_per_gpu{{{JOB}}}", "{{training_job}} per GPU")),
            unit="flops",
            description="If throughput falls while busbw falls below its baseline, communication "
            "costs the job time; busbw alone dropping on a small bucket may not.",
        ),
        timeseries(
            "Communication health: busbw loss vs baseline (worst key)",
            targets(
                (
                    f"max by (training_job, transport) (ncclwatch_degradation_ratio{{{KEY}}})",
                    "{{training_job}} {{transport}}",
                )
            ),
            unit="percentunit",
            threshold_steps=loss_steps(),
            description="0 % is the learned baseline; in the red area (loss above the detector's "
            "threshold) windows count as degraded.",
        ),
        row("Bus bandwidth: NVLink-only vs network / mixed"),
        timeseries(
            "NVLink-only communicators",
            targets(
                (
                    f'{by_key} ({busbw}{{{KEY}, transport="{NVLINK_RE}"}})',
                    "{{op}} {{size_bucket}}",
                ),
            ),
            unit="Bps",
            min_=0,
            description="Communicators whose ranks are all on one node: traffic stays on NVLink.",
        ),
        timeseries(
            "Network / mixed communicators",
            targets(
                (
                    f'{by_key} ({busbw}{{{KEY}, transport=~"{NETWORK_RE}"}})',
                    "{{op}} {{size_bucket}} {{transport}}",
                ),
            ),
            unit="Bps",
            min_=0,
            description="Communicators spanning nodes: `net` (one rank per node) and `mixed` "
            "(NVLink inside a node, network between nodes). Network trouble shows here first.",
        ),
        row("Anomalies"),
        table(
            "Active anomalies",
            target(f"ncclwatch_anomaly_active{{{ANOMALY}}} > 0", instant=True, fmt="table"),
            w=16,
            hide=("Time", "__name__", "instance", "cluster", "Value"),
            links=[comm_link()],
            description="One row per active anomaly; click a row to open its communicator.",
        ),
        timeseries(
            "Anomalies fired",
            targets(
                (
                    f"sum by (anomaly_type, severity) (increase(ncclwatch_anomalies_total{{{JOB}}}[$__rate_interval]))",
                    "{{anomaly_type}} ({{severity}})",
                )
            ),
            unit="none",
            w=8,
            draw="bars",
            legend_calcs=("sum",),
        ),
        timeseries(
            "Communicators waiting: longest op in flight without completing",
            targets((f"max by (training_job, comm_name, comm) (ncclwatch_comm_waiting_seconds{{{JOB}}})",
                     "{{training_job}} {{comm_name}} {{comm}}")),
            unit="s",
            w=24,
            min_=0,
            threshold_steps=((None, "transparent"), (DetectorConfig().stall_after_s, "red")),
            description="From the plugin's progress records, written only while a rank has had "
            "an operation in flight for a second or more without completing it: a stopped, hung "
            "or stuck rank, or a path that carries nothing. From the red line up (the detector's "
            "stall_after_s) the detector names who holds the communicator up.",
        ),
        row(
            "NCCL Inspector (node-exporter textfile)",
            [
                timeseries(
                    "Inspector busbw, single-node communicators (NVLink-only)",
                    targets(
                        (
                            f'avg by (collective, message_size) (nccl_bus_bandwidth_gbs{{{INSPECTOR}, n_nodes="1"}})',
                            "{{collective}} {{message_size}}",
                        )
                    ),
                    unit="GBs",
                    min_=0,
                    description="NCCL Inspector's Prometheus mode (NCCL >= 2.30), or the ncclwatch "
                    "plugin's Inspector-compatible textfile, scraped through node-exporter.",
                ),
                timeseries(
                    "Inspector busbw, multi-node communicators (network / mixed)",
                    targets(
                        (
                            f'avg by (collective, message_size) (nccl_bus_bandwidth_gbs{{{INSPECTOR}, n_nodes!="1"}})',
                            "{{collective}} {{message_size}}",
                        )
                    ),
                    unit="GBs",
                    min_=0,
                ),
                timeseries(
                    "Inspector collective exec time",
                    targets(
                        (
                            f"max by (collective, message_size, n_nodes) "
                            f"(nccl_collective_exec_time_microseconds{{{INSPECTOR}}})",
                            "{{collective}} {{message_size}} ({{n_nodes}} nodes)",
                        )
                    ),
                    unit="µs",
                ),
                timeseries(
                    "Inspector P2P busbw",
                    targets(
                        (
                            f"avg by (p2p_operation, message_size) (nccl_p2p_bus_bandwidth_gbs{{{INSPECTOR}}})",
                            "{{p2p_operation}} {{message_size}}",
                        )
                    ),
                    unit="GBs",
                    min_=0,
                ),
            ],
        ),
    ]
    return dashboard(
        "ncclwatch-job",
        "ncclwatch: job overview",
        "Is communication degraded, where, and does it cost the job throughput?",
        panels,
        key_vars(),
        annotations=[anomaly_annotation(ANOMALY), checkpoint_annotation(JOB)],
    )


def comm_dashboard() -> dict[str, Any]:
    observed = f"ncclwatch_busbw_observed_bytes_per_second{{{KEY}}}"
    baseline = f"ncclwatch_busbw_baseline_bytes_per_second{{{KEY}}}"
    rank_sel = 'cluster=~"$cluster", training_job=~"$job", comm=~"$comm"'
    dashed = {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}
    band = [
        {
            "matcher": {"id": "byFrameRefID", "options": "B"},
            "properties": [dashed, {"id": "custom.lineWidth", "value": 1}],
        },
        {
            "matcher": {"id": "byFrameRefID", "options": "C"},
            "properties": [
                {"id": "custom.lineStyle", "value": {"fill": "dot", "dash": [0, 10]}},
                {"id": "custom.fillOpacity", "value": 8},
                {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}},
            ],
        },
    ]
    quantile = (
        "histogram_quantile({q}, sum by (le, op) (rate(ncclwatch_exec_seconds_bucket{{{sel}}}[$__rate_interval])))"
    )
    panels = [
        row("Bus bandwidth against the learned baseline"),
        timeseries(
            "Bus bandwidth vs baseline: $op",
            targets(
                (f"max by (op, size_bucket) ({observed})", "{{size_bucket}} observed"),
                (f"max by (op, size_bucket) ({baseline})", "{{size_bucket}} baseline"),
                (
                    f"max by (op, size_bucket) ({baseline}) * (1 - $threshold)",
                    "{{size_bucket}} degraded below",
                ),
            ),
            unit="Bps",
            w=24,
            min_=0,
            overrides=band,
            description="Solid: observed median busbw per window. Dashed: the detector's learned "
            "baseline. Dotted red: baseline × (1 − threshold); windows under it count as degraded.",
            repeat="op",
            repeatDirection="v",
        ),
        timeseries(
            "busbw loss vs baseline by size bucket",
            targets((f"ncclwatch_degradation_ratio{{{KEY}}}", "{{op}} {{size_bucket}}")),
            unit="percentunit",
            threshold_steps=loss_steps(),
            legend_calcs=("lastNotNull", "max"),
        ),
        timeseries(
            "Exec time quantiles by op (job-wide)",
            targets(
                (quantile.format(q=0.5, sel=EXEC), "{{op}} p50"),
                (quantile.format(q=0.95, sel=EXEC), "{{op}} p95"),
                (quantile.format(q=0.99, sel=EXEC), "{{op}} p99"),
            ),
            unit="s",
            description="From the ncclwatch_exec_seconds histogram, labelled by job, op and "
            "transport only (not per communicator), to keep its series bounded.",
        ),
        row("Ranks"),
        {
            "type": "heatmap",
            "title": "Per-rank relative exec time (straggler score)",
            "description": "Each row is a rank: its kernel time over the median of the other "
            "ranks'. The rank everyone waits for arrives late and spends the least time in the "
            "kernel: a row that stays red (below 1) is a straggler; the others sit at about 1.",
            "datasource": DS,
            "targets": [target(f"max by (rank) (ncclwatch_rank_relative_exec_ratio{{{rank_sel}}})", "{{rank}}")],
            "fieldConfig": {
                "defaults": {"custom": {"hideFrom": {"legend": False, "tooltip": False, "viz": False}}},
                "overrides": [],
            },
            "options": {
                "calculate": False,
                "cellGap": 1,
                "cellValues": {"unit": "percentunit"},
                "color": {
                    "mode": "scheme",
                    "scheme": "RdBu",  # low (a straggler) red, 1 neutral, waiting ranks blue
                    "reverse": False,
                    "fill": "dark",
                    "exponent": 0.5,
                    "steps": 64,
                    "min": 0.5,
                    "max": 1.5,
                },
                "rowsFrame": {"layout": "auto"},
                "yAxis": {"axisPlacement": "left", "reverse": False, "axisLabel": "rank"},
                "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": True},
                "legend": {"show": True},
                "exemplars": {"color": "rgba(255,0,255,0.7)"},
                "filterValues": {"le": 1e-9},
            },
            "_size": (16, 10),
        },
        {
            "type": "bargauge",
            "title": "Straggler candidates now (lowest relative exec)",
            "datasource": DS,
            "targets": [
                target(
                    f"bottomk(8, min by (rank, node) (ncclwatch_rank_relative_exec_ratio{{{rank_sel}}}))",
                    "rank {{rank}} ({{node}})",
                    instant=True,
                )
            ],
            "fieldConfig": {
                "defaults": {
                    "unit": "percentunit",
                    "min": 0,
                    "max": 2,
                    "thresholds": thresholds((None, "red"), (1 - DetectorConfig().straggler_score, "green")),
                },
                "overrides": [],
            },
            "options": {
                "orientation": "horizontal",
                "displayMode": "gradient",
                "showUnfilled": True,
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            },
            "_size": (8, 10),
        },
        table(
            "Active anomalies on this communicator (or spanning several)",
            target(f"ncclwatch_anomaly_active{{{ANOMALY}}} > 0", instant=True, fmt="table"),
            w=24,
            h=6,
            hide=("Time", "__name__", "instance", "cluster", "Value"),
        ),
        table(
            "Straggler's GPUs (DCGM exporter)",
            # DCGM exporter calls the host `Hostname`; ncclwatch's series carry it (beside
            # Inspector's `node`), so the join needs no label_replace.
            target(
                f'max by (Hostname, rank) (ncclwatch_anomaly_active{{{ANOMALY}, anomaly_type="straggler"}})'
                ' * on (Hostname) group_right (rank) DCGM_FI_DEV_GPU_UTIL',
                instant=True,
                fmt="table",
            ),
            description="GPU utilization (DCGM_FI_DEV_GPU_UTIL) of the node whose rank the "
            "detector names as a straggler, joined on the host name: empty without DCGM "
            "exporter or without a straggler.",
            w=24,
            h=6,
            unit="percent",
            hide=("Time", "__name__", "instance", "cluster", "job", "training_job", "pci_bus_id",
                  "DCGM_FI_DRIVER_VERSION"),
        ),
    ]
    return dashboard(
        "ncclwatch-comm",
        "ncclwatch: communicator",
        "One communicator: bus bandwidth per op and size bucket against its baseline, "
        "exec-time quantiles, and which rank is slow.",
        panels,
        key_vars(comm_multi=False),
        annotations=[anomaly_annotation(ANOMALY)],
    )


def pipeline_dashboard() -> dict[str, Any]:
    cl = 'cluster=~"$cluster"'
    panels = [
        row("Plugin"),
        timeseries(
            "Plugin drops / s",
            targets(
                (
                    srate("ncclwatch_plugin_dropped_total", JOB, "node, reason"),
                    "{{node}} {{reason}}",
                )
            ),
            unit="ops",
            description="Ops the profiler plugin could not record, by reason. Any drop means the "
            "detectors see part of the traffic; pool_full/ring_full: the plugin needs more room.",
        ),
        timeseries(
            "Scrape targets up",
            targets((f'up{{{cl}, job=~"ncclwatch.*|node"}}', "{{job}} {{instance}}")),
            unit="none",
            min_=0,
            legend_calcs=("lastNotNull", "min"),
        ),
        row("Forwarders"),
        timeseries(
            "Records read / s",
            targets(
                (
                    srate("ncclwatch_forwarder_records_read_total", cl, "instance, source"),
                    "{{instance}} {{source}}",
                )
            ),
            unit="rps",
            w=8,
        ),
        timeseries(
            "Records sent to Kafka / s",
            targets(
                (
                    srate("ncclwatch_forwarder_records_sent_total", cl, "instance, topic"),
                    "{{instance}} {{topic}}",
                )
            ),
            unit="rps",
            w=8,
        ),
        timeseries(
            "Records quarantined / s",
            targets(
                (
                    srate("ncclwatch_forwarder_records_quarantined_total", cl, "stage, reason"),
                    "{{stage}} {{reason}}",
                )
            ),
            unit="rps",
            w=8,
        ),
        timeseries(
            "Backlog: spool bytes not yet sent",
            targets((f"ncclwatch_forwarder_bytes_behind{{{cl}}}", "{{instance}}")),
            unit="bytes",
            w=8,
            min_=0,
        ),
        timeseries(
            "Send buffer",
            targets((f"ncclwatch_forwarder_buffer_bytes{{{cl}}}", "{{instance}}")),
            unit="bytes",
            w=8,
            min_=0,
            description="Bytes awaiting Kafka acknowledgements; fills while Kafka is unreachable.",
        ),
        timeseries(
            "Time since last acknowledged send",
            targets(
                (
                    f"time() - ncclwatch_forwarder_last_send_timestamp_seconds{{{cl}}}",
                    "{{instance}}",
                ),
            ),
            unit="s",
            w=8,
            min_=0,
        ),
        row("Detectors (watch / worker)"),
        timeseries(
            "Detector lag",
            targets((f"ncclwatch_detector_lag_seconds{{{cl}}}", "{{instance}}")),
            unit="s",
            w=8,
            min_=0,
            description="Wall-clock time minus the stream time of the newest record processed.",
        ),
        timeseries(
            "Detector records / s",
            targets(
                (
                    srate("ncclwatch_detector_records_total", cl, "instance, kind"),
                    "{{instance}} {{kind}}",
                )
            ),
            unit="rps",
            w=8,
        ),
        timeseries(
            "Detector keys",
            targets((f"ncclwatch_detector_keys{{{cl}}}", "{{instance}}")),
            unit="none",
            w=8,
            min_=0,
            threshold_steps=((None, "transparent"), (DetectorConfig().max_metric_keys, "red")),
            description="Keys with per-key metric series; capped at [detector] max_metric_keys.",
        ),
    ]
    variables = [
        datasource_var(),
        query_var("cluster", "Cluster", "label_values(up, cluster)"),
        query_var("job", "Job", 'label_values(ncclwatch_plugin_dropped_total{cluster=~"$cluster"}, training_job)'),
    ]
    return dashboard(
        "ncclwatch-pipeline",
        "ncclwatch: pipeline health",
        "Is ncclwatch itself seeing everything? Plugin drops, forwarder backlog, detector lag.",
        panels,
        variables,
    )


def build_all() -> dict[str, dict[str, Any]]:
    return {d["uid"]: d for d in (job_dashboard(), comm_dashboard(), pipeline_dashboard())}


# ----------------------------------------------------------------------------- queries


def write(out_dir: Path = GRAFANA_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for uid, dash in build_all().items():
        path = out_dir / f"{uid}.json"
        path.write_text(render(dash))
        paths.append(path)
    return paths


def stale(out_dir: Path = GRAFANA_DIR) -> list[str]:
    """Names of committed dashboards that differ from what this module generates."""
    return [
        f"{uid}.json"
        for uid, dash in build_all().items()
        if not (out_dir / f"{uid}.json").is_file() or (out_dir / f"{uid}.json").read_text() != render(dash)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed JSON is stale")
    parser.add_argument("--out", type=Path, default=GRAFANA_DIR)
    args = parser.parse_args(argv)
    if args.check:
        bad = stale(args.out)
        for name in bad:
            print(f"stale: {args.out / name} (run python -m ncclwatch.dashboards.generate)")
        return 1 if bad else 0
    for path in write(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
