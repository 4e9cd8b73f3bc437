"""Sorting more items than fit in memory, like ``sort(1)``: the one home of the mechanism
behind :class:`~ncclwatch.ingest.recording.SortedRecording` (recordings on disk) and
``replay --topic`` (a topic range).

Items are added with a key of non-negative integers; up to ``run_records`` of them are
held and sorted in memory. Beyond that, sorted runs go to a temporary directory as lines
(the key in fixed-width digits, then the item as ``encode`` makes it: one line, no
newline) compressed with lz4, and are merged from there, so lines compare as bytes and
nothing is parsed to merge. More than ``max_open_runs`` runs are first merged into one,
so few files are ever open. Items of equal key come back in the order they were added.

>>> s = ExternalSort((3,), encode=lambda x: x.encode(), decode=bytes.decode, run_records=2)
>>> with s:
...     for k, v in [(3, "c"), (1, "a"), (2, "b"), (1, "a2"), (0, "z")]:
...         s.add((k,), v)
...     (list(s), s.total, s.runs)
(['z', 'a', 'a2', 'b', 'c'], 5, 3)
"""

from __future__ import annotations

import heapq
import io
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

# Items sorted in memory before a run goes to disk: ~2 KB each held as parsed records,
# so ~100 MB of sort buffer (measured: docs/BENCHMARKS.md, replay memory).
RUN_RECORDS = 50_000
# Runs merged into one before more are written, so a merge never opens more files.
MAX_OPEN_RUNS = 64
_SEQ_WIDTH = 12  # the order items were added in: the tie-breaker that keeps the sort stable
_WRITE_LINES = 4096  # lines per write to a run
_READ_BUFFER = 256 << 10  # per open run: at most MAX_OPEN_RUNS of them


class SortSpaceError(RuntimeError):
    """The temporary space a long sort needs could not be written (a full disk, say)."""


class ExternalSort:
    """Add ``(key, item)`` pairs, then iterate the items once in key order.

    ``widths`` gives each key field's width in digits (a key field must be a
    non-negative integer below ``10**width``). ``encode(item)`` is the item as one line
    of bytes without a newline, ``decode(line)`` the item again; items read back from
    disk are what ``decode`` returns, those never spilled are the ones added.
    """

    def __init__(
        self,
        widths: Sequence[int],
        *,
        encode: Callable[[Any], bytes],
        decode: Callable[[bytes], Any],
        run_records: int = RUN_RECORDS,
        max_open_runs: int = MAX_OPEN_RUNS,
    ) -> None:
        self.widths = tuple(widths)
        self.encode = encode
        self.decode = decode
        self.run_records = max(1, run_records)
        self.max_open_runs = max(2, max_open_runs)
        self.total = 0
        self.runs = 0  # sorted runs written to disk so far (0: all in memory)
        self._fmt = b"".join(b"%%0%dd" % w for w in (*self.widths, _SEQ_WIDTH)) + b"%b\n"
        self._key_width = sum(self.widths) + _SEQ_WIDTH
        self._memory: list[tuple[tuple[int, ...], int, Any]] = []
        self._run_paths: list[Path] = []
        self._stack = ExitStack()
        self._tmp: Path | None = None

    def __enter__(self) -> ExternalSort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop what is held and remove the temporary directory."""
        self._memory = []
        self._run_paths = []
        self._stack.close()

    @property
    def directory(self) -> Path | None:
        """Where the runs are (None while everything is in memory); removed on close."""
        return self._tmp

    def add(self, key: tuple[int, ...], item: Any) -> None:
        self._memory.append((key, self.total, item))
        self.total += 1
        if len(self._memory) >= self.run_records:
            self._spill()

    def __iter__(self) -> Iterator[Any]:
        buf = self._memory
        if not self._run_paths:
            buf.sort()  # keys then add order: the item itself is never compared
            self._memory = []
            for _, _, item in buf:
                yield item
            return
        if buf:
            self._spill()

        decode, skip = self.decode, self._key_width
        with ExitStack() as files:
            runs = [_lines(files, p) for p in self._run_paths]
            for line in heapq.merge(*runs):
                yield decode(line[skip:-1])

    def _spill(self) -> None:
        try:
            self._write_run()
        except OSError as e:
            where = self._tmp or tempfile.gettempdir()
            raise SortSpaceError(
                f"sorting more than {self.run_records:,} records needs temporary space, and writing "
                f"it in {where} failed: {e.strerror or e} (TMPDIR chooses where it goes)") from e

    def _write_run(self) -> None:
        import lz4.frame

        buf, self._memory = self._memory, []
        buf.sort()
        if self._tmp is None:
            self._tmp = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="ncclwatch-sort-")))
        path = self._tmp / f"run-{self.runs:06d}.lz4"
        fmt, encode = self._fmt, self.encode
        with lz4.frame.open(path, "wb", compression_level=0) as f:
            # lz4's writer costs a frame chunk per call: write thousands of lines at once
            for i in range(0, len(buf), _WRITE_LINES):
                f.write(b"".join([fmt % (*key, seq, encode(item)) for key, seq, item in buf[i:i + _WRITE_LINES]]))
        self._run_paths.append(path)
        self.runs += 1
        if len(self._run_paths) >= self.max_open_runs:
            self._compact()

    def _compact(self) -> None:
        import lz4.frame

        assert self._tmp is not None
        path = self._tmp / f"merged-{self.runs:06d}.lz4"
        with ExitStack() as files:
            runs = [_lines(files, p) for p in self._run_paths]
            with lz4.frame.open(path, "wb", compression_level=0) as out:
                batch: list[bytes] = []
                for line in heapq.merge(*runs):
                    batch.append(line)
                    if len(batch) >= _WRITE_LINES:
                        out.write(b"".join(batch))
                        batch.clear()
                out.write(b"".join(batch))
        for p in self._run_paths:
            p.unlink()
        self._run_paths = [path]


def _lines(files: ExitStack, path: Path) -> io.BufferedReader:
    """A run's lines; the buffer in front of lz4's reader makes a line a C-level split of
    a large decompressed chunk instead of a call through lz4's file object."""
    import lz4.frame

    return files.enter_context(io.BufferedReader(lz4.frame.open(path, "rb"), _READ_BUFFER))
