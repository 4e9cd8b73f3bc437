"""``ncclwatch alert-test``: send a clearly labelled test alert end to end, then resolve it.

The alert is ``NcclwatchTestAlert`` with ``test="true"`` and the chosen severity, so it
takes the same route as a real alert of that severity and an operator sees it arrive
where on-call would. It is resolved after ``--duration`` seconds (or on Ctrl-C); if that
resolution cannot be delivered, Alertmanager still ends it at its ``endsAt``.

Exit status: 0 sent and resolved; 1 Alertmanager unreachable or refused; 2 no URL.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
import uuid
from typing import Any

from ncclwatch.alerting.alertmanager import AlertmanagerClient, AlertmanagerError
from ncclwatch.alerting.alerts import TEST_ALERT_NAME, AlertLinks, iso, parse_static_labels

from ncclwatch import progress

# The test alert's endsAt lies this far past the planned resolution: if the resolution is
# lost, the alert still ends by itself soon after.
ENDS_MARGIN_S = 60.0
RESOLVE_RETRY_S = 30.0
PROGRESS_EVERY_S = 10.0  # off a terminal: a status line this often while waiting


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--severity", choices=("info", "warning", "critical"), default="warning",
                        help="severity label, which picks the route (default: warning)")
    parser.add_argument("--duration", type=float, default=60.0, metavar="SECONDS",
                        help="resolve the alert after this long (default: 60)")
    parser.add_argument("--url", default="",
                        help="Alertmanager URL (default: config alerting.alertmanager_url)")
    parser.add_argument("--job", default="ncclwatch-alert-test",
                        help="value of the training_job label (default: ncclwatch-alert-test)")


def build_test_alert(severity: str, job: str, duration_s: float, links: AlertLinks,
               static_labels: dict[str, str], now_ns: int) -> dict[str, Any]:
    """The test alert (firing), ``endsAt`` a margin past the planned resolution."""
    host = socket.gethostname()
    labels = dict(static_labels)
    labels.update(alertname=TEST_ALERT_NAME, severity=severity, test="true", training_job=job,
                  source="ncclwatch", host=host, anomaly_id=f"test-{uuid.uuid4().hex[:12]}")
    return {
        "labels": labels,
        "annotations": {
            "summary": f"TEST alert from `ncclwatch alert-test` on {host}: not a real problem",
            "description": (
                f"Sent at {iso(now_ns)} to check that {severity} alerts reach on-call; "
                f"it resolves by itself after {duration_s:g} s. No action needed."
            ),
            **({"runbook_url": links.runbook(TEST_ALERT_NAME)} if links.runbook_base_url else {}),
        },
        "startsAt": iso(now_ns),
        "endsAt": iso(now_ns + int((duration_s + ENDS_MARGIN_S) * 1e9)),
    }


def _receivers(client: AlertmanagerClient, alert: dict[str, Any]) -> list[str] | None:
    """The receivers Alertmanager routed the alert to, once it shows up (or None)."""
    for _ in range(20):
        try:
            held = client.get_alerts(anomaly_id=alert["labels"]["anomaly_id"])
        except AlertmanagerError:
            return None
        if held:
            return sorted({r["name"] for a in held for r in a.get("receivers", [])})
        time.sleep(0.1)
    return None


def _state(client: AlertmanagerClient, alert: dict[str, Any]) -> str:
    """What Alertmanager shows for the alert now: active, suppressed, or why unknown."""
    try:
        held = client.get_alerts(anomaly_id=alert["labels"]["anomaly_id"])
    except AlertmanagerError as e:
        return f"unknown ({e})"
    return ", ".join(sorted({a.get("status", {}).get("state", "?") for a in held})) or "not held"


def _wait(client: AlertmanagerClient, alert: dict[str, Any], duration_s: float) -> None:
    """Wait ``duration_s`` before resolving, saying so: a countdown bar on a terminal,
    else a line now and every ``PROGRESS_EVERY_S`` with the alert's state in Alertmanager."""
    print(f"firing for {duration_s:g} s, then resolving (Ctrl-C: resolve now)", flush=True)
    deadline = time.monotonic() + duration_s
    with progress.bar(round(duration_s), "resolving in", unit="s",
                      bar_format="{desc} {remaining} [{bar}] {postfix}") as countdown:
        next_line = time.monotonic() + PROGRESS_EVERY_S
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 1.0))
            countdown.n = round(duration_s - max(0.0, deadline - time.monotonic()))
            if countdown.disable and time.monotonic() >= next_line and deadline - time.monotonic() > 0.5:
                next_line += PROGRESS_EVERY_S
                print(f"  in Alertmanager: {_state(client, alert)}; resolving in "
                      f"{deadline - time.monotonic():.0f} s", flush=True)
            elif not countdown.disable:
                countdown.set_postfix_str(f"Alertmanager: {_state(client, alert)}", refresh=True)


def run(args: argparse.Namespace, cfg: Any) -> int:
    url = args.url or cfg.alerting.alertmanager_url
    if not url:
        print("ncclwatch alert-test: no Alertmanager configured: set alerting.alertmanager_url "
              "(or NCCLWATCH_ALERTING_ALERTMANAGER_URL) or pass --url", file=sys.stderr)
        return 2
    try:
        client = AlertmanagerClient.from_config(cfg.alerting, url)
        static = parse_static_labels(cfg.alerting.alert_labels)
        links = AlertLinks(cfg.alerting.grafana_url, cfg.alerting.runbook_base_url)
    except ValueError as e:
        print(f"ncclwatch alert-test: {e}", file=sys.stderr)
        return 2
    alert = build_test_alert(args.severity, args.job, args.duration, links, static, time.time_ns())
    labels = alert["labels"]
    try:
        client.post_alerts([alert])
    except AlertmanagerError as e:
        print(f"ncclwatch alert-test: Alertmanager at {url} is not reachable or refused the "
              f"alert, nothing was sent: {e}", file=sys.stderr)
        return 1
    receivers = _receivers(client, alert)
    routed = ", ".join(receivers) if receivers else "unknown (not visible in /api/v2/alerts)"
    print(f"sent {TEST_ALERT_NAME} severity={labels['severity']} test=true "
          f"anomaly_id={labels['anomaly_id']} to {url}; routed to: {routed}", flush=True)
    try:
        _wait(client, alert, max(0.0, args.duration))
    except KeyboardInterrupt:
        print("interrupted: resolving now", file=sys.stderr)
    alert["endsAt"] = iso(time.time_ns())
    deadline = time.monotonic() + RESOLVE_RETRY_S
    delay_s = 0.5
    while True:
        try:
            client.post_alerts([alert])
            break
        except AlertmanagerError as e:
            if time.monotonic() + delay_s > deadline:
                print(f"ncclwatch alert-test: could not deliver the resolution ({e}); the alert "
                      f"ends by itself at {iso(time.time_ns() + int(ENDS_MARGIN_S * 1e9))} "
                      "at the latest", file=sys.stderr)
                return 1
            time.sleep(delay_s)
            delay_s = min(delay_s * 2, 8.0)
    print(f"resolved {TEST_ALERT_NAME} anomaly_id={labels['anomaly_id']}", flush=True)
    return 0
