"""Record real Megatron-LM runs with the plugin and a fault, in ``record.py``'s run layout.

``train_job.py`` only imitates a training job; this runs Megatron-LM's own
``pretrain_gpt.py`` (a small GPT on mock data, ``--transformer-impl local``), two ranks
data-parallel on one GPU as two pretend nodes (``megatron_rank.py``), so that what the
detectors are judged on includes Megatron's real NCCL traffic and its real log. The job's
throughput is its log's (``trainlogs/rank-<r>.log``; ``run.json``'s ``throughput`` says
``log``), as a user without ``report_throughput`` has it. A plan is a JSON list of runs::

    {"name": "m1x2-tc-8g", "scenario": "congestion", "duration_s": 45, "fault_start_s": 15,
     "fault_duration_s": 12, "injector": "tc:rate=8gbit,dev=lo"}

``injector``: ``tc:rate=R,dev=D`` (a ``tbf`` on the device NCCL's sockets use), or
``stop:rank=R,seconds=S`` (its process stopped once, ``SIGSTOP``/``SIGCONT``), either
switched on and off (``pulse:on=S,off=S+tc:...``); none for a clean run.
``megatron_args`` adds to the model's arguments, ``drop_args`` takes flags away
(``--log-throughput``: the log then has no TFLOP/s, as Megatron's default).
``save``: checkpoint saves, ``{"interval": N, "format": "torch", "delay_s": S}`` (every N
iterations into a folder removed after the run; rank 0's saves made S s longer, as on slow
storage: ``megatron_rank.py``); the run is labelled by its fault only, a save is none.
``profiler``: ``ncclwatch`` (default) or ``inspector`` (NCCL Inspector in JSON mode,
``--inspector-plugin``). Times count from the job's 10th iteration. ::

    python bench/scenarios/megatron_run.py --megatron DIR --plan PLAN --out /tmp/mlm-runs \\
        --tar "$OUT" --tc "env LD_LIBRARY_PATH=... tc"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
import faults  # noqa: E402
from record import inspector_env  # noqa: E402

PLUGIN = REPO / "plugin" / "build" / "libncclwatch-profiler.so"
# A GPT small enough for one shared GPU, large enough that its gradient all-reduce over
# the pretend nodes' sockets is a real share of each iteration.
MODEL = [
    "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
    "--seq-length", "1024", "--max-position-embeddings", "1024",
    "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", "1000000",
    "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--weight-decay", "0.1",
    "--clip-grad", "1.0", "--bf16", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "32000", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
    "--no-persist-layer-norm", "--position-embedding-type", "learned_absolute",
    "--log-interval", "1", "--log-throughput", "--eval-iters", "0", "--eval-interval", "1000000",
    "--distributed-backend", "nccl",
]
_ITER = re.compile(r"^\s*\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\] iteration\s+(\d+)/.*?"
                   r"elapsed time per iteration \(ms\): ([0-9.]+)"
                   r"(?:.*?throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+))?")


def log(msg: str) -> None:
    print(f"[megatron_run {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def steps_of(trainlog: Path) -> list[dict]:
    """The job's steps as Megatron logged them (the judge's own reading, not ncclwatch's);
    without ``--log-throughput``, TFLOP/s in a unit of its own (1000 / the iteration's
    ms: the same model each step, so only ratios count)."""
    out = []
    for line in trainlog.read_text(errors="replace").splitlines():
        m = _ITER.search(line)
        if m:
            ts = datetime.fromisoformat(m.group(1)).astimezone()  # Megatron prints local time
            out.append({"step": int(m.group(2)), "ts_ns": int(ts.timestamp() * 1e9),
                        "step_s": float(m.group(3)) / 1000,
                        "tflops_per_gpu": float(m.group(4)) if m.group(4) else 1000 / float(m.group(3))})
    return out


def injector_of(spec: str, tc: list[str], pids: dict[int, int]):
    if spec.startswith("pulse:"):  # pulse:on=S,off=S+<injector>
        head, _, inner = spec.partition("+")
        kv = dict(p.split("=", 1) for p in head.removeprefix("pulse:").split(","))
        inj, rank = injector_of(inner, tc, pids)
        return faults.Pulsed(inj, float(kv["on"]), float(kv["off"])), rank
    kind, _, rest = spec.partition(":")
    kv = dict(p.split("=", 1) for p in rest.split(",") if p)
    if kind == "tc":
        return faults.TcShaper(tc=tc, iface=kv.get("dev", "lo"), rate=kv["rate"]), None
    if kind == "stop":
        rank, seconds = int(kv["rank"]), float(kv["seconds"])
        return faults.ProcessFreezer(pids[rank], 0.5, 2 * seconds), rank
    raise ValueError(f"unknown injector {spec!r}")


def run_one(spec: dict, args: argparse.Namespace) -> Path:
    name = spec["name"]
    d = Path(args.out) / name
    for sub in ("spool", "ctl", "logs", "trainlogs", "inspector"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    job = f"gpu-{name}"
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "NCCL_SOCKET_IFNAME": args.iface,
           "NCCL_PROFILER_PLUGIN": str(PLUGIN), "NCCLWATCH_SPOOL_DIR": str(d / "spool"),
           "NCCLWATCH_JOB_ID": job, "MLM_DIR": args.megatron, "MLM_RUN_DIR": str(d),
           "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"}
    profiler = spec.get("profiler", "ncclwatch")
    if profiler == "inspector":  # as record.py runs it
        env.update({"NCCL_PROFILER_PLUGIN": args.inspector_plugin, **inspector_env(d / "inspector")})
    model = [a for a in MODEL if a not in spec.get("drop_args", ())]
    save = spec.get("save")
    ckpt = Path(args.out) / "checkpoints" / name
    if save:
        model += ["--save", str(ckpt), "--save-interval", str(save["interval"]),
                  "--ckpt-format", save.get("format", "torch_dist")]
        env["MLM_SAVE_DELAY_S"] = str(save.get("delay_s", 0))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HERE / "megatron_rank.py"), *model, *spec.get("megatron_args", [])]
    log(f"{name}: {shlex.join(cmd)}")
    launched = time.time_ns()
    with open(d / "logs" / "torchrun.log", "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        last = d / "trainlogs" / "rank-1.log"
        deadline = time.monotonic() + args.ready_timeout_s
        ready = None
        while ready is None:
            steps = steps_of(last) if last.exists() else []
            if len(steps) >= 10:
                ready = time.monotonic()
            elif proc.poll() is not None or time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
                raise RuntimeError(f"{name}: no 10th iteration (rc {proc.poll()}); see {d}/trainlogs")
            else:
                time.sleep(0.5)
        ready_ns = time.time_ns()
        pids = {int(p.stem.split("-")[1]): json.loads(p.read_text())["pid"] for p in (d / "ctl").glob("rank-*.json")}
        log(f"{name}: ready, pids {pids}")
        injections, labels = [], []
        if spec.get("injector"):
            inj, rank = injector_of(spec["injector"], shlex.split(args.tc), pids)
            time.sleep(max(0.0, ready + spec["fault_start_s"] - time.monotonic()))
            t0 = time.time_ns()
            inj.start()
            time.sleep(spec["fault_duration_s"])
            inj.stop()
            t1 = time.time_ns()
            desc = inj.describe() if hasattr(inj, "describe") else {"injector": "freeze", "pid": inj.pid}
            injections.append({"start_ns": t0, "end_ns": t1, **desc})
            if rank is None:
                labels.append({"type": "network_path", "attribution": "network", "global_rank": None,
                               "injector": spec["injector"], "start_ns": t0, "end_ns": t1})
            else:
                labels.append({"type": "straggler", "attribution": "straggler", "global_rank": rank,
                               "global_ranks": [rank], "gpu": 0, "pid": pids[rank], "pids": [pids[rank]],
                               "injector": spec["injector"], "start_ns": t0, "end_ns": t1})
            log(f"{name}: {spec['injector']} {(t1 - t0) / 1e9:.1f} s")
        time.sleep(max(0.0, ready + spec["duration_s"] - time.monotonic()))
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    shutil.rmtree(ckpt, ignore_errors=True)
    steps = steps_of(last)
    with open(d / "ctl" / "steps.jsonl", "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in steps)
    (d / "labels.json").write_text(json.dumps({"scenario": spec["scenario"], "job": job, "faults": labels}, indent=1))
    (d / "run.json").write_text(json.dumps({
        "name": name, "scenario": spec["scenario"], "job": job, "job_kind": "megatron", "throughput": "log",
        "command": shlex.join(cmd), "host": platform.node(), "launched_ns": launched, "ready_ns": ready_ns,
        "rc": rc, "plugin": env["NCCL_PROFILER_PLUGIN"], "profiler": profiler,
        "ranks": {str(r): {"rank": r, "pid": p, "gpu": 0} for r, p in pids.items()}, "comms": {},
        "injections": injections, "steps": len(steps), "save": save,
        "machine": {"platform": platform.platform(), "nproc": os.cpu_count(),
                    "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }, indent=1))
    if args.tar:
        with tarfile.open(Path(args.tar) / f"{name}.tar.gz", "w:gz", compresslevel=9) as tar:
            tar.add(d, arcname=name)
    return d


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron", required=True, help="a Megatron-LM tree (pretrain_gpt.py, megatron/)")
    p.add_argument("--plan", required=True)
    p.add_argument("--out", default="/tmp/mlm-runs")
    p.add_argument("--tar", default="", help="pack each run as NAME.tar.gz here")
    p.add_argument("--tc", default="tc")
    p.add_argument("--iface", default="lo")
    p.add_argument("--inspector-plugin", default="", help="NCCL Inspector's .so, for runs of profiler inspector")
    p.add_argument("--ready-timeout-s", type=float, default=240.0)
    args = p.parse_args()
    recorded = 0
    for spec in json.loads(Path(args.plan).read_text()):
        try:
            run_one(spec, args)
            recorded += 1
        except Exception as e:  # one run failing leaves the others to record ...
            log(f"{spec['name']}: FAILED {e!r}")
            if not recorded:
                return 1  # ... unless none has yet: the job itself does not start
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
