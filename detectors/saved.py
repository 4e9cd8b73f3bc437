"""Saved states as table entries: one value per state, or a head and its parts.

A job's state in the job stage grows with its ranks: 6.7 MB of JSON at 16,384 GPUs, 20.5 MB
at 49,152, about 42 MB at 100k, past what one Kafka message may hold (the worker's
changelog takes 16 MB, a broker's default topic 1 MB). A state longer than ``part_bytes`` is saved in parts:
its JSON cut into pieces under keys of their own, then a small head under the state's
key that says where they are. Recovery reads whatever the changelog holds last for each
key, and a worker may stop between two of a save's writes, so the parts of a save never
overwrite the parts the current head points to: they alternate between two slots, the
head flips to the new one once its parts are written, and only then are the old slot's
removed. A save cut short leaves the previous head and its slot whole.

Keys: a state's own key is its head's (``job`` as it is); a part's is
``"\\x00p<slot>.<i>\\x00" + job``. A key that itself starts with ``"\\x00"`` is stored
as ``"\\x00h\\x00" + key``, so no state's key is ever a part's.

>>> codec = StateCodec(part_bytes=16)
>>> entries = codec.entries("job-1", {"v": 1, "ranks": list(range(12))})
>>> for k, v in entries:
...     print(k.replace("\\x00", "|"), v)
|p0.0|job-1 b'{"v":1,"ranks":['
|p0.1|job-1 b'0,1,2,3,4,5,6,7,'
|p0.2|job-1 b'8,9,10,11]}'
job-1 b'{"parted":1,"slot":0,"parts":3,"other":0,"bytes":43,"crc32":2062660661}'
>>> table = dict(entries)
>>> StateCodec(part_bytes=16).load(table.get, "job-1")
{'v': 1, 'ranks': [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]}
>>> [(k.replace("\\x00", "|"), v) for k, v in codec.entries("job-1", {"v": 1})]  # short again
[('job-1', b'{"v":1}'), ('|p0.0|job-1', None), ('|p0.1|job-1', None), ('|p0.2|job-1', None)]
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import msgspec

PART_BYTES = 512 * 1024  # well under a broker's default message size (1 MB)

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.decode


def table_key(key: str) -> str:
    """The table key of a state's head (or whole value)."""
    return "\x00h\x00" + key if key.startswith("\x00") else key


def part_key(key: str, slot: int, i: int) -> str:
    return f"\x00p{slot}.{i}\x00{key}"


def state_of(table_key_: str) -> str | None:
    """The state a table key is the head of; None for a part's key.

    >>> state_of("job-1"), state_of(part_key("job-1", 0, 3)), state_of(table_key("\\x00x"))
    ('job-1', None, '\\x00x')
    """
    if table_key_.startswith("\x00h\x00"):
        return table_key_[3:]
    return None if table_key_.startswith("\x00") else table_key_


class StateCodec:
    """States to table entries and back, in parts when long (see the module).

    It remembers, per state, which slot holds its parts and how many each slot has
    (learned from its saves and loads), so that a save that needs fewer parts than the
    slot held removes the rest, and a forgotten state takes all its parts with it.

    Parameters
    ----------
    part_bytes
        The longest value written: a longer state goes in parts of this size.
    """

    def __init__(self, part_bytes: int = PART_BYTES):
        if part_bytes < 1:
            raise ValueError(f"part_bytes must be positive, not {part_bytes}")
        self.part_bytes = part_bytes
        self._slots: dict[str, tuple[int, int, int]] = {}  # key -> (slot in use, its parts, the other's)

    def entries(self, key: str, state: dict[str, Any] | None) -> list[tuple[str, bytes | None]]:
        """What to write for ``state`` (None: remove it), in order: ``(table key, value)``,
        a value of None a tombstone."""
        slot, parts, other = self._slots.get(key, (1, 0, 0))
        if state is None:
            self._slots.pop(key, None)
            return [*self._tombstones(key, slot, 0, parts), *self._tombstones(key, 1 - slot, 0, other),
                    (table_key(key), None)]
        raw = _encode(state)
        if len(raw) <= self.part_bytes:
            self._slots.pop(key, None)
            return [(table_key(key), raw), *self._tombstones(key, slot, 0, parts),
                    *self._tombstones(key, 1 - slot, 0, other)]
        # the slot not in use: a stop before the head leaves the current one whole
        new, step = 1 - slot, self.part_bytes
        n = -(-len(raw) // step)
        out: list[tuple[str, bytes | None]] = [(part_key(key, new, i), raw[i * step:(i + 1) * step])
                                               for i in range(n)]
        out += self._tombstones(key, new, n, other)
        # "other": the old slot's parts, in case the stop comes before they are removed
        head = {"parted": 1, "slot": new, "parts": n, "other": parts, "bytes": len(raw), "crc32": zlib.crc32(raw)}
        out.append((table_key(key), _encode(head)))
        out += self._tombstones(key, slot, 0, parts)  # read by no head now
        self._slots[key] = (new, n, 0)
        return out

    def load(self, get: Callable[[str], bytes | None], key: str) -> dict[str, Any] | None:
        """The state saved under ``key`` (``get``: the table's), None if there is none."""
        value = get(table_key(key))
        if value is None:
            self._slots.pop(key, None)
            return None
        state = _decode(value)
        if not (isinstance(state, dict) and "parted" in state):
            self._slots.pop(key, None)
            return state
        slot, n = state["slot"], state["parts"]
        pieces = [get(part_key(key, slot, i)) for i in range(n)]
        raw = b"".join(p for p in pieces if p is not None)
        if None in pieces or len(raw) != state["bytes"] or zlib.crc32(raw) != state["crc32"]:
            raise ValueError(f"saved state {key!r}: its {n} parts in slot {slot} are not those its head was "
                             f"written with ({sum(p is None for p in pieces)} missing)")
        self._slots[key] = (slot, n, state["other"])
        return _decode(raw)

    def _tombstones(self, key: str, slot: int, start: int, end: int) -> list[tuple[str, bytes | None]]:
        return [(part_key(key, slot, i), None) for i in range(start, end)]
