"""The training-process side of throughput: one JSON line appended to the node's spool.

``report_throughput`` runs inside the training loop, so it does as little as possible:
no Kafka client, no threads, no buffering. It appends one ``throughput`` record to
``$NCCLWATCH_SPOOL_DIR/<job>/<host>-throughput-<pid>.000000.jsonl`` with a single
``write()`` on an ``O_APPEND`` descriptor, so a concurrent reader sees either the whole
line or nothing of it (the forwarder never takes a line without its ``\\n``). I/O errors
are counted and warned about once; they never raise into the training loop.

>>> import tempfile, pathlib
>>> d = tempfile.mkdtemp()
>>> report_throughput(310.2, 7, rank=0, spool_dir=d, job="job 1")
>>> [p.name.split("-throughput-")[1].split(".", 1)[1] for p in pathlib.Path(d, "job%201").iterdir()]
['000000.jsonl']
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import stat
import threading
import time
import warnings
from collections.abc import Mapping
from typing import NamedTuple

from ncclwatch.records import PAUSE_REASONS, PAUSE_STATES, PauseRecord, ThroughputRecord, to_json
from ncclwatch.rules import safe_filename

DEFAULT_SPOOL_DIR = "/tmp/ncclwatch-spool"
log = logging.getLogger(__name__)

# How many reports could not be written; exposed for tests and for callers who care.
errors_total = 0
_warned = False
# Open descriptors by path: reopening per step would cost a syscall pair per call and
# the file name depends only on (spool dir, job, host, pid), which rarely changes.
_fds: dict[str, int] = {}
_lock = threading.Lock()  # several threads of one process may report; open once


# Where a job id comes from, first match wins (docs/deploy.md, "Job identity"). The plugin
# mirrors this in plugin/src/config.c; tests/vectors/job_id.json holds the cases both pass.
# Kubernetes sets none of the *_NAME variables by itself: a pod exposes its workload's label
# or annotation through the downward API (the chart's training-pod snippet sets them all;
# a label the pod does not carry gives an empty value, which is skipped).
EXPLICIT_SOURCES = ("NCCLWATCH_JOB_ID", "SLURM_JOB_ID")
K8S_SOURCES = (
    ("PYTORCHJOB_NAME", "label training.kubeflow.org/job-name"),  # Kubeflow Training Operator
    ("JOBSET_NAME", "label jobset.sigs.k8s.io/jobset-name"),  # JobSet, Kubeflow Trainer v2
    ("VC_JOB_NAME", "annotation volcano.sh/job-name"),  # Volcano
    ("K8S_JOB_NAME", "label batch.kubernetes.io/job-name"),  # a plain batch/v1 Job
)
K8S_NAMESPACE = "POD_NAMESPACE"  # prefixes a Kubernetes name: "<namespace>/<name>"
ELASTIC_SOURCE = "TORCHELASTIC_RUN_ID"
# torchrun's --rdzv-id defaults to "none": every job started without one would share it.
ELASTIC_UNSET = "none"
FALLBACK_JOB = "unknown"
_job_warned = False


class JobIdentity(NamedTuple):
    """A job id and the variable it came from (``None``: the meaningless fallback)."""

    job: str
    source: str | None


def job_identity(environ: Mapping[str, str] | None = None) -> JobIdentity:
    """The job id as the plugin derives it, and where it came from.

    >>> job_identity({"SLURM_JOB_ID": "42", "JOBSET_NAME": "llm"})
    JobIdentity(job='42', source='SLURM_JOB_ID')
    >>> job_identity({"JOBSET_NAME": "llm", "POD_NAMESPACE": "team-a"})
    JobIdentity(job='team-a/llm', source='JOBSET_NAME')
    >>> job_identity({"TORCHELASTIC_RUN_ID": "none"})
    JobIdentity(job='unknown', source=None)
    """
    env = os.environ if environ is None else environ
    for name in EXPLICIT_SOURCES:
        if env.get(name):
            return JobIdentity(env[name], name)
    for name, _ in K8S_SOURCES:
        if env.get(name):
            namespace = env.get(K8S_NAMESPACE)
            return JobIdentity(f"{namespace}/{env[name]}" if namespace else env[name], name)
    elastic = env.get(ELASTIC_SOURCE)
    if elastic and elastic != ELASTIC_UNSET:
        return JobIdentity(elastic, ELASTIC_SOURCE)
    return JobIdentity(FALLBACK_JOB, None)


def fallback_warning(environ: Mapping[str, str]) -> str:
    """What to tell someone whose job fell back to the meaningless id."""
    names = [*EXPLICIT_SOURCES, *(n for n, _ in K8S_SOURCES), ELASTIC_SOURCE]
    why = f"none of {', '.join(names)} is set"
    if environ.get(ELASTIC_SOURCE) == ELASTIC_UNSET:
        why += f" ({ELASTIC_SOURCE}=none is torchrun's default without --rdzv-id)"
    return (
        f"ncclwatch: no job id in the environment: {why}. Records are labelled "
        f"{FALLBACK_JOB!r} and mixed with every other unlabelled job on this node; "
        "set NCCLWATCH_JOB_ID (docs/deploy.md, 'Job identity')"
    )


def job_id(environ: Mapping[str, str] | None = None) -> str:
    """The job id as the plugin derives it; warns once per process when this process's
    own environment names no job.

    >>> job_id({"SLURM_JOB_ID": "42"}), job_id({})
    ('42', 'unknown')
    """
    global _job_warned
    ident = job_identity(environ)
    if ident.source is None and environ is None and not _job_warned:
        _job_warned = True
        msg = fallback_warning(os.environ)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        log.warning(msg)
    return ident.job


def spool_path(spool_dir: str, job: str, host: str, pid: int) -> str:
    """Where one process's throughput records go.

    >>> spool_path("/s", "j/1", "h", 9)
    '/s/j%2F1/h-throughput-9.000000.jsonl'
    """
    return os.path.join(
        spool_dir, safe_filename(job), f"{safe_filename(host)}-throughput-{pid}.000000.jsonl"
    )


def check_dir_ours(d: str) -> None:
    """Raise ``PermissionError`` unless ``d`` is a directory of this user that no other
    user may write: the plugin's rule for a job's spool directory (plugin/src/writer.c),
    since on a shared node's sticky spool someone else may have created it first.

    >>> import tempfile; d = tempfile.mkdtemp(); check_dir_ours(d); os.chmod(d, 0o777)
    >>> check_dir_ours(d)
    Traceback (most recent call last):
    ...
    PermissionError: spool directory ... is writable by every user: not writing there
    """
    st = os.lstat(d)
    why = ("is not a directory" if not stat.S_ISDIR(st.st_mode)
           else "belongs to another user" if st.st_uid != os.geteuid()
           else "is writable by every user" if st.st_mode & stat.S_IWOTH else "")
    if why:
        raise PermissionError(f"spool directory {d} {why}: not writing there")


def _open(path: str) -> int:
    fd = _fds.get(path)
    if fd is None:
        with _lock:
            fd = _fds.get(path)
            if fd is None:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                check_dir_ours(os.path.dirname(path))
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
                fd = os.open(path, flags, 0o644)
                _fds[path] = fd
    return fd


def _close(path: str) -> None:
    with _lock:
        fd = _fds.pop(path, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def _fail(err: BaseException) -> None:
    global errors_total, _warned
    errors_total += 1
    if not _warned:
        _warned = True
        msg = (
            f"ncclwatch: could not write a throughput or pause record ({err}); "
            "further errors are only counted"
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=4)
        log.warning(msg)


def report_throughput(
    tflops_per_gpu: float,
    step: int,
    *,
    tokens_per_s: float | None = None,
    rank: int | None = None,
    spool_dir: str | None = None,
    job: str | None = None,
) -> None:
    """Append one throughput record for ``step`` to this node's spool.

    ``rank`` defaults to ``$RANK`` (``-1`` when unset, meaning a job-level report), the
    spool to ``$NCCLWATCH_SPOOL_DIR`` (else ``/tmp/ncclwatch-spool``, like the plugin),
    ``job`` to the plugin's job id. Values that break the contract (negative or
    non-finite TFLOP/s, negative step) are programmer errors and raise ``ValueError``;
    failing disks do not raise.
    """
    tflops = float(tflops_per_gpu)
    if not math.isfinite(tflops) or tflops < 0:
        raise ValueError(f"tflops_per_gpu must be finite and >= 0, got {tflops_per_gpu!r}")
    if int(step) != step or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    tokens = None
    if tokens_per_s is not None:
        tokens = float(tokens_per_s)
        if not math.isfinite(tokens) or tokens < 0:
            raise ValueError(f"tokens_per_s must be finite and >= 0, got {tokens_per_s!r}")
    if rank is None:
        try:
            rank = int(os.environ.get("RANK", "-1"))
        except ValueError:
            rank = -1
    _append(ThroughputRecord(
        job=job if job is not None else job_id(),
        host=socket.gethostname(),
        rank=int(rank),
        ts_ns=time.time_ns(),
        step=int(step),
        tflops_per_gpu=tflops,
        tokens_per_s=tokens,
        source="api",
    ), spool_dir)


def report_pause(state: str, step: int, *, reason: str = "checkpoint", spool_dir: str | None = None,
                 job: str | None = None) -> None:
    """Say that the job stops training on purpose from now on (``state="begin"``: a
    checkpoint save) or has stopped doing so (``"end"``; the next reported step ends it
    as well). The detectors do not raise what begins inside one (docs/detectors.md,
    "Checkpoint saves"). Same spool file, defaults and failure handling as
    :func:`report_throughput`; call it from the rank that saves, before the save.

    >>> import tempfile, pathlib, json
    >>> d = tempfile.mkdtemp()
    >>> report_pause("begin", 40, spool_dir=d, job="j")
    >>> [json.loads(line)["state"] for f in pathlib.Path(d, "j").iterdir() for line in f.open()]
    ['begin']
    """
    if state not in PAUSE_STATES or reason not in PAUSE_REASONS:
        raise ValueError(f"state must be one of {PAUSE_STATES} and reason one of {PAUSE_REASONS}, "
                         f"got {state!r}, {reason!r}")
    if int(step) != step or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    _append(PauseRecord(job=job if job is not None else job_id(), host=socket.gethostname(), rank=-1,
                        ts_ns=time.time_ns(), state=state, reason=reason, step=int(step)), spool_dir)


def _append(record: ThroughputRecord | PauseRecord, spool_dir: str | None) -> None:
    """One record onto this process's spool file: one ``write()``; errors counted, not raised."""
    data = (to_json(record) + "\n").encode("utf-8")
    spool = spool_dir or os.environ.get("NCCLWATCH_SPOOL_DIR") or DEFAULT_SPOOL_DIR
    path = spool_path(spool, record.job, record.host, os.getpid())
    try:
        fd = _open(path)
        written = os.write(fd, data)
        if written != len(data):
            # A short write on a regular file means the disk is full. End the partial
            # line so the next report starts on a line of its own (the fragment is
            # quarantined by the forwarder instead of corrupting the next record).
            with contextlib.suppress(OSError):
                os.write(fd, b"\n")
            raise OSError(f"short write: {written} of {len(data)} bytes")
    except OSError as e:
        _close(path)
        _fail(e)
