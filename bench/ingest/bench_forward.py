"""Forwarder throughput: spool files -> acknowledged Kafka writes, records per CPU-second.

Runs the real forwarder (in this process, so its CPU time is measured without the
interpreter's start-up and imports) against the real local Kafka broker of
scripts/services.sh, on a synthetic spool in the plugin's layout. CPU time is
``getrusage(RUSAGE_SELF)`` user+sys over ``Forwarder.run()``: the main thread and the
producer's threads (kafka-python's sender, or librdkafka's), everything the forwarder
process spends.

    .venv/bin/python bench/ingest/bench_forward.py [--records 60000] [--repeats 3]
        [--producers kafka-python,confluent-kafka] [--out docs/bench/ingest.md] [--profile]
    .venv/bin/python bench/ingest/bench_forward.py --streams 2,16,256 [--repeats 5]
    .venv/bin/python bench/ingest/bench_forward.py --only 100,lz4,2000 --bare --repeats 6

``--bare``: in every repeat, besides the forwarder, the limit it is held to: a bare
confluent-kafka producer (the same librdkafka settings) sending the same op lines packed
the same way, built before timing (no spool reading, parsing, windows or checkpoints).

``--floor``: in every repeat, also the least any forwarder that checks what it sends
must do: every spool line read and parsed by the fast validated parser
(``ingest/parse.py``, the forwarder's own), nothing windowed or sent. Costs per record
add up: such a forwarder spends at least ``1/floor + 1/bare`` CPU-seconds per record
when it sends with the bare producer's client, so it reaches at most
``floor / (floor + bare)`` of the bare producer's rate.

A producer named ``confluent-kafka:no-idempotence`` is librdkafka with its idempotent
producer off (as shipped before 2026-11-25), to measure what the order guarantee costs.

``--streams``: the shipped configuration (100 ops per message, lz4, 2000-line batches,
the default producer) on spools of the same records spread over that many streams
(processes) of one node, the spools alternating within every repeat; the spools are a
backlog (directories dated a minute back, :func:`backlog`).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import os
import platform
import pstats
import resource
import shutil
import statistics
import sys
import tempfile
import time

from ncclwatch.ingest.forward import Forwarder, Options
from ncclwatch.ingest.metrics import ForwarderMetrics
from ncclwatch_testkit import services as testing
from ncclwatch_testkit.synth import write_spool

from ncclwatch import config

CONFIGS = [
    # (ops_per_message, compression, batch_size)
    (1, "gzip", 500), (1, "gzip", 2000), (1, "gzip", 8000),
    (1, "lz4", 2000),
    (100, "gzip", 2000),
    (100, "lz4", 500), (100, "lz4", 2000), (100, "lz4", 8000),
    (1000, "lz4", 8000),
]


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one_run(bootstrap: str, spool: str, records: int, per_msg: int, codec: str, batch: int,
            profile: bool = False, producer: str = config.KafkaConfig.producer) -> tuple[float, float, int]:
    producer, _, variant = producer.partition(":")
    if variant not in ("", "no-idempotence"):
        raise SystemExit(f"unknown producer variant {variant!r}")
    with _idempotence(variant != "no-idempotence"):
        return _one_run(bootstrap, spool, records, per_msg, codec, batch, profile, producer)


@contextlib.contextmanager
def _idempotence(on: bool):
    """librdkafka's settings with ``enable.idempotence`` forced (a benchmark knob only)."""
    from ncclwatch.ingest import rdkafka

    shipped = rdkafka.producer_conf
    rdkafka.producer_conf = lambda *a, **kw: {**shipped(*a, **kw), "enable.idempotence": on}
    try:
        yield
    finally:
        rdkafka.producer_conf = shipped


def _one_run(bootstrap: str, spool: str, records: int, per_msg: int, codec: str, batch: int,
             profile: bool, producer: str) -> tuple[float, float, int]:
    prefix = testing.unique_name("bench")
    env = {"NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": bootstrap, "NCCLWATCH_TOPICS_PARTITIONS": "4",
           # recorded times: no retention may delete them
           "NCCLWATCH_KAFKA_PRODUCER": producer, **testing.RECORDED_TOPICS_ENV}
    for k in config.TOPIC_NAME_FIELDS:
        env[f"NCCLWATCH_TOPICS_{k.upper()}"] = f"{prefix}.{k}"
    cfg = config.load(None, environ=env)
    state = tempfile.mkdtemp(prefix="ncclwatch-bench-state-")
    opts = Options(spool_dir=spool, state_dir=state, node_id="bench", once=True,
                   delete_acked=False, ops_per_message=per_msg, compression=codec,
                   batch_size=batch)
    fwd = Forwarder(cfg, opts, metrics=ForwarderMetrics())
    # topic creation is set-up, not forwarding (the sink is Forwarder.delivery since
    # 285dcce; before, Forwarder itself: bench/ab.py runs older commits through this)
    (fwd.delivery.connect if hasattr(fwd, "delivery") else fwd._connect)()
    prof = cProfile.Profile() if profile else None
    c0, w0 = cpu_s(), time.perf_counter()
    if prof:
        prof.enable()
    rc = fwd.run()
    if prof:
        prof.disable()
        # BENCH_SORT=cumtime BENCH_TOP=40: another view of the same profile
        top = int(os.environ.get("BENCH_TOP", "25"))
        pstats.Stats(prof).sort_stats(os.environ.get("BENCH_SORT", "tottime")).print_stats(top)
    c1, w1 = cpu_s(), time.perf_counter()
    shutil.rmtree(state, ignore_errors=True)
    assert rc == 0
    sent_ops = int(fwd.metrics.registry.get_sample_value(
        "ncclwatch_forwarder_records_sent_total", {"topic": cfg.topics.ops}) or 0)
    assert sent_ops == records, (sent_ops, records)
    one_run.windows = int(fwd.metrics.registry.get_sample_value(  # type: ignore[attr-defined]
        "ncclwatch_forwarder_records_sent_total", {"topic": cfg.topics.windows}) or 0)
    return c1 - c0, w1 - w0, sent_ops


def packed_messages(spool: str, per_msg: int) -> list[tuple[bytes, bytes]]:
    """The spool's op lines packed as the forwarder packs them: ``per_msg`` lines of one
    ``job|comm`` per message, in each file's order, files in name order (the bare
    producer's input, built before its timing)."""
    import msgspec

    from ncclwatch.routing import op_group

    class Key(msgspec.Struct):
        job: str
        comm: str

    decode = msgspec.json.Decoder(Key).decode
    packs: dict[bytes, list[bytes]] = {}
    out: list[tuple[bytes, bytes]] = []
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(spool) for f in fs if f.endswith(".jsonl"))
    for path in files:
        with open(path, "rb") as f:
            for line in f.read().splitlines():
                k = decode(line)
                key = op_group(k.job, k.comm).encode()
                pack = packs.setdefault(key, [])
                pack.append(line)
                if len(pack) == per_msg:
                    out.append((key, b"\n".join(pack)))
                    packs[key] = []
    out += [(key, b"\n".join(pack)) for key, pack in packs.items() if pack]
    return out


def bare_run(bootstrap: str, messages: list[tuple[bytes, bytes]], records: int, codec: str) -> tuple[float, float, int]:
    """The limit: confluent-kafka alone sending the forwarder's messages, built beforehand,
    with the forwarder's librdkafka settings (acks=all, idempotent, one request in
    flight, its batch and linger), to a fresh topic; CPU of this process, the
    producer's threads included, until every message is acknowledged."""
    from confluent_kafka import Producer
    from ncclwatch.ingest import rdkafka

    topic = testing.unique_name("bench-bare")
    ing = config.IngestConfig()
    kafka = config.KafkaConfig(bootstrap_servers=bootstrap)
    conf = rdkafka.producer_conf(kafka, compression=codec, batch_size_bytes=1 << 20, linger_ms=ing.linger_ms,
                                 request_timeout_ms=10_000, delivery_timeout_ms=30_000)
    failed: list = []

    def on_delivery(err, _msg):
        if err is not None:
            failed.append(err)

    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, 4, 1, topic_configs={"retention.ms": "-1"})])
    admin.close()
    producer = Producer(conf)
    c0, w0 = cpu_s(), time.perf_counter()
    for key, value in messages:
        while True:
            try:
                producer.produce(topic, value, key, on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    left = producer.flush(60)
    c1, w1 = cpu_s(), time.perf_counter()
    assert left == 0 and not failed, (left, failed[:3])
    return c1 - c0, w1 - w0, records


def floor_run(spool: str, records: int) -> tuple[float, float, int]:
    """Every spool line read and parsed by the forwarder's fast validated parser, nothing
    else: CPU of this process."""
    from ncclwatch.ingest.parse import is_quarantined, parse

    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(spool) for f in fs if f.endswith(".jsonl"))
    n = bad = 0
    c0, w0 = cpu_s(), time.perf_counter()
    for path in files:
        with open(path, "rb") as f:
            for line in f.read().splitlines():
                bad += is_quarantined(parse(line))
                n += 1
    c1, w1 = cpu_s(), time.perf_counter()
    assert n == records and not bad, (n, records, bad)
    return c1 - c0, w1 - w0, n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=60000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--profile", action="store_true", help="one profiled run of the packed config")
    ap.add_argument("--only", default="", help="ops_per_message,codec,batch: run just that config")
    ap.add_argument("--producers", default=config.KafkaConfig.producer,
                    help="comma-separated kafka.producer values, interleaved in every repeat")
    ap.add_argument("--streams", default="", help="comma-separated stream counts: the shipped config per count")
    ap.add_argument("--bare", action="store_true",
                    help="also, in every repeat, a bare confluent-kafka producer sending the same packed messages")
    ap.add_argument("--floor", action="store_true",
                    help="also, in every repeat, the spool read and parsed alone (no windows, nothing sent)")
    args = ap.parse_args()
    producers = args.producers.split(",")
    bootstrap = testing.ensure_started("kafka").kafka_bootstrap
    if args.streams:
        return by_streams(bootstrap, [int(x) for x in args.streams.split(",")], args.records, args.repeats)
    spool = tempfile.mkdtemp(prefix="ncclwatch-bench-spool-")
    streams = 8
    write_spool(spool, streams=streams, ops_per_stream=args.records // streams,
                segment_ops=5000, comms=4)
    records = streams * (args.records // streams)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(spool) for f in fs)
    if args.profile:
        one_run(bootstrap, spool, records, 100, "lz4", 2000, profile=True, producer=producers[0])
        return 0
    rows = []
    configs = CONFIGS
    if args.only:
        a, b, c = args.only.split(",")
        configs = [(int(a), b, int(c))]
    for per_msg, codec, batch in configs:
        sides = [*producers, *(["bare"] if args.bare else []), *(["floor"] if args.floor else [])]
        bare_input = packed_messages(spool, per_msg) if args.bare else []
        assert not args.bare or sum(v.count(b"\n") + 1 for _, v in bare_input) == records
        rates: dict[str, list[float]] = {p: [] for p in sides}
        walls: dict[str, list[float]] = {p: [] for p in sides}
        for i in range(args.repeats):
            # alternate which producer goes first, so both see the same machine noise
            for producer in sides if i % 2 == 0 else sides[::-1]:
                if producer == "bare":
                    cpu, wall, n = bare_run(bootstrap, bare_input, records, codec)
                elif producer == "floor":
                    cpu, wall, n = floor_run(spool, records)
                else:
                    cpu, wall, n = one_run(bootstrap, spool, records, per_msg, codec, batch, producer=producer)
                rates[producer].append(n / cpu)
                walls[producer].append(n / wall)
        if args.bare:
            limit = statistics.median(rates["bare"])
            for producer in producers:
                each = ", ".join(f"{a / b:.2f}" for a, b in zip(rates[producer], rates["bare"], strict=True))
                print(f"{producer}: {statistics.median(rates[producer]) / limit:.2f}x the bare producer "
                      f"(medians; per repeat: {each})", flush=True)
            if args.floor:
                bound = [f / (f + b) for f, b in zip(rates["floor"], rates["bare"], strict=True)]
                print(f"a forwarder that parses every line: at most {statistics.median(bound):.2f}x the bare "
                      f"producer (floor / (floor + bare) per repeat: {', '.join(f'{x:.2f}' for x in bound)})",
                      flush=True)
        for producer in sides:
            r, w = rates[producer], walls[producer]
            rows.append((producer, per_msg, codec, batch, r, w))
            print(f"{producer:<15} ops/msg={per_msg:<4} {codec:<5} batch={batch:<5} records/cpu-s median="
                  f"{statistics.median(r):>9,.0f} min={min(r):,.0f} max={max(r):,.0f}"
                  f"  wall records/s median={statistics.median(w):,.0f}", flush=True)
    shutil.rmtree(spool, ignore_errors=True)
    if args.out:
        write_report(args.out, rows, records, size, args.repeats)
    return 0


def backlog(spool: str) -> None:
    """Date the spool's directories a minute back, as a backlog's are: a directory
    modified in the last ``SpoolTailer.RACY_S`` is listed again on every poll (a file
    created in the same clock tick must not be missed), which a run of a second or two
    over a spool written just before would otherwise pay throughout."""
    t = time.time() - 60
    for d, _, _ in os.walk(spool):
        os.utime(d, (t, t))


def by_streams(bootstrap: str, counts: list[int], records: int, repeats: int) -> int:
    ing = config.IngestConfig()
    spools = {}
    for n in counts:
        spools[n] = tempfile.mkdtemp(prefix=f"ncclwatch-bench-spool-{n}-")
        write_spool(spools[n], streams=n, ops_per_stream=records // n, segment_ops=5000, comms=4)
        backlog(spools[n])
    rates: dict[int, list[float]] = {n: [] for n in counts}
    windows: dict[int, int] = {}
    for i in range(repeats):
        for n in counts if i % 2 == 0 else counts[::-1]:
            cpu, _, sent = one_run(bootstrap, spools[n], n * (records // n), ing.ops_per_message, ing.compression,
                                   ing.batch_size)
            rates[n].append(sent / cpu)
            windows[n] = one_run.windows  # type: ignore[attr-defined]
    for n in counts:
        r = rates[n]
        print(f"streams={n:<4} records/cpu-s median={statistics.median(r):>9,.0f} min={min(r):,.0f} "
              f"max={max(r):,.0f} windows sent={windows[n]:,} ({repeats} repeats)", flush=True)
        shutil.rmtree(spools[n], ignore_errors=True)
    return 0


def write_report(path: str, rows, records: int, size: int, repeats: int) -> None:
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    lines = [
        "| producer | ops per Kafka message | compression | batch (lines) | records / CPU-s, median | "
        "min – max | records / s wall, median |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for producer, per_msg, codec, batch, rates, walls in rows:
        lines.append(f"| {producer} | {per_msg} | {codec} | {batch} | {statistics.median(rates):,.0f} | "
                     f"{min(rates):,.0f} – {max(rates):,.0f} | {statistics.median(walls):,.0f} |")
    table = "\n".join(lines)
    meta = (f"Measured {datetime.date.today()} on `nproc`={os.cpu_count()}, {cpu}, "
            f"Python {platform.python_version()}, local single-node Kafka "
            f"(scripts/services.sh) on the same machine. {records:,} op records "
            f"({size / records:.0f} bytes a line, 8 streams × 4 communicators, 5000-line "
            f"segments), {repeats} repeats per row.")
    marker_start, marker_end = "<!-- bench:start -->", "<!-- bench:end -->"
    block = f"{marker_start}\n{meta}\n\n{table}\n{marker_end}"
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    if marker_start in text:
        head, rest = text.split(marker_start, 1)
        text = head + block + rest.split(marker_end, 1)[1]
    else:
        text = text + "\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
