"""Turn the GPU benchmark outputs into numbers: capture ratios, accuracy, overhead.

Standard library only (it runs on the GPU machine too).

    analyze.py capture  CALLS_DIR SPOOL_DIR            (bench/plugin/capture.py under torchrun)
    analyze.py accuracy BENCH_CSV SPOOL_DIR            (nccl_bench accuracy + graph output)
    analyze.py overhead BENCH_CSV                      (nccl_bench overhead runs, interleaved)
    analyze.py stress   BENCH_CSV SPOOL_DIR            (nccl_bench stress: counts by timing)

Each prints a Markdown report and writes the same numbers as JSON next to the input
(``--json PATH`` to choose). Matching the plugin's records to calls: the benchmark wrote
the host wall-clock window of every (mode, op, size); a record belongs to the window its
``start_ns`` (the GPU start converted to wall clock by the plugin) falls in, with the
config's op name and its most common ``bytes``, and records pair with calls in GPU start
order. So a record that is missing, extra, or whose clock conversion is wrong shows up as
a capture ratio other than 100 %.
"""

from __future__ import annotations

import argparse
import collections
import csv
import glob
import json
import math
import os
import statistics
import sys

# Records may start up to this long after the window's closing host timestamp (the host
# clock is read after cudaStreamSynchronize; start_ns is late by the plugin's calibration
# bias, microseconds).
WINDOW_SLACK_NS = 2_000_000


def load_spool(spool_dir: str) -> tuple[dict[int, list[dict]], dict[int, dict]]:
    """Op records by pid, and each pid's last plugin_stats."""
    ops: dict[int, list[dict]] = collections.defaultdict(list)
    stats: dict[int, dict] = {}
    for path in sorted(glob.glob(os.path.join(spool_dir, "**", "*.jsonl"), recursive=True)):
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    continue
                rec = json.loads(line)
                if rec["kind"] == "op":
                    ops[rec["pid"]].append(rec)
                elif rec["kind"] == "plugin_stats":
                    stats[rec["pid"]] = rec
    return ops, stats


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)] if s else float("nan")


def in_window(recs: list[dict], names: set[str], t0: int, t1: int) -> dict[str, list[dict]]:
    """Records of `names` starting in [t0, t1 + slack], keeping each name's most common size."""
    by_name: dict[str, list[dict]] = collections.defaultdict(list)
    for r in recs:
        if r["op"] in names and t0 <= r["start_ns"] <= t1 + WINDOW_SLACK_NS:
            by_name[r["op"]].append(r)
    out = {}
    for name, rs in by_name.items():
        common = collections.Counter(r["bytes"] for r in rs).most_common(1)[0][0]
        out[name] = sorted((r for r in rs if r["bytes"] == common), key=lambda r: r["start_ns"])
    return out


def accuracy_stats(recs: list[dict], event_ns: list[int]) -> dict:
    """Relative error of the plugin's exec_ns against per-call CUDA-event time, paired in order."""
    rel = [(r["exec_ns"] - e) / e for r, e in zip(recs, event_ns, strict=True) if e > 0]
    return {
        "median_diff_us": statistics.median(r["exec_ns"] - e for r, e in zip(recs, event_ns, strict=True)) / 1e3,
        "median_exec_us": statistics.median(r["exec_ns"] for r in recs) / 1e3,
        "median_event_us": statistics.median(event_ns) / 1e3,
        "median_rel_err": statistics.median(rel),
        "p95_abs_rel_err": percentile([abs(x) for x in rel], 0.95),
    }


def fmt_pct(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:+.2f} %"


def size_label(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


# --- torch capture ----------------------------------------------------------------------

CAPTURE_NAMES = {
    "AllReduce": ["AllReduce"],
    "AllGather": ["AllGather"],
    "ReduceScatter": ["ReduceScatter"],
    "Broadcast": ["Broadcast"],
    "Reduce": ["Reduce"],
    "AllToAll": ["AllToAll"],
    "SendRecv": ["Send", "Recv"],
}


def analyze_capture(calls_dir: str, spool_dir: str) -> dict:
    ops, stats = load_spool(spool_dir)
    rows, graph_rows = [], []
    for path in sorted(glob.glob(os.path.join(calls_dir, "calls-rank*.json"))):
        with open(path) as f:
            run = json.load(f)
        recs = ops.get(run["pid"], [])
        for c in run["configs"]:
            names = CAPTURE_NAMES[c["op"]]
            found = in_window(recs, set(names), c["t0_ns"], c["t1_ns"])
            if c["op"] == "AllToAll" and not found:
                # PyTorch may build all_to_all from grouped Send/Recv instead of ncclAlltoAll.
                names = ["Send", "Recv"]
                found = in_window(recs, set(names), c["t0_ns"], c["t1_ns"])
            # all_to_all from grouped Send/Recv: one of each per peer, self included.
            per_call = run.get("world", 2) if c["op"] == "AllToAll" and names == ["Send", "Recv"] else 1
            for name in names:
                got = found.get(name, [])
                row = {
                    "mode": c["mode"],
                    "op": c["op"],
                    "record_op": name,
                    "bytes": c["bytes"],
                    "rank": run["rank"],
                    "issued": c["calls"] * per_call,
                    "captured": len(got),
                    "kernel_gpu": sum(r["timing"] == "kernel_gpu" for r in got),
                    "record_bytes": got[0]["bytes"] if got else None,
                }
                if len(got) == c["calls"] and all(r["timing"] == "kernel_gpu" for r in got):
                    row.update(accuracy_stats(got, c["event_ns"]))
                    if c.get("launch_ns") and c["mode"] == "sync":
                        # GPU start (the plugin's calibrated wall clock) minus the host time
                        # just before the call: the launch latency if the clock is right; a
                        # negative value would be a start_ns placed too early.
                        lead = [r["start_ns"] - h for r, h in zip(got, c["launch_ns"], strict=True)]
                        row["start_minus_launch_us"] = {
                            "min": min(lead) / 1e3,
                            "median": statistics.median(lead) / 1e3,
                            "max": max(lead) / 1e3,
                        }
                rows.append(row)
        g = run.get("graph")
        if g and "error" not in g:
            found = in_window(recs, {"AllReduce"}, g["t0_ns"], g["t1_ns"]).get("AllReduce", [])
            graph_rows.append(
                {
                    "rank": run["rank"],
                    "issued": g["replays"] * g["per_graph"],
                    "captured": len(found),
                    "graph_flag": sum(r["graph"] for r in found),
                }
            )
        elif g:
            graph_rows.append({"rank": run["rank"], "error": g["error"]})
    return {
        "rows": rows,
        "graph": graph_rows,
        "versions": {"torch": run.get("torch"), "nccl": run.get("nccl")},
        "plugin_stats": {str(p): s for p, s in stats.items()},
    }


def report_capture(res: dict) -> str:
    out = []
    rows = res["rows"]
    out.append("### Capture (records / calls issued, per rank, both modes)\n")
    out.append("| op | record | " + " | ".join(size_label(b) for b in sorted({r["bytes"] for r in rows})) + " |")
    sizes = sorted({r["bytes"] for r in rows})
    out.append("| --- | --- | " + " | ".join("---" for _ in sizes) + " |")
    seen = []
    for r in rows:
        key = (r["op"], r["record_op"])
        if key not in seen:
            seen.append(key)
    for op, rec_op in seen:
        cells = []
        for b in sizes:
            mine = [r for r in rows if (r["op"], r["record_op"], r["bytes"]) == (op, rec_op, b)]
            cap, iss = sum(r["captured"] for r in mine), sum(r["issued"] for r in mine)
            gpu = sum(r["kernel_gpu"] for r in mine)
            cells.append(f"{cap}/{iss}" + ("" if gpu == cap else f" ({gpu} GPU-timed)"))
        out.append(f"| {op} | {rec_op} | " + " | ".join(cells) + " |")
    total_cap = sum(r["captured"] for r in rows)
    total_iss = sum(r["issued"] for r in rows)
    out.append(f"\nAll: {total_cap}/{total_iss} = {100 * total_cap / max(total_iss, 1):.2f} %.")
    for p, s in res["plugin_stats"].items():
        out.append(f"pid {p}: plugin_stats recorded {s['recorded']}, dropped {s['dropped']}")
    for g in res["graph"]:
        out.append(
            f"CUDA graph, rank {g['rank']}: "
            + (
                f"error {g['error']}"
                if "error" in g
                else f"{g['captured']}/{g['issued']} replayed AllReduces recorded, {g['graph_flag']} with graph=true"
            )
        )
    leads = [r["start_minus_launch_us"] for r in rows if "start_minus_launch_us" in r]
    if leads:
        out.append(
            "\nstart_ns minus host launch time, sync mode, all ops (µs): "
            f"min {min(x['min'] for x in leads):.1f}, median of medians "
            f"{statistics.median(x['median'] for x in leads):.1f}, max {max(x['max'] for x in leads):.1f}"
        )
    bad = [r for r in rows if r["captured"] != r["issued"]]
    for r in bad[:40]:
        out.append(
            f"mismatch: {r['mode']} {r['op']}/{r['record_op']} {size_label(r['bytes'])} rank {r['rank']}: "
            f"{r['captured']}/{r['issued']} ({r['kernel_gpu']} GPU-timed)"
        )
    out.append("\n### Plugin exec time vs per-call CUDA events (ranks pooled)\n")
    out.append(
        "| mode | op | record | size | median exec µs | median event µs | median exec − event µs "
        "| median rel. err | P95 abs rel. err |"
    )
    out.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in rows:
        if "median_rel_err" in r:
            groups[(r["mode"], r["op"], r["record_op"], r["bytes"])].append(r)
    for (mode, op, rec_op, b), rs in groups.items():
        out.append(
            f"| {mode} | {op} | {rec_op} | {size_label(b)} | "
            f"{statistics.median(r['median_exec_us'] for r in rs):.1f} | "
            f"{statistics.median(r['median_event_us'] for r in rs):.1f} | "
            f"{statistics.median(r['median_diff_us'] for r in rs):+.2f} | "
            f"{fmt_pct(statistics.median(r['median_rel_err'] for r in rs))} | "
            f"{100 * max(r['p95_abs_rel_err'] for r in rs):.2f} % |"
        )
    return "\n".join(out)


# --- nccl_bench accuracy + graph --------------------------------------------------------

BENCH_NAMES = {"AllReduce": ["AllReduce"], "AllGather": ["AllGather"], "SendRecv": ["Send", "Recv"]}


def read_csv(path: str) -> list[list[str]]:
    with open(path) as f:
        return [row for row in csv.reader(f) if row and row[0] in ("acc", "win", "graph", "lat", "stress")]


def analyze_accuracy(bench_csv: str, spool_dir: str) -> dict:
    ops, stats = load_spool(spool_dir)
    if len(ops) != 1:
        raise SystemExit(f"expected the records of one benchmark process, found pids {sorted(ops)}")
    ((pid, recs),) = ops.items()
    events: dict[tuple, list[int]] = collections.defaultdict(list)
    rows, graph_rows = [], []
    lines = read_csv(bench_csv)
    for row in lines:
        if row[0] == "acc":
            _, op, b, _call, dev, ns = row
            events[(op, int(b), int(dev))].append(int(ns))
    for row in lines:
        if row[0] == "win":
            _, op, b, t0, t1 = row
            for dev in sorted({k[2] for k in events}):
                ev = events[(op, int(b), dev)]
                mine = [r for r in recs if r["rank"] == dev]
                found = in_window(mine, set(BENCH_NAMES[op]), int(t0), int(t1))
                for name in BENCH_NAMES[op]:
                    got = found.get(name, [])
                    r = {
                        "op": op,
                        "record_op": name,
                        "bytes": int(b),
                        "rank": dev,
                        "issued": len(ev),
                        "captured": len(got),
                        "kernel_gpu": sum(x["timing"] == "kernel_gpu" for x in got),
                    }
                    if len(got) == len(ev):
                        r.update(accuracy_stats(got, ev))
                    rows.append(r)
        elif row[0] == "graph":
            _, op, b, replays, per_graph, t0, t1 = row
            for dev in sorted({r["rank"] for r in recs}):
                found = in_window([r for r in recs if r["rank"] == dev], {op}, int(t0), int(t1)).get(op, [])
                graph_rows.append(
                    {
                        "rank": dev,
                        "issued": int(replays) * int(per_graph),
                        "captured": len(found),
                        "graph_flag": sum(r["graph"] for r in found),
                        "kernel_gpu": sum(r["timing"] == "kernel_gpu" for r in found),
                    }
                )
    return {"rows": rows, "graph": graph_rows, "plugin_stats": stats.get(pid)}


def report_accuracy(res: dict) -> str:
    out = [
        "| op | record | size | captured / issued | median exec µs | median event µs | median exec − event µs "
        "| median rel. err | P95 abs rel. err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in res["rows"]:
        groups[(r["op"], r["record_op"], r["bytes"])].append(r)
    for (op, rec_op, b), rs in groups.items():
        cap = f"{sum(r['captured'] for r in rs)}/{sum(r['issued'] for r in rs)}"
        acc = [r for r in rs if "median_rel_err" in r]
        if acc:
            out.append(
                f"| {op} | {rec_op} | {size_label(b)} | {cap} | "
                f"{statistics.median(r['median_exec_us'] for r in acc):.1f} | "
                f"{statistics.median(r['median_event_us'] for r in acc):.1f} | "
                f"{statistics.median(r['median_diff_us'] for r in acc):+.2f} | "
                f"{fmt_pct(statistics.median(r['median_rel_err'] for r in acc))} | "
                f"{100 * max(r['p95_abs_rel_err'] for r in acc):.2f} % |"
            )
        else:
            out.append(f"| {op} | {rec_op} | {size_label(b)} | {cap} | | | | | |")
    for g in res["graph"]:
        out.append(
            f"\nCUDA graph, rank {g['rank']}: {g['captured']}/{g['issued']} replayed AllReduces recorded, "
            f"{g['graph_flag']} with graph=true, {g['kernel_gpu']} GPU-timed."
        )
    if res["plugin_stats"]:
        s = res["plugin_stats"]
        out.append(f"\nplugin_stats: recorded {s['recorded']}, dropped {s['dropped']}")
    return "\n".join(out)


# --- overhead ---------------------------------------------------------------------------


def analyze_overhead(bench_csv: str, base: str = "none") -> dict:
    per: dict[tuple, list[float]] = collections.defaultdict(list)
    for row in read_csv(bench_csv):
        if row[0] == "lat":
            _, label, rep, op, b, _batch, _calls, us = row
            per[(label, int(rep), op, int(b))].append(float(us))
    med = {k: statistics.median(v) for k, v in per.items()}
    labels = sorted({k[0] for k in med})
    reps = sorted({k[1] for k in med})
    keys = sorted({(k[2], k[3]) for k in med})
    rows = []
    for op, b in keys:
        base_by_rep = {r: med[(base, r, op, b)] for r in reps if (base, r, op, b) in med}
        row = {"op": op, "bytes": b, "base_us": statistics.median(base_by_rep.values()), "labels": {}}
        for label in labels:
            # Reps are interleaved, so each rep's ratio compares runs minutes apart at most.
            ratios = [
                med[(label, r, op, b)] / base_by_rep[r] - 1
                for r in reps
                if (label, r, op, b) in med and r in base_by_rep
            ]
            row["labels"][label] = {
                "median_us": statistics.median(med[(label, r, op, b)] for r in reps if (label, r, op, b) in med),
                "median_delta": statistics.median(ratios),
                "min_delta": min(ratios),
                "max_delta": max(ratios),
                "per_rep_delta": ratios,
            }
        rows.append(row)
    return {"base": base, "labels": labels, "reps": reps, "rows": rows}


def report_overhead(res: dict) -> str:
    labels = [x for x in res["labels"] if x != res["base"]]
    out = [
        "| op | size | no plugin µs/call | " + " | ".join(f"{x} Δ (range)" for x in labels) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in labels) + " |",
    ]
    for row in res["rows"]:
        cells = []
        for label in labels:
            d = row["labels"][label]
            cells.append(
                f"{100 * d['median_delta']:+.2f} % ({100 * d['min_delta']:+.1f} … {100 * d['max_delta']:+.1f})"
            )
        out.append(f"| {row['op']} | {size_label(row['bytes'])} | {row['base_us']:.2f} | " + " | ".join(cells) + " |")
    if {"ncclwatch", "noop_kch"} <= set(res["labels"]):
        out.append(
            "\nncclwatch over the do-nothing plugin with the same mask (percentage points, median of per-rep"
            " differences):\n"
        )
        out.append("| op | size | ncclwatch − noop_kch |")
        out.append("| --- | --- | --- |")
        for row in res["rows"]:
            a, b = row["labels"]["ncclwatch"]["per_rep_delta"], row["labels"]["noop_kch"]["per_rep_delta"]
            diff = [100 * (x - y) for x, y in zip(a, b, strict=False)]
            out.append(
                f"| {row['op']} | {size_label(row['bytes'])} | {statistics.median(diff):+.2f} pp "
                f"({min(diff):+.2f} … {max(diff):+.2f}) |"
            )
    return "\n".join(out)


# --- stress -------------------------------------------------------------------------------


def analyze_stress(bench_csv: str, spool_dir: str) -> dict:
    """Issued ops against records, drops and timing sources of one nccl_bench stress run."""
    (row,) = [r for r in read_csv(bench_csv) if r and r[0] == "stress"]
    eager, replays, per_graph = int(row[1]), int(row[2]), int(row[3])
    ops, stats = load_spool(spool_dir)
    recs = [r for pid_recs in ops.values() for r in pid_recs]
    timing = collections.Counter(r["timing"] for r in recs)
    dropped = sum(sum(st["dropped"].values()) for st in stats.values())
    recorded = sum(st["recorded"] for st in stats.values())
    graph = sum(1 for r in recs if r["graph"])
    host = collections.Counter(f"{r['op']} graph={r['graph']}" for r in recs if r["timing"] == "host")
    # GPU-timed exec per (op, size): a channel counter out of step would show as another
    # op's timestamps (milliseconds for a 1 KiB op), as after a Send/Recv to self.
    execs: dict[str, list[int]] = collections.defaultdict(list)
    for r in recs:
        if r["timing"] == "kernel_gpu":
            execs[f"{r['op']} {r['bytes']}"].append(r["exec_ns"])
    exec_us = {k: {"n": len(v), "p50_us": percentile(v, 0.5) / 1e3, "p99_us": percentile(v, 0.99) / 1e3,
                   "max_us": max(v) / 1e3} for k, v in sorted(execs.items())}
    return {
        "issued_eager": eager, "graph_replays": replays, "ops_per_graph": per_graph,
        "issued": eager + replays * per_graph, "seconds": float(row[4]),
        "records": len(recs), "recorded_stat": recorded, "dropped": dropped,
        "graph_records": graph, "timing": dict(timing), "gpu_exec_us": exec_us,
        "host_timed_by_op": dict(host),
    }


def report_stress(res: dict) -> str:
    exact = res["records"] + res["dropped"] == res["issued"]
    return "\n".join([
        f"- issued: {res['issued']:,} ops ({res['issued_eager']:,} eager + {res['graph_replays']} graph "
        f"replays x {res['ops_per_graph']} ops) in {res['seconds']:.1f} s",
        f"- recorded: {res['records']:,} (plugin_stats: {res['recorded_stat']:,}), dropped: {res['dropped']:,}"
        f" -> recorded + dropped {'==' if exact else '!='} issued"
        + ("" if exact else f" (difference {res['issued'] - res['records'] - res['dropped']:+,})"),
        f"- graph replay records: {res['graph_records']:,}",
        "- timing: " + ", ".join(f"{k} {v:,}" for k, v in sorted(res["timing"].items())),
        "- host-timed by op: " + (", ".join(f"{k} {v:,}" for k, v in sorted(res["host_timed_by_op"].items()))
                                  or "none"),
        "",
        "| op bytes | GPU-timed | p50 µs | p99 µs | max µs |",
        "| --- | --- | --- | --- | --- |",
        *(f"| {k} | {v['n']:,} | {v['p50_us']:.1f} | {v['p99_us']:.1f} | {v['max_us']:.1f} |"
          for k, v in res["gpu_exec_us"].items()),
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["capture", "accuracy", "overhead", "stress"])
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.what == "capture":
        res = analyze_capture(*args.inputs)
        text = report_capture(res)
    elif args.what == "accuracy":
        res = analyze_accuracy(*args.inputs)
        text = report_accuracy(res)
    elif args.what == "stress":
        res = analyze_stress(*args.inputs)
        text = report_stress(res)
    else:
        res = analyze_overhead(*args.inputs)
        text = report_overhead(res)
    print(text)
    path = args.json or os.path.join(os.path.dirname(os.path.abspath(args.inputs[0])), f"{args.what}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
