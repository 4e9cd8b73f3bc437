"""The C plugin's ``progress`` records: written only while a communicator has stopped
making progress, one per communicator of the process, and never by a healthy job.

Runs the progress-* scenarios of ``tests/plugin/driver.c`` by name (``NW_TEST_ONLY``; a
full driver run removes their spools after checking them in C, see the driver), then
reads what they wrote:

- progress-hang: ``NCCLWATCH_PROGRESS_MS=500``, one communicator with an AllReduce hung
  for 2.5 s, one idle; then the AllReduce completes and a few ops follow;
- progress-normal: ``NCCLWATCH_PROGRESS_MS=100``, back-to-back ops and idle gaps;
- progress-balance: every way an op leaves its slot, then an op stuck for 350 ms;
- progress-off: ``NCCLWATCH_PROGRESS_MS=0`` and a stuck op;
- progress-config: ``NCCLWATCH_PROGRESS_MS=abc`` (then ``50``): warned, default 1000 ms.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections import defaultdict
from pathlib import Path

import jsonschema
import pytest
from test_plugin_output import BUILD, PLUGIN, _lines, _segments

from ncclwatch import records

SCENARIOS = ("progress-hang", "progress-normal", "progress-balance", "progress-off", "progress-config")
KEYS = [
    "v",
    "kind",
    "job",
    "host",
    "pid",
    "gpu",
    "comm",
    "comm_name",
    "rank",
    "nranks",
    "ts_ns",
    "issued",
    "colls",
    "done",
    "in_flight",
    "waiting_since_ns",
    "last_done_ns",
]


class Run:
    def __init__(self, out: Path, stderr: str) -> None:
        self.out = out
        self.stderr = stderr

    def lines(self, scenario: str) -> list[dict]:
        return [json.loads(x) for p in _segments(self.out / scenario) for x in _lines(p)]

    def progress(self, scenario: str) -> list[dict]:
        return [x for x in self.lines(scenario) if x["kind"] == "progress"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    targets = [f"build/normal/{t}" for t in ("libncclwatch-profiler.so", "driver", "cuda/libcuda.so.1")]
    subprocess.run(["make", "-s", "-C", str(PLUGIN), *targets], check=True, timeout=300)
    out = tmp_path_factory.mktemp("plugin-progress")
    # NW_TEST_VERBOSE: the driver echoes what the plugin tells NCCL's logger on stderr.
    env = {**os.environ, "NW_TEST_ONLY": ",".join(SCENARIOS), "NW_TEST_VERBOSE": "1"}
    done = subprocess.run(
        [str(BUILD / "driver"), str(BUILD / "libncclwatch-profiler.so"), str(out), "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return Run(out, done.stderr)


def test_progress_lines_are_contract_records_with_the_ops_fields(run: Run) -> None:
    schema = jsonschema.Draft202012Validator(json.loads(records.schema_path("progress").read_text()))
    seen = 0
    for scenario in SCENARIOS:
        lines = run.lines(scenario)
        ops = {x["comm"]: x for x in lines if x["kind"] == "op"}
        for p in (x for x in lines if x["kind"] == "progress"):
            seen += 1
            assert list(p) == KEYS
            schema.validate(p)
            rec = records.parse_line(json.dumps(p))
            assert isinstance(rec, records.ProgressRecord), rec
            assert p["in_flight"] == p["issued"] - p["done"] >= 0
            assert all(p[k] >= 0 for k in KEYS[10:])
            # Exactly what this process's op lines carry for the communicator.
            op = ops[p["comm"]]
            for k in ("job", "host", "pid", "gpu", "comm", "comm_name", "rank", "nranks"):
                assert p[k] == op[k], k
    assert seen >= 4


def test_a_hung_collective_is_reported_for_every_communicator_until_it_completes(run: Run) -> None:
    lines = run.lines("progress-hang")
    by_comm: dict[str, list[dict]] = defaultdict(list)
    for p in (x for x in lines if x["kind"] == "progress"):
        by_comm[p["comm_name"]].append(p)
    assert set(by_comm) == {"stuck", "idle"}
    stuck, idle = by_comm["stuck"], by_comm["idle"]
    assert len(stuck) >= 2 and len(idle) >= 2
    (hung,) = [x for x in lines if x["kind"] == "op" and x["comm_name"] == "stuck" and x["seq"] == 3]
    hung_end = hung["start_ns"] + hung["exec_ns"]
    assert hung["exec_ns"] >= 2_400_000_000
    for p in stuck:
        assert (p["in_flight"], p["issued"], p["colls"], p["done"]) == (1, 5, 4, 4)
        assert abs(p["waiting_since_ns"] - hung["start_ns"]) < 1_000_000_000
        assert p["ts_ns"] - p["waiting_since_ns"] >= 500_000_000  # only after the interval
        assert 0 < p["last_done_ns"] <= p["waiting_since_ns"]
    ts = [p["ts_ns"] for p in stuck]
    assert ts == sorted(ts) and len(set(ts)) == len(ts)
    assert all(b - a >= 450_000_000 for a, b in zip(ts, ts[1:], strict=False))  # once per interval
    for p in idle:
        assert (p["in_flight"], p["waiting_since_ns"], p["issued"], p["done"]) == (0, 0, 2, 2)
    assert sorted(p["ts_ns"] for p in idle) == ts  # written together
    # Nothing once the AllReduce completed (a few ops and 0.7 s followed). The hung op ends
    # when its channel's stop arrives, a few microseconds after the time it carries.
    assert max(ts) < hung_end + 50_000_000


def test_normal_traffic_writes_no_progress_line(run: Run) -> None:
    lines = run.lines("progress-normal")
    assert sum(x["kind"] == "op" for x in lines) > 100
    assert run.progress("progress-normal") == []


def test_every_way_out_of_a_slot_counts_as_done(run: Run) -> None:
    progress = run.progress("progress-balance")
    assert progress, "the stuck op at the end is reported"
    # Only the final stuck op: the counters came back to balance after untimed drops,
    # host-timed, sampled-out and reaped ops (and pool_full starts were never counted).
    last = progress[-1]
    assert last["in_flight"] == 1
    assert all(p["issued"] == last["issued"] and p["in_flight"] == 1 for p in progress)


def test_progress_ms_zero_turns_them_off(run: Run) -> None:
    assert sum(x["kind"] == "op" for x in run.lines("progress-off")) == 3
    assert run.progress("progress-off") == []


def test_a_bad_progress_ms_is_warned_like_other_knobs_and_the_default_used(run: Run) -> None:
    # The shape of every integer knob's warning (config.c nw_env_u64).
    assert re.search(
        r'ncclwatch: ignoring NCCLWATCH_PROGRESS_MS="abc": expected an integer in \[100, 600000\]; using 1000',
        run.stderr,
    )
    assert 'ignoring NCCLWATCH_PROGRESS_MS="50": expected an integer in [100, 600000]; using 1000' in run.stderr
    (p,) = run.progress("progress-config")  # 1.8 s stuck at the default 1000 ms: one line
    assert p["in_flight"] == 1 and p["ts_ns"] - p["waiting_since_ns"] >= 1_000_000_000
