"""Score the detectors on the recorded GPU runs: expected, got, delay, false alerts, severity.

For every run of ``tests/fixtures/gpu_runs/2026-11-23`` (or the directories given):

* **truth** comes from the run itself: ``labels.json`` (what was injected, when) and the
  job's own step timings (``ctl/steps.jsonl``), which give the *measured* throughput
  loss of each fault: the median TFLOP/s per GPU over the fault (its first 2 s left out)
  against the median before it (for a process stopped part of the time, ``freeze``, or
  a fault on for part of every second or more, the work done per second instead:
  :func:`rate_drop`);
* a fault costing at least ``--gate`` (5 %) must be detected, with the right attribution
  (``network_path`` for a network fault; ``straggler`` naming a process on the slow GPU
  for a straggler), within ``--max-delay-s`` of its start; its severity must be
  ``critical`` (the rule: critical exactly when the measured loss is >= 5 %; a
  ``throughput_drop``, not NCCL's fault, is a warning from 10 %, info below);
* a fault below the gate, and a clean run, must raise nothing;
* every firing incident that is not the one expected answer is a false alert (a second
  incident for the same fault counts too).

Plugin runs are read as a plugin user has them (the spool, throughput through
``report_throughput``), Inspector runs as an Inspector-only user has them (the Inspector
JSON logs plus the per-rank Megatron-format training logs), through
``ncclwatch.ingest.recording`` and the local-mode detector loop (``watch --speed 0``).

    .venv/bin/python bench/detectors/eval_gpu_runs.py --split heldout --markdown

``--emulate-sampling N`` replays the plugin runs as if they had been recorded with
``NCCLWATCH_TIMING_SAMPLE=N`` (see ``sampled_like_plugin``): the recorded GPU timings of the
ops the sampler would not have timed are dropped (``timing: sampled_out``), to see whether
detection, delay and attribution hold on what sampled timing leaves.

``--emulate-log-interval-s S`` replays every run as if the job's throughput had been
reported once per ``S`` seconds (see ``coarser_throughput``), as a trainer that logs every
few steps, or whose steps take seconds, reports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ncclwatch.detectors import watch
from ncclwatch.detectors.incidents import SEVERITY_RANK
from ncclwatch.ingest.recording import Options, ReadStats, read_recording

from ncclwatch import config
from ncclwatch.records import OpRecord, ThroughputRecord

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "gpu_runs" / "2026-11-23"
GATE = 0.05
SETTLE_NS = 2 * 10**9
PULSE_SETTLE_NS = 10**9
DUTY_PERIOD_S = 1.0  # a duty cycle this slow leaves whole steps untouched: measure the rate


def measured_drop(run: Path, start_ns: int, end_ns: int) -> float:
    """The job's throughput loss over [start, end], from its own step timings.

    A pulsed fault (its injection lists ``on_spans_ns``) is measured over the spans it
    was on, each after ``PULSE_SETTLE_NS`` or half the span, whichever is shorter: the
    median over the whole period would pick the off half of the steps and call an
    intermittent fault harmless (and a full second's settling left nothing of 1-s spans).
    A run whose injection stopped a process part of the time (``freeze``), or was on for
    part of every ``period_s`` of at least ``DUTY_PERIOD_S`` (a GPU taken a second at a
    time), is measured by :func:`rate_drop`: its stalls lengthen some steps and leave the
    others, and so the median, alone. So is a fault inside which no step ended at all.
    """
    steps = [json.loads(x) for x in (run / "ctl" / "steps.jsonl").read_text().splitlines() if x]
    injections = json.loads((run / "run.json").read_text()).get("injections", ())
    if any(i.get("injector") == "freeze" or i.get("period_s", 0) >= DUTY_PERIOD_S for i in injections):
        return rate_drop(steps, start_ns, end_ns)
    before = [s["tflops_per_gpu"] for s in steps if s["ts_ns"] < start_ns]
    spans = next((i["on_spans_ns"] for i in injections if i.get("on_spans_ns")), None)
    if spans:
        during = [s["tflops_per_gpu"] for s in steps
                  if any(a + min(PULSE_SETTLE_NS, (b - a) // 2) <= s["ts_ns"] <= b for a, b in spans)]
    else:
        during = [s["tflops_per_gpu"] for s in steps if start_ns + SETTLE_NS <= s["ts_ns"] <= end_ns]
    if before and not during and not spans:
        # No step ended inside the fault: the job stopped (a network path that carried
        # nothing), which only its work over the time can say.
        return rate_drop(steps, start_ns, end_ns)
    if not before or not during:
        return 0.0
    return 1.0 - statistics.median(during) / statistics.median(before)


def rate_drop(steps: list[dict], start_ns: int, end_ns: int) -> float:
    """The loss of work done per second over [start + settle, end] against before it.

    A process stopped for a fraction of every second (``freeze``) makes one step in a
    few much longer and leaves the others as they were, so the median step's TFLOP/s
    holds while the job does a fifth less work a second: its cost is the rate, each
    step's TFLOP/s times its duration summed over the time.

    >>> steps, t = [], 0.0
    >>> for i in range(200):  # 10 TFLOP a step; from 10 s every third step stalls 0.1 s
    ...     step_s = 0.2 if t >= 10 and i % 3 == 0 else 0.1
    ...     t += step_s
    ...     steps.append({"ts_ns": int(t * 1e9), "step_s": step_s, "tflops_per_gpu": 10 / step_s})
    >>> round(rate_drop(steps, 10**10, 2 * 10**10), 2)
    0.25
    >>> stalled = [s for s in steps if s["ts_ns"] < 10**10] + [  # no step done in 10 s
    ...     {"ts_ns": 21 * 10**9, "step_s": 11.0, "tflops_per_gpu": 10 / 11.0}]
    >>> round(rate_drop(stalled, 10**10, 2 * 10**10), 2)  # its 10 TFLOP spread over 11 s
    0.99
    >>> statistics.median(s["tflops_per_gpu"] for s in steps if s["ts_ns"] > 12e9)  # the median holds
    100.0
    """
    def rate(lo: int, hi: int) -> float:
        # Each step's work spread over its own time, counted for the part inside
        # [lo, hi): a step that ends after the span (one stalled 10 s) did no work in it.
        work = 0.0
        for s in steps:
            end, dur = s["ts_ns"], s["step_s"] * 1e9
            overlap = min(end, hi) - max(end - dur, lo)
            if overlap > 0 and dur > 0:
                work += s["tflops_per_gpu"] * s["step_s"] * overlap / dur
        return work / ((hi - lo) / 1e9)

    first = min((s["ts_ns"] - s["step_s"] * 1e9 for s in steps), default=start_ns)
    lo = start_ns + SETTLE_NS
    if first >= start_ns or lo >= end_ns:
        return 0.0
    before = rate(first, start_ns)
    return 0.0 if before <= 0 else 1.0 - rate(lo, end_ns) / before


def sources(run: Path) -> tuple[list[Path], Options]:
    """What a user of the run's profiler has: Inspector logs + training logs, or the spool
    (+ the training logs where the job reported its throughput only there: Megatron-LM's
    own runs, ``run.json`` ``"throughput": "log"``)."""
    info = json.loads((run / "run.json").read_text())
    job = json.loads((run / "labels.json").read_text())["job"]
    logs = sorted(str(p) for p in (run / "trainlogs").glob("rank-*.log"))
    if info.get("profiler", "ncclwatch") == "inspector":
        return [run / "inspector"], Options(job=job, training_logs=logs)
    if info.get("throughput") == "log":
        return [run / "spool"], Options(job=job, training_logs=logs)
    return [run / "spool"], Options(job=job)


_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser, as plugin/src/sampler.c draws its groups."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sampled_like_plugin(records: list[Any], n: int, key_ms: int = 200) -> list[Any]:
    """The records as the plugin's sampler would have left them (a model of sampler.c).

    Per process, every op is one group (PyTorch issues one per collective); a group is
    timed when the hash of its index draws 1 in ``n``, or when it is the predicted successor
    of the previous group and its key (communicator, op, size) was not timed for
    ``key_ms``; never while a timed op is still running (the plugin waits for its channel
    events). The first group is timed. Clock: the op's recorded start.
    """
    state: dict[tuple, dict[str, Any]] = {}
    out = []
    for r in records:
        if not isinstance(r, OpRecord) or r.timing != "kernel_gpu":
            out.append(r)
            continue
        st = state.setdefault((r.job, r.host, r.pid), {"g": 0, "timed": True, "prev": None,
                                                       "next": {}, "last": {}, "busy_until": 0})
        key = (r.comm, r.op, r.bytes)
        timed = st["timed"]
        now = r.start_ns
        if timed:
            st["last"][key] = now
            st["busy_until"] = r.start_ns + r.exec_ns
        else:
            out_r = dataclasses.replace(r, timing="sampled_out", exec_ns=0, algbw_gbs=0.0, busbw_gbs=0.0)
        out.append(r if timed else out_r)
        if st["prev"] is not None:
            st["next"][st["prev"]] = key
        st["prev"] = key
        st["g"] += 1
        nxt = _mix(st["g"]) < _MASK64 // n
        pred = st["next"].get(key)
        if not nxt and key_ms > 0 and pred is not None:
            nxt = now - st["last"].get(pred, -(1 << 62)) >= key_ms * 1_000_000
        st["timed"] = nxt and now >= st["busy_until"]
    return out


def coarser_throughput(records: list[Any], every_s: float) -> list[Any]:
    """The records as a trainer logging once per ``every_s`` seconds would have left them.

    Per reporter (job, host, rank), the throughput records of each interval of the clock
    become one, at the interval's last step, with the TFLOP/s Megatron prints for a log
    interval (work over elapsed time: the harmonic mean of the steps', each step the same
    work). Every other record is left as it is, in its place.

    >>> recs = [ThroughputRecord(job="j", host="h", rank=0, ts_ns=t * 10**9, step=t,
    ...         tflops_per_gpu=v, tokens_per_s=None, source="api")
    ...         for t, v in ((0, 100.0), (1, 50.0), (2, 100.0), (3, 100.0), (4, 80.0))]
    >>> [(r.step, round(r.tflops_per_gpu, 1)) for r in coarser_throughput(recs, 2.0)]
    [(1, 66.7), (3, 100.0), (4, 80.0)]
    """
    every_ns = int(every_s * 1e9)
    out: list[Any] = []
    held: dict[tuple, tuple[int, int, list[float]]] = {}  # reporter -> (interval, slot, TFLOP/s)

    def close(slot: int, values: list[float]) -> None:
        out[slot] = dataclasses.replace(out[slot], tflops_per_gpu=len(values) / sum(
            1.0 / max(v, 1e-9) for v in values))

    for r in records:
        if not isinstance(r, ThroughputRecord):
            out.append(r)
            continue
        who, interval = (r.job, r.host, r.rank), r.ts_ns // every_ns
        prev = held.get(who)
        if prev is not None and prev[0] != interval:
            close(prev[1], prev[2])
            prev = None
        values = prev[2] if prev is not None else []
        if prev is not None:
            out[prev[1]] = None  # the interval's record moves to its latest step
        values.append(r.tflops_per_gpu)
        held[who] = (interval, len(out), values)
        out.append(r)
    for _, slot, values in held.values():  # the last interval of each: what it has
        close(slot, values)
    return [r for r in out if r is not None]


def incidents(events: list[Any]) -> dict[str, dict[str, Any]]:
    """Events grouped by incident id: first firing event, highest severity, end."""
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        inc = out.setdefault(e.id, {"first": e, "severity": e.severity, "end_ns": None,
                                    "resolved_delta": None})
        if SEVERITY_RANK[e.severity] > SEVERITY_RANK[inc["severity"]]:
            inc["severity"] = e.severity  # a firing event repeated as its severity rose
        if e.state == "resolved":
            inc["end_ns"] = e.end_ns
            inc["resolved_delta"] = e.throughput_delta
    return out


def names_straggler(ev: Any, fault: dict, run_info: dict) -> bool:
    """The event names a process on the slow GPU (by its rank in one of its communicators).

    A slow GPU makes every process on it late, so naming any of them names the GPU (in a
    real job each GPU has one process; here two share it, see bench/scenarios/README.md).
    """
    evidence = ev.evidence or {}
    comm = next((c for c in run_info.get("comms", {}).values() if c["comm"] == evidence.get("comm")), None)
    if comm is None:
        # A communicator the recorder did not list (a job's step-sync one): the event's
        # process id says which rank it named.
        pid = evidence.get("pid")
        ranks = [r for r in run_info["ranks"].values() if pid is not None and r.get("pid") == pid]
        return len(ranks) == 1 and ranks[0]["gpu"] == fault["gpu"]
    if ev.rank is None or not 0 <= ev.rank < len(comm["ranks"]):
        return False
    global_rank = comm["ranks"][ev.rank]
    return run_info["ranks"][str(global_rank)]["gpu"] == fault["gpu"]


def fault_as(f: dict, labels: str) -> dict:
    """The fault as judged: measured (as labelled) or as injected.

    ``bench/scenarios/measure_fault.py`` rewrites a label to what the fault did (peer
    copies that left NCCL's transfers alone and slowed two GPUs' compute are not an
    ``intra_node`` fault to the job) and keeps the injector's in ``injected_as``;
    ``labels="injected"`` judges by that one, as whoever injected it would.

    >>> f = {"type": "throughput_drop", "attribution": "unknown",
    ...      "injected_as": {"type": "intra_node", "attribution": "intra_node"}}
    >>> fault_as(f, "measured")["type"], fault_as(f, "injected")["type"]
    ('throughput_drop', 'intra_node')
    """
    if labels == "injected" and "injected_as" in f:
        return {**f, **f["injected_as"]}
    return f


def judge(run: Path, events: list[Any], max_delay_s: float, labels: str = "measured") -> dict[str, Any]:
    """One run's row. Judged by measured labels, a relabelled run's row also says
    whether the events would be right by the injected one (``ok_injected``)."""
    labelled = json.loads((run / "labels.json").read_text())["faults"]
    row = _judge(run, [fault_as(f, labels) for f in labelled], events, max_delay_s)
    if labels == "measured" and any("injected_as" in f for f in labelled):
        row["ok_injected"] = _judge(run, [fault_as(f, "injected") for f in labelled], events, max_delay_s)["ok"]
    return row


def _judge(run: Path, faults: list[dict], events: list[Any], max_delay_s: float) -> dict[str, Any]:
    incs = incidents(events)
    run_info = json.loads((run / "run.json").read_text())
    row: dict[str, Any] = {"run": run.name, "profiler": run_info.get("profiler", "ncclwatch")}
    if not faults:
        row.update(fault="clean", drop=None, expected="nothing")
    else:
        f = faults[0]
        drop = measured_drop(run, f["start_ns"], f["end_ns"])
        kind = f["type"]
        who = "every rank" if kind == "throughput_drop" else "straggler"
        cf = f.get("compute_factor")
        row.update(fault=f.get("injector") or f"{who} x{'?' if cf is None else round(cf, 2)}",
                   drop=round(drop, 4),
                   expected=kind if drop >= GATE else "nothing (below gate)")
    matched = None
    false_alerts = []
    for iid, inc in sorted(incs.items(), key=lambda kv: kv[1]["first"].detected_ns):
        ev = inc["first"]
        if faults and row["expected"] == faults[0]["type"] and matched is None:
            f = faults[0]
            in_time = f["start_ns"] - 5e9 <= ev.detected_ns <= f["end_ns"] + 5e9
            right = ev.type == f["type"] and (f["type"] != "straggler" or names_straggler(ev, f, run_info))
            if in_time and right:
                matched = (iid, inc)
                continue
        false_alerts.append(f"{ev.type}@{(ev.detected_ns - (faults[0]['start_ns'] if faults else 0)) / 1e9:+.1f}s"
                            if faults else ev.type)
    row["false_alerts"] = false_alerts
    if matched:
        ev = matched[1]["first"]
        delay = (ev.detected_ns - faults[0]["start_ns"]) / 1e9
        row.update(got=ev.type + (f" rank {ev.rank}" if ev.type == "straggler" else ""),
                   delay_s=round(delay, 1), severity=matched[1]["severity"],
                   throughput_delta=ev.throughput_delta,
                   resolved_delta=matched[1]["resolved_delta"])
        # A throughput drop without a comm cause is not NCCL's to page for: by design
        # (docs/detectors.md) it is a warning from twice the gate, else info.
        want = ("critical" if row["drop"] >= GATE else "warning") if faults[0]["type"] != "throughput_drop" \
            else ("warning" if row["drop"] >= 2 * GATE else "info")
        sev_ok = matched[1]["severity"] == want
        row["ok"] = delay <= max_delay_s and not false_alerts and sev_ok
    else:
        row.update(got="-", delay_s=None, severity=None)
        row["ok"] = not false_alerts and row["expected"].startswith("nothing")
    return row


def run_dirs(paths: list[str], split: str) -> list[Path]:
    roots = [Path(p) for p in paths] or [FIXTURES]
    wanted: set[str] | None = None
    if split != "all":
        wanted = set(json.loads((FIXTURES / "split.json").read_text())[split])
    out = []
    for root in roots:
        for p in sorted(root.iterdir()) if root.is_dir() and not (root / "labels.json").exists() else [root]:
            name = p.name.removesuffix(".tar.gz")
            is_run = (p.is_dir() and (p / "labels.json").exists()) or p.name.endswith(".tar.gz")
            if is_run and (wanted is None or name in wanted):
                out.append(p)
    return out


def unpacked(p: Path, tmp: Path) -> Path:
    if p.is_dir():
        return p
    with tarfile.open(p) as tar:
        tar.extractall(tmp, filter="data")
    return tmp / p.name.removesuffix(".tar.gz")


def evaluate(paths: list[Path], cfg: Any, max_delay_s: float,
             detect: Callable[[Any, list], list] | None = None,
             emulate_sampling: int = 1, emulate_key_ms: int = 200,
             log_interval_s: float = 0.0, labels: str = "measured") -> list[dict[str, Any]]:
    detect = detect or (lambda c, recs: watch.detect(c, recs))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, p in enumerate(paths):
            # one folder per archive: runs of one name in two directories must not mix
            run = unpacked(p, Path(tmp) / str(i))
            srcs, options = sources(run)
            records = read_recording(srcs, ReadStats(), options)
            if emulate_sampling > 1:
                records = sampled_like_plugin(list(records), emulate_sampling, emulate_key_ms)
            if log_interval_s > 0:
                records = coarser_throughput(list(records), log_interval_s)
            rows.append(judge(run, detect(cfg, records), max_delay_s, labels))
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = "| run | profiler | fault | loss | expected | got | delay s | severity | false alerts | ok |"
    lines = [head, "|" + " --- |" * 10]
    for r in rows:
        loss = "-" if r["drop"] is None else f"{r['drop'] * 100:.1f} %"
        lines.append(f"| {r['run']} | {r['profiler']} | {r['fault']} | {loss} | {r['expected']} | "
                     f"{r['got']} | {r['delay_s'] if r['delay_s'] is not None else '-'} | "
                     f"{r['severity'] or '-'} | {', '.join(r['false_alerts']) or '-'} | "
                     f"{'yes' if r['ok'] else '**no**'} |")
    ok = sum(r["ok"] for r in rows)
    lines.append(f"\n{ok}/{len(rows)} runs right.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("paths", nargs="*", help="run directories or .tar.gz (default: the fixtures)")
    ap.add_argument("--split", choices=("all", "tune", "heldout"), default="all")
    ap.add_argument("--max-delay-s", type=float, default=5.0)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--emulate-sampling", type=int, default=1, metavar="N",
                    help="replay plugin runs as if recorded with NCCLWATCH_TIMING_SAMPLE=N")
    ap.add_argument("--emulate-key-ms", type=int, default=200, metavar="MS",
                    help="... and NCCLWATCH_TIMING_KEY_MS=MS")
    ap.add_argument("--emulate-log-interval-s", type=float, default=0.0, metavar="S",
                    help="replay runs as if throughput had been reported once per S seconds")
    ap.add_argument("--labels", choices=("measured", "injected"), default="measured",
                    help="judge relabelled runs by what the fault did (measured) or by what "
                         "was injected")
    args = ap.parse_args(argv)
    cfg = config.load(None)
    rows = evaluate(run_dirs(args.paths, args.split), cfg, args.max_delay_s,
                    emulate_sampling=args.emulate_sampling, emulate_key_ms=args.emulate_key_ms,
                    log_interval_s=args.emulate_log_interval_s, labels=args.labels)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    print(markdown(rows) if args.markdown else json.dumps(rows, indent=1, default=str))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
