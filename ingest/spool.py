"""Source: tail JSON-lines files by byte offset, the way the plugin's spool is written.

The plugin writes ``<spool>/<job>/<host>-<gpu>-<pid>.<segment:06d>.jsonl``. A *stream* is
a file name without ``.<segment>.jsonl``; a segment is *closed* once a higher-numbered
segment of the same stream exists (the plugin has a single writer per stream, so
everything of segment n was written before n+1 was created). Segments of one stream are
read strictly in order, so one communicator's records stay in order across rotations.

Only complete lines are returned: a line without its final ``\\n`` is still being written
and is returned once the ``\\n`` arrives; at the end of a *closed* segment it never will,
so it is returned as it is (the parser quarantines it). A line longer than
``max_line_bytes`` is returned cut to ``max_line_bytes + 1`` bytes (so the parser
quarantines it as ``too_long``) with ``next_offset`` past its newline. A file that shrank
was truncated: reading restarts at 0 and it is logged. A path whose inode changed was
replaced: reading restarts at 0 too.

Positions are a plain ``{path: byte offset}`` dict, the offset of the next unread byte,
so a caller can checkpoint them as JSON and pass them back after a restart.

>>> import os, tempfile
>>> d = tempfile.mkdtemp(); os.mkdir(os.path.join(d, "job"))
>>> p = os.path.join(d, "job", "h-GPU-1-7.000000.jsonl")
>>> with open(p, "wb") as f:
...     _ = f.write(b'{"a":1}\\n{"b":2}\\n{"c"')
>>> t = SpoolTailer(d)
>>> [(ln.offset, ln.next_offset, ln.raw) for ln in t.poll(100)]
[(0, 8, b'{"a":1}'), (8, 16, b'{"b":2}')]
>>> with open(p, "ab") as f:
...     _ = f.write(b':3}\\n')
>>> [ln.raw for ln in t.poll(100)], t.positions == {p: 24}
([b'{"c":3}'], True)
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import time
from collections.abc import Collection, Iterable
from typing import NamedTuple

from ncclwatch.records import MAX_LINE_BYTES

log = logging.getLogger(__name__)

_SEGMENT_RE = re.compile(r"^(?P<stream>.+)\.(?P<segment>[0-9]+)\.jsonl$")


class Line(NamedTuple):
    """One line of a source file: where it is and its bytes (without the ``\\n``)."""

    source: str
    offset: int
    next_offset: int
    raw: bytes


class Chunk(NamedTuple):
    """Consecutive lines of one file: the fast path (no object per line).

    Lines ``raws[i]`` are contiguous and each was followed by ``\\n``, except in a chunk
    of a single cut or unterminated line, whose ``next_offset`` says where it ended.
    """

    source: str
    offset: int
    next_offset: int
    raws: list[bytes]

    def lines(self) -> Iterable[Line]:
        if len(self.raws) == 1:
            yield Line(self.source, self.offset, self.next_offset, self.raws[0])
            return
        pos = self.offset
        for raw in self.raws:
            nxt = pos + len(raw) + 1
            yield Line(self.source, pos, nxt, raw)
            pos = nxt


def segment_of(name: str) -> tuple[str, int] | None:
    """Split a spool file name into (stream, segment), None if it is not a segment.

    >>> segment_of("h-GPU-1-7.000012.jsonl"), segment_of("notes.txt")
    (('h-GPU-1-7', 12), None)
    """
    m = _SEGMENT_RE.match(name)
    if m is None:
        return None
    return m.group("stream"), int(m.group("segment"))


class _Open:
    __slots__ = ("fd", "ino", "scan_pos")

    def __init__(self, fd: int, ino: int):
        self.fd = fd
        self.ino = ino
        # While a line longer than the limit is still growing: how far it was scanned
        # without finding its newline, so a poll does not rescan it from the start.
        self.scan_pos = -1


class Tailer:
    """Tail a changing set of files by byte offset; subclasses say which files.

    Parameters
    ----------
    positions
        ``{path: offset}`` to resume from (copied); files not in it start at 0.
    max_line_bytes
        Longer lines are cut and flagged for quarantine (``too_long``).
    chunk_bytes
        Bytes read per system call; must exceed ``max_line_bytes``.
    """

    def __init__(
        self,
        positions: dict[str, int] | None = None,
        *,
        max_line_bytes: int = MAX_LINE_BYTES,
        chunk_bytes: int = 1 << 20,
        max_open: int = 256,
    ):
        if chunk_bytes <= max_line_bytes:
            raise ValueError("chunk_bytes must exceed max_line_bytes")
        self.positions: dict[str, int] = dict(positions or {})
        self.max_line_bytes = max_line_bytes
        self.chunk_bytes = chunk_bytes
        self.max_open = max_open
        self.inodes: dict[str, int] = {}  # path -> inode last read; checkpoint with positions
        self.sizes: dict[str, int] = {}  # path -> size at the last look
        self.closed: set[str] = set()  # segments known to be closed
        self.truncations_total = 0
        self.replaced_total = 0
        self.vanished_unread_bytes_total = 0
        self._open: dict[str, _Open] = {}
        self._rr = 0
        # Bytes a line takes, about (updated per chunk): bounds how much one read takes
        # when only a few lines are wanted.
        self._line_bytes = 512
        self.stream_ids: set[str] = set()  # as of the last poll
        self.read_streams: set[str] = set()
        self.limited: set[str] = set()

    # -- what to read ---------------------------------------------------------------

    def discover(self) -> list[list[str]]:
        """Streams to read, each a list of paths in read order (all but the last closed)."""
        raise NotImplementedError

    # -- public API -----------------------------------------------------------------

    def poll(self, max_lines: int) -> list[Line]:
        """Up to ``max_lines`` complete lines, fairly across streams."""
        return [ln for chunk in self.poll_chunks(max_lines) for ln in chunk.lines()]

    def poll_chunks(self, max_lines: int, *, per_stream: int = 0,
                    skip: Collection[str] = ()) -> list[Chunk]:
        """Like :meth:`poll`, grouped into per-file chunks (no object per line).

        ``per_stream`` (> 0) caps the lines taken from one stream, so that one poll
        advances every stream a little instead of one stream a lot; streams whose
        :meth:`stream_id` is in ``skip`` are not read. Afterwards :attr:`read_streams`
        holds the ids of the streams that were read and :attr:`limited` those of them
        that stopped at a line cap (they may have more complete lines).
        """
        streams = self.discover()
        live = {p for s in streams for p in s}
        for path in [p for p in self.positions if p not in live]:
            self._vanished(path)
        out: list[Chunk] = []
        budget = max_lines
        n = len(streams)
        sid_of = self.stream_id
        self.stream_ids = {sid_of(s[0]) for s in streams}
        self.read_streams = read = set()
        self.limited = limited = set()
        if n == 0:
            return out
        start = self._rr % n
        self._rr += 1
        for i in range(n):
            paths = streams[(start + i) % n]
            sid = sid_of(paths[0])
            if sid in skip:
                continue
            quota = min(budget, per_stream) if per_stream > 0 else budget
            left = quota
            last = len(paths) - 1
            for j, path in enumerate(paths):
                closed = j < last
                if closed:
                    self.closed.add(path)
                left, done = self._read(path, closed, left, out)
                if left <= 0 or not done:
                    break
            read.add(sid)
            if left <= 0:
                limited.add(sid)
            budget -= quota - left
            if budget <= 0:
                break
        return out

    def stream_id(self, path: str) -> str:
        """The stream a file belongs to (here: the file itself)."""
        return path

    def rewind(self, path: str, offset: int) -> None:
        """Un-read everything of ``path`` from ``offset`` on (lines a caller polled but
        did not use): the next poll returns those lines again."""
        if offset < self.positions.get(path, 0):
            self.positions[path] = offset
        o = self._open.get(path)
        if o is not None:
            o.scan_pos = -1

    def bytes_behind(self) -> int:
        """Bytes written to the files but not read yet (as of the last poll)."""
        pos = self.positions
        return sum(max(0, size - pos.get(p, 0)) for p, size in self.sizes.items())

    def is_done(self, path: str) -> bool:
        """A closed segment read to its end."""
        return path in self.closed and self.positions.get(path, 0) >= self.sizes.get(path, -1)

    def forget(self, path: str) -> None:
        """Stop tracking a file (e.g. after deleting an acknowledged segment)."""
        self._close(path)
        self.positions.pop(path, None)
        self.inodes.pop(path, None)
        self.sizes.pop(path, None)
        self.closed.discard(path)

    def close(self) -> None:
        for path in list(self._open):
            self._close(path)

    # -- internals ------------------------------------------------------------------

    def _vanished(self, path: str) -> None:
        unread = self.sizes.get(path, 0) - self.positions.get(path, 0)
        if unread > 0:
            self.vanished_unread_bytes_total += unread
            log.warning("event=file_vanished path=%s unread_bytes=%d", path, unread)
        self.forget(path)

    def _close(self, path: str) -> None:
        o = self._open.pop(path, None)
        if o is not None:
            with contextlib.suppress(OSError):
                os.close(o.fd)

    def _fd(self, path: str, ino: int) -> _Open | None:
        o = self._open.get(path)
        if o is not None and o.ino == ino:
            return o
        if o is not None:
            self._close(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            log.warning("event=open_failed path=%s error=%s", path, e)
            return None
        st = os.fstat(fd)
        if st.st_ino != ino:  # replaced between stat and open: take it next poll
            os.close(fd)
            return None
        if len(self._open) >= self.max_open:
            self._close(next(iter(self._open)))
        o = self._open[path] = _Open(fd, ino)
        return o

    def _read(self, path: str, closed: bool, budget: int, out: list[Chunk]) -> tuple[int, bool]:
        """Read complete lines of one file into ``out``; (budget left, file fully read)."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._vanished(path)
            return budget, True
        size = st.st_size
        ino = st.st_ino
        pos = self.positions.get(path, 0)
        known_ino = self.inodes.get(path)
        if known_ino is not None and known_ino != ino:
            self.replaced_total += 1
            log.warning("event=file_replaced path=%s old_offset=%d; reading from 0", path, pos)
            pos = 0
        elif size < pos:
            o = self._open.get(path)
            if o is not None:
                o.scan_pos = -1
            self.truncations_total += 1
            log.warning("event=file_truncated path=%s offset=%d size=%d; reading from 0",
                        path, pos, size)
            pos = 0
        self.inodes[path] = ino
        self.sizes[path] = size
        self.positions[path] = pos
        if pos >= size:
            if closed:
                self._close(path)
            return budget, True
        o = self._fd(path, ino)
        if o is None:
            return budget, False
        fd = o.fd
        limit = self.max_line_bytes
        while budget > 0 and pos < size:
            if o.scan_pos > pos:  # inside a long line: look for its end only
                budget, pos, progressed = self._long_line(o, path, pos, size, closed, out, budget)
                if not progressed:
                    break
                continue
            # Never less than a longest line plus one, so "no newline in what was read"
            # still means a line that is too long or not finished.
            want = min(self.chunk_bytes, size - pos,
                       max(limit + 1, budget * self._line_bytes * 5 // 4))
            data = os.pread(fd, want, pos)
            if not data:
                break
            last_nl = data.rfind(b"\n")
            if last_nl < 0:
                if len(data) > limit:
                    o.scan_pos = pos + len(data)
                    continue
                if closed and pos + len(data) >= size:
                    # The end of a closed segment: this line will never be completed.
                    out.append(Chunk(path, pos, pos + len(data), [data]))
                    budget -= 1
                    pos += len(data)
                break  # a line still being written
            raws = data[:last_nl].split(b"\n")
            if len(raws) > budget:
                raws = raws[:budget]
                end = pos + sum(map(len, raws)) + len(raws)
            else:
                end = pos + last_nl + 1
            out.append(Chunk(path, pos, end, raws))
            budget -= len(raws)
            self._line_bytes = (end - pos) // len(raws) + 1
            pos = end
        self.positions[path] = pos
        done = pos >= size
        if done and closed:
            self._close(path)
        return budget, done

    def _long_line(self, o: _Open, path: str, pos: int, size: int, closed: bool,
                   out: list[Chunk], budget: int) -> tuple[int, int, bool]:
        """Continue scanning an over-long line; emit it cut once its end is known."""
        scan = o.scan_pos
        while scan < size:
            data = os.pread(o.fd, min(self.chunk_bytes, size - scan), scan)
            if not data:
                break
            nl = data.find(b"\n")
            if nl >= 0:
                head = os.pread(o.fd, self.max_line_bytes + 1, pos)
                end = scan + nl + 1
                out.append(Chunk(path, pos, end, [head]))
                o.scan_pos = -1
                log.warning("event=line_too_long path=%s offset=%d bytes=%d", path, pos,
                            end - 1 - pos)
                return budget - 1, end, True
            scan += len(data)
        o.scan_pos = scan
        if closed and scan >= size:
            head = os.pread(o.fd, self.max_line_bytes + 1, pos)
            out.append(Chunk(path, pos, size, [head]))
            o.scan_pos = -1
            return budget - 1, size, True
        return budget, pos, False


class SpoolTailer(Tailer):
    """Tail the plugin's spool directory: ``<spool>/<job>/<stream>.<segment>.jsonl``.

    Files directly in ``spool_dir`` are read too. Files whose names are not segments
    are ignored (the spool is the plugin's, and a stray editor file is not data).

    ``trust="owner"`` reads a segment only when the owner of its directory, root or
    this process's user owns it: on a node shared by several users, one user's files
    dropped into another's job directory are not that job's records. The others are
    left unread and listed in :attr:`untrusted` (path -> "file uid U in a directory of
    uid D"), each logged once.
    """

    def __init__(self, spool_dir: str, positions: dict[str, int] | None = None, *,
                 trust: str = "any", **kwargs):
        super().__init__(positions, **kwargs)
        self.spool_dir = spool_dir
        self.trust_owner = trust == "owner"
        self.untrusted: dict[str, str] = {}
        self._sids: dict[str, str] = {}
        self._listed: dict[str, tuple[int, list]] = {}  # dir (+ "/" for its subdirs) -> (mtime, listing)
        self._streams: list[list[str]] | None = None  # the last answer, while nothing changed
        self._relisted = False

    def stream_id(self, path: str) -> str:
        """``<dir>/<stream>`` of a segment path: every segment of a stream has the same.

        >>> SpoolTailer("/s").stream_id("/s/job/h-GPU-1-7.000003.jsonl")
        '/s/job/h-GPU-1-7'
        """
        sid = self._sids.get(path)
        if sid is None:
            if len(self._sids) > 65536:
                self._sids.clear()
            seg = segment_of(os.path.basename(path))
            sid = self._sids[path] = (os.path.join(os.path.dirname(path), seg[0])
                                      if seg else path)
        return sid

    def discover(self) -> list[list[str]]:
        """Every stream's segments, in read order. A directory is listed again only when
        its modification time changed (a segment was created or deleted in it), so a
        poll costs one ``stat`` per job directory, not one directory entry per segment.
        Directories modified in the last ``RACY_S`` are listed every time: a file created
        in the same clock tick as the last listing leaves the time unchanged."""
        self._relisted = False
        root = self._listing(self.spool_dir, dirs=True)
        if root is None:
            return []
        listings = [self._listing(d) for d in [self.spool_dir, *root]]
        if not self._relisted and self._streams is not None:
            return [list(s) for s in self._streams]  # nothing changed: the last answer
        streams: dict[str, list[tuple[int, str]]] = {}
        for listing in listings:
            for stream, segment, path in listing or ():
                streams.setdefault(stream, []).append((segment, path))
        for gone in set(self._listed) - {self.spool_dir + "/", self.spool_dir, *root}:
            del self._listed[gone]  # a job directory that was removed
        self._streams = [[p for _, p in sorted(segs)] for _, segs in sorted(streams.items())]
        return [list(s) for s in self._streams]

    RACY_S = 2.0

    def _listing(self, d: str, dirs: bool = False) -> list | None:
        """``d``'s subdirectories (``dirs``) or its segments as (stream, segment, path),
        from the last listing while ``d`` is unchanged; None if ``d`` is gone."""
        key = d + "/" if dirs else d
        try:
            dst = os.stat(d)
            mtime = dst.st_mtime_ns
        except (FileNotFoundError, NotADirectoryError):
            self._relisted = self._relisted or self._listed.pop(key, None) is not None
            return None
        cached = self._listed.get(key)
        if cached is not None and cached[0] == mtime and time.time_ns() - mtime > self.RACY_S * 1e9:
            return cached[1]
        out: list = []
        try:
            with os.scandir(d) as it:
                for e in it:
                    if dirs:
                        if e.is_dir(follow_symlinks=False):
                            out.append(e.path)
                        continue
                    seg = segment_of(e.name)
                    if seg is not None and e.is_file(follow_symlinks=False):
                        if self.trust_owner and not self._trusted(e, dst.st_uid):
                            continue
                        out.append((os.path.join(d, seg[0]), seg[1], e.path))
        except (FileNotFoundError, NotADirectoryError):
            self._relisted = self._relisted or self._listed.pop(key, None) is not None
            return None
        self._listed[key] = (mtime, out)
        self._relisted = True
        return out

    def _trusted(self, entry: os.DirEntry, dir_uid: int) -> bool:
        try:
            uid = entry.stat(follow_symlinks=False).st_uid
        except FileNotFoundError:
            return False
        if uid in (dir_uid, 0, os.geteuid()):
            return True
        if entry.path not in self.untrusted:
            self.untrusted[entry.path] = f"file uid {uid} in a directory of uid {dir_uid}"
            log.warning("event=untrusted_segment path=%r file_uid=%d dir_uid=%d action=not_read "
                        "(ingest.spool_trust=owner)", entry.path, uid, dir_uid)
        return False


class FileTailer(Tailer):
    """Tail every file matching some glob patterns, each its own stream, never closed.

    For NCCL Inspector's ``<host>-pid<pid>.log`` files and training logs.
    """

    def __init__(self, patterns: list[str], positions: dict[str, int] | None = None, **kwargs):
        super().__init__(positions, **kwargs)
        self.patterns = list(patterns)

    def discover(self) -> list[list[str]]:
        paths: set[str] = set()
        for pat in self.patterns:
            paths.update(p for p in glob.glob(pat) if os.path.isfile(p))
        return [[p] for p in sorted(paths)]
