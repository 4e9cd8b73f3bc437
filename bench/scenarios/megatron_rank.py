"""One rank of a real Megatron-LM job, as ``megatron_run.py`` launches it through torchrun.

Sets the rank's pretend node (``NCCL_HOSTID``: two ranks on one GPU need two "hosts" on
NCCL 2.28, which makes their communicator a network one), says its process id in
``ctl/rank-<rank>.json``, sends its output to ``trainlogs/rank-<rank>.log`` (Megatron
prints its arguments on rank 0 and its iteration lines on the last rank) and runs
Megatron's ``pretrain_gpt.py`` in this process with the arguments given.

Environment: ``MLM_DIR`` (a Megatron-LM tree), ``MLM_RUN_DIR`` (the run's folder).
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def main() -> None:
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    run_dir, mlm = os.environ["MLM_RUN_DIR"], os.environ["MLM_DIR"]
    os.environ["NCCL_HOSTID"] = f"pretend-node-{local}"
    # ... each alone on its node's one GPU, as Megatron (which sets the device from its
    # local rank) sees it
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = "0", "1"
    with open(os.path.join(run_dir, "ctl", f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "pid": os.getpid(), "gpu": 0, "host_id": os.environ["NCCL_HOSTID"],
                   "node": local, "layer": "pretend"}, f)
    log = os.open(os.path.join(run_dir, "trainlogs", f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    script = os.path.join(mlm, "pretrain_gpt.py")
    sys.path.insert(0, mlm)
    sys.argv = [script, *sys.argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
