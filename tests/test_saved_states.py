"""Saved states in parts (``detectors/saved.py``): what recovery reads is always one
whole save, whatever the table's size limit and wherever a worker stops."""

from __future__ import annotations

import json
import random

import pytest
from ncclwatch.detectors.saved import StateCodec, part_key, state_of, table_key


def apply(table: dict[str, bytes], entries) -> None:
    """What a compacted changelog holds after ``entries``: the last value per key."""
    for key, value in entries:
        if value is None:
            table.pop(key, None)
        else:
            table[key] = value


def state(seed: int, size: int) -> dict:
    rng = random.Random(seed)
    return {"v": 1, "seed": seed, "ranks": [[f"node{rng.randrange(99)}", rng.random()] for _ in range(size)]}


@pytest.mark.parametrize("part_bytes", [1, 7, 100, 4096])
def test_every_save_loads_back_exactly_whole_or_in_parts(part_bytes):
    codec, table = StateCodec(part_bytes), {}
    for seed, size in enumerate([0, 40, 3, 200, 200, 1, 0, 90]):
        st = state(seed, size)
        apply(table, codec.entries("job", st))
        assert StateCodec(part_bytes).load(table.get, "job") == st
        assert all(len(v) <= part_bytes for k, v in table.items() if state_of(k) is None)  # the parts
        # nothing but the head and the parts it names: the previous save's are gone
        head = json.loads(table["job"])
        assert len(table) == 1 + (head["parts"] if "parted" in head else 0)


@pytest.mark.parametrize("part_bytes", [16, 300])
def test_a_save_cut_short_anywhere_leaves_the_state_before_it_or_the_new_one(part_bytes):
    """A worker killed between two writes of a save: recovery reads the last whole save."""
    sizes = [50, 80, 20, 0, 60]
    for restart_at in range(len(sizes)):
        before = None
        codec, table = StateCodec(part_bytes), {}
        for i, size in enumerate(sizes):
            st = state(i, size)
            entries = codec.entries("job", st)
            if i == restart_at:
                for cut in range(len(entries) + 1):
                    t = dict(table)
                    apply(t, entries[:cut])
                    got = StateCodec(part_bytes).load(t.get, "job")
                    assert got == (st if cut == len(entries) else before) or (got == st and cut >= 1), (i, cut)
                # the worker restarts on a cut-short table, loads, and saves again
                cut = len(entries) // 2
                apply(table, entries[:cut])
                codec = StateCodec(part_bytes)
                loaded = codec.load(table.get, "job")
                assert loaded in (before, st)
                apply(table, codec.entries("job", st))
            else:
                apply(table, entries)
            assert StateCodec(part_bytes).load(table.get, "job") == st
            before = st


def test_a_forgotten_state_takes_all_its_parts_and_other_states_keep_theirs():
    codec, table = StateCodec(64), {}
    for seed in range(3):
        apply(table, codec.entries("a", state(seed, 30)))
        apply(table, codec.entries("b", state(seed + 10, 30)))
    reloaded = StateCodec(64)  # a restarted worker knows the slots from the heads it loads
    assert reloaded.load(table.get, "a") == state(2, 30)
    apply(table, reloaded.entries("a", None))
    assert {state_of(k) for k in table} == {"b", None} and all(k.endswith("b") for k in table)
    assert StateCodec(64).load(table.get, "a") is None
    assert StateCodec(64).load(table.get, "b") == state(12, 30)


def test_user_keys_never_meet_part_keys():
    """A job may be named anything, even like a part's key."""
    codec, table = StateCodec(16), {}
    tricky = [part_key("x", 0, 0), "\x00h\x00x", "x", "\x00", ""]
    for i, job in enumerate(tricky):
        apply(table, codec.entries(job, state(i, 5)))
    for i, job in enumerate(tricky):
        assert StateCodec(16).load(table.get, job) == state(i, 5)
    assert sorted(j for k in table if (j := state_of(k)) is not None) == sorted(tricky)
    assert all(state_of(table_key(j)) == j for j in tricky)


def test_a_state_saved_whole_by_an_older_worker_loads():
    """Before parts, Faust wrote each state as one JSON value under the job's key."""
    st = state(1, 10)
    assert StateCodec().load({"job": json.dumps(st).encode()}.get, "job") == st


def test_a_missing_or_changed_part_is_an_error_naming_the_state():
    codec, table = StateCodec(32), {}
    apply(table, codec.entries("job-7", state(1, 20)))
    parts = sorted(k for k in table if state_of(k) is None)
    for damage in ("drop", "change"):
        t = dict(table)
        if damage == "drop":
            del t[parts[1]]
        else:
            t[parts[1]] = t[parts[1]][:-1] + b"0"
        with pytest.raises(ValueError, match="saved state 'job-7'"):
            StateCodec(32).load(t.get, "job-7")


def test_part_bytes_must_be_positive():
    with pytest.raises(ValueError, match="part_bytes"):
        StateCodec(0)


def test_collection_is_paused_while_states_are_built_and_back_after_even_on_error():
    import gc

    from ncclwatch.detectors.stream import collection_paused

    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collection_paused():
        raise RuntimeError("a state that cannot be built")
    assert gc.isenabled()
    gc.disable()  # paused by someone else: left as found
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_worker_core_builds_its_saves_without_collections():
    """``StreamCore`` builds every touched job's state inside ``collection_paused``."""
    import gc

    from ncclwatch.detectors.stream import JobDetectors, StreamCore

    from ncclwatch.config import DetectorConfig

    seen = []

    class Recording(JobDetectors):
        def job_state(self, job):
            seen.append(gc.isenabled())
            return super().job_state(job)

    detectors = Recording(DetectorConfig(), partitions=1)
    core = StreamCore(detectors, lambda job: None)
    for job in ("a", "b"):
        core.positions[job] = core._ensure(job)
        detectors.pipeline(job)  # as the job's first record makes it
        core.partition_of[job] = 0
    core._unsaved = {"a", "b"}
    out = core.handle([])
    assert seen == [False, False] and gc.isenabled()
    assert set(out.states) == {"a", "b"}


def test_the_worker_core_encodes_its_saves_before_collections_resume():
    """With ``encode_state`` (the worker's table codec), each state is encoded inside the
    pause too, and only the encoded entries leave it: the state's objects are freed
    before garbage collection resumes, so no collection walks them."""
    import gc
    import weakref

    from ncclwatch.detectors.saved import StateCodec
    from ncclwatch.detectors.stream import JobDetectors, StreamCore

    from ncclwatch.config import DetectorConfig

    codec = StateCodec()
    encoded, alive = [], []

    class Probe(dict):  # a dict that can be referenced weakly: is the state still alive?
        pass

    def encode(job, state):
        encoded.append((job, gc.isenabled()))
        probe = Probe(state)
        alive.append(weakref.ref(probe))
        return codec.entries(job, probe)

    detectors = JobDetectors(DetectorConfig(), partitions=1)
    core = StreamCore(detectors, lambda job: None, encode_state=encode)
    for job in ("a", "b"):
        core.positions[job] = core._ensure(job)
        detectors.pipeline(job)
        core.partition_of[job] = 0
    core._unsaved = {"a", "b"}
    out = core.handle([])
    assert encoded == [("a", False), ("b", False)] and gc.isenabled()
    assert all(ref() is None for ref in alive)  # freed as soon as encoded
    for job in ("a", "b"):
        partition, entries = out.states[job]
        assert partition == 0
        assert codec.load(dict(entries).get, job)["positions"] == {}  # what the codec reads back


def test_a_job_forgotten_and_back_before_a_save_is_saved_in_its_other_slot():
    """A job evicted (an hour silent) whose records come again before the next save is
    saved, not removed; with ``encode_state`` its parts go to the slot its live head does
    not use, so a stop part-way leaves the last whole save readable."""
    from ncclwatch.detectors.saved import StateCodec, part_key
    from ncclwatch.detectors.stream import JobDetectors, StreamCore

    from ncclwatch.config import DetectorConfig

    codec = StateCodec(part_bytes=64)  # any state goes in parts
    detectors = JobDetectors(DetectorConfig(), partitions=1)
    core = StreamCore(detectors, lambda job: None, encode_state=codec.entries)
    core.positions["a"] = core._ensure("a")
    detectors.pipeline("a")
    core.partition_of["a"] = 0
    table: dict = {}
    for slot in (0, 1):  # the first save's parts go to slot 0, the next one's to slot 1
        core._unsaved = {"a"}
        if slot:
            core._unsaved_gone = {"a": 0}  # forgotten, then its records came again
        _, entries = core.handle([]).states["a"]
        values = dict(entries)
        assert values.get(part_key("a", slot, 0)) is not None
        assert values.get(part_key("a", 1 - slot, 0)) is None  # the live head's parts untouched or removed
        for k, v in entries:
            if v is None:
                table.pop(k, None)
            else:
                table[k] = v
    assert codec.load(table.get, "a")["positions"] == {}


def test_a_saved_job_with_open_incidents_is_adopted_from_one_read_of_its_state():
    """After a rebalance the job stage reads each saved job to see whether it left
    incidents open; one it adopts is loaded from that read, not decoded again."""
    from ncclwatch.detectors.stream import JobDetectors, StreamCore
    from ncclwatch_testkit import scenarios

    from ncclwatch.config import DetectorConfig

    cfg = DetectorConfig(quiet_end_s=60.0)
    records, _ = scenarios.generate(scenarios.by_name("network_step30_2x2"))
    detectors = JobDetectors(cfg, partitions=1)
    core = StreamCore(detectors, lambda job: None)
    job = records[0].job
    core.positions[job] = core._ensure(job)
    pipeline = detectors.pipeline(job)
    fired = []
    for r in records[: len(records) * 3 // 4]:  # the fault (60-110 s of 150) is on
        fired += [e for e in pipeline.process(r) if e.state == "firing"]
    assert fired
    core.partition_of[job] = 0
    core._unsaved = {job}
    state = json.loads(json.dumps(core.handle([]).states[job][1]))  # (partition, state)
    reads = []

    def load(j):
        reads.append(j)
        return state

    again = StreamCore(JobDetectors(cfg, partitions=1), load)
    assert again.adopt_saved(job, 0)
    assert reads == [job]
    assert job in again.detectors.pipelines
