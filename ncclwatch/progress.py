"""Progress bars for long commands: on stderr, only on a terminal, clear of event lines.

Bars are tqdm's (the ``watch`` extra; without it there are no bars, nothing else
changes). A bar lives on stderr and is drawn only when stderr is a terminal, so
pipes, files and CI logs never see carriage returns. Lines a command prints while a bar
is drawn (anomaly events on stdout, say) go through :func:`write`, which lifts the bar,
prints the line and draws the bar again below it, so the two never run into each other
on a terminal that shows both streams.

>>> import io
>>> with bar(3, "replay", file=io.StringIO()) as b:   # not a terminal: no bar at all
...     b.update(3)
...     b.disable
True
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

try:
    from tqdm import tqdm
except ImportError:  # the zero-dependency core install: bars are a nicety, not a need
    tqdm = None


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or not a real stream
        return False


def bar(total: float | None, desc: str, *, unit: str = "records", file: TextIO | None = None,
        enabled: bool | None = None, **kwargs: Any) -> tqdm:
    """A tqdm bar on ``file`` (stderr); ``enabled=None``: only if that is a terminal."""
    file = file if file is not None else sys.stderr
    show = is_terminal(file) if enabled is None else enabled
    if tqdm is None:
        return _NoBar(total)
    return tqdm(total=total, desc=desc, unit=unit, file=file, disable=not show, dynamic_ncols=True,
                leave=False, **kwargs)


def write(line: str, file: TextIO | None = None) -> None:
    """Print ``line`` (to stdout) without running into a bar drawn on the terminal."""
    file = file if file is not None else sys.stdout
    if tqdm is None:
        print(line, file=file)
    else:
        tqdm.write(line, file=file)


class _NoBar:
    """What :func:`bar` gives without tqdm: the same calls, nothing drawn."""

    disable = True

    def __init__(self, total: float | None = None):
        self.total = total or 0
        self.n = 0

    def refresh(self) -> None:
        return None

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: float = 1) -> None:
        self.n += n

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        return None

    def close(self) -> None:
        return None
