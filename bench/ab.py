"""Side by side: an older commit against the working tree, interleaved runs.

Each repeat runs one benchmark once with the old commit's ``ncclwatch`` and once with
the working tree's, in alternating order, each in a fresh process, so both see the same
machine noise:

- ``--what forward``: ``bench/ingest/bench_forward.py``'s ``one_run`` (a synthetic spool
  -> the real local Kafka broker), op records per CPU-second;
- ``--what pipeline``: one ``Pipeline`` over a suite scenario's records (generation not
  timed), window summaries per CPU-second;
- ``--what job-stage``: a synthetic job of ``--nodes`` x 8 GPUs (5 keys per rank, 1 s
  windows, 20 s, a network fault on one node) through each side's key stage (not timed)
  into its verdicts' wire format; timed: decoding them and one job stage over them, as
  `bench/detectors/bench_two_stages.py` times it; the job's windows per CPU-second;
- ``--what merge``: the job worker's ``VerdictMerge`` as the worker drives it: 200 windows
  of 1,000 communicators' verdicts added one at a time, each followed by a release, and
  every 1,000 a mark from each of 8 key stages and a release; verdicts per CPU-second.

    .venv/bin/python bench/ab.py OLD_COMMIT --what forward [--repeats 6] [--records 60000]
        [--config 100,lz4,2000]
    .venv/bin/python bench/ab.py OLD_COMMIT --what pipeline [--scenario steady_2x8]
    .venv/bin/python bench/ab.py OLD_COMMIT --what job-stage [--nodes 1024]
    .venv/bin/python bench/ab.py OLD_COMMIT --what merge

The old commit is checked out with ``git worktree`` under a temporary directory and
imported through a symlink shim with the editable install's finder removed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD_PIPELINE = r"""
import json, sys, time
shim = sys.argv[1]
if shim:
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, shim)
from ncclwatch.config import DetectorConfig
from ncclwatch.detectors import pipeline
from ncclwatch_testkit import scenarios
records, _ = scenarios.generate(scenarios.by_name(sys.argv[2]))
windows = sum(1 for r in records if r.KIND == "window")
t = time.process_time()
p = pipeline.Pipeline(DetectorConfig())
for r in records:
    p.process(r)
p.flush()
print(json.dumps({"cpu_s": time.process_time() - t, "records": windows,
                  "module": pipeline.__file__}))
"""

CHILD_JOB_STAGE = r"""
import gc, json, sys, time
shim = sys.argv[1]
if shim:
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, shim)
from ncclwatch.config import DetectorConfig
from ncclwatch.detectors import keys
from ncclwatch_testkit import scenarios, stages
cfg, nodes = DetectorConfig(), int(sys.argv[2])
sc = scenarios.Scenario("job-stage", nodes, 8, 20, seed=11,
                        faults=(scenarios.Fault("network", 15, 20, 0.3, node=1),),
                        forwarder_delay_s=tuple(1.0 + 0.35 * (i % 8) for i in range(nodes)))
records, _ = scenarios.generate(sc)
parts, other = stages.split(records, 1)
blobs = [keys.encode_verdict(v) for v in stages.key_stage(parts[0], cfg)]
windows = sum(1 for r in records if r.KIND == "window")
gc.freeze()
t = time.process_time()
verdicts = [keys.decode_verdict(b) for b in blobs]
events = stages.job_stage(stages.job_stage_input(verdicts, other), cfg)
cpu = time.process_time() - t
print(json.dumps({"cpu_s": cpu, "records": windows, "bytes": sum(map(len, blobs)),
                  "events": [[e.type, e.state] for e in events], "module": keys.__file__}))
"""

CHILD_MERGE = r"""
import json, sys, time
shim = sys.argv[1]
if shim:
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, shim)
from ncclwatch.detectors import keys
def verdict(end, comm):
    return keys.KeyVerdict(
        job="j", key=(comm, "AllReduce", "4MiB", "net"), comm_name="", window_ns=1, ranks=None,
        start_ns=end - 1, end_ns=end, observed=1.0, baseline=None, effect=0.0, degraded=False,
        drift=False, was_firing=False, transition=None, spread_transition=None, spread_effect=0.0,
        exec_ns_p50=1, host=None, warm=False, baseline_after=None, closed_before=end,
        rule=(False, 0, None, None), spread_rule=(False, 0, None, None))
items = [verdict(t, f"c{c}") for t in range(1, 201) for c in range(1000)]
merge = keys.VerdictMerge(range(8))
released = 0
t = time.process_time()
for i, v in enumerate(items):
    merge.add(v)
    released += len(merge.release())
    if i % 1000 == 999:
        for source in range(8):
            merge.mark(source, v.end_ns - 2)
        released += len(merge.release())
cpu = time.process_time() - t
print(json.dumps({"cpu_s": cpu, "records": len(items), "events": released, "bytes": 0,
                  "module": keys.__file__}))
"""

CHILD = r"""
import json, sys
shim = sys.argv[1]
if shim:
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, shim)
sys.path.insert(0, sys.argv[2])
import bench_forward as b
import ncclwatch.ingest.forward as fwd
per, codec, batch = sys.argv[4].split(",")
cpu, wall, n = b.one_run(sys.argv[5], sys.argv[3], int(sys.argv[6]) // 8 * 8, int(per), codec,
                         int(batch))
print(json.dumps({"cpu_s": cpu, "wall_s": wall, "records": n, "module": fwd.__file__}))
"""


def shim_for(tree: Path, dest: Path) -> Path:
    pkg = dest / "ncclwatch"
    pkg.mkdir(parents=True)
    for f in (tree / "ncclwatch").iterdir():
        (pkg / f.name).symlink_to(f)
    for sub in ("ingest", "detectors", "alerting", "dashboards"):
        (pkg / sub).symlink_to(tree / sub)
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("old")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--records", type=int, default=60000)
    ap.add_argument("--config", default="100,lz4,2000", help="ops_per_message,codec,batch")
    ap.add_argument("--what", choices=("forward", "pipeline", "job-stage", "merge"), default="forward")
    ap.add_argument("--scenario", default="steady_2x8")
    ap.add_argument("--nodes", type=int, default=1024, help="job-stage: nodes of 8 GPUs")
    args = ap.parse_args()
    from ncclwatch_testkit import services as testing
    from ncclwatch_testkit.synth import write_spool

    bootstrap = testing.ensure_started("kafka").kafka_bootstrap if args.what == "forward" else ""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_p = Path(tmp)
        tree = tmp_p / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree),
                        args.old], check=True)
        try:
            shim = shim_for(tree, tmp_p / "shim")
            spool = tmp_p / "spool"
            # the spool bench_forward.py uses
            if args.what == "forward":
                write_spool(str(spool), streams=8, ops_per_stream=args.records // 8,
                            segment_ops=5000, comms=4)
            rates: dict[str, list[float]] = {"old": [], "new": []}
            seen: dict[str, list] = {}
            sizes: dict[str, int] = {}
            for i in range(args.repeats):
                order = ("old", "new") if i % 2 == 0 else ("new", "old")
                for side in order:
                    shim_arg = str(shim) if side == "old" else ""
                    if args.what == "forward":
                        cmd = [sys.executable, "-c", CHILD, shim_arg, str(ROOT / "bench" / "ingest"),
                               str(spool), args.config, bootstrap, str(args.records)]
                    elif args.what == "pipeline":
                        cmd = [sys.executable, "-c", CHILD_PIPELINE, shim_arg, args.scenario]
                    elif args.what == "merge":
                        cmd = [sys.executable, "-c", CHILD_MERGE, shim_arg]
                    else:
                        cmd = [sys.executable, "-c", CHILD_JOB_STAGE, shim_arg, str(args.nodes)]
                    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    assert ("/shim/" in r["module"]) == (side == "old"), r["module"]
                    rates[side].append(r["records"] / r["cpu_s"])
                    if "events" in r:  # the same job: both sides must find the same
                        seen.setdefault(side, r["events"])
                        assert r["events"] == seen[side] == seen.get("old", r["events"]), r["events"]
                        sizes[side] = r["bytes"]
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)])
    diffs = [n / o - 1 for o, n in zip(rates["old"], rates["new"], strict=True)]
    for side in ("old", "new"):
        v = rates[side]
        unit = {"forward": "op records", "merge": "verdicts"}.get(args.what, "windows")
        print(f"{side}: median {statistics.median(v):,.0f} {unit}/CPU-s, "
              f"min {min(v):,.0f}, max {max(v):,.0f} ({len(v)} runs)")
    print("new/old - 1 per repeat: " + ", ".join(f"{d:+.1%}" for d in diffs)
          + f"; median {statistics.median(diffs):+.1%}")
    if any(sizes.values()):
        print("verdict bytes: " + ", ".join(f"{side} {n:,}" for side, n in sizes.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
