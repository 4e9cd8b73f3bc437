"""Check dashboards against a real Prometheus: does every panel's query run and return data?

    python -m ncclwatch.dashboards.check --prometheus http://127.0.0.1:9090 --since 15m

Grafana is not needed: each panel's PromQL, with the dashboard variables substituted the
way Grafana would ("All" is the regex ``.*``; ``--var job=1234`` picks a value), is run as
a range query over the last ``--since``. Template-variable queries (``label_values``) are
run too. Exit status 1 if a query fails to parse or run, or, with ``--strict``, returns
no series. Operators can point it at their own Prometheus after setting the stack up;
the tests point it at the test services fed by a replayed fixture.

>>> substitute('rate(x{job=~"$job", op=~"${op}"}[$__rate_interval])', {"job": "j1"}, rate_s=20)
'rate(x{job=~"j1", op=~".*"}[20s])'
>>> sorted(variables_used('a{b=~"$cluster"} ${__url_time_range} [[op]] ${job:regex}'))
['cluster', 'job', 'op']
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncclwatch.dashboards.panels import panel_queries

GRAFANA_DIR = Path(__file__).resolve().parent / "grafana"

# $name, ${name}, ${name:format}, [[name]], [[name:format]]. Names starting "__" are
# Grafana's globals ($__rate_interval, ${__data.fields.job}, ...), never dashboard variables.
_VAR = re.compile(
    r"\$\{(?P<b>[A-Za-z0-9_.]+)(?::[^}]*)?\}"
    r"|\$(?P<p>[A-Za-z_][A-Za-z0-9_]*)"
    r"|\[\[(?P<k>[A-Za-z0-9_]+)(?::[^\]]*)?\]\]"
)
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(?P<match>.+?)\s*,\s*)?(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$")


def variables_used(text: str) -> set[str]:
    """Dashboard variables a string refers to (Grafana's ``__`` globals left out)."""
    names = set()
    for m in _VAR.finditer(text):
        name = (m.group("b") or m.group("p") or m.group("k")).split(".")[0]
        if not name.startswith("__"):
            names.add(name)
    return names


def _strings(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, f"{path}.{k}" if path else k)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _strings(v, f"{path}[{i}]")


def undefined_variables(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, name) for every variable reference with no variable of that name."""
    defined = {v["name"] for v in dash.get("templating", {}).get("list", [])}
    return [
        (where, name) for where, text in _strings(dash) for name in sorted(variables_used(text)) if name not in defined
    ]


def substitute(expr: str, values: dict[str, str], *, rate_s: int = 60, range_s: int = 900) -> str:
    """The query Grafana would send: globals as durations, unset variables as "All" (.*)."""
    durations = {"__rate_interval": f"{rate_s}s", "__interval": f"{max(rate_s // 4, 1)}s"}
    durations["__range"] = f"{range_s}s"

    def repl(m: re.Match) -> str:
        name = m.group("b") or m.group("p") or m.group("k")
        if name in durations:
            return durations[name]
        if name.startswith("__"):
            raise ValueError(f"no value for Grafana global {name!r} in a query: {expr}")
        return values.get(name, ".*")

    return _VAR.sub(repl, expr)


# ----------------------------------------------------------------------------- Prometheus


class PrometheusError(RuntimeError):
    pass


def _call(base_url: str, path: str, params: list[tuple[str, str]], *, post: bool, timeout_s: float = 30) -> Any:
    """GET, or POST (as Grafana does for queries: long expressions fit in a body)."""
    url = f"{base_url.rstrip('/')}{path}"
    query = urllib.parse.urlencode(params)
    req = urllib.request.Request(url, data=query.encode()) if post else f"{url}?{query}"
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            payload = json.load(r)
    except urllib.error.HTTPError as e:  # 400/422 carry Prometheus's own error text
        try:
            payload = json.load(e)
        except ValueError:
            raise PrometheusError(f"{url}: HTTP {e.code}") from None
    if payload.get("status") != "success":
        raise PrometheusError(f"{payload.get('errorType')}: {payload.get('error')}")
    return payload["data"]


def query_range(base_url: str, expr: str, start_s: float, end_s: float, step_s: float) -> list:
    data = _call(
        base_url,
        "/api/v1/query_range",
        [
            ("query", expr),
            ("start", f"{start_s:.3f}"),
            ("end", f"{end_s:.3f}"),
            ("step", f"{step_s:g}"),
        ],
        post=True,
    )
    return data["result"]


def label_values(base_url: str, query: str, start_s: float, end_s: float) -> list[str]:
    """What Grafana's ``label_values(metric{...}, label)`` variable query lists."""
    m = _LABEL_VALUES.match(query)
    if not m:
        raise ValueError(f"not a label_values() query: {query}")
    params = [("start", f"{start_s:.3f}"), ("end", f"{end_s:.3f}")]
    if m.group("match"):
        params.append(("match[]", m.group("match")))
    return _call(base_url, f"/api/v1/label/{m.group('label')}/values", params, post=False)


# ----------------------------------------------------------------------------- the check


@dataclass(frozen=True)
class Result:
    dashboard: str
    panel: str
    ref: str
    query: str
    series: int
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.series > 0


def load_dashboards(directory: Path = GRAFANA_DIR) -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(directory.glob("*.json")):
        dash = json.loads(path.read_text())
        out[dash["uid"]] = dash
    return out


def check_dashboard(
    base_url: str,
    dash: dict[str, Any],
    *,
    values: dict[str, str] | None = None,
    start_s: float,
    end_s: float,
    rate_s: int = 60,
) -> list[Result]:
    """Run every variable query and every panel query of one dashboard."""
    # Constants ($threshold) have their one value; the rest default to "All" (.*).
    values = {
        **{v["name"]: v["query"] for v in dash["templating"]["list"] if v["type"] == "constant"},
        **(values or {}),
    }
    range_s = max(int(end_s - start_s), 1)
    step_s = max(range_s / 200, 1.0)
    out = []
    for var in dash.get("templating", {}).get("list", []):
        if var["type"] != "query":
            continue
        q = substitute(var["definition"], values, rate_s=rate_s, range_s=range_s)
        try:
            n, err = len(label_values(base_url, q, start_s, end_s)), ""
        except (PrometheusError, ValueError, OSError) as e:
            n, err = 0, str(e)
        out.append(Result(dash["uid"], f"variable {var['name']}", "var", q, n, err))
    exprs = [(t["panel"], t["refId"], t["expr"]) for t in panel_queries(dash)]
    for anno in dash.get("annotations", {}).get("list", []):
        if anno.get("expr"):
            exprs.append((f"annotation {anno['name']}", "anno", anno["expr"]))
    for panel, ref, expr in exprs:
        q = substitute(expr, values, rate_s=rate_s, range_s=range_s)
        try:
            n, err = len(query_range(base_url, q, start_s, end_s, step_s)), ""
        except (PrometheusError, OSError) as e:
            n, err = 0, str(e)
        out.append(Result(dash["uid"], panel, ref, q, n, err))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--prometheus", required=True, help="Prometheus base URL")
    add("--since", default="15m", help="time range to query, e.g. 15m, 2h (default 15m)")
    add("--var", action="append", default=[], metavar="NAME=VALUE", help="a variable's value")
    add("--rate-interval-s", type=int, default=60, help="$__rate_interval (default 60)")
    add("--strict", action="store_true", help="also fail on queries that return no data")
    add("--dir", type=Path, default=GRAFANA_DIR, help="dashboard JSON directory")
    args = parser.parse_args(argv)
    unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    m = re.fullmatch(r"(\d+)([smhd])", args.since)
    if not m:
        parser.error(f"--since {args.since!r}: use e.g. 15m")
    end_s = time.time()
    start_s = end_s - int(m.group(1)) * unit[m.group(2)]
    values = dict(v.split("=", 1) for v in args.var)
    failed = 0
    for dash in load_dashboards(args.dir).values():
        results = check_dashboard(
            args.prometheus,
            dash,
            values=values,
            start_s=start_s,
            end_s=end_s,
            rate_s=args.rate_interval_s,
        )
        for r in results:
            status = "ok" if r.ok else ("ERROR" if r.error else "no data")
            bad = bool(r.error) or (args.strict and not r.ok)
            failed += bad
            print(f"{status:8} {r.series:5}  {r.dashboard} / {r.panel} [{r.ref}]")
            if r.error:
                print(f"{'':15}{r.query}\n{'':15}{r.error}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
