"""Turn the device's run archives into the committed fixtures of ``tests/fixtures/gpu_runs``.

For each ``<name>.tar.gz`` written by ``record.py`` (the whole run directory) it writes:

* ``<name>.tar.gz``: the spool alone (``<job>/*.jsonl``: the plugin's op/drop/
  plugin_stats segments and the throughput records), what ``ncclwatch watch`` replays;
* ``<name>.labels.json``: the ground truth in the labelled-scenario format of
  ``docs/scenarios.md`` (see :func:`scenario_labels`);
* ``<name>.run.json``: how it was recorded (command, machine, topology, communicator
  hashes, injector details), the job's own per-step timings summarised per second, the
  live ``ncclwatch watch`` events and the NCCL log lines that show the transports.

``--keep-ops`` keeps only op records of the given op names (the rest of a run is kept),
to bound the fixture size.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path

from ncclwatch.rules import size_bucket


def read_spool_records(spool: Path) -> list[dict]:
    """Every JSON record of a spool directory (plugin segments and throughput files)."""
    out = []
    for f in sorted(spool.rglob("*.jsonl")):
        for line in f.read_bytes().splitlines():
            if line.strip():
                out.append(json.loads(line))
    return out


def comm_keys(records: list[dict], start_ns: int = 0, end_ns: int = 1 << 63) -> dict:
    """The detector keys ``{comm, op, size_bucket, transport}`` seen per communicator
    among ops that started in ``[start_ns, end_ns)``."""
    keys: dict[str, set[tuple]] = {}
    for r in records:
        if r.get("kind") == "op" and start_ns <= r["start_ns"] < end_ns:
            keys.setdefault(r["comm"], set()).add(
                (r["op"], size_bucket(r["bytes"]), r["transport"]))
    return {c: [{"comm": c, "op": o, "size_bucket": b, "transport": t}
                for o, b, t in sorted(ks)] for c, ks in keys.items()}


def arrival_lateness_s(records: list[dict], comm: str, rank: int, start_ns: int,
                       end_ns: int, min_bytes: int = 4096) -> float | None:
    """Median over ops of ``comm`` started in the interval: how much later ``rank`` started
    its kernel than the median of the other ranks (the same op instance: op name + seq)."""
    ops: dict[tuple, dict[int, int]] = {}
    for r in records:
        if (r.get("kind") == "op" and r["comm"] == comm and r["bytes"] >= min_bytes
                and start_ns <= r["start_ns"] < end_ns):
            ops.setdefault((r["op"], r["seq"]), {})[r["rank"]] = r["start_ns"]
    late = [(ranks[rank] - statistics.median(v for q, v in ranks.items() if q != rank)) / 1e9
            for ranks in ops.values() if rank in ranks and len(ranks) > 1]
    return statistics.median(late) if late else None


def effects(records: list[dict], start_ns: int, end_ns: int, before_s: float = 20.0,
            settle_s: float = 2.0) -> dict:
    """What the fault did, from the recording alone.

    Per (comm, op, size bucket): the median bus bandwidth of ops that started within the
    fault (after ``settle_s``) against those in the ``before_s`` before it; and the job's
    median TFLOP/s over the same two intervals.
    """
    before0 = start_ns - int(before_s * 1e9)
    on0 = start_ns + int(settle_s * 1e9)
    groups: dict[tuple, tuple[list[float], list[float]]] = {}
    tput: tuple[list[float], list[float]] = ([], [])
    for r in records:
        kind = r.get("kind")
        if kind == "op":
            t, v = r["start_ns"], r["busbw_gbs"]
            g = groups.setdefault((r["comm"], r["op"], size_bucket(r["bytes"]), r["transport"]),
                                  ([], []))
        elif kind == "throughput":
            t, v, g = r["ts_ns"], r["tflops_per_gpu"], tput
        else:
            continue
        if before0 <= t < start_ns:
            g[0].append(v)
        elif on0 <= t < end_ns:
            g[1].append(v)

    def change(pair):
        if not pair[0] or not pair[1]:
            return None
        b, o = statistics.median(pair[0]), statistics.median(pair[1])
        return {"before": round(b, 3), "during": round(o, 3), "change": round(o / b - 1, 4),
                "n_before": len(pair[0]), "n_during": len(pair[1])}

    return {
        "busbw_gbs": [{"comm": k[0], "op": k[1], "size_bucket": k[2], "transport": k[3],
                       **(change(v) or {})} for k, v in sorted(groups.items())],
        "tflops_per_gpu": change(tput),
    }


def scenario_labels(labels: dict, run: dict, records: list[dict]) -> dict:
    """The run's faults in the labelled-scenario format of ``docs/scenarios.md``.

    A network fault is labelled on the communicator(s) that cross pretend nodes, with
    the keys that ran during it and the measured busbw loss as ``magnitude``. A straggler
    is labelled with its rank in the first communicator its extra compute stalls (the
    host layer's NVLink communicator on 2 GPUs), as the detector reports ranks. When the
    straggler's GPU measurably made another process's rank late too (two processes share
    each GPU here), that communicator gets an ``optional`` straggler label: reporting it
    is right, missing it is no error.
    """
    out = []
    for f in labels["faults"]:
        t0, t1 = f["start_ns"], f["end_ns"]
        keys = comm_keys(records, t0, t1)
        eff = effects(records, t0, t1)
        label = {"start_ns": t0, "end_ns": t1, "onset_ns": t0,
                 "type": f["type"], "attribution": f["attribution"]}
        if f["type"] == "network_path":
            comms = sorted(c["comm"] for c in f.get("comms", {}).values())
            if len(comms) == 1:
                label["comm"] = comms[0]
            label["keys"] = [k for c in comms for k in keys.get(c, [])]
            losses = [-e["change"] for e in eff["busbw_gbs"]
                      if e["comm"] in comms and "change" in e]
            label["note"] = f"injector {f.get('injector')}; comms {', '.join(comms)}"
            extra = []
        else:
            comm, rank = next(iter(f.get("comm_ranks", {}).items()), (None, None))
            label.update({"rank": rank, "host": f.get("host"), "comm": comm})
            label["keys"] = keys.get(comm, [])
            losses = [-e["change"] for e in eff["busbw_gbs"] if e["comm"] == comm and "change" in e]
            label["note"] = (f"global rank {f['global_rank']} (pid {f.get('pid')}, GPU "
                             f"{f.get('gpu')}) ran {f.get('extra_matmuls')} extra matmuls/layer")
            extra = _shared_gpu_stragglers(f, run, records, comm)
        if losses:
            label["magnitude"] = round(statistics.median(losses), 4)
        out.append(label)
        out.extend(extra)
    return {"version": 1, "scenario": labels["scenario"], "job": labels["job"],
            "description": f"recorded on GPUs by bench/scenarios/record.py ({run.get('host')})",
            "labels": out}


def _shared_gpu_stragglers(f: dict, run: dict, records: list[dict], labelled: str | None,
                           min_lateness_s: float = 0.001) -> list[dict]:
    t0, t1 = f["start_ns"], f["end_ns"]
    gpu = f.get("gpu")
    out = []
    for name, c in run.get("comms", {}).items():
        if c["comm"] == labelled:
            continue
        for comm_rank, global_rank in enumerate(c["ranks"]):
            if run["ranks"][str(global_rank)]["gpu"] != gpu:
                continue
            before = arrival_lateness_s(records, c["comm"], comm_rank, t0 - 20 * 10**9, t0)
            during = arrival_lateness_s(records, c["comm"], comm_rank, t0 + 2 * 10**9, t1)
            if before is None or during is None or during - before < min_lateness_s:
                continue
            out.append({
                "start_ns": t0, "end_ns": t1, "onset_ns": t0, "type": "straggler",
                "attribution": "straggler", "rank": comm_rank, "host": f.get("host"),
                "comm": c["comm"], "optional": True,
                "keys": comm_keys(records, t0, t1).get(c["comm"], []),
                "note": (f"{name}: global rank {global_rank} shares GPU {gpu} with the "
                         f"straggler and started its kernels {1000 * during:.1f} ms after "
                         f"its peers (before the fault: {1000 * before:.1f} ms)"),
            })
    return out


def per_second(steps: list[dict]) -> list[dict]:
    """The job's step log as one row per wall-clock second (median TFLOP/s, phase times)."""
    rows: dict[int, list[dict]] = {}
    for s in steps:
        rows.setdefault(s["ts_ns"] // 10**9, []).append(s)
    out = []
    for sec in sorted(rows):
        group = rows[sec]
        out.append({
            "t_s": sec,
            "steps": len(group),
            "tflops_per_gpu": round(statistics.median(g["tflops_per_gpu"] for g in group), 2),
            "phase_ms": [round(1000 * statistics.median(g["phase_s"][i] for g in group), 2)
                         for i in range(len(group[0]["phase_s"]))],
            "straggler_rank": max(g["straggler_rank"] for g in group),
        })
    return out


def _spool_lines(path: Path, keep_ops: set[str] | None) -> bytes:
    data = path.read_bytes()
    if keep_ops is None:
        return data
    out = io.BytesIO()
    for line in data.splitlines(keepends=True):
        if b'"kind":"op"' in line:
            with_op = json.loads(line)
            if with_op.get("op") not in keep_ops:
                continue
        out.write(line)
    return out.getvalue()


def convert(archive: Path, dest: Path, keep_ops: set[str] | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        (root,) = [p for p in Path(tmp).iterdir() if p.is_dir()]
        name = root.name
        labels = json.loads((root / "labels.json").read_text())
        run = json.loads((root / "run.json").read_text())
        steps = [json.loads(x) for x in (root / "ctl" / "steps.jsonl").read_text().splitlines()]
        events_path = root / "live-events.jsonl"
        run["live_events"] = ([json.loads(x) for x in events_path.read_text().splitlines() if x]
                              if events_path.exists() else None)
        watch_log = root / "logs" / "watch.log"
        run["live_watch_log_tail"] = (watch_log.read_text(errors="replace").splitlines()[-40:]
                                      if watch_log.exists() else None)
        run["nccl_log"] = {p.name: p.read_text(errors="replace").splitlines()[:60]
                           for p in sorted((root / "logs").glob("nccl.*.log"))}
        run["per_second"] = per_second(steps)
        calibration = root / "calibration.json"
        if calibration.exists():
            run["calibration"] = json.loads(calibration.read_text())
        dest.mkdir(parents=True, exist_ok=True)
        spool_tar = dest / f"{name}.tar.gz"
        n_files = 0
        # mtime 0 and sorted names: the same run converts to the same bytes.
        with open(spool_tar, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0,
                                                         compresslevel=9) as gz, \
                tarfile.open(fileobj=gz, mode="w") as tar:
            for f in sorted((root / "spool").rglob("*.jsonl")):
                data = _spool_lines(f, keep_ops)
                info = tarfile.TarInfo(str(f.relative_to(root / "spool")))
                info.size = len(data)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))
                n_files += 1
        everything = read_spool_records(root / "spool")
        records = [r for r in everything if keep_ops is None or r.get("kind") != "op"
                   or r["op"] in keep_ops]
        run["kept_ops"] = sorted(keep_ops) if keep_ops else "all"
        run["effects"] = [{"label": f["type"], **effects(everything, f["start_ns"], f["end_ns"])}
                          for f in labels["faults"]]
        (dest / f"{name}.labels.json").write_text(
            json.dumps(scenario_labels(labels, run, records), indent=1) + "\n")
        (dest / f"{name}.run.json").write_text(json.dumps(run, indent=1, default=str) + "\n")
    return {"name": name, "spool_files": n_files, "bytes": spool_tar.stat().st_size}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("archives", nargs="+", type=Path)
    p.add_argument("--dest", type=Path, default=Path("tests/fixtures/gpu_runs"))
    p.add_argument("--keep-ops", nargs="*", help="op names to keep (default: all)")
    args = p.parse_args(argv)
    keep = set(args.keep_ops) if args.keep_ops else None
    for a in args.archives:
        print(json.dumps(convert(a, args.dest, keep)), file=sys.stdout)


if __name__ == "__main__":
    main()
