"""Sink-side spill: a bounded, append-only on-disk queue of Kafka message batches.

While Kafka is unreachable the forwarder keeps reading and appends each batch here; a
batch counts as safe (its source positions may be checkpointed) once it is fsynced. When
Kafka answers again the batches are sent in order and the read position advances.

Files are ``buffer.<n:012d>.bin``; each frame is ``length:u32 crc32:u32 payload`` with a
msgpack payload ``[[topic, key, value], ...]``. A torn frame at the very end (a crash
during ``append``) is cut off on open: its batch was never fsynced, so its positions were
never checkpointed and the lines are read again from the source.

Bounded: ``append`` refuses (:class:`BufferFull`) a batch that would take the files on
disk past ``max_bytes``, before writing anything; the caller keeps that batch in memory
and stops reading (back-pressure: the plugin's spool keeps the lines). A write that
fails (``ENOSPC``, ``EIO``) is cut back to the last whole frame before the error is
raised, so a full disk never leaves a torn frame in front of later ones. Files are
0600 in a 0700 directory: they hold record content.

>>> import tempfile
>>> b = DiskBuffer(tempfile.mkdtemp())
>>> b.append([("t", b"k", b"v1"), ("t", b"k", b"v2")])
>>> b.pending_bytes > 0, b.peek()
(True, [('t', b'k', b'v1'), ('t', b'k', b'v2')])
>>> b.advance(); b.peek() is None, b.pending_bytes
(True, 0)
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
import zlib

import msgspec

from ncclwatch import private

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">II")
_NAME = re.compile(r"^buffer\.(\d{12})\.bin$")
Message = tuple[str, bytes | None, bytes]


class BufferFull(Exception):
    """The batch would take the buffer past ``max_bytes``; nothing was written."""


class DiskBuffer:
    """Append-only frames in ``directory``; ``position`` is ``(file number, offset)``.

    ``max_bytes`` bounds the bytes of the buffer's files on disk (consumed files count
    until :meth:`collect` deletes them); ``None`` is unbounded.

    >>> import tempfile
    >>> b = DiskBuffer(tempfile.mkdtemp(), max_bytes=100)
    >>> b.append([("t", None, b"x" * 60)])
    >>> try:
    ...     b.append([("t", None, b"y" * 60)])
    ... except BufferFull as e:
    ...     print(e)
    a frame of 75 bytes would take the buffer to 150 bytes > max_bytes 100
    >>> b.disk_bytes
    75
    """

    def __init__(self, directory: str, position: tuple[int, int] | None = None,
                 *, file_bytes: int = 64 << 20, max_bytes: int | None = None):
        self.directory = directory
        self.file_bytes = file_bytes
        self.max_bytes = max_bytes
        private.makedirs(directory)
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(list[tuple[str, bytes | None, bytes]]).decode
        self.corrupt_frames_total = 0
        files = self._files()
        self._read_file, self._read_off = position if position else (files[0] if files else 0, 0)
        # Files before the read position were consumed (a crash came before their deletion).
        for n in files:
            if n < self._read_file:
                self._unlink(n)
        files = [n for n in files if n >= self._read_file]
        if files and files[0] > self._read_file:
            self._read_file, self._read_off = files[0], 0
        elif self._read_file not in files:
            self._read_off = 0  # deleted, so it had been consumed completely
        self._write_file = files[-1] if files else self._read_file
        self._sizes = {n: self._valid_size(n) for n in files}
        self._sizes.setdefault(self._write_file, 0)
        self._peeked: tuple[list[Message], int] | None = None

    # -- files ------------------------------------------------------------------------

    def _path(self, n: int) -> str:
        return os.path.join(self.directory, f"buffer.{n:012d}.bin")

    def _files(self) -> list[int]:
        out = []
        for name in os.listdir(self.directory):
            m = _NAME.match(name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def _unlink(self, n: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(n))

    def _valid_size(self, n: int) -> int:
        """Size up to the last whole frame; cut a torn tail."""
        path = self._path(n)
        with open(path, "rb") as f:
            data = f.read()
        off = 0
        while off + _HEADER.size <= len(data):
            length, crc = _HEADER.unpack_from(data, off)
            end = off + _HEADER.size + length
            if end > len(data) or zlib.crc32(data[off + _HEADER.size:end]) != crc:
                break
            off = end
        if off != len(data):
            log.warning("event=buffer_torn_tail file=%s kept_bytes=%d cut_bytes=%d",
                        path, off, len(data) - off)
            with open(path, "r+b") as f:
                f.truncate(off)
                os.fsync(f.fileno())
        return off

    # -- queue --------------------------------------------------------------------------

    def append(self, messages: list[Message]) -> None:
        """Write one batch durably (fsync) before returning.

        Raises :class:`BufferFull` (nothing written) past ``max_bytes``, and ``OSError``
        when the write fails, with the file cut back to its last whole frame.
        """
        payload = self._encode(messages)
        frame = _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        if self.max_bytes is not None and self.disk_bytes + len(frame) > self.max_bytes:
            raise BufferFull(f"a frame of {len(frame)} bytes would take the buffer to "
                             f"{self.disk_bytes + len(frame)} bytes > max_bytes {self.max_bytes}")
        if self._sizes.get(self._write_file, 0) >= self.file_bytes:
            self._write_file += 1
            self._sizes[self._write_file] = 0
        path = self._path(self._write_file)
        size = self._sizes.get(self._write_file, 0)
        fd = private.open_append(path)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # the torn tail of an earlier failed write
            try:
                view = memoryview(frame)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except OSError:
                # Cut the partial frame now; if even that fails, the fstat above cuts
                # it at the next append, and a torn tail is cut on open.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)
        self._sizes[self._write_file] = size + len(frame)

    def peek(self) -> list[Message] | None:
        """The oldest unsent batch, or None when the buffer is empty."""
        if self._peeked is not None:
            return self._peeked[0]
        while True:
            size = self._sizes.get(self._read_file, 0)
            if self._read_off >= size:
                if self._read_file >= self._write_file:
                    return None
                self._read_file += 1
                self._read_off = 0
                continue
            with open(self._path(self._read_file), "rb") as f:
                f.seek(self._read_off)
                header = f.read(_HEADER.size)
                length, crc = _HEADER.unpack(header)
                payload = f.read(length)
            if len(payload) != length or zlib.crc32(payload) != crc:
                # Only reachable if the disk changed under us: skip the rest of the file.
                self.corrupt_frames_total += 1
                log.error("event=buffer_corrupt file=%s offset=%d; skipping the rest of it",
                          self._path(self._read_file), self._read_off)
                self._read_off = size
                continue
            msgs = self._decode(payload)
            self._peeked = (msgs, _HEADER.size + length)
            return msgs

    def advance(self) -> None:
        """The batch returned by :meth:`peek` was acknowledged."""
        if self._peeked is None:
            raise RuntimeError("advance() without a peeked batch")
        self._read_off += self._peeked[1]
        self._peeked = None

    @property
    def position(self) -> tuple[int, int]:
        return self._read_file, self._read_off

    @property
    def disk_bytes(self) -> int:
        """Bytes of the buffer's files on disk (consumed ones until :meth:`collect`)."""
        return sum(self._sizes.values())

    @property
    def pending_bytes(self) -> int:
        total = 0
        for n, size in self._sizes.items():
            if n > self._read_file:
                total += size
            elif n == self._read_file:
                total += max(0, size - self._read_off)
        return total

    def empty(self) -> bool:
        return self.pending_bytes == 0

    def collect(self) -> None:
        """Delete consumed files (call after the read position was checkpointed)."""
        for n in [n for n in self._sizes if n < self._read_file]:
            self._unlink(n)
            del self._sizes[n]
        if self.empty() and self._sizes.get(self._write_file, 0) > 0:
            # Start the next spill in a fresh file so this one can go.
            self._unlink(self._write_file)
            self._sizes.pop(self._write_file, None)
            self._write_file += 1
            self._read_file, self._read_off = self._write_file, 0
            self._sizes[self._write_file] = 0
