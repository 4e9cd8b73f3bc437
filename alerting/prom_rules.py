"""``ncclwatch alert-rules``: the Prometheus rules with this deployment's links.

The shipped ``alerting/rules/ncclwatch.rules.yml`` names no host: each alert carries a
``dashboard_path`` annotation. :func:`render` turns it into ``dashboard_url`` under
``[alerting] grafana_url`` and adds ``runbook_url`` under ``runbook_base_url``, through
the same :class:`~ncclwatch.alerting.alerts.AlertLinks` the sink builds its links with,
so both alerting paths send on-call to the same places. An unset URL leaves its link out.

>>> text = render(AlertLinks("https://grafana.example.com", "https://wiki.example.com/rb"))
>>> [line.strip() for line in text.splitlines() if "NcclStragglerRank.md" in line]
['runbook_url: "https://wiki.example.com/rb/NcclStragglerRank.md"']
>>> "dashboard_path:" in text, "dashboard_path:" in render(AlertLinks())
(False, True)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from ncclwatch.alerting.alerts import AlertLinks

RULES_FILE = Path(__file__).resolve().parent / "rules" / "ncclwatch.rules.yml"
_ALERT = re.compile(r"^\s*- alert: (\w+)\s*$")
_ANNOTATIONS = re.compile(r"^(\s*)annotations:\s*$")
_DASHBOARD_PATH = re.compile(r'^(\s*)dashboard_path: "([^"]*)"\s*$')


def render(links: AlertLinks, text: str | None = None) -> str:
    """The rules file (``text``, default the shipped one) with ``links`` filled in."""
    text = RULES_FILE.read_text() if text is None else text
    out: list[str] = []
    alert = ""
    for line in text.splitlines():
        if m := _ALERT.match(line):
            alert = m.group(1)
        elif (m := _DASHBOARD_PATH.match(line)) and links.grafana_url:
            out.append(f'{m.group(1)}dashboard_url: "{links.grafana(m.group(2))}"')
            continue
        out.append(line)
        if (m := _ANNOTATIONS.match(line)) and alert and links.runbook_base_url:
            out.append(f'{m.group(1)}  runbook_url: "{links.runbook(alert)}"')
    return "\n".join(out) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grafana-url", default=None, metavar="URL",
                        help="Grafana as on-call reaches it (default: config alerting.grafana_url)")
    parser.add_argument("--runbook-base-url", default=None, metavar="URL",
                        help="where <AlertName>.md runbooks are served (default: config alerting.runbook_base_url)")


def run(args: argparse.Namespace, cfg: Any) -> int:
    grafana = cfg.alerting.grafana_url if args.grafana_url is None else args.grafana_url
    runbooks = cfg.alerting.runbook_base_url if args.runbook_base_url is None else args.runbook_base_url
    try:
        links = AlertLinks(grafana, runbooks)
    except ValueError as e:
        print(f"ncclwatch alert-rules: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(render(links))
    return 0
