"""Every command that serves metrics binds where it is told: ``--metrics-addr`` or the config
key, 127.0.0.1 by default. Real processes, scraped over HTTP; 127.0.0.2 is another
loopback address, so a server bound there is not reachable on 127.0.0.1."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from ncclwatch_testkit import services as testing

METRICS_LINE = re.compile(r"metrics on https?://([0-9.]+):(\d+)/metrics|event=metrics_listening addr=(\S+) port=(\d+)")


@contextmanager
def serving(args: list[str], env: dict[str, str], log: Path, timeout_s: float = 60) -> Iterator[tuple[str, int]]:
    """Start ``ncclwatch ARGS``; yield the (address, port) it says it serves metrics on."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("NCCLWATCH_")}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ncclwatch.cli", *args], env={**base, **env},
                                stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)
    try:
        deadline = time.monotonic() + timeout_s
        while not (m := METRICS_LINE.search(log.read_text())):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        yield (m.group(1) or m.group(3)), int(m.group(2) or m.group(4))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def reachable(addr: str, port: int) -> bool:
    try:
        socket.create_connection((addr, port), timeout=2).close()
    except OSError:
        return False
    return True


def scrape(addr: str, port: int) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{addr}:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def assert_bound_only_to(addr: str, port: int, family: str) -> None:
    assert family in scrape(addr, port)
    other = "127.0.0.1" if addr != "127.0.0.1" else "127.0.0.2"
    assert not reachable(other, port), f"also listening on {other}:{port}"


def assert_identifies_itself(text: str, component: str) -> None:
    """``ncclwatch_build_info`` names the component, package and contract versions, and
    the process metrics are there (CPU seconds, resident memory)."""
    info = re.search(r'^ncclwatch_build_info\{([^}]*)\} 1\.0$', text, re.M)
    assert info, text[:2000]
    assert f'component="{component}"' in info.group(1) and 'contract="1"' in info.group(1)
    assert re.search(r'version="[^"]+"', info.group(1))
    assert re.search(r"^process_cpu_seconds_total \d", text, re.M)
    assert re.search(r"^process_resident_memory_bytes \d", text, re.M)


def test_watch_says_whether_its_input_is_live_so_the_lag_rule_skips_replays(tmp_path):
    from ncclwatch_testkit.synth import write_spool

    spool = tmp_path / "spool"
    write_spool(str(spool), streams=2, ops_per_stream=2000)
    env = {"NCCLWATCH_JOB_ID": "metrics-live-test"}
    with serving(["watch", str(spool), "--metrics-port", "0"], env, tmp_path / "live.log") as (addr, port):
        text = scrape(addr, port)
        assert re.search(r"^ncclwatch_detector_input_live 1\.0$", text, re.M)
        assert_identifies_itself(text, "watch")
    # a replay at 1/1000 of recorded speed: still running when scraped
    with serving(["watch", str(spool), "--speed", "0.001", "--metrics-port", "0"], env,
                 tmp_path / "replay.log") as (addr, port):
        assert re.search(r"^ncclwatch_detector_input_live 0\.0$", scrape(addr, port), re.M)


def test_watch_binds_the_metrics_addr_option_and_defaults_to_loopback(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    env = {"NCCLWATCH_JOB_ID": "metrics-addr-test"}
    with serving(["watch", str(spool), "--metrics-port", "0", "--metrics-addr", "127.0.0.2"], env,
                 tmp_path / "a.log") as (addr, port):
        assert addr == "127.0.0.2"
        assert_bound_only_to(addr, port, "ncclwatch_detector_lag_seconds")
    with serving(["watch", str(spool), "--metrics-port", "0"], env, tmp_path / "b.log") as (addr, port):
        assert addr == "127.0.0.1"
        assert_bound_only_to(addr, port, "ncclwatch_detector_lag_seconds")
    env["NCCLWATCH_DETECTOR_METRICS_ADDR"] = "127.0.0.2"  # the config key alone does it too
    with serving(["watch", str(spool), "--metrics-port", "0"], env, tmp_path / "c.log") as (addr, port):
        assert addr == "127.0.0.2"


@pytest.mark.kafka
def test_forward_binds_the_metrics_addr_option(kafka_bootstrap, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    env = {"NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
           "NCCLWATCH_TOPICS_PREFIX": testing.unique_name("maddr") + ".",
           "NCCLWATCH_INGEST_STATE_DIR": str(tmp_path / "state")}
    args = ["-v", "forward", "--spool", str(spool), "--metrics-port", "0", "--metrics-addr", "127.0.0.2"]
    with serving(args, env, tmp_path / "f.log") as (addr, port):
        assert addr == "127.0.0.2"
        assert_bound_only_to(addr, port, "ncclwatch_forwarder_")
        assert_identifies_itself(scrape(addr, port), "forward")


@pytest.mark.kafka
def test_worker_binds_the_metrics_addr_option(kafka_bootstrap, tmp_path):
    env = {"NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
           "NCCLWATCH_TOPICS_PREFIX": testing.unique_name("maddr") + ".",
           "NCCLWATCH_TOPICS_PARTITIONS": "1", "NCCLWATCH_ALERTING_ALERTMANAGER_URL": ""}
    with serving(["worker", "--metrics-port", "0", "--metrics-addr", "127.0.0.2"], env,
                 tmp_path / "w.log", timeout_s=90) as (addr, port):
        assert addr == "127.0.0.2"
        assert_bound_only_to(addr, port, "ncclwatch_worker_")
        assert_identifies_itself(scrape(addr, port), "worker")
