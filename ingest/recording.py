"""Recorded sources, read whole: what ``watch``, ``replay``, ``report`` and ``eval`` replay.

Everything ``ncclwatch forward`` reads live can be given to the commands that replay:

- the plugin's spool: a directory of ``*.jsonl[.gz]`` record files, one such file, or a
  ``.tar.gz`` of either (contract records, :func:`ncclwatch.ingest.parse.parse_record`);
- NCCL Inspector JSON output: a directory as Inspector writes it
  (``<dump dir>/<host>-pid<pid>.log``), one such file, or an archive of them (each line
  mapped by :func:`ncclwatch.ingest.inspector.op_from_inspector`);
- training logs, one file per rank (``--training-log``, repeatable, each a path or a
  glob), parsed by :class:`~ncclwatch.ingest.trainlog.ThroughputParser` with the line's
  own timestamps and merged into one job series by
  :class:`~ncclwatch.ingest.trainlog.RankMerge`;
- a run directory as ``bench/scenarios/record.py`` writes it (``spool/``,
  ``inspector/``, ``trainlogs/``, ``run.json``, ``labels.json``), or its archive.

What a file is, is told from its first line, not its name: a JSON object with a
``kind`` is a contract record, one with ``header`` and ``metadata`` an Inspector line.
A text file (``.log``, ``.out``, ``.err``, ``.txt``, gzipped or not) with a Megatron /
NeMo iteration line giving the throughput in its first 64 MiB is a training log,
wherever it lies in the recording (a Slurm ``.out`` beside Inspector's directory), and
is read as ``--training-log`` would read it when none is given. Files that are none of
these are listed in :attr:`ReadStats.unrecognised`, and a source holding nothing
recognisable is a :class:`RecordingError` that says what it found.

Inspector lines and training logs carry no job id; their job is, in this order, the
one given (``--job``), the ``job`` of the run directory's ``run.json`` or
``labels.json``, the Inspector directory's name ``nccl-inspector-<jobid>`` (Inspector's
default), the only job of the spool records, else ``unknown``.

>>> record_time_ns(ThroughputRecord(job="j", host="h", rank=0, ts_ns=7, step=1,
...                                 tflops_per_gpu=1.0, tokens_per_s=None, source="api"))
7
"""

from __future__ import annotations

import argparse
import bisect
import glob
import gzip
import heapq
import json
import logging
import os
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ncclwatch.ingest import external_sort
from ncclwatch.ingest.external_sort import ExternalSort
from ncclwatch.ingest.inspector import InspectorError, NotAnOp, op_from_inspector, quarantine
from ncclwatch.ingest.parse import OpTime, op_time, to_record
from ncclwatch.ingest.parse import parse as fast_parse
from ncclwatch.ingest.trainlog import (
    DEFAULT_REGEX,
    MegatronFlops,
    RankMerge,
    ThroughputParser,
    is_iteration_line,
    zone_shift_ns,
)

from ncclwatch.records import (
    PauseRecord,
    Quarantined,
    ThroughputRecord,
    to_json,
)

log = logging.getLogger(__name__)

SPOOL, INSPECTOR = "spool", "inspector"
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
# Names a spool or an Inspector dump is written under; other files in a directory are
# not looked at (a run directory also holds NCCL debug logs, control files, plots).
_CANDIDATE_SUFFIXES = (".jsonl", ".jsonl.gz", ".log", ".log.gz", ".out", ".err", ".txt")
_RUN_DIRS = ("spool", "inspector", "trainlogs")
# How far into a text file an iteration line is looked for: Megatron prints its
# arguments and model set-up first (thousands of lines), and a job's stdout may hold
# NCCL's debug output too.
_TRAINLOG_SCAN_BYTES = 64 << 20
_LINE_BYTES = 64 << 10  # a Megatron iteration line is well under 4 KiB
# Inspector writes per communicator per dump, so its ops reach a file out of time order
# by up to a dump interval: their windows wait this long (in stream time) for stragglers.
INSPECTOR_LATENESS_S = 10.0

# At equal times: windows (and the ops they are made of) first, then telemetry, then
# throughput. A step's throughput and the window ending at the same instant are both
# "now"; the window first means a throughput drop is judged knowing the NCCL anomaly that
# the same window may have just confirmed. Every driver orders ties this way.
MARK_TIME_NS = 1 << 62  # after every record: see record_time_ns
KIND_ORDER = {"op": 0, "window": 0, "pause": 0, "drop": 1, "plugin_stats": 1, "progress": 1, "throughput": 2,
              "anomaly": 3}


def record_time_ns(record: Any) -> int:
    """The stream time a record stands for: when it became true.

    An op counts when it ended, a window at its end, everything else at its timestamp.
    Told by ``KIND``, so the parser's fast structs (same fields) are timed alike.
    """
    kind = record.KIND
    if kind == "op":
        return record.start_ns + record.exec_ns
    if kind == "window":
        return record.end_ns
    if kind == "anomaly":
        return record.detected_ns
    if kind == "key_verdict":
        return record.end_ns
    if kind == "verdict_mark":
        # Progress, not an event: the job stage's VerdictMerge orders by marks. In a
        # time merge a mark must not bound its partition (several key stages' verdicts
        # interleave there, and marks come twice a second), or it would hold the
        # throughput and telemetry of the same partition number back without end.
        return MARK_TIME_NS
    return record.ts_ns


def order_key(record: Any) -> tuple[int, int]:
    """How drivers order records: by stream time, ties by kind (see ``KIND_ORDER``)."""
    return record_time_ns(record), KIND_ORDER.get(record.KIND, 3)


class RecordingError(ValueError):
    """A source that holds nothing ncclwatch can read, or options that do not fit it."""


@dataclass
class ReadStats:
    """What reading a recording met, for the line a command prints about it."""

    lines: int = 0
    records: int = 0
    quarantined: dict[str, int] = field(default_factory=dict)
    partial_lines: int = 0
    files: dict[str, int] = field(default_factory=dict)  # kind -> files read
    skipped: dict[str, int] = field(default_factory=dict)  # lines that are no record, by what
    unrecognised: list[str] = field(default_factory=list)  # files of neither kind
    untimed_throughput: int = 0  # training-log lines without a timestamp (stamped at read)
    trainlog_shift_ns: int = 0  # added to naive training-log times to meet the ops (zone_shift_ns)
    late_throughput: int = 0  # a rank's report of an iteration already merged

    def quarantine(self, q: Quarantined) -> None:
        self.quarantined[q.reason] = self.quarantined.get(q.reason, 0) + 1

    def notes(self) -> list[str]:
        """One line per thing a person should know about what was (not) read."""
        out = []
        if self.quarantined:
            out.append(f"left out {sum(self.quarantined.values())} bad lines: {self.quarantined}")
        if self.skipped:
            out.append(f"skipped lines that carry no op: {self.skipped}")
        if self.unrecognised:
            shown = ", ".join(self.unrecognised[:5])
            more = f" and {len(self.unrecognised) - 5} more" if len(self.unrecognised) > 5 else ""
            out.append(f"not recognised (neither spool records, Inspector JSON nor a training log): {shown}{more}")
        if self.untimed_throughput:
            out.append(
                f"{self.untimed_throughput} training-log line(s) had no timestamp: stamped with the time they were read"
            )
        if self.trainlog_shift_ns:
            h, rest = divmod(abs(self.trainlog_shift_ns) // 60_000_000_000, 60)
            sign = "-" if self.trainlog_shift_ns < 0 else "+"
            out.append(
                f"the training log's timestamps carry no zone and were hours from the ops: moved {sign}{h}:{rest:02d} "
                "onto them (set ingest.trainlog_timezone to the zone they were written in)"
            )
        if self.late_throughput:
            out.append(
                f"{self.late_throughput} per-rank training-log report(s) came after "
                "their iteration was merged (left out)"
            )
        return out


@dataclass(frozen=True)
class Sources:
    """What one recording is made of, once archives are unpacked."""

    spool: tuple[Path, ...] = ()
    inspector: tuple[Path, ...] = ()
    trainlogs: tuple[Path, ...] = ()  # a run directory's trainlogs/
    run_dir: Path | None = None
    job: str = ""  # the run directory's job (run.json / labels.json)


# --- opening -----------------------------------------------------------------------------


def is_archive(path: Path) -> bool:
    return path.is_file() and path.name.endswith(ARCHIVE_SUFFIXES)


@contextmanager
def opened_recording(path: str | Path) -> Iterator[Path]:
    """A recording as a directory or file on disk; ``.tar.gz`` archives are unpacked first."""
    p = Path(path)
    if is_archive(p):
        with tempfile.TemporaryDirectory(prefix="ncclwatch-replay-") as tmp:
            try:
                with tarfile.open(p) as tar:
                    tar.extractall(tmp, filter="data")
            except OSError as e:  # a full disk, most often: say where, and what chooses it
                raise RecordingError(f"{p}: unpacking it into {tmp} failed: {e.strerror or e} "
                                     "(TMPDIR chooses where archives are unpacked)") from e
            yield Path(tmp)
    else:
        yield p


def run_dir_of(root: Path) -> Path | None:
    """``root`` (or its only subdirectory, as an archive of one packs it) when it is laid
    out as a recorded run: ``spool/``, ``inspector/`` or ``trainlogs/`` in it."""
    if not root.is_dir():
        return None
    if any((root / d).is_dir() for d in _RUN_DIRS):
        return root
    subdirs = [p for p in root.iterdir() if p.is_dir()]
    if len(subdirs) == 1 and any((subdirs[0] / d).is_dir() for d in _RUN_DIRS):
        return subdirs[0]
    return None


def _open_bytes(path: Path) -> Any:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")  # noqa: SIM115


def file_kind(path: Path) -> str | None:
    """``spool``, ``inspector`` or None, from the first non-empty line.

    A JSON object with ``header`` and ``metadata`` is Inspector's, one with ``kind`` a
    contract record. A ``*.jsonl`` file is taken for a spool segment whatever its first
    line (an empty one is not written yet; a broken line is quarantined, with its
    reason, like any other); any other file that is neither is not recognised.
    """
    spool_name = path.name.endswith((".jsonl", ".jsonl.gz"))
    try:
        with _open_bytes(path) as f:
            for raw in f:
                raw = raw.strip()
                if not raw:
                    continue
                try:
                    obj = json.loads(raw)
                except ValueError:
                    obj = None
                if isinstance(obj, dict) and "header" in obj and "metadata" in obj:
                    return INSPECTOR
                if spool_name or (isinstance(obj, dict) and "kind" in obj):
                    return SPOOL
                return None
    except (OSError, EOFError):
        return None
    return SPOOL if spool_name else None


def is_training_log(path: Path, limit: int = _TRAINLOG_SCAN_BYTES) -> bool:
    """A text file with a Megatron / NeMo iteration line giving the job's throughput in
    its first ``limit`` bytes (a Slurm ``.out``, a rank's ``.log``, gzipped or not)."""
    try:
        with _open_bytes(path) as f:
            seen = 0
            while seen < limit:
                raw = f.readline(_LINE_BYTES)  # bounded: a text-named binary has no newlines
                if not raw:
                    return False
                if is_iteration_line(raw):
                    return True
                seen += len(raw)
    except (OSError, EOFError, gzip.BadGzipFile):
        return False
    return False


def _candidates(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(_CANDIDATE_SUFFIXES))


def _run_job(run: Path) -> str:
    for name in ("run.json", "labels.json"):
        f = run / name
        if f.is_file():
            try:
                job = json.loads(f.read_text()).get("job")
            except (ValueError, AttributeError):
                continue
            if isinstance(job, str) and job:
                return job
    return ""


def find_sources(root: Path, stats: ReadStats) -> Sources:
    """Sort what ``root`` (a directory or a file, archives already unpacked) holds."""
    run = run_dir_of(root)
    if run is not None:
        # A run directory's control files and NCCL logs are JSON lines and text too:
        # only its spool/ and inspector/ are records.
        dirs = [run / d for d in ("spool", "inspector") if (run / d).is_dir()]
        files = [f for d in dirs for f in _candidates(d)]
        trainlogs = sorted((run / "trainlogs").glob("*.log")) if (run / "trainlogs").is_dir() else []
        # Training logs kept elsewhere in it (a Slurm .out beside the records, say)
        trainlogs += [f for f in _candidates(run)
                      if f.relative_to(run).parts[0] not in _RUN_DIRS and is_training_log(f)]
    else:
        files = [root] if root.is_file() else _candidates(root)
        trainlogs = []
    spool, insp = [], []
    for f in files:
        kind = file_kind(f)
        if kind == SPOOL:
            spool.append(f)
        elif kind == INSPECTOR:
            insp.append(f)
        elif run is None and is_training_log(f):
            trainlogs.append(f)  # a Megatron log in the tree: the job's throughput
        elif f.stat().st_size > 0:
            stats.unrecognised.append(str(f))
    return Sources(tuple(spool), tuple(insp), tuple(trainlogs), run, _run_job(run) if run else "")


# --- reading -----------------------------------------------------------------------------


def _lines_of_file(path: Path, stats: ReadStats) -> Iterator[tuple[bytes, int]]:
    for lines, offset in _line_batches(path, stats):
        for raw in lines:
            yield raw, offset
            offset += len(raw) + 1


def _line_batches(
    path: Path, stats: ReadStats, limit: int | None = None, size: int = 0
) -> Iterator[tuple[list[bytes], int]]:
    """The complete lines of a file (without their newlines), ``size`` bytes read at a
    time (default ``_READ_BYTES``), each batch with the byte offset of its first line;
    only the first ``limit`` bytes with a limit. A last line without its newline is
    counted in ``stats``, not given: the contract says it was still being written."""
    offset, rest, left, size = 0, b"", limit, size or _READ_BYTES
    with _open_bytes(path) as f:
        while left is None or left > 0:
            chunk = f.read(size if left is None else min(size, left))
            if not chunk:
                break
            if left is not None:
                left -= len(chunk)
            lines = (rest + chunk).split(b"\n") if rest else chunk.split(b"\n")
            rest = lines.pop()
            if lines:
                yield lines, offset
                offset += sum(map(len, lines)) + len(lines)
    if rest:
        stats.partial_lines += 1


def iter_recording_lines(path: Path, stats: ReadStats) -> Iterator[tuple[str, bytes, int]]:
    """(source, raw line, byte offset) for every complete line of a spool recording."""
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz")))
    )
    for f in files:
        for raw, offset in _lines_of_file(f, stats):
            stats.lines += 1
            yield str(f), raw, offset


def inspector_job(path: Path) -> str:
    """The job Inspector's default dump directory names (``nccl-inspector-<jobid>``), or "".

    >>> inspector_job(Path("/logs/nccl-inspector-4711/h-pid1.log"))
    '4711'
    >>> inspector_job(Path("/logs/nccl-inspector-unknown-jobid/h-pid1.log"))
    ''
    """
    base = path.parent.name
    if base.startswith("nccl-inspector-") and base != "nccl-inspector-unknown-jobid":
        return base[len("nccl-inspector-") :]
    return ""


@dataclass(frozen=True)
class Options:
    """How to read what the contract does not say: jobs, training-log text and time."""

    training_logs: tuple[str, ...] = ()  # paths or globs, one file per rank
    job: str = ""  # job of Inspector ops and training-log throughput ("": found, see module)
    throughput_regex: str = DEFAULT_REGEX
    timezone: str = "local"  # zone of naive training-log timestamps

    @classmethod
    def from_config(cls, ingest: Any, *, training_logs: Iterable[str] = (), job: str = "") -> Options:
        """From ``config.ingest`` (regex, time zone) and the command line."""
        return cls(tuple(training_logs), job, ingest.throughput_regex or DEFAULT_REGEX, ingest.trainlog_timezone)


def expand_globs(patterns: Iterable[str]) -> list[Path]:
    """Files named by paths or globs, each once, in name order; a pattern matching nothing
    is an error (a typo must not silently leave the job without throughput)."""
    out: dict[str, None] = {}
    for pat in patterns:
        hits = sorted(glob.glob(os.path.expanduser(pat))) if glob.has_magic(pat) else [pat]
        hits = [h for h in hits if os.path.isfile(h)]
        if not hits:
            raise RecordingError(f"training log {pat!r}: no such file")
        out.update(dict.fromkeys(hits))
    return [Path(p) for p in out]


# Megatron prints its arguments before its first iteration; a log with neither in its
# first this many lines has none (scanning on would read every rank's log twice)
_ARGUMENT_LINES = 100_000


def read_training_logs(
    paths: Iterable[Path], *, job: str, options: Options, stats: ReadStats, host: str = "",
    ops_span: tuple[int, int] | None = None,
) -> list[ThroughputRecord | PauseRecord]:
    """One job throughput series from per-rank logs (:class:`RankMerge`, read whole),
    with the job's pauses (checkpoint saves) among its steps.

    With ``ops_span`` (the first and last time of the recording's ops) and the default
    zone (``local``: the reader's, a guess when replaying), naive timestamps that land
    hours from the ops are moved by the zone offset that lays them over them
    (:func:`~ncclwatch.ingest.trainlog.zone_shift_ns`; ``stats.trainlog_shift_ns``).
    """
    merge = RankMerge(hold_s=None)  # the files are whole: every rank's report is there
    megatron = MegatronFlops()  # the arguments rank 0 printed serve every rank's log
    paths = list(paths)
    # read them first, whichever log has them: they head it (only the default pattern
    # falls back to computing TFLOP/s from them)
    for path in paths if options.throughput_regex == DEFAULT_REGEX else ():
        with _open_bytes(path) as f:
            for _, raw in zip(range(_ARGUMENT_LINES), f, strict=False):
                if megatron.complete or is_iteration_line(raw):
                    break  # the arguments come before training starts
                megatron.read(raw.decode("utf-8", errors="replace"))
    read_ns = time.time_ns()
    naive_only = True
    for path in paths:
        parser = ThroughputParser(
            job=job, host=host or path.stem, regex=options.throughput_regex, timezone=options.timezone,
            megatron=megatron,
        )
        with _open_bytes(path) as f:
            for raw in f:
                rec = parser.parse(raw.decode("utf-8", errors="replace"), read_ns)
                if rec is not None:
                    merge.add(str(path), rec)
        stats.untimed_throughput += parser.untimed
        naive_only &= parser.clock.aware == 0 and parser.untimed == 0
        stats.files["training_log"] = stats.files.get("training_log", 0) + 1
    out = merge.flush()
    stats.late_throughput += merge.late
    if ops_span is not None and out and naive_only and options.timezone == "local":
        shift = zone_shift_ns((min(r.ts_ns for r in out), max(r.ts_ns for r in out)), ops_span)
        if shift:
            stats.trainlog_shift_ns = shift
            out = [replace(r, ts_ns=r.ts_ns + shift) for r in out]
    return out


def iter_records(
    paths: Iterable[str | Path], stats: ReadStats, options: Options | None = None
) -> Iterator[tuple[str, int, bytes, Any]]:
    """(source, offset, raw, record) for every valid record of the recordings, in file order.

    ``raw`` is the line as written for spool records and the contract JSON of the
    record for what was mapped (Inspector ops, training-log throughput). Bad lines are
    counted in ``stats`` and left out. Spool records may come as the fast parser's
    structs (:func:`ncclwatch.ingest.parse.parse`: same fields and ``KIND``, half the
    cost); :func:`~ncclwatch.ingest.parse.to_record` makes them contract dataclasses.
    """
    with ExitStack() as stack:
        yield from _records_of(_open_sources(paths, stats, stack), stats, options)


def _open_sources(paths: Iterable[str | Path], stats: ReadStats, stack: ExitStack) -> list[tuple[Path, Sources]]:
    """What each recording holds, archives unpacked for as long as ``stack`` is open."""
    paths = [Path(p) for p in paths]
    for p in paths:
        if not p.exists():
            raise RecordingError(f"{p}: no such file or directory")
    found = [(p, find_sources(stack.enter_context(opened_recording(p)), stats)) for p in paths]
    for p, src in found:
        if not (src.spool or src.inspector or src.trainlogs):
            raise RecordingError(_nothing_found(p, stats))
    return found


def _records_of(
    found: list[tuple[Path, Sources]],
    stats: ReadStats,
    options: Options | None,
    on_spool_file: Callable[[Path | None], None] | None = None,
    first_look: bool = False,
) -> Iterator[tuple[str, int, bytes, Any]]:
    """:func:`iter_records` of opened recordings. ``on_spool_file`` is told of each spool
    file before its records, and (with None) when the records that are no spool lines
    begin. With ``first_look`` a spool line that holds an op's version, job and time is
    given as :func:`~ncclwatch.ingest.parse.op_time`'s result, not validated (its
    reader parses it whole when it needs it); every other line is parsed as without."""
    options = options or Options()
    spool_jobs: set[str] = set()
    has_throughput = False
    # The recording's time, from each file's first and last record (about in time
    # order within a file): where its training logs' steps must land.
    span: tuple[int, int] | None = None
    first = last = None
    for _, src in found:
        for f in src.spool:
            stats.files[SPOOL] = stats.files.get(SPOOL, 0) + 1
            if on_spool_file is not None:
                on_spool_file(f)
            source = str(f)  # iter_recording_lines, a batch of lines at a time
            for lines, offset in _line_batches(f, stats):
                stats.lines += len(lines)
                for raw in lines:
                    rec = (first_look and op_time(raw)) or fast_parse(raw, source, offset)
                    if type(rec) is Quarantined:
                        stats.quarantine(rec)
                    else:
                        spool_jobs.add(getattr(rec, "job", ""))
                        has_throughput |= rec.KIND == "throughput"
                        yield source, offset, raw, rec
                        if first is None:
                            first = rec
                        last = rec
                    offset += len(raw) + 1
            span = _widen(span, first, last)
            first = last = None
    if on_spool_file is not None:
        on_spool_file(None)
    jobs = set(spool_jobs)  # the jobs the training logs may be of
    for _, src in found:
        for f in src.inspector:
            stats.files[INSPECTOR] = stats.files.get(INSPECTOR, 0) + 1
            job = options.job or src.job or inspector_job(f) or _only(spool_jobs) or "unknown"
            jobs.add(job)
            for item in _inspector_records(f, job, stats):
                yield item
                if first is None:
                    first = item[3]
                last = item[3]
            span = _widen(span, first, last)
            first = last = None
    logs = expand_globs(options.training_logs)
    if not logs and not has_throughput:
        # a run directory's per-rank logs, when the job did not report its throughput
        # through the API (then the spool has it, and a second series would disagree)
        logs = [f for _, src in found for f in src.trainlogs]
    if logs:
        job = options.job or next((s.job for _, s in found if s.job), "") or _only(jobs)
        if not job and len(jobs) > 1:
            raise RecordingError(
                f"the recording holds jobs {sorted(jobs)}: give --job to say which one the training logs are of"
            )
        for i, rec in enumerate(read_training_logs(logs, job=job or "unknown", options=options, stats=stats,
                                                   ops_span=span)):
            yield str(logs[0]), i, to_json(rec).encode(), rec


def _widen(span: tuple[int, int] | None, first: Any, last: Any) -> tuple[int, int] | None:
    if first is None:
        return span
    a, b = sorted((record_time_ns(first), record_time_ns(last)))
    return (a, b) if span is None else (min(span[0], a), max(span[1], b))


def _only(jobs: set[str]) -> str:
    return next(iter(jobs)) if len(jobs) == 1 else ""


def _inspector_records(path: Path, job: str, stats: ReadStats) -> Iterator[tuple[str, int, bytes, Any]]:
    source = str(path)
    for raw, offset in _lines_of_file(path, stats):
        stats.lines += 1
        if not raw.strip():
            continue
        try:
            rec = op_from_inspector(raw, job=job)
        except NotAnOp as e:
            stats.skipped[e.what] = stats.skipped.get(e.what, 0) + 1
            continue
        except InspectorError as e:
            stage = "parse" if e.reason in ("not_json", "not_utf8") else "schema"
            stats.quarantine(quarantine(e, raw, source, offset, stage))
            continue
        yield source, offset, to_json(rec).encode(), rec


def _nothing_found(path: Path, stats: ReadStats) -> str:
    text = f"{path}: no plugin spool (*.jsonl records) or NCCL Inspector JSON logs found"
    if stats.unrecognised:
        shown = ", ".join(stats.unrecognised[:5])
        text += f"; not recognised: {shown}"
        if path.is_file():
            text += " (a training log? give it with --training-log)"
    return text


# How many records a sort holds in memory, and how many sorted runs it merges at once
# (ingest/external_sort.py): replaying 10 M records needs no more memory than 50 k.
SORT_RUN_RECORDS = external_sort.RUN_RECORDS
MAX_OPEN_RUNS = external_sort.MAX_OPEN_RUNS


class SortedRecording:
    """Every valid record of one or more recordings, in stream time, in bounded memory.

    Within one file records are roughly in time order already; across files (one per
    process) they interleave, and Inspector writes per communicator per dump, so they
    are merged by time as a live run would have seen them: by :func:`order_key`, records
    of equal key in the order they were read (:func:`iter_records`).

    Entering reads the recording through once (``total``, ``first_ns`` and ``last_ns``
    are known then); iterating gives ``(source, offset, raw, record)`` once.

    A plugin spool file is written in about completion order, so most of it need not be
    sorted at all: its records that come in order (none earlier than one before it in
    the file) are read from the file a second time while iterating and merged with
    the other files', and only the rest (the few written late, and all records that
    are no spool lines: Inspector's, training logs') go through a sort. That sort holds
    up to ``run_records`` records in memory; beyond that sorted runs go to a temporary
    directory and are merged from there (:class:`ExternalSort`), so memory stays flat
    whatever the length. ``stream=False`` sorts everything (what was done before; the
    tests hold both to the same order). ``keep`` leaves records out before they are
    counted or held. Without ``keep`` the first pass only looks at a spool op line's
    version, job and time (:func:`~ncclwatch.ingest.parse.op_time`, ~40 % of a parse)
    unless it goes to the sort; a line that looked right but that the second pass
    refuses (a bad field besides those) is taken off ``total``, ``kinds`` and
    ``stats.records`` then, counted in ``refused_late`` and quarantined in ``stats``.
    Records are contract dataclasses; with ``fast`` they may be the
    fast parser's structs (for what only routes or copies them: no dataclass to build,
    half the parse).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> lines = [to_json(ThroughputRecord(job="j", host="h", rank=0, ts_ns=t, step=t,
    ...          tflops_per_gpu=1.0, tokens_per_s=None, source="api")) for t in (3, 1, 2, 5, 4)]
    >>> _ = (d / "a.jsonl").write_text("\\n".join(lines) + "\\n")
    >>> with SortedRecording([d], ReadStats(), run_records=2) as rec:
    ...     (rec.total, rec.sorted_records, [r.ts_ns for _, _, _, r in rec])
    (5, 3, [1, 2, 3, 4, 5])
    """

    def __init__(
        self,
        paths: Iterable[str | Path],
        stats: ReadStats | None = None,
        options: Options | None = None,
        *,
        keep: Callable[[Any], bool] | None = None,
        run_records: int | None = None,
        fast: bool = False,
        stream: bool = True,
    ) -> None:
        self.paths = list(paths)
        self.stats = stats if stats is not None else ReadStats()
        self.options = options
        self.keep = keep
        self.fast = fast
        self.stream = stream
        # Streamed spool lines are only looked at in the first pass (op_time) and parsed
        # whole in the second; ``keep`` must see whole records, so it reads them whole.
        self._first_look = stream and keep is None
        self.total = 0
        self.first_ns: int | None = None
        self.last_ns: int | None = None
        self.kinds: Counter[str] = Counter()  # records by kind
        # lines counted above that iterating found bad (then taken off the counts)
        self.refused_late = 0
        self._sources: list[str] = []
        self._files: list[_SpoolFile] = []  # the spool files read again while iterating
        self._stack = ExitStack()  # archives stay unpacked until the recording is closed
        # Key: stream time (shifted to be positive: 20 digits), then kind (1 digit); equal
        # keys keep the order added, which is the order read.
        self._sort = ExternalSort((20, 1), encode=_encode_entry, decode=_decode_entry,
                                  run_records=run_records or SORT_RUN_RECORDS,
                                  max_open_runs=MAX_OPEN_RUNS)
        self._stack.callback(self._sort.close)

    @property
    def runs(self) -> int:
        """Sorted runs spilled to disk (0: sorted in memory)."""
        return self._sort.runs

    @property
    def sorted_records(self) -> int:
        """Records that went through the sort (the rest stream from their files)."""
        return self._sort.total

    @property
    def spill_dir(self) -> Path | None:
        """The temporary directory of the spilled runs (None: sorted in memory)."""
        return self._sort.directory

    def __enter__(self) -> SortedRecording:
        try:
            self._read()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _read(self) -> None:
        index: dict[str, int] = {}
        add = self._sort.add
        keep = self.keep
        current: list[_SpoolFile | None] = [None]

        def on_spool_file(path: Path | None) -> None:
            current[0] = None
            if path is not None and self.stream:
                current[0] = _SpoolFile(path)
                self._files.append(current[0])

        kinds: dict[str, int] = {}
        first = last = None
        seq = 0  # the order read: what orders records of equal time
        last_source, src, f = None, 0, None
        found = _open_sources(self.paths, self.stats, self._stack)
        stats = self.stats
        for source, offset, raw, rec in _records_of(found, stats, self.options, on_spool_file, self._first_look):
            if keep is not None and not keep(rec):
                continue
            kind_name = rec.KIND
            if kind_name == "op":  # order_key, inlined for the common case
                t, kind = rec.start_ns + rec.exec_ns, 0
            else:
                t, kind = order_key(rec)
            if source is not last_source:  # a new file (or a record of no file)
                last_source, f = source, current[0]
                src = index.get(source)  # type: ignore[assignment]
                if src is None:
                    src = index[source] = len(self._sources)
                    self._sources.append(source)
            key = (((t << 2) | kind) << _SEQ_BITS) | seq  # _merge_key, inlined
            if f is not None and key > f.last_key:  # in order: read from its file again
                if f.first_key is None:
                    f.first_key, f.first_seq, f.src = key, seq, src
                f.last_key = key
                f.end = offset + len(raw) + 1
            else:
                if type(rec) is OpTime:  # only looked at so far: the sort holds records
                    rec = fast_parse(raw, source, offset)
                    if type(rec) is Quarantined:
                        stats.quarantine(rec)
                        continue
                add((t + _T_SHIFT, kind), (seq, src, offset, raw, rec))
            if first is None:
                first = last = t
            elif t < first:
                first = t
            elif t > last:
                last = t
            seq += 1
            kinds[kind_name] = kinds.get(kind_name, 0) + 1
        self.first_ns, self.last_ns = first, last
        self.kinds.update(kinds)
        self.total = seq
        self.stats.records = self.total
        self._files = [f for f in self._files if f.first_key is not None]

    def __iter__(self) -> Iterator[tuple[str, int, bytes, Any]]:
        convert = _same if self.fast else to_record
        sources = self._sources
        for _, src, offset, raw, rec in self._merged():
            yield sources[src], offset, raw, convert(rec)

    def records(self) -> Iterator[Any]:
        """The records alone, in the same order (for what needs no source, offset or line)."""
        if self.fast:
            for item in self._merged():
                yield item[4]
        else:
            for item in self._merged():
                yield to_record(item[4])

    def _merged(self) -> Iterator[tuple[int, int, int, bytes, Any]]:
        """``(merge key, source index, offset, raw, record)`` in merge-key order: the sort's
        output and each streamed file's, merged a batch at a time.

        Each input is in key order, and every key an input has yet to give is above its
        *bound* (the last key it gave; for a file not opened yet, just below its first
        key, known from the first pass). So whatever is held at or below the smallest
        bound can go: one C sort of what is held (runs already in order) per batch read.
        """
        inputs: list[tuple[int, int, Iterator[list]]] = []  # (bound, number, batches)
        if self._sort.total:
            inputs.append((-(1 << 200), 0, self._sorted_batches()))
        for i, f in enumerate(self._files, 1):
            assert f.first_key is not None
            inputs.append((f.first_key - 1, i, self._file_batches(f)))
        heapq.heapify(inputs)
        held: list[tuple] = []
        while inputs:
            _, i, batches = inputs[0]
            batch = next(batches, None)
            if batch is None:
                heapq.heappop(inputs)
            else:
                held += batch
                heapq.heapreplace(inputs, (batch[-1][0], i, batches))
            if not inputs:
                break
            held.sort()
            cut = bisect.bisect_left(held, (inputs[0][0] + 1,))
            if cut:
                yield from held[:cut]
                del held[:cut]
        held.sort()
        yield from held

    def _sorted_batches(self) -> Iterator[list]:
        parse = fast_parse
        sources = self._sources
        batch: list = []
        for seq, src, offset, raw, rec in self._sort:
            if rec is None:  # read back from disk: parse it again
                rec = parse(raw, source=sources[src], offset=offset)
                if type(rec) is Quarantined:  # it parsed once: the spill file was damaged
                    self.stats.quarantine(rec)
                    continue
            t, kind = order_key(rec)
            batch.append((_merge_key(t, kind, seq), src, offset, raw, rec))
            if len(batch) >= _MERGE_BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    def _file_batches(self, f: _SpoolFile) -> Iterator[list]:
        """The records of ``f`` that were in order, read and parsed again, a batch at a time.

        Only the bytes the first pass read are read (a file still being written has more
        by now), and the same records are left out the same way: bad lines (counted
        then), those ``keep`` refuses, and those out of order (in the sort).
        """
        parse, keep, src, looked = fast_parse, self.keep, f.src, self._first_look
        seq, last = f.first_seq, f.first_key - 1
        kind_order = KIND_ORDER
        # counted in the first pass; read in smaller pieces when many files are merged
        size = max(_MIN_READ_BYTES, min(_READ_BYTES, _HELD_BYTES // len(self._files)))
        for lines, offset in _line_batches(f.path, ReadStats(), f.end, size):
            batch = []
            for raw in lines:
                rec = parse(raw)
                at = offset
                offset += len(raw) + 1
                if type(rec) is Quarantined:
                    if looked and (op := op_time(raw)) is not None:
                        key = (((op.start_ns + op.exec_ns) << 2) << _SEQ_BITS) | seq
                        if key > last:  # counted as a record by the first look: it was not
                            seq += 1
                            last = key
                            self._refused(rec)
                    continue
                if keep is not None and not keep(rec):
                    continue
                kind = rec.KIND
                if kind == "op":  # order_key, inlined for the common case
                    key = (((rec.start_ns + rec.exec_ns) << 2) << _SEQ_BITS) | seq
                else:
                    key = _merge_key(record_time_ns(rec), kind_order.get(kind, 3), seq)
                seq += 1
                if key > last:
                    last = key
                    batch.append((key, src, at, raw, rec))
            if batch:
                yield batch

    def late_note(self) -> str | None:
        """What reading the records found that ``stats.notes()`` before it could not say."""
        if not self.refused_late:
            return None
        q = self.stats.quarantined
        return (f"{self.refused_late} more bad lines found while reading the records: "
                f"left out {sum(q.values())} bad lines in all: {q}")

    def _refused(self, q: Quarantined) -> None:
        """A line the first pass counted from a first look and the second refused."""
        self.stats.quarantine(q)
        self.total -= 1
        self.stats.records -= 1
        self.kinds["op"] -= 1
        self.refused_late += 1


@dataclass
class _SpoolFile:
    """What the first pass learnt of one spool file, to stream it again."""

    path: Path
    src: int = 0  # index of its source name
    first_key: int | None = None  # merge key of its first record in order
    first_seq: int = 0  # read order of its first kept record
    last_key: int = -(1 << 200)
    end: int = 0  # the byte after the last record kept


_T_SHIFT = 1 << 63  # record times may be negative; sort keys may not
_SEQ_BITS = 40  # records of a recording, in read order: up to 10^12
_MERGE_BATCH = 2048  # records the sort gives the merge at a time
_READ_BYTES = 256 << 10  # a file is read this much at a time (~600 op records)
# The merge holds about one read of every streamed file: so much at most, in all (about a
# hundred thousand records, as much as the sort holds), however many files there are.
_HELD_BYTES = 32 << 20
_MIN_READ_BYTES = 16 << 10


def _merge_key(t: int, kind: int, seq: int) -> int:
    """Stream time, then kind (0–3), then read order, as one integer: what the merge
    compares (an integer compares faster than a tuple).

    >>> _merge_key(5, 1, 7) < _merge_key(5, 2, 0) < _merge_key(6, 0, 0)
    True
    >>> _merge_key(-5, 3, 2**40 - 1) < _merge_key(-4, 0, 0)
    True
    """
    return (((t << 2) | kind) << _SEQ_BITS) | seq


def _encode_entry(e: tuple[int, int, int, bytes, Any]) -> bytes:
    return b"%d %d %d %b" % (e[0], e[1], e[2], e[3])


def _decode_entry(line: bytes) -> tuple[int, int, int, bytes, None]:
    seq, src, offset, raw = line.split(b" ", 3)
    return int(seq), int(src), int(offset), raw, None


def _same(rec: Any) -> Any:
    return rec


def read_recording(
    paths: Iterable[str | Path], stats: ReadStats | None = None, options: Options | None = None
) -> list[Any]:
    """Every valid record of one or more recordings, sorted by stream time, as a list
    (:class:`SortedRecording` streams them in bounded memory)."""
    with SortedRecording(paths, stats, options) as rec:
        return [r for _, _, _, r in rec]


def add_source_arguments(p: argparse.ArgumentParser, *, job: bool = True) -> None:
    """What ``forward`` reads besides the spool, for every command that detects
    (``job=False``: the command has a ``--job`` of its own)."""
    p.add_argument(
        "--training-log",
        action="append",
        default=[],
        metavar="FILE|GLOB",
        help="training log to read the job's throughput from, one file per rank; repeatable, "
        "each a path or a quoted glob ('logs/*.log'); the ranks' logs become one series",
    )
    if not job:
        return
    p.add_argument(
        "--job",
        default="",
        help="job id of Inspector ops and training-log throughput (they carry none); default: "
        "the run's run.json/labels.json, the Inspector directory name nccl-inspector-<jobid>, "
        "the spool's only job, else 'unknown'",
    )
