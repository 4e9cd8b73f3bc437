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
Files that are neither are listed in :attr:`ReadStats.unrecognised`, and a source
holding nothing recognisable is a :class:`RecordingError` that says what it found.

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
import glob
import gzip
import json
import logging
import os
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncclwatch.ingest import external_sort
from ncclwatch.ingest.external_sort import ExternalSort
from ncclwatch.ingest.inspector import InspectorError, NotAnOp, op_from_inspector, quarantine
from ncclwatch.ingest.parse import parse as fast_parse
from ncclwatch.ingest.parse import parse_record, to_record
from ncclwatch.ingest.trainlog import DEFAULT_REGEX, RankMerge, ThroughputParser

from ncclwatch.records import (
    Quarantined,
    ThroughputRecord,
    to_json,
)

log = logging.getLogger(__name__)

SPOOL, INSPECTOR = "spool", "inspector"
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
# Names a spool or an Inspector dump is written under; other files in a directory are
# not looked at (a run directory also holds NCCL debug logs, control files, plots).
_CANDIDATE_SUFFIXES = (".jsonl", ".jsonl.gz", ".log", ".log.gz")
_RUN_DIRS = ("spool", "inspector", "trainlogs")
# Inspector writes per communicator per dump, so its ops reach a file out of time order
# by up to a dump interval: their windows wait this long (in stream time) for stragglers.
INSPECTOR_LATENESS_S = 10.0

# At equal times: windows (and the ops they are made of) first, then telemetry, then
# throughput. A step's throughput and the window ending at the same instant are both
# "now"; the window first means a throughput drop is judged knowing the NCCL anomaly that
# the same window may have just confirmed. Every driver orders ties this way.
MARK_TIME_NS = 1 << 62  # after every record: see record_time_ns
KIND_ORDER = {"op": 0, "window": 0, "drop": 1, "plugin_stats": 1, "throughput": 2, "anomaly": 3}


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
            out.append(f"not recognised (neither spool records nor Inspector JSON): {shown}{more}")
        if self.untimed_throughput:
            out.append(
                f"{self.untimed_throughput} training-log line(s) had no timestamp: stamped with the time they were read"
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
        trainlogs = tuple(sorted((run / "trainlogs").glob("*.log"))) if (run / "trainlogs").is_dir() else ()
    else:
        files = [root] if root.is_file() else _candidates(root)
        trainlogs = ()
    spool, insp = [], []
    for f in files:
        kind = file_kind(f)
        if kind == SPOOL:
            spool.append(f)
        elif kind == INSPECTOR:
            insp.append(f)
        elif f.stat().st_size > 0:
            stats.unrecognised.append(str(f))
    return Sources(tuple(spool), tuple(insp), trainlogs, run, _run_job(run) if run else "")


# --- reading -----------------------------------------------------------------------------


def _lines_of_file(path: Path, stats: ReadStats) -> Iterator[tuple[bytes, int]]:
    offset = 0
    with _open_bytes(path) as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                # the contract: a line without its newline was still being written
                stats.partial_lines += 1
                break
            yield raw[:-1], offset
            offset += len(raw)


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


def read_training_logs(
    paths: Iterable[Path], *, job: str, options: Options, stats: ReadStats, host: str = ""
) -> list[ThroughputRecord]:
    """One job throughput series from per-rank logs (:class:`RankMerge`, read whole)."""
    merge = RankMerge(hold_s=None)  # the files are whole: every rank's report is there
    read_ns = time.time_ns()
    for path in paths:
        parser = ThroughputParser(
            job=job, host=host or path.stem, regex=options.throughput_regex, timezone=options.timezone
        )
        with _open_bytes(path) as f:
            for raw in f:
                rec = parser.parse(raw.decode("utf-8", errors="replace"), read_ns)
                if rec is not None:
                    merge.add(str(path), rec)
        stats.untimed_throughput += parser.untimed
        stats.files["training_log"] = stats.files.get("training_log", 0) + 1
    out = merge.flush()
    stats.late_throughput += merge.late
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
    options = options or Options()
    paths = [Path(p) for p in paths]
    for p in paths:
        if not p.exists():
            raise RecordingError(f"{p}: no such file or directory")
    with ExitStack() as stack:
        found = [(p, find_sources(stack.enter_context(opened_recording(p)), stats)) for p in paths]
        for p, src in found:
            if not (src.spool or src.inspector or src.trainlogs):
                raise RecordingError(_nothing_found(p, stats))
        spool_jobs: set[str] = set()
        has_throughput = False
        for _, src in found:
            for f in src.spool:
                stats.files[SPOOL] = stats.files.get(SPOOL, 0) + 1
                for source, raw, offset in iter_recording_lines(f, stats):
                    rec = fast_parse(raw, source=source, offset=offset)
                    if type(rec) is Quarantined:
                        stats.quarantine(rec)
                        continue
                    spool_jobs.add(getattr(rec, "job", ""))
                    has_throughput |= rec.KIND == "throughput"
                    yield source, offset, raw, rec
        jobs = set(spool_jobs)  # the jobs the training logs may be of
        for _, src in found:
            for f in src.inspector:
                stats.files[INSPECTOR] = stats.files.get(INSPECTOR, 0) + 1
                job = options.job or src.job or inspector_job(f) or _only(spool_jobs) or "unknown"
                jobs.add(job)
                yield from _inspector_records(f, job, stats)
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
            for i, rec in enumerate(read_training_logs(logs, job=job or "unknown", options=options, stats=stats)):
                yield str(logs[0]), i, to_json(rec).encode(), rec


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
    are known then); iterating gives ``(source, offset, raw, record)`` once. Up to
    ``run_records`` records are sorted in memory; beyond that sorted runs go to a
    temporary directory and are merged from there (:class:`ExternalSort`), so memory
    stays flat whatever the length. ``keep`` leaves records out before they are counted
    or held. Records are contract dataclasses; with ``fast`` they may be the fast
    parser's structs (for what only routes or copies them: no dataclass to build, half
    the parse).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> lines = [to_json(ThroughputRecord(job="j", host="h", rank=0, ts_ns=t, step=t,
    ...          tflops_per_gpu=1.0, tokens_per_s=None, source="api")) for t in (3, 1, 2, 5, 4)]
    >>> _ = (d / "a.jsonl").write_text("\\n".join(lines) + "\\n")
    >>> with SortedRecording([d], ReadStats(), run_records=2) as rec:
    ...     (rec.total, rec.runs, [r.ts_ns for _, _, _, r in rec])
    (5, 2, [1, 2, 3, 4, 5])
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
    ) -> None:
        self.paths = list(paths)
        self.stats = stats if stats is not None else ReadStats()
        self.options = options
        self.keep = keep
        self.fast = fast
        self.total = 0
        self.first_ns: int | None = None
        self.last_ns: int | None = None
        self.kinds: Counter[str] = Counter()  # records by kind
        self._sources: list[str] = []
        # Key: stream time (shifted to be positive: 20 digits), then kind (1 digit).
        self._sort = ExternalSort((20, 1), encode=_encode_entry, decode=_decode_entry,
                                  run_records=run_records or SORT_RUN_RECORDS,
                                  max_open_runs=MAX_OPEN_RUNS)

    @property
    def runs(self) -> int:
        """Sorted runs spilled to disk (0: sorted in memory)."""
        return self._sort.runs

    @property
    def spill_dir(self) -> Path | None:
        """The temporary directory of the spilled runs (None: sorted in memory)."""
        return self._sort.directory

    def __enter__(self) -> SortedRecording:
        try:
            self._read()
        except BaseException:
            self._sort.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._sort.close()

    def _read(self) -> None:
        index: dict[str, int] = {}
        add = self._sort.add
        for source, offset, raw, rec in iter_records(self.paths, self.stats, self.options):
            if self.keep is not None and not self.keep(rec):
                continue
            t, kind = order_key(rec)
            if self.first_ns is None or t < self.first_ns:
                self.first_ns = t
            if self.last_ns is None or t > self.last_ns:
                self.last_ns = t
            src = index.get(source)
            if src is None:
                src = index[source] = len(self._sources)
                self._sources.append(source)
            add((t + _T_SHIFT, kind), (src, offset, raw, rec))
            self.kinds[rec.KIND] += 1
        self.total = self._sort.total
        self.stats.records = self.total

    def __iter__(self) -> Iterator[tuple[str, int, bytes, Any]]:
        convert = _same if self.fast else to_record
        parse = fast_parse if self.fast else parse_record
        sources = self._sources
        for src, offset, raw, rec in self._sort:
            source = sources[src]
            if rec is None:  # read back from disk: parse it again
                rec = parse(raw, source=source, offset=offset)
                if type(rec) is Quarantined:  # it parsed once: the spill file was damaged
                    self.stats.quarantine(rec)
                    continue
                yield source, offset, raw, rec
            else:
                yield source, offset, raw, convert(rec)


_T_SHIFT = 1 << 63  # record times may be negative; sort keys may not


def _encode_entry(e: tuple[int, int, bytes, Any]) -> bytes:
    return b"%d %d %b" % (e[0], e[1], e[2])


def _decode_entry(line: bytes) -> tuple[int, int, bytes, None]:
    src, offset, raw = line.split(b" ", 2)
    return int(src), int(offset), raw, None


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
