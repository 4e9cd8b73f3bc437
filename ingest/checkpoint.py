"""Durable forwarder state: one JSON file written by write-fsync-rename.

A reader after a crash sees either the previous checkpoint or the new one, never a torn
mix: the new content goes to a temporary file in the same directory, is fsynced, renamed
over the old name, and the directory is fsynced so the rename itself survives a power cut.
A save that fails (a full disk) removes its temporary file before raising, and
:func:`remove_stale_temps` clears those of processes killed in the middle of one.

>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "n", "checkpoint.json")
>>> load(path)
{}
>>> save(path, {"positions": {"/s/a.jsonl": 10}})
>>> load(path)["positions"]
{'/s/a.jsonl': 10}
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os

from ncclwatch import private
from ncclwatch.rules import safe_filename

log = logging.getLogger(__name__)


def path_for(state_dir: str, node_id: str) -> str:
    """``<state_dir>/<safe node id>/checkpoint.json``.

    >>> path_for("/var/lib/ncclwatch", "node/1")
    '/var/lib/ncclwatch/node%2F1/checkpoint.json'
    """
    return os.path.join(state_dir, safe_filename(node_id), "checkpoint.json")


def save(path: str, state: dict) -> None:
    """Replace the checkpoint atomically; raises ``OSError`` (temp file removed) on failure."""
    d = os.path.dirname(path)
    private.makedirs(d)
    tmp = f"{path}.tmp.{os.getpid()}"
    data = json.dumps(state, separators=(",", ":"), sort_keys=True).encode()
    try:
        fd = private.open_truncate(tmp)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def remove_stale_temps(path: str) -> list[str]:
    """Delete ``<path>.tmp.<pid>`` files left by processes that died while saving.

    Only those of processes that no longer run: a second forwarder on the same state
    directory is a configuration error, but its temp file is not ours to delete.
    """
    removed = []
    for tmp in glob.glob(glob.escape(path) + ".tmp.*"):
        pid = tmp.rsplit(".", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
            removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load(path: str) -> dict:
    """The last checkpoint, or ``{}`` when there is none.

    A checkpoint that cannot be read is an error, not a fresh start: starting over
    silently would re-send everything (or, worse, skip nothing and hide the problem).
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return {}
    state = json.loads(data)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: checkpoint is not a JSON object")
    return state
