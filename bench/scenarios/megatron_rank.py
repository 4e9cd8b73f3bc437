"""One rank of a real Megatron-LM job, as ``megatron_run.py`` launches it through torchrun.

Sets the rank's pretend node (``NCCL_HOSTID``: two ranks on one GPU need two "hosts" on
NCCL 2.28, which makes their communicator a network one), says its process id in
``ctl/rank-<rank>.json``, sends its output to ``trainlogs/rank-<rank>.log`` (Megatron
prints its arguments on rank 0 and its iteration lines on the last rank) and runs
Megatron's ``pretrain_gpt.py`` in this process with the arguments given.

Environment: ``MLM_DIR`` (a Megatron-LM tree), ``MLM_RUN_DIR`` (the run's folder),
``MLM_SAVE_DELAY_S`` (optional: rank 0 spends that long more writing each checkpoint, as
on slow storage, while the other ranks wait for it at the save's barrier).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time


def slow_saves(delay_s: float) -> None:
    """Make rank 0's checkpoint writes ``delay_s`` longer: storage slower than this
    machine's page cache, which takes a save of this small model in about a second.
    Megatron's legacy (``torch``) format writes with ``torch.save`` after logging the
    save's start, and the other ranks wait for it at the save's barrier."""
    import torch

    save = torch.save

    def slow_save(*args, **kwargs):
        if int(os.environ["RANK"]) == 0:
            print(f"[megatron_rank] write delayed {delay_s:g} s", flush=True)
            time.sleep(delay_s)
        return save(*args, **kwargs)

    torch.save = slow_save


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
    if float(os.environ.get("MLM_SAVE_DELAY_S", "0")) > 0:
        slow_saves(float(os.environ["MLM_SAVE_DELAY_S"]))
    sys.argv = [script, *sys.argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
