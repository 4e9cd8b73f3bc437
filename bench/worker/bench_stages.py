"""One large job through the two-stage Faust topology on the real broker: its key stage
in 1, 2, 4 ... ``worker --stage keys`` processes of one consumer group, one
``worker --stage jobs`` behind them.

The job is ``ncclwatch_testkit.scenarios``' synthetic job (``--nodes 2048 --gpus 8``:
16,384 GPUs, 5 keys per rank, 1 s windows) with a network fault on one node from
``--fault-at``, its forwarders' publication delays 1-3.5 s. Its windows are packed
``--windows-per-message`` per message of one communicator, keyed ``<job>|<comm>``
(``topics.window_key = "comm"``), its throughput records go to ``job.throughput``.

Each run gets fresh topics (a new prefix, unlimited retention) and fresh consumer
groups. The workers start on the empty topics; once every one is assigned and the
group has settled (no new assignment for ``--settle-s``), the input is published and
the clock starts:

- **key stage**: until the key group's committed offsets reach the end of every
  windows partition. A committed offset moves only once the window's state is saved and
  its group closed (the worker's contract), so this is the rate of windows fully
  through the key stage. CPU: the key workers' (user + sys from /proc);
- **job stage**: until the job group has committed the verdicts the key stage had
  sent by then, and the throughput records. CPU: the job worker's.

The anomaly events of every run are compared with the first run's and with the
library's two stages run in this process on the same records (``stages.run_two_stages``,
whose CPU time is the library's rate beside the workers'). Runs of different worker
counts (and ``--save-every-s`` values, passed to the workers) alternate within each
repeat, so the machine's noise spreads over all of them. ``--old COMMIT`` runs every
configuration with that commit's workers too (``git worktree`` + ``bench/ab.py``'s
import shim, as ``bench_worker.py --old``), alternating with the working tree's
(``--old-without orjson``: the old side's workers cannot import those modules).

``--bare``: after every run, the limit besides the library: a bare aiokafka consumer
(Faust's client) reads the same windows topic in a fresh process and decodes every line
with the worker's fast validated parse, timed like a worker (from after its start).
``--profile FILE``: one worker of the first run under cProfile (``--profile-stage``). ::

    .venv/bin/python bench/worker/bench_stages.py --nodes 2048 --gpus 8 --seconds 20 \\
        --workers 1,2,4 --repeats 2 [--save-every-s 0,1.0] [--old COMMIT] [--bare]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from bench_worker import CHILD, cpu_model, env_for, old_tree, proc_cpu_s
from ncclwatch_testkit import scenarios, stages
from ncclwatch_testkit import services as testing

from ncclwatch import config
from ncclwatch.records import to_json

REPO = Path(__file__).resolve().parents[2]


def job_records(nodes: int, gpus: int, seconds: int, fault_at: int) -> list:
    sc = scenarios.Scenario(
        "stages", nodes, gpus, seconds, seed=11,
        faults=(scenarios.Fault("network", fault_at, seconds, 0.3, node=1),),
        forwarder_delay_s=tuple(1.0 + 0.35 * (i % 8) for i in range(nodes)),
    )
    records, _ = scenarios.generate(sc)
    return records


def messages_of(records: list, per_message: int) -> list[tuple[str, bytes, bytes]]:
    """(topic kind, key, value): windows packed per communicator in publication order,
    a communicator's pack sent once full (or at the end); throughput one per message."""
    out: list[tuple[str, bytes, bytes]] = []
    packs: dict[bytes, list[str]] = {}
    for r in records:
        if r.KIND == "window":
            key = f"{r.job}|{r.comm}".encode()
            pack = packs.setdefault(key, [])
            pack.append(to_json(r))
            if len(pack) == per_message:
                out.append(("windows", key, "\n".join(pack).encode()))
                packs[key] = []
        elif r.KIND != "op":
            out.append(("throughput", r.job.encode(), to_json(r).encode()))
    out += [("windows", key, "\n".join(pack).encode()) for key, pack in packs.items() if pack]
    return out


def publish(cfg, messages: list) -> None:
    from kafka import KafkaProducer

    topics = {"windows": cfg.topics.windows, "throughput": cfg.topics.throughput}
    producer = KafkaProducer(bootstrap_servers=cfg.kafka.bootstrap_servers, acks=1, linger_ms=20,
                             batch_size=1 << 20, max_request_size=4 << 20, compression_type="lz4")
    for kind, key, value in messages:
        producer.send(topics[kind], key=key, value=value)
    producer.flush()
    producer.close()


class Offsets:
    def __init__(self, bootstrap: str):
        from kafka import KafkaAdminClient, KafkaConsumer

        self.admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        self.consumer = KafkaConsumer(bootstrap_servers=bootstrap)

    def ends(self, topic: str) -> dict:
        from kafka import TopicPartition

        tps = [TopicPartition(topic, p) for p in sorted(self.consumer.partitions_for_topic(topic) or [])]
        return {(tp.topic, tp.partition): o for tp, o in self.consumer.end_offsets(tps).items()}

    def committed(self, group: str) -> dict:
        offsets = self.admin.list_group_offsets(group).get(group, {})
        return {(tp.topic, tp.partition): om.offset for tp, om in offsets.items()}

    def reached(self, group: str, ends: dict) -> bool:
        done = self.committed(group)
        return all(done.get(tp, 0) >= end for tp, end in ends.items() if end > 0)

    def close(self) -> None:
        self.admin.close()
        self.consumer.close()


def start_worker(env: dict, app_id: str, stage: str, logs: Path, save_every_s: float,
                 shim: str = "", profile: str = "", without: str = "") -> tuple[subprocess.Popen, Path]:
    log_path = Path(tempfile.mkstemp(prefix=f"bench-stages-{stage}-", suffix=".log", dir=logs)[1])
    if shim:  # the old side: without the modules --old-without names
        env = {**env, "NCCLWATCH_BENCH_BLOCK": without}
    # --profile: the worker's event loop thread under cProfile, written when it stops
    prof = ["-m", "cProfile", "-o", profile] if profile else []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, *(["-c", CHILD, shim] if shim else [*prof, "-m", "ncclwatch.cli"]),
             "worker", "--stage", stage, "--app-id", app_id,
             "--metrics-port", "-1", "--save-every-s", str(save_every_s)],
            env=dict(os.environ, **env), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        )
    return proc, log_path


# The limit the key worker is held to besides the library: a bare aiokafka consumer (the
# client Faust runs on) reading the same windows topic and decoding every line with the
# fast validated parse the worker uses, in a fresh process timed like a worker (from
# after its start).
BARE_CONSUMER = r"""
import asyncio, json, resource, sys
from aiokafka import AIOKafkaConsumer
from ncclwatch.ingest.parse import parse

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

async def main(bootstrap, topic, want):
    c = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                         enable_auto_commit=False, group_id=None)
    await c.start()
    c0 = cpu()
    messages = records = 0
    while messages < want:
        for msgs in (await c.getmany(timeout_ms=1000)).values():
            for m in msgs:
                messages += 1
                for line in m.value.split(b"\n"):
                    if line:
                        parse(line)
                        records += 1
    cpu_s = cpu() - c0
    await c.stop()
    print(json.dumps({"records": records, "cpu_s": round(cpu_s, 2)}))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def bare_consume(bootstrap: str, topic: str, messages: int) -> dict:
    out = subprocess.run([sys.executable, "-c", BARE_CONSUMER, bootstrap, topic, str(messages)],
                         capture_output=True, text=True, timeout=900, cwd=REPO, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def read_events(bootstrap: str, topic: str) -> list[tuple]:
    from kafka import KafkaConsumer

    c = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                      consumer_timeout_ms=3000, enable_auto_commit=False)
    try:
        out = [json.loads(m.value) for m in c]
    finally:
        c.close()
    return sorted((e["type"], e["state"], e.get("host"), e["start_ns"]) for e in out)


def one_run(bootstrap: str, partitions: int, workers: int, save_every_s: float, messages: list, windows: int,
            args, logs: Path, shim: str = "", profile: str = "") -> dict:
    env = {**env_for(bootstrap, testing.unique_name("bs"), partitions), "NCCLWATCH_TOPICS_WINDOW_KEY": "comm"}
    cfg = config.load(None, environ=env)
    keys_id, jobs_id = testing.unique_name("bench-keys"), testing.unique_name("bench-jobs")
    stage, without = args.profile_stage, args.old_without
    procs = [start_worker(env, keys_id, "keys", logs, save_every_s, shim,
                          profile if i == 0 and stage == "keys" else "", without)
             for i in range(workers)]
    procs.append(start_worker(env, jobs_id, "jobs", logs, save_every_s, shim, profile if stage == "jobs" else "",
                              without))
    offsets = Offsets(bootstrap)
    try:
        deadline = time.monotonic() + args.timeout_s
        last_change, seen = time.monotonic(), -1
        while True:  # every worker assigned, and no rebalance for settle_s
            texts = [log.read_text() for _, log in procs]
            for (p, _), text in zip(procs, texts, strict=True):
                if p.poll() is not None:
                    raise RuntimeError(f"a worker exited:\n{text[-3000:]}")
            count = sum(t.count("assigned") for t in texts)
            if count != seen:
                seen, last_change = count, time.monotonic()
            if all("assigned" in t for t in texts) and time.monotonic() - last_change > args.settle_s:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not settle")
            time.sleep(0.2)
        keys, job = [p for p, _ in procs[:-1]], procs[-1][0]
        cpu0 = [proc_cpu_s(p.pid) for p in keys]
        job_cpu0 = proc_cpu_s(job.pid)
        t0 = time.monotonic()
        publish(cfg, messages)
        t_pub = time.monotonic() - t0
        ends = offsets.ends(cfg.topics.windows)
        if sum(ends.values()) != sum(1 for m in messages if m[0] == "windows"):
            raise RuntimeError(f"input not intact: {ends}")
        while not offsets.reached(keys_id, ends):
            if any(p.poll() is not None for p in keys) or time.monotonic() > deadline:
                raise RuntimeError("key stage did not finish:\n" + procs[0][1].read_text()[-3000:])
            time.sleep(0.2)
        t_keys = time.monotonic() - t0
        key_cpu = sum(proc_cpu_s(p.pid) - c for p, c in zip(keys, cpu0, strict=True))
        time.sleep(1.5)  # the key stage's last verdicts and marks
        job_ends = {**offsets.ends(cfg.topics.verdicts), **offsets.ends(cfg.topics.throughput)}
        while not offsets.reached(jobs_id, job_ends):
            if job.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("job stage did not finish:\n" + procs[-1][1].read_text()[-3000:])
            time.sleep(0.2)
        t_job = time.monotonic() - t0
        job_cpu = proc_cpu_s(job.pid) - job_cpu0
        time.sleep(2.0)
        events = read_events(bootstrap, cfg.topics.anomalies)
    finally:
        offsets.close()
        for p, _ in procs:
            p.terminate()
        for p, _ in procs:
            p.wait(timeout=60)
    exits = [log.read_text().strip().splitlines()[-1][:300] for _, log in procs]
    bare = {}
    if args.bare:  # the same topic, after the workers stopped
        b = bare_consume(bootstrap, cfg.topics.windows, sum(ends.values()))
        if b["records"] != windows:
            raise RuntimeError(f"the bare consumer read {b['records']} windows, not {windows}")
        bare = {"bare_consumer_cpu_s": b["cpu_s"], "bare_windows_per_cpu_s": round(windows / b["cpu_s"])}
    return {
        "workers": workers, "save_every_s": save_every_s, "publish_s": round(t_pub, 2), "key_stage_s": round(t_keys, 2),
        "windows_per_s": round(windows / t_keys), "key_cpu_s": round(key_cpu, 2),
        "windows_per_cpu_s": round(windows / key_cpu), "job_stage_done_s": round(t_job, 2),
        "job_cpu_s": round(job_cpu, 2), "events": events, "exit_lines": exits, **bare,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--nodes", type=int, default=2048)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--fault-at", type=int, default=12)
    ap.add_argument("--windows-per-message", type=int, default=50)
    ap.add_argument("--workers", default="1,2,4", help="key worker counts, comma-separated")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--save-every-s", default="1.0", help="the workers' --save-every-s, comma-separated: side by side")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settle-s", type=float, default=6.0)
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--profile", default="", help="one worker of the first run under cProfile, its stats "
                    "written to this file")
    ap.add_argument("--profile-stage", choices=("keys", "jobs"), default="keys",
                    help="which --profile takes: the first key worker, or the job worker")
    ap.add_argument("--bare", action="store_true", help="after every run, a bare aiokafka consumer + decode "
                    "reads the same windows topic: the limit besides the library")
    ap.add_argument("--old-without", default="", help="modules the old side runs without, comma-separated "
                    "(e.g. orjson: Faust encodes with it when it can import it)")
    ap.add_argument("--old", default="", help="also run this commit's workers, side by side")
    args = ap.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    saves = [float(x) for x in args.save_every_s.split(",")]
    trees = ["new", "old"] if args.old else ["new"]
    sides = [(tree, n, save) for save in saves for n in counts for tree in trees]
    bootstrap = testing.ensure_started("kafka").kafka_bootstrap
    print(json.dumps({"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.node(),
                      "cpu": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version(),
                      "command": "bench/worker/bench_stages.py", "args": vars(args)}), flush=True)
    records = job_records(args.nodes, args.gpus, args.seconds, args.fault_at)
    gc.freeze()
    windows = sum(1 for r in records if r.KIND == "window")
    messages = messages_of(records, args.windows_per_message)
    t = time.process_time()
    library = stages.run_two_stages(records, 1, config.DetectorConfig())
    library_cpu = time.process_time() - t
    want = sorted((e.type, e.state, e.host, e.start_ns) for e in library)
    print(json.dumps({"ranks": args.nodes * args.gpus, "windows": windows, "messages": len(messages),
                      "library_two_stages_cpu_s": round(library_cpu, 2),
                      "library_windows_per_cpu_s": round(windows / library_cpu),
                      "library_events": want}), flush=True)
    del records
    gc.collect()
    runs: dict[tuple[str, int, float], list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="bench-stages-") as logs, contextlib.ExitStack() as stack:
        shims = {"new": "", "old": str(old_tree(args.old, stack)) if args.old else ""}
        for i in range(args.repeats):
            for tree, n, save in sides if i % 2 == 0 else sides[::-1]:
                profile = args.profile if i == 0 and (tree, n, save) == sides[0] else ""
                r = one_run(bootstrap, args.partitions, n, save, messages, windows, args, Path(logs), shims[tree],
                            profile)
                r["tree"] = args.old if tree == "old" else "working tree"
                # the library flushes open groups at its end, a worker never does: firing ones
                r["events_as_library"] = [e for e in r["events"] if e[1] == "firing"] == [
                    e for e in want if e[1] == "firing"]
                runs[(tree, n, save)].append(r)
                print(json.dumps(r), flush=True)
    first = runs[sides[0]][0]["events"]
    for tree, save in [(tree, save) for save in saves for tree in trees]:
        base = statistics.median(r["windows_per_s"] for r in runs[(tree, counts[0], save)])
        for n in counts:
            rs = runs[(tree, n, save)]
            rate = statistics.median(r["windows_per_s"] for r in rs)
            print(json.dumps({
                "tree": rs[0]["tree"], "workers": n, "save_every_s": save,
                "windows_per_s": [r["windows_per_s"] for r in rs],
                "median": round(rate), "speedup": round(rate / base, 2),
                "of_linear": round(rate / base / (n / counts[0]), 2),
                "windows_per_cpu_s": [r["windows_per_cpu_s"] for r in rs],
                "windows_per_cpu_s_median": round(statistics.median(r["windows_per_cpu_s"] for r in rs)),
                "of_library_per_cpu_s": round(statistics.median(r["windows_per_cpu_s"] for r in rs)
                                              / (windows / library_cpu), 2),
                "job_cpu_s": [r["job_cpu_s"] for r in rs],
                **({"bare_windows_per_cpu_s": [r["bare_windows_per_cpu_s"] for r in rs],
                    "of_bare_per_cpu_s": round(
                        statistics.median(r["windows_per_cpu_s"] for r in rs)
                        / statistics.median(r["bare_windows_per_cpu_s"] for r in rs), 2)} if args.bare else {}),
                "events_same_as_library": all(r["events_as_library"] for r in rs),
                "events_same_across_runs": all(r["events"] == first for r in rs),
            }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
