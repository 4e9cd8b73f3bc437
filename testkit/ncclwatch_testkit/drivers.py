"""Test helpers for the detector drivers (watch, worker, replay).

Spools written the way the plugin writes them; for the real Kafka broker: unique topics
per test, publishing records the way the forwarder does (keys, Kafka timestamps =
record times), reading a topic back, and running ``ncclwatch worker`` as a subprocess.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ncclwatch.detectors.stream import JobDetectors, KeyDetectors, job_partition
from ncclwatch.ingest.recording import order_key, record_time_ns

from ncclwatch import routing
from ncclwatch.config import TOPIC_NAME_FIELDS, load
from ncclwatch.records import ThroughputRecord, WindowSummary, to_json
from ncclwatch.rules import bandwidths_gbs
from ncclwatch_testkit import services as testing
from ncclwatch_testkit.synth import op_record

T0_NS = 1_763_800_000 * 10**9  # a whole second, so windows line up with the generator's


def _op(job, host, pid, rank, comm, transport, nranks, nnodes, seq, start_ns, nbytes, busbw_gbs):
    _, bus = bandwidths_gbs("AllReduce", nbytes, nranks, 1_000_000)
    exec_ns = int(1_000_000 * bus / busbw_gbs)  # the time that gives this busbw
    return op_record(job=job, host=host, pid=pid, gpu=f"GPU-{pid}", comm=comm, rank=rank, seq=seq,
                     start_ns=start_ns, nbytes=nbytes, nranks=nranks, nnodes=nnodes, exec_ns=exec_ns,
                     comm_name="dp" if transport == "net" else "tp", transport=transport)


def write_spool(spool: Path, *, job="job-w", seconds=60, degrade_from_s=40, loss=0.35, first_s=0, seed=7) -> dict:
    """A 2-node, 2-GPU-per-node job as the plugin spools it: one file per process.

    Rail layout: GPU i of each node shares a data-parallel communicator with GPU i of the
    other node (2 ranks, 2 nodes: transport ``net``, AllReduce 32 MiB), and the two GPUs
    of a node share a tensor-parallel one (``nvlink``, AllReduce 1 MiB); each runs 4
    times a second. From ``degrade_from_s`` on the network path loses ``loss`` of its
    bandwidth and the job's throughput drops 13 %.
    """
    rnd = random.Random(seed * 1000 + first_s)
    d = spool / job
    d.mkdir(parents=True, exist_ok=True)
    for node, host in enumerate(("node-a", "node-b")):
        for gpu in range(2):
            pid = 1000 + 10 * node + gpu
            net_comm = f"0x00000000000000a{gpu}"
            nvl_comm = f"0x00000000000000b{node}"
            lines = []
            for s in range(first_s, seconds):
                degraded = s >= degrade_from_s
                for k in range(4):
                    t = T0_NS + s * 10**9 + k * 250_000_000 + pid * 1000
                    net = 20.0 * (1 - loss if degraded else 1.0) * rnd.uniform(0.98, 1.02)
                    nvl = 150.0 * rnd.uniform(0.98, 1.02)
                    seq = s * 4 + k
                    lines.append(_op(job, host, pid, node, net_comm, "net", 2, 2, seq, t, 32 << 20, net))
                    lines.append(
                        _op(
                            job,
                            host,
                            pid,
                            gpu,
                            nvl_comm,
                            "nvlink",
                            2,
                            1,
                            seq,
                            t + 100_000_000,
                            1 << 20,
                            nvl,
                        )
                    )
            name = f"{host}-GPU-{pid}-{pid}.{first_s:06d}.jsonl"
            (d / name).write_text("".join(to_json(r) + "\n" for r in lines))
    tp = [
        ThroughputRecord(
            job=job,
            host="node-a",
            rank=-1,
            ts_ns=T0_NS + (s + 1) * 10**9,
            step=s,
            tflops_per_gpu=(310.0 if s < degrade_from_s else 270.0) * rnd.uniform(0.99, 1.01),
            tokens_per_s=None,
            source="fixture",
        )
        for s in range(first_s, seconds)
    ]
    (d / f"node-a-throughput-999.{first_s:06d}.jsonl").write_text("".join(to_json(r) + "\n" for r in tp))
    return {"job": job, "degrade_ns": T0_NS + degrade_from_s * 10**9}


KAFKA_CLIENT = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 2000}


def topics_env(kafka_bootstrap: str, partitions: int = 2) -> dict[str, str]:
    """Environment overrides that point every ncclwatch command at fresh topics."""
    u = testing.unique_name("dt")
    return {
        "NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        **{f"NCCLWATCH_TOPICS_{k.upper()}": f"{u}.{k}" for k in TOPIC_NAME_FIELDS},
        "NCCLWATCH_TOPICS_PARTITIONS": str(partitions),
        "NCCLWATCH_DETECTOR_METRICS_PORT": "-1",
        "NCCLWATCH_ALERTING_ALERTMANAGER_URL": "",
        **testing.RECORDED_TOPICS_ENV,
    }


def config_of(env: dict[str, str]):
    return load(None, environ=env)


def create_topics(env: dict[str, str]) -> None:
    cfg = config_of(env)
    for name in (cfg.topics.ops, cfg.topics.telemetry, cfg.topics.windows, cfg.topics.throughput):
        testing.kafka_create_topic(cfg.kafka.bootstrap_servers, name, cfg.topics.partitions)


def topic_for(env: dict[str, str], record: Any) -> str:
    return routing.topic_for(config_of(env).topics, record.KIND)


def publish(env: dict[str, str], records: list, extra: list[tuple[str, bytes | None, bytes]] = ()) -> None:
    """Records as the forwarder publishes them; ``extra`` = raw (topic, key, value) messages."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=env["NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS"], acks="all", linger_ms=5)
    topics = config_of(env).topics
    try:
        for rec in records:
            producer.send(
                routing.topic_for(topics, rec.KIND),
                key=routing.key_for(rec, topics),  # as the forwarder keys them
                value=to_json(rec).encode(),
                timestamp_ms=record_time_ns(rec) // 10**6,
            )
        for topic, key, value in extra:
            producer.send(topic, key=key, value=value)
        producer.flush()
    finally:
        producer.close()


def read_topic(bootstrap: str, topic: str, *, min_count: int = 0, idle_s: float = 1.0, timeout_s: float = 60.0) -> list:
    """Every message of a topic (all partitions, from the beginning), in (timestamp, partition,
    offset) order; waits until ``min_count`` arrived, then until none came for ``idle_s``."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, **KAFKA_CLIENT)
    try:
        deadline = time.monotonic() + timeout_s
        parts = None
        while not parts:
            parts = consumer.partitions_for_topic(topic)
            if not parts:
                if time.monotonic() > deadline:
                    return []
                time.sleep(0.2)
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        out: list = []
        last_new = time.monotonic()
        while time.monotonic() < deadline:
            batch = consumer.poll(timeout_ms=200)
            for msgs in batch.values():
                out.extend(msgs)
            if any(batch.values()):
                last_new = time.monotonic()
            elif len(out) >= min_count and time.monotonic() - last_new >= idle_s:
                break
        out.sort(key=lambda m: (m.timestamp, m.partition, m.offset))
        return out
    finally:
        consumer.close()


def read_events(env: dict[str, str], **kwargs: Any) -> list[dict]:
    msgs = read_topic(env["NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS"], env["NCCLWATCH_TOPICS_ANOMALIES"], **kwargs)
    return [json.loads(m.value) for m in msgs]


def committed(env: dict[str, str], group: str) -> dict[tuple[str, int], int]:
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=env["NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS"])
    try:
        offsets = admin.list_group_offsets(group).get(group, {})  # kafka-python 3: by group
        return {(tp.topic, tp.partition): om.offset for tp, om in offsets.items()}
    finally:
        admin.close()


def end_offsets(env: dict[str, str], topics: list[str]) -> dict[tuple[str, int], int]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=env["NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS"])
    try:
        tps = [TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t) or [])]
        return {(tp.topic, tp.partition): o for tp, o in consumer.end_offsets(tps).items()}
    finally:
        consumer.close()


def wait_consumed(env: dict[str, str], group: str, topics: list[str], timeout_s: float = 60.0) -> None:
    """Until the group's committed offsets reached the end of every partition of ``topics``."""
    deadline = time.monotonic() + timeout_s
    while True:
        ends = end_offsets(env, topics)
        done = committed(env, group)
        if all(done.get(tp, 0) >= end for tp, end in ends.items() if end > 0):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"group {group} did not consume {topics}: committed {done}, ends {ends}")
        time.sleep(0.3)


class WorkerProcess:
    """``ncclwatch worker`` as a subprocess; its stderr goes to a file for the test's eyes."""

    def __init__(self, env: dict[str, str], app_id: str, log_dir: Path, *args: str):
        self.env = dict(os.environ, **env)
        self.app_id = app_id
        self.log_dir = log_dir
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> WorkerProcess:
        self.starts += 1
        # several workers of one app (one consumer group) each have a log of their own
        name = f"worker-{self.app_id}-{self.starts}"
        self.log_path = self.log_dir / f"{name}.log"
        n = 1
        while self.log_path.exists():
            n += 1
            self.log_path = self.log_dir / f"{name}-{n}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop/kill)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ncclwatch.cli",
                "worker",
                "--app-id",
                self.app_id,
                "--metrics-port",
                "-1",
                *self.args,
            ],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        return self

    def wait_assigned(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "assigned" not in self.log_path.read_text():
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker not assigned partitions in {timeout_s}s:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        """The log's tail, for assertion messages."""
        return self.full_output()[-5000:]

    def full_output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: no goodbye, no last commit, no flush."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def reference_events(cfg_env: dict[str, str], records: list) -> list:
    """What the detectors give for these records in one process, in time order."""
    cfg = config_of(cfg_env)
    det = JobDetectors(cfg.detector, partitions=cfg.topics.partitions)
    events = []
    for rec in sorted(records, key=order_key):
        events += det.process(rec)
    return events


def staged_reference_events(cfg_env: dict[str, str], records: list) -> list:
    """What the two stages give for these records in one process: each windows
    partition's key stage, marking its progress after each window, and the job stage."""
    cfg = config_of(cfg_env)
    n = cfg.topics.partitions
    keys = KeyDetectors(cfg.detector)
    jobs = JobDetectors(cfg.detector, partitions=n, staged=True)
    events = []
    for rec in records:  # each partition reads its windows in the order published
        if rec.KIND == "window":
            p = job_partition(KeyDetectors.state_key(rec), n)
            for x in keys.process(rec, p):
                events += jobs.process(x)
            for m in keys.marks({p: False}):
                events += jobs.mark(m)
        elif rec.KIND != "op":
            events += jobs.process(rec)
    for m in keys.marks(dict.fromkeys(range(n), True)):  # every partition read to the end
        events += jobs.mark(m)
    return events


def scenario_records(names: list[str]) -> list:
    """Several labelled scenarios as the forwarders would publish them together.

    Each scenario's own list is in its publication order (windows a second or so after
    they end, node by node); the scenarios run at the same time, so they are merged by
    about when each record would have been published, keeping each one's own order.
    """
    import heapq

    from ncclwatch_testkit import scenarios

    delay_ns = {"window": 10**9, "throughput": 50_000_000}

    def emitted(r: Any) -> int:
        return record_time_ns(r) + delay_ns.get(r.KIND, 0)

    lists = [scenarios.generate(scenarios.by_name(n))[0] for n in names]
    return list(heapq.merge(*lists, key=emitted))


def identity(ev: Any) -> tuple:
    """What must be equal between drivers: which anomaly, what state, when, and why."""
    d = (
        ev
        if isinstance(ev, dict)
        else {f: getattr(ev, f) for f in ("id", "type", "state", "job", "key", "start_ns", "attribution")}
    )
    return (
        d["id"],
        d["type"],
        d["state"],
        d["job"],
        json.dumps(d["key"], sort_keys=True),
        d["start_ns"],
        d["attribution"],
    )


def window_scenario(
    job: str = "job-k",
    *,
    seconds: int = 60,
    degrade_from_s: int = 40,
    recover_at_s: int | None = None,
    t0_ns: int = 1_763_800_000 * 10**9,
    loss: float = 0.35,
) -> list:
    """Window summaries (2 network keys, 1 NVLink key, 2 ranks each) and job throughput, as the
    forwarder would publish them; the network keys lose ``loss`` between ``degrade_from_s`` and
    ``recover_at_s``."""
    import random
    import zlib

    rnd = random.Random(zlib.crc32(job.encode()))
    keys = [
        ("0x00000000000000a0", "dp", "AllReduce", "32MiB", "net", 20.0),
        ("0x00000000000000a1", "dp", "AllReduce", "32MiB", "net", 20.0),
        ("0x00000000000000b0", "tp", "AllReduce", "1MiB", "nvlink", 150.0),
    ]
    out: list = []
    for s in range(seconds):
        degraded = s >= degrade_from_s and (recover_at_s is None or s < recover_at_s)
        for comm, name, op, bucket, transport, bw in keys:
            for rank in range(2):
                v = bw * (1 - loss if degraded and transport == "net" else 1.0) * rnd.uniform(0.98, 1.02)
                exec_ns = int((32 << 20 if bucket == "32MiB" else 1 << 20) / v)
                out.append(
                    WindowSummary(
                        job=job,
                        host=f"node-{rank}" if transport == "net" else "node-0",
                        comm=comm,
                        comm_name=name,
                        op=op,
                        size_bucket=bucket,
                        transport=transport,
                        rank=rank,
                        nranks=2,
                        start_ns=t0_ns + s * 10**9,
                        end_ns=t0_ns + (s + 1) * 10**9,
                        count=4,
                        bytes=4 * (32 << 20 if bucket == "32MiB" else 1 << 20),
                        exec_ns_min=exec_ns,
                        exec_ns_p50=exec_ns,
                        exec_ns_p95=exec_ns,
                        exec_ns_max=exec_ns,
                        busbw_gbs_p50=v,
                        first_seq=4 * s,
                        last_seq=4 * s + 3,
                    )
                )
        out.append(
            ThroughputRecord(
                job=job,
                host="node-0",
                rank=-1,
                ts_ns=t0_ns + (s + 1) * 10**9,
                step=s,
                tflops_per_gpu=(270.0 if degraded else 310.0) * rnd.uniform(0.99, 1.01),
                tokens_per_s=None,
                source="fixture",
            )
        )
    return out


def recorded_runs_through_worker(kafka_bootstrap: str, tmp: Path, archives: list[Path],
                                 sources: Callable[[Path], tuple[list, Any]]) -> dict:
    """Recorded GPU runs (``bench/scenarios`` archives) the way a cluster sees them: each
    through its own ``ncclwatch forward --once`` (its spool, or Inspector logs + training
    logs) into fresh topics, then one ``ncclwatch worker`` over them; and local mode over
    the same records. ``sources``: a run directory's sources and read options
    (``bench/detectors/eval_gpu_runs.sources``). Returns the worker's events, local
    mode's per job, the unpacked runs' directory and the worker's log."""
    import tarfile

    from ncclwatch.detectors import watch
    from ncclwatch.ingest.recording import ReadStats, read_recording

    env = topics_env(kafka_bootstrap)
    create_topics(env)
    records: list = []
    names = []
    for a in archives:
        with tarfile.open(a) as tar:
            tar.extractall(tmp, filter="data")
        names.append(a.name.removesuffix(".tar.gz"))
    # Forwarded in the order they were recorded, as one node's forwarder would have
    # published them (a partition is a FIFO: a run forwarded after a later one would
    # reach the worker with its time running backwards).
    for name in sorted(names, key=lambda n: json.loads((tmp / n / "run.json").read_text())["launched_ns"]):
        run = tmp / name
        srcs, options = sources(run)
        records += read_recording(srcs, ReadStats(), options)
        args = ["--state-dir", str(tmp / "state" / name), "--node-id", "gpu-box",
                "--no-delete-acked", "--compression", "gzip", "--metrics-port", "-1"]
        if srcs[0].name == "spool":  # the plugin's (and the job's throughput, if it wrote any)
            args += ["--spool", str(srcs[0])]
        else:  # an Inspector user
            empty = tmp / "empty" / name
            empty.mkdir(parents=True)
            args += ["--spool", str(empty), "--inspector-dir", str(srcs[0])]
        if options.training_logs:  # the throughput the job logged (Inspector's, Megatron's own runs)
            args += ["--job", options.job]
            for log in options.training_logs:
                args += ["--training-log", log]
        fwd = subprocess.run([sys.executable, "-m", "ncclwatch.cli", "forward", "--once", *args],
                             env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
        assert fwd.returncode == 0, (name, fwd.stderr[-3000:])
    # Local mode over the same runs together, as the worker's partitions hold them (a
    # run's records move the stream time of the jobs it shares a partition with).
    records.sort(key=order_key)
    local: dict[str, list] = {}
    for e in watch.detect(load(None, environ=env), records):
        local.setdefault(e.job, []).append(json.loads(to_json(e)))
    expected = sum(len(v) for v in local.values())
    worker = WorkerProcess(env, testing.unique_name("gpu"), tmp).start()
    try:
        events = read_events(env, min_count=expected, idle_s=8.0, timeout_s=240)
    finally:
        worker.stop()
    return {"events": events, "local": local, "tmp": tmp, "log": worker.output()}


def recorded_event(e: dict) -> tuple:
    """What must be equal between the worker's and local mode's events of recorded runs:
    which incident, what state, when, why, how severe, and which rank of which
    communicator it names."""
    return (e["job"], e["id"], e["type"], e["state"], e["attribution"], e["start_ns"], e["severity"],
            e.get("rank"), (e.get("evidence") or {}).get("comm"))


def worker_and_local(got: dict) -> tuple[list[tuple], list[tuple]]:
    """:func:`recorded_runs_through_worker`'s two sides as sorted :func:`recorded_event` lists."""
    return (sorted(map(recorded_event, got["events"])),
            sorted(recorded_event(e) for evs in got["local"].values() for e in evs))
