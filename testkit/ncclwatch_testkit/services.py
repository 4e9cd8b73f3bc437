"""Helpers for tests that need the real local services started by ``scripts/services.sh``.

Kafka (KRaft, one broker), Prometheus, Alertmanager and node-exporter run on 127.0.0.1 on
free ports; their endpoints are recorded in ``<state>/endpoints.env`` where ``<state>`` is
``$NCCLWATCH_STATE_DIR`` or ``<repo>/var/services``.  In pytest, use the fixtures from
``tests/conftest.py`` (``services``, ``kafka_bootstrap``, ``prometheus_url``, ...); outside
pytest call :func:`ensure_started`.

>>> parse_env_file_text("# c\\nA=1\\nB=x=y\\n")
{'A': '1', 'B': 'x=y'}
>>> unique_name("t").startswith("t-")
True
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

SERVICE_NAMES = ("kafka", "prometheus", "alertmanager", "node-exporter")


def repo_root() -> Path:
    """The checkout this module lives in (it is ``testkit/ncclwatch_testkit/services.py``)."""
    return Path(__file__).resolve().parents[2]


def services_script() -> Path:
    return repo_root() / "scripts" / "services.sh"


def state_dir() -> Path:
    env = os.environ.get("NCCLWATCH_STATE_DIR")
    return Path(env) if env else repo_root() / "var" / "services"


def endpoints_file() -> Path:
    return state_dir() / "endpoints.env"


def parse_env_file_text(text: str) -> dict[str, str]:
    """``KEY=VALUE`` lines; blank lines and ``#`` comments are ignored."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        out[key.strip()] = value.strip()
    return out


@dataclass(frozen=True)
class Services:
    """Endpoints of the local test services (see ``scripts/services.sh``)."""

    kafka_bootstrap: str  # "127.0.0.1:PORT"
    prometheus_url: str  # "http://127.0.0.1:PORT"
    alertmanager_url: str
    node_exporter_url: str
    textfile_dir: Path  # node-exporter textfile collector dir: write *.prom files here
    state_dir: Path
    prometheus_targets_file: Path  # file_sd JSON, job "ncclwatch"; rewrite to add targets
    prometheus_rules_dir: Path  # *.yml rule files; POST /-/reload after changing
    alertmanager_config_file: Path  # replace and POST /-/reload

    @classmethod
    def from_env_file(cls, path: Path | None = None) -> Services:
        path = path or endpoints_file()
        env = parse_env_file_text(path.read_text())
        state = Path(env.get("NCCLWATCH_STATE_DIR", str(path.parent)))
        try:
            return cls(
                kafka_bootstrap=env["NCCLWATCH_KAFKA_BOOTSTRAP"],
                prometheus_url=env["NCCLWATCH_PROMETHEUS_URL"],
                alertmanager_url=env["NCCLWATCH_ALERTMANAGER_URL"],
                node_exporter_url=env["NCCLWATCH_NODE_EXPORTER_URL"],
                textfile_dir=Path(env["NCCLWATCH_TEXTFILE_DIR"]),
                state_dir=state,
                prometheus_targets_file=Path(
                    env.get("NCCLWATCH_PROMETHEUS_TARGETS_FILE", state / "prometheus/targets.json")
                ),
                prometheus_rules_dir=Path(
                    env.get("NCCLWATCH_PROMETHEUS_RULES_DIR", state / "prometheus/rules")
                ),
                alertmanager_config_file=Path(
                    env.get(
                        "NCCLWATCH_ALERTMANAGER_CONFIG", state / "alertmanager/alertmanager.yml"
                    )
                ),
            )
        except KeyError as e:
            raise RuntimeError(f"{path} lacks {e.args[0]}: run scripts/services.sh start") from e


class ServicesError(RuntimeError):
    """``scripts/services.sh`` failed; the message carries its output (with the log tail)."""


def run_services(command: str, *names: str, timeout: float = 600) -> str:
    """Run ``scripts/services.sh COMMAND NAMES...``; raise :class:`ServicesError` on failure."""
    args = ["bash", str(services_script()), command, *names]
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if proc.returncode != 0:
        raise ServicesError(
            f"{' '.join(args)} exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        )
    return proc.stdout


def is_running(*names: str) -> bool:
    """True iff all named services (default: all) are running."""
    args = ["bash", str(services_script()), "status", *(names or ("all",))]
    proc = subprocess.run(args, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return proc.returncode == 0


def ensure_started(*names: str) -> Services:
    """Start the named services (default: all) unless already running; return the endpoints.

    ``services.sh start`` is idempotent and waits until every service is really ready.
    """
    names = names or ("all",)
    if not (is_running(*names) and endpoints_file().exists()):
        run_services("start", *names)
    return Services.from_env_file()


def stop_service(name: str) -> None:
    """Stop one service (``kafka``, ...) cleanly; its data dir and port are kept."""
    run_services("stop", name)


def start_service(name: str) -> Services:
    """(Re)start one service on its recorded port and wait until it is ready."""
    run_services("start", name)
    return Services.from_env_file()


def log_tail(name: str, lines: int = 60) -> str:
    """The last lines of a service's log (for assertion messages)."""
    path = state_dir() / name / f"{name}.log"
    if not path.exists():
        return f"(no log at {path})"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# Topics of recorded data (tests, benchmarks, replay targets) hold records stamped with the
# recording's own times, often older than the broker's default retention (7 days): the
# broker would delete them within minutes, mid-run. Such topics never expire.
RECORDED_TOPIC_CONFIG = {"retention.ms": "-1"}
# The same for topics ncclwatch itself creates (forwarder, worker) under a test config;
# and no wall-clock end of quiet jobs (`detector.quiet_end_s`): what a worker makes of
# recorded data is compared with the library's events, which know no wall clock, and a
# partition quiet for a minute while a busy machine runs a test would end its jobs.
RECORDED_TOPICS_ENV = {"NCCLWATCH_TOPICS_RETENTION_MS": "-1", "NCCLWATCH_DETECTOR_QUIET_END_S": "0"}


def unique_name(prefix: str) -> str:
    """``prefix-<10 hex chars>``: a fresh topic/group/alert name per test."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def kafka_create_topic(
    bootstrap: str,
    name: str,
    partitions: int = 1,
    *,
    config: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> None:
    """Create a topic (replication factor 1) and wait until every partition has a leader.

    Its records never expire (``RECORDED_TOPIC_CONFIG``) unless ``config`` says otherwise.
    """
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="ncclwatch-testkit")
    try:
        with contextlib.suppress(TopicAlreadyExistsError):
            admin.create_topics(
                [NewTopic(name, partitions, 1, topic_configs={**RECORDED_TOPIC_CONFIG, **(config or {})})],
                timeout_ms=int(timeout * 1000),
            )
        deadline = time.monotonic() + timeout
        while True:
            described = admin.describe_topics([name])
            ready = [
                t
                for t in described
                if t.get("name") == name
                and t.get("error_code", 0) == 0
                and len(t.get("partitions", [])) == partitions
                and all(p.get("leader_id", p.get("leader", -1)) >= 0 for p in t["partitions"])
            ]
            if ready:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"topic {name} not ready after {timeout}s: {described}")
            time.sleep(0.1)
    finally:
        admin.close()


def http_json(url: str, data: Any = None, method: str | None = None, timeout: float = 10) -> Any:
    """GET (or POST ``data`` as JSON) and decode the JSON answer (``None`` when empty)."""
    body = None if data is None else json.dumps(data).encode()
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw.strip() else None


def prometheus_query(prometheus_url: str, query: str) -> list[dict[str, Any]]:
    """Instant query; returns ``data.result`` (vector samples with ``metric`` and ``value``)."""
    url = f"{prometheus_url}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    answer = http_json(url)
    if answer.get("status") != "success":
        raise RuntimeError(f"prometheus query {query!r} failed: {answer}")
    return answer["data"]["result"]


def wait_prometheus(
    prometheus_url: str, query: str, timeout: float = 15.0, interval: float = 0.25
) -> list[dict[str, Any]]:
    """Poll an instant query until it returns a non-empty result; raise on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        result = prometheus_query(prometheus_url, query)
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"prometheus query {query!r} still empty after {timeout}s")
        time.sleep(interval)


def reload(url: str) -> None:
    """POST ``/-/reload`` to Prometheus or Alertmanager (after changing config/rules)."""
    urllib.request.urlopen(urllib.request.Request(f"{url}/-/reload", method="POST"), timeout=30)


class TcpGate:
    """A TCP proxy in front of a service, closed or open: an outage without touching the
    shared service. Closed, its port refuses connections (as a stopped service's does);
    open, it relays every connection to ``target`` (``host:port``). Closing it also cuts
    the connections it relays.

    Kafka clients reach the gate only to bootstrap (the broker then hands out its own
    address), so for Kafka it models a broker that is down, then comes back.

    >>> gate = TcpGate("127.0.0.1:9")
    >>> gate.address.startswith("127.0.0.1:"), gate.is_open
    (True, False)
    """

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self._server is not None

    def open(self) -> None:
        if self._server is None:
            self._server = socket.create_server(("127.0.0.1", self.port))
            threading.Thread(target=self._accept, args=(self._server,), daemon=True).start()

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def kafka_cluster_id() -> str:
    """A random KRaft cluster id (base64url of a UUID) that does not start with "-":
    StorageTool would read that as an option (1 id in 64), which Kafka's own
    ``Uuid.randomUuid()`` avoids the same way (scripts/services.sh does too)."""
    import base64

    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


class PrivateKafka:
    """A single-node KRaft broker of one's own, from the jars ``scripts/setup.sh`` fetched:
    for faults the shared broker must not suffer (stopped, paused, killed) and for a
    SASL_PLAINTEXT listener it does not have. Its port stays the same across restarts.

    ``sasl_users`` (user -> password) turns on SASL/PLAIN; the broker's own user is
    ``admin``/``admin-pw``. Ends with :meth:`stop` (or as a context manager).
    """

    def __init__(self, workdir: Path, *, sasl_users: dict[str, str] | None = None, heap: str = "-Xmx384m"):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sasl_users = dict(sasl_users or {})
        libs = Path(os.environ.get("NCCLWATCH_CACHE_DIR", repo_root() / ".cache")) / "kafka" / "libs"
        if not list(libs.glob("kafka_2.13-*.jar")):
            raise ServicesError(f"Kafka jars missing in {libs}: run scripts/setup.sh")
        self.java = ["java", heap, "-XX:+UseG1GC", "-cp", f"{libs}/*"]
        self.port, self.controller_port = free_port(), free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._write_config()

    def _write_config(self) -> None:
        proto = "SASL_PLAINTEXT" if self.sasl_users else "PLAINTEXT"
        lines = [
            "process.roles=broker,controller", "node.id=1",
            f"controller.quorum.voters=1@127.0.0.1:{self.controller_port}",
            f"listeners={proto}://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            f"advertised.listeners={proto}://127.0.0.1:{self.port}",
            "controller.listener.names=CONTROLLER", f"inter.broker.listener.name={proto}",
            f"listener.security.protocol.map=CONTROLLER:PLAINTEXT,{proto}:{proto}",
            f"log.dirs={self.dir}/data", "num.partitions=1", "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=4", "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1", "group.initial.rebalance.delay.ms=0",
            "auto.create.topics.enable=true", "log.retention.ms=-1",
        ]
        if self.sasl_users:
            users = " ".join(f'user_{u}="{p}"' for u, p in {"admin": "admin-pw", **self.sasl_users}.items())
            lines += [
                "sasl.enabled.mechanisms=PLAIN", "sasl.mechanism.inter.broker.protocol=PLAIN",
                "listener.name.sasl_plaintext.plain.sasl.jaas.config=org.apache.kafka.common.security.plain."
                f'PlainLoginModule required username="admin" password="admin-pw" {users};',
            ]
        (self.dir / "server.properties").write_text("\n".join(lines) + "\n")

    def client_kwargs(self) -> dict[str, Any]:
        """kafka-python settings of the broker's own admin user."""
        kw: dict[str, Any] = {"bootstrap_servers": self.bootstrap}
        if self.sasl_users:
            kw.update(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN",
                      sasl_plain_username="admin", sasl_plain_password="admin-pw")
        return kw

    def start(self, timeout: float = 90.0) -> PrivateKafka:
        if not (self.dir / "data" / "meta.properties").exists():
            subprocess.run([*self.java, "kafka.tools.StorageTool", "format", "-t", kafka_cluster_id(), "-c",
                            str(self.dir / "server.properties")], check=True, capture_output=True, timeout=120)
        self._log = open(self.dir / "kafka.log", "a")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([*self.java, "kafka.Kafka", str(self.dir / "server.properties")],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 90.0) -> None:
        from kafka.admin import KafkaAdminClient

        deadline = time.monotonic() + timeout
        while True:
            try:
                KafkaAdminClient(**self.client_kwargs(), bootstrap_timeout_ms=2000).close()
                return
            except Exception:
                if self.proc is not None and self.proc.poll() is not None:
                    raise ServicesError(f"private Kafka exited:\n{self.log_tail()}") from None
                if time.monotonic() > deadline:
                    raise ServicesError(f"private Kafka not ready in {timeout}s:\n{self.log_tail()}") from None
                time.sleep(0.5)

    def log_tail(self, n: int = 3000) -> str:
        path = self.dir / "kafka.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def signal(self, sig: int) -> None:
        """SIGSTOP (a hung broker), SIGCONT, SIGKILL (``kill -9``)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)
        if sig == 9:
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        import signal as signals

        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signals.SIGCONT)
                os.killpg(self.proc.pid, signals.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signals.SIGKILL)
                self.proc.wait()
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> PrivateKafka:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WebhookReceiver:
    """An on-call webhook on 127.0.0.1: records Alertmanager's notifications as
    (receiver path, payload), for the tests and the reliability script."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self._cond = threading.Condition()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer._cond:
                    outer.calls.append((self.path, body))
                    outer._cond.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self, job: str) -> list[tuple[str, dict]]:
        """(receiver path, alert) for every notified alert of one training job, in arrival order."""
        with self._cond:
            return [(path, a) for path, body in self.calls for a in body["alerts"]
                    if a["labels"].get("training_job") == job]

    def wait(self, job: str, pred: Callable[[str, dict], bool], timeout_s: float = 20.0) -> dict:
        """The first notified alert of ``job`` matching ``pred(path, alert)``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for path, a in self.alerts(job):
                    if pred(path, a):
                        return {"path": path, **a}
                left = deadline - time.monotonic()
                if left <= 0:
                    got = [(p, a["labels"]["alertname"], a["status"]) for p, a in self.alerts(job)]
                    raise AssertionError(f"nothing matching for {job} in {timeout_s}s: {got}")
                self._cond.wait(left)

    def close(self):
        self.server.shutdown()
        self.server.server_close()
