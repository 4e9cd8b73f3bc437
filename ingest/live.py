"""Live sources without Kafka: what ``ncclwatch watch`` tails on one machine.

The same three sources as the forwarder (``ncclwatch forward``), mapped by the same
code: the plugin's spool (:class:`~ncclwatch.ingest.spool.SpoolTailer`, lines parsed by
the contract), NCCL Inspector JSON logs (``<dir>/*.log``,
:func:`~ncclwatch.ingest.inspector.op_from_inspector`) and training logs (one file per
rank, globs re-expanded at every poll so ranks that start late are found;
:class:`~ncclwatch.ingest.trainlog.RankLogs`: a parser per log, the lines' own time,
one job series).

:meth:`LiveSources.poll` gives ``(key, line, record)``: ``key`` names the input the
caller's time merge orders (a file; all training logs together are one input, since
their merged series is one), ``record`` may be a :class:`~ncclwatch.records.Quarantined`.
"""

from __future__ import annotations

import glob
import os
import socket
import time
from pathlib import Path
from typing import Any

from ncclwatch.ingest.inspector import InspectorError, NotAnOp, op_from_inspector, quarantine
from ncclwatch.ingest.parse import parse_record
from ncclwatch.ingest.recording import Options, inspector_job
from ncclwatch.ingest.spool import FileTailer, Line, SpoolTailer, Tailer
from ncclwatch.ingest.throughput import job_id
from ncclwatch.ingest.trainlog import RankLogs

TRAINLOG_KEY = "training-log"


class LiveSources:
    """Tailers for a spool, Inspector dump directories and training logs.

    Parameters
    ----------
    spool
        The plugin's spool directory, or None.
    inspector_dirs
        NCCL Inspector dump directories (JSON mode, ``*.log``).
    training_logs
        Training logs, paths or globs, one file per rank.
    options
        Job, throughput regex and time zone (:class:`~ncclwatch.ingest.recording.Options`).
    """

    def __init__(self, spool: str | None, inspector_dirs: list[str], training_logs: list[str], options: Options):
        self.spool = spool
        self.inspector_dirs = list(inspector_dirs)
        self.training_logs = list(training_logs)
        self.options = options
        self.tailers: list[tuple[str, Tailer]] = []
        if spool is not None:
            self.tailers.append(("spool", SpoolTailer(spool)))
        if inspector_dirs:
            self.tailers.append(("inspector", FileTailer([os.path.join(d, "*.log") for d in inspector_dirs])))
        if training_logs:
            self.tailers.append(("training_log", FileTailer([os.path.expanduser(p) for p in training_logs])))
        self.host = socket.gethostname()
        # Live, a job id can come from the environment, as the forwarder takes it; the
        # training logs are of the job Inspector's directory names, when it names one.
        named = {inspector_job(Path(d, "x.log")) for d in inspector_dirs} - {""}
        self.job = options.job or (next(iter(named)) if len(named) == 1 else "") or job_id()
        self.logs = RankLogs(job=self.job, host=self.host, regex=options.throughput_regex,
                             timezone=options.timezone)
        self._inspector_jobs: dict[str, str] = {}
        self.skipped: dict[str, int] = {}

    def prom_files(self) -> dict[str, int]:
        """NCCL Inspector Prometheus files (``*.prom``) in the watched directories or one
        level below, per directory: local mode does not read them (see ``watch``)."""
        found: dict[str, int] = {}
        for d in ([self.spool] if self.spool else []) + self.inspector_dirs:
            for pattern in ("*.prom", "*/*.prom"):
                for path in glob.glob(os.path.join(glob.escape(d), pattern)):
                    parent = os.path.dirname(path)
                    found[parent] = found.get(parent, 0) + 1
        return found

    def describe(self) -> str:
        parts = [self.spool] if self.spool else []
        parts += [f"Inspector {d}" for d in self.inspector_dirs]
        parts += [f"training log {p}" for p in self.training_logs]
        return ", ".join(parts)

    def resume(self, positions: dict[str, int]) -> None:
        """Start each file where a saved state left it."""
        for _, tailer in self.tailers:
            for path in (p for stream in tailer.discover() for p in stream):
                if path in positions:
                    tailer.positions[path] = positions[path]

    def positions(self) -> dict[str, int]:
        """Training logs as read: their records are merged, so no single line is "done"."""
        out: dict[str, int] = {}
        for name, tailer in self.tailers:
            if name == "training_log":
                out.update(tailer.positions)
        return out

    def poll(self, max_lines: int) -> list[tuple[str, Line, Any]]:
        out: list[tuple[str, Line, Any]] = []
        last_log_line = Line(TRAINLOG_KEY, 0, 0, b"")
        for name, tailer in self.tailers:
            for line in tailer.poll(max_lines):
                if name == "spool":
                    out.append((line.source, line, parse_record(line.raw, source=line.source, offset=line.offset)))
                elif name == "inspector":
                    rec = self._inspector(line)
                    if rec is not None:
                        out.append((line.source, line, rec))
                else:
                    self.logs.add(line.raw, line.source, time.time_ns())
                    last_log_line = line
            if name == "training_log":
                # after every file's new lines: an iteration is complete when all ranks logged it
                out += [(TRAINLOG_KEY, last_log_line, r) for r in self.logs.merge.release()]
        return out

    def behind(self) -> list[tuple[str, bool]]:
        """Per input of the time merge: whether it has bytes not read yet."""
        out = []
        for name, tailer in self.tailers:
            behind_any = False
            for path in (p for stream in tailer.discover() for p in stream):
                size = tailer.sizes.get(path)
                if size is None:
                    try:
                        size = os.stat(path).st_size
                    except FileNotFoundError:
                        continue
                behind = size > tailer.positions.get(path, 0)
                if name == "training_log":
                    behind_any |= behind
                else:
                    out.append((path, behind))
            if name == "training_log":
                out.append((TRAINLOG_KEY, behind_any))
        return out

    def flush(self) -> list[tuple[str, Line, Any]]:
        """End of input: the iterations the training-log merge still holds."""
        return [(TRAINLOG_KEY, Line(TRAINLOG_KEY, 0, 0, b""), r) for r in self.logs.merge.flush()]

    def close(self) -> None:
        for _, tailer in self.tailers:
            tailer.close()

    def _inspector(self, line: Line) -> Any:
        job = self._inspector_jobs.get(line.source)
        if job is None:
            job = self.options.job or inspector_job(Path(line.source)) or self.job
            self._inspector_jobs[line.source] = job
        try:
            return op_from_inspector(line.raw, job=job)
        except NotAnOp as e:
            self.skipped[e.what] = self.skipped.get(e.what, 0) + 1
            return None
        except InspectorError as e:
            stage = "parse" if e.reason in ("not_json", "not_utf8") else "schema"
            return quarantine(e, line.raw, line.source, line.offset, stage)
