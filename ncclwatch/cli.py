"""The ``ncclwatch`` command.

Each sub-command lives in its component and exposes two functions::

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace, cfg: ncclwatch.config.Config) -> int: ...

This file only lists them, so components plug in without touching each other.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from dataclasses import dataclass

from ncclwatch import __version__, config


@dataclass(frozen=True)
class Command:
    name: str
    module: str
    help: str
    description: str


COMMANDS = (
    Command(
        "watch",
        "ncclwatch.detectors.watch",
        "single-node mode: tail the spool, detect, serve metrics, alert (no Kafka)",
        "Tails the plugin's spool directory directly and runs the detectors in-process. "
        "Pointed at a recorded spool with --speed it replays it, so detection can be seen "
        "without a GPU. Serves Prometheus metrics and sends alerts when Alertmanager is "
        "configured, else prints them.",
    ),
    Command(
        "forward",
        "ncclwatch.ingest.forward",
        "per-node forwarder: spool, Inspector files and throughput -> Kafka",
        "Runs once per node. Tails the plugin spool, NCCL Inspector JSON/.prom output and "
        "the job's throughput, publishes op records, window summaries and throughput to "
        "Kafka with acks=all, and checkpoints file positions only after Kafka acknowledged.",
    ),
    Command(
        "worker",
        "ncclwatch.detectors.faust_app",
        "cluster mode: Faust stream processor over the Kafka topics",
        "A Faust worker that consumes window summaries and throughput from Kafka, keeps "
        "baselines in changelog-backed tables, publishes anomaly events and serves metrics.",
    ),
    Command(
        "fit",
        "ncclwatch.detectors.fit",
        "fit a cold-start bandwidth model (scikit-learn) from history",
        "Learns expected bus bandwidth per transport class and message size from recorded "
        "op records (files or a topic) and saves a model file the detectors load.",
    ),
    Command(
        "replay",
        "ncclwatch.detectors.replay",
        "replay a historic run from Kafka or files into a detector run or topic",
        "Replays records by time range or offsets, at a speed factor, into a fresh detector "
        "run, into files, or from files into topics (live topics only with an explicit flag).",
    ),
    Command(
        "eval",
        "ncclwatch.detectors.evaluate",
        "score anomaly events against a labelled scenario",
        "Precision, recall, F1, detection delay and attribution accuracy of anomaly events "
        "against labelled fault intervals; a table, or JSON for CI.",
    ),
    Command(
        "report",
        "ncclwatch.dashboards.report",
        "PNG plots and a Markdown summary of a recorded run",
        "Plots bus bandwidth over time per key with anomalies shaded and job throughput "
        "overlaid, for people who want a picture without Grafana.",
    ),
    Command(
        "alert-test",
        "ncclwatch.alerting.alert_test",
        "send a clearly labelled test alert end to end",
        "Sends a test alert to the configured Alertmanager, then resolves it, so an operator "
        "can check that the route reaches on-call.",
    ),
    Command(
        "config",
        "ncclwatch.config_cmd",
        "print the example configuration or the effective one (secrets redacted)",
        "`ncclwatch config example` prints every key with its default; "
        "`ncclwatch config show` prints the effective configuration with secrets redacted.",
    ),
)


def _load(cmd: Command):
    """Import a command's module, or None while its component is not written yet."""
    try:
        return importlib.import_module(cmd.module)
    except ModuleNotFoundError as e:
        if e.name is None or not cmd.module.startswith(e.name):
            raise
        return None


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, object]:
    """The parser; only the chosen command's module is imported (Faust is slow to import)."""
    parser = argparse.ArgumentParser(
        prog="ncclwatch",
        description="Tells, while a training job runs, when and where its NCCL "
        "communication degrades and whether that costs the job throughput.",
    )
    parser.add_argument("--version", action="version", version=f"ncclwatch {__version__}")
    parser.add_argument("-c", "--config", help="TOML config file (default: $NCCLWATCH_CONFIG)")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description)
        if cmd.name == chosen:
            module = _load(cmd)
            if module is not None and hasattr(module, "add_arguments"):
                module.add_arguments(p)
    return parser, module


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, module = build_parser(argv)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if module is None or not hasattr(module, "run"):
        print(f"ncclwatch {args.command}: not implemented yet", file=sys.stderr)
        return 3
    try:
        cfg = config.load(args.config)
    except config.ConfigError as e:
        print(f"ncclwatch: configuration error: {e}", file=sys.stderr)
        return 2
    return int(module.run(args, cfg) or 0)


if __name__ == "__main__":
    sys.exit(main())
