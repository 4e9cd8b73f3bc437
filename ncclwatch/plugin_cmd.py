"""``ncclwatch plugin-path``: where the NCCL profiler plugin is, for ``NCCL_PROFILER_PLUGIN``.

The Linux x86-64 wheel carries the plugin as ``ncclwatch/lib/libncclwatch-profiler.so``; a
source checkout has it in ``plugin/build/`` after ``make -C plugin``; the Docker image and
the node install of docs/deploy.md put it in ``/opt/ncclwatch/lib/``. The first that exists
wins, so a training image needs only ``pip install ncclwatch`` and::

    export NCCL_PROFILER_PLUGIN="$(ncclwatch plugin-path)"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PLUGIN_SO = "libncclwatch-profiler.so"
PACKAGED = Path(__file__).resolve().parent / "lib" / PLUGIN_SO
CHECKOUT = Path(__file__).resolve().parents[1] / "plugin" / "build" / PLUGIN_SO
SYSTEM = Path("/opt/ncclwatch/lib") / PLUGIN_SO
CANDIDATES = (PACKAGED, CHECKOUT, SYSTEM)


def find_plugin(candidates: tuple[Path, ...] = CANDIDATES) -> Path | None:
    """The first plugin that exists, or None.

    >>> find_plugin(()) is None
    True
    """
    return next((p for p in candidates if p.is_file()), None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--all", action="store_true", help="list every place looked at, found or not")


def run(args: argparse.Namespace, cfg: object = None) -> int:
    if getattr(args, "all", False):
        for p in CANDIDATES:
            print(f"{p}\t{'found' if p.is_file() else 'absent'}")
    found = find_plugin()
    if found is None:
        print(
            "ncclwatch: no profiler plugin found. Wheels for Linux x86-64 carry it; elsewhere "
            "build it with `make -C plugin` in a checkout (needs only gcc and make) and copy "
            f"build/{PLUGIN_SO} to {SYSTEM}. Looked at: " + ", ".join(map(str, CANDIDATES)),
            file=sys.stderr,
        )
        return 1
    if not getattr(args, "all", False):
        print(found)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ncclwatch plugin-path", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
