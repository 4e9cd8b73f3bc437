"""Recorded GPU runs through the cluster path and through local mode: the same events?

Each run goes through its own ``ncclwatch forward --once`` into fresh topics, then one
``ncclwatch worker`` over them (``ncclwatch_testkit.drivers.recorded_runs_through_worker``,
which ``tests/test_gpu_runs_*.py`` use on a few runs each); local mode reads the same
records. Prints the event counts and whether they are equal, event for event (id, type,
state, attribution, start, severity, rank, communicator). Needs the project's Kafka
(``scripts/services.sh start kafka``).

    .venv/bin/python bench/detectors/worker_vs_local.py --bootstrap 127.0.0.1:PORT RUN.tar.gz ...
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import eval_gpu_runs  # this directory, on sys.path as the script's own
from ncclwatch_testkit.drivers import recorded_runs_through_worker, worker_and_local


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap", required=True, help="Kafka bootstrap address (host:port)")
    ap.add_argument("runs", nargs="+", type=Path, help="run archives (*.tar.gz)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        got = recorded_runs_through_worker(args.bootstrap, Path(tmp), args.runs, eval_gpu_runs.sources)
    worker, local = worker_and_local(got)
    print(f"runs {len(args.runs)}, worker events {len(worker)}, local events {len(local)}, "
          f"equal: {worker == local}")
    if worker != local:
        for e in sorted(set(worker) ^ set(local), key=str):
            print("  only in", "worker" if e in worker else "local", e)
        print(got["log"][-2000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
