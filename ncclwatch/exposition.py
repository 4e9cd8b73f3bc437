"""Serving a service's Prometheus metrics: one helper for ``forward``, ``worker`` and
``watch``, with the bind address, TLS and basic auth that Prometheus exporters take.

TLS and basic auth are configured as in Prometheus's exporter-toolkit, by a web
configuration file (``ingest.metrics_web_config`` / ``detector.metrics_web_config``)::

    tls_server_config:
      cert_file: /etc/ncclwatch/metrics.crt
      key_file: /etc/ncclwatch/metrics.key
      client_ca_file: /etc/ncclwatch/ca.crt   # optional: then clients must present a cert
    basic_auth_users:
      prometheus: $2y$10$...                   # bcrypt hash (htpasswd -nBC 10 "" | tr -d ':\\n')

Without a file the endpoint is plain HTTP with no auth, bound to 127.0.0.1 by default.
A bad file is a :class:`~ncclwatch.config.ConfigError` at start-up, never a silently open
endpoint. Passwords are checked against bcrypt hashes with crypt(3) (libxcrypt); a
verified (user, password) pair is remembered, since bcrypt costs ~0.1 s by design.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import socket
import ssl
import threading
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from ncclwatch.config import ConfigError

log = logging.getLogger(__name__)

_TLS_KEYS = {"cert_file", "key_file", "client_ca_file"}


class WebConfig:
    """A parsed exporter-toolkit web configuration (only the keys ncclwatch supports)."""

    def __init__(self, tls: dict[str, str] | None = None, users: dict[str, str] | None = None):
        self.tls = tls or {}
        self.users = users or {}

    @classmethod
    def load(cls, path: str) -> WebConfig:
        if not path:
            return cls()
        import yaml

        where = f"metrics web config {path}"
        try:
            doc = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ConfigError(f"{where}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: not YAML ({type(e).__name__})") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"{where}: expected a mapping")
        unknown = set(doc) - {"tls_server_config", "basic_auth_users"}
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        tls = doc.get("tls_server_config") or {}
        users = doc.get("basic_auth_users") or {}
        if not isinstance(tls, dict) or set(tls) - _TLS_KEYS:
            raise ConfigError(f"{where}: tls_server_config takes only {', '.join(sorted(_TLS_KEYS))}")
        if tls and not (tls.get("cert_file") and tls.get("key_file")):
            raise ConfigError(f"{where}: tls_server_config needs cert_file and key_file")
        for key in _TLS_KEYS & set(tls):
            if not Path(str(tls[key])).is_file():
                raise ConfigError(f"{where}: tls_server_config.{key}: no such file")
        if not isinstance(users, dict) or not all(
                isinstance(u, str) and isinstance(h, str) and h.startswith(("$2a$", "$2b$", "$2y$"))
                for u, h in users.items()):
            raise ConfigError(f"{where}: basic_auth_users maps user names to bcrypt hashes ($2y$...)")
        return cls({k: str(v) for k, v in tls.items()}, dict(users))

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.tls["cert_file"], self.tls["key_file"])
        if self.tls.get("client_ca_file"):
            ctx.load_verify_locations(self.tls["client_ca_file"])
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


def _crypt(password: str, hashed: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the module leaves in 3.13
        import crypt

    return crypt.crypt(password, hashed) or ""


class BasicAuth:
    """WSGI middleware: 401 unless the request carries a user and password of ``users``.

    >>> ok = BasicAuth(lambda env, start: [b"metrics"], {"p": "$2b$04$" + "x" * 53})
    >>> statuses = []
    >>> ok({}, lambda status, headers: statuses.append(status))
    [b'Unauthorized']
    >>> statuses
    ['401 Unauthorized']
    """

    def __init__(self, app: Callable, users: dict[str, str], check: Callable[[str, str], str] = _crypt):
        self.app = app
        self.users = users
        self.check = check
        self._good: set[bytes] = set()  # digests of verified user:password pairs

    def allowed(self, header: str) -> bool:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        hashed = self.users.get(user)
        if hashed is None:
            return False
        digest = hashlib.sha256(f"{user}\0{password}\0{hashed}".encode()).digest()
        if digest in self._good:
            return True
        if hmac.compare_digest(self.check(password, hashed), hashed):
            self._good.add(digest)
            return True
        return False

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        if self.allowed(environ.get("HTTP_AUTHORIZATION", "")):
            return self.app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                            ("WWW-Authenticate", 'Basic realm="ncclwatch"')])
        return [b"Unauthorized"]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that failed the TLS handshake or hung up: its problem, not a traceback
        log.debug("event=metrics_request_failed", exc_info=True)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        return None  # one line per scrape is noise, and would name the scraper


def serve(registry: CollectorRegistry, addr: str, port: int, web_config: str = "") -> WSGIServer:
    """Serve ``registry`` on ``addr:port`` (port 0: a free one, see ``server_port``) in a
    daemon thread, with the TLS and basic auth of ``web_config``; returns the server, whose
    ``scheme`` says ``http`` or ``https``. The web config is read once, here."""
    web = WebConfig.load(web_config)
    app: Callable = make_wsgi_app(registry)
    if web.users:
        app = BasicAuth(app, web.users)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    server_class = type("MetricsServer", (_Server,), {"address_family": family})
    server = make_server(addr, port, app, server_class, handler_class=_QuietHandler)
    ctx = web.ssl_context()
    if ctx is not None:
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    server.scheme = "http" if ctx is None else "https"  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, name="ncclwatch-metrics", daemon=True).start()
    return server


def serve_configured(registry: CollectorRegistry, section: Any, port: int | None = None) -> Any | None:
    """Serve ``registry`` as a config section says (``metrics_addr``, ``metrics_port``,
    ``metrics_web_config``): the one place ``forward``, ``worker`` and ``watch`` handle
    ``--metrics-port``, which overrides the section's port when given (0: any free port;
    negative: no endpoint, and None is returned). The server's ``url`` is what to print."""
    port = section.metrics_port if port is None else port
    if port < 0:
        return None
    server = serve(registry, section.metrics_addr, port, section.metrics_web_config)
    server.url = f"{server.scheme}://{section.metrics_addr}:{server.server_port}/metrics"
    return server
