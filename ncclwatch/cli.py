"""The ``ncclwatch`` command.

Each sub-command lives in its component and exposes two functions::

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace, cfg: ncclwatch.config.Config) -> int: ...

This file only lists them, so components plug in without touching each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import logging
import os
import sys
from dataclasses import dataclass

from ncclwatch import __version__, config, redact
from ncclwatch.ingest.external_sort import SortSpaceError


@dataclass(frozen=True)
class Command:
    name: str
    module: str
    help: str
    description: str
    # Needs Kafka from its start: credentials Kafka refuses end it with a clear message
    # (exit 1) instead of a client retrying forever.
    checks_kafka_credentials: bool = False


COMMANDS = (
    Command(
        "watch",
        "ncclwatch.detectors.watch",
        "single-node mode: tail the spool or Inspector logs, detect, serve metrics, alert (no Kafka)",
        "Tails the plugin's spool directory (or NCCL Inspector's JSON logs, and training logs) "
        "directly and runs the detectors in-process. Pointed at a recording with --speed it "
        "replays it, so detection can be seen without a GPU. Serves Prometheus metrics and "
        "sends alerts when Alertmanager is configured, else prints them.",
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
        checks_kafka_credentials=True,
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
        "run, into files, or from files into topics (live topics only with an explicit flag). "
        "Files: a spool, NCCL Inspector JSON logs, a recorded run, an archive, training logs.",
    ),
    Command(
        "eval",
        "ncclwatch.detectors.evaluate",
        "score anomaly events against a labelled scenario",
        "Precision, recall, F1, detection delay and attribution accuracy of anomaly events "
        "(or of the detectors run over a recording) against labelled fault intervals; a "
        "table, or JSON for CI.",
    ),
    Command(
        "report",
        "ncclwatch.dashboards.report",
        "PNG plots and a Markdown summary of a recorded run",
        "Plots bus bandwidth over time per key with anomalies shaded, the baseline band and "
        "job throughput overlaid, for people who want a picture without Grafana. Reads a "
        "spool, NCCL Inspector JSON logs, a recorded run or an archive of one.",
    ),
    Command(
        "alert-test",
        "ncclwatch.alerting.alert_test",
        "send a clearly labelled test alert end to end",
        "Sends a test alert to the configured Alertmanager, then resolves it, so an operator "
        "can check that the route reaches on-call.",
    ),
    Command(
        "alert-rules",
        "ncclwatch.alerting.prom_rules",
        "print the Prometheus alerting rules with this deployment's Grafana and runbook links",
        "Prints alerting/rules/ncclwatch.rules.yml with dashboard_url and runbook_url made from "
        "[alerting] grafana_url and runbook_base_url (or the options), for Prometheus's rule_files.",
    ),
    Command(
        "plugin-path",
        "ncclwatch.plugin_cmd",
        "print the path of the NCCL profiler plugin (for NCCL_PROFILER_PLUGIN)",
        "Prints where the profiler plugin is: inside the wheel (Linux x86-64), a checkout's "
        "plugin/build/, or /opt/ncclwatch/lib; --all lists every place looked at.",
    ),
    Command(
        "config",
        "ncclwatch.config_cmd",
        "print the example configuration or the effective one (secrets redacted)",
        "`ncclwatch config example` prints every key with its default; "
        "`ncclwatch config show` prints the effective configuration with secrets redacted.",
    ),
)


EXIT_CODES = """\
exit status:
  0    success (`worker --until-caught-up`: every input read to where it ended at start)
  1    failure at run time: a service unreachable or refusing, a crashed worker
  2    usage or configuration error: bad option, unknown config key, missing file
  3    the command is not available in this installation
  130  interrupted (Ctrl-C)
  141  the output pipe closed early (`ncclwatch ... | head`); nothing is printed about it
"""
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a program killed by it


def _load(cmd: Command):
    """Import a command's module, or None while its component is not written yet."""
    try:
        return importlib.import_module(cmd.module)
    except ModuleNotFoundError as e:
        if e.name is None or not cmd.module.startswith(e.name):
            raise
        return None


def _command_in(argv: list[str]) -> str | None:
    """The command word: the first argument that is neither a global option nor its value.

    >>> _command_in(["-c", "prod.toml", "-vv", "watch", "--speed", "1"])
    'watch'
    >>> _command_in(["--config=prod.toml", "config", "show"]), _command_in(["-vc", "f", "fit"])
    ('config', 'fit')
    """
    args = iter(argv)
    for arg in args:
        if arg == "--":
            return next(args, None)
        if arg in ("-c", "--config") or (arg.startswith("-") and not arg.startswith("--") and arg.lstrip("-v") == "c"):
            next(args, None)  # the option's value
        elif not arg.startswith("-"):
            return arg
    return None


def _global_options(parser: argparse.ArgumentParser, default: object) -> None:
    """-c and -v, accepted before and after the command (``default`` SUPPRESS after it, so
    an option given before the command is not reset by the command's parser)."""
    parser.add_argument("-c", "--config", metavar="FILE", default=default,
                        help="TOML config file (default: $NCCLWATCH_CONFIG, else built-in defaults)")
    parser.add_argument("-v", "--verbose", action="count", default=0 if default is None else default,
                        help="more logging (-vv: debug)")


def _serves_metrics(parser: argparse.ArgumentParser) -> bool:
    return any("--metrics-port" in a.option_strings for a in parser._actions)


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, object]:
    """The parser; only the chosen command's module is imported (Faust is slow to import)."""
    parser = argparse.ArgumentParser(
        prog="ncclwatch",
        description="Tells, while a training job runs, when and where its NCCL "
        "communication degrades and whether that costs the job throughput.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ncclwatch {__version__}")
    _global_options(parser, None)
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = _command_in(argv)
    module = None
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description, parents=[common],
                           epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
        if cmd.name == chosen:
            module = _load(cmd)
            if module is not None and hasattr(module, "add_arguments"):
                module.add_arguments(p)
            if _serves_metrics(p):
                p.add_argument("--metrics-addr", metavar="ADDR", default=None,
                               help="address the metrics server binds to (default: config "
                               "ingest.metrics_addr or detector.metrics_addr, 127.0.0.1; "
                               "0.0.0.0 for every interface)")
    return parser, module


def _with_overrides(cfg: config.Config, args: argparse.Namespace) -> config.Config:
    """Command-line options that stand for config keys (they win over file and environment)."""
    addr = getattr(args, "metrics_addr", None)
    if addr:
        cfg = dataclasses.replace(
            cfg,
            ingest=dataclasses.replace(cfg.ingest, metrics_addr=addr),
            detector=dataclasses.replace(cfg.detector, metrics_addr=addr),
        )
    return cfg


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the flush at exit does not fail again on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, io.UnsupportedOperation):  # not a real file (tests capture it)
        pass


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
        cfg = _with_overrides(config.load(args.config), args)
    except config.ConfigError as e:
        print(f"ncclwatch: configuration error: {e}", file=sys.stderr)
        return 2
    # Before any client is built: no log record, of any library at any level, may carry
    # a password, a token or a broker address (ncclwatch/redact.py).
    redact.install_for(cfg)
    cmd = next(c for c in COMMANDS if c.name == args.command)
    if cmd.checks_kafka_credentials and cfg.kafka.security_protocol != "PLAINTEXT":
        from ncclwatch.ingest.kafka_sink import check_credentials

        refused = check_credentials(cfg.kafka)
        if refused:
            print(f"ncclwatch {args.command}: {refused}", file=sys.stderr)
            return 1
    try:
        rc = int(module.run(args, cfg) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the try, not at exit
    except config.ConfigError as e:  # a setting only a command reads (a metrics web config, say)
        print(f"ncclwatch {args.command}: configuration error: {e}", file=sys.stderr)
        return 2
    except SortSpaceError as e:  # a replay longer than memory, and no room to sort it on disk
        print(f"ncclwatch {args.command}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return rc


if __name__ == "__main__":
    sys.exit(main())
