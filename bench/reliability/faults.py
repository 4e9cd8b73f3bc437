"""Fault runs: what each fault costs in records (or alerts) sent, received, lost, duplicated.

Every run uses the real programs (``ncclwatch forward`` and ``ncclwatch alert-test``'s
Alertmanager client through ``AlertSink``) against real services. Faults the shared
services of scripts/services.sh must not suffer (a broker that dies, a broker with
SASL) hit a broker of the run's own (``testing.PrivateKafka``, same jars); the
Alertmanager outage is a closed ``testing.TcpGate`` in front of the services'
Alertmanager, whose routing points at a webhook receiver of this script for the run
(as tests/test_alerting_services.py does) and is put back afterwards.

Records are op records with unique ids: *sent* is what the spool held, *received* the
distinct ids on the ops topic, *lost* = sent - received, *duplicated* = messages read -
distinct ids (at-least-once allows duplicates, never losses).

    .venv/bin/python bench/reliability/faults.py [--only kill9,outage,...] [--out results.json]

Runs: kill9 (forwarder killed -9 three times), worker_kill9 (the Faust worker killed -9 three
times, its anomaly events against an uninterrupted worker's), outage (broker killed -9 for 40 s while
the spool grows), full_disk (state on an 8 MiB tmpfs, full, while the broker is down),
poison (hostile lines in the spool), am_outage (Alertmanager unreachable 30 s while
anomalies fire and resolve), bad_credentials (wrong SASL password: forwarder and worker).
The full-disk run mounts a tmpfs (root or CAP_SYS_ADMIN).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ncclwatch_testkit import services as testing
from ncclwatch_testkit.synth import stream_lines

from ncclwatch.config import TOPIC_NAME_FIELDS
from ncclwatch.records import OpRecord, parse_line

REPO = Path(__file__).resolve().parents[2]
T0_NS = (time.time_ns() // 10**9 - 3600) * 10**9  # an hour ago: recent, whole seconds


# --- helpers --------------------------------------------------------------------------


def env_for(bootstrap: str, prefix: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": bootstrap, "NCCLWATCH_TOPICS_PARTITIONS": "3",
           **testing.RECORDED_TOPICS_ENV, **extra}
    for k in TOPIC_NAME_FIELDS:
        env[f"NCCLWATCH_TOPICS_{k.upper()}"] = f"{prefix}.{k}"
    return env


def forward_cmd(spool: Path, state: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ncclwatch.cli", "forward", "--spool", str(spool), "--state-dir", str(state),
            "--node-id", "n1", "--metrics-port", "-1", "--batch-size", "1000", "--compression", "gzip", *extra]


def write_streams(spool: Path, *, streams: int, ops: int, segment: int, first: int = 0, t0_ns: int = T0_NS,
                  interval_ns: int = 1_000_000) -> set[str]:
    """``ops`` op lines per stream (from op ``first`` on) in segments; their ids."""
    d = spool / "job-r"
    d.mkdir(parents=True, exist_ok=True)
    ids = set()
    for s in range(streams):
        lines = stream_lines(job="job-r", host="node001", pid=3000 + s, gpu=f"GPU-{s:04d}", rank=s, n=first + ops,
                             comms=2, interval_ns=interval_ns, t0_ns=t0_ns + s * 7_000)[first:]
        ids.update(parse_line(x).id for x in lines)
        for i, k in enumerate(range(0, len(lines), segment)):
            seg = d / f"node001-GPU-{s:04d}-{3000 + s}.{(first // segment) + i:06d}.jsonl"
            seg.write_bytes(b"\n".join(lines[k:k + segment]) + b"\n")
    return ids


def op_id(rec) -> str | None:
    return rec.id if isinstance(rec, OpRecord) else None


def event_id(rec) -> str | None:
    """An anomaly event's identity under at-least-once delivery: (id, state)."""
    return f"{rec.id}|{rec.state}" if rec.KIND == "anomaly" else None


def consume_ids(bootstrap: str, topic: str, timeout_s: float = 60.0, key=op_id,
                **client) -> tuple[collections.Counter, int]:
    """``key(record)`` of every record on a topic (every partition, from the start):
    counts, and how many records had no key (quarantine records among ops, say)."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=1000, **client)
    ids: collections.Counter = collections.Counter()
    other = 0
    try:
        parts = c.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        if not tps:
            return ids, 0
        c.assign(tps)
        c.seek_to_beginning(*tps)
        end = c.end_offsets(tps)
        deadline = time.monotonic() + timeout_s
        while any(c.position(tp) < end[tp] for tp in tps) and time.monotonic() < deadline:
            for msgs in c.poll(timeout_ms=500, max_records=5000).values():
                for m in msgs:
                    for line in m.value.split(b"\n"):
                        k = key(parse_line(line))
                        if k is None:
                            other += 1
                        else:
                            ids[k] += 1
        return ids, other
    finally:
        c.close()


def tally(sent: set[str], got: collections.Counter) -> dict[str, int]:
    received = len(set(got) & sent)
    return {"sent": len(sent), "received": received, "lost": len(sent) - received,
            "duplicated": sum(got.values()) - len(got)}


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def kill9_during_progress(start, progress, total: int, *, times: int = 3, timeout_s: float) -> int:
    """Start a process up to ``times`` times, each time SIGKILL it a moment after
    ``progress()`` (acknowledged bytes, committed offsets) moved on, while it is short of
    ``total``; returns the kills (fewer when a run got to the end before its kill)."""
    kills = 0
    for _ in range(times):
        p = start()
        before = progress()
        wait_for(lambda before=before: progress() > before or progress() >= total, timeout_s,
                 "progress before the kill")
        time.sleep(0.1)
        if progress() < total:
            kills += 1
        p.send_signal(signal.SIGKILL)
        p.wait()
    return kills


def acked(state: Path) -> int:
    try:
        return sum(json.loads((state / "n1" / "checkpoint.json").read_text())["acked"].values())
    except (FileNotFoundError, ValueError, KeyError):
        return 0


# --- runs -----------------------------------------------------------------------------------


def run_kill9(work: Path) -> dict:
    """200,000 records; the forwarder is killed with SIGKILL (up to) three times while sending."""
    kafka = testing.ensure_started("kafka").kafka_bootstrap
    spool, state = work / "spool", work / "state"
    sent = write_streams(spool, streams=4, ops=50_000, segment=10_000)
    env = env_for(kafka, testing.unique_name("rel-kill9"))
    total = sum(p.stat().st_size for p in spool.rglob("*.jsonl"))
    # acknowledged segments stay, so acknowledged bytes only grow until the final run
    kills = kill9_during_progress(
        lambda: subprocess.Popen(forward_cmd(spool, state, "--no-delete-acked"), env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        lambda: acked(state), total, timeout_s=120)
    done = subprocess.run(forward_cmd(spool, state, "--once"), env=env, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    got, _ = consume_ids(kafka, env["NCCLWATCH_TOPICS_OPS"])
    return {"fault": f"kill -9 of the forwarder ({kills} times), then a restart to the end", **tally(sent, got)}


def run_worker_kill9(work: Path) -> dict:
    """The worker is killed with SIGKILL three times while detecting; a restart drains to
    the end. Its anomaly events are compared with an uninterrupted worker's on the same
    input (events are at-least-once: a duplicate is the same (id, state) again)."""
    from kafka import KafkaAdminClient, KafkaProducer
    from ncclwatch.ingest.recording import record_time_ns
    from ncclwatch_testkit import scenarios

    from ncclwatch import config
    from ncclwatch.records import to_json

    kafka = testing.ensure_started("kafka").kafka_bootstrap
    env = env_for(kafka, testing.unique_name("rel-wkill9"), NCCLWATCH_DETECTOR_METRICS_PORT="-1",
                  NCCLWATCH_ALERTING_ALERTMANAGER_URL="")
    cfg = config.load(None, environ=env)
    topics = {"window": cfg.topics.windows, "throughput": cfg.topics.throughput}
    for name in topics.values():
        testing.kafka_create_topic(kafka, name, cfg.topics.partitions)
    producer = KafkaProducer(bootstrap_servers=kafka, linger_ms=50, batch_size=512 * 1024)
    messages = 0
    faulty = [s for s in scenarios.suite() if s.name.startswith(("network_step", "straggler", "nvlink_step"))]
    for copy in range(3):
        for sc in faulty:
            job = f"{sc.name}-{copy}"
            recs, _ = scenarios.generate(sc)
            for r in recs:
                r = dataclasses.replace(r, job=job)
                topic = topics.get(r.KIND)
                if topic:
                    producer.send(topic, key=job.encode(), value=to_json(r).encode(),
                                  timestamp_ms=record_time_ns(r) // 10**6)
                    messages += 1
    producer.flush()
    producer.close()

    def worker(app_id: str, *extra: str, anomalies: str = cfg.topics.anomalies) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "ncclwatch.cli", "worker", "--app-id", app_id, *extra],
                                env={**env, "NCCLWATCH_TOPICS_ANOMALIES": anomalies},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work)

    def committed(app_id: str) -> int:
        admin = KafkaAdminClient(bootstrap_servers=kafka)
        try:
            offsets = admin.list_group_offsets(app_id).get(app_id, {})
        finally:
            admin.close()
        return sum(om.offset for tp, om in offsets.items() if tp.topic in topics.values() and om.offset > 0)

    reference = testing.unique_name("rel-wref")
    done = worker(reference, "--until-caught-up", anomalies=f"{cfg.topics.anomalies}.reference")
    assert done.wait(timeout=900) == 0, "the reference worker failed"
    app_id = testing.unique_name("rel-wkill")
    end = committed(reference)  # the reference worker drained every input partition
    kills = kill9_during_progress(lambda: worker(app_id), lambda: committed(app_id), end, timeout_s=300)
    done = worker(app_id, "--until-caught-up")
    assert done.wait(timeout=900) == 0, "the restarted worker failed"

    want, _ = consume_ids(kafka, f"{cfg.topics.anomalies}.reference", key=event_id)
    got, _ = consume_ids(kafka, cfg.topics.anomalies, key=event_id)
    assert want, "the reference worker raised no anomaly: the run shows nothing"
    return {"fault": f"kill -9 of the worker ({kills} times), then a restart that drains to the end",
            "input_messages": messages, **tally(set(want), got),
            "extra": len(set(got) - set(want))}


def run_outage(work: Path) -> dict:
    """The broker dies (SIGKILL) for 40 s while the spool grows; then it comes back."""
    spool, state = work / "spool", work / "state"
    with testing.PrivateKafka(work / "kafka") as kafka:
        env = env_for(kafka.bootstrap, "rel-outage")
        sent = write_streams(spool, streams=2, ops=20_000, segment=10_000)
        p = subprocess.Popen(forward_cmd(spool, state), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: acked(state) > 0, 120, "first records acknowledged")
            kafka.signal(signal.SIGKILL)
            down = time.monotonic()
            sent |= write_streams(spool, streams=2, ops=20_000, segment=10_000, first=20_000)
            time.sleep(max(0.0, 40 - (time.monotonic() - down)))
            kafka.start()
            outage_s = time.monotonic() - down
            p.send_signal(signal.SIGTERM)
            p.wait(120)
        finally:
            if p.poll() is None:
                p.kill()
        done = subprocess.run(forward_cmd(spool, state, "--once"), env=env, capture_output=True, timeout=600)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        got, _ = consume_ids(kafka.bootstrap, env["NCCLWATCH_TOPICS_OPS"])
    return {"fault": f"broker killed -9, down {outage_s:.0f} s while the spool grew", **tally(sent, got)}


def run_full_disk(work: Path) -> dict:
    """State on an 8 MiB tmpfs, filled, while the broker is down; space comes back, then the broker."""
    spool = work / "spool"
    mnt = work / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    try:
        state = mnt / "state"
        filler = mnt / "filler"
        filler.write_bytes(b"\0" * (6 << 20))
        with testing.PrivateKafka(work / "kafka") as kafka:
            env = env_for(kafka.bootstrap, "rel-disk")
            kafka.signal(signal.SIGKILL)  # down before the forwarder starts
            sent = write_streams(spool, streams=2, ops=25_000, segment=10_000)
            log = open(work / "forward.log", "w")  # noqa: SIM115
            p = subprocess.Popen(forward_cmd(spool, state), env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                wait_for(lambda: "event=disk_write_failed" in (work / "forward.log").read_text(), 120,
                         "the disk to fill")
                time.sleep(5)
                alive_when_full = p.poll() is None
                filler.unlink()
                time.sleep(3)
                kafka.start()
                time.sleep(15)
                p.send_signal(signal.SIGTERM)
                p.wait(120)
            finally:
                if p.poll() is None:
                    p.kill()
                log.close()
            text = (work / "forward.log").read_text()
            done = subprocess.run(forward_cmd(spool, state, "--once"), env=env, capture_output=True, timeout=600)
            assert done.returncode == 0, done.stderr.decode()[-2000:]
            got, _ = consume_ids(kafka.bootstrap, env["NCCLWATCH_TOPICS_OPS"])
        temps = [p.name for p in state.rglob("*") if ".tmp" in p.name]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    return {"fault": "state dir on a full 8 MiB file system while the broker was down",
            **tally(sent, got), "alive_while_full": alive_when_full,
            "disk_full_log_lines": text.count("event=disk_write_failed"), "temp_files_left": len(temps)}


POISON = [
    b"[" * 20000,
    b'{"v":1,"kind":"op","job":"a\\udcffb"}',
    b'{"v":1,"kind":"op","job":"j","busbw_gbs":NaN}',
    b'{"v":1,"kind":"op","seq":1180591620717411303424}',
    b'{"v":1,"kind":"plugin_stats","job":"j","host":"h","pid":1,"gpu":"g","ts_ns":1,"recorded":0,'
    b'"dropped":{"evil":1},"segment":0}',
]


def run_poison(work: Path) -> dict:
    """Hostile lines in the middle of a segment; everything else must arrive."""
    kafka = testing.ensure_started("kafka").kafka_bootstrap
    spool, state = work / "spool", work / "state"
    sent = write_streams(spool, streams=2, ops=10_000, segment=5_000)
    seg = sorted((spool / "job-r").glob("*.jsonl"))[0]
    lines = seg.read_bytes().split(b"\n")
    # the start-near-2^63 op, and a lone surrogate in a good op's op name
    good = lines[0]
    bad_time = re.sub(rb'"start_ns":\d+', b'"start_ns":9223372035854775807', good)
    bad_name = good.replace(b'"op":"AllReduce"', b'"op":"All\\ud800Reduce"')
    poison = [*POISON, bad_time, bad_name]
    seg.write_bytes(b"\n".join(lines[:2500] + poison + lines[2500:]))
    env = env_for(kafka, testing.unique_name("rel-poison"))
    done = subprocess.run(forward_cmd(spool, state, "--once"), env=env, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    got, _ = consume_ids(kafka, env["NCCLWATCH_TOPICS_OPS"])
    _, quarantined = consume_ids(kafka, env["NCCLWATCH_TOPICS_QUARANTINE"])
    return {"fault": f"{len(poison)} poison lines in a segment", **tally(sent, got),
            "poison_lines": len(poison), "quarantined": quarantined}


def notified(hook: testing.WebhookReceiver, job: str) -> list[tuple[str, str]]:
    return [(a["labels"]["anomaly_id"], a["status"]) for _, a in hook.alerts(job)]


def run_am_outage(work: Path) -> dict:
    """Alertmanager unreachable 30 s; 6 anomalies: 3 fire and resolve inside the outage,
    3 fire inside and resolve after it. Each must reach on-call firing, then resolved."""
    from ncclwatch.alerting.alertmanager import AlertmanagerClient
    from ncclwatch.alerting.sink import AlertSink

    from ncclwatch.records import from_json

    services = testing.ensure_started("alertmanager")
    hook = testing.WebhookReceiver()
    path = services.alertmanager_config_file
    original = path.read_text()
    text = (REPO / "alerting" / "alertmanager.yml").read_text()
    text = text.replace("https://oncall.example.com/hooks/ncclwatch", hook.url)
    for key in ("group_wait", "group_interval"):
        text = re.sub(rf"(?m)^(\s*{key}:) \S+$", r"\1 1s", text)
    path.write_text(text)
    testing.reload(services.alertmanager_url)
    job = testing.unique_name("rel-am")
    gate = testing.TcpGate(services.alertmanager_url.split("//", 1)[1])
    try:
        sink = AlertSink(client=AlertmanagerClient(f"http://{gate.address}", timeout_s=2),
                         resend_interval_s=5, resolve_hold_s=4)
        now = time.time_ns()
        events = []
        for i in range(6):
            events.append(from_json({
                "v": 1, "kind": "anomaly", "id": f"{job}-{i}", "type": "network_path", "state": "firing",
                "job": job, "key": {"comm": f"0x00000000000000a{i}", "comm_name": "", "op": "AllReduce",
                                    "size_bucket": "64MiB", "transport": "net"},
                "host": None, "rank": None, "start_ns": now - 60 * 10**9, "end_ns": None, "detected_ns": now,
                "baseline_busbw_gbs": 40.0, "observed_busbw_gbs": 30.0, "effect": 0.25, "attribution": "network",
                "throughput_delta": None, "severity": "critical", "evidence": {}}))
        t0 = time.monotonic()
        for ev in events:
            sink.handle(ev)
        resolved_in = False
        while time.monotonic() - t0 < 30:
            if not resolved_in and time.monotonic() - t0 > 10:
                for ev in events[:3]:
                    sink.handle(from_json({**json.loads(_to_json(ev)), "state": "resolved", "end_ns": time.time_ns()}))
                resolved_in = True
            sink.tick()
            time.sleep(0.1)
        gate.open()
        back = time.monotonic()
        first = None
        for ev in events[3:]:
            sink.handle(from_json({**json.loads(_to_json(ev)), "state": "resolved", "end_ns": time.time_ns()}))
        while time.monotonic() - back < 60 and (sink.stats()["outbox"] or len(notified(hook, job)) < 12):
            sink.tick()
            if first is None and sink.sent:
                first = time.monotonic() - back
            time.sleep(0.1)
        time.sleep(3)
    finally:
        gate.close()
        path.write_text(original)
        testing.reload(testing.Services.from_env_file().alertmanager_url)
    got = notified(hook, job)
    counts = collections.Counter(got)
    expected = {(ev.id, s) for ev in events for s in ("firing", "resolved")}
    in_order = all(got.index((ev.id, "firing")) < got.index((ev.id, "resolved"))
                   for ev in events if (ev.id, "firing") in got and (ev.id, "resolved") in got)
    return {"fault": "Alertmanager unreachable 30 s; 3 anomalies fired and resolved inside it, 3 resolved after",
            "sent": len(expected), "received": len(set(counts) & expected),
            "lost": len(expected - set(counts)), "duplicated": sum(counts.values()) - len(counts),
            "firing_before_resolved": in_order, "first_post_after_recovery_s": round(first or -1, 1)}


def _to_json(ev) -> str:
    from ncclwatch.records import to_json

    return to_json(ev)


def run_bad_credentials(work: Path) -> dict:
    """Wrong SASL password: the forwarder and the worker must stop with a clear message."""
    out = {"fault": "wrong SASL password (forwarder, worker)"}
    with testing.PrivateKafka(work / "kafka", sasl_users={"ncclwatch": "right-pw"}) as kafka:
        env = env_for(kafka.bootstrap, "rel-auth", NCCLWATCH_KAFKA_SECURITY_PROTOCOL="SASL_PLAINTEXT",
                      NCCLWATCH_KAFKA_SASL_MECHANISM="PLAIN", NCCLWATCH_KAFKA_SASL_PLAIN_USERNAME="ncclwatch",
                      NCCLWATCH_KAFKA_SASL_PLAIN_PASSWORD="wrong-pw", NCCLWATCH_DETECTOR_METRICS_PORT="-1")
        sent = write_streams(work / "spool", streams=1, ops=1000, segment=1000)
        for name, cmd in (("forward", forward_cmd(work / "spool", work / "state")),
                          ("worker", [sys.executable, "-m", "ncclwatch.cli", "worker", "--app-id", "rel-auth"])):
            t = time.monotonic()
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            msg = next((ln for ln in done.stderr.splitlines() if "refused the credentials" in ln), "")
            out[name] = {"exit": done.returncode, "seconds": round(time.monotonic() - t, 1),
                         "message": msg[:160], "password_in_output": "wrong-pw" in done.stderr + done.stdout}
        out["spool_lines_kept"] = sum(p.read_bytes().count(b"\n") for p in (work / "spool").rglob("*.jsonl"))
        out["sent"] = len(sent)
    return out


RUNS = {"kill9": run_kill9, "worker_kill9": run_worker_kill9, "outage": run_outage, "full_disk": run_full_disk,
        "poison": run_poison, "am_outage": run_am_outage, "bad_credentials": run_bad_credentials}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(RUNS), help="comma-separated runs (default: all)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    results = {}
    for name in args.only.split(","):
        with tempfile.TemporaryDirectory(prefix=f"ncclwatch-rel-{name}-") as tmp:
            t = time.monotonic()
            print(f"== {name}", file=sys.stderr, flush=True)
            res = RUNS[name](Path(tmp))
            res["run_s"] = round(time.monotonic() - t, 1)
            results[name] = res
            print(json.dumps(res), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
            "python": platform.python_version(), "commit": _git_head()}
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    return 0


def _git_head() -> str:
    with contextlib.suppress(Exception):
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    return ""


if __name__ == "__main__":
    sys.exit(main())
