"""A training-like job for torchrun: real bf16 matmuls and FSDP/TP-like collectives.

Run by ``bench/scenarios/record.py`` (which also injects the faults), or by hand::

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 4 \\
        bench/scenarios/train_job.py --gpus 2 --pretend-nodes 2 --duration-s 60 --ctl-dir /tmp/ctl

``--gpus N --pretend-nodes M`` picks the processes and communicators
(``topology.layout``): torchrun must start ``layout(N, M).world_size`` processes. Each
process sets its own ``NCCL_HOSTID`` before any NCCL communicator exists, which is what
puts the pretend layer's communicators on NCCL's network transport.

One step, for every layer of processes (host layer first, then pretend layer):

* for each model layer ``--matmuls-per-layer`` bf16 products of ``tokens × hidden ×
  hidden`` in three parts, between them an AllGather of a parameter shard (``fsdp``)
  and an AllReduce of activations (``tp``), after them a ReduceScatter of gradients
  (``fsdp``); then one AllReduce of a gradient bucket (``dp``) when the process has such
  a communicator;
* ``torch.cuda.synchronize()`` and a barrier over the world's gloo group
  (``--step-sync nccl``: over an NCCL communicator of every process, as Megatron-LM's
  barriers and loss reductions are, so that waiting for a late process lands in NCCL's
  kernels rather than in gloo).

The layers run one after the other (``--phases serial``, the default) because on one
machine two processes share each GPU: run together, their kernels would time-slice and a
slow network communicator would lengthen the NVLink communicator's kernels too, which a
real multi-node job (one process per GPU) does not do. Each step still needs both
layers, so the job's throughput reflects both kinds of communicator.

Global rank 0 times every step between two control exchanges (a gloo AllReduce that
carries rank 0's decisions: stop, straggler on) and reports the model TFLOP/s per GPU
through ``ncclwatch.report_throughput``. A straggler's extra matmuls are not model work,
so they lower the reported TFLOP/s as a slow rank does in real training.

Control, through ``--ctl-dir`` (read by rank 0 once per step):
``stop`` (file): end the job; ``straggler.json``: ``{"ranks": [R, ...], "extra_matmuls": K}``
(or ``"rank": R``) adds K matmuls per model layer on those global ranks until the file is
removed; give both processes of one GPU to make the GPU slow in every communicator.
Written there: ``rank-<r>.json`` (pid, GPU, host id, communicators), ``ready`` (after the
warm-up), ``events.jsonl`` (when each rank really started/stopped straggling) and
``steps.jsonl`` (rank 0's per-step timings).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from topology import layout  # noqa: E402

MIB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--gpus", type=int, required=True, help="GPUs on this machine to use")
    p.add_argument("--pretend-nodes", type=int, required=True,
                   help="split the GPUs into this many nodes, each with its own NCCL_HOSTID")
    p.add_argument("--host-layer", choices=("auto", "on", "off"), default="auto",
                   help="add one process per GPU with the machine's host id (NVLink-only)")
    p.add_argument("--phases", choices=("serial", "concurrent"), default="serial")
    p.add_argument("--step-sync", choices=("gloo", "nccl"), default="gloo",
                   help="what the per-step control exchange and phase barriers run on: gloo "
                        "(the waiting for a late process lands outside NCCL) or an NCCL "
                        "communicator of every process (as Megatron-LM's barriers and loss "
                        "reductions do: the waiting lands in NCCL's kernels)")
    p.add_argument("--share-gpus", action="store_true",
                   help="on a machine with fewer GPUs than --gpus, layout GPU g runs on device "
                        "g mod the devices there (pretend nodes only: NCCL refuses two ranks "
                        "of one host on one GPU)")
    p.add_argument("--duration-s", type=float, default=60.0,
                   help="measured run time after the warm-up")
    p.add_argument("--warmup-steps", type=int, default=15)
    p.add_argument("--layers", type=int, default=1, help="model layers per step")
    p.add_argument("--matmuls-per-layer", type=int, default=10)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--ag-mib", type=float, default=16.0, help="AllGather shard per rank")
    p.add_argument("--rs-mib", type=float, default=16.0, help="ReduceScatter output per rank")
    p.add_argument("--ar-mib", type=float, default=4.0, help="tp AllReduce message")
    p.add_argument("--dp-mib", type=float, default=16.0, help="dp AllReduce message")
    p.add_argument("--pp-mib", type=float, default=0.0,
                   help="pipeline-like Send/Recv per model layer: each rank of the tp communicator "
                        "sends this much to the next and receives from the previous (0: none)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: gloo everywhere and float32, to check the logic without GPUs")
    p.add_argument("--ctl-dir", required=True)
    p.add_argument("--no-report", action="store_true", help="do not call report_throughput")
    p.add_argument("--train-log-dir", default="",
                   help="every rank writes a Megatron-format log rank-<r>.log here")
    return p.parse_args(argv)


class Job:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
        host = {"auto": None, "on": True, "off": False}[args.host_layer]
        self.topo = layout(args.gpus, args.pretend_nodes, host)
        if world != self.topo.world_size:
            raise SystemExit(f"torchrun started {world} processes, the layout needs "
                             f"{self.topo.world_size} (--nproc-per-node {self.topo.world_size})")
        self.me = self.topo.process(self.rank)
        # NCCL reads the host id once per process, at its first communicator: set it first.
        os.environ["NCCL_HOSTID"] = self.me.host_id
        self.ctl = Path(args.ctl_dir)
        self.ctl.mkdir(parents=True, exist_ok=True)

        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.cuda = args.device == "cuda"
        self.gpu = self.me.gpu
        if self.cuda and args.share_gpus:
            self.gpu %= torch.cuda.device_count()
        if self.cuda:
            torch.cuda.set_device(self.gpu)
            self.device = torch.device("cuda", self.gpu)
            self.dtype = torch.bfloat16
        else:
            self.device = torch.device("cpu")
            self.dtype = torch.float32
        dist.init_process_group("gloo")  # the world group: barriers and control only
        self.groups = {}
        for comm in self.topo.comms:  # every rank creates every group, in the same order
            group = dist.new_group(list(comm.ranks), backend="nccl" if self.cuda else "gloo",
                                   group_desc=comm.name)
            if self.rank in comm.ranks:
                self.groups[comm.name] = group
        # The step's synchronisation: gloo's world group, or an NCCL one of every process.
        self.sync_group = None
        if self.cuda and args.step_sync == "nccl":
            self.sync_group = dist.new_group(list(range(world)), backend="nccl", group_desc="sync")
        self.my_comms = self.topo.comms_of(self.rank)
        self.role = {}
        for comm in self.my_comms:
            for role in comm.roles:
                self.role.setdefault(role, comm)
        self._allocate()

    def _tensor(self, mib: float, factor: int = 1):
        elems = max(1, int(mib * MIB) // self.torch.tensor([], dtype=self.dtype).element_size())
        return self.torch.zeros(elems * factor, dtype=self.dtype, device=self.device)

    def _allocate(self) -> None:
        torch, a = self.torch, self.args
        gen = torch.Generator(device=self.device).manual_seed(1234 + self.rank)
        self.x = torch.randn(a.tokens, a.hidden, dtype=self.dtype, device=self.device,
                             generator=gen)
        self.w = torch.randn(a.hidden, a.hidden, dtype=self.dtype, device=self.device,
                             generator=gen) / a.hidden**0.5
        self.y = torch.empty(a.tokens, a.hidden, dtype=self.dtype, device=self.device)
        self.bufs = {}
        if "fsdp" in self.role:
            n = len(self.role["fsdp"].ranks)
            self.bufs["ag_in"] = self._tensor(a.ag_mib)
            self.bufs["ag_out"] = self._tensor(a.ag_mib, n)
            self.bufs["rs_out"] = self._tensor(a.rs_mib)
            self.bufs["rs_in"] = self._tensor(a.rs_mib, n)
        if "tp" in self.role:
            self.bufs["ar"] = self._tensor(a.ar_mib)
            if a.pp_mib > 0:
                self.bufs["pp_send"] = self._tensor(a.pp_mib)
                self.bufs["pp_recv"] = self._tensor(a.pp_mib)
        if "dp" in self.role:
            self.bufs["dp"] = self._tensor(a.dp_mib)

    @property
    def flops_per_process_step(self) -> float:
        a = self.args
        return 2.0 * a.tokens * a.hidden * a.hidden * a.matmuls_per_layer * a.layers

    def _matmuls(self, n: int) -> None:
        for _ in range(n):
            self.torch.matmul(self.x, self.w, out=self.y)

    def work(self, extra_matmuls: int) -> None:
        """One step's share of this process: compute and collectives, then wait for both."""
        dist, b = self.dist, self.bufs
        fsdp, tp, dp = (self.role.get(r) for r in ("fsdp", "tp", "dp"))
        n = self.args.matmuls_per_layer
        first, second = n // 3, n - n // 3 - n // 3
        for _ in range(self.args.layers):
            # Compute first: the GPU is idle after the phase barrier, so a collective issued
            # right away starts when each *host* gets there, and its kernel time measures the
            # ranks' host skew (bimodal 90/180 µs for a 32 MiB NVLink AllGather in the
            # recordings of b4bd64a), not the link. Behind matmuls the GPU paces its start.
            self._matmuls(first)
            if fsdp:
                dist.all_gather_into_tensor(b["ag_out"], b["ag_in"], group=self.groups[fsdp.name])
            self._matmuls(second)
            # A straggler's extra work lands before the next collective, so its peers wait
            # inside NCCL for it, as behind a slow GPU in real training.
            self._matmuls(extra_matmuls)
            if tp:
                dist.all_reduce(b["ar"], group=self.groups[tp.name])
            self._matmuls(n - first - second)
            if fsdp:
                dist.reduce_scatter_tensor(b["rs_out"], b["rs_in"], group=self.groups[fsdp.name])
            if tp and "pp_send" in b:
                self._pipeline_exchange(tp)
        if dp:
            dist.all_reduce(b["dp"], group=self.groups[dp.name])
        if self.cuda:
            self.torch.cuda.synchronize()

    def _pipeline_exchange(self, comm) -> None:
        """Activations to the next stage, from the previous one, as pipeline parallelism
        passes them (a ring here, so every rank sends and receives): NCCL Send/Recv."""
        dist, b = self.dist, self.bufs
        ranks = list(comm.ranks)
        i = ranks.index(self.rank)
        group = self.groups[comm.name]
        ops = [dist.P2POp(dist.isend, b["pp_send"], ranks[(i + 1) % len(ranks)], group=group),
               dist.P2POp(dist.irecv, b["pp_recv"], ranks[(i - 1) % len(ranks)], group=group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    def write_manifest(self) -> None:
        info = {
            "rank": self.rank, "pid": os.getpid(), "layer": self.me.layer, "gpu": self.me.gpu,
            "host_id": self.me.host_id, "node": self.me.node,
            "comms": [c.name for c in self.my_comms],
        }
        if self.rank == 0:
            info["topology"] = self.topo.to_dict()
            info["args"] = vars(self.args)
        (self.ctl / f"rank-{self.rank}.json").write_text(json.dumps(info, indent=1))

    def _event(self, **fields) -> None:
        line = json.dumps({"ts_ns": time.time_ns(), "rank": self.rank, **fields}) + "\n"
        fd = os.open(self.ctl / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def _control(self, step: int, elapsed_s: float | None) -> tuple[bool, int, int]:
        """Rank 0's decisions for this step, shared with everyone (also a barrier).

        Returns (stop, bit mask of straggling global ranks, extra matmuls).
        """
        torch = self.torch
        ctl = torch.zeros(3, dtype=torch.int64)
        if self.rank == 0:
            stop = (self.ctl / "stop").exists() or (
                elapsed_s is not None and elapsed_s >= self.args.duration_s)
            mask, extra = 0, 0
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
                spec = json.loads((self.ctl / "straggler.json").read_text())
                ranks = spec.get("ranks", [spec.get("rank")])
                mask = sum(1 << int(r) for r in ranks)
                extra = int(spec["extra_matmuls"])
            ctl[0], ctl[1], ctl[2] = int(stop), mask, extra
        if self.sync_group is None:
            self.dist.all_reduce(ctl)  # SUM over the gloo world: everyone gets rank 0's values
        else:
            ctl = ctl.to(self.device)
            self.dist.all_reduce(ctl, group=self.sync_group)
            ctl = ctl.cpu()  # waits for the kernel, as a loss's .item() does
        return bool(ctl[0]), int(ctl[1]), int(ctl[2])

    def _barrier(self) -> None:
        if self.sync_group is None:
            self.dist.barrier()
        else:
            self.dist.barrier(group=self.sync_group, device_ids=[self.gpu])
            self.torch.cuda.synchronize()

    def _megatron_line(self, step: int, step_s: float, tflops: float) -> str:
        """One iteration line as Megatron-LM prints it, local wall-clock time first."""
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
        return (f"[{stamp}] iteration {step:8d}/ 1000000 | consumed samples: {step * 256:12d} | "
                f"elapsed time per iteration (ms): {step_s * 1e3:.1f} | "
                f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f} | learning rate: 1.000000E-04 | "
                f"global batch size:   256 | lm loss: 2.500000E+00 | loss scale: 1.0 | "
                f"grad norm: 1.000 | number of skipped iterations:   0 | "
                f"number of nan iterations:   0 |\n")

    def run(self) -> None:
        from ncclwatch import report_throughput

        dist, a = self.dist, self.args
        self.write_manifest()
        # Create every NCCL communicator now (PyTorch makes them lazily), in one global
        # order, so the first timed step does not pay for NCCL's setup.
        for comm in self.my_comms:
            dist.all_reduce(self._tensor(0.001), group=self.groups[comm.name])
        if self.cuda:
            self.torch.cuda.synchronize()
        dist.barrier()

        phases = list(self.topo.layers) if a.phases == "serial" else ["all"]
        flops_per_gpu = self.flops_per_process_step * len(self.topo.layers)
        # Kept open across the loop and closed after it; one line per step.
        steps_log = open(self.ctl / "steps.jsonl", "a") if self.rank == 0 else None  # noqa: SIM115
        straggling = False
        train_log = None
        if a.train_log_dir:
            Path(a.train_log_dir).mkdir(parents=True, exist_ok=True)
            train_log = open(Path(a.train_log_dir) / f"rank-{self.rank}.log", "a")  # noqa: SIM115
        measure_start = None
        phase_s: list[float] = []
        last_straggler = 0
        step = 0
        t_prev = None
        while True:
            elapsed = None if measure_start is None else time.monotonic() - measure_start
            stop, straggler_mask, extra = self._control(step, elapsed)
            t_step = time.monotonic()
            if t_prev is not None and train_log is not None and step > 1:
                step_s = t_step - t_prev
                train_log.write(self._megatron_line(step - 1, step_s,
                                                    flops_per_gpu / step_s / 1e12))
                train_log.flush()
            if t_prev is not None and self.rank == 0 and step > a.warmup_steps:
                step_s = t_step - t_prev
                tflops = flops_per_gpu / step_s / 1e12
                if not a.no_report:
                    report_throughput(tflops, step=step - 1, rank=-1)
                steps_log.write(json.dumps({
                    "step": step - 1, "ts_ns": time.time_ns(), "step_s": round(step_s, 6),
                    "phase_s": [round(x, 6) for x in phase_s], "tflops_per_gpu": round(tflops, 6),
                    "straggler_mask": last_straggler}) + "\n")
            if stop:
                break
            if step == a.warmup_steps:
                measure_start = time.monotonic()
                if self.rank == 0:
                    (self.ctl / "ready").write_text(json.dumps({"ts_ns": time.time_ns(),
                                                                "step": step}))
            mine = extra if straggler_mask >> self.rank & 1 else 0
            if bool(mine) != straggling:
                straggling = bool(mine)
                self._event(event="straggler_start" if straggling else "straggler_end",
                            step=step, extra_matmuls=mine)
            phase_s = []
            for phase in phases:
                t0 = time.monotonic()
                if phase in ("all", self.me.layer):
                    self.work(mine)
                self._barrier()
                phase_s.append(time.monotonic() - t0)
            last_straggler = straggler_mask
            t_prev = t_step
            step += 1
            if steps_log and step % 50 == 0:
                steps_log.flush()
        if straggling:
            self._event(event="straggler_end", step=step, extra_matmuls=0)
        if steps_log:
            steps_log.close()
        if train_log:
            train_log.close()
        if self.rank == 0:
            (self.ctl / "done").write_text(json.dumps({"ts_ns": time.time_ns(), "steps": step}))
        dist.destroy_process_group()


def main() -> None:
    Job(parse_args()).run()


if __name__ == "__main__":
    main()
