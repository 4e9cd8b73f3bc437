"""Worker throughput: records per second through one ``ncclwatch worker`` process.

Against the real local Kafka broker of scripts/services.sh. The inputs are published
once, before any worker starts; then each repeat starts a fresh ``ncclwatch worker``
subprocess with a new app id (a new consumer group, an empty state table), and times it
from "partitions assigned" (start-up excluded) until the group's committed offsets reach
the end of every input partition. Committed offsets only move after the detectors'
state is saved (the worker's contract), so this is the rate of fully processed records.
CPU seconds of the worker process (user + sys from /proc) are reported too: the machine
is shared, the broker runs on it, and records per CPU-second is what sizes a deployment.

The input: window summaries of several copies of a healthy 2x8-GPU labelled scenario
(plus their throughput records) on ``nccl.windows``/``job.throughput``; everything goes
through decoding, the time merge, the detectors and the state table. (Until topic
contract v2 the worker also read every op record of ``nccl.ops`` to pick out drops, and
an ``ops`` mode measured that; it reads ``nccl.telemetry`` instead now.)

``--ops-per-window K`` adds what the forwarder publishes besides: K op records per
window on ``nccl.ops`` (100 per message, as shipped). ``--old COMMIT`` runs an older
commit's worker on the same topics too (``git worktree`` + ``bench/ab.py``'s import shim),
the sides alternating within every repeat; a side is done when its consumer group has
committed every input it reads (the old side also ``nccl.ops`` if that commit's worker
read it: ``--old-reads-ops``).

    .venv/bin/python bench/worker/bench_worker.py [--windows 150000]
        [--windows-per-message 50] [--repeats 3] [--out docs/bench/worker.md] [--profile FILE]
        [--ops-per-window 10] [--old COMMIT [--old-reads-ops]]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ncclwatch_testkit import services as testing

from ncclwatch import config
from ncclwatch.records import to_json

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

# The worker of another tree: its modules through a shim, the editable install's finder off.
CHILD = r"""
import os, sys
shim = sys.argv[1]
# modules the old side must run without (e.g. orjson, which Faust picks up when installed)
for name in filter(None, os.environ.get("NCCLWATCH_BENCH_BLOCK", "").split(",")):
    sys.modules[name] = None
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, shim)
from ncclwatch import cli
import ncclwatch.records as r
assert "/shim-" in r.__file__, r.__file__
sys.exit(cli.main(sys.argv[2:]))
"""


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def env_for(bootstrap: str, prefix: str, partitions: int) -> dict[str, str]:
    env = {
        "NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "NCCLWATCH_TOPICS_PARTITIONS": str(partitions),
        "NCCLWATCH_DETECTOR_METRICS_PORT": "-1",
        "NCCLWATCH_ALERTING_ALERTMANAGER_URL": "",
        **testing.RECORDED_TOPICS_ENV,  # recorded times: no retention may delete them
    }
    for k in config.TOPIC_NAME_FIELDS:
        env[f"NCCLWATCH_TOPICS_{k.upper()}"] = f"{prefix}.{k}"
    return env


def window_messages(n: int, per_message: int = 1) -> list[tuple[str, bytes, bytes, int]]:
    """(topic kind, key, value, timestamp ms) for ~n windows: copies of a healthy 2x8 job,
    ``per_message`` consecutive windows of a job packed into one message (JSON Lines)."""
    from ncclwatch.ingest.recording import record_time_ns
    from ncclwatch_testkit import scenarios

    base, _ = scenarios.generate(scenarios.by_name("steady_2x8"))
    n_windows = sum(1 for r in base if r.KIND == "window")
    copies = max(1, round(n / n_windows))
    out = []
    for c in range(copies):
        job = f"bench-{c:03d}"
        pack: list[str] = []
        for r in base:
            r2 = dataclasses.replace(r, job=job)
            ts = record_time_ns(r) // 10**6
            if r.KIND != "window":
                out.append(("throughput", job.encode(), to_json(r2).encode(), ts))
                continue
            pack.append(to_json(r2))
            if len(pack) == per_message:
                out.append(("windows", job.encode(), "\n".join(pack).encode(), ts))
                pack = []
        if pack:
            out.append(("windows", job.encode(), "\n".join(pack).encode(), ts))
    return out


def op_messages(n: int, per_message: int = 100) -> list[tuple[str, bytes, bytes, int]]:
    """``n`` op records of a 2x8 job, ``per_message`` of one communicator per message."""
    from ncclwatch_testkit.synth import stream_lines

    t0 = 1_763_800_000 * 10**9
    per_rank = max(1, n // 16)
    out = []
    for rank in range(16):
        groups: dict[str, list[bytes]] = {}
        for line in stream_lines(job="bench-ops", host=f"h{rank // 8}", pid=100 + rank, gpu=f"GPU-{rank}",
                                 rank=rank, n=per_rank, comms=4):
            comm = line.split(b'"comm":"', 1)[1].split(b'"', 1)[0].decode()
            g = groups.setdefault(comm, [])
            g.append(line)
            if len(g) == per_message:
                out.append(("ops", f"bench-ops|{comm}".encode(), b"\n".join(g), t0 // 10**6))
                groups[comm] = []
        out += [("ops", f"bench-ops|{c}".encode(), b"\n".join(g), t0 // 10**6) for c, g in groups.items() if g]
    return out


def publish(env: dict[str, str], messages: list) -> float:
    from kafka import KafkaProducer

    cfg = config.load(None, environ=env)
    topics = {"windows": cfg.topics.windows, "throughput": cfg.topics.throughput, "ops": cfg.topics.ops}
    for name in topics.values():
        testing.kafka_create_topic(cfg.kafka.bootstrap_servers, name, cfg.topics.partitions)
    producer = KafkaProducer(
        bootstrap_servers=cfg.kafka.bootstrap_servers,
        acks=1,
        linger_ms=50,
        batch_size=512 * 1024,
        compression_type="lz4",
    )
    t = time.monotonic()
    for kind, key, value, ts in messages:
        producer.send(topics[kind], key=key, value=value, timestamp_ms=ts)
    producer.flush()
    producer.close()
    return time.monotonic() - t


def committed_total(admin, group: str, topics: set[str]) -> int:
    offsets = admin.list_group_offsets(group).get(group, {})
    return sum(om.offset for tp, om in offsets.items() if tp.topic in topics and om.offset > 0)


def end_total(env: dict[str, str], topics: list[str], messages: int) -> int:
    """The inputs' end offsets, after checking that every published message is still there:
    a retention that deleted inputs would leave empty partitions and an inflated rate."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=env["NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS"])
    try:
        tps = [TopicPartition(t, p) for t in topics for p in c.partitions_for_topic(t) or []]
        end, begin = c.end_offsets(tps), c.beginning_offsets(tps)
    finally:
        c.close()
    kept = sum(end[tp] - begin[tp] for tp in tps)
    if kept != messages:
        raise RuntimeError(f"input not intact: {kept} of {messages} published messages left in {topics}")
    return sum(end.values())


def run_worker(env: dict[str, str], topics: list[str], records: int, messages: int, timeout_s: float,
               profile: str = "", shim: str = "") -> dict:
    from kafka import KafkaAdminClient

    app_id = testing.unique_name("bench-worker")
    end = end_total(env, topics, messages)
    log_path = Path(tempfile.mkstemp(prefix="bench-worker-", suffix=".log")[1])
    # --profile: the worker's event loop thread under cProfile, written when it stops
    prof = ["-m", "cProfile", "-o", profile] if profile else []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, *(["-c", CHILD, shim] if shim else [*prof, "-m", "ncclwatch.cli"]),
             "worker", "--app-id", app_id, "--metrics-port", "-1"],
            env=dict(os.environ, **env),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    admin = KafkaAdminClient(bootstrap_servers=env["NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS"])
    try:
        deadline = time.monotonic() + timeout_s
        while "assigned" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("worker did not start:\n" + log_path.read_text()[-3000:])
            time.sleep(0.05)
        t0, cpu0 = time.monotonic(), proc_cpu_s(proc.pid)
        topic_set = set(topics)
        while committed_total(admin, app_id, topic_set) < end:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("worker did not finish:\n" + log_path.read_text()[-3000:])
            time.sleep(0.2)
        t1, cpu1 = time.monotonic(), proc_cpu_s(proc.pid)
    finally:
        admin.close()
        proc.terminate()
        proc.wait(timeout=60)
    wall, cpu = t1 - t0, cpu1 - cpu0
    return {"wall_s": wall, "cpu_s": cpu, "rate": records / wall, "rate_cpu": records / cpu}


def summarize(name: str, runs: list[dict]) -> dict:
    rates = [r["rate"] for r in runs]
    cpu_rates = [r["rate_cpu"] for r in runs]
    return {
        "name": name,
        "median": statistics.median(rates),
        "min": min(rates),
        "max": max(rates),
        "median_cpu": statistics.median(cpu_rates),
        "runs": runs,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=150_000)
    ap.add_argument("--windows-per-message", type=int, action="append")
    ap.add_argument("--ops-per-window", type=int, default=0, help="op records on nccl.ops per window")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--out", help="write a Markdown report here")
    ap.add_argument("--profile", default="", help="one run under cProfile, its stats written to this file")
    ap.add_argument("--old", default="", help="also run this commit's worker, side by side")
    ap.add_argument("--old-reads-ops", action="store_true", help="the old worker reads nccl.ops (contract v1)")
    args = ap.parse_args()
    bootstrap = testing.ensure_started("kafka").kafka_bootstrap
    results = []
    with contextlib.ExitStack() as stack:
        sides = [("new", "")]
        if args.old:
            sides.append(("old", str(old_tree(args.old, stack))))
        for per in args.windows_per_message or [1, 50]:
            env = env_for(bootstrap, testing.unique_name("bw"), args.partitions)
            msgs = window_messages(args.windows, per)
            n = sum(m[2].count(b"\n") + 1 for m in msgs)
            n_ops = n * args.ops_per_window
            ops = op_messages(n_ops) if n_ops else []
            pub = publish(env, msgs + ops)
            print(f"published {n} window+throughput records ({per} windows/message) and {n_ops} op records "
                  f"in {pub:.1f} s", flush=True)
            cfg = config.load(None, environ=env)
            detect = [cfg.topics.windows, cfg.topics.throughput]
            runs: dict[str, list[dict]] = {side: [] for side, _ in sides}
            for i in range(args.repeats):
                for side, shim in sides if i % 2 == 0 else sides[::-1]:
                    topics, count = detect, len(msgs)
                    if side == "old" and args.old_reads_ops and ops:
                        topics, count = [*detect, cfg.topics.ops], len(msgs) + len(ops)
                    r = run_worker(env, topics, n, count, args.timeout_s, shim=shim,
                                   profile=args.profile if i == 0 and side == "new" else "")
                    print(f"  {side} run {i + 1}: {r['rate']:,.0f} records/s, {r['rate_cpu']:,.0f} per CPU-s",
                          flush=True)
                    runs[side].append(r)
            for side, _ in sides:
                name = f"window summaries, {per} per message, + throughput ({n:,} records)"
                if n_ops:
                    name += f", {n_ops:,} op records on nccl.ops"
                if args.old:
                    name = f"{side} ({args.old if side == 'old' else 'working tree'}): {name}"
                results.append(summarize(name, runs[side]))
    if args.out:
        write_report(Path(args.out), results, args)
    return 0


def old_tree(commit: str, stack: contextlib.ExitStack) -> Path:
    """An import shim for ``commit``'s modules (removed when ``stack`` closes)."""
    from ab import shim_for

    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-worker-old-")))
    tree = tmp / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(tree), commit], check=True)
    stack.callback(subprocess.run, ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    return shim_for(tree, tmp / "shim-old")


def write_report(path: Path, results: list[dict], args: argparse.Namespace) -> None:
    lines = [
        "# Worker throughput (`ncclwatch worker`, Faust, real Kafka)",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {os.cpu_count()} CPU cores ({cpu_model()}), shared with the Kafka broker and other work",
        f"- command: `.venv/bin/python bench/worker/bench_worker.py {' '.join(sys.argv[1:])}`",
        f"- {args.partitions} partitions per topic, one worker process, {args.repeats} repeats "
        "(fresh consumer group and empty state each), timed from partition assignment to the "
        "last committed offset",
        "",
        "| input | records/s (median) | min | max | records per worker CPU-second (median) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r['name']} | {r['median']:,.0f} | {r['min']:,.0f} | {r['max']:,.0f} | {r['median_cpu']:,.0f} |"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
