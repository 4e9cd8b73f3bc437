"""Runs recorded on 2×H200 (tests/fixtures/gpu_runs), replayed through the detectors.

The recordings are real plugin output from ``bench/scenarios`` (one NVLink communicator
and one forced onto NCCL's socket transport, see ``tests/fixtures/gpu_runs/README.md``):
a clean run, a network-path congestion run and a straggler run, each with ground-truth
labels. The tests check, in order:

1. the recordings themselves: valid records, the two transport classes, labels that name
   what is in the recording, and the effect the fault had (measured from the ops and the
   job's TFLOP/s, independent of any detector);
2. ``ncclwatch watch`` (local mode, no Kafka) on each recording;
3. the cluster path, ``ncclwatch forward`` → Kafka → ``ncclwatch worker`` (Faust), on the
   real broker, which must report what ``watch`` reports.

Detection delay is measured from the labelled fault start (the injector's ``start()``).
Its bound for a network fault, ``(sustain_windows + 1 + 2) × window_s`` = 6 s with the
defaults: the first degraded window may hold less than a window of fault, the rule needs
``sustain_windows`` degraded windows, and a rank group waits up to 2 windows for late ranks
before it closes. A straggler only has to be reported while it lasts (its label's
length): see docs/gpu-runs.md for why the current detector is slower there.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from ncclwatch.detectors.evaluate import evaluate, read_events
from ncclwatch.detectors.labels import LabelSet
from ncclwatch.detectors.messages import message_lines
from ncclwatch.ingest.recording import ReadStats, read_recording

from ncclwatch import cli
from ncclwatch.config import load
from ncclwatch.records import OpRecord, ThroughputRecord, parse_line

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "gpu_runs"
SCENARIOS = ("clean", "congestion", "straggler")
COMM_TYPES = {"collective_degraded", "network_path", "intra_node", "straggler"}

sys.path.insert(0, str(ROOT / "bench" / "scenarios"))
from make_fixtures import arrival_lateness_s, effects, read_spool_records  # noqa: E402

CFG = load(None, environ={})
NETWORK_DELAY_BOUND_S = (CFG.detector.sustain_windows + 1 + 2) * CFG.ingest.window_s


def labels(name: str) -> LabelSet:
    return LabelSet.load(FIXTURES / f"{name}.labels.json")


def required(name: str):
    return [lb for lb in labels(name).labels if not lb.optional]


def run_info(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.run.json").read_text())


def comm_of(name: str, transport: str) -> str:
    (comm,) = [c["comm"] for c in run_info(name)["comms"].values()
               if c["transport_expected"] == transport]
    return comm


@pytest.fixture(scope="module")
def raw_records(tmp_path_factory) -> dict[str, list[dict]]:
    """Each recording's records as plain dicts, for measuring the faults themselves."""
    out = {}
    for name in SCENARIOS:
        d = tmp_path_factory.mktemp(name)
        with tarfile.open(FIXTURES / f"{name}.tar.gz") as tar:
            tar.extractall(d, filter="data")
        out[name] = read_spool_records(d)
    return out


# -- 0. the scenario job's layout, for any number of GPUs and pretend nodes ------------------

@pytest.mark.parametrize(("gpus", "nodes", "world", "transports"), [
    (2, 2, 4, {"nvlink": 1, "net": 1}),  # what was recorded: two processes per GPU
    (4, 2, 4, {"mixed": 1, "nvlink": 2, "net": 2}),  # issue 8: a truly mixed communicator
    (8, 8, 16, {"nvlink": 1, "net": 1}),
    (8, 2, 8, {"mixed": 1, "nvlink": 2, "net": 4}),
    (4, 1, 4, {"nvlink": 1}),
])
def test_scenario_layout_gives_each_gpu_count_its_communicator_classes(gpus, nodes, world,
                                                                       transports):
    from topology import layout

    t = layout(gpus, nodes)
    assert t.world_size == world
    counts: dict[str, int] = {}
    for c in t.comms:
        counts[c.transport] = counts.get(c.transport, 0) + 1
        # every member of a communicator is on a different GPU, one process per GPU each
        assert len({t.process(r).gpu for r in c.ranks}) == len(c.ranks)
        assert c.nnodes == len({t.process(r).host_id for r in c.ranks})
    assert counts == transports
    # NVLink-only communicators never span two host ids, network ones always do
    assert all((c.transport == "nvlink") == (c.nnodes == 1) for c in t.comms)


def test_scenario_scripts_doctests_pass():
    import doctest

    import faults
    import topology

    for mod in (topology, faults):
        result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, mod.__name__


def test_the_process_freezer_stops_a_process_part_of_the_time_and_always_lets_it_go():
    import time

    import faults

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        freezer = faults.ProcessFreezer(child.pid, duty=0.5, period_s=0.1)
        freezer.start()
        time.sleep(0.45)
        freezer.stop()
        state = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert freezer.stops >= 3 and freezer.error == ""
        assert state != "T"  # continued, not left stopped
        with pytest.raises(ValueError):
            faults.ProcessFreezer(child.pid, duty=1.0, period_s=0.1)
    finally:
        child.kill()
        child.wait()


# -- 1. the recordings ---------------------------------------------------------------------

@pytest.mark.parametrize("name", SCENARIOS)
def test_every_line_of_a_recording_is_a_valid_contract_record_with_gpu_timing(name):
    stats = ReadStats()
    records = read_recording([FIXTURES / f"{name}.tar.gz"], stats)
    assert stats.quarantined == {} and stats.partial_lines == 0
    ops = [r for r in records if isinstance(r, OpRecord)]
    tput = [r for r in records if isinstance(r, ThroughputRecord)]
    assert len(ops) > 5000 and len(tput) > 500
    assert {r.timing for r in ops} == {"kernel_gpu"}
    assert {r.source for r in tput} == {"api"} and {r.rank for r in tput} == {-1}


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_recording_has_an_nvlink_and_a_socket_communicator_of_two_processes_each(name,
                                                                                   raw_records):
    comms: dict[str, dict] = {}
    for r in raw_records[name]:
        if r["kind"] == "op":
            c = comms.setdefault(r["comm"], {"pids": set(), "shape": set()})
            c["pids"].add(r["pid"])
            c["shape"].add((r["transport"], r["nranks"], r["nnodes"]))
    by_transport = {next(iter(c["shape"]))[0]: c for c in comms.values()}
    assert len(comms) == 2 and set(by_transport) == {"nvlink", "net"}
    assert by_transport["nvlink"]["shape"] == {("nvlink", 2, 1)}
    assert by_transport["net"]["shape"] == {("net", 2, 2)}  # NCCL_HOSTID made two nodes
    # Four processes, two per GPU, none in both communicators.
    assert not by_transport["nvlink"]["pids"] & by_transport["net"]["pids"]
    assert {comm_of(name, "nvlink"), comm_of(name, "net")} == set(comms)


@pytest.mark.parametrize("name", SCENARIOS)
def test_labels_name_communicators_and_keys_that_the_recording_holds(name, raw_records):
    keys = {(r["comm"], r["op"], r["transport"]) for r in raw_records[name] if r["kind"] == "op"}
    ls = labels(name)
    assert ls.job == f"gpu-{name}"
    assert {r["job"] for r in raw_records[name]} == {ls.job}
    for lb in ls.labels:
        assert lb.end_ns - lb.start_ns >= 20 * 10**9
        assert lb.keys and all((k["comm"], k["op"], k["transport"]) in keys for k in lb.keys)
        assert lb.comm in {k[0] for k in keys}
    assert [lb.type for lb in required(name)] == {
        "clean": [], "congestion": ["network_path"], "straggler": ["straggler"]}[name]


def test_congestion_cut_network_busbw_and_throughput_while_nvlink_stayed_flat(raw_records):
    (lb,) = required("congestion")
    eff = effects(raw_records["congestion"], lb.start_ns, lb.end_ns)
    big = [e for e in eff["busbw_gbs"] if e.get("n_during", 0) > 100]
    net = [e["change"] for e in big if e["comm"] == lb.comm]
    nvlink = [e["change"] for e in big if e["transport"] == "nvlink"]
    assert net and all(c <= -0.10 for c in net), eff  # the issue asks for >= 10 % busbw
    assert nvlink and all(abs(c) <= 0.10 for c in nvlink), eff
    assert eff["tflops_per_gpu"]["change"] <= -0.10


def test_straggler_made_its_nvlink_peer_wait_and_cost_throughput(raw_records):
    (lb,) = required("straggler")
    recs = raw_records["straggler"]
    before = arrival_lateness_s(recs, lb.comm, lb.rank, lb.start_ns - 20 * 10**9, lb.start_ns)
    during = arrival_lateness_s(recs, lb.comm, lb.rank, lb.start_ns + 2 * 10**9, lb.end_ns)
    # 5 extra matmuls ≈ 15 ms: late by that at the AllReduce, by ~2 ms at the ReduceScatter
    # (the median over both), against a fraction of a millisecond before.
    assert abs(before) < 0.001 and during > 0.005
    assert effects(recs, lb.start_ns, lb.end_ns)["tflops_per_gpu"]["change"] <= -0.10


def test_clean_run_throughput_is_steady(raw_records):
    tput = sorted((r["ts_ns"], r["tflops_per_gpu"]) for r in raw_records["clean"]
                  if r["kind"] == "throughput")
    overall = statistics.median(v for _, v in tput)
    t0 = tput[0][0]
    buckets: dict[int, list[float]] = {}
    for t, v in tput:
        buckets.setdefault((t - t0) // (5 * 10**9), []).append(v)
    assert all(abs(statistics.median(v) / overall - 1) < 0.03 for v in buckets.values())


# -- checks on anomaly events, shared by both drivers ------------------------------------------

def firing(events: list[dict]) -> list[dict]:
    return [e for e in events if e["state"] == "firing"]


def check_clean(events: list[dict]) -> None:
    assert events == []


def check_congestion(events: list[dict], measured_drop: float) -> float:
    """Network path on the socket communicator only, costing throughput; returns the delay."""
    (lb,) = required("congestion")
    comm_events = [e for e in events if e["type"] in COMM_TYPES]
    assert comm_events and {e["key"]["comm"] for e in comm_events} == {lb.comm}, comm_events
    assert all(e["type"] == "network_path" and e["attribution"] == "network"
               for e in comm_events), comm_events
    first = firing(comm_events)[0]
    assert first["key"]["transport"] == "net"
    # Correlated with the job's speed: the anomaly carries the TFLOP/s change, and it is the
    # drop the job itself measured (median over the fault) within a few points.
    assert first["throughput_delta"] < -0.05
    assert abs(first["throughput_delta"] - measured_drop) < 0.08
    delay_s = (first["detected_ns"] - lb.start_ns) / 1e9
    assert 0 <= delay_s <= NETWORK_DELAY_BOUND_S
    assert first["start_ns"] <= lb.start_ns + 10**9  # it dates the degradation from the fault
    return delay_s


def check_straggler(events: list[dict]) -> float:
    """A straggler anomaly naming a process on the straggling GPU, soon after the fault began.

    Two processes share GPU 1: the injected straggler (rank 1 of the NVLink communicator,
    the required label) and rank 1 of the socket communicator, which the extra compute on
    that GPU made late too (the optional label). Naming either names GPU 1; naming any
    rank of GPU 0 would be wrong.
    """
    on_gpu1 = {(lb.comm, lb.rank) for lb in labels("straggler").labels}
    (lb,) = required("straggler")
    strag = firing([e for e in events if e["type"] == "straggler"])
    assert strag, events
    assert {(e["key"]["comm"], e["rank"]) for e in strag} <= on_gpu1
    assert all(e["attribution"] == "straggler" and e["host"] == lb.host for e in strag)
    delay_s = (strag[0]["detected_ns"] - lb.start_ns) / 1e9
    # 3 sustained windows + 1 partial + 2 of lateness, as for congestion.
    assert 0 <= delay_s <= 6.0
    return delay_s


def measured_drop(raw: list[dict]) -> float:
    (lb,) = required("congestion")
    return effects(raw, lb.start_ns, lb.end_ns)["tflops_per_gpu"]["change"]


# -- 2. ncclwatch watch (local mode) ----------------------------------------------------------

@pytest.fixture(scope="module")
def watch_events(tmp_path_factory) -> dict[str, list[dict]]:
    out = {}
    d = tmp_path_factory.mktemp("watch")
    for name in SCENARIOS:
        path = d / f"{name}.events.jsonl"
        rc = cli.main(["watch", str(FIXTURES / f"{name}.tar.gz"), "--events-out", str(path),
                       "--metrics-port", "-1", "--status-every-s", "0"])
        assert rc == 0
        out[name] = ([json.loads(x) for x in path.read_text().splitlines() if x]
                     if path.exists() else [])
        for e in out[name]:
            assert parse_line(json.dumps(e)).KIND == "anomaly"
    return out


def test_watch_raises_nothing_on_the_clean_run(watch_events):
    check_clean(watch_events["clean"])


def test_watch_reports_congestion_as_network_path_on_the_socket_comm_with_the_throughput_cost(
        watch_events, raw_records):
    delay_s = check_congestion(watch_events["congestion"], measured_drop(raw_records["congestion"]))
    assert delay_s < NETWORK_DELAY_BOUND_S


def test_watch_names_the_straggling_rank(watch_events):
    check_straggler(watch_events["straggler"])


def test_eval_finds_every_labelled_fault_and_no_false_alarm(watch_events, tmp_path):
    pairs = []
    for name in SCENARIOS:
        ev = tmp_path / f"{name}.events.jsonl"
        ev.write_text("".join(json.dumps(e) + "\n" for e in watch_events[name]))
        pairs.append((labels(name), read_events(ev)))
    report = evaluate(pairs, 5.0)
    total = report["total"]
    assert total["labels"] == 2 and total["detected"] == 2
    assert total["anomalies_fp"] == 0


# -- 3. forwarder windows, Kafka, Faust worker ---------------------------------------------

def _in_time_order(names) -> list:
    """The reference: the recordings' windows as the Windower makes them from ops in
    record-time order (and the other records), to compare the forwarder's windows with."""
    from ncclwatch.ingest.windows import Windower

    windower = Windower(CFG.ingest.window_s)
    out: list = []
    for rec in read_recording([FIXTURES / f"{n}.tar.gz" for n in names]):
        if isinstance(rec, OpRecord):
            out += windower.add(rec)
        else:
            out.append(rec)
    return out + windower.flush()


@pytest.fixture(scope="module")
def pipeline(kafka_bootstrap, tmp_path_factory) -> dict:
    """The recordings through ``ncclwatch forward --once`` into fresh topics, and what
    the forwarder published there through one ``ncclwatch worker``."""
    from ncclwatch_testkit import services as testing
    from ncclwatch_testkit.drivers import (
        WorkerProcess,
        config_of,
        create_topics,
        read_events,
        read_topic,
        topics_env,
    )

    from ncclwatch.records import to_json

    tmp = tmp_path_factory.mktemp("pipeline")
    spool = tmp / "spool"
    for name in SCENARIOS:
        with tarfile.open(FIXTURES / f"{name}.tar.gz") as tar:
            tar.extractall(spool, filter="data")
    fwd_env = topics_env(kafka_bootstrap)
    create_topics(fwd_env)
    fwd = subprocess.run(
        [sys.executable, "-m", "ncclwatch.cli", "forward", "--once", "--spool", str(spool),
         "--no-delete-acked", "--state-dir", str(tmp / "state"), "--node-id", "gpu-box",
         # gzip: the default lz4 batches are unreadable by the worker's aiokafka here
         # ("Libraries for lz4 compression codec not found": it wants cramjam, not lz4).
         "--compression", "gzip", "--metrics-port", "-1"],
        env={**os.environ, **fwd_env}, capture_output=True, text=True, timeout=300)
    assert fwd.returncode == 0, fwd.stderr[-3000:]
    records = _in_time_order(SCENARIOS)
    windows = [r for r in records if r.KIND == "window"]
    # --once returned after Kafka acknowledged everything: the topic is complete
    forwarded = read_topic(kafka_bootstrap, config_of(fwd_env).topics.windows,
                           min_count=1, idle_s=2.0, timeout_s=120)

    # The worker reads what the forwarder published, in the order it published it.
    expected = sum(len(v) for v in _reference(tmp).values())
    worker = WorkerProcess(fwd_env, testing.unique_name("gpu"), tmp).start()
    try:
        events = read_events(fwd_env, min_count=expected, idle_s=5.0, timeout_s=180)
    finally:
        worker.stop()
    by_job: dict[str, list[dict]] = {name: [] for name in SCENARIOS}
    for e in events:
        by_job[e["job"].removeprefix("gpu-")].append(e)
    return {
        "events": by_job,
        # the forwarder packs windows of one job that close together (JSON lines)
        "forwarded_windows": sorted(line.decode() for m in forwarded for line in message_lines(m.value)),
        "windows": sorted(to_json(w) for w in windows),
        "log": worker.output(),
    }


def _reference(tmp: Path) -> dict[str, list[dict]]:
    """What watch reports, to know how many events the worker should publish."""
    out = {}
    for name in SCENARIOS:
        path = tmp / f"ref-{name}.jsonl"
        cli.main(["watch", str(FIXTURES / f"{name}.tar.gz"), "--events-out", str(path),
                  "--metrics-port", "-1", "--status-every-s", "0"])
        out[name] = ([json.loads(x) for x in path.read_text().splitlines() if x]
                     if path.exists() else [])
    return out


def identity(e: dict) -> tuple:
    return (e["type"], e["state"], e["key"]["comm"], e["attribution"], e["rank"], e["start_ns"])


@pytest.mark.kafka
def test_forward_makes_the_same_windows_of_the_recorded_runs(pipeline):
    assert pipeline["forwarded_windows"] == pipeline["windows"]


@pytest.mark.kafka
def test_kafka_worker_reports_what_watch_reports_on_the_recorded_runs(pipeline, watch_events,
                                                                      raw_records):
    events = pipeline["events"]
    check_clean(events["clean"])
    check_congestion(events["congestion"], measured_drop(raw_records["congestion"]))
    check_straggler(events["straggler"])
    for name in SCENARIOS:
        assert sorted(map(identity, events[name])) == sorted(
            map(identity, watch_events[name])), (name, pipeline["log"])
