"""``ncclwatch replay``: topics by time or offsets into detectors or files; files into topics."""

from __future__ import annotations

import json
import time

import pytest
from ncclwatch.ingest.external_sort import ExternalSort
from ncclwatch.ingest.recording import record_time_ns
from ncclwatch_testkit import services as testing
from ncclwatch_testkit.drivers import (
    WorkerProcess,
    config_of,
    create_topics,
    identity,
    publish,
    read_events,
    read_topic,
    reference_events,
    topics_env,
    window_scenario,
)

from ncclwatch import cli
from ncclwatch.records import to_json

T0_NS = 1_763_800_000 * 10**9


@pytest.fixture(scope="module")
def live_run(kafka_bootstrap, tmp_path_factory):
    """Three runs published to the same topics, far apart in time, and what a live worker
    made of them."""
    env = topics_env(kafka_bootstrap)
    create_topics(env)
    early = window_scenario("job-early", t0_ns=T0_NS - 1000 * 10**9, seconds=60, degrade_from_s=30)
    run = window_scenario("job-x", t0_ns=T0_NS, seconds=70, degrade_from_s=40, recover_at_s=55)
    late = window_scenario("job-late", t0_ns=T0_NS + 1000 * 10**9, seconds=60, degrade_from_s=30)
    records = early + run + late
    publish(env, records)
    worker = WorkerProcess(env, testing.unique_name("app"), tmp_path_factory.mktemp("w")).start()
    try:
        want = len(reference_events(env, records))
        events = read_events(env, min_count=want, idle_s=1.5, timeout_s=90)
    finally:
        worker.stop()
    return {"env": env, "run": run, "records": records, "events": events, "log": worker.output()}


@pytest.fixture
def with_env(live_run, monkeypatch):
    for k, v in live_run["env"].items():
        monkeypatch.setenv(k, v)
    return live_run


def test_replay_by_time_range_into_a_new_detector_run_gives_the_live_anomalies(with_env, tmp_path):
    run, env = with_env["run"], with_env["env"]
    live = [e for e in with_env["events"] if e["job"] == "job-x"]
    assert any(e["state"] == "firing" for e in live), with_env["log"]
    out = tmp_path / "replayed.jsonl"
    since = str(record_time_ns(run[0]) - 10**9)
    until = str(record_time_ns(run[-1]) + 10**9)
    rc = cli.main(
        [
            "replay",
            "--topic",
            env["NCCLWATCH_TOPICS_WINDOWS"],
            "--topic",
            env["NCCLWATCH_TOPICS_THROUGHPUT"],
            "--since",
            since,
            "--until",
            until,
            "--detect",
            "--events-out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    replayed = [json.loads(line) for line in out.read_text().splitlines()]
    # only the run inside the range, and exactly what the live worker said about it
    assert {e["job"] for e in replayed} == {"job-x"}
    assert [identity(e) for e in replayed] == [identity(e) for e in live]
    assert [e["detected_ns"] for e in replayed] == [e["detected_ns"] for e in live]


def test_replaying_a_window_of_a_topic_yields_exactly_its_records(with_env, tmp_path):
    env = with_env["env"]
    windows = [r for r in with_env["records"] if r.KIND == "window"]
    # a range that starts and ends between records, in the middle of a run
    a_ns, b_ns = T0_NS + 10_500_000_000, T0_NS + 20_000_000_000
    want = sorted(to_json(r) for r in windows if a_ns <= record_time_ns(r) < b_ns)
    assert 0 < len(want) < len(windows)
    out = tmp_path / "slice.jsonl.gz"
    rc = cli.main(
        [
            "replay",
            "--topic",
            env["NCCLWATCH_TOPICS_WINDOWS"],
            "--since",
            str(a_ns),
            "--until",
            str(b_ns),
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    import gzip

    with gzip.open(out, "rt") as f:
        got = f.read().splitlines()
    assert sorted(got) == want
    times = [json.loads(g)["end_ns"] for g in got]
    assert times == sorted(times), "records come out in time order"


def _replay_topics(env: dict, tmp_path, tag: str) -> dict[str, object]:
    """What replay makes of both topics: the records in order, the events, a copy's keys."""
    topics = ["--topic", env["NCCLWATCH_TOPICS_WINDOWS"], "--topic", env["NCCLWATCH_TOPICS_THROUGHPUT"]]
    out, events = tmp_path / f"{tag}.jsonl", tmp_path / f"{tag}.events.jsonl"
    copy = testing.unique_name(f"copy-{tag}")
    assert cli.main(["replay", *topics, "--out", str(out), "--no-progress"]) == 0
    assert cli.main(["replay", *topics, "--detect", "--events-out", str(events), "--no-progress"]) == 0
    assert cli.main(["replay", *topics, "--to-topic", copy, "--no-progress"]) == 0
    keys = sorted((m.key, m.value) for m in read_topic(env["NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS"], copy, idle_s=0.3))
    return {"out": out.read_bytes(), "events": events.read_bytes(), "copy": keys}


def test_a_topic_range_longer_than_the_sort_buffer_replays_exactly_as_one_held_in_memory(
        with_env, tmp_path, monkeypatch):
    from ncclwatch.ingest import recording

    whole = _replay_topics(with_env["env"], tmp_path, "whole")
    monkeypatch.setattr(recording, "SORT_RUN_RECORDS", 47)  # runs of 47 records on disk
    monkeypatch.setattr(recording, "MAX_OPEN_RUNS", 4)  # and merged early
    compactions = []
    compact = ExternalSort._compact
    monkeypatch.setattr(ExternalSort, "_compact", lambda self: (compactions.append(self.runs), compact(self)))
    spilled = _replay_topics(with_env["env"], tmp_path, "spilled")
    assert len(compactions) >= 3  # each of the 3 commands sorted on disk, merging early
    assert len(whole["out"].splitlines()) > 20 * 47 and whole["events"] and len(whole["copy"]) > 20 * 47
    for what in whole:
        assert spilled[what] == whole[what], what


def test_replay_by_offsets_reads_exactly_that_slice(with_env, kafka_bootstrap, tmp_path):
    topic = with_env["env"]["NCCLWATCH_TOPICS_WINDOWS"]
    msgs = [m for m in read_topic(kafka_bootstrap, topic, idle_s=0.3) if m.partition == 0]
    want = sorted(m.value.decode() for m in msgs if 5 <= m.offset < 25)
    out = tmp_path / "offsets.jsonl"
    rc = cli.main(["replay", "--topic", topic, "--offsets", f"{topic}:0:5-25", "--out", str(out), "--no-progress"])
    assert rc == 0
    assert sorted(out.read_text().splitlines()) == want and len(want) == 20


def test_files_into_a_topic_keep_the_record_times_and_pace_by_speed(kafka_bootstrap, tmp_path, monkeypatch):
    env = topics_env(kafka_bootstrap)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    records = window_scenario("job-f", seconds=20, degrade_from_s=100)
    src = tmp_path / "run.jsonl"
    src.write_text("".join(to_json(r) + "\n" for r in records) + "{broken\n")
    target = testing.unique_name("replayed")
    testing.kafka_create_topic(kafka_bootstrap, target, 2)
    t0 = time.monotonic()
    rc = cli.main(["replay", "--files", str(src), "--to-topic", target, "--speed", "20", "--no-progress"])
    took_s = time.monotonic() - t0
    assert rc == 0
    assert took_s >= 0.9, "20 s of records at 20x take about a second"
    msgs = read_topic(kafka_bootstrap, target, min_count=len(records), idle_s=0.5)
    assert len(msgs) == len(records)  # the broken line is left out
    by_value = {m.value.decode(): m for m in msgs}
    for r in records:
        m = by_value[to_json(r)]
        assert m.timestamp == record_time_ns(r) // 10**6
        assert m.key == r.job.encode()


def test_a_replay_waits_for_acknowledgements_in_bounded_steps_and_loses_nothing(kafka_bootstrap, tmp_path,
                                                                                 monkeypatch, capsys):
    from ncclwatch.detectors import replay

    env = topics_env(kafka_bootstrap)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(replay, "MAX_UNACKED", 40)  # waits every 20 sends
    waits: list[int] = []  # unacknowledged sends at each wait
    await_acks = replay._await_acks
    monkeypatch.setattr(replay, "_await_acks", lambda q, keep, sent: (waits.append(len(q)), await_acks(q, keep, sent)))
    records = window_scenario("job-b", seconds=30, degrade_from_s=100)
    src = tmp_path / "run.jsonl"
    src.write_text("".join(to_json(r) + "\n" for r in records))
    target = testing.unique_name("bounded")
    assert cli.main(["replay", "--files", str(src), "--to-topic", target, "--no-progress"]) == 0
    assert f"replayed {len(records)} record(s)" in capsys.readouterr().err
    msgs = read_topic(kafka_bootstrap, target, min_count=len(records), idle_s=0.5)
    assert sorted(m.value.decode() for m in msgs) == sorted(to_json(r) for r in records)
    assert len(waits) > 5 and max(waits) <= 40, waits


def test_a_broker_that_is_down_is_a_clear_error_that_names_no_address(tmp_path, monkeypatch, capsys):
    gate = testing.TcpGate("127.0.0.1:9")  # closed: nothing answers there
    monkeypatch.setenv("NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS", gate.address)
    src = tmp_path / "run.jsonl"
    src.write_text("".join(to_json(r) + "\n" for r in window_scenario("job-d", seconds=2, degrade_from_s=100)))
    t0 = time.monotonic()
    assert cli.main(["replay", "--files", str(src), "--to-topic", "x.y", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "ncclwatch replay: Kafka (" in err and "Traceback" not in err, err
    assert gate.address not in err and str(gate.port) not in err.split("ncclwatch replay:")[-1]
    assert time.monotonic() - t0 < 60


def test_replay_refuses_to_write_into_live_topics_without_into_live(tmp_path, capsys):
    src = tmp_path / "r.jsonl"
    src.write_text("")
    cfg = config_of({})
    assert cli.main(["replay", "--files", str(src), "--to-kafka"]) == 2
    assert "refusing to write into live topic" in capsys.readouterr().err
    assert cli.main(["replay", "--files", str(src), "--to-topic", cfg.topics.windows]) == 2
    assert "--into-live" in capsys.readouterr().err
    # a prefix makes them replay topics, which is fine (nothing to send: no broker needed)
    assert cli.main(["replay", "--files", str(src), "--to-topic", "x." + cfg.topics.windows, "--no-progress"]) == 0
