"""Files and directories only the owner can read: 0600 and 0700, whatever the umask.

Quarantined lines, the spill buffer and the alert outbox hold record content (job and
host names, raw input lines), so they are not left world-readable under the usual umask
of 022. The mode is set with ``fchmod``/``chmod`` after creation as well, because the
umask only removes bits: a file created by an older version (0644) is tightened, and a
umask like 0277 cannot leave a file its owner cannot write. Directories that already
exist keep their mode.

>>> import os, stat, tempfile
>>> d = os.path.join(tempfile.mkdtemp(), "state", "node")
>>> makedirs(d)
>>> fd = open_append(os.path.join(d, "q.jsonl")); os.close(fd)
>>> oct(stat.S_IMODE(os.stat(d).st_mode)), oct(stat.S_IMODE(os.stat(os.path.join(d, "q.jsonl")).st_mode))
('0o700', '0o600')
"""

from __future__ import annotations

import contextlib
import os
import stat

FILE_MODE = 0o600
DIR_MODE = 0o700


def makedirs(path: str | os.PathLike) -> None:
    """Create ``path`` and missing parents as 0700; directories that exist are left alone
    (a ``--quarantine-file /tmp/q.jsonl`` must not make /tmp private)."""
    created = []
    p = os.path.abspath(os.fspath(path))
    while not os.path.isdir(p):
        created.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    for d in created:
        with contextlib.suppress(OSError):
            os.chmod(d, DIR_MODE)


def open_fd(path: str | os.PathLike, flags: int) -> int:
    """``os.open`` with O_CREAT and mode 0600, enforced on the open file."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        # Only regular files: a path that leads to a device (a test's /dev/full) must
        # not change the device's own mode.
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: str | os.PathLike) -> int:
    return open_fd(path, os.O_WRONLY | os.O_APPEND)


def open_truncate(path: str | os.PathLike) -> int:
    return open_fd(path, os.O_WRONLY | os.O_TRUNC)
