"""``ncclwatch config example|show``."""

from __future__ import annotations

import argparse
import json

from ncclwatch import config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=("example", "show"), help="example defaults, or the effective config")


def run(args: argparse.Namespace, cfg: config.Config) -> int:
    if args.what == "example":
        print(config.example(), end="")
    else:
        print(json.dumps(config.redacted(cfg), indent=2))
    return 0
