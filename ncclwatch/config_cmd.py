"""``ncclwatch config example|show``: both print TOML that ``-c FILE`` reads back."""

from __future__ import annotations

import argparse

from ncclwatch import config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=("example", "show"), help="example defaults, or the effective config")


def run(args: argparse.Namespace, cfg: config.Config) -> int:
    if args.what == "example":
        print(config.example(), end="")
    else:
        # the effective configuration (file, then environment), secrets as "***"
        print(config.dumps(cfg), end="")
    return 0
