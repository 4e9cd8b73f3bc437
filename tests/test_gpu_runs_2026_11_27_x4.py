"""Real 4×H100 runs of 2026-11-27: a job of two (pretend) nodes with two GPUs each, so
that one communicator is *mixed* (NVLink inside a node, the socket transport between
them) beside NVLink-only and network-only ones; tests/fixtures/gpu_runs/2026-11-27-x4
has the README."""

from __future__ import annotations

import json

import pytest
from gpu_runs_support import eval_gpu_runs, recorded_set

from ncclwatch.config import load

FIXTURES, SPLIT, rows, test_the_split_is_the_directory = recorded_set("2026-11-27-x4")


def test_the_first_batch_after_the_changes_it_led_to(rows):
    """6 of 7; the miss: NVLink copies both ways between GPUs 2 and 3, which slowed both
    GPUs (labelled throughput_drop by what they did), raise a straggler on GPU 3."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["tune"])])
    assert [n for n in SPLIT["tune"] if not rows[n]["ok"]] == ["p4-nvlink-2x2-n1"], table
    for name in ("i4-cpu-k2", "i4-tc-24g", "p4-tc-16g"):
        # the network fault's waiting on the NVLink communicators is not a second cause
        assert rows[name]["got"] == "network_path" and rows[name]["false_alerts"] == [], table
    assert rows["p4-strag-r2-1.3x"]["got"] == "straggler rank 0", table  # GPU 2, in its node's comm


def test_the_held_out_batch_after_the_link_share_check(rows):
    """Judged once as 4 of 6 by the code that made the first batch right; 5 of 6 since
    the link-share check (`link_share_rise`), which this batch's miss led to (so the
    batch is no longer held out for it)."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout"])])
    right = {n for n in SPLIT["heldout"] if rows[n]["ok"]}
    assert right == {"i4-clean", "p4-pulse-tc-12g", "p4-strag-r0-1.15x", "p4-tc-40g", "i4-slow-all-1.3x"}, table
    # every rank 1.3x slower slowed the socket transfers too (compute contends with
    # NCCL's kernels) and read as the network path 8.3 s in; the network ops' share of
    # the ranks' time held, so it is the job's own drop, found 2.3 s in
    r = rows["i4-slow-all-1.3x"]
    assert (r["got"], r["false_alerts"], r["delay_s"]) == ("throughput_drop", [], 2.3), table
    # the miss as it was: a competing-socket fault costing 4.7 % (under the 5 % gate)
    assert rows["p4-sock-n4"]["false_alerts"] == ["network_path@+3.7s"], table


def test_the_held_out_batch_with_the_check_off_is_as_first_judged():
    """``link_share_rise = 0`` gives the batch's table as first judged (4 of 6)."""
    cfg = load(None, environ={"NCCLWATCH_DETECTOR_LINK_SHARE_RISE": "0"})
    runs = [FIXTURES / f"{n}.tar.gz" for n in ("i4-slow-all-1.3x",)]
    (r,) = eval_gpu_runs.evaluate(runs, cfg, 5.0)
    assert (r["got"], r["false_alerts"]) == ("-", ["network_path@+8.3s"])


def test_the_third_batch_recorded_and_judged_after_the_changes(rows):
    """6 of 6: other layouts (four pretend nodes, two processes per GPU; one NVLink-only
    node of four) and stragglers on ranks 1 and 3, through both profilers."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_2"])])
    assert all(rows[n]["ok"] for n in SPLIT["heldout_2"]), table
    assert rows["p4n4-clean"]["got"] == "-" and rows["p4n4-clean"]["false_alerts"] == [], table


def test_the_fourth_batch_after_the_changes_it_led_to(rows):
    """Judged once by 70d8b7a: 5 of 9 (8d99d46 too); 8 of 9 after the two changes it
    led to (a deepening throughput drop becomes a warning; starved proxies are the
    network's); 9 of 9 since windows carry the process id. The last miss was a straggler
    on GPU 0 through Inspector, named as GPU 1 (its NVLink peer, which waits for it):
    Inspector gives no GPU, and every pretend node is one host, so the communicators'
    spreads could not be matched to one process."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["tune_2"])])
    assert [n for n in SPLIT["tune_2"] if not rows[n]["ok"]] == [], table
    assert rows["p4-cpu-k2"]["got"] == "network_path", table
    for n in ("p4-slow-all-1.3x", "p4n4-slow-all-1.3x"):
        assert (rows[n]["got"], rows[n]["severity"]) == ("throughput_drop", "warning"), table


def test_an_inspector_straggler_is_matched_across_communicators_by_its_process_id(tmp_path):
    """Inspector names no GPU: its windows carry the process id (and ``gpu`` ""), which
    with the host is the process the communicators' spreads are compared by. GPU 0 was
    slow; its node peer (GPU 1) waits for it in their NVLink AllReduce and arrives late
    at the mixed collective, whose spread fires first naming GPU 1."""
    from ncclwatch.detectors import watch
    from ncclwatch.ingest.recording import ReadStats, read_recording
    from ncclwatch.ingest.windows import Windower

    run = eval_gpu_runs.unpacked(FIXTURES / "i4-strag-r0-1.3x.tar.gz", tmp_path)
    info = json.loads((run / "run.json").read_text())
    srcs, options = eval_gpu_runs.sources(run)
    records = list(read_recording(srcs, ReadStats(), options))
    windower = Windower(window_s=1.0)
    windows = [w for r in records if getattr(r, "KIND", "") == "op" for w in windower.add(r)]
    windows += windower.flush()
    assert {w.gpu for w in windows} == {""} and len({(w.host, w.pid) for w in windows}) == 4
    events = watch.detect(load(None, environ={}), records)
    firing = [e for e in events if e.state == "firing"]
    assert [e.type for e in firing] == ["straggler"]
    ev = firing[0]
    comm = next(c for c in info["comms"].values() if c["comm"] == ev.evidence["comm"])
    assert info["ranks"][str(comm["ranks"][ev.rank])]["gpu"] == 0
    first = next(c for c in info["comms"].values() if c["comm"] == ev.evidence["named_first"]["comm"])
    assert info["ranks"][str(first["ranks"][ev.evidence["named_first"]["rank"]])]["gpu"] == 1
    assert "gpu" not in ev.evidence  # none is known; "unknown" is not a GPU
    assert ev.evidence["pid"] == info["ranks"]["0"]["pid"]  # the process to look at


def test_the_fifth_batch_held_out_as_first_judged(rows):
    """Recorded with the fourth, judged once by 4ebe770: 7 of 9 (8d99d46 gives the same
    table). Misses: a clean run whose network keys drifted ~14 % slower while the job
    dipped ~7 % for three windows (network_path, not changed for); every rank 1.2x
    slower through Inspector costing 7 %, never raised: the job's two slow first windows
    had tripled the throughput baseline's noise, so the loss stayed under 3 sigmas and
    was learned. Since the warm-up leaves such values out of the noise: found, 3.8 s in
    (this batch is no longer held out for that rule)."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_3"])])
    wrong = {n for n in SPLIT["heldout_3"] if not rows[n]["ok"]}
    assert wrong == {"i4-clean-2"}, table
    assert rows["i4-clean-2"]["false_alerts"] == ["network_path"], table
    r = rows["i4-slow-all-1.2x"]
    assert (r["got"], r["delay_s"], r["false_alerts"]) == ("throughput_drop", 3.8, []), table


def test_the_sixth_batch_held_out_as_first_judged(rows):
    """Recorded while the process id and the warm-up's noise were changed, judged once
    after them (3b0fb9d): 9 of 9. Three Inspector stragglers named on the slow GPU (the
    code before, 4f996ec, named two of them as their NVLink peers: 7 of 9)."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_4"])])
    assert all(rows[n]["ok"] for n in SPLIT["heldout_4"]), table
    for n in ("i4-strag-r0-1.5x", "i4-strag-r1-1.2x", "i4-strag-r2-1.3x", "p4-strag-r0-1.3x"):
        assert rows[n]["got"].startswith("straggler") and rows[n]["false_alerts"] == [], table
    for n in ("i4-clean-3", "p4-clean-2"):
        assert rows[n]["got"] == "-" and rows[n]["false_alerts"] == [], table


def test_the_seventh_batch_held_out_as_first_judged(rows):
    """Other sizes and layouts, recorded after the session's changes and judged once
    (039fe0e): 9 of 9 (4f996ec the same); faults of 8 s found as those of 20 s."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_5"])])
    assert all(rows[n]["ok"] for n in SPLIT["heldout_5"]), table
    assert rows["i4-tc-20g-8s"]["got"] == "network_path", table
    assert rows["p4-strag-r2-1.5x-8s"]["got"].startswith("straggler"), table
    assert rows["i4-strag-r3-1.15x"]["got"] == "-" and rows["i4-strag-r3-1.15x"]["false_alerts"] == [], table


def test_the_eighth_batch_held_out_as_first_judged(rows):
    """Job shapes the 4-GPU batches never had (pipeline Send/Recv of 32 MiB, a 256 MiB
    data-parallel AllReduce, 64 MiB, two layers), recorded and judged once (5f02617):
    9 of 9, every fault critical but the every-rank slowdown, nothing on the clean runs."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_6"])])
    assert all(rows[n]["ok"] for n in SPLIT["heldout_6"]), table
    for n in ("p4-pp-tc-24g", "p4-big-tc-32g", "i4-dp64-tc-40g", "i4-big-cpu-k2"):
        assert rows[n]["got"] == "network_path" and rows[n]["severity"] == "critical", table
    assert rows["p4-layers2-slow-all-1.2x"]["got"] == "throughput_drop", table
    for n in ("i4-big-clean", "p4-pp-clean"):
        assert rows[n]["got"] == "-" and rows[n]["false_alerts"] == [], table


def test_the_ninth_batch_held_out_as_first_judged(rows):
    """Plan q's job shapes crossed with other faults (four pretend nodes with pipeline
    traffic, pulses, faults from 22 s), judged once (0bd73fc): 7 of 9. The misses stay
    misses until something changes them on purpose."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_7"])])
    wrong = {n for n in SPLIT["heldout_7"] if not rows[n]["ok"]}
    assert wrong == {"p4-big-slow-all-1.3x", "p4-nvlink-1way-n0"}, table
    for n in ("p4n4-pp-tc-32g", "p4-dp64-pulse-tc-16g", "i4-layers2-tc-24g", "p4-dp64-cpu-k1"):
        assert rows[n]["got"] == "network_path" and rows[n]["severity"] == "critical", table
    assert rows["i4n1-big-strag-r1-1.2x"]["got"].startswith("straggler"), table


def test_the_tenth_batch_steps_longer_than_a_window_as_first_judged(rows):
    """Steps of ~1-1.3 s, judged once after the throughput change (78f6cea): 2 of 4. The
    Inspector slowdown is found within the bound only because a step now counts for the
    windows it spans (5.3 s before). Since a key whose ranks wait for one of them no
    longer counts as its communicator's link trouble, the 1.3x straggler on GPU 2 is
    named in 4.3 s (it was held until the fault ended, then misnamed): 3 of 4."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_8"])])
    wrong = {n for n in SPLIT["heldout_8"] if not rows[n]["ok"]}
    assert wrong == {"p4-long-slow-all-1.2x"}, table
    assert rows["p4-long-strag-r2-1.3x"]["delay_s"] <= 5.0, table
    assert rows["i4-long-slow-all-1.3x"]["got"] == "throughput_drop", table
    assert rows["i4-long-slow-all-1.3x"]["delay_s"] <= 5.0, table


def test_the_eleventh_batch_new_fault_kinds_after_the_change_it_led_to(rows):
    """Fault kinds no batch had (plan t): a GPU shared with another process's matmuls and a
    tbf rate stepped down over the fault; judged once by a97fccc: 2 of 6. Every shared GPU
    was named as the straggler, but each run also raised network_path 9.6-15.4 s in: the
    shared GPU runs its NCCL kernels slower too, so the network collectives it is in slow.
    A link incident whose every key has a straggler begun before it, and an NVLink key of
    that process degraded too (a slower network leaves NVLink alone), is now the
    straggler's echo: 3 of 6. GPU 0 hogged half the time still raised network_path 15.4 s
    in: its NVLink key's fastest transfers stayed fast (waiting, not degraded). The echo
    also holds where the job's network keys without the late process hold (a slower
    network would slow them too): 4 of 6, no shared GPU raised as a network fault (this
    batch was judged once before; the change was made after, on it). Through Inspector
    the straggler came 9.9 s in: held as its NVLink pair's link trouble (the shared GPU's
    NVLink kernels run 5x slower) though its peer waited for it there (spread effect
    0.9, under the spread rule's noise gate); a key whose ranks wait for one of them
    is now not link trouble even before its spread rule says so: 3.9 s, 5 of 6. Still
    missed: the plugin's ramp is found 6.1 s in (its first 5 s at 48 Gbit/s cost 4.6 %,
    under the gate)."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_9"])])
    wrong = {n for n in SPLIT["heldout_9"] if not rows[n]["ok"]}
    assert wrong == {"p4-ramp-48-12g"}, table
    assert rows["i4-gpuhog-g1"]["delay_s"] <= 5.0, table
    for name, rank in (("p4-gpuhog-g2", 2), ("p4-gpuhog-g0-0.5", 0), ("i4-gpuhog-g1", 1)):
        assert rows[name]["got"] == f"straggler rank {rank}", table
        assert rows[name]["false_alerts"] == [], table
    assert rows["p4-gpuhog-g0-0.5"]["delay_s"] <= 5.0, table
    for name in ("p4-ramp-48-12g", "i4-ramp-40-12g"):
        assert rows[name]["got"] == "network_path", table
    assert rows["i4-ramp-40-12g"]["delay_s"] <= 5.0, table
    assert rows["i4-t-clean"]["got"] == "-", table


def test_the_twelfth_batch_held_out_after_the_shared_gpu_changes(rows):
    """Recorded after the two changes the eleventh batch led to (made on it after its
    judgement), held out (plan u): GPUs shared 30 % and 50 % of the time, in 0.1-s and
    2-s spells, through both profilers; a throttle, a straggler, clean. Judged once by
    f125331: 6 of 6 (the code before the changes, b1b0d7a: 5 of 6, the Inspector
    half-shared GPU also raised as network_path)."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_10"])])
    assert all(rows[n]["ok"] for n in SPLIT["heldout_10"]), table
    for name, rank in (("p4-gpuhog-g3-0.3", 3), ("i4-gpuhog-g0-0.5", 0), ("i4-strag-r3-1.3x-u", 3)):
        assert rows[name]["got"] == f"straggler rank {rank}", table
        assert rows[name]["false_alerts"] == [] and rows[name]["delay_s"] <= 5.0, table
    assert rows["p4-tc-20g-u"]["got"] == "network_path", table
    assert rows["p4-u-clean"]["got"] == "-", table
    # GPU 1 taken for 1 s of every 2: the median step held (-3.4 %), the work done per
    # second fell 13.8 % (eval_gpu_runs.DUTY_PERIOD_S); the job's own drop, found by its
    # throughput rule's flapping (two windows 20 % down among six)
    r = rows["p4-gpuhog-g1-p2-dp64"]
    assert r["expected"] == "throughput_drop" and 0.12 < r["drop"] < 0.16, table
    assert (r["got"], r["false_alerts"]) == ("throughput_drop", []) and r["delay_s"] <= 5.0, table


def test_a_gpu_taken_a_second_at_a_time_is_missed_without_the_jobs_flapping_rule():
    cfg = load(None, environ={"NCCLWATCH_DETECTOR_THROUGHPUT_FLAP_COUNT": "0"})
    (r,) = eval_gpu_runs.evaluate([FIXTURES / "p4-gpuhog-g1-p2-dp64.tar.gz"], cfg, 5.0)
    assert (r["expected"], r["got"], r["ok"]) == ("throughput_drop", "-", False)



def test_the_thirteenth_batch_intra_node_faults_through_host_memory(rows):
    """Held out (plan v): one node whose GPUs talk through host memory (NCCL's SHM
    transport, `NCCL_P2P_DISABLE=1`), another process's PCIe copies on one GPU or host
    memory copies on 8 threads; a PCIe hog with NVLink on; clean. Judged once by
    81b73bd: 6 of 6 — only the four-GPU PCIe fault cost the gate (6.7 %), raised as
    `intra_node`; the others cost 1.5-3.9 % and raised nothing."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_11"])])
    assert all(rows[n]["ok"] for n in SPLIT["heldout_11"]), table
    r = rows["p4n1-shm-pcie-g2-s1"]
    assert (r["got"], r["false_alerts"], r["severity"]) == ("intra_node", [], "critical"), table
    assert r["delay_s"] <= 5.0, table
    for name in SPLIT["heldout_11"]:
        if name != "p4n1-shm-pcie-g2-s1":
            assert rows[name]["got"] == "-" and rows[name]["false_alerts"] == [], table


def test_the_fourteenth_batch_intra_node_faults_of_a_communication_bound_job(rows):
    """Plan w: the same faults on a job whose steps are mostly communication (SHM
    transfers of 64 MiB, 2 matmuls per layer), losing 9-29 %. Judged once by 81b73bd: 3
    of 6. Two changes made on it after (so it is no longer held out for them):

    * through Inspector on two GPUs nothing was raised at a 29 % loss: the small
      AllReduce's ranks waited for the GPU whose PCIe was shared (a straggler, held as
      its communicator's link trouble) while the link incident was held as that
      straggler's echo; a straggler that link trouble holds back explains nothing now;
    * through Inspector on four, `intra_node` came 5.2 s in: the SHM keys are 69 % of a
      step, so the link-share check's margin (`link_share_rise`) was most of the way to
      what a slower link does to the share, and read the loss as the job's own until the
      third window; the margin is now at most halfway there.

    5 of 6 after. The miss: on two pretend nodes, GPU 0's PCIe copies slowed every
    socket key 25-40 % (loopback sockets move through the same host memory, so the
    pretend network slowed host-wide) before node 0's SHM key fired: `network_path` 1.9 s
    in, `intra_node` 12.9 s in. On a real cluster another node's network would not slow."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["tune_3"])])
    assert [n for n in SPLIT["tune_3"] if not rows[n]["ok"]] == ["p4-shm-pcie-g0-big"], table
    for name in ("i2n1-shm-pcie-g1-big", "i4n1-shm-pcie-g3-s1-big", "p2n1-shm-pcie-g0-big",
                 "p4n1-shm-membw-16-big"):
        r = rows[name]
        assert (r["got"], r["false_alerts"], r["severity"]) == ("intra_node", [], "critical"), table
        assert r["delay_s"] <= 5.0, table
    assert rows["p4n1-shm-clean-big"]["got"] == "-", table



def test_the_fifteenth_batch_held_out_after_the_intra_node_changes(rows):
    """Plan x, recorded after the two changes the fourteenth batch led to: intra-node
    faults of other sizes, and what those changes could break (every rank slower on a
    communication-bound job, a straggler through host memory, a GPU shared half the
    time). Judged once by c5a3f80: 6 of 6 (81b73bd, the code before them, the same)."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_12"])])
    assert all(rows[n]["ok"] for n in SPLIT["heldout_12"]), table
    for name in ("i2n1-shm-pcie-g0-s1-b4", "p4n1-shm-pcie-g1-b4", "p2n1-shm-membw-24-b4"):
        assert rows[name]["got"] == "intra_node" and rows[name]["delay_s"] <= 5.0, table
    assert rows["i4n1-shm-strag-r2-1.5x-b4"]["got"] == "straggler rank 2", table
    assert rows["p4-gpuhog-g2-x"]["got"] == "straggler rank 2", table
    assert rows["p4n1-shm-slow-all-1.5x-b4"]["got"] == "throughput_drop", table
    assert all(rows[n]["false_alerts"] == [] for n in SPLIT["heldout_12"]), table


def test_the_sixteenth_batch_held_out_as_first_judged(rows):
    """Plan y, held out: fault kinds earlier batches had, through the other profiler or on
    another layout (competing sockets through Inspector, proxy starvation on four
    pretend nodes, a throttle of a 64 MiB data-parallel job on four, a GPU shared half
    the time on one NVLink node), a 1.2x straggler from 11 s, a 30-s throttle of a
    communication-bound job, and a clean run. Judged once by 0a0556a: 6 of 7. The miss:
    the clean run's network keys (Inspector) lost 25 % for five seconds 8 s into the
    job, and its throughput 13 %, a real dip of the machine's loopback network, not
    injected; its first two windows fell in the keys' warm-up, the next three raised
    `network_path` for 3 s. A fourth window before firing (``sustain_windows = 4``) would
    not raise it (nor the older i4-clean-2's), but it would make 37 of the 159 right
    answers on the 168 earlier runs wrong, most of them past the 5-s bound: not changed."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_13"])])
    right = {n for n in SPLIT["heldout_13"] if rows[n]["ok"]}
    assert right == set(SPLIT["heldout_13"]) - {"i4-clean-pp16-ag32-y"}, table
    assert rows["i4-clean-pp16-ag32-y"]["false_alerts"] == ["network_path"], table
    for name in ("p4n4-cpu-k2-y", "i4n4-dp64-tc-20g-y", "p4-ag32-tc-12g-long"):
        assert rows[name]["got"] == "network_path" and rows[name]["delay_s"] <= 5.0, table
    assert rows["i4n1-gpuhog-g3-0.5-y"]["got"] == "straggler rank 3", table
    assert rows["p4-strag-r3-1.2x-early"]["got"].startswith("straggler"), table
    # 3.4 %, under the gate: nothing raised
    assert rows["i4-sock-n8-y"]["got"] == "-" and rows["i4-sock-n8-y"]["false_alerts"] == [], table


def test_the_seventeenth_batch_held_out_after_the_change_it_led_to(rows):
    """Plan z, held out: a pulsed throttle (5 s on, 3 s off) and proxy starvation through
    Inspector, an 8-s throttle, a 1.15x straggler, a GPU shared 30 % of the time on one
    NVLink node, a stepped-down rate, clean. Judged once by 0c459cb: 6 of 7, the pulsed
    throttle also raising a straggler 17.2 s in, its echo, raised when the link incident
    resolved between two pulses. A link incident resolved within reopen_s still explains
    its echoes (causes.echoed_links): 7 of 7."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_14"])])
    assert all(rows[n]["ok"] and rows[n]["false_alerts"] == [] for n in SPLIT["heldout_14"]), table
    r = rows["i4-pulse-5-3-tc-20g-z"]
    assert (r["got"], r["delay_s"]) == ("network_path", 3.2), table
    for name in ("i4-cpu-k1-z", "p4-ramp-40-16g-z", "p4-tc-28g-8s-z"):
        assert rows[name]["got"] == "network_path" and rows[name]["delay_s"] <= 5.0, table
    assert rows["p4n1-gpuhog-g1-0.3-z"]["got"] == "straggler rank 1", table
    assert rows["i4-strag-r2-1.15x-z"]["got"].startswith("straggler"), table


def test_the_eighteenth_batch_held_out_after_the_pause_change(rows):
    """Plan aa, recorded after the seventeenth batch's change and held out: pulsed
    throttles of other periods (6 s on 2 off; 3 on 3 off through Inspector), plain
    stragglers through both profilers, clean, competing sockets under the gate, four
    pretend nodes. Judged once by 0d933ae: 7 of 7 (0c459cb, before it, the same)."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_15"])])
    assert all(rows[n]["ok"] and rows[n]["false_alerts"] == [] for n in SPLIT["heldout_15"]), table
    for name in ("p4-pulse-6-2-tc-16g-aa", "i4-pulse-3-3-tc-12g-aa", "i4n4-tc-16g-aa"):
        assert rows[name]["got"] == "network_path" and rows[name]["delay_s"] <= 5.0, table
    assert rows["p4-strag-r1-1.3x-aa"]["got"] == "straggler rank 1", table
    assert rows["i4-strag-r3-1.5x-aa"]["got"] == "straggler rank 3", table
    assert rows["i4-clean-aa"]["got"] == "-" and rows["p4-sock-n8-aa"]["got"] == "-", table


def test_the_nineteenth_batch_held_out_fault_sizes_not_seen_before(rows):
    """Plan ab, recorded 2026-11-28 and held out: a throttle to 8 Gbit/s and a mild one
    to 36, a 2x straggler and a 1.3x one from 24 s in through Inspector, a GPU shared 70 %
    of the time on one node, host-memory copies under the gate, a clean run with a 64 MiB
    AllReduce. Judged once by 0f400ae: 7 of 7."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_16"])])
    assert all(rows[n]["ok"] and rows[n]["false_alerts"] == [] for n in SPLIT["heldout_16"]), table
    for name in ("p4-tc-8g-ab", "i4-tc-36g-ab"):
        assert rows[name]["got"] == "network_path" and rows[name]["delay_s"] <= 5.0, table
    assert rows["p4-strag-r0-2x-ab"]["got"] == "straggler rank 0", table
    assert rows["i4-strag-r1-1.3x-late-ab"]["got"] == "straggler rank 1", table
    assert rows["p4n1-gpuhog-g2-0.7-ab"]["got"] == "straggler rank 2", table
    assert rows["i4n1-shm-membw-ab"]["got"] == "-" and rows["p4-clean-ar64-ab"]["got"] == "-", table


def test_the_twentieth_batch_held_out_six_of_seven(rows):
    """Plan ac, recorded 2026-11-28 and held out: four pretend nodes throttled, a 1.2x
    straggler through Inspector, throttle pulses of 2 s on and 2 s off, a GPU shared 50 %
    through Inspector, proxy starvation, an 8-s straggler, clean. Judged once by f7a9612:
    6 of 7; the miss (the 2-s pulses: one slow window in four, never three in a row) is
    in the fixtures' README. Since the flapping rule (a network key firing on two windows
    losing half among its last six) the pulses are `network_path`, critical, 5.6 s in:
    past the eval's 5-s bound (the second pulse's window closes 5.6 s after the first's
    start), so still not "ok"."""
    right = [n for n in SPLIT["heldout_17"] if n != "p4-pulse-2-2-tc-10g-ac"]
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_17"])])
    pulse = rows["p4-pulse-2-2-tc-10g-ac"]
    assert (pulse["got"], pulse["severity"], pulse["false_alerts"]) == ("network_path", "critical", []), table
    assert pulse["delay_s"] <= 6.0, table
    assert all(rows[n]["ok"] and rows[n]["false_alerts"] == [] for n in right), table
    for name in ("p4n4-tc-20g-ac", "p4-cpu-k3-ac"):
        assert rows[name]["got"] == "network_path" and rows[name]["delay_s"] <= 5.0, table
    for name in ("i4-strag-r2-1.2x-ac", "i4n1-gpuhog-g0-0.5-ac", "p4-strag-r3-1.5x-8s-ac"):
        assert rows[name]["got"].startswith("straggler"), table
    assert rows["i4-clean-dp64-ar64-ac"]["got"] == "-", table


def test_the_twenty_first_batch_pulsed_links_are_named_late_and_nothing_else_is_raised(rows):
    """Plan ad, recorded 2026-11-28 after the flapping rule and held out for it: throttle
    pulses of 1/3, 2/2 (Inspector), 2/3 (four pretend nodes) and 1/2 s on/off, a GPU shared
    50 %, a 1.3x straggler through Inspector, clean. Judged once: 4 of 7 (the eval's loss of
    1-s pulses mended; the rule off: 3 of 7, no pulsed run named). Every pulsed run is a
    critical, flapping `network_path` on the second pulse, three past the 5-s bound."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_18"])])
    pulsed = [n for n in SPLIT["heldout_18"] if "-pulse-" in n]
    assert len(pulsed) == 4
    for name in pulsed:
        row = rows[name]
        assert row["drop"] >= 0.5, table  # 1-s spans measured, not "below the gate"
        assert (row["got"], row["severity"], row["false_alerts"]) == ("network_path", "critical", []), table
        assert row["delay_s"] <= 6.5, table
    assert rows["p4-pulse-1-2-tc-20g-ad"]["ok"], table
    for name in ("p4-gpuhog-g1-0.5-ad", "i4-strag-r1-1.3x-ad", "p4-clean-ad"):
        assert rows[name]["ok"] and rows[name]["false_alerts"] == [], table


def test_a_pulsed_link_through_inspector_is_not_called_the_jobs_own_drop(tmp_path):
    """Its first drop-out passes before the second fires the link; the throughput drop
    between them is NCCL's (before: a `throughput_drop` "not NCCL" 3.3 s in)."""
    from ncclwatch.detectors import watch
    from ncclwatch.ingest.recording import ReadStats, read_recording

    run = eval_gpu_runs.unpacked(FIXTURES / "i4-pulse-2-2-tc-12g-ad.tar.gz", tmp_path)
    srcs, options = eval_gpu_runs.sources(run)
    events = watch.detect(load(None, environ={}), read_recording(srcs, ReadStats(), options))
    firing = [e for e in events if e.state == "firing"]
    assert [e.type for e in firing] == ["network_path"]
    assert firing[0].evidence["flapping"] is True


def test_a_straggler_is_named_by_the_communicator_where_the_others_wait_for_it(tmp_path):
    """Rank 3 shares a node with the slow rank 2 and waits for it in their NVLink
    communicator, so it comes as late to the next mixed collective and looks later
    there; the event names GPU 2's process and says which rank the first key named."""
    from ncclwatch.detectors import watch
    from ncclwatch.ingest.recording import ReadStats, read_recording

    run = eval_gpu_runs.unpacked(FIXTURES / "p4-strag-r2-1.3x.tar.gz", tmp_path)
    info = json.loads((run / "run.json").read_text())
    srcs, options = eval_gpu_runs.sources(run)
    events = watch.detect(load(None, environ={}), read_recording(srcs, ReadStats(), options))
    firing = [e for e in events if e.state == "firing"]
    assert [e.type for e in firing] == ["straggler"]
    ev = firing[0]
    comm = next(c for c in info["comms"].values() if c["comm"] == ev.evidence["comm"])
    assert info["ranks"][str(comm["ranks"][ev.rank])]["gpu"] == 2
    assert ev.evidence["named_first"]["rank"] == 3 and ev.evidence["named_first"]["comm"] != ev.evidence["comm"]


@pytest.mark.kafka
def test_worker_reports_what_local_mode_reports(kafka_bootstrap, tmp_path):
    """The scores and busy times the job stage compares travel in the key verdicts: the
    cluster path (forward -> Kafka -> worker) names the same process (by GPU; by process
    id through Inspector), and finds every rank slower to be the job's own drop."""
    from ncclwatch_testkit.drivers import recorded_runs_through_worker, worker_and_local

    runs = [FIXTURES / f"{n}.tar.gz"
            for n in ("p4-strag-r2-1.3x", "p4-tc-16g", "i4-slow-all-1.3x", "i4-strag-r0-1.3x")]
    got = recorded_runs_through_worker(kafka_bootstrap, tmp_path, runs, eval_gpu_runs.sources)

    worker, local = worker_and_local(got)
    assert worker == local, (worker, local, got["log"][-3000:])
    assert {e[2] for e in worker} == {"network_path", "straggler", "throughput_drop"}


def test_a_job_that_logs_its_throughput_every_2_s_is_found_slowing_in_stream_time():
    """The every-rank slowdowns replayed as if the trainer logged once per 2 s
    (``eval_gpu_runs.coarser_throughput``): a log line's value spans the windows since the
    last one, so the drop is found 6-9 s in, where three log lines took 10-13 s."""
    runs = ["p4-slow-all-1.3x", "i4n4-slow-all-1.3x"]
    got = eval_gpu_runs.evaluate([FIXTURES / f"{n}.tar.gz" for n in runs], load(None, environ={}),
                                 10.0, log_interval_s=2.0)
    table = eval_gpu_runs.markdown(got)
    for r in got:
        assert r["got"] == "throughput_drop" and r["false_alerts"] == [], table
        assert r["delay_s"] <= 9.0, table
