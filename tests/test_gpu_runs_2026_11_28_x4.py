"""Real 4×H200 runs of 2026-11-28, held out: seven batches of the 4-GPU layouts (two or
four pretend nodes, or one NVLink node of four), each judged once (7, 6 and 7 of 7, 1 of
4, 5, 5 and 6 of 7); tests/fixtures/gpu_runs/2026-11-28-x4 has the README."""

from __future__ import annotations

from gpu_runs_support import eval_gpu_runs, recorded_set

FIXTURES, SPLIT, rows, test_the_split_is_the_directory = recorded_set("2026-11-28-x4")


def test_the_first_batch(rows):
    """7 of 7 (plan `ak`): a two-step ramp through Inspector, a 1.4x straggler through
    Inspector, proxy starvation on four pretend nodes, every rank 1.2x slower, a
    throttle, a GPU shared 40 %, clean with pipeline Send/Recv."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout"])])
    assert all(rows[n]["ok"] for n in SPLIT["heldout"]), table
    for name in ("i4-ramp-32-16-ak", "i4n4-cpu-k2-ak", "p4-tc-14g-ak"):
        assert rows[name]["got"] == "network_path" and rows[name]["severity"] == "critical", table
    assert rows["i4-strag-r2-1.4x-ak"]["got"] == "straggler rank 0", table  # global rank 2
    assert rows["p4n4-gpuhog-g3-0.4-ak"]["got"] == "straggler rank 3", table
    assert rows["p4-slow-all-1.2x-ak"]["got"] == "throughput_drop", table
    assert rows["p4-pp-clean-ak"]["got"] == "-" and rows["p4-pp-clean-ak"]["false_alerts"] == [], table


def test_the_second_batch(rows):
    """6 of 7 (plan `al`: smaller faults). The miss: a GPU shared 25 % through Inspector,
    its rank late on the mixed communicator only, taken for the job's own drop."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_2"])])
    assert [n for n in SPLIT["heldout_2"] if not rows[n]["ok"]] == ["i4-gpuhog-g1-0.25-al"], table
    r = rows["i4-gpuhog-g1-0.25-al"]
    assert r["got"] == "-" and [a.split("@")[0] for a in r["false_alerts"]] == ["throughput_drop"], table
    assert rows["p4-strag-r0-1.3x-8s-al"]["got"] == "straggler rank 0", table
    for name in ("p4-tc-40g-al", "p4n4-pulse-3-3-tc-20g-al"):
        assert rows[name]["got"] == "network_path" and rows[name]["delay_s"] <= 5.0, table
    for name in ("i4-strag-r1-1.2x-al", "p4-sock-n16-al", "i4n4-clean-al"):  # under the gate, clean
        assert rows[name]["got"] == "-" and rows[name]["false_alerts"] == [], table


def test_the_third_batch(rows):
    """7 of 7 (plan `am`): one NVLink node of four (a straggler, clean, host-memory copies
    under SHM through Inspector), every rank 1.3x slower and a late throttle through
    Inspector, a throttle with pipeline Send/Recv, a 48 -> 24 -> 12 Gbit/s ramp."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_3"])])
    assert all(rows[n]["ok"] for n in SPLIT["heldout_3"]), table
    for name in ("i4-tc-24g-late-am", "p4-pp-tc-16g-am", "p4-ramp-48-24-12-am"):
        assert rows[name]["got"] == "network_path" and rows[name]["delay_s"] <= 5.0, table
    assert rows["i4n1-shm-membw-24-am"]["got"] == "intra_node", table
    assert rows["p4n1-strag-r2-1.3x-am"]["got"] == "straggler rank 2", table
    assert rows["i4-slow-all-1.3x-am"]["got"] == "throughput_drop", table
    assert rows["p4n1-clean-am"]["got"] == "-" and rows["p4n1-clean-am"]["false_alerts"] == [], table


def test_the_fourth_batch(rows):
    """1 of 4 (plan `an`, four 40-s runs): 2-s pulses found late (5.8 s); a GPU shared
    30 % raised as a straggler where `measure_fault.py` labelled the job's own drop; a
    1.1x straggler under the gate raised when the network dipped on its own."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_4"])])
    assert [n for n in SPLIT["heldout_4"] if rows[n]["ok"]] == ["p4-cpu-k1-d0.5-an"], table
    r = rows["i4-pulse-2-2-tc-16g-an"]
    assert (r["got"], r["false_alerts"]) == ("network_path", []) and r["delay_s"] > 5.0, table
    r = rows["i4n4-gpuhog-g2-0.3-an"]
    assert r["got"] == "-" and [a.split("@")[0] for a in r["false_alerts"]] == ["straggler"], table
    r = rows["p4-strag-r3-1.1x-an"]
    assert r["got"] == "-" and [a.split("@")[0] for a in r["false_alerts"]] == ["straggler", "network_path"], table


def test_the_fifth_batch(rows):
    """5 of 7 as first judged (plan `ao`, by 8228787), 6 of 7 since be3bbcd: another
    process's NVLink copies between GPUs 2 and 3 of one node, whose intra_node incident
    and straggler each held the other as its echo (nothing for 25 s), are raised as
    `intra_node`. The miss: 48 competing sockets costing 5.6 %, raised as the job's own
    drop (its network keys lost 5-15 %, never three windows in a row)."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_5"])])
    assert [n for n in SPLIT["heldout_5"] if not rows[n]["ok"]] == ["i4-sock-n48-ao"], table
    r = rows["i4-sock-n48-ao"]
    assert r["got"] == "-" and [a.split("@")[0] for a in r["false_alerts"]] == ["throughput_drop"], table
    r = rows["p4n1-nvlink-2x2-big-ao"]
    assert (r["got"], r["false_alerts"]) == ("intra_node", []) and r["delay_s"] <= 5.0, table
    for name in ("p4-tc-28g-mm6-ao", "p4-cpu-k4-late-ao"):
        assert rows[name]["got"] == "network_path" and rows[name]["severity"] == "critical", table
    assert rows["i4n4-strag-r3-1.6x-ao"]["got"] == "straggler rank 3", table
    assert rows["p4-strag-r1-2x-6s-ao"]["got"] == "straggler rank 1", table
    assert rows["i4-clean-mm2-ao"]["got"] == "-" and rows["i4-clean-mm2-ao"]["false_alerts"] == [], table


def test_the_sixth_batch(rows):
    """5 of 7 (plan `ap`, held out for be3bbcd and judged once by it; 8228787 the same):
    two more runs of another process's NVLink copies on one node of four, each raised as
    a straggler on one of the two GPUs the copies slowed (labelled `intra_node` and, by
    `measure_fault.py`, the job's own drop); one-way copies across pretend nodes under
    the gate, stragglers, a shared GPU and a throttle right."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_6"])])
    misses = ["i4n1-nvlink-1-2-big-ap", "p4n1-nvlink-0-1-both-ap"]
    assert [n for n in SPLIT["heldout_6"] if not rows[n]["ok"]] == misses, table
    for name in misses:
        r = rows[name]
        assert r["got"] == "-" and [a.split("@")[0] for a in r["false_alerts"]] == ["straggler"], table
    assert rows["i4-strag-r0-1.5x-ap"]["got"] == "straggler rank 0", table
    assert rows["p4n1-strag-r1-1.5x-big-ap"]["got"] == "straggler rank 1", table
    assert rows["p4n1-gpuhog-g1-0.5-ap"]["got"] == "straggler rank 1", table
    assert rows["i4n4-tc-24g-ap"]["got"] == "network_path", table
    r = rows["p4-nvlink-1way-2-3-big-ap"]
    assert (r["got"], r["false_alerts"]) == ("-", []), table


def test_the_seventh_batch(rows):
    """6 of 7 (plan `aq`, faults near the 5 % gate, judged once by 4d851f5): a 1.2x
    straggler through Inspector named, a 44 Gbit/s throttle and proxies starved 30 % of
    the time raised; 32 sockets and every rank 1.1x slower under the gate and clean
    quiet. The miss: a GPU shared 20 % through Inspector (9.1 %), labelled the job's own
    drop, nothing raised: the job's drop waits for a straggler incident on the shared
    GPU's rank that the early-loss check never confirms. Since
    `detector.throughput_hold_windows` (a drop held 10 windows for NCCL trouble that is
    never raised goes out as the job's own) it is raised, 14 s in: past the 5-s bound,
    still a miss, no longer silent."""
    table = eval_gpu_runs.markdown([rows[n] for n in sorted(SPLIT["heldout_7"])])
    assert [n for n in SPLIT["heldout_7"] if not rows[n]["ok"]] == ["i4-gpuhog-g0-0.2-aq"], table
    r = rows["i4-gpuhog-g0-0.2-aq"]
    assert (r["got"], r["false_alerts"]) == ("throughput_drop", []), table
    assert 10.0 <= r["delay_s"] <= 16.0, table
    assert rows["i4-strag-r3-1.2x-aq"]["got"] == "straggler rank 1", table  # global rank 3
    for name in ("p4-tc-44g-aq", "p4n4-cpu-k1-d0.3-aq"):
        assert rows[name]["got"] == "network_path" and rows[name]["delay_s"] <= 5.0, table
    for name in ("i4-sock-n32-aq", "p4-slow-all-1.1x-aq", "p4n4-clean-aq"):
        assert rows[name]["got"] == "-" and rows[name]["false_alerts"] == [], table
