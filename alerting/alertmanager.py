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

Failures back off: 1 s, 2 s, 4 s, then every ``backoff_max_s`` (5 s); a success resets
it. The cap is short on purpose: a retry is one small POST (a refused connection costs
nothing), and alerts held through an outage should go out within seconds of the
recovery, not after a doubling that had reached half a minute.

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

import base64
import json
import logging
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

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


def http_send(
    method: str,
    url: str,
    body: bytes | None,
    timeout_s: float,
    *,
    context: ssl.SSLContext | None = None,
    headers: Mapping[str, str] | None = None,
) -> tuple[int, bytes]:
    """The default ``send``: urllib, JSON body, no proxies from the environment.

    Proxies are ignored because Alertmanager is normally on the cluster network and an
    inherited ``http_proxy`` would send alerts somewhere else. ``context`` verifies an
    https:// server (None: the system's CAs); ``headers`` carry the credentials.
    """
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    for name, value in (headers or {}).items():
        req.add_header(name, value)
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def auth_headers(
    username: str = "", password: str = "", bearer_token: str = "", bearer_token_file: str = ""
) -> Callable[[], dict[str, str]]:
    """What each request sends to authenticate: basic auth or a bearer token, never both.

    The token file is read per request, so a rotated token (a Kubernetes projected
    service-account token, say) is picked up without a restart.

    >>> auth_headers("am", "s3cret")()
    {'Authorization': 'Basic YW06czNjcmV0'}
    >>> auth_headers(bearer_token="t0k")()
    {'Authorization': 'Bearer t0k'}
    >>> auth_headers()()
    {}
    """
    if sum(map(bool, (username, bearer_token, bearer_token_file))) > 1:
        raise ValueError("alertmanager auth: set basic auth (username/password) or one bearer token, not several")
    if password and not username:
        raise ValueError("alertmanager auth: a password needs alertmanager_username")
    if username:
        basic = "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()
        return lambda: {"Authorization": basic}
    if bearer_token:
        return lambda: {"Authorization": f"Bearer {bearer_token}"}
    if bearer_token_file:
        path = Path(bearer_token_file)
        return lambda: {"Authorization": f"Bearer {path.read_text().strip()}"}
    return dict


def http_sender(
    *, ca_file: str = "", cert_file: str = "", key_file: str = "", headers: Callable[[], dict[str, str]] = dict
) -> SendFn:
    """An :func:`http_send` with TLS settings (CA bundle, client certificate for mutual
    TLS) and auth headers; files are checked now, so a wrong path fails at start."""
    if key_file and not cert_file:
        raise ValueError("alertmanager TLS: a key file needs alertmanager_cert_file")
    context = None
    if ca_file or cert_file:
        try:
            context = ssl.create_default_context(cafile=ca_file or None)
            if cert_file:
                context.load_cert_chain(cert_file, key_file or None)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"alertmanager TLS files: {e}") from None

    def send(method: str, url: str, body: bytes | None, timeout_s: float) -> tuple[int, bytes]:
        return http_send(method, url, body, timeout_s, context=context, headers=headers())

    return send


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
        The first retry delay after a failure, doubled per further failure up to the max
        (so the first retry after Alertmanager is back comes at most ``backoff_max_s``
        after it).
    """

    def __init__(
        self,
        url: str,
        *,
        send: SendFn = http_send,
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float = 5.0,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 5.0,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"alertmanager_url must be http(s)://..., got {url!r}")
        if urlsplit(url).password is not None:
            # it would be printed in every error message and log line that names the URL
            raise ValueError("alertmanager_url holds a password: use alertmanager_username/_password instead")
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

    @classmethod
    def from_config(cls, cfg: Any, url: str = "", **kwargs: Any) -> AlertmanagerClient:
        """From ``config.alerting``: its URL (or ``url``), TLS files and credentials."""
        url = url or cfg.alertmanager_url
        headers = auth_headers(cfg.alertmanager_username, cfg.alertmanager_password,
                               cfg.alertmanager_bearer_token, cfg.alertmanager_bearer_token_file)
        try:
            has_credentials = bool(headers())
        except OSError as e:  # the token file
            raise ValueError(f"alertmanager_bearer_token_file: {e}") from None
        if url.startswith("http://") and has_credentials:
            log.warning("alertmanager credentials go over plain http to %s: use https://", url)
        send = http_sender(ca_file=cfg.alertmanager_ca_file, cert_file=cfg.alertmanager_cert_file,
                           key_file=cfg.alertmanager_key_file, headers=headers)
        return cls(url, send=send, **kwargs)

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
