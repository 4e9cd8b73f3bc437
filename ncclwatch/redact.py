"""Secrets never reach a log line, whoever writes it and however logging is set up.

Libraries log what they are given: kafka-python's clients log their whole configuration
(``sasl_plain_password``, ``ssl_password``) at debug level, aiokafka and Faust log broker
addresses, an exception may quote a URL. Filters on handlers miss handlers added later
(Faust configures its own) and loggers that do not propagate, so :func:`install` wraps
the log *record factory*: every record any logger creates, at any level, has the
configured secrets replaced by ``<redacted>`` in its message and its traceback before a
handler sees it.

What is redacted: every config field marked secret (``config._secret()``: the Kafka SSL
and SASL passwords, the Alertmanager password and bearer token), the forms they are
sent in (HTTP basic auth), the bearer token file's content, and the Kafka bootstrap
addresses (``host:port`` and ``host``; only their count is logged, see
``kafka_sink.describe``). Values shorter than 3 characters are not redacted (they
would blank out every such substring of every line; such a password is no secret).

>>> r = Redactor(["hunter22", "broker-7:9093", "broker-7"])
>>> r.redact("connect broker-7:9093 as u/hunter22 then broker-7")
'connect <redacted> as u/<redacted> then <redacted>'
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import threading
from collections.abc import Iterable
from typing import Any

MASK = "<redacted>"
MIN_LEN = 3


class Redactor:
    """Replaces each needle (longest first, so ``host:port`` goes before ``host``)."""

    def __init__(self, needles: Iterable[str]):
        self.needles = sorted({n for n in needles if n and len(n) >= MIN_LEN}, key=len, reverse=True)

    def redact(self, text: str) -> str:
        for n in self.needles:
            if n in text:
                text = text.replace(n, MASK)
        return text

    def scrub(self, record: logging.LogRecord) -> None:
        """Redact a record in place: its message (args folded in) and its traceback."""
        if not self.needles:
            return
        try:
            msg = record.getMessage()
        except Exception:  # a bad format string: logging reports it itself, later
            return
        clean = self.redact(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            text = logging.Formatter().formatException(record.exc_info)
            clean = self.redact(text)
            if clean != text:
                record.exc_text = clean
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)


def kafka_needles(kafka: Any) -> list[str]:
    """The Kafka section's secrets and bootstrap addresses."""
    out = _secret_values(kafka)
    for entry in str(getattr(kafka, "bootstrap_servers", "")).split(","):
        entry = entry.strip()
        if entry:
            out += [entry, entry.rsplit(":", 1)[0]]
    return out


def needles_of(cfg: Any) -> list[str]:
    """Everything to redact for a whole :class:`~ncclwatch.config.Config`."""
    out: list[str] = []
    for sect in dataclasses.fields(cfg):
        obj = getattr(cfg, sect.name)
        out += _secret_values(obj)
    out += kafka_needles(cfg.kafka)
    a = cfg.alerting
    if a.alertmanager_username and a.alertmanager_password:
        pair = f"{a.alertmanager_username}:{a.alertmanager_password}".encode()
        out.append(base64.b64encode(pair).decode())
    if a.alertmanager_bearer_token_file:
        try:
            with open(a.alertmanager_bearer_token_file, encoding="utf-8") as f:
                out.append(f.read().strip())
        except OSError:
            pass  # the alerting client reports an unreadable token file
    return out


def _secret_values(obj: Any) -> list[str]:
    return [str(getattr(obj, f.name)) for f in dataclasses.fields(obj)
            if f.metadata.get("secret") and getattr(obj, f.name)]


_lock = threading.Lock()
_needles: set[str] = set()
_redactor = Redactor(())
_installed = False


def install(needles: Iterable[str]) -> Redactor:
    """Redact these (and what earlier calls added) in every log record from now on."""
    global _redactor, _installed
    with _lock:
        _needles.update(needles)
        _redactor = Redactor(_needles)
        if not _installed:
            base = logging.getLogRecordFactory()

            def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
                record = base(*args, **kwargs)
                _redactor.scrub(record)
                return record

            logging.setLogRecordFactory(factory)
            _installed = True
        return _redactor


def install_for(cfg: Any) -> Redactor:
    """:func:`install` the secrets of a whole configuration (the CLI does, for every command)."""
    return install(needles_of(cfg))
