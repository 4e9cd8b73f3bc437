"""One configuration for every command: a TOML file plus environment overrides.

``load(path)`` reads the file once in the driver and returns a frozen :class:`Config`;
each component receives only its own section. Unknown keys are errors, not silently
ignored, and so are environment values of the wrong type. Every field can be overridden
by ``NCCLWATCH_<SECTION>_<FIELD>`` (upper case), e.g. ``NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS``.
Secrets (SASL password, TLS key password) never appear in ``repr`` or logs.

>>> cfg = load(None, environ={"NCCLWATCH_DETECTOR_THRESHOLD": "0.2"})
>>> cfg.detector.threshold, cfg.topics.ops
(0.2, 'nccl.ops')
>>> "hunter2" in repr(load(None, environ={"NCCLWATCH_KAFKA_SASL_PLAIN_PASSWORD": "hunter2"}))
False
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

DEFAULT_PATH_ENV = "NCCLWATCH_CONFIG"


class ConfigError(ValueError):
    """A configuration file or environment value that cannot be used."""


def _secret():
    return field(default="", repr=False, metadata={"secret": True})


PRODUCERS = ("kafka-python", "confluent-kafka")


@dataclass(frozen=True)
class KafkaConfig:
    """How to reach Kafka. kafka-python names, so they pass straight through."""

    bootstrap_servers: str = "127.0.0.1:9092"
    security_protocol: str = "PLAINTEXT"  # PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL
    ssl_cafile: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    ssl_password: str = _secret()
    sasl_mechanism: str = ""  # PLAIN, SCRAM-SHA-256, SCRAM-SHA-512
    sasl_plain_username: str = ""
    sasl_plain_password: str = _secret()
    client_id: str = "ncclwatch"
    # The forwarder's producer: "confluent-kafka" (librdkafka, C) or "kafka-python" (pure
    # Python, 1.2-2.2x the CPU per record: docs/BENCHMARKS.md); consumers are unaffected.
    producer: str = "confluent-kafka"

    def __post_init__(self) -> None:
        if self.producer not in PRODUCERS:
            raise ValueError(f"kafka.producer must be one of {', '.join(PRODUCERS)}, got {self.producer!r}")

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for kafka-python clients; empty settings are left out."""
        out: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers.split(","),
            "security_protocol": self.security_protocol,
            "client_id": self.client_id,
        }
        for name in (
            "ssl_cafile",
            "ssl_certfile",
            "ssl_keyfile",
            "ssl_password",
            "sasl_mechanism",
            "sasl_plain_username",
            "sasl_plain_password",
        ):
            value = getattr(self, name)
            if value:
                out[name] = value
        return out


TOPIC_NAME_FIELDS = (
    "ops", "telemetry", "windows", "verdicts", "throughput", "anomalies", "quarantine", "dead_letter",
)
WINDOW_KEYS = ("job", "comm")
_TOPIC_CHARS = re.compile(r"^[A-Za-z0-9._-]*$")  # what Kafka allows in a topic name


@dataclass(frozen=True)
class TopicsConfig:
    """Kafka topic names and layout. `prefix` goes in front of every topic name and of the
    worker's app id (so its internal topics and consumer group too): one key isolates a run."""

    # A name that already starts with the prefix is kept as it is, so the effective
    # configuration (`ncclwatch config show`) loads back to itself.
    prefix: str = ""
    ops: str = "nccl.ops"
    # drops and plugin stats, keyed by job like the windows (topic contract v2; v1 had
    # them on `ops`, keyed <job>|<host>, and the worker re-keyed them: docs/ingest.md)
    telemetry: str = "nccl.telemetry"
    windows: str = "nccl.windows"
    # What window messages are keyed by. "job": a job's windows in one partition, for the
    # one-stage worker (`ncclwatch worker`). "comm": `<job>|<comm>`, spread over every
    # partition, for the two-stage topology (`worker --stage keys` writing verdicts,
    # `worker --stage jobs` reading them): one job across many workers (docs/architecture.md).
    window_key: str = "job"
    # the key stage's verdicts and progress marks, keyed by job (window_key "comm" only)
    verdicts: str = "nccl.verdicts"
    throughput: str = "job.throughput"
    anomalies: str = "nccl.anomalies"
    quarantine: str = "ncclwatch.quarantine"
    dead_letter: str = "ncclwatch.deadletter"
    partitions: int = 4
    replication_factor: int = 1
    # retention.ms of the topics ncclwatch creates. Kafka measures it on the records'
    # timestamps, which are their own times (op and window times, detection times): keep
    # -1 (never delete) for topics of recorded data (replays, benchmarks, tests), or the
    # broker deletes them within minutes of creation (docs/ingest.md, "Retention").
    retention_ms: int = 7 * 24 * 3600 * 1000

    def __post_init__(self) -> None:
        if not _TOPIC_CHARS.match(self.prefix):
            raise ValueError(f"topics.prefix may hold only letters, digits, '.', '_' and '-', got {self.prefix!r}")
        if self.window_key not in WINDOW_KEYS:
            raise ValueError(f"topics.window_key must be one of {', '.join(WINDOW_KEYS)}, got {self.window_key!r}")
        for name in TOPIC_NAME_FIELDS:
            value = getattr(self, name)
            if not value.startswith(self.prefix):
                object.__setattr__(self, name, self.prefix + value)  # frozen: set once, here


SPOOL_TRUST = ("owner", "any")


@dataclass(frozen=True)
class IngestConfig:
    """The per-node forwarder."""

    spool_dir: str = "/var/spool/ncclwatch"
    state_dir: str = "/var/lib/ncclwatch"
    window_s: float = 1.0
    batch_size: int = 2000
    linger_ms: int = 20
    compression: str = "lz4"  # none, gzip, lz4 (lz4 costs ~0.25 us/record, gzip-9 ~13 us)
    # Records packed into one Kafka message (JSON lines, docs/ingest.md "Topics and keys"):
    # op records of one communicator, and window summaries of one job that close together.
    # Kafka and Faust cost per message, not per byte; 1 = one record per message.
    ops_per_message: int = 100
    windows_per_message: int = 50
    buffer_max_bytes: int = 256 * 1024 * 1024
    inspector_dirs: str = ""  # comma-separated NCCL Inspector output dirs to tail
    training_log: str = ""  # comma-separated training logs or globs (one file per rank)
    # Megatron-LM's ``throughput per GPU (TFLOP/s/GPU): 310.2``, NeMo 2's
    # ``TFLOPS_per_GPU: 512.3`` (its progress line, ``iteration 9/49 | ...``)
    throughput_regex: str = (r"(?:throughput per GPU \(TFLOP/s/GPU\)|\bTFLOPS_per_GPU):\s*"
                             r"(?P<tflops>[0-9.]+(?:[eE][+-]?[0-9]+)?)")
    # The zone of a training log's naive line timestamps (Megatron prints local time):
    # "local" (the zone of the process reading the log), "UTC", or an IANA name.
    trainlog_timezone: str = "local"
    # A record stamped further ahead of the forwarder's clock than this is quarantined
    # (out_of_range): one far-future op would otherwise move its stream's time so far
    # that every later op of the process arrives "late" and no window closes again.
    max_future_s: float = 3600.0
    # Which spool files the forwarder believes (docs/deploy.md "Shared nodes"): "owner"
    # reads a job directory's segments only when the directory's owner (or root, or the
    # forwarder's own user) owns them, and quarantines records of any other job than the
    # directory's (wrong_job); "any" reads every segment, as on a node with one tenant.
    spool_trust: str = "owner"
    metrics_addr: str = "127.0.0.1"
    metrics_port: int = 9465
    # exporter-toolkit web config (TLS, basic auth) of the metrics endpoint: ncclwatch/exposition.py
    metrics_web_config: str = ""

    def __post_init__(self) -> None:
        for name in ("ops_per_message", "windows_per_message"):
            if getattr(self, name) < 1:
                raise ValueError(f"ingest.{name} must be at least 1, got {getattr(self, name)}")
        if self.spool_trust not in SPOOL_TRUST:
            raise ValueError(f"ingest.spool_trust must be one of {', '.join(SPOOL_TRUST)}, "
                             f"got {self.spool_trust!r}")
        # Checked here, not where the first log line is read: a bad zone is a config error.
        if self.trainlog_timezone != "local" and self.trainlog_timezone.upper() not in ("UTC", "Z"):
            try:
                ZoneInfo(self.trainlog_timezone)
            except (ZoneInfoNotFoundError, ValueError):
                raise ValueError(
                    f"ingest.trainlog_timezone {self.trainlog_timezone!r}: not 'local', 'UTC' "
                    "or an IANA zone name") from None


@dataclass(frozen=True)
class DetectorConfig:
    """Baselines and the sustained-degradation rule."""

    threshold: float = 0.10  # relative busbw loss that counts as degraded
    sustain_windows: int = 3  # consecutive degraded windows before an anomaly fires
    recover_windows: int = 3  # consecutive healthy windows before it resolves
    recover_threshold: float = 0.05  # hysteresis: healthy means loss below this
    # A link dropping out a second or two at a time never holds `sustain_windows`
    # degraded windows in a row: a key also fires on `flap_count` degraded windows losing
    # at least `flap_threshold` among its last `flap_windows`, and then resolves only
    # after `flap_windows` healthy ones in a row. 0 turns it off.
    flap_count: int = 2
    flap_windows: int = 6
    flap_threshold: float = 0.5
    warmup_windows: int = 10
    # A comm anomaly is raised only once it costs the job this much of its throughput
    # (and is then critical); NCCL slowing down without costing the job is no page.
    throughput_drop: float = 0.05
    # A job slowed a second at a time (a GPU taken in bursts, a process stopped now and
    # then) never holds `sustain_windows` slow windows in a row, yet loses as much: its
    # throughput also fires on `throughput_flap_count` windows losing at least
    # `throughput_flap_threshold` among its last `flap_windows` (not all of one streak;
    # a two-window dip stays a dip). 0 turns it off.
    throughput_flap_count: int = 2
    throughput_flap_threshold: float = 0.2
    # A sustained throughput drop waits this many windows past the one that completed it
    # for the comm windows of its time to show a cause (a key degraded since the drop
    # began) before it is raised as "not NCCL".
    throughput_grace_windows: int = 1
    # A drop held for NCCL's trouble (keys dipping or dropping out with it) that never
    # becomes a comm anomaly of its own is raised as the job's own after this many
    # windows: a sustained loss is never left unsaid for want of a cause. 0: held for good.
    throughput_hold_windows: int = 10
    # For a job that reports no throughput: how large a sustained busbw loss must be
    # before it is raised (as a warning), since its cost cannot be measured.
    threshold_without_throughput: float = 0.25
    straggler_score: float = 0.2
    # The ranks' spread counts as a straggler's only while the others spend at least this
    # share of a window waiting for the late rank (its op count times how much shorter
    # its kernel is than the others' median): a rank arriving a fraction of a small
    # kernel later costs nobody anything, however far the ratio moved. 0 turns it off.
    straggler_min_wait: float = 0.01
    # A straggler is raised only if the job had already lost at least this share of its
    # loss now (of twice `throughput_drop` at most) in the incident's first windows: a
    # rank that has been the last to arrive for a while (at a sync AllReduce every step
    # one rank is, now and then, in clean runs too) takes no blame for a loss that
    # something else began after it. A cause costs from its start; a link's ramp does not, which is why links
    # are not held to this. 0: off.
    straggler_early_share: float = 0.6
    # A rank is raised as stalled (a `straggler` whose evidence says `stalled`) when the
    # plugin's progress records (kind `progress`) show its peers waiting this long in an
    # operation it has not reached, or show nothing from it while they wait; and only
    # once the wait is also `stall_steps` of the job's median step time (a job of 20-s
    # steps waits seconds at a barrier). 0 turns it off.
    stall_after_s: float = 3.0
    stall_steps: float = 2.0
    # A degraded window must also have lost at least this fraction of `threshold` in its
    # best op instance (the one whose rank waited least, from each rank's fastest exec):
    # a collective cannot beat its transfer, so a drop only in the typical instance is
    # the ranks arriving further apart (host skew, a busy GPU), not a slower link.
    # 0 turns the check off.
    transfer_confirm: float = 0.5
    # A link incident is raised only if its operations' share of the ranks' time rose by
    # at least this fraction of the job's throughput loss: a link that slows takes a
    # larger share, while everything slowing alike (compute contending with NCCL's
    # kernels) leaves it where it was, which is the job's own drop. 0 turns it off.
    link_share_rise: float = 0.25
    telemetry_timeout_s: float = 10.0
    # A link or straggler incident firing again this soon (stream time) after it resolved,
    # with the same type and scope, is reopened (same id, `evidence.reopened` counts)
    # instead of raised anew: an intermittent fault is one incident. 0 turns it off.
    reopen_s: float = 30.0
    # A window is degraded only if it is also this many noise sigmas below its baseline.
    z_min: float = 3.0
    # A key drifting down learns nothing for this many windows: enough for a ramp to cross
    # the threshold against where it started (0 -> 30 % in 120 s is caught as with 60),
    # short enough that a drift staying under it soon becomes the new normal (on the
    # recorded straggler run, 60 turned a 10-15 % post-fault drift of a socket comm into
    # an alert).
    drift_freeze_windows: int = 30
    # How long an incomplete rank group waits for its missing ranks, in windows: at first,
    # and at most once a forwarder is seen lagging.
    lateness_windows: int = 2
    max_lateness_windows: int = 8
    # `worker`: an input partition that says it is behind but delivers nothing for this
    # long stops holding the others back in the time merge (records then pass it, and
    # what it delivers later is late). Longer suits a broker or a machine that stalls.
    merge_max_hold_s: float = 10.0
    # `worker --stage keys`: a communicator of this many ranks or more keeps its open
    # groups' windows out of its saved state (a 16,384-rank group is ~13 MB of JSON, past
    # a Kafka message), acknowledging a window's message once its group closed.
    key_hold_ranks: int = 256
    job_evict_s: float = 3600.0  # a job silent this long (in stream time) is forgotten
    # Live drivers (`watch` tailing, `worker`): jobs that have received nothing for this
    # long in wall-clock time are treated as if stream time had moved on that long, so
    # a job that ended gets its incidents resolved (`job_silent`) and, after
    # `job_evict_s`, its state dropped. Stream time alone moves only with newer records:
    # alone on its partition, a finished job's incidents stayed open for ever. Longer
    # than a forwarder or broker outage you would not want ended. 0 turns it off.
    quiet_end_s: float = 60.0
    model_path: str = ""  # scikit-learn cold-start model from `ncclwatch fit`
    state_path: str = ""  # where `ncclwatch watch` persists baselines
    metrics_addr: str = "127.0.0.1"
    metrics_port: int = 9466
    metrics_web_config: str = ""  # as ingest.metrics_web_config
    max_metric_keys: int = 2000  # bound on per-key metric series
    # `ncclwatch worker`'s Faust data directory. Its tables live in memory and are rebuilt
    # from their changelog topic, so nothing there must survive a restart: empty means a
    # private temporary directory, removed at exit (never `<app-id>-data/` in the CWD).
    worker_data_dir: str = ""

    def __post_init__(self) -> None:
        # The knobs of 2026-11-26; the older ones are checked where they are used.
        if self.throughput_hold_windows < 0:
            raise ValueError(f"detector.throughput_hold_windows must be >= 0, got {self.throughput_hold_windows}")
        if not self.stall_after_s >= 0.0:
            raise ValueError(f"detector.stall_after_s must be >= 0 seconds, got {self.stall_after_s}")
        if not self.stall_steps >= 0.0:
            raise ValueError(f"detector.stall_steps must be >= 0, got {self.stall_steps}")
        if not 0.0 <= self.straggler_early_share <= 1.0:
            raise ValueError(f"detector.straggler_early_share must be in [0, 1], got {self.straggler_early_share}")
        if self.throughput_grace_windows < 0:
            raise ValueError(f"detector.throughput_grace_windows must be >= 0, got {self.throughput_grace_windows}")
        if not 0.0 <= self.straggler_min_wait < 1.0:
            raise ValueError(f"detector.straggler_min_wait must be in [0, 1), got {self.straggler_min_wait}")
        if not 0.0 <= self.transfer_confirm <= 1.0:
            raise ValueError(f"detector.transfer_confirm must be in [0, 1], got {self.transfer_confirm}")
        if not 0.0 <= self.link_share_rise <= 1.0:
            raise ValueError(f"detector.link_share_rise must be in [0, 1], got {self.link_share_rise}")
        if not self.reopen_s >= 0.0:
            raise ValueError(f"detector.reopen_s must be >= 0 seconds, got {self.reopen_s}")
        if not self.merge_max_hold_s > 0.0:
            raise ValueError(f"detector.merge_max_hold_s must be > 0 seconds, got {self.merge_max_hold_s}")
        if not self.quiet_end_s >= 0.0:
            raise ValueError(f"detector.quiet_end_s must be >= 0 seconds, got {self.quiet_end_s}")
        if self.flap_count and not 2 <= self.flap_count <= self.flap_windows:
            raise ValueError(f"detector.flap_count must be 0 or in [2, flap_windows = {self.flap_windows}], "
                             f"got {self.flap_count}")
        if self.flap_count and not self.threshold <= self.flap_threshold < 1.0:
            raise ValueError(f"detector.flap_threshold must be in [threshold = {self.threshold}, 1), "
                             f"got {self.flap_threshold}")
        if self.throughput_flap_count and not 2 <= self.throughput_flap_count <= self.flap_windows:
            raise ValueError("detector.throughput_flap_count must be 0 or in [2, flap_windows = "
                             f"{self.flap_windows}], got {self.throughput_flap_count}")
        if self.throughput_flap_count and not self.throughput_drop <= self.throughput_flap_threshold < 1.0:
            raise ValueError("detector.throughput_flap_threshold must be in [throughput_drop = "
                             f"{self.throughput_drop}, 1), got {self.throughput_flap_threshold}")


@dataclass(frozen=True)
class AlertingConfig:
    """Where anomaly events become alerts."""

    alertmanager_url: str = ""  # empty: print alerts instead of sending them
    # TLS towards Alertmanager (an https:// URL): CA bundle (empty: the system's), client
    # certificate and key for mutual TLS.
    alertmanager_ca_file: str = ""
    alertmanager_cert_file: str = ""
    alertmanager_key_file: str = ""
    # Auth, for Alertmanager's --web.config.file or a proxy in front of it: basic auth, or
    # a bearer token (inline or in a file re-read per request); never both.
    alertmanager_username: str = ""
    alertmanager_password: str = _secret()
    alertmanager_bearer_token: str = _secret()
    alertmanager_bearer_token_file: str = ""
    resend_interval_s: float = 60.0
    # An anomaly that fired and resolved while Alertmanager was unreachable: its firing
    # alert is sent once Alertmanager is back, its resolution this long after (at least
    # Alertmanager's group_wait + group_interval, so the firing one was notified first).
    resolve_hold_s: float = 330.0
    # Links in alerts, as on-call opens them: Grafana's external URL (dashboards) and where
    # the runbooks (docs/runbooks/<AlertName>.md) are served. Empty: no such link.
    grafana_url: str = ""
    runbook_base_url: str = ""
    alert_labels: str = ""  # extra static labels, "k=v,k2=v2"
    state_dir: str = ""  # durable outbox for alerts not yet delivered; empty: in memory only


@dataclass(frozen=True)
class Config:
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    topics: TopicsConfig = field(default_factory=TopicsConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    alerting: AlertingConfig = field(default_factory=AlertingConfig)


def _coerce(section: str, name: str, typ: type, value: Any, origin: str) -> Any:
    where = f"{origin}: {section}.{name}"
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
            return value.lower() in ("1", "true", "yes")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if isinstance(value, str):
        return value
    raise ConfigError(f"{where}: expected a string, got {value!r}")


def _section(cls: type, name: str, table: Mapping[str, Any], environ: Mapping[str, str]) -> Any:
    hints = get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) in [{name}]: {', '.join(unknown)}")
    values = {}
    for f in dataclasses.fields(cls):
        env_name = f"NCCLWATCH_{name.upper()}_{f.name.upper()}"
        if env_name in environ:
            values[f.name] = _coerce(name, f.name, hints[f.name], environ[env_name], env_name)
        elif f.name in table:
            values[f.name] = _coerce(name, f.name, hints[f.name], table[f.name], "config file")
    try:
        return cls(**values)
    except ValueError as e:  # a section that checks its values itself
        raise ConfigError(str(e)) from None


def load(path: str | Path | None = None, *, environ: Mapping[str, str] | None = None) -> Config:
    """Read the configuration: defaults, then the TOML file, then the environment.

    ``path=None`` uses ``$NCCLWATCH_CONFIG`` if set, else defaults only.
    """
    environ = os.environ if environ is None else environ
    if path is None and environ.get(DEFAULT_PATH_ENV):
        path = environ[DEFAULT_PATH_ENV]
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: {e}") from None
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    hints = get_type_hints(Config)
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ConfigError(f"unknown section(s): {', '.join(unknown)}")
    for name, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"[{name}] must be a table")
    return Config(**{name: _section(hints[name], name, data.get(name, {}), environ) for name in sections})


def example() -> str:
    """The default configuration as a commented TOML document (`ncclwatch config example`)."""
    header = (
        "# ncclwatch configuration. Every key can be overridden by the environment:\n"
        "# NCCLWATCH_<SECTION>_<KEY>, e.g. NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS=broker:9092\n\n"
    )
    return header + dumps(Config(), comments=True)


def dumps(cfg: Config, *, comments: bool = False) -> str:
    """The configuration as a TOML document, secrets redacted (`ncclwatch config show`).

    ``tomllib.loads(dumps(cfg)) == redacted(cfg)``: every value comes back as it was.

    >>> text = dumps(load(None, environ={"NCCLWATCH_TOPICS_PREFIX": "run7."}))
    >>> tomllib.loads(text)["topics"]["ops"]
    'run7.nccl.ops'
    """
    lines: list[str] = []
    hints = get_type_hints(Config)
    for name, values in redacted(cfg).items():
        if lines:
            lines.append("")
        lines.append(f"[{name}]")
        doc = inspect.cleandoc(hints[name].__doc__ or "") if comments else ""
        lines += [f"# {line}".rstrip() for line in doc.splitlines()]
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_value(value: Any) -> str:
    r"""One TOML value: bool, integer, float or basic string.

    >>> [_toml_value(v) for v in (True, 7, 0.1, 1e-05, float("inf"))]
    ['true', '7', '0.1', '1e-05', 'inf']
    >>> print(_toml_value('a "b"\\c\n\x7f'))
    "a \"b\"\\c\n\u007f"
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # Python's shortest repr ("0.1", "1e-05", "5.0") is a TOML float
    out = []
    for ch in str(value):
        code = ord(ch)
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        elif 0xD800 <= code <= 0xDFFF:
            # a lone surrogate (an undecodable byte in the environment) is no Unicode
            # scalar value, which is all a TOML string can hold
            out.append("\\ufffd")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def redacted(cfg: Config) -> dict[str, dict[str, Any]]:
    """The configuration as plain dicts with secrets replaced, safe to log."""
    out: dict[str, dict[str, Any]] = {}
    for sect in dataclasses.fields(cfg):
        obj = getattr(cfg, sect.name)
        out[sect.name] = {
            f.name: ("***" if f.metadata.get("secret") and getattr(obj, f.name) else getattr(obj, f.name))
            for f in dataclasses.fields(obj)
        }
    return out
