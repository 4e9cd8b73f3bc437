"""What an injected fault did to the job's NCCL traffic, measured from the run itself.

An injector names a mechanism, not an effect: peer copies meant to slow NVLink may
leave NCCL's transfers alone and slow the GPUs' compute instead. For a run whose label
says ``intra_node``, this measures, over the fault against the minutes before it, on
every NVLink key (communicator, op, message size) with enough operations:

* the *transfer*: per 1-s window the fastest kernel time of any rank (the instance whose
  rank arrived last, so nobody waited), median over windows. A collective cannot beat
  its transfer, so this rising by ``LINK_SLOWER`` or more is a slower link;
* each rank's median kernel time: a rank whose time held (it waits for nobody) while
  every other rank's rose by ``OTHERS_WAIT`` or more is the late one; it is the
  straggler if it is the late one on most keys.

and rewrites the label to the effect (keeping the injected one in ``injected_as``):
``intra_node`` if a link slowed, else ``straggler`` naming the late rank if there is
one, else ``throughput_drop`` (attribution ``unknown``: the job slowed, NCCL did not).
The rule uses the fault's labelled span and the whole run, never a detector's output.

A run whose label was injected as a *shared GPU* (``gpuhog:``: another process computing
on one GPU, labelled a straggler of the job's processes there) is measured the same way
but judged by its own rule, since sharing the GPU also lengthens the shared rank's own
NCCL kernels (its SMs are time-sliced) and so its kernel time need not hold within
``LATE_HELD`` nor the transfer within ``LINK_SLOWER``: on each NVLink key whose
communicator holds a shared rank, that rank is the late one if every other rank's median
kernel time rose by at least ``OTHERS_WAIT`` times as much as the shared rank's own (the
others wait for it). Late on most of those keys: the straggler label stands; else the
run is relabelled ``throughput_drop`` (attribution ``unknown``).

    .venv/bin/python bench/scenarios/measure_fault.py RUN.tar.gz ... --out DIR
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path

from ncclwatch.ingest.recording import Options, read_recording

LINK_SLOWER = 1.10
OTHERS_WAIT = 1.5
LATE_HELD = 1.05
MIN_OPS = 50
TIMED = ("kernel_gpu", "inspector")  # GPU kernel time (Inspector's is kernel_gpu too)


def measure(run: Path) -> dict:
    labels = json.loads((run / "labels.json").read_text())
    info = json.loads((run / "run.json").read_text())
    fault = labels["faults"][0]
    t0, t1 = fault["start_ns"], fault["end_ns"]
    if info.get("profiler") == "inspector":
        srcs = [run / "inspector"]
        logs = tuple(str(p) for p in sorted((run / "trainlogs").glob("rank-*.log")))
        opts = Options(job=labels["job"], training_logs=logs)
    else:
        srcs, opts = [run / "spool"], Options(job=labels["job"])
    ops = [r for r in read_recording(srcs, options=opts)
           if getattr(r, "KIND", "") == "op" and r.transport == "nvlink" and r.timing in TIMED]
    keys: dict = collections.defaultdict(lambda: {"before": collections.defaultdict(list),
                                                  "during": collections.defaultdict(list),
                                                  "win": collections.defaultdict(list)})
    for r in ops:
        end = r.start_ns + r.exec_ns
        phase = "before" if end < t0 else "during" if t0 + 10**9 <= end <= t1 else None
        if phase is None:
            continue
        k = keys[(r.comm, r.op, r.bytes)]
        k[phase][r.rank].append(r.exec_ns)
        k["win"][(phase, end // 10**9)].append(r.exec_ns)
    out = []
    for (comm, op, nbytes), k in keys.items():
        if min(sum(map(len, k[p].values())) for p in ("before", "during")) < MIN_OPS:
            continue
        transfer = {p: statistics.median(min(v) for (ph, _), v in k["win"].items() if ph == p)
                    for p in ("before", "during")}
        ranks = {r: (statistics.median(k["before"][r]), statistics.median(k["during"][r]))
                 for r in k["before"] if k["during"].get(r)}
        late = [r for r, (b, d) in ranks.items() if d <= LATE_HELD * b
                and all(d2 >= OTHERS_WAIT * b2 for r2, (b2, d2) in ranks.items() if r2 != r)]
        out.append({"comm": comm, "op": op, "bytes": nbytes,
                    "transfer_ratio": round(transfer["during"] / transfer["before"], 3),
                    "exec_us_before_during": {r: [round(b / 1e3), round(d / 1e3)] for r, (b, d) in ranks.items()},
                    "late_rank": late[0] if len(late) == 1 and len(ranks) >= 2 else None})
    return {"keys": out}


def shared_gpu_late(m: dict, info: dict, global_ranks: list[int]) -> list[bool]:
    """Per NVLink key of a communicator that holds a shared-GPU rank: was that rank the late
    one (every other rank's kernel time rose ``OTHERS_WAIT`` times as much as its own)?"""
    comms = {c["comm"]: c for c in info["comms"].values()}
    out = []
    for k in m["keys"]:
        c = comms.get(k["comm"])
        own = [c["ranks"].index(g) for g in global_ranks if g in c["ranks"]] if c else []
        times = {int(r): bd for r, bd in k["exec_us_before_during"].items()}
        if not own or not all(r in times for r in own) or len(times) < 2:
            continue
        rise = {r: d / max(b, 1) for r, (b, d) in times.items()}
        own_rise = max(rise[r] for r in own)
        out.append(all(v >= OTHERS_WAIT * own_rise for r, v in rise.items() if r not in own))
    return out


def relabel(run: Path) -> dict | None:
    labels = json.loads((run / "labels.json").read_text())
    fault = labels["faults"][0] if labels["faults"] else None
    if fault is not None and str(fault.get("injector", "")).startswith("gpuhog"):
        m = measure(run)
        info = json.loads((run / "run.json").read_text())
        fault["injected_as"] = {"type": fault["type"], "attribution": fault["attribution"]}
        fault["measured"] = m
        late = shared_gpu_late(m, info, fault["global_ranks"])
        fault["measured"]["shared_rank_late"] = late
        if not (late and 2 * sum(late) > len(late)):
            fault.update(type="throughput_drop", attribution="unknown")
        return labels
    if fault is None or fault["type"] != "intra_node":
        return None
    m = measure(run)
    info = json.loads((run / "run.json").read_text())
    fault["injected_as"] = {"type": fault["type"], "attribution": fault["attribution"]}
    fault["measured"] = m
    slower = [k for k in m["keys"] if k["transfer_ratio"] >= LINK_SLOWER]
    named = collections.Counter(k["late_rank"] for k in m["keys"] if k["late_rank"] is not None)
    if slower:
        return labels  # the link did slow: intra_node stands
    fault.pop("comms", None)
    # One rank late on most keys: a slow GPU; on a minority, the ranks' usual jitter.
    if len(named) == 1 and 2 * next(iter(named.values())) > len(m["keys"]):
        comm_rank = next(iter(named))
        comm = next(c for c in info["comms"].values() if c["comm"] == m["keys"][0]["comm"])
        g = comm["ranks"][comm_rank]
        rk = info["ranks"][str(g)]
        fault.update(type="straggler", attribution="straggler", global_rank=g, global_ranks=[g],
                     pid=rk["pid"], pids=[rk["pid"]], gpu=rk["gpu"], comm_ranks={comm["comm"]: comm_rank})
    else:
        fault.update(type="throughput_drop", attribution="unknown")
    return labels


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("archives", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="directory for the (relabelled) archives")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for a in args.archives:
        name = a.name.removesuffix(".tar.gz")
        with tempfile.TemporaryDirectory() as tmp:
            with tarfile.open(a) as t:
                t.extractall(tmp, filter="data")
            run = Path(tmp) / name
            labels = relabel(run)
            if labels is None:
                shutil.copyfile(a, args.out / a.name)
                continue
            f = labels["faults"][0]
            print(f"{name}: injected {f['injected_as']['type']}, measured {f['type']}"
                  f"{' rank ' + str(f['global_rank']) if f['type'] == 'straggler' else ''}: "
                  f"{json.dumps(f['measured']['keys'])}", file=sys.stderr)
            (run / "labels.json").write_text(json.dumps(labels, indent=1))
            with tarfile.open(args.out / a.name, "w:gz", compresslevel=9) as t:
                t.add(run, arcname=name)


if __name__ == "__main__":
    main()
