"""The ``ncclwatch`` command line, run as a real process: global options, exit codes, pipes, TOML."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ncclwatch import __version__, config

REPO = Path(__file__).resolve().parents[1]


def ncclwatch(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter, with no NCCLWATCH_* variables but ``env``'s."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("NCCLWATCH_")}
    kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kw}
    return subprocess.run([sys.executable, "-m", "ncclwatch.cli", *args], env={**base, **(env or {})},
                          text=True, timeout=60, **kw)


@pytest.fixture
def cfg_file(tmp_path: Path) -> Path:
    path = tmp_path / "prod.toml"
    path.write_text('[topics]\nprefix = "prod."\n\n[detector]\nthreshold = 0.25\n')
    return path


@pytest.mark.parametrize("where", ["before", "after", "between"])
def test_config_file_option_works_before_and_after_the_command(cfg_file, where):
    args = {
        "before": ["-c", str(cfg_file), "config", "show"],
        "after": ["config", "show", "--config", str(cfg_file)],
        "between": ["config", f"--config={cfg_file}", "show"],
    }[where]
    r = ncclwatch(*args)
    assert r.returncode == 0, r.stderr
    shown = tomllib.loads(r.stdout)
    assert shown["detector"]["threshold"] == 0.25
    assert shown["topics"]["ops"] == "prod.nccl.ops"


def test_a_missing_config_file_is_a_usage_error_with_exit_2(tmp_path):
    r = ncclwatch("config", "show", "-c", str(tmp_path / "nope.toml"))
    assert r.returncode == 2 and "config file not found" in r.stderr


def test_version_and_documented_exit_codes():
    r = ncclwatch("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ncclwatch {__version__}"
    help_text = ncclwatch("--help").stdout
    for code in ("0", "1", "2", "130", "141"):
        assert f"\n  {code} " in help_text, code
    assert "exit status:" in ncclwatch("config", "--help").stdout
    assert ncclwatch("config", "show", "--no-such-flag").returncode == 2


def test_a_closed_output_pipe_exits_quietly_without_a_traceback():
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head` that has already gone: every write gets EPIPE
    try:
        r = ncclwatch("config", "example", stdout=write_end)
    finally:
        os.close(write_end)
    assert r.returncode == 141
    assert r.stderr == "", r.stderr


def test_config_show_prints_toml_that_parses_back_to_the_effective_config_with_secrets_redacted():
    env = {
        "NCCLWATCH_KAFKA_SASL_PLAIN_PASSWORD": "hunter2",
        "NCCLWATCH_ALERTING_ALERTMANAGER_BEARER_TOKEN": "tok-secret",
        "NCCLWATCH_INGEST_THROUGHPUT_REGEX": r'step (?P<tflops>\d+) "q" \t',
        "NCCLWATCH_DETECTOR_THRESHOLD": "1e-05",
        "NCCLWATCH_ALERTING_ALERT_LABELS": "team=ml-infra,cluster=eu\u00e9",
    }
    r = ncclwatch("config", "show", env=env)
    assert r.returncode == 0, r.stderr
    assert "hunter2" not in r.stdout and "tok-secret" not in r.stdout
    shown = tomllib.loads(r.stdout)
    assert shown == config.redacted(config.load(None, environ=env))
    assert shown["kafka"]["sasl_plain_password"] == "***"
    assert shown["ingest"]["throughput_regex"] == env["NCCLWATCH_INGEST_THROUGHPUT_REGEX"]


def test_config_show_output_loads_back_to_the_same_config(tmp_path):
    env = {"NCCLWATCH_TOPICS_PREFIX": "run7.", "NCCLWATCH_TOPICS_OPS": "custom.ops"}
    shown = ncclwatch("config", "show", env=env).stdout
    path = tmp_path / "shown.toml"
    path.write_text(shown)
    again = ncclwatch("config", "show", "-c", str(path))
    assert again.returncode == 0, again.stderr
    assert again.stdout == shown


def test_one_topic_prefix_renames_every_topic():
    cfg = config.load(None, environ={"NCCLWATCH_TOPICS_PREFIX": "run7."})
    names = [getattr(cfg.topics, f) for f in config.TOPIC_NAME_FIELDS]
    assert names == ["run7." + getattr(config.TopicsConfig(), f) for f in config.TOPIC_NAME_FIELDS]
    assert config.TopicsConfig(prefix="a.", ops="mine").ops == "a.mine"
    with pytest.raises(config.ConfigError, match="prefix"):
        config.load(None, environ={"NCCLWATCH_TOPICS_PREFIX": "run 7/"})


def test_config_example_is_the_shipped_example_file_and_parses():
    r = ncclwatch("config", "example")
    assert r.stdout == (REPO / "ncclwatch" / "config.example.toml").read_text()
    assert tomllib.loads(r.stdout) == config.redacted(config.Config())


@pytest.mark.parametrize("name,value", [("transfer_confirm", "2"), ("transfer_confirm", "-0.1"),
                                        ("link_share_rise", "1.5"), ("link_share_rise", "-0.1"),
                                        ("reopen_s", "-1"), ("merge_max_hold_s", "0"),
                                        ("quiet_end_s", "-1")])
def test_the_detector_knobs_of_2026_11_26_refuse_values_out_of_range(name, value):
    with pytest.raises(config.ConfigError, match=f"detector.{name}"):
        config.load(None, environ={f"NCCLWATCH_DETECTOR_{name.upper()}": value})
    assert getattr(config.load(None, environ={}).detector, name) > -1  # the default loads
