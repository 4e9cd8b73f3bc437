"""Session fixtures for the real local services (Kafka, Prometheus, Alertmanager, node-exporter).

The first test that asks for one starts them all via ``scripts/services.sh start`` (idempotent,
waits until ready). They are left running afterwards so reruns are fast; ``.ci/run`` and
``make services-stop`` stop them. There is no skipping: if a service cannot start, the test
errors with the script's output and the service's log tail.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from ncclwatch_testkit import services as testing
from ncclwatch_testkit.services import Services


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    try:
        svc = testing.ensure_started()
    except testing.ServicesError as e:
        pytest.fail(f"could not start the local test services:\n{e}", pytrace=False)
    yield svc


@pytest.fixture(scope="session")
def kafka_bootstrap(services: Services) -> str:
    """``127.0.0.1:PORT`` of the single-node KRaft broker."""
    return services.kafka_bootstrap


@pytest.fixture(scope="session")
def prometheus_url(services: Services) -> str:
    return services.prometheus_url


@pytest.fixture(scope="session")
def alertmanager_url(services: Services) -> str:
    return services.alertmanager_url


@pytest.fixture(scope="session")
def node_exporter_url(services: Services) -> str:
    return services.node_exporter_url


@pytest.fixture(scope="session")
def textfile_dir(services: Services) -> Path:
    """node-exporter's textfile collector directory: ``*.prom`` files here get scraped."""
    return services.textfile_dir


@pytest.fixture
def kafka_topic(kafka_bootstrap: str) -> str:
    """A fresh single-partition topic, created and ready."""
    name = testing.unique_name("t")
    testing.kafka_create_topic(kafka_bootstrap, name, 1)
    return name


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs to fill: a full disk for real (needs root or CAP_SYS_ADMIN, as CI has)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs for a full-disk test: {done.stderr.strip()}", pytrace=False)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)

