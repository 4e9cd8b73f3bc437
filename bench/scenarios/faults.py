"""Fault injectors for the scenario job, each with ``start()`` / ``stop()``.

Network-path congestion, on one machine whose "network" is NCCL's socket transport
between pretend nodes, is emulated the ways that machine allows:

* ``ProxyCpuContention``: NCCL's network traffic is moved by its proxy threads
  (``NCCL Progress``) and, when configured, socket helper threads (``NCCL Sock…``). The
  injector pins those threads of the chosen processes to a few cores and runs busy
  processes on the same cores, so the data path gets a fraction of a CPU, as a NIC's
  queue shared with a noisy neighbour would give it a fraction of the link. Threads are
  found by name (NCCL names them when ``NCCL_SET_THREAD_NAME=1``) and their previous
  affinity is restored at ``stop()``.
* ``SocketBlaster``: TCP senders and receivers moving data as fast as they can over the
  address NCCL's socket transport uses (its interface, from NCCL's log), optionally on
  the same cores as the proxy threads: competing traffic on the same path.
* ``TcShaper``: a token-bucket rate limit on that interface with ``tc`` when a ``tc``
  binary and the kernel's ``sch_tbf`` are there (they were not installed on the GPU
  machine; one can be carried); ``RampedTc`` steps that rate down over the fault.
* ``NetemShaper``: latency and/or packet loss on that interface (``tc`` ``netem``).

``GpuHog`` is not a network fault: another process computing on one GPU, which the job's
processes there then share.

Intra-node trouble, where the GPUs of a node talk through host memory instead of NVLink
(``NCCL_P2P_DISABLE=1``: NCCL's SHM transport, as on PCIe-only nodes or when peer access
fails): ``PcieContention`` copies between pinned host memory and one GPU in both
directions, taking that GPU's PCIe link from the SHM transport's copies;
``HostMemoryHog`` copies big host buffers on several threads, taking memory bandwidth
from the SHM transport's staging buffers.

A straggler needs no injector here: the job reads ``straggler.json`` in its control
directory (see ``train_job.py``).

>>> sorted(parse_nccl_socket_if("NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>\\n").items())
[('address', '10.0.0.2'), ('iface', 'eth0')]
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

NCCL_DATA_THREADS = ("NCCL Progress", "NCCL Sock", "NCCL Proxy")


def threads(pid: int) -> list[tuple[int, str]]:
    """(tid, name) of every thread of ``pid``; empty once the process is gone."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out.append((int(task.name), (task / "comm").read_text().strip()))
    return sorted(out)


def nccl_data_threads(pid: int, prefixes: tuple[str, ...] = NCCL_DATA_THREADS) -> list[int]:
    """Threads of ``pid`` that move NCCL's network data, found by NCCL's thread names."""
    return [tid for tid, name in threads(pid) if name.startswith(prefixes)]


_SOCKET_IF = re.compile(r"NET/Socket : Using \[0\]([^:\s]+):([^<\s]+)<")


def parse_nccl_socket_if(log_text: str) -> dict[str, str]:
    """Interface and address NCCL's socket transport chose, from an ``NCCL_DEBUG=INFO`` log."""
    m = _SOCKET_IF.search(log_text)
    return {"iface": m.group(1), "address": m.group(2)} if m else {}


def _spin(core: int | None, duty: float, period_s: float) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if core is not None:
        os.sched_setaffinity(0, {core})
    busy_s = duty * period_s
    while True:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < busy_s:
            pass
        if duty < 1.0:
            time.sleep(period_s - busy_s)


@dataclass
class ProxyCpuContention:
    """Starve the NCCL data-path threads of ``pids`` of CPU.

    The threads of ``pids[i]`` go to ``cores[i % len(cores)]``, where ``spinners_per_core``
    busy processes run ``duty`` of every ``period_s``.
    """

    pids: list[int]
    cores: list[int]
    spinners_per_core: int = 1
    duty: float = 1.0
    period_s: float = 0.01
    _saved: dict[int, set[int]] = field(default_factory=dict, repr=False)
    _procs: list[mp.Process] = field(default_factory=list, repr=False)
    pinned: dict[int, list[int]] = field(default_factory=dict)
    fallback: bool = False
    thread_names: dict[int, list[str]] = field(default_factory=dict)

    def start(self) -> None:
        if not self.cores:
            raise ValueError("no cores to contend")
        ctx = mp.get_context("fork")
        for core in self.cores:
            for _ in range(self.spinners_per_core):
                p = ctx.Process(target=_spin, args=(core, self.duty, self.period_s), daemon=True)
                p.start()
                self._procs.append(p)
        for i, pid in enumerate(self.pids):
            core = self.cores[i % len(self.cores)]
            tids = nccl_data_threads(pid)
            if not tids:
                # NCCL did not name its threads (NCCL_SET_THREAD_NAME unset or an NCCL that
                # names only through NVTX): take every thread but the main one, which
                # launches the GPU work; NCCL's proxy is among them.
                self.fallback = True
                tids = [tid for tid, _ in threads(pid) if tid != pid]
            for tid in tids:
                with contextlib.suppress(OSError):
                    self._saved[tid] = os.sched_getaffinity(tid)
                    os.sched_setaffinity(tid, {core})
            self.pinned[pid] = tids
            self.thread_names[pid] = sorted({name for _, name in threads(pid)})

    def stop(self) -> None:
        for p in self._procs:
            p.terminate()
        for p in self._procs:
            p.join(5)
        self._procs.clear()
        for tid, cpus in self._saved.items():
            with contextlib.suppress(OSError):  # the thread may be gone
                os.sched_setaffinity(tid, cpus)
        self._saved.clear()

    def describe(self) -> dict:
        return {"injector": "proxy_cpu", "pids": self.pids, "cores": self.cores,
                "spinners_per_core": self.spinners_per_core, "duty": self.duty,
                "pinned_threads": {str(k): v for k, v in self.pinned.items()},
                "fallback_all_threads": self.fallback,
                "thread_names": {str(k): v for k, v in self.thread_names.items()}}


def _receive(listener: socket.socket, core: int | None, counter) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if core is not None:
        os.sched_setaffinity(0, {core})
    conn, _ = listener.accept()
    buf = bytearray(1 << 22)
    view = memoryview(buf)
    while True:
        n = conn.recv_into(view)
        if not n:
            return
        with counter.get_lock():
            counter.value += n


def _send(address: tuple[str, int], core: int | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if core is not None:
        os.sched_setaffinity(0, {core})
    data = b"\0" * (1 << 22)
    with socket.create_connection(address) as s:
        while True:
            s.sendall(data)


@dataclass
class SocketBlaster:
    """``streams`` TCP connections sending as fast as they can to ``address``."""

    address: str
    streams: int = 4
    cores: list[int] | None = None
    _procs: list[mp.Process] = field(default_factory=list, repr=False)
    _started: float = 0.0
    bytes_moved: int = 0
    gbs: float = 0.0

    def start(self) -> None:
        ctx = mp.get_context("fork")
        self._counter = ctx.Value("q", 0)
        for i in range(self.streams):
            core = self.cores[i % len(self.cores)] if self.cores else None
            listener = socket.create_server((self.address, 0))
            port = listener.getsockname()[1]
            rx = ctx.Process(target=_receive, args=(listener, core, self._counter), daemon=True)
            rx.start()
            listener.close()
            tx = ctx.Process(target=_send, args=((self.address, port), core), daemon=True)
            tx.start()
            self._procs += [rx, tx]
        self._started = time.monotonic()

    def stop(self) -> None:
        elapsed = time.monotonic() - self._started
        for p in self._procs:
            p.terminate()
        for p in self._procs:
            p.join(5)
        self._procs.clear()
        self.bytes_moved = int(self._counter.value)
        self.gbs = self.bytes_moved / max(elapsed, 1e-9) / 1e9

    def describe(self) -> dict:
        return {"injector": "sockets", "address": self.address, "streams": self.streams,
                "cores": self.cores, "bytes_moved": self.bytes_moved,
                "competing_gbs": round(self.gbs, 3)}


def run_tc(tc: list[str], env: dict[str, str] | None, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*tc, *args], capture_output=True, text=True, timeout=10, env=env)


class RootQdisc:
    """:meth:`start` puts :meth:`qdisc` at the root of ``iface``, :meth:`stop` takes it
    away; ``applied`` and ``error`` say whether it took. Subclasses are dataclasses with
    ``tc``, ``iface``, ``env``, ``applied`` and ``error`` fields."""

    tc: list[str]
    iface: str
    env: dict[str, str] | None
    applied: bool
    error: str

    def qdisc(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        r = run_tc(self.tc, self.env, "qdisc", "replace", "dev", self.iface, "root", *self.qdisc())
        self.applied = r.returncode == 0
        self.error = r.stderr.strip()

    def stop(self) -> None:
        if self.applied:
            run_tc(self.tc, self.env, "qdisc", "del", "dev", self.iface, "root")


def tbf(rate: str) -> list[str]:
    return ["tbf", "rate", rate, "burst", "4mb", "latency", "100ms"]


@dataclass
class TcShaper(RootQdisc):
    """A ``tbf`` rate limit on ``iface`` (``tc`` given as a command list)."""

    tc: list[str]
    iface: str
    rate: str = "16gbit"
    env: dict[str, str] | None = None
    applied: bool = False
    error: str = ""

    def qdisc(self) -> list[str]:
        return tbf(self.rate)

    def describe(self) -> dict:
        return {"injector": "tc", "iface": self.iface, "rate": self.rate,
                "applied": self.applied, "error": self.error}


@dataclass
class NetemShaper(RootQdisc):
    """``netem`` on ``iface`` (``tc`` given as a command list): latency (``delay``, with an
    optional ``jitter``) and/or packet ``loss`` on the path, not a rate limit. Needs the
    kernel's ``sch_netem``; ``applied`` and ``error`` say whether it took."""

    tc: list[str]
    iface: str
    delay: str = ""
    jitter: str = ""
    loss: str = ""
    env: dict[str, str] | None = None
    applied: bool = False
    error: str = ""

    def args(self) -> list[str]:
        out = []
        if self.delay:
            out += ["delay", self.delay] + ([self.jitter] if self.jitter else [])
        if self.loss:
            out += ["loss", self.loss]
        if not out:
            raise ValueError("netem needs delay= and/or loss=")
        return out

    def qdisc(self) -> list[str]:
        return ["netem", *self.args()]

    def describe(self) -> dict:
        return {"injector": "netem", "iface": self.iface, "delay": self.delay, "jitter": self.jitter,
                "loss": self.loss, "netem_args": self.args(), "applied": self.applied,
                "error": self.error}


class LoopInjector:
    """An injector whose :meth:`_loop` runs on a thread from :meth:`start` until
    :meth:`stop` sets ``_stop`` (which the loop waits on between its steps)."""

    NAME = "injector"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self.NAME, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)


class RampedTc(LoopInjector):
    """A ``tbf`` rate stepped down over the fault: ``rates[0]`` from :meth:`start`, the
    next every ``step_s``, the last until :meth:`stop` (a gradual degradation rather than
    a step). ``steps`` are the wall-clock (start_ns, rate, applied) of each rate."""

    def __init__(self, tc: list[str], iface: str, rates: list[str], step_s: float,
                 env: dict[str, str] | None = None) -> None:
        if not rates or step_s <= 0:
            raise ValueError("a ramp needs rates and a step > 0 s")
        self.tc, self.iface, self.rates, self.step_s, self.env = tc, iface, rates, step_s, env
        super().__init__()
        self.steps: list[tuple[int, str, bool]] = []
        self.error = ""

    def _loop(self) -> None:
        for i, rate in enumerate(self.rates):
            if i and self._stop.wait(self.step_s):
                return
            t = time.time_ns()
            r = run_tc(self.tc, self.env, "qdisc", "replace", "dev", self.iface, "root", *tbf(rate))
            self.steps.append((t, rate, r.returncode == 0))
            if r.returncode != 0:
                self.error = r.stderr.strip()

    NAME = "ramp"

    def stop(self) -> None:
        super().stop()
        if any(ok for _, _, ok in self.steps):
            run_tc(self.tc, self.env, "qdisc", "del", "dev", self.iface, "root")

    def describe(self) -> dict:
        return {"injector": "ramp-tc", "iface": self.iface, "rates": self.rates, "step_s": self.step_s,
                "steps": [{"start_ns": t, "rate": r, "applied": ok} for t, r, ok in self.steps],
                "applied": bool(self.steps) and all(ok for _, _, ok in self.steps), "error": self.error}


class ProcessFreezer(LoopInjector):
    """One process stopped (``SIGSTOP``) for ``duty`` of every ``period_s`` and let go
    (``SIGCONT``): a host-side stall, as a rank's page faults, a blocking data loader or
    a noisy neighbour on its cores make one. Its GPU runs what was queued, then idles;
    the other ranks wait for it at their next synchronisation: an NCCL collective, or
    with ``train_job.py``'s default gloo step barrier mostly in gloo, where no profiler
    of NCCL sees the wait (``--step-sync nccl`` moves it). Unlike the straggler scenario
    (extra matmuls on its GPU) nothing on the GPU is slower."""

    NAME = "freeze"

    def __init__(self, pid: int, duty: float, period_s: float) -> None:
        if not (0 < duty < 1 and period_s > 0):
            raise ValueError("a freeze needs 0 < duty < 1 and a period > 0 s")
        self.pid, self.duty, self.period_s = pid, duty, period_s
        super().__init__()
        self.stops = 0
        self.error = ""

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self.stops += 1
                time.sleep(self.duty * self.period_s)  # never left stopped past stop()
                os.kill(self.pid, signal.SIGCONT)
                self._stop.wait((1 - self.duty) * self.period_s)
        except OSError as e:
            self.error = str(e)
        finally:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGCONT)

    def describe(self) -> dict:
        return {"injector": "freeze", "pid": self.pid, "duty": self.duty, "period_s": self.period_s,
                "stops": self.stops, "error": self.error}


class Combined:
    """Several injectors started and stopped together."""

    def __init__(self, *parts) -> None:
        self.parts = parts

    def start(self) -> None:
        for p in self.parts:
            p.start()

    def stop(self) -> None:
        for p in reversed(self.parts):
            p.stop()

    def describe(self) -> dict:
        return {"injector": "+".join(p.describe()["injector"] for p in self.parts),
                "parts": [p.describe() for p in self.parts]}


# The copier: a separate CUDA process that keeps NVLink busy with peer copies between two
# GPUs, as another tenant's (or a misplaced job's) traffic would. It allocates and warms
# up first, says "ready", and copies only after a line on stdin, so the fault starts when
# the label says and not a CUDA initialisation later.
_NVLINK_COPIER = r"""
import sys, torch
src_dev, dst_dev, streams, mib, both = (int(a) for a in sys.argv[1:6])
n = mib << 20
pairs = [(src_dev, dst_dev)] + ([(dst_dev, src_dev)] if both else [])
work = []
for a, b in pairs:
    for _ in range(streams):
        x = torch.empty(n, dtype=torch.uint8, device=f"cuda:{a}")
        y = torch.empty(n, dtype=torch.uint8, device=f"cuda:{b}")
        work.append((torch.cuda.Stream(device=a), x, y))
for s, x, y in work:
    with torch.cuda.stream(s):
        y.copy_(x, non_blocking=True)
torch.cuda.synchronize(src_dev); torch.cuda.synchronize(dst_dev)
print("ready", flush=True)
sys.stdin.readline()
copies = 0
while True:
    for s, x, y in work:
        with torch.cuda.stream(s):
            for _ in range(8):
                y.copy_(x, non_blocking=True)
    for s, _, _ in work:
        s.synchronize()
    copies += 8 * len(work)
    if copies % (64 * len(work)) == 0:
        print("copied", copies * n, flush=True)
"""


# The PCIe hog: pinned host memory <-> one GPU, ``streams`` copy streams each way.
_PCIE_COPIER = r"""
import sys, torch
gpu, streams, mib = (int(a) for a in sys.argv[1:4])
n = mib << 20
torch.cuda.set_device(gpu)
work = []
for _ in range(streams):
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(n, dtype=torch.uint8, device=f"cuda:{gpu}")
    work.append((torch.cuda.Stream(), d, h))  # host -> GPU
    h2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d2 = torch.empty(n, dtype=torch.uint8, device=f"cuda:{gpu}")
    work.append((torch.cuda.Stream(), h2, d2))  # GPU -> host
for s, y, x in work:
    with torch.cuda.stream(s):
        y.copy_(x, non_blocking=True)
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
copies = 0
while True:
    for s, y, x in work:
        with torch.cuda.stream(s):
            for _ in range(4):
                y.copy_(x, non_blocking=True)
    for s, _, _ in work:
        s.synchronize()
    copies += 4 * len(work)
    print("copied", copies * n, flush=True)
"""

# The host memory hog: threads copying big host buffers (numpy releases the GIL in copies).
_HOST_MEMORY_HOG = r"""
import sys, threading, numpy as np
threads, mib = int(sys.argv[1]), int(sys.argv[2])
bufs = [(np.ones(mib << 17), np.empty(mib << 17)) for _ in range(threads)]  # float64: mib MiB each
done = [0] * threads
go = threading.Event()
def work(i):
    a, b = bufs[i]
    go.wait()
    while True:
        np.copyto(b, a)
        done[i] += 1
for i in range(threads):
    threading.Thread(target=work, args=(i,), daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
go.set()
import time
while True:
    time.sleep(1.0)
    print("copied", sum(done) * (mib << 20), flush=True)
"""


class GoProcess:
    """A Python child that sets up (CUDA start-up takes seconds), prints ``ready``, waits
    for ``go`` on stdin, then works, printing ``<counter> <n>`` lines, until terminated."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.started = 0.0

    @classmethod
    def launch(cls, python: str, script: str, args: list, what: str) -> GoProcess:
        proc = subprocess.Popen([python, "-c", script, *map(str, args)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "ready":
            error = (line + (proc.stderr.read() if proc.stderr else ""))[-2000:]
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{what} did not start: {error}")
        return cls(proc)

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        self.started = time.monotonic()

    def finish(self, counter: str) -> tuple[int, float]:
        """Stop it; the last ``counter`` value it printed and the seconds since ``go``."""
        elapsed = time.monotonic() - self.started
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=20)
        values = [int(x.split()[1]) for x in out.splitlines() if x.startswith(counter)]
        return (values[-1] if values else 0), elapsed


class GoInjector:
    """An injector that is a :class:`GoProcess` running ``SCRIPT`` with :meth:`_args`:
    :meth:`prepare` starts it, :meth:`start` lets it work, :meth:`stop` hands its last
    ``COUNTER`` value and the seconds it worked to :meth:`_done`. Subclasses are
    dataclasses with ``python``, ``error`` and ``_child`` fields."""

    SCRIPT = WHAT = COUNTER = ""
    python: str
    error: str
    _child: GoProcess | None

    def _args(self) -> list:
        raise NotImplementedError

    def _done(self, value: int, elapsed: float) -> None:
        raise NotImplementedError

    def prepare(self) -> None:
        if self._child is None:
            try:
                self._child = GoProcess.launch(self.python, self.SCRIPT, self._args(), self.WHAT)
            except RuntimeError as e:
                self.error = str(e)
                raise

    def start(self) -> None:
        self.prepare()
        assert self._child is not None
        self._child.go()

    def stop(self) -> None:
        if self._child is None:
            return
        self._done(*self._child.finish(self.COUNTER))
        self._child = None


class Copier(GoInjector):
    """A :class:`GoInjector` whose child counts the bytes it copied (``copied <n>``)."""

    COUNTER = "copied "
    bytes_moved: int
    gbs: float

    def _done(self, value: int, elapsed: float) -> None:
        self.bytes_moved = value
        self.gbs = round(value / max(elapsed, 1e-9) / 1e9, 1)


@dataclass
class NvlinkContention(Copier):
    """Competing peer-to-peer copies between GPUs ``src`` and ``dst`` over NVLink.

    ``streams`` copy streams per direction, each moving ``mib`` MiB per copy; ``both``
    copies in both directions. :meth:`prepare` starts the process (CUDA start-up takes
    seconds), :meth:`start` lets it copy.
    """

    src: int = 0
    dst: int = 1
    streams: int = 2
    mib: int = 256
    both: bool = True
    python: str = "python3"
    _child: GoProcess | None = field(default=None, repr=False)
    bytes_moved: int = 0
    gbs: float | None = None
    error: str = ""

    SCRIPT, WHAT = _NVLINK_COPIER, "NVLink copier"

    def _args(self) -> list:
        return [self.src, self.dst, self.streams, self.mib, int(self.both)]

    def describe(self) -> dict:
        return {"injector": "nvlink", "src_gpu": self.src, "dst_gpu": self.dst,
                "streams_per_direction": self.streams, "mib_per_copy": self.mib,
                "both_directions": self.both, "bytes_moved_at_least": self.bytes_moved,
                "competing_gbs_at_least": self.gbs, "error": self.error}


# The hog: a separate CUDA process running big bf16 matmuls on one GPU, as another tenant
# sharing the GPU would (no MPS: the GPU time-slices between it and the job's process).
# It allocates and warms up first, says "ready", and runs only after a line on stdin; with
# duty < 1 it is busy ``duty`` of every ``period`` seconds.
_GPU_HOG = r"""
import sys, time, torch
gpu, duty, period, n = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
torch.cuda.set_device(gpu)
a = torch.randn(n, n, dtype=torch.bfloat16, device=f"cuda:{gpu}")
b = torch.randn(n, n, dtype=torch.bfloat16, device=f"cuda:{gpu}")
for _ in range(3):
    c = a @ b
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
done, last = 0, time.monotonic()
while True:
    t0 = time.monotonic()
    while time.monotonic() - t0 < duty * period:
        for _ in range(4):
            c = a @ b
        torch.cuda.synchronize()
        done += 4
    if duty < 1.0:
        time.sleep(max(0.0, period - (time.monotonic() - t0)))
    if time.monotonic() - last >= 1.0:
        last = time.monotonic()
        print("matmuls", done, flush=True)
"""


@dataclass
class GpuHog(GoInjector):
    """Another process computing on GPU ``gpu`` (matmuls of ``n``×``n`` bf16), busy
    ``duty`` of every ``period_s``: the job's processes on that GPU share it and fall
    behind. :meth:`prepare` starts the process (CUDA start-up takes seconds), :meth:`start`
    lets it compute."""

    gpu: int = 0
    duty: float = 1.0
    period_s: float = 0.1
    n: int = 8192
    python: str = "python3"
    _child: GoProcess | None = field(default=None, repr=False)
    matmuls: int = 0
    tflops: float = 0.0
    error: str = ""

    SCRIPT, WHAT, COUNTER = _GPU_HOG, "GPU hog", "matmuls "

    def _args(self) -> list:
        return [self.gpu, self.duty, self.period_s, self.n]

    def _done(self, value: int, elapsed: float) -> None:
        self.matmuls = value
        self.tflops = round(value * 2 * self.n**3 / max(elapsed, 1e-9) / 1e12, 1)

    def describe(self) -> dict:
        return {"injector": "gpuhog", "gpu": self.gpu, "duty": self.duty, "period_s": self.period_s,
                "matmul_n": self.n, "matmuls_at_least": self.matmuls,
                "hog_tflops_at_least": self.tflops, "error": self.error}


class Pulsed(LoopInjector):
    """An injector switched on for ``on_s``, off for ``off_s``, over and over (an
    intermittent fault: a flapping link, a periodic neighbour), from :meth:`start` until
    :meth:`stop`; ``spans`` are the wall-clock (start_ns, end_ns) it was on."""

    def __init__(self, inner, on_s: float, off_s: float) -> None:
        if not (on_s > 0 and off_s > 0):
            raise ValueError("pulse on and off must be > 0 s")
        self.inner, self.on_s, self.off_s = inner, on_s, off_s
        super().__init__()
        self.spans: list[tuple[int, int]] = []

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.time_ns()
            self.inner.start()
            self._stop.wait(self.on_s)
            self.inner.stop()
            self.spans.append((t0, time.time_ns()))
            self._stop.wait(self.off_s)

    NAME = "pulse"

    def describe(self) -> dict:
        inner = self.inner.describe()
        return {**inner, "injector": f"pulsed-{inner['injector']}", "on_s": self.on_s,
                "off_s": self.off_s, "on_spans_ns": self.spans}


@dataclass
class PcieContention(Copier):
    """Another process copying pinned host memory to and from GPU ``gpu`` (``streams``
    streams each way, ``mib`` MiB per copy): that GPU's PCIe link is shared, which slows
    NCCL only where it moves data through host memory (the SHM and socket transports).
    :meth:`prepare` starts the process, :meth:`start` lets it copy."""

    gpu: int = 0
    streams: int = 2
    mib: int = 256
    python: str = "python3"
    _child: GoProcess | None = field(default=None, repr=False)
    bytes_moved: int = 0
    gbs: float = 0.0
    error: str = ""

    SCRIPT, WHAT = _PCIE_COPIER, "PCIe copier"

    def _args(self) -> list:
        return [self.gpu, self.streams, self.mib]

    def describe(self) -> dict:
        return {"injector": "pcie", "gpu": self.gpu, "streams_per_direction": self.streams,
                "mib_per_copy": self.mib, "bytes_moved_at_least": self.bytes_moved,
                "competing_gbs_at_least": self.gbs, "error": self.error}


@dataclass
class HostMemoryHog(Copier):
    """Another process copying ``mib``-MiB host buffers on ``threads`` threads: host
    memory bandwidth shared with NCCL's SHM transport. :meth:`prepare` allocates,
    :meth:`start` lets it copy."""

    threads: int = 8
    mib: int = 256
    python: str = "python3"
    _child: GoProcess | None = field(default=None, repr=False)
    bytes_moved: int = 0
    gbs: float = 0.0
    error: str = ""

    SCRIPT, WHAT = _HOST_MEMORY_HOG, "host memory hog"

    def _args(self) -> list:
        return [self.threads, self.mib]

    def describe(self) -> dict:
        return {"injector": "membw", "threads": self.threads, "mib_per_buffer": self.mib,
                "bytes_copied_at_least": self.bytes_moved, "copy_gbs_at_least": self.gbs,
                "error": self.error}
