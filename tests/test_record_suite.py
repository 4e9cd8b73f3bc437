"""`record.py suite`'s summary names each run's own injector, not the --injector default.

The runs themselves need GPUs; here `run_scenario` stands in for them (it is the
recorder's own function, not a service), so only the bookkeeping around it runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "scenarios"))

import record  # noqa: E402


def test_the_summary_names_each_runs_injector_and_keeps_failed_runs(tmp_path, monkeypatch):
    plan = [
        {"name": "p-pulse", "scenario": "congestion", "injector": "pulse:on=1,off=3+tc:rate=8gbit,dev=lo"},
        {"name": "p-strag", "scenario": "straggler", "straggler_rank": "1"},
        {"name": "p-clean", "scenario": "clean"},
        {"name": "p-cpu", "scenario": "congestion"},
    ]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    seen = []

    def fake_run(args, scenario, name):
        seen.append((name, args.injector))
        if name == "p-clean":
            raise RuntimeError("no GPU here")
        return tmp_path / f"{name}.tar.gz"

    monkeypatch.setattr(record, "run_scenario", fake_run)
    args = record.build_parser().parse_args(
        ["suite", "--plan", str(tmp_path / "plan.json"), "--out", str(tmp_path / "out")])
    record.suite(args)
    summary = json.loads((tmp_path / "out" / "suite.json").read_text())
    assert "injector" not in summary
    assert summary["injectors"] == {
        "p-pulse": "pulse:on=1,off=3+tc:rate=8gbit,dev=lo", "p-strag": None, "p-clean": None,
        "p-cpu": "cpu:k=2",  # a congestion run without its own: the default, which it used
    }
    assert seen[1] == ("p-strag", "cpu:k=2")  # the plan's override did not leak into later runs
    assert summary["runs"]["p-clean"].startswith("failed: RuntimeError")
