"""Small builders for Grafana dashboard JSON: panels, variables, layout.

Only what ncclwatch's dashboards use, written the way Grafana 12 saves them, so the
generated files diff cleanly against a dashboard exported from the UI.

>>> p = layout([timeseries("t", [target("up")], unit="none", w=12), stat("s", [], unit="s")])
>>> [(q["id"], q["gridPos"]["x"]) for q in p]
[(1, 0), (2, 12)]
>>> [q["expr"] for q in panel_queries({"panels": p})]
['up']
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

# What Grafana 12.0/12.1 write when saving a dashboard; newer Grafana migrates forward
# on load.
SCHEMA_VERSION = 41
DATASOURCE_UID = "ncclwatch-prometheus"  # the provisioned datasource's uid
DS = {"type": "prometheus", "uid": "${datasource}"}
TAGS = ["ncclwatch"]


def target(
    expr: str,
    legend: str = "",
    *,
    ref: str = "A",
    instant: bool = False,
    fmt: str = "time_series",
) -> dict[str, Any]:
    return {
        "datasource": DS,
        "editorMode": "code",
        "expr": expr,
        "format": fmt,
        "instant": instant,
        "legendFormat": legend or "__auto",
        "range": not instant,
        "refId": ref,
    }


def targets(*specs: tuple[str, str]) -> list[dict[str, Any]]:
    """Several range queries, refIds A, B, C …"""
    return [target(expr, legend, ref=chr(ord("A") + i)) for i, (expr, legend) in enumerate(specs)]


def srate(metric: str, selector: str, by: str) -> str:
    """Per-second rate of a counter, summed by a few bounded labels."""
    return f"sum by ({by}) (rate({metric}{{{selector}}}[$__rate_interval]))"


def thresholds(*steps: tuple[float | None, str]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


def timeseries(
    title: str,
    tgts: list[dict[str, Any]],
    *,
    unit: str,
    description: str = "",
    w: int = 12,
    h: int = 8,
    min_: float | None = None,
    overrides: list[dict[str, Any]] | None = None,
    threshold_steps: tuple[tuple[float | None, str], ...] | None = None,
    draw: str = "line",
    legend_calcs: tuple[str, ...] = ("lastNotNull", "min", "max"),
    **extra: Any,
) -> dict[str, Any]:
    custom: dict[str, Any] = {
        "drawStyle": draw,
        "lineWidth": 1,
        "fillOpacity": 0 if draw == "line" else 80,
        "showPoints": "never",
        "spanNulls": False,
        "axisSoftMin": min_,
        "thresholdsStyle": {"mode": "off"},
    }
    defaults: dict[str, Any] = {"unit": unit, "custom": custom}
    if threshold_steps:
        defaults["thresholds"] = thresholds(*threshold_steps)
        custom["thresholdsStyle"] = {"mode": "line+area"}
    panel = {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": tgts,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {
            "legend": {
                "showLegend": True,
                "displayMode": "table",
                "placement": "bottom",
                "calcs": list(legend_calcs),
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "_size": (w, h),
    }
    panel.update(extra)
    return panel


def stat(
    title: str,
    tgts: list[dict[str, Any]],
    *,
    unit: str,
    description: str = "",
    w: int = 6,
    h: int = 4,
    steps: tuple[tuple[float | None, str], ...] = ((None, "green"),),
    no_value: str = "",
    decimals: int | None = None,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit, "thresholds": thresholds(*steps)}
    if no_value:
        defaults["noValue"] = no_value
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": tgts,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "area",
            "textMode": "auto",
            "justifyMode": "auto",
            "orientation": "auto",
        },
        "_size": (w, h),
    }


def table(
    title: str,
    tgt: dict[str, Any],
    *,
    description: str = "",
    w: int = 12,
    h: int = 8,
    hide: tuple[str, ...] = ("Time", "__name__", "instance", "cluster"),
    links: list[dict[str, Any]] | None = None,
    unit: str = "none",
) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit, "custom": {"filterable": True}}
    if links:
        defaults["links"] = links
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": [tgt],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"showHeader": True, "cellHeight": "sm"},
        "transformations": [{"id": "organize", "options": {"excludeByName": {name: True for name in hide}}}],
        "_size": (w, h),
    }


def row(title: str, panels: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A row; with ``panels`` it is collapsed and holds them (Grafana's own layout)."""
    return {
        "type": "row",
        "title": title,
        "collapsed": panels is not None,
        "panels": panels or [],
        "_size": (24, 1),
    }


def layout(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give every panel an id and a gridPos, packing left to right on a 24-column grid."""
    next_id = iter(range(1, 1000))
    x = y = row_h = 0

    def place(panel: dict[str, Any]) -> dict[str, Any]:
        nonlocal x, y, row_h
        w, h = panel.pop("_size")
        if x + w > 24 or panel["type"] == "row":
            x, y, row_h = 0, y + row_h, 0
        out = {"id": next(next_id), "gridPos": {"h": h, "w": w, "x": x, "y": y}, **panel}
        x, row_h = x + w, max(row_h, h)
        if panel["type"] == "row":
            x, y, row_h = 0, y + h, 0
            out["panels"] = [place(p) for p in panel["panels"]]
            if out["panels"]:  # collapsed: its children do not take room on the grid
                x = row_h = 0
        return out

    return [place(p) for p in items]


def query_var(
    name: str,
    label: str,
    query: str,
    *,
    multi: bool = True,
    include_all: bool = True,
) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": {
            "qryType": 1,
            "query": query,
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
        },
        "refresh": 2,  # on time range change: jobs come and go
        "sort": 1,
        "multi": multi,
        "includeAll": include_all,
        "allValue": ".*" if include_all else None,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if include_all else {},
        "options": [],
        "regex": "",
        "hide": 0,
    }


def datasource_var() -> dict[str, Any]:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {"selected": False, "text": "Prometheus", "value": DATASOURCE_UID},
        "options": [],
        "refresh": 1,
        "regex": "",
        "hide": 0,
    }


def constant_var(name: str, value: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "constant",
        "description": description,
        "query": value,
        "current": {"text": value, "value": value},
        "options": [{"selected": True, "text": value, "value": value}],
        "hide": 2,
    }


def dashboard(
    uid: str,
    title: str,
    description: str,
    panels: list[dict[str, Any]],
    variables: list[dict[str, Any]],
    annotations: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    builtin = {
        "builtIn": 1,
        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
        "enable": True,
        "hide": True,
        "iconColor": "rgba(0, 211, 255, 1)",
        "name": "Annotations & Alerts",
        "type": "dashboard",
    }
    return {
        "id": None,
        "uid": uid,
        "title": title,
        "description": description,
        "tags": TAGS,
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,  # shared crosshair: line throughput up against busbw
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "refresh": "5s",
        "schemaVersion": SCHEMA_VERSION,
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {"refresh_intervals": ["5s", "10s", "30s", "1m", "5m", "15m"]},
        "version": 1,
        "weekStart": "",
        "annotations": {"list": [builtin, *(annotations or [])]},
        "links": [
            {
                "type": "dashboards",
                "title": "ncclwatch",
                "tags": TAGS,
                "asDropdown": False,
                "includeVars": True,
                "keepTime": True,
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "templating": {"list": variables},
        "panels": layout(panels),
    }


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those inside collapsed rows."""
    for p in panels:
        yield p
        yield from iter_panels(p.get("panels", []))


def render(dash: dict[str, Any]) -> str:
    return json.dumps(dash, indent=2, ensure_ascii=False) + "\n"


def panel_queries(dash: dict[str, Any]) -> list[dict[str, Any]]:
    """Every PromQL target of every panel, with the panel's title: what Grafana will run."""
    out = []
    for panel in iter_panels(dash.get("panels", [])):
        for t in panel.get("targets", []):
            if t.get("expr"):
                out.append({"panel": panel["title"], "panel_type": panel["type"], **t})
    return out
