"""A small synchronous client for Alertmanager's v2 API, with exponential backoff.

Synchronous on purpose: ``ncclwatch watch`` calls it inline, the Faust worker from a
thread executor (``loop.run_in_executor``), so one client serves both without an event
loop of its own. What touches the network is injected (``send``), and so is the clock
the backoff reads, so tests drive both.

>>> calls = []
>>> def fake_send(method, url, body, timeout_s):
...     calls.append((method, url, json.loads(body)))
...     return 200, b""
>>> c = AlertmanagerClient("http://am:9093/", send=fake_send)
>>> c.post_alerts([{"labels": {"alertname": "X"}}])
>>> calls
[('POST', 'http://am:9093/api/v2/alerts', [{'labels': {'alertname': 'X'}}])]

Failures back off: 1 s, 2 s, 4 s ... up to ``backoff_max_s``; a success resets it.

>>> now = [0.0]
>>> def down(method, url, body, timeout_s):
...     raise OSError("connection refused")
>>> c = AlertmanagerClient("http://am:9093", send=down, clock=lambda: now[0])
>>> c.try_post([{}]), c.retry_in_s()
(False, 1.0)
>>> c.try_post([{}])  # still backing off: not even tried
False
>>> now[0] = 1.0; c.try_post([{}]), c.retry_in_s()
(False, 2.0)
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from urllib.parse import quote

log = logging.getLogger(__name__)

# send(method, url, body or None, timeout_s) -> (HTTP status, response body); raises OSError
# when the server cannot be reached.
SendFn = Callable[[str, str, bytes | None, float], tuple[int, bytes]]


class AlertmanagerError(RuntimeError):
    """Alertmanager could not be reached or refused the request."""


class AlertmanagerRejected(AlertmanagerError):
    """Alertmanager is up but says the alerts are invalid (HTTP 400/422): resending the
    same alerts can never succeed."""


# Only validation errors mean "these alerts are bad". 401/403/404 (an auth proxy, a wrong
# path prefix) are configuration problems that get fixed, after which the same alerts go
# through: those are treated like an outage, so nothing is dropped.
REJECTED_STATUSES = frozenset((400, 422))


def http_send(method: str, url: str, body: bytes | None, timeout_s: float) -> tuple[int, bytes]:
    """The default ``send``: urllib, JSON body, no proxies from the environment.

    Proxies are ignored because Alertmanager is normally on the cluster network and an
    inherited ``http_proxy`` would send alerts somewhere else.
    """
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class AlertmanagerClient:
    """Posts alerts to ``<url>/api/v2/alerts``.

    Parameters
    ----------
    url
        Alertmanager's base URL, e.g. ``http://alertmanager:9093``.
    send
        The HTTP function (see :func:`http_send`).
    clock
        Monotonic seconds, for the backoff.
    timeout_s
        Per request.
    backoff_initial_s, backoff_max_s
        The first retry delay after a failure, doubled per further failure up to the max.
    """

    def __init__(
        self,
        url: str,
        *,
        send: SendFn = http_send,
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float = 5.0,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 60.0,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"alertmanager_url must be http(s)://..., got {url!r}")
        if backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        self.url = url.rstrip("/")
        self.send = send
        self.clock = clock
        self.timeout_s = timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._delay_s = 0.0
        self._next_try = 0.0
        self.failures = 0  # consecutive
        self.last_error = ""

    def post_alerts(self, alerts: list[dict]) -> None:
        """One attempt; raises :class:`AlertmanagerError`. Ignores the backoff."""
        # "replace": a job name decoded from JSON may hold a lone surrogate ("\udcff"),
        # which is no UTF-8; one odd name must not make every POST raise.
        text_body = json.dumps(alerts, ensure_ascii=False, separators=(",", ":"))
        body = text_body.encode("utf-8", "replace")
        url = f"{self.url}/api/v2/alerts"
        try:
            status, text = self.send("POST", url, body, self.timeout_s)
        except OSError as e:  # URLError, timeouts and refused connections are OSErrors
            raise AlertmanagerError(f"POST {url}: {e}") from e
        if status in REJECTED_STATUSES:
            raise AlertmanagerRejected(f"POST {url}: HTTP {status}: {text[:300]!r}")
        if status // 100 != 2:
            raise AlertmanagerError(f"POST {url}: HTTP {status}: {text[:300]!r}")

    def get_alerts(self, **filters: str) -> list[dict]:
        """``GET /api/v2/alerts`` (what Alertmanager holds now), for checks and tests."""
        query = "&".join(
            f"filter={quote(f'{k}={json.dumps(v)}')}" for k, v in filters.items()
        )
        url = f"{self.url}/api/v2/alerts" + (f"?{query}" if query else "")
        try:
            status, text = self.send("GET", url, None, self.timeout_s)
        except OSError as e:
            raise AlertmanagerError(f"GET {url}: {e}") from e
        if status != 200:
            raise AlertmanagerError(f"GET {url}: HTTP {status}: {text[:300]!r}")
        return json.loads(text)

    def ready(self) -> bool:
        """True when the backoff allows another attempt."""
        return self.clock() >= self._next_try

    def retry_in_s(self) -> float:
        return max(0.0, self._next_try - self.clock())

    def try_post(self, alerts: list[dict]) -> bool:
        """Post unless backing off; True on success, False on an outage (logged, backoff).

        Raises :class:`AlertmanagerRejected` when Alertmanager answers that the alerts are
        invalid: it is up, so that is no reason to back off, and the caller decides.
        """
        if not self.ready():
            return False
        try:
            self.post_alerts(alerts)
        except AlertmanagerRejected:
            self._reset()
            raise
        except AlertmanagerError as e:
            self.failures += 1
            self.last_error = str(e)
            self._delay_s = min(
                self.backoff_max_s, self._delay_s * 2 if self._delay_s else self.backoff_initial_s
            )
            self._next_try = self.clock() + self._delay_s
            log.warning("alertmanager unreachable (%d failures, retry in %.1fs): %s",
                        self.failures, self._delay_s, e)
            return False
        self._reset()
        return True

    def _reset(self) -> None:
        if self.failures:
            log.info("alertmanager reachable again after %d failures", self.failures)
        self.failures = 0
        self._delay_s = 0.0
        self._next_try = 0.0
