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
  machine; one can be carried).

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


@dataclass
class TcShaper:
    """A ``tbf`` rate limit on ``iface`` (``tc`` given as a command list)."""

    tc: list[str]
    iface: str
    rate: str = "16gbit"
    env: dict[str, str] | None = None
    applied: bool = False
    error: str = ""

    def _tc(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self.tc, *args], capture_output=True, text=True, timeout=10,
                              env=self.env)

    def start(self) -> None:
        r = self._tc("qdisc", "replace", "dev", self.iface, "root", "tbf", "rate", self.rate,
                     "burst", "4mb", "latency", "100ms")
        self.applied = r.returncode == 0
        self.error = r.stderr.strip()

    def stop(self) -> None:
        if self.applied:
            self._tc("qdisc", "del", "dev", self.iface, "root")

    def describe(self) -> dict:
        return {"injector": "tc", "iface": self.iface, "rate": self.rate,
                "applied": self.applied, "error": self.error}


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
