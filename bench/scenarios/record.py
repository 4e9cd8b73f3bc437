"""Record scenario runs of ``train_job.py`` with faults injected and ground truth written.

Sub-commands (each run goes into ``--out/<name>/``, and ``--tar`` packs it)::

    record.py run --scenario clean|congestion|nvlink|intra|straggler|gpuhog --name NAME ...
    record.py calibrate ...      # one run stepping through injector settings
    record.py suite ...          # what the GPU call runs: calibrate, then the three runs

A run directory holds ``spool/`` (the plugin's and ``report_throughput``'s JSONL),
``ctl/`` (the job's manifests, per-step timings and straggler events), ``logs/``
(torchrun and NCCL logs), ``labels.json`` (the injected faults with wall-clock times)
and ``run.json`` (command, machine, topology, communicator hashes, injector details).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
# ncclwatch.rules resolves from the repository root; ncclwatch.ingest needs the shim below.
sys.path.append(str(REPO))
import faults  # noqa: E402
from topology import layout  # noqa: E402

from ncclwatch import rules  # noqa: E402
from ncclwatch.rules import NETWORK_TRANSPORTS  # noqa: E402

PLUGIN = REPO / "plugin" / "build" / "libncclwatch-profiler.so"


def log(msg: str) -> None:
    print(f"[record {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_shim(dest: Path) -> Path:
    """A directory that makes ``import ncclwatch.ingest`` work without installing.

    pyproject maps ``ncclwatch.ingest`` to ``ingest/`` (and so on), which a plain
    ``PYTHONPATH=<repo>`` does not resolve; symlinks reproduce the mapping.
    """
    pkg = dest / "ncclwatch"
    if pkg.exists():
        shutil.rmtree(pkg)
    pkg.mkdir(parents=True)
    for f in (REPO / "ncclwatch").iterdir():
        if f.name != "__pycache__":
            (pkg / f.name).symlink_to(f)
    for sub in ("ingest", "detectors", "alerting", "dashboards"):
        if (REPO / sub).is_dir():
            (pkg / sub).symlink_to(REPO / sub)
    return dest


def job_env(run_dir: Path, job_id: str, shim: Path, plugin: Path | None,
            profiler: str = "ncclwatch") -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "NCCLWATCH_SPOOL_DIR": str(run_dir / "spool"),
        "NCCLWATCH_JOB_ID": job_id,
        "NCCL_NVLS_ENABLE": "0",  # NVLink multicast stays off on shared machines
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "NCCL_SET_THREAD_NAME": "1",  # lets the injector find NCCL's proxy threads
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV",
        "NCCL_DEBUG_FILE": str(run_dir / "logs" / "nccl.%h.%p.log"),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH", "")])),
    })
    if plugin is not None:
        env["NCCL_PROFILER_PLUGIN"] = str(plugin)
    if profiler == "inspector":
        env.update(inspector_env(run_dir / "inspector"))
    return env


def inspector_env(dump_dir: Path) -> dict[str, str]:
    """NCCL Inspector in JSON mode as its README recommends for fine-grained output:
    dumps every 500 µs, every message size, P2P tracked, one file per process."""
    return {
        "NCCL_INSPECTOR_ENABLE": "1",
        "NCCL_INSPECTOR_DUMP_DIR": str(dump_dir),
        "NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS": "500",
        "NCCL_INSPECTOR_DUMP_MIN_SIZE_BYTES": "0",
        "NCCL_INSPECTOR_ENABLE_P2P": "1",
    }


class Run:
    """One torchrun job in ``run_dir`` with a fault plan."""

    def __init__(self, args: argparse.Namespace, name: str, scenario: str) -> None:
        self.args, self.name, self.scenario = args, name, scenario
        self.dir = Path(args.out) / name
        if self.dir.exists():
            shutil.rmtree(self.dir)
        for sub in ("spool", "ctl", "logs", "trainlogs", "inspector"):
            (self.dir / sub).mkdir(parents=True)
        self.ctl = self.dir / "ctl"
        self.job_id = f"{args.job_prefix}{name}"
        host = {"auto": None, "on": True, "off": False}[args.host_layer]
        self.topo = layout(args.gpus, args.pretend_nodes, host)
        self.labels: list[dict] = []
        self.injections: list[dict] = []
        if args.profiler == "inspector":
            plugin = Path(args.inspector_plugin)
        elif args.profiler == "none":
            plugin = None
        else:
            plugin = Path(args.plugin) if args.plugin else (PLUGIN if PLUGIN.exists() else None)
        self.env = job_env(self.dir, self.job_id, make_shim(Path(args.shim)), plugin,
                           args.profiler)
        for setting in args.nccl_env:
            name, sep, value = setting.partition("=")
            if not (sep and name.startswith("NCCL_") and name[5:].replace("_", "").isalnum()):
                raise ValueError(f"--nccl-env takes NCCL_NAME=VALUE, got {setting!r}")
            if name == "NCCL_NVLS_ENABLE":
                raise ValueError("NCCL_NVLS_ENABLE stays 0 on shared machines")
            self.env[name] = value
        self.plugin = plugin
        self.cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={self.topo.world_size}", str(HERE / "train_job.py"),
            "--gpus", str(args.gpus), "--pretend-nodes", str(args.pretend_nodes),
            "--host-layer", args.host_layer, "--duration-s", str(args.duration_s),
            "--ctl-dir", str(self.ctl), "--device", args.device,
            "--train-log-dir", str(self.dir / "trainlogs"), *args.job_args,
        ]

    # -- the job -----------------------------------------------------------------------
    def start(self) -> None:
        log(f"{self.name}: {shlex.join(self.cmd)}")
        self.t_launch_ns = time.time_ns()
        # Open for the job's lifetime; closed in wait().
        self.log_file = open(self.dir / "logs" / "torchrun.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.log_file,
                                     stderr=subprocess.STDOUT, cwd=self.dir, start_new_session=True)
        deadline = time.monotonic() + self.args.ready_timeout_s
        while not (self.ctl / "ready").exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: job exited {self.proc.returncode} before ready")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name}: not ready after {self.args.ready_timeout_s} s")
            time.sleep(0.2)
        self.ready_ns = json.loads((self.ctl / "ready").read_text())["ts_ns"]
        if self.args.live_watch and self.scenario != "calibrate":
            self.start_watch()
        self.ready_mono = time.monotonic()
        self.ranks = {int(p.stem.split("-")[1]): json.loads(p.read_text())
                      for p in self.ctl.glob("rank-*.json")}
        log(f"{self.name}: ready, pids {[self.ranks[r]['pid'] for r in sorted(self.ranks)]}")

    def start_watch(self) -> None:
        """``ncclwatch watch`` tailing this run's spool, as an operator would run it."""
        cmd = [sys.executable, "-m", "ncclwatch.cli", "watch", str(self.dir / "spool"),
               "--events-out", str(self.dir / "live-events.jsonl"), "--metrics-port", "-1",
               "--state", str(self.dir / "watch-state.json"), "--status-every-s", "5"]
        env = dict(self.env)
        if self.args.watch_pythonpath:
            env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], self.args.watch_pythonpath])
        env.pop("NCCL_PROFILER_PLUGIN", None)
        self.watch_log = open(self.dir / "logs" / "watch.log", "w")  # noqa: SIM115
        self.watch = subprocess.Popen(cmd, env=env, stdout=self.watch_log,
                                      stderr=subprocess.STDOUT, cwd=self.dir)
        log(f"{self.name}: live watch: {shlex.join(cmd)}")

    def stop_watch(self) -> None:
        if getattr(self, "watch", None) is None:
            return
        time.sleep(self.args.watch_linger_s)  # let it read the last segments
        self.watch.send_signal(signal.SIGINT)
        try:
            self.watch.wait(20)
        except subprocess.TimeoutExpired:
            self.watch.kill()
            self.watch.wait()
        self.watch_log.close()
        log(f"{self.name}: live watch exited {self.watch.returncode}")

    def sleep_until(self, offset_s: float) -> None:
        """Sleep until ``offset_s`` after the job's warm-up ended."""
        time.sleep(max(0.0, self.ready_mono + offset_s - time.monotonic()))

    def wait(self) -> int:
        budget = self.args.duration_s + 60
        try:
            rc = self.proc.wait(budget)
        except subprocess.TimeoutExpired:
            log(f"{self.name}: still running after {budget} s, stopping it")
            (self.ctl / "stop").touch()
            try:
                rc = self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
                rc = -9
        self.log_file.close()
        self.rc = rc
        log(f"{self.name}: job exited {rc}")
        self.stop_watch()
        return rc

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    # -- targets -----------------------------------------------------------------------
    def network_ranks(self) -> list[int]:
        """Global ranks in a communicator that crosses (pretend) nodes."""
        return sorted({r for c in self.topo.comms if c.transport in NETWORK_TRANSPORTS
                       for r in c.ranks})

    def socket_address(self) -> dict[str, str]:
        for f in sorted((self.dir / "logs").glob("nccl.*.log")):
            found = faults.parse_nccl_socket_if(f.read_text(errors="replace"))
            if found:
                return found
        return {"iface": "lo", "address": "127.0.0.1"}

    def congestion(self, spec: str):
        """An injector from a spec like ``cpu:k=2,duty=1``, ``sockets:n=4+cpu:k=1``,
        ``nvlink:streams=2,mib=256,both=1`` or ``pulse:on=4,off=4+tc:rate=12gbit,dev=lo``
        (``pulse`` switches the rest on and off), ``netem:delay=500us,dev=lo``,
        ``netem:loss=1%,dev=lo``, ``ramp:rates=48gbit/32gbit/20gbit/12gbit,step=5,dev=lo``
        (a tbf rate stepped down every ``step`` s), ``gpuhog:gpu=2,duty=1.0`` (another
        process's matmuls on GPU 2), ``pcie:gpu=0,streams=2,mib=256`` (another process's
        host <-> GPU 0 copies), ``membw:threads=8,mib=256`` (host memory copies) or
        ``freeze:rank=2,duty=0.2,period=0.5`` (global rank 2's process stopped 20 % of
        every 0.5 s)."""
        parts = []
        pulse = None
        pids = [self.ranks[r]["pid"] for r in self.network_ranks()]
        ncores = os.cpu_count() or 2
        cores = [ncores - 1 - i for i in range(len(pids))]
        for piece in spec.split("+"):
            kind, _, opts = piece.partition(":")
            kv = dict(o.split("=") for o in opts.split(",") if o)
            if kind == "cpu":
                parts.append(faults.ProxyCpuContention(
                    pids, cores, int(kv.get("k", 1)), float(kv.get("duty", 1.0))))
            elif kind == "sockets":
                parts.append(faults.SocketBlaster(self.socket_address()["address"],
                                                  int(kv.get("n", 4)), cores))
            elif kind == "tc":
                if not self.args.allow_tc:
                    raise ValueError("tc shapes the whole interface: pass --allow-tc")
                tc = self.args.tc.split() if self.args.tc else ["tc"]
                # Same-host socket traffic goes through `lo` whatever address NCCL picked.
                parts.append(faults.TcShaper(tc, kv.get("dev", self.socket_address()["iface"]),
                                             kv.get("rate", "16gbit")))
            elif kind in ("netem", "ramp"):
                if not self.args.allow_tc:
                    raise ValueError(f"{kind} shapes the whole interface: pass --allow-tc")
                tc = self.args.tc.split() if self.args.tc else ["tc"]
                dev = kv.get("dev", self.socket_address()["iface"])
                if kind == "netem":
                    parts.append(faults.NetemShaper(tc, dev, kv.get("delay", ""), kv.get("jitter", ""),
                                                    kv.get("loss", "")))
                else:
                    parts.append(faults.RampedTc(tc, dev, kv.get("rates", "48gbit/32gbit/20gbit/12gbit").split("/"),
                                                 float(kv.get("step", 5))))
            elif kind == "gpuhog":
                parts.append(faults.GpuHog(int(kv.get("gpu", 0)), float(kv.get("duty", 1.0)),
                                           float(kv.get("period", 0.1)), int(kv.get("n", 8192)), sys.executable))
            elif kind == "nvlink":
                parts.append(faults.NvlinkContention(
                    int(kv.get("src", 0)), int(kv.get("dst", 1)), int(kv.get("streams", 2)),
                    int(kv.get("mib", 256)), kv.get("both", "1") == "1", sys.executable))
            elif kind == "pcie":
                parts.append(faults.PcieContention(int(kv.get("gpu", 0)), int(kv.get("streams", 2)),
                                                   int(kv.get("mib", 256)), sys.executable))
            elif kind == "membw":
                parts.append(faults.HostMemoryHog(int(kv.get("threads", 8)), int(kv.get("mib", 256)),
                                                  sys.executable))
            elif kind == "freeze":
                parts.append(faults.ProcessFreezer(self.ranks[int(kv.get("rank", 0))]["pid"],
                                                   float(kv.get("duty", 0.2)), float(kv.get("period", 0.5))))
            elif kind == "pulse":
                pulse = (float(kv.get("on", 4)), float(kv.get("off", 4)))
            else:
                raise ValueError(f"unknown injector {kind!r} in {spec!r}")
        injector = parts[0] if len(parts) == 1 else faults.Combined(*parts)
        return injector if pulse is None else faults.Pulsed(injector, *pulse)

    def inject(self, injector, start_s: float, end_s: float, label: dict | None) -> dict:
        self.sleep_until(start_s)
        t0 = time.time_ns()
        injector.start()
        self.sleep_until(end_s)
        injector.stop()
        t1 = time.time_ns()
        record = {"start_ns": t0, "end_ns": t1, **injector.describe()}
        self.injections.append(record)
        if label is not None:
            self.labels.append({**label, "start_ns": t0, "end_ns": t1})
        log(f"{self.name}: injected {record}")
        return record

    def straggle(self, ranks: list[int], extra: int, start_s: float, end_s: float) -> None:
        self.sleep_until(start_s)
        (self.ctl / "straggler.json").write_text(json.dumps({"ranks": ranks,
                                                             "extra_matmuls": extra}))
        self.sleep_until(end_s)
        (self.ctl / "straggler.json").unlink()
        self.injections.append({"injector": "straggler", "ranks": ranks, "extra_matmuls": extra,
                                "matmuls_per_layer": self.matmuls_per_layer})

    @property
    def matmuls_per_layer(self) -> int:
        args = self.args.job_args
        if "--matmuls-per-layer" in args:
            return int(args[args.index("--matmuls-per-layer") + 1])
        return 10

    # -- after the job ------------------------------------------------------------------
    def straggler_labels(self) -> None:
        """Labels from the job's own events: when the extra matmuls really ran."""
        events = [json.loads(line) for line in
                  (self.ctl / "events.jsonl").read_text().splitlines()] if (
            self.ctl / "events.jsonl").exists() else []
        open_at: dict[int, dict] = {}
        spans: dict[tuple[int, int], list[tuple[int, dict, dict]]] = {}
        for e in events:
            if e["event"] == "straggler_start":
                open_at[e["rank"]] = e
            elif e["event"] == "straggler_end" and e["rank"] in open_at:
                s = open_at.pop(e["rank"])
                spans.setdefault((s["step"], e["step"]), []).append((e["rank"], s, e))
        # Ranks that straggled over the same steps are one fault (one slow GPU).
        for (start_step, end_step), members in sorted(spans.items()):
            ranks = sorted(r for r, _, _ in members)
            # Every rank slower is no straggler: the job computes slower and NCCL is not
            # the cause, which the detectors call a throughput drop ("not NCCL").
            everyone = set(ranks) >= set(self.ranks)
            self.labels.append({
                **({"type": "throughput_drop", "attribution": "unknown"} if everyone
                   else {"type": "straggler", "attribution": "straggler"}),
                "global_rank": ranks[0],
                "global_ranks": ranks, "extra_matmuls": members[0][1]["extra_matmuls"],
                "compute_factor": 1 + members[0][1]["extra_matmuls"] / self.matmuls_per_layer,
                "start_ns": min(s["ts_ns"] for _, s, _ in members),
                "end_ns": max(e["ts_ns"] for _, _, e in members),
                "start_step": start_step, "end_step": end_step,
            })

    def resolve_comms(self) -> dict[str, dict]:
        """Map each topology communicator to the hash the plugin recorded for it."""
        pid_rank = {info["pid"]: r for r, info in self.ranks.items()}
        seen: dict[str, dict] = {}
        for f in (self.dir / "inspector").rglob("*"):
            if not f.is_file():
                continue
            with open(f, errors="replace") as fh:
                for line in fh:
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        rec = json.loads(line)
                        h, m = rec["header"], rec["metadata"]
                        c = seen.setdefault(rules.comm_hex(int(h["id"], 16)), {"pids": set(), "transport": set(),
                                                      "nranks": h["n_ranks"],
                                                      "nnodes": h["nnodes"],
                                                      "comm_name": h.get("comm_name", "")})
                        c["pids"].add(m["pid"])
        for f in (self.dir / "spool").rglob("*.jsonl"):
            with open(f, errors="replace") as fh:
                for line in fh:
                    if '"kind":"op"' not in line.replace(" ", ""):
                        continue
                    with contextlib.suppress(ValueError):
                        rec = json.loads(line)
                        c = seen.setdefault(rec["comm"], {"pids": set(), "transport": set(),
                                                          "nranks": rec["nranks"],
                                                          "nnodes": rec["nnodes"],
                                                          "comm_name": rec.get("comm_name", "")})
                        c["pids"].add(rec["pid"])
                        c["transport"].add(rec["transport"])
        out = {}
        for comm in self.topo.comms:
            for h, c in seen.items():
                if {pid_rank.get(p) for p in c["pids"]} == set(comm.ranks):
                    out[comm.name] = {"comm": h, "comm_name": c["comm_name"],
                                      "transport_recorded": sorted(c["transport"]),
                                      "transport_expected": comm.transport,
                                      "nranks": c["nranks"], "nnodes": c["nnodes"],
                                      "ranks": list(comm.ranks)}
        return out

    def finish(self, tar_dir: Path | None) -> Path:
        self.straggler_labels()
        comms = self.resolve_comms()
        hostname = socket.gethostname()
        for label in self.labels:
            label.setdefault("host", hostname)
            if label["type"] == "network_path":
                label["comms"] = {n: c for n, c in comms.items()
                                  if c["transport_expected"] in NETWORK_TRANSPORTS}
            if label["type"] == "intra_node":
                label["comms"] = {n: c for n, c in comms.items()
                                  if c["transport_expected"] == "nvlink"}
            if label["type"] == "straggler":
                r = label["global_rank"]
                label["pid"] = self.ranks[r]["pid"]
                label["gpu"] = self.ranks[r]["gpu"]
                label["pids"] = [self.ranks[x]["pid"] for x in label["global_ranks"]]
                label["comm_ranks"] = {comms[c.name]["comm"]: c.ranks.index(x)
                                       for x in label["global_ranks"]
                                       for c in self.topo.comms_of(x) if c.name in comms}
        (self.dir / "labels.json").write_text(json.dumps(
            {"scenario": self.scenario, "job": self.job_id, "faults": self.labels}, indent=1))
        steps = [json.loads(x) for x in (self.ctl / "steps.jsonl").read_text().splitlines()]
        run = {
            "name": self.name, "scenario": self.scenario, "job": self.job_id,
            "command": shlex.join(self.cmd), "driver": shlex.join(sys.argv),
            "host": hostname, "launched_ns": self.t_launch_ns, "ready_ns": self.ready_ns,
            "rc": self.rc, "plugin": str(self.plugin) if self.plugin else None,
            "profiler": self.args.profiler, "nccl_env": list(self.args.nccl_env),
            "socket": self.socket_address(), "ranks": self.ranks, "comms": comms,
            "injections": self.injections, "steps": len(steps),
            "tflops_per_gpu_median": statistics.median(s["tflops_per_gpu"] for s in steps)
            if steps else None,
            "machine": machine_info(),
        }
        (self.dir / "run.json").write_text(json.dumps(run, indent=1, default=str))
        trim_nccl_logs(self.dir / "logs")
        if tar_dir is None:
            return self.dir
        tar_dir.mkdir(parents=True, exist_ok=True)
        out = tar_dir / f"{self.name}.tar.gz"
        with tarfile.open(out, "w:gz", compresslevel=9) as tar:
            tar.add(self.dir, arcname=self.name)
        log(f"{self.name}: packed {out} ({out.stat().st_size / 1e6:.2f} MB)")
        return out


def trim_nccl_logs(logs: Path) -> None:
    """Keep NCCL's lines that show the topology and transport choice, drop the rest."""
    keep = ("NET/", "nNodes", "via", "NCCL version", "comm 0x", "Init COMPLETE", "Using",
            "NCCL_", "Channel 00", "WARN")
    for f in logs.glob("nccl.*.log"):
        lines = [x for x in f.read_text(errors="replace").splitlines() if any(k in x for k in keep)]
        f.write_text("\n".join(lines[:400]) + "\n")


def machine_info() -> dict:
    info = {"platform": platform.platform(), "nproc": os.cpu_count(), "date_utc":
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with contextlib.suppress(Exception):
        info["gpus"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    with contextlib.suppress(Exception):
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


# -- scenarios ------------------------------------------------------------------------

INJECTED_SCENARIOS = ("congestion", "nvlink", "intra", "gpuhog", "freeze")  # those --injector drives

def run_scenario(args: argparse.Namespace, scenario: str, name: str | None = None) -> Path:
    run = Run(args, name or scenario, scenario)
    run.start()
    try:
        if scenario == "congestion":
            injector = run.congestion(args.injector)
            run.inject(injector, args.fault_start_s, args.fault_start_s + args.fault_duration_s,
                       {"type": "network_path", "attribution": "network", "global_rank": None,
                        "injector": args.injector})
        elif scenario in ("nvlink", "intra"):
            injector = run.congestion(args.injector)
            for part in getattr(injector, "parts", [injector]):
                if hasattr(part, "prepare"):
                    part.prepare()
            run.inject(injector, args.fault_start_s, args.fault_start_s + args.fault_duration_s,
                       {"type": "intra_node", "attribution": "intra_node", "global_rank": None,
                        "injector": args.injector})
        elif scenario == "gpuhog":
            # Another process computing on one GPU: the job's processes there are the
            # injected stragglers (measure_fault.py checks that they were the late ones).
            injector = run.congestion(args.injector)
            for part in getattr(injector, "parts", [injector]):
                if hasattr(part, "prepare"):
                    part.prepare()
            gpus = {p.gpu for p in getattr(injector, "parts", [injector]) if isinstance(p, faults.GpuHog)}
            ranks = sorted(r for r, info in run.ranks.items() if info["gpu"] in gpus)
            run.inject(injector, args.fault_start_s, args.fault_start_s + args.fault_duration_s,
                       {"type": "straggler", "attribution": "straggler", "global_rank": ranks[0],
                        "global_ranks": ranks, "injector": args.injector})
        elif scenario == "freeze":
            # One rank's process stopped part of the time (freeze:rank=N): the straggler.
            injector = run.congestion(args.injector)
            inner = getattr(injector, "inner", injector)  # pulsed or not
            pid = next(p.pid for p in getattr(inner, "parts", [inner])
                       if isinstance(p, faults.ProcessFreezer))
            rank = next(r for r, info in run.ranks.items() if info["pid"] == pid)
            run.inject(injector, args.fault_start_s, args.fault_start_s + args.fault_duration_s,
                       {"type": "straggler", "attribution": "straggler", "global_rank": rank,
                        "global_ranks": [rank], "injector": args.injector})
        elif scenario == "straggler":
            ranks = [int(r) for r in str(args.straggler_rank).split(",")]
            run.straggle(ranks, args.straggler_extra, args.fault_start_s,
                         args.fault_start_s + args.fault_duration_s)
        elif scenario != "clean":
            raise ValueError(f"unknown scenario {scenario!r}")
    except BaseException:
        (run.ctl / "stop").touch()
        run.wait()
        raise
    run.wait()
    return run.finish(Path(args.tar) if args.tar else None)


def window_stats(steps: list[dict], t0: int, t1: int, settle_ns: int) -> dict:
    sel = [s for s in steps if t0 + settle_ns <= s["ts_ns"] <= t1]
    if not sel:
        return {"steps": 0}
    return {"steps": len(sel),
            "tflops": statistics.median(s["tflops_per_gpu"] for s in sel),
            "phase_s": [statistics.median(s["phase_s"][i] for s in sel)
                        for i in range(len(sel[0]["phase_s"]))]}


def calibrate(args: argparse.Namespace) -> dict:
    """One run stepping through ``--levels``; effect of each on throughput and phase times."""
    levels = args.levels
    on_s, off_s = args.level_on_s, args.level_off_s
    args.duration_s = off_s + len(levels) * (on_s + off_s) + 2
    run = Run(args, "calibrate", "calibrate")
    run.start()
    try:
        for i, spec in enumerate(levels):
            start = off_s + i * (on_s + off_s)
            try:
                run.inject(run.congestion(spec), start, start + on_s, None)
            except Exception as e:  # one failing injector must not end the calibration
                log(f"calibrate: {spec} failed: {e!r}")
                run.injections.append({"spec": spec, "error": repr(e)})
                continue
            run.injections[-1]["spec"] = spec
    except BaseException:
        (run.ctl / "stop").touch()
        run.wait()
        raise
    run.wait()
    steps = [json.loads(x) for x in (run.ctl / "steps.jsonl").read_text().splitlines()]
    settle = int(1e9)
    base = window_stats(steps, run.ready_ns, run.ready_ns + int(off_s * 1e9), 0)
    results = []
    for inj in run.injections:
        if "start_ns" not in inj:
            results.append(inj)
            continue
        w = window_stats(steps, inj["start_ns"], inj["end_ns"], settle)
        after = window_stats(steps, inj["end_ns"], inj["end_ns"] + int(off_s * 1e9), settle)
        ref = after if after.get("steps") else base
        res = {"spec": inj["spec"], "on": w, "off_after": after}
        if w.get("steps") and ref.get("steps") and ref["tflops"] > 0 and ref["phase_s"][-1] > 0:
            res["throughput_drop"] = round(1 - w["tflops"] / ref["tflops"], 4)
            res["net_phase_slowdown"] = round(w["phase_s"][-1] / ref["phase_s"][-1] - 1, 4)
        res["detail"] = {k: v for k, v in inj.items() if k not in ("start_ns", "end_ns")}
        results.append(res)
        log(f"calibrate: {res.get('spec')}: drop {res.get('throughput_drop')}, "
            f"net phase +{res.get('net_phase_slowdown')}")
    out = {"baseline": base, "levels": results, "chosen": choose(results, args.target_drop)}
    run.labels = []
    (run.dir / "calibration.json").write_text(json.dumps(out, indent=1, default=str))
    run.finish(Path(args.tar) if args.tar else None)
    log(f"calibrate: chosen {out['chosen']}")
    return out


def choose(results: list[dict], target: float) -> str | None:
    """The setting whose throughput drop is closest to ``target`` among those at least
    10 % (the issue asks for ≥ 10 % on the network communicator), else the strongest."""
    ok = [r for r in results if r.get("throughput_drop") is not None]
    if not ok:
        return None
    good = [r for r in ok if r["throughput_drop"] >= 0.10]
    if good:
        return min(good, key=lambda r: abs(r["throughput_drop"] - target))["spec"]
    return max(ok, key=lambda r: r["throughput_drop"])["spec"]


def suite(args: argparse.Namespace) -> None:
    summary: dict = {"machine": machine_info(), "runs": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.levels:
        saved = args.duration_s
        try:
            cal = calibrate(args)
            summary["calibration"] = cal
            if cal["chosen"]:
                args.injector = cal["chosen"]
        except Exception as e:
            log(f"suite: calibration failed: {e!r}")
            summary["calibration_error"] = repr(e)
        args.duration_s = saved
    # --plan: a JSON list of runs, each {"name", "scenario", and any option to override}.
    plan = json.loads(Path(args.plan).read_text()) if args.plan else [
        {"name": s, "scenario": s} for s in args.scenarios]
    base = dict(vars(args))
    # Each run's own injector, where its scenario uses one (a top-level value named the
    # --injector default, which no run of a plan that gives its own ever used).
    summary["injectors"] = {}
    for entry in plan:
        name = entry["name"]
        for k, v in entry.items():
            if k not in ("name", "scenario"):
                setattr(args, k.replace("-", "_"), v)
        summary["injectors"][name] = args.injector if entry["scenario"] in INJECTED_SCENARIOS else None
        try:
            path = run_scenario(args, entry["scenario"], name)
            summary["runs"][name] = str(path)
        except Exception as e:
            log(f"suite: {name} failed: {e!r}")
            summary["runs"][name] = f"failed: {e!r}"
        for k, v in base.items():
            setattr(args, k, v)
        (out / "suite.json").write_text(json.dumps(summary, indent=1, default=str))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("command", choices=("run", "calibrate", "suite"))
    p.add_argument("--scenario", default="clean",
                   choices=("clean", "congestion", "nvlink", "intra", "straggler", "gpuhog", "freeze"))
    p.add_argument("--scenarios", nargs="+", default=["clean", "congestion", "straggler"])
    p.add_argument("--name")
    p.add_argument("--out", default="/tmp/ncclwatch-runs")
    p.add_argument("--tar", help="directory for <name>.tar.gz of each run")
    p.add_argument("--shim", default="/tmp/ncclwatch-shim")
    p.add_argument("--plugin", help=f"profiler plugin (default {PLUGIN} when built)")
    p.add_argument("--tc", help="tc command, e.g. 'env LD_LIBRARY_PATH=x ./tc'")
    p.add_argument("--allow-tc", action="store_true",
                   help="let tc injectors shape the interface (it slows every user of it)")
    p.add_argument("--job-prefix", default="gpu-")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--pretend-nodes", type=int, default=2)
    p.add_argument("--host-layer", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--duration-s", type=float, default=75.0)
    p.add_argument("--ready-timeout-s", type=float, default=120.0)
    p.add_argument("--fault-start-s", type=float, default=25.0)
    p.add_argument("--fault-duration-s", type=float, default=25.0)
    p.add_argument("--injector", default="cpu:k=2")
    p.add_argument("--straggler-rank", default="1",
                   help="global rank(s), comma-separated: both processes of a GPU make it slow")
    p.add_argument("--nccl-env", nargs="*", default=[], metavar="NAME=VALUE",
                   help="NCCL_* settings for the job, e.g. NCCL_P2P_DISABLE=1 (intra-node traffic "
                        "through host memory: NCCL's SHM transport)")
    p.add_argument("--profiler", choices=("ncclwatch", "inspector", "none"), default="ncclwatch")
    p.add_argument("--inspector-plugin", default="",
                   help="NCCL Inspector's libnccl-profiler-inspector.so (--profiler inspector)")
    p.add_argument("--plan", help="JSON list of runs for `suite` (overrides --scenarios)")
    p.add_argument("--straggler-extra", type=int, default=4,
                   help="extra matmuls per model layer on the straggler")
    p.add_argument("--levels", nargs="*", default=[],
                   help="injector specs the calibration steps through")
    p.add_argument("--level-on-s", type=float, default=6.0)
    p.add_argument("--level-off-s", type=float, default=4.0)
    p.add_argument("--target-drop", type=float, default=0.15)
    p.add_argument("--live-watch", action="store_true",
                   help="run `ncclwatch watch` on the spool during each run")
    p.add_argument("--watch-pythonpath", default="",
                   help="extra PYTHONPATH for the watch (carried wheels)")
    p.add_argument("--watch-linger-s", type=float, default=5.0)
    p.epilog = "Arguments after a lone -- go to train_job.py."
    return p


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:cut])
    args.job_args = argv[cut + 1:]
    if args.command == "run":
        run_scenario(args, args.scenario, args.name)
    elif args.command == "calibrate":
        calibrate(args)
    else:
        suite(args)


if __name__ == "__main__":
    main()
