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


def scenario_labels(labels: dict, run: dict) -> dict:
    """The run's faults in the labelled-scenario format (one entry per fault)."""
    faults = []
    for f in labels["faults"]:
        entry = {
            "type": f["type"],
            "attribution": f["attribution"],
            "start_ns": f["start_ns"],
            "end_ns": f["end_ns"],
            "host": f.get("host"),
        }
        if f["type"] == "network_path":
            entry["rank"] = None
            entry["comms"] = sorted(c["comm"] for c in f.get("comms", {}).values())
            entry["transports"] = sorted({c["transport_expected"]
                                          for c in f.get("comms", {}).values()})
        else:
            entry["rank"] = f["global_rank"]
            entry["comm_ranks"] = f.get("comm_ranks", {})
            entry["pid"] = f.get("pid")
            entry["gpu"] = f.get("gpu")
        entry["detail"] = {k: v for k, v in f.items() if k not in entry and k != "comms"}
        faults.append(entry)
    return {"v": 1, "job": labels["job"], "scenario": labels["scenario"], "faults": faults}


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
        (dest / f"{name}.labels.json").write_text(
            json.dumps(scenario_labels(labels, run), indent=1) + "\n")
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
