"""The Alertmanager client's TLS and auth settings against a real Alertmanager.

The shared Alertmanager of scripts/services.sh speaks plain HTTP, and its web settings
cannot change without a restart, so this module starts its own, private one (the same
binary) with exporter-toolkit's ``--web.config.file``: TLS with a certificate from a CA
made here, client certificates required (mutual TLS) and basic auth. Alertmanager has
no bearer tokens; a local HTTPS server on port 0 records the header instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import ssl
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from ncclwatch.alerting.alertmanager import AlertmanagerClient, AlertmanagerError
from ncclwatch.alerting.sink import AlertSink
from ncclwatch_testkit import services as testing

from ncclwatch.config import AlertingConfig, ConfigError, load
from ncclwatch.records import from_json

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

ALERTMANAGER = os.environ.get("NCCLWATCH_ALERTMANAGER_BIN", "/usr/bin/prometheus-alertmanager")
PASSWORD = "c0rrect-h0rse"


def openssl(*args: str, cwd: Path) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def make_pki(d: Path) -> None:
    """ca.crt; server.crt for 127.0.0.1 and client.crt, both signed by the CA."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=ncclwatch test CA",
            "-keyout", "ca.key", "-out", "ca.crt", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                "-out", f"{name}.csr", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=d)


def bcrypt(password: str) -> str:
    """What basic_auth_users takes; crypt(3) does bcrypt (the module is deprecated, still in 3.11)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt as c

        return c.crypt(password, c.mksalt(c.METHOD_BLOWFISH))



@dataclasses.dataclass
class SecureAM:
    url: str
    pki: Path

    def cfg(self, **over: str) -> AlertingConfig:
        base = dict(alertmanager_url=self.url, alertmanager_ca_file=str(self.pki / "ca.crt"),
                    alertmanager_cert_file=str(self.pki / "client.crt"),
                    alertmanager_key_file=str(self.pki / "client.key"),
                    alertmanager_username="ncclwatch", alertmanager_password=PASSWORD)
        return AlertingConfig(**{**base, **over})


@pytest.fixture(scope="module")
def secure_am(tmp_path_factory) -> Iterator[SecureAM]:
    assert Path(ALERTMANAGER).is_file(), f"{ALERTMANAGER} missing: run scripts/setup.sh"
    assert shutil.which("openssl"), "openssl missing"
    d = tmp_path_factory.mktemp("am-tls")
    make_pki(d)
    (d / "web.yml").write_text(
        "tls_server_config:\n"
        f"  cert_file: {d / 'server.crt'}\n  key_file: {d / 'server.key'}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {d / 'ca.crt'}\n"
        f"basic_auth_users:\n  ncclwatch: '{bcrypt(PASSWORD)}'\n"
    )
    (d / "am.yml").write_text("route:\n  receiver: 'null'\nreceivers:\n  - name: 'null'\n")
    port = testing.free_port()
    log = open(d / "alertmanager.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [ALERTMANAGER, f"--config.file={d / 'am.yml'}", f"--web.config.file={d / 'web.yml'}",
         f"--storage.path={d / 'data'}", f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=log, stderr=subprocess.STDOUT)
    am = SecureAM(f"https://127.0.0.1:{port}", d)
    try:
        client = AlertmanagerClient.from_config(am.cfg())
        deadline = time.monotonic() + 30
        while True:
            try:
                client.get_alerts()
                break
            except AlertmanagerError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError((d / "alertmanager.log").read_text()[-3000:]) from None
                time.sleep(0.2)
        yield am
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_alerts_reach_alertmanager_over_mutual_tls_with_basic_auth(secure_am):
    job = testing.unique_name("job")
    client = AlertmanagerClient.from_config(secure_am.cfg())
    client.post_alerts([{"labels": {"alertname": "NcclwatchTestAlert", "training_job": job}}])
    assert [a["labels"]["training_job"] for a in client.get_alerts(training_job=job)] == [job]


def test_a_wrong_password_is_refused_and_not_repeated_in_the_error(secure_am):
    client = AlertmanagerClient.from_config(secure_am.cfg(alertmanager_password="wrong-pass"))
    with pytest.raises(AlertmanagerError, match="HTTP 401") as e:
        client.post_alerts([{"labels": {"alertname": "X"}}])
    assert "wrong-pass" not in str(e.value)


@pytest.mark.parametrize("missing", ["client certificate", "CA"])
def test_tls_fails_without_the_client_certificate_or_the_ca(secure_am, missing):
    over = ({"alertmanager_cert_file": "", "alertmanager_key_file": ""} if missing == "client certificate"
            else {"alertmanager_ca_file": ""})
    client = AlertmanagerClient.from_config(secure_am.cfg(**over))
    with pytest.raises(AlertmanagerError):
        client.post_alerts([{"labels": {"alertname": "X"}}])


def test_the_sink_built_from_config_uses_the_tls_and_auth_settings(secure_am):
    job = testing.unique_name("job")
    cfg = load(None, environ={
        "NCCLWATCH_ALERTING_ALERTMANAGER_URL": secure_am.url,
        "NCCLWATCH_ALERTING_ALERTMANAGER_CA_FILE": str(secure_am.pki / "ca.crt"),
        "NCCLWATCH_ALERTING_ALERTMANAGER_CERT_FILE": str(secure_am.pki / "client.crt"),
        "NCCLWATCH_ALERTING_ALERTMANAGER_KEY_FILE": str(secure_am.pki / "client.key"),
        "NCCLWATCH_ALERTING_ALERTMANAGER_USERNAME": "ncclwatch",
        "NCCLWATCH_ALERTING_ALERTMANAGER_PASSWORD": PASSWORD,
    })
    assert PASSWORD not in repr(cfg)
    sink = AlertSink.from_config(cfg.alerting)
    now = time.time_ns()
    sink.handle(from_json({
        "v": 1, "kind": "anomaly", "id": testing.unique_name("an"), "type": "network_path", "state": "firing",
        "job": job, "key": {"comm": "0x00000000000000ab", "comm_name": "dp", "op": "AllReduce",
                            "size_bucket": "64MiB", "transport": "net"},
        "host": "node-3", "rank": None, "start_ns": now - 60 * 10**9, "end_ns": None, "detected_ns": now,
        "baseline_busbw_gbs": 40.0, "observed_busbw_gbs": 30.0, "effect": 0.25, "attribution": "network",
        "throughput_delta": None, "severity": "critical", "evidence": {},
    }))
    assert sink.pending() == 0, sink.stats()
    held = AlertmanagerClient.from_config(secure_am.cfg()).get_alerts(training_job=job)
    assert held and held[0]["labels"]["alertname"] == "NcclNetworkPathDegraded"


# --- bearer tokens (no Alertmanager takes them; a proxy in front of it would) --------------


class TokenServer:
    """HTTPS on 127.0.0.1:0 with the test CA's server certificate; records Authorization."""

    def __init__(self, pki: Path):
        self.seen: list[str | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.seen.append(self.headers.get("Authorization"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(pki / "server.crt", pki / "server.key")
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_bearer_token_file_is_read_per_request_so_rotation_needs_no_restart(secure_am, tmp_path):
    server = TokenServer(secure_am.pki)
    try:
        token = tmp_path / "token"
        token.write_text("first\n")
        cfg = AlertingConfig(alertmanager_url=server.url, alertmanager_ca_file=str(secure_am.pki / "ca.crt"),
                             alertmanager_bearer_token_file=str(token))
        client = AlertmanagerClient.from_config(cfg)
        client.post_alerts([{"labels": {"alertname": "X"}}])
        token.write_text("second\n")
        client.post_alerts([{"labels": {"alertname": "X"}}])
        inline = AlertmanagerClient.from_config(dataclasses.replace(
            cfg, alertmanager_bearer_token_file="", alertmanager_bearer_token="inline-t0k"))
        inline.post_alerts([{"labels": {"alertname": "X"}}])
        assert server.seen == ["Bearer first", "Bearer second", "Bearer inline-t0k"]
    finally:
        server.close()


def test_conflicting_or_leaky_auth_settings_are_refused():
    with pytest.raises(ValueError, match="not several"):
        AlertmanagerClient.from_config(AlertingConfig(alertmanager_url="https://am:9093",
                                                      alertmanager_username="u", alertmanager_bearer_token="t"))
    with pytest.raises(ValueError, match="holds a password"):
        AlertmanagerClient.from_config(AlertingConfig(alertmanager_url="https://u:pw@am:9093"))
    with pytest.raises(ValueError, match="TLS files"):
        AlertmanagerClient.from_config(AlertingConfig(alertmanager_url="https://am:9093",
                                                      alertmanager_ca_file="/nonexistent/ca.crt"))
    shown = json.dumps(dataclasses.asdict(AlertingConfig()))
    assert "alertmanager_password" in shown  # the keys exist ...
    with pytest.raises(ConfigError, match="unknown key"):  # ... and typos are caught
        load_toml('[alerting]\nalertmanager_pasword = "x"\n')


def load_toml(text: str):
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    try:
        return load(f.name, environ={})
    finally:
        os.unlink(f.name)
