"""The detector library's two stages run apart (key stages per communicator, one job
stage fed their verdicts): the events do not depend on how communicators are spread
over key stages, and they are the incidents one process running both finds."""

from __future__ import annotations

import functools

import pytest
from ncclwatch.detectors.keys import KeyStage, KeyVerdict, VerdictMerge, decode_verdict, encode_verdict
from ncclwatch.detectors.pipeline import detect_all
from ncclwatch_testkit import scenarios, stages

from ncclwatch.config import DetectorConfig
from ncclwatch.records import to_json

CFG = DetectorConfig()
WINDOW_NS = 10**9

# one of each fault kind, and a healthy noisy job
NAMES = [
    "steady_noisy_2x8", "network_step25_4x1", "network_node1_2x8", "network_late_forwarder_2x2",
    "nvlink_ramp_2x8", "straggler_2x8", "throughput_dip_2x2", "telemetry_silence_2x2",
    "telemetry_drops_2x2", "multi_fault_2x8", "network_pulse_2x2",
]


@pytest.fixture(scope="module", params=NAMES)
def case(request):
    records, _ = scenarios.generate(scenarios.by_name(request.param))
    return request.param, records


def test_events_do_not_depend_on_how_communicators_are_spread_over_key_stages(case):
    _, records = case
    one = stages.run_two_stages(records, 1, CFG)
    for shards in (2, 3, 5):
        assert stages.run_two_stages(records, shards, CFG) == one, f"{shards} key stages"


def test_two_stages_raise_the_incidents_one_process_raises(case):
    # Same incidents, same starts and states; the moment of detection may move by a
    # few windows (the job stage's stream time is its verdicts' ends), and a straggler's
    # rank is a communicator rank, so it is the rank in whichever key said so first.
    name, records = case
    one = detect_all(records, CFG)
    two = stages.run_two_stages(records, 2, CFG)

    def what(events):
        return [(e.type, e.state, e.host, e.severity, e.start_ns) for e in events]

    assert what(two) == what(one), name
    for a, b in zip(one, two, strict=True):
        assert abs(a.detected_ns - b.detected_ns) <= 3 * WINDOW_NS, (name, a.type, a.state)


def test_a_verdict_carries_all_the_job_stage_reads_of_its_key():
    # Verdicts that went through their wire format (as between processes) give the same
    # events: the job stage holds no reference into the key stage.
    records, _ = scenarios.generate(scenarios.by_name("multi_fault_2x8"))
    parts, other = stages.split(records, 2)
    verdicts = [v for part in parts for v in stages.key_stage(part, CFG)]
    copied = [decode_verdict(encode_verdict(v)) for v in verdicts]
    assert copied == verdicts
    events = stages.job_stage(stages.job_stage_input(copied, other), CFG)
    assert events == stages.job_stage(stages.job_stage_input(verdicts, other), CFG)
    assert {e.type for e in events} == {"network_path", "straggler", "intra_node"}


@pytest.mark.parametrize(("data", "says"), [
    (b"", "not a key verdict"),
    (b'{"job": "j"}', "not a key verdict"),
    (b'[99, {}]', "format version 99: this build reads versions 1, 2 and 3"),
    (b'[2, {"job": "j"}]', "malformed key verdict"),
    (b'[1, {"job": "j"}]', "malformed key verdict"),
    (b'[1, {"job": 5}]', "malformed key verdict"),
])
def test_a_bad_verdict_is_refused_with_what_is_wrong(data, says):
    with pytest.raises(ValueError, match=says):
        decode_verdict(data)


def _window(comm: str, t: int, rank: int):
    from ncclwatch.records import WindowSummary

    return WindowSummary(
        job="j", host=f"h{rank}", comm=comm, comm_name="", op="AllReduce", size_bucket="64MiB",
        transport="net", rank=rank, nranks=2, start_ns=t * WINDOW_NS, end_ns=(t + 1) * WINDOW_NS,
        count=10, bytes=10 << 26, exec_ns_min=1, exec_ns_p50=1_000_000, exec_ns_p95=1, exec_ns_max=1,
        busbw_gbs_p50=40.0, first_seq=10 * t, last_seq=10 * t + 9)


def test_a_communicators_verdicts_depend_only_on_its_own_windows():
    # Communicator A's windows come 3 (rank 0) and 6 (rank 1) windows behind B's, in the
    # same key stage: A's groups wait on A's stream time, not B's, so A's verdicts are
    # what a key stage holding A alone gives. (Alone, A closes its first groups without
    # rank 1, then waits longer for it, up to max_lateness_windows.)
    a, b = "0x" + "a" * 16, "0x" + "b" * 16
    stream = []
    for t in range(26):
        stream += [_window(b, t, 0), _window(b, t, 1)]
        if t >= 3:
            stream.append(_window(a, t - 3, 0))
        if t >= 6:
            stream.append(_window(a, t - 6, 1))
    together = [v for v in stages.key_stage(stream, CFG) if v.key[0] == a]
    alone = stages.key_stage([w for w in stream if w.comm == a], CFG)

    def what(vs):  # a complete group's verdict says "every rank" (None)
        return [(v.start_ns // WINDOW_NS, [0, 1] if v.ranks is None else sorted(r for r, _ in v.ranks))
                for v in vs]

    assert what(together) == what(alone)
    assert what(alone)[5:20] == [(t, [0, 1]) for t in range(5, 20)]


@pytest.mark.parametrize("name", ["multi_fault_2x8", "network_late_forwarder_2x2", "telemetry_silence_2x2"])
def test_streaming_merge_lets_verdicts_go_in_the_order_of_the_finished_shards(name):
    # Three key stages fed window by window, each marking its progress after every
    # window: the job stage's merge lets the verdicts go, while the stream goes on, in
    # the same order the offline merge of finished shards gives; none is late.
    records, _ = scenarios.generate(scenarios.by_name(name))
    shards = 3
    key_stages = [KeyStage(CFG) for _ in range(shards)]
    # the key stages that hold windows (one that gets none could mark nothing: a
    # key stage on an empty partition would need a clock of its own)
    merge = VerdictMerge({stages.shard_of(r.comm, shards) for r in records if r.KIND == "window"})
    streamed, released_before_end = [], 0
    for r in records:
        if r.KIND != "window":
            continue
        i = stages.shard_of(r.comm, shards)
        for v in key_stages[i].process(r):
            merge.add(v)
        merge.mark(i, key_stages[i].mark())
        got = merge.release()
        released_before_end += len(got)
        streamed += got
    for ks in key_stages:
        for v in ks.flush():
            merge.add(v)
    streamed += merge.release(flush=True)
    parts, _ = stages.split(records, shards)
    offline = stages.job_stage_input([v for p in parts for v in stages.key_stage(p, CFG)], [])
    assert streamed == offline
    assert merge.late == 0
    assert released_before_end > 0.9 * len(offline)  # it streams: little waits for the end


def test_a_job_stage_fed_verdicts_saved_and_restored_goes_on_as_if_never_stopped():
    import json

    from ncclwatch.detectors.pipeline import Pipeline

    records, _ = scenarios.generate(scenarios.by_name("multi_fault_2x8"))
    parts, other = stages.split(records, 2)
    inputs = stages.job_stage_input([v for p in parts for v in stages.key_stage(p, CFG)], other)
    whole = stages.job_stage(inputs, CFG)
    for cut in (len(inputs) // 3, len(inputs) * 2 // 3):  # inside the straggler, then the NVLink fault
        p = Pipeline(CFG)
        events = [e for r in inputs[:cut] for e in p.process(r)]
        state = json.loads(json.dumps(p.to_state()))
        assert state["jobs"][0][1]["views"] and not state["jobs"][0][1]["keys"]
        p = Pipeline.from_state(CFG, state)
        events += [e for r in inputs[cut:] for e in p.process(r)]
        events += p.flush()
        assert events == whole, cut


def _verdict(job: str, end: int) -> KeyVerdict:
    return KeyVerdict(job=job, key=("0x1", "AllReduce", "64MiB", "net"), comm_name="", window_ns=1,
                      ranks=[], start_ns=end - 1, end_ns=end, observed=1.0, baseline=None, effect=0.0,
                      degraded=False, drift=False, was_firing=False, transition=None,
                      spread_transition=None, spread_effect=0.0, exec_ns_p50=1, host=None, warm=False,
                      baseline_after=None, closed_before=end, rule=(False, 0, None, None),
                      spread_rule=(False, 0, None, None))


def test_an_idle_key_stage_holds_nothing_back_until_it_marks_again():
    from ncclwatch.detectors.keys import NEVER

    m = VerdictMerge(["x", "y"])
    m.add(_verdict("j", 5))
    m.mark("x", 10)
    assert m.release() == []  # y has said nothing
    m.mark("y", None)
    assert [v.end_ns for v in m.release()] == [5]
    m.mark("y", NEVER)  # a new owner that knows nothing yet: still idle
    m.add(_verdict("j", 8))
    assert [v.end_ns for v in m.release()] == [8]
    m.mark("y", 12)  # busy again: it bounds again
    m.add(_verdict("j", 11))
    m.mark("x", 20)
    assert [v.end_ns for v in m.release()] == [11]
    m.add(_verdict("j", 15))
    assert m.release() == []


def test_with_every_key_stage_idle_what_is_held_goes_once_it_has_waited_idle_wait_s():
    from ncclwatch.detectors.keys import VerdictMark
    from ncclwatch.detectors.stream import JobDetectors

    from ncclwatch.records import ThroughputRecord

    now = [0.0]
    m = VerdictMerge(["x", "y"], idle_wait_s=5.0, clock=lambda: now[0])
    m.mark("x", None), m.mark("y", None)
    m.add(_verdict("j", 5))
    now[0] = 2.0
    m.add(_verdict("j", 3))
    assert (m.release(), m.waiting()) == ([], True)
    now[0] = 5.0  # the first waited: it goes, and what is earlier with it
    assert [v.end_ns for v in m.release()] == [3, 5]
    m.add(_verdict("j", 9))
    m.mark("x", 8)  # a key stage woke up: its mark bounds again, the wait is moot
    assert not m.waiting() and m.release() == []

    # a job with throughput and no NCCL windows at all is judged IDLE_AFTER_S late, not never
    jd = JobDetectors(CFG, partitions=1, staged=True, idle_wait_s=5.0, clock=lambda: now[0])
    t = ThroughputRecord(job="j", host="h", rank=0, ts_ns=10**9, step=1, tflops_per_gpu=100.0,
                         tokens_per_s=None, source="api")
    jd.process(t, 0)
    jd.mark(VerdictMark(0, None), 0)
    assert jd.waiting() and jd.poll() == [] and len(jd.merges["j"]) == 1
    now[0] = 10.0
    assert jd.poll() == [] and len(jd.merges["j"]) == 0 and jd.marked == ["j"]


def test_a_mark_counts_for_the_jobs_of_the_verdicts_partition_it_was_read_on():
    # marks go to every verdicts partition after the verdicts sent there: one read on
    # partition 1 says nothing of verdicts still unread on partition 0
    from ncclwatch.detectors.keys import VerdictMark
    from ncclwatch.detectors.stream import JobDetectors

    jd = JobDetectors(CFG, partitions=1, staged=True)
    jd.process(_verdict("a", 5), 0)
    jd.process(_verdict("b", 5), 1)
    jd.mark(VerdictMark(0, 10), 1)
    assert (len(jd.merges["a"]), len(jd.merges["b"])) == (1, 0)
    assert jd.marked == ["b"]


def _verdicts_topic(records, shards: int, lag_every: int):
    """The messages a job stage reads, as key stages streaming window by window fill
    them: verdicts (one message per job per window) and progress marks on ``v/0``, the
    other records on ``t/0``; the last key stage marks only every ``lag_every``
    windows (it lags, so the job stage holds the others' verdicts meanwhile)."""
    from ncclwatch.detectors.keys import VerdictMark, encode_mark
    from ncclwatch.detectors.messages import Message

    from ncclwatch.records import to_json

    key_stages = [KeyStage(CFG) for _ in range(shards)]
    out: list[tuple[int, str, bytes | None, bytes]] = []  # (time, topic, key, value)
    seen = [0] * shards
    for r in records:
        if r.KIND != "window":
            out.append((r.ts_ns, "t", r.job.encode(), to_json(r).encode()))
            continue
        i = stages.shard_of(r.comm, shards)
        vs = key_stages[i].process(r)
        if vs:
            out.append((r.end_ns, "v", r.job.encode(), b"\n".join(encode_verdict(v) for v in vs)))
        seen[i] += 1
        if i < shards - 1 or seen[i] % lag_every == 0:
            out.append((r.end_ns, "v", None, encode_mark(VerdictMark(i, key_stages[i].mark()))))
    end = max(t for t, *_ in out)
    out += [(end, "v", None, encode_mark(VerdictMark(i, None))) for i in range(shards)]
    offsets = {"v": 0, "t": 0}
    messages = []
    for _, topic, key, value in sorted(out, key=lambda m: m[0]):
        messages.append(Message(topic, 0, offsets[topic], key, value, 0))
        offsets[topic] += 1
    return messages


def _batch_clock():
    """A clock that moves 0.1 s per reading (StreamCore reads it once per batch)."""
    import itertools

    ticks = itertools.count()
    return lambda: next(ticks) / 10


def _job_stage_core(shards: int, load_state, save_every_s: float = 0.0):
    from ncclwatch.detectors.messages import STAGE_KINDS, TELEMETRY_KINDS
    from ncclwatch.detectors.stream import JobDetectors, StreamCore

    from ncclwatch.records import ThroughputRecord

    core = StreamCore(JobDetectors(CFG, partitions=shards, staged=True), load_state,
                      save_every_s=save_every_s, clock=_batch_clock())
    return core, {"v": STAGE_KINDS, "t": (ThroughputRecord, *TELEMETRY_KINDS)}


@pytest.mark.parametrize("save_every_s", [0.0, 0.35])
def test_a_job_stage_worker_restarted_from_its_saved_state_and_commits_misses_nothing(save_every_s):
    # What the job stage holds for a lagging key stage is not saved (a lag of minutes
    # would make a job's state bigger than a Kafka message): its messages stay
    # unacknowledged until let go, so after a crash they come again. Killed anywhere,
    # restarted from the saved states and the committed offsets, it emits what it
    # would have emitted without stopping (at least once: repeats are exact copies).

    from ncclwatch.records import to_json

    records, _ = scenarios.generate(scenarios.by_name("multi_fault_2x8"))
    shards, batch = 2, 40
    messages = _verdicts_topic(records, shards, lag_every=400)
    batches = [messages[i:i + batch] for i in range(0, len(messages), batch)]

    core, kinds = _job_stage_core(shards, lambda job: None, save_every_s)
    whole = [ev for b in batches for ev in core.handle(b, kinds).events]
    assert sum(ev.state == "firing" for ev in whole) >= 3

    for cut in (len(batches) // 3, len(batches) // 2, len(batches) * 4 // 5):
        table = _Table()
        core, kinds = _job_stage_core(shards, table.reader(), save_every_s)
        before, done, biggest, held = [], set(), 0, 0
        for b in batches[:cut]:
            out = core.handle(b, kinds)
            before += out.events
            biggest = max(biggest, table.save(out))
            done |= {(m.topic, m.offset) for m in out.done}
            held = max(held, sum(len(m) for m in core.detectors.merges.values()))
        # Kafka commits the acknowledged prefix of each partition
        committed = {tp: min(m.offset for m in messages if m.topic == tp and (tp, m.offset) not in done)
                     for tp in ("v", "t")}
        assert committed["v"] < batches[cut][0].offset  # a held message was not acknowledged
        assert held > 200 and biggest < 40_000, (held, biggest)  # held (~700 B each), not in the state
        core, kinds = _job_stage_core(shards, table.reader(), save_every_s)
        again = [m for m in messages if m.offset >= committed[m.topic]]
        after = [ev for i in range(0, len(again), batch) for ev in core.handle(again[i:i + batch], kinds).events]
        first: dict[str, object] = {}
        for ev in before + after:
            first.setdefault(to_json(ev), ev)
        assert list(first.values()) == whole, cut


@pytest.mark.parametrize("idle_wait_s", [5.0, 0.0])
def test_a_job_stage_waits_for_key_stages_that_were_all_idle_before_letting_records_go(idle_wait_s):
    # Key stages idle (nothing read for a while), then a job's records arrive at once
    # (a forwarder draining its spill, a job starting on a quiet cluster): the job
    # stage reads the job's throughput long before the key stages' first verdicts and
    # marks. Let go at once, every verdict comes late and the throughput is judged
    # without them; held while the key stages wake up, the events are the in-order ones.
    from ncclwatch.detectors.keys import VerdictMark, encode_mark
    from ncclwatch.detectors.messages import STAGE_KINDS, TELEMETRY_KINDS, Message
    from ncclwatch.detectors.stream import JobDetectors, StreamCore

    from ncclwatch.records import ThroughputRecord

    records, _ = scenarios.generate(scenarios.by_name("multi_fault_2x8"))
    shards, batch = 2, 40
    messages = _verdicts_topic(records, shards, lag_every=1)
    kinds = {"v": STAGE_KINDS, "t": (ThroughputRecord, *TELEMETRY_KINDS)}
    now = [0.0]

    def core():
        return StreamCore(JobDetectors(CFG, partitions=shards, staged=True, idle_wait_s=idle_wait_s,
                                       clock=lambda: now[0]), lambda job: None)

    def run(order):
        c = core()
        events = [ev for i in range(0, len(order), batch) for ev in c.handle(order[i:i + batch], kinds).events]
        return events, c.detectors.late_verdicts()

    in_order, late = run(messages)
    assert late == 0 and sum(ev.state == "firing" for ev in in_order) >= 3

    def idle(n: int) -> list:  # on the job's verdicts partition, apart from the verdicts' offsets
        return [Message("v", 0, 10**6 + shards * n + i, None, encode_mark(VerdictMark(i, None)), 0)
                for i in range(shards)]

    throughput = [m for m in messages if m.topic == "t"]
    verdicts = [m for m in messages if m.topic == "v"]
    c, events = core(), []
    for i in range(0, len(throughput), batch):
        # the verdicts partition read to its end; the idle key stages' marks, twice a second
        events += c.handle(throughput[i:i + batch], kinds, {("v", 0): False}).events
        events += c.handle(idle(i), kinds).events
        now[0] += 0.1
    for i in range(0, len(verdicts), batch):
        events += c.handle(verdicts[i:i + batch], kinds).events
    if idle_wait_s:
        assert (events, c.detectors.late_verdicts()) == (in_order, 0)
    else:  # what the worker did before: the verdicts late, the events others
        assert c.detectors.late_verdicts() > 0 and events != in_order


class _Table:
    """What the worker writes to its table after a batch: the states through its codec
    (``detectors/saved.py``), in parts past ``part_bytes``; read back as a restarted
    worker reads them, by a codec of its own."""

    def __init__(self, part_bytes: int | None = None):
        from ncclwatch.detectors.saved import PART_BYTES, StateCodec

        self.part_bytes = part_bytes or PART_BYTES
        self.codec = StateCodec(self.part_bytes)
        self.data: dict[str, bytes] = {}

    def save(self, out) -> int:
        """The batch's states written; the longest value written."""
        biggest = 0
        for key, (_, state) in out.states.items():
            for k, value in self.codec.entries(key, state):
                if value is None:
                    self.data.pop(k, None)
                else:
                    self.data[k] = value
                    biggest = max(biggest, len(value))
        return biggest

    def reader(self):
        from ncclwatch.detectors.saved import StateCodec

        return functools.partial(StateCodec(self.part_bytes).load, self.data.get)

    def states(self) -> list[dict]:
        from ncclwatch.detectors.saved import state_of

        load = self.reader()
        return [load(job) for k in self.data if (job := state_of(k)) is not None]


def _key_stage_core(load_state, hold_ranks, save_every_s=0.0, hold_events=False):
    from ncclwatch.detectors.messages import STAGE_KINDS  # noqa: F401 (the windows' kinds below)
    from ncclwatch.detectors.stream import KeyDetectors, StreamCore

    from ncclwatch.records import WindowSummary

    detectors = KeyDetectors(CFG, hold_ranks=hold_ranks)
    core = StreamCore(detectors, load_state, state_key=KeyDetectors.state_key, merge_group=lambda _: 0,
                      save_every_s=save_every_s, hold_events=hold_events, clock=_batch_clock())
    return core, {"w": (WindowSummary,)}


@pytest.mark.parametrize(("hold_ranks", "save_every_s", "part_bytes"),
                         [(2, 0.0, None), (None, 0.0, None), (2, 0.35, None), (None, 0.35, None), (None, 0.35, 300)])
def test_a_key_stage_worker_restarted_from_its_saved_state_and_commits_misses_nothing(hold_ranks, save_every_s,
                                                                                      part_bytes):
    # A large communicator's open groups are not saved (a 16,384-rank group is ~13 MB of
    # JSON, past a Kafka message): their windows' messages stay unacknowledged until
    # the group closes, and after a crash come again. Killed anywhere, restarted from
    # its saved states and the committed (acknowledged-prefix) offsets, the key stage
    # sends the verdicts it would have sent without stopping (repeats are exact copies).
    # hold_ranks=2 holds every communicator here; None holds none (groups are state).
    # save_every_s > 0: states go out every fourth batch, with the messages they cover.
    # part_bytes: every communicator's state saved in parts of 300 bytes.
    import json

    from ncclwatch.detectors.messages import Message

    from ncclwatch.records import to_json

    records, _ = scenarios.generate(scenarios.by_name("network_late_forwarder_2x2"))  # groups wait 4.5 s
    shards, batch = 2, 25
    offsets = [0] * shards
    messages = []
    for r in records:
        if r.KIND == "window":
            p = stages.shard_of(r.comm, shards)
            messages.append(Message("w", p, offsets[p], f"{r.job}|{r.comm}".encode(), to_json(r).encode(), 0))
            offsets[p] += 1
    batches = [messages[i:i + batch] for i in range(0, len(messages), batch)]

    def verdicts(out):
        return [encode_verdict(v) for v in out.events]

    def to_the_end(core, kinds):
        # what an idle worker still sends: the events held until the next save
        out = []
        while core.save_pending:
            out += verdicts(core.handle([], kinds))
        return out

    core, kinds = _key_stage_core(lambda key: None, hold_ranks, save_every_s)
    whole = [v for b in batches for v in verdicts(core.handle(b, kinds))] + to_the_end(core, kinds)
    assert len(whole) > 100 and any(decode_verdict(v).fired for v in whole)

    for cut in (len(batches) // 3, len(batches) // 2, len(batches) * 4 // 5):
        table = _Table(part_bytes)
        core, kinds = _key_stage_core(table.reader(), hold_ranks, save_every_s)
        before, done = [], set()
        for b in batches[:cut]:
            out = core.handle(b, kinds)
            before += verdicts(out)
            assert table.save(out) <= table.part_bytes
            done |= {(m.partition, m.offset) for m in out.done}
        # Kafka commits the acknowledged prefix of each partition
        committed = {p: min((m.offset for m in messages if m.partition == p and (p, m.offset) not in done),
                            default=offsets[p]) for p in range(shards)}
        read = {p: max(m.offset for b in batches[:cut] for m in b if m.partition == p) + 1 for p in range(shards)}
        held = sum(read[p] - committed[p] for p in range(shards))
        if hold_ranks is not None:
            assert held > 0  # messages of open groups were not acknowledged
            assert all('"pending": [[' not in json.dumps(s) for s in table.states())  # nor saved
        elif save_every_s == 0:
            assert held == 0
        if part_bytes:
            assert any(k.startswith("\x00p") for k in table.data)  # in parts indeed
        core, kinds = _key_stage_core(table.reader(), hold_ranks, save_every_s)
        again = [m for m in messages if m.offset >= committed[m.partition]]
        after = [v for i in range(0, len(again), batch) for v in verdicts(core.handle(again[i:i + batch], kinds))]
        after += to_the_end(core, kinds)
        # the same verdicts, each key's in the same order (keys interleave by arrival)
        got, want = list(dict.fromkeys(before + after)), list(dict.fromkeys(whole))
        assert sorted(got) == sorted(want), cut
        assert _by_key(got) == _by_key(want), cut


def test_held_events_go_out_with_the_save_that_covers_their_messages():
    # Published before the save, they were published again by the next owner of a
    # partition taken away in between (it reads from the older saved state). The job
    # stage holds its events so; a key-stage core here shows the mechanism (the worker's
    # key stage sends its verdicts at once: hold_events=False).
    from ncclwatch.detectors.messages import Message

    from ncclwatch.records import to_json

    records, _ = scenarios.generate(scenarios.by_name("network_step20_2x8"))
    messages = [Message("w", 0, i, f"{r.job}|{r.comm}".encode(), to_json(r).encode(), 0)
                for i, r in enumerate(r for r in records if r.KIND == "window")]
    core, kinds = _key_stage_core(lambda key: None, None, save_every_s=0.35, hold_events=True)  # save: 4th batch
    sent, acked, saves = 0, 0, 0
    for i in range(0, len(messages), 25):
        out = core.handle(messages[i:i + 25], kinds)
        if out.states:
            saves += 1
            acked += len(out.done)
            sent += len(out.events)
        else:
            assert out.events == [] and out.done == []  # nothing leaves before its save
    assert saves > 3 and sent > 100 and acked > 0


def _by_key(encoded):
    out: dict[tuple, list] = {}
    for v in encoded:
        d = decode_verdict(v)
        out.setdefault((d.job, tuple(d.key)), []).append(d.end_ns)
    return out


def _as_version_1(v: KeyVerdict, rank_host: dict) -> bytes:
    """``v`` as a key stage of an older build sent it: format 1, every group's ranks listed."""
    import json

    if v.rank_host is not None:
        rank_host[v.key] = dict(v.rank_host)
    body = json.loads(encode_verdict(v, version=2))[1]
    if body["ranks"] is None:
        body["ranks"] = [[r, h] for r, h in sorted(rank_host[v.key].items())]
    return json.dumps([1, body]).encode()


@pytest.mark.parametrize("name", ["telemetry_silence_2x2", "multi_fault_2x8"])
def test_verdicts_of_format_1_give_the_events_of_format_2(name):
    """Format 2 leaves a complete group's ranks out (the job stage takes them from the
    key's rank_host); a job stage reading an older key stage's lists gives the same
    events, the silent node of telemetry_silence_2x2 included."""
    records, _ = scenarios.generate(scenarios.by_name(name))
    parts, other = stages.split(records, 1)
    verdicts = stages.key_stage(parts[0], CFG)
    assert sum(v.ranks is None for v in verdicts) > 0.8 * len(verdicts)  # a silent node's are not
    new = [decode_verdict(encode_verdict(v)) for v in verdicts]
    rank_host: dict = {}
    old = [decode_verdict(_as_version_1(v, rank_host)) for v in verdicts]
    assert all(v.ranks is not None for v in old)
    got_new = stages.job_stage(stages.job_stage_input(new, other), CFG)
    got_old = stages.job_stage(stages.job_stage_input(old, other), CFG)
    assert [to_json(e) for e in got_new] == [to_json(e) for e in got_old]
    if name == "telemetry_silence_2x2":
        assert "telemetry_loss" in {e.type for e in got_new}


@pytest.mark.parametrize("name", ["multi_fault_2x8", "network_pulse_2x2"])
def test_verdicts_of_format_2_give_the_events_of_format_3_in_about_half_the_bytes(name):
    """Format 3 writes a verdict's fields as an array (format 2: an object, whose field
    names were most of its bytes); a job stage reads both to the same verdicts and events."""
    records, _ = scenarios.generate(scenarios.by_name(name))
    parts, other = stages.split(records, 1)
    verdicts = stages.key_stage(parts[0], CFG)
    v3 = [encode_verdict(v) for v in verdicts]
    v2 = [encode_verdict(v, version=2) for v in verdicts]
    assert {b[:3] for b in v3} == {b"[3,"} and {b[:3] for b in v2} == {b"[2,"}
    assert sum(map(len, v3)) < 0.6 * sum(map(len, v2))
    new = [decode_verdict(b) for b in v3]
    assert new == [decode_verdict(b) for b in v2] == verdicts
    assert any(v.fired is not None for v in new) and any(v.rank_host for v in new)
    got_new = stages.job_stage(stages.job_stage_input(new, other), CFG)
    got_old = stages.job_stage(stages.job_stage_input([decode_verdict(b) for b in v2], other), CFG)
    assert got_new and [to_json(e) for e in got_new] == [to_json(e) for e in got_old]


def test_a_format_3_verdict_with_fields_missing_or_of_a_later_build_is_refused_clearly():
    records, _ = scenarios.generate(scenarios.by_name("multi_fault_2x8"))
    v = encode_verdict(stages.key_stage(stages.split(records, 1)[0][0], CFG)[0])
    with pytest.raises(ValueError, match="malformed key verdict"):
        decode_verdict(b'[3,["j",["0x1","AllReduce","64MiB","net"]]]')  # too few fields
    with pytest.raises(ValueError, match="malformed key verdict"):
        decode_verdict(v.replace(b'[3,["', b'[3,[7,"', 1))  # every field one place on
    with pytest.raises(ValueError, match="format version 4: this build reads versions 1, 2 and 3"):
        decode_verdict(b"[4" + v[2:])


def test_a_format_3_verdict_of_an_older_or_newer_build_reads():
    """Fields are added at the end with a default: an older build's verdict (fewer fields)
    reads with that default, a newer one's (more) reads without them."""
    import json

    records, _ = scenarios.generate(scenarios.by_name("multi_fault_2x8"))
    v = stages.key_stage(stages.split(records, 1)[0][0], CFG)[0]
    assert v.busy_ns is not None  # the last field
    version, row = json.loads(encode_verdict(v))
    older = decode_verdict(json.dumps([version, row[:-1]]).encode())
    assert older.busy_ns is None and older.end_ns == v.end_ns and older.rank_host == v.rank_host
    assert decode_verdict(json.dumps([version, [*row, {"later": 1}]]).encode()) == v


def test_a_mark_of_format_1_still_reads():
    from ncclwatch.detectors.keys import VerdictMark, decode_stage_line

    assert decode_stage_line(b'[1,"mark",{"source":2,"upto_ns":7}]') == VerdictMark(2, 7)
    assert decode_stage_line(b'[2,"mark",{"source":2,"upto_ns":null}]') == VerdictMark(2, None)
