"""The key worker's driver code without Faust or Kafka: ``StreamCore`` with the key
stage's detectors against the detector library alone, on the same windows, in one
process, sides alternating.

The job is ``bench_stages.py``'s synthetic one (``--nodes`` × ``--gpus`` GPUs, 5 keys per
rank, 1 s windows), its windows packed ``--windows-per-message`` per message of one
communicator and spread over ``--partitions`` partitions by their key as Kafka's
default partitioner spreads them. Both sides start from the packed message values (not timed: building them):

- **library**: each partition's :class:`~ncclwatch.detectors.keys.KeyStage` fed every
  line after the worker's fast validated parse;
- **core**: :class:`~ncclwatch.detectors.stream.StreamCore` with
  :class:`~ncclwatch.detectors.stream.KeyDetectors`, as ``worker --stage keys`` builds it
  (one time-merge group, saves at most once a second into a dict), fed the messages in
  batches of ``--batch`` (decode, key checks, time merge, positions, saves).

Their ratio is what the worker's own code costs; the rest of the gap to the Kafka
worker (``bench_stages.py``) is Faust and the machine it shares with the broker. ::

    .venv/bin/python bench/worker/bench_core.py --nodes 256 --seconds 20 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime

from bench_stages import job_records, messages_of
from bench_worker import cpu_model
from ncclwatch.detectors.keys import KeyStage
from ncclwatch.detectors.messages import Message
from ncclwatch.detectors.stream import KeyDetectors, StreamCore, collect_less_often, job_partition
from ncclwatch.ingest.parse import parse

from ncclwatch.config import DetectorConfig
from ncclwatch.records import WindowSummary

TOPIC = "nccl.windows"


def window_messages(nodes: int, gpus: int, seconds: int, per_message: int, partitions: int) -> list[Message]:
    records = job_records(nodes, gpus, seconds, seconds // 2)
    offsets = [0] * partitions
    out = []
    for kind, key, value in messages_of(records, per_message):
        if kind == "windows":
            p = job_partition(key.decode(), partitions)  # Kafka's default partitioner, as bench_stages gets
            out.append(Message(TOPIC, p, offsets[p], key, value))
            offsets[p] += 1
    return out


def library(messages: list[Message], cfg: DetectorConfig) -> int:
    stages: dict[int, KeyStage] = {}
    verdicts = 0
    for m in messages:
        stage = stages.get(m.partition)
        if stage is None:
            stage = stages[m.partition] = KeyStage(cfg)
        for line in m.value.split(b"\n"):
            verdicts += len(stage.process(parse(line)))
    return verdicts


def core(messages: list[Message], cfg: DetectorConfig, batch: int) -> int:
    table: dict = {}
    ended = [False]  # then the clock says a save is due: the verdicts held for it go out
    c = StreamCore(KeyDetectors(cfg), table.get, state_key=KeyDetectors.state_key, merge_group=lambda _: 0,
                   save_every_s=1.0, clock=lambda: float("inf") if ended[0] else time.monotonic())
    kinds = {TOPIC: (WindowSummary,)}
    verdicts = 0
    for i in [*range(0, len(messages), batch), len(messages)]:
        ended[0] = i == len(messages)
        out = c.handle(messages[i:i + batch], kinds, {})
        verdicts += len(out.events)
        for key, (_, state) in out.states.items():
            table[key] = state
    return verdicts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--nodes", type=int, default=256)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--windows-per-message", type=int, default=50)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--batch", type=int, default=80, help="messages per handle() call (the worker's ~0.2 s)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    messages = window_messages(args.nodes, args.gpus, args.seconds, args.windows_per_message, args.partitions)
    windows = sum(m.value.count(b"\n") + 1 for m in messages)
    cfg = DetectorConfig()
    collect_less_often()  # as the worker does
    print(json.dumps({"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.node(),
                      "cpu": cpu_model(), "python": platform.python_version(),
                      "command": "bench/worker/bench_core.py", "args": vars(args), "windows": windows}), flush=True)
    rates: dict[str, list[float]] = {"library": [], "core": []}
    for i in range(args.repeats):
        for side in ("library", "core") if i % 2 == 0 else ("core", "library"):
            t = time.process_time()
            n = library(messages, cfg) if side == "library" else core(messages, cfg, args.batch)
            rates[side].append(windows / (time.process_time() - t))
            print(json.dumps({"side": side, "windows_per_cpu_s": round(rates[side][-1]), "verdicts": n}), flush=True)
    lib, cor = (statistics.median(rates[s]) for s in ("library", "core"))
    print(json.dumps({"library_median": round(lib), "core_median": round(cor), "core_of_library": round(cor / lib, 2),
                      "per_repeat": [round(c / b, 2) for c, b in zip(rates["core"], rates["library"], strict=True)]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
