"""The metrics endpoint behind TLS and basic auth (exporter-toolkit's web config), scraped
by a real Prometheus.

The shared Prometheus of scripts/services.sh scrapes its targets over plain HTTP, so this
module starts a private one (the same binary) whose scrape jobs carry the CA and the
credentials; one job has the right password, one the wrong one.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from ncclwatch_testkit import services as testing
from test_alertmanager_tls import bcrypt, make_pki
from test_metrics_addr import serving

from ncclwatch.config import ConfigError
from ncclwatch.exposition import WebConfig

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

PROMETHEUS = os.environ.get("NCCLWATCH_PROMETHEUS_BIN", "/usr/bin/prometheus")
PASSWORD = "scr4pe-me"


def get(url: str, *, auth: tuple[str, str] | None = None, ca: Path | None = None) -> tuple[int, str]:
    ctx = ssl.create_default_context(cafile=str(ca)) if ca else None
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))
    try:
        with opener.open(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    if not shutil.which("openssl"):
        pytest.fail("openssl is needed to make the test certificates (scripts/setup.sh installs it)")
    d = tmp_path_factory.mktemp("metrics-pki")
    make_pki(d)
    return d


def web_config(pki: Path, **extra: str) -> Path:
    path = pki / "web.yml"
    path.write_text(f"tls_server_config:\n  cert_file: {pki / 'server.crt'}\n  key_file: {pki / 'server.key'}\n"
                    f"basic_auth_users:\n  prometheus: '{bcrypt(PASSWORD)}'\n")
    return path


def test_https_with_basic_auth_and_what_plain_clients_get(pki, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    env = {"NCCLWATCH_JOB_ID": "metrics-tls", "NCCLWATCH_DETECTOR_METRICS_WEB_CONFIG": str(web_config(pki))}
    with serving(["watch", str(spool), "--metrics-port", "0"], env, tmp_path / "w.log") as (addr, port):
        assert "metrics on https://" in (tmp_path / "w.log").read_text()
        url = f"https://{addr}:{port}/metrics"
        assert get(url, ca=pki / "ca.crt")[0] == 401
        assert get(url, auth=("prometheus", "wrong"), ca=pki / "ca.crt")[0] == 401
        assert get(url, auth=("nobody", PASSWORD), ca=pki / "ca.crt")[0] == 401
        status, text = get(url, auth=("prometheus", PASSWORD), ca=pki / "ca.crt")
        assert status == 200 and 'ncclwatch_build_info{' in text
        with pytest.raises(OSError):  # plain HTTP to a TLS port: refused in the handshake
            get(f"http://{addr}:{port}/metrics", auth=("prometheus", PASSWORD))
        assert get(url, auth=("prometheus", PASSWORD), ca=pki / "ca.crt")[0] == 200  # still serving
        log = (tmp_path / "w.log").read_text()
        assert PASSWORD not in log and "Traceback" not in log


def test_prometheus_scrapes_with_the_right_credentials_only(pki, tmp_path):
    if not os.access(PROMETHEUS, os.X_OK):
        pytest.fail(f"{PROMETHEUS} missing: run scripts/setup.sh")
    spool = tmp_path / "spool"
    spool.mkdir()
    env = {"NCCLWATCH_JOB_ID": "metrics-tls", "NCCLWATCH_DETECTOR_METRICS_WEB_CONFIG": str(web_config(pki))}
    with serving(["watch", str(spool), "--metrics-port", "0"], env, tmp_path / "w.log") as (addr, port):
        jobs = "".join(
            f"  - job_name: {name}\n    scheme: https\n    scrape_interval: 1s\n"
            f"    tls_config: {{ca_file: {pki / 'ca.crt'}}}\n"
            f"    basic_auth: {{username: prometheus, password: {password}}}\n"
            f"    static_configs: [{{targets: ['{addr}:{port}']}}]\n"
            for name, password in (("right", PASSWORD), ("wrong", "not-it")))
        (tmp_path / "prometheus.yml").write_text("global: {scrape_interval: 1s}\nscrape_configs:\n" + jobs)
        prom_port = testing.free_port()
        log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 (closed below)
        prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=log, stderr=log)
        try:
            def query(q: str) -> dict[str, str]:
                url = f"http://127.0.0.1:{prom_port}/api/v1/query?query=" + urllib.parse.quote(q)
                try:
                    status, body = get(url)
                except urllib.error.URLError:
                    return {}
                if status != 200:
                    return {}
                return {r["metric"].get("job", ""): r["value"][1] for r in json.loads(body)["data"]["result"]}

            deadline = time.monotonic() + 60
            while not ((up := query("up")).keys() >= {"right", "wrong"} and query("ncclwatch_build_info")):
                assert time.monotonic() < deadline, (up, (tmp_path / "prometheus.log").read_text()[-2000:])
                time.sleep(0.5)
            assert up == {"right": "1", "wrong": "0"}
            assert set(query("ncclwatch_build_info")) == {"right"}
        finally:
            prom.terminate()
            prom.wait(30)
            log.close()


@pytest.mark.parametrize("text,complaint", [
    ("tls_server_config: {cert_file: /nonexistent.crt, key_file: /nonexistent.key}\n", "no such file"),
    ("tls_server_config: {cert_file: CERT}\n", "needs cert_file and key_file"),
    ("basic_auth_users: {prometheus: plain-text-password}\n", "bcrypt hashes"),
    ("http_server_config: {http2: false}\n", "unknown key(s) http_server_config"),
    ("- a list\n", "expected a mapping"),
    ("tls_server_config: [\n", "not YAML"),
])
def test_a_bad_web_config_is_a_clear_error_and_never_an_open_endpoint(pki, tmp_path, text, complaint):
    path = tmp_path / "web.yml"
    path.write_text(text.replace("CERT", str(pki / "server.crt")))
    with pytest.raises(ConfigError, match=re.escape(complaint)):
        WebConfig.load(str(path))


def test_a_bad_web_config_stops_the_command_with_exit_2(pki, tmp_path):
    path = tmp_path / "web.yml"
    path.write_text("basic_auth_users: {prometheus: plain-text-password}\n")
    spool = tmp_path / "spool"
    spool.mkdir()
    env = {**os.environ, "NCCLWATCH_JOB_ID": "metrics-tls", "NCCLWATCH_DETECTOR_METRICS_WEB_CONFIG": str(path)}
    done = subprocess.run([sys.executable, "-m", "ncclwatch.cli", "watch", str(spool), "--metrics-port", "0"],
                          capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "bcrypt hashes" in done.stderr and "Traceback" not in done.stderr
