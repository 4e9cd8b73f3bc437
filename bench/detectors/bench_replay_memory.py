"""Peak memory of the commands that replay a recording, by recording length.

Each command runs in a fresh process over a synthetic plugin spool (8 streams, 4
communicators, ``ncclwatch_testkit.synth.write_spool``) and is measured by the kernel: peak
resident set since exec (``VmHWM``, which the child prints as it exits), CPU seconds
(user + sys, ``wait4``) and wall seconds.

- ``watch``: ``ncclwatch watch SPOOL --speed 0`` (local mode replaying at full speed);
- ``replay``: ``ncclwatch replay --files SPOOL --out FILE``;
- ``detect``: ``ncclwatch replay --files SPOOL --detect``;
- ``report``: ``ncclwatch report SPOOL`` (Markdown and figures);
- ``bare-read``: every line of the spool read and decoded by the fast parser, nothing
  else (the limit a replay is measured against);
- ``bare-window``: the same, and every op put in its window by the windower, nothing
  else (the least ``watch`` must do before its detectors, in the order read);
- ``topic``: ``ncclwatch replay --topic T --out FILE`` and ``topic-detect``:
  ``ncclwatch replay --topic T --detect``, where T holds the same spool (written once
  per length with ``replay --files SPOOL --to-topic T``, unlimited retention; its
  message count is checked before every timing). They need a broker:
  ``NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS`` (``scripts/services.sh start kafka`` prints it).

``--old COMMIT`` runs the same commands with an older commit too (``git worktree``,
imported through ``bench/ab.py``'s shim), alternating which goes first, so both sides
see the same machine. ::

    .venv/bin/python bench/detectors/bench_replay_memory.py --records 1000000,10000000 \\
        [--commands watch,replay,detect,report,topic,topic-detect] [--repeats 1] [--old COMMIT] [--new COMMIT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

CHILD = r"""
import sys
shim = sys.argv[1]
if shim:
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, shim)
from ncclwatch import cli
import ncclwatch.records as r
assert ("/shim-" in r.__file__) == bool(shim), r.__file__

def bare_read(spool):
    # the limit a replay is held to: every line read and decoded, nothing else
    from pathlib import Path
    from ncclwatch.ingest.parse import parse
    n = 0
    for f in sorted(Path(spool).rglob("*.jsonl")):
        with open(f, "rb") as fh:
            for line in fh:
                parse(line.rstrip(b"\n"))
                n += 1
    print(n, "lines", file=sys.stderr)
    return 0

def bare_window(spool):
    # the least `watch` must do besides its detectors: read, decode, window every op
    from pathlib import Path
    from ncclwatch.ingest.parse import parse
    from ncclwatch.ingest.windows import Windower
    w = Windower(1.0)
    n = windows = 0
    for f in sorted(Path(spool).rglob("*.jsonl")):
        with open(f, "rb") as fh:
            for line in fh:
                rec = parse(line.rstrip(b"\n"))
                if getattr(rec, "KIND", "") == "op":
                    windows += len(w.add(rec))
                n += 1
    windows += len(w.flush())
    print(n, "lines", windows, "windows", file=sys.stderr)
    return 0

try:
    if sys.argv[2] == "bare-read":
        rc = bare_read(sys.argv[3])
    elif sys.argv[2] == "bare-window":
        rc = bare_window(sys.argv[3])
    else:
        rc = cli.main(sys.argv[2:])
finally:
    # peak resident set since exec (ru_maxrss would also count the forked parent's pages)
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print("NCCLWATCH_BENCH_HWM_KB", hwm.split()[1], file=sys.stderr)
sys.exit(rc)
"""


def _sha(rev: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True, text=True,
                          check=True).stdout.strip()


def spool_of(n: int, cache: Path) -> Path:
    """A spool of ``n`` op records (rounded down to 8 streams), written once per size."""
    d = cache / f"spool-{n}"
    if not (d / "done").exists():
        # in a child process: this one stays small, so nothing of it counts in the forks
        subprocess.run([sys.executable, "-c", "import sys; from ncclwatch_testkit.synth import write_spool; "
                        "write_spool(sys.argv[1], job='bench-mem', streams=8, ops_per_stream=int(sys.argv[2]), "
                        "comms=4, segment_ops=200_000)", str(d), str(n // 8)], check=True)
        (d / "done").write_text("")
    return d


def topic_of(n: int, spool: Path, cache: Path) -> str:
    """A topic holding the spool of ``n`` records, filled once (its end offsets say how
    many messages it must have; checked again before each use by :func:`check_topic`)."""
    topic = f"bench-replay-memory-{n}"
    mark = cache / f"{topic}.count"
    if not mark.exists():
        if topic_count(topic):
            raise SystemExit(f"{topic} has messages but no record of how many were written (an interrupted "
                             "fill?): delete the topic and run again")
        subprocess.run([sys.executable, "-m", "ncclwatch.cli", "replay", "--files", str(spool), "--to-topic", topic,
                        "--no-progress"], check=True)
        mark.write_text(str(topic_count(topic)))
    check_topic(topic, int(mark.read_text()), n)
    return topic


def topic_count(topic: str) -> int:
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=os.environ["NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS"])
    try:
        tps = [TopicPartition(topic, p) for p in c.partitions_for_topic(topic) or ()]
        if not tps:
            return 0
        begin, end = c.beginning_offsets(tps), c.end_offsets(tps)
        return sum(end[tp] - begin[tp] for tp in tps)
    finally:
        c.close()


def check_topic(topic: str, want: int, n: int) -> None:
    got = topic_count(topic)
    if got != want or got < n:
        raise SystemExit(f"{topic}: {got} messages, {want} written for {n} op records: the input is not intact")


def argv_for(command: str, spool: Path, out: Path, topic: str = "") -> list[str]:
    if command in ("bare-read", "bare-window"):
        return [command, str(spool)]
    if command == "topic":
        return ["replay", "--topic", topic, "--out", str(out / "replayed.jsonl"), "--no-progress"]
    if command == "topic-detect":
        return ["replay", "--topic", topic, "--detect", "--no-progress"]
    if command == "watch":
        return ["watch", str(spool), "--speed", "0", "--metrics-port", "-1", "--status-every-s", "0",
                "--no-progress"]
    if command == "replay":
        return ["replay", "--files", str(spool), "--out", str(out / "replayed.jsonl"), "--no-progress"]
    if command == "detect":
        return ["replay", "--files", str(spool), "--detect", "--no-progress"]
    if command == "report":
        return ["report", str(spool), "--out", str(out / "report")]
    raise ValueError(command)


def measure(argv: list[str], shim: str) -> dict:
    """Peak RSS (MB), CPU s and wall s of one fresh process running ``ncclwatch argv``."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as errf:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, shim, *argv], stdout=subprocess.DEVNULL, stderr=errf)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - t0
        errf.seek(0)
        err = errf.read().decode(errors="replace")
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv}: exit {proc.returncode}: {err[-2000:]}")
    hwm_kb = next(int(line.split()[1]) for line in err.splitlines() if line.startswith("NCCLWATCH_BENCH_HWM_KB"))
    return {"rss_mb": hwm_kb / 1024, "cpu_s": usage.ru_utime + usage.ru_stime, "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--records", default="1000000", help="comma-separated recording lengths")
    ap.add_argument("--commands", default="watch,replay,detect,report")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--old", help="also run this older commit, side by side")
    ap.add_argument("--new", help="run this commit as the new side (default: the working tree), so the "
                    "tree can change while a long run goes on")
    ap.add_argument("--old-max-records", type=int, default=1_000_000,
                    help="run the old commit only up to this length (it may hold everything in memory)")
    ap.add_argument("--cache", default=str(ROOT / "var" / "bench-replay-memory"))
    args = ap.parse_args()
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    sides = [("new", "")]
    with tempfile.TemporaryDirectory(prefix="ncclwatch-memory-") as tmp:
        tmp_p = Path(tmp)
        trees = []
        from ab import shim_for

        for side, commit in (("new", args.new), ("old", args.old)):
            if commit:
                tree = tmp_p / f"{side}-tree"
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), commit],
                               check=True)
                trees.append(tree)
                shim = str(shim_for(tree, tmp_p / f"shim-{side}"))
                sides = [s for s in sides if s[0] != side] + [(side, shim)]
        try:
            print(json.dumps({"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.node(),
                              "cpus": os.cpu_count(), "python": platform.python_version(),
                              "new": _sha(args.new) if args.new else "working tree",
                              "old": _sha(args.old) if args.old else None}), flush=True)
            for n in (int(x) for x in args.records.split(",")):
                spool = spool_of(n, cache)
                commands = args.commands.split(",")
                topic = topic_of(n, spool, cache) if any(c.startswith("topic") for c in commands) else ""
                for command in commands:
                    for rep in range(args.repeats):
                        order = sides if rep % 2 == 0 else sides[::-1]
                        for side, shim in order:
                            if side == "old" and n > args.old_max_records:
                                continue
                            out = tmp_p / f"out-{side}"
                            out.mkdir(exist_ok=True)
                            if topic:
                                check_topic(topic, int((cache / f"{topic}.count").read_text()), n)
                            r = measure(argv_for(command, spool, out, topic), shim)
                            subprocess.run(["rm", "-rf", str(out)], check=True)
                            print(json.dumps({"records": n, "command": command, "side": side, "repeat": rep,
                                              **{k: round(v, 1) for k, v in r.items()},
                                              "records_per_cpu_s": round(n / r["cpu_s"])}), flush=True)
        finally:
            for tree in trees:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
