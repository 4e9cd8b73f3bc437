"""``ncclwatch report``: Markdown and PNGs from a recording, with anomalies and faults marked."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
from ncclwatch.dashboards.run import Interval, anomaly_intervals
from ncclwatch_testkit.demo import write_demo_spool

from ncclwatch import cli
from ncclwatch.records import AnomalyEvent, to_json

SECONDS = 90
STRAGGLER_S = (20, 40)
NETWORK_S = (55, 80)


def event(
    id_: str,
    type_: str,
    state: str,
    start_ns: int,
    detected_ns: int,
    *,
    end_ns=None,
    key=None,
    rank=None,
    severity="critical",
    effect=0.35,
) -> AnomalyEvent:
    return AnomalyEvent(
        id=id_,
        type=type_,
        state=state,
        job="demo-job",
        key=key or {"comm": None, "comm_name": None, "op": None, "size_bucket": None, "transport": "net"},
        host=None,
        rank=rank,
        start_ns=start_ns,
        end_ns=end_ns,
        detected_ns=detected_ns,
        baseline_busbw_gbs=22.0,
        observed_busbw_gbs=14.3,
        effect=effect,
        attribution="network",
        throughput_delta=-0.13,
        severity=severity,
        evidence={},
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A scenario run directory: spool/ beside labels.json, as bench/scenarios records one.

    Its labels.json is in record.py's raw shape ({"faults": [...]}); the demo's own labels,
    in the labelled-scenario format, go to demo-run.labels.json beside it.
    """
    d = tmp_path_factory.mktemp("run") / "demo-run"
    labels = write_demo_spool(
        d / "spool",
        seconds=SECONDS,
        t0_ns=1_763_800_000 * 10**9,
        straggler_s=STRAGGLER_S,
        network_s=NETWORK_S,
    )
    raw = [{"type": lb["type"], "attribution": lb["attribution"], "start_ns": lb["start_ns"],
            "end_ns": lb["end_ns"]} for lb in labels["labels"]]  # fmt: skip
    (d / "labels.json").write_text(json.dumps({"scenario": "demo", "job": "demo-job", "faults": raw}))
    (d.parent / "demo-run.labels.json").write_text(json.dumps(labels))
    return d


def labelled(run_dir: Path) -> dict[str, dict]:
    return {f["type"]: f for f in json.loads((run_dir.parent / "demo-run.labels.json").read_text())["labels"]}


@pytest.fixture(scope="module")
def events_file(run_dir, tmp_path_factory) -> Path:
    """What `ncclwatch watch --events-out` writes: the network fault, fired and resolved."""
    net = labelled(run_dir)["network_path"]
    s = 10**9
    evs = [
        event("n1", "network_path", "firing", net["start_ns"] + s, net["start_ns"] + 4 * s),
        event(
            "n1",
            "network_path",
            "resolved",
            net["start_ns"] + s,
            net["end_ns"] + 3 * s,
            end_ns=net["end_ns"] + s,
        ),
        event(
            "w1",
            "collective_degraded",
            "firing",
            net["start_ns"] + 2 * s,
            net["start_ns"] + 5 * s,
            severity="warning",
        ),  # still firing at the end
    ]
    path = tmp_path_factory.mktemp("events") / "events.jsonl"
    path.write_text("".join(to_json(e) + "\n" for e in evs))
    return path


def assert_real_png(path: Path, min_w: int = 800, min_h: int = 400) -> None:
    import matplotlib.image
    import numpy as np

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    img = matplotlib.image.imread(path)
    h, w = img.shape[:2]
    assert w >= min_w and h >= min_h, (path, w, h)
    # a drawn figure, not a blank canvas: many distinct colours
    colours = np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 50, (path, len(colours))


def test_report_from_a_run_directory_writes_markdown_and_three_figures(run_dir, events_file, tmp_path):
    out = tmp_path / "report"
    rc = cli.main(["report", str(run_dir), "--events", str(events_file), "--out", str(out)])
    assert rc == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "keys-demo-job.png",
        "overview-demo-job.png",
        "ranks-demo-job.png",
        "report.md",
    ]
    for png in out.glob("*.png"):
        assert_real_png(png)
    md = (out / "report.md").read_text()
    assert md.startswith("# ncclwatch report: demo-run\n")
    for png in ("overview-demo-job.png", "keys-demo-job.png", "ranks-demo-job.png"):
        assert f"]({png})" in md
    # the anomaly table: one row per anomaly, the open one marked
    rows = [line for line in md.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2 and not any(line.startswith("| 3 |") for line in md.splitlines())
    assert "network_path" in rows[0] and "22.0 → 14.3 GB/s" in rows[0] and "-13.0%" in rows[0]
    assert "(still firing)" in rows[1]
    # the labelled network fault is matched to the detection 4 s after it began
    assert "| network_path | +55 s | +80 s | network_path, detected 4 s after the fault began |" in md
    assert "| straggler | +20 s | +40 s | none |" in md
    # every key of the demo topology is listed, the 32 MiB data-parallel ones first
    keys = [line for line in md.splitlines() if line.startswith("| 0x")]
    assert len(keys) == 5 and "| AllReduce | 32MiB | net | 2 |" in keys[0]
    # throughput drops while the anomalies are active (the demo job loses 13 %)
    assert "while an anomaly was active (-1" in md
    assert "The plugin dropped ops (12 ring_full)" in md


def test_report_reads_a_tar_gz_of_the_run_the_same_way(run_dir, events_file, tmp_path):
    archive = tmp_path / "demo-run.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(run_dir, arcname="demo-run")
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli.main(["report", str(run_dir), "--events", str(events_file), "--out", str(a)]) == 0
    assert cli.main(["report", str(archive), "--events", str(events_file), "--out", str(b)]) == 0
    md_a, md_b = (a / "report.md").read_text(), (b / "report.md").read_text()
    assert md_a.split("\n", 3)[3] == md_b.split("\n", 3)[3]  # all but title and source lines


def test_labels_beside_a_fixture_archive_are_found_and_validated(run_dir, events_file, tmp_path):
    """tests/fixtures/gpu_runs/ layout: NAME.tar.gz (the spool) beside NAME.labels.json."""
    archive = tmp_path / "gpu-run.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(run_dir / "spool", arcname=".")
    (tmp_path / "gpu-run.labels.json").write_text((run_dir.parent / "demo-run.labels.json").read_text())
    out = tmp_path / "r"
    assert cli.main(["report", str(archive), "--events", str(events_file), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert md.startswith("# ncclwatch report: gpu-run\n")
    assert "| network_path | +55 s | +80 s | network_path, detected 4 s after the fault began |" in md
    # a labels file that breaks the format is an error, not silently no labels
    bad = json.loads((tmp_path / "gpu-run.labels.json").read_text())
    bad["labels"][0]["type"] = "slow"
    (tmp_path / "bad.labels.json").write_text(json.dumps(bad))
    rc = cli.main(["report", str(archive), "--events", str(events_file), "--labels", str(tmp_path / "bad.labels.json"),
                   "--out", str(tmp_path / "r2")])  # fmt: skip
    assert rc == 2


def test_report_runs_the_detectors_when_no_events_are_given(run_dir, tmp_path):
    """Without --events the report replays the recording through the watch's detectors."""
    out = tmp_path / "report"
    assert cli.main(["report", str(run_dir / "spool"), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "from detectors run over the recording" in md
    net = labelled(run_dir)["network_path"]
    intervals = []
    for line in md.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 4 and cells[1].isdigit():
            intervals.append((cells[2], int(cells[4].strip("+ s"))))
    # the injected network degradation is found, starting inside the fault
    t0 = 1_763_800_000
    fault_from, fault_to = net["start_ns"] // 10**9 - t0, net["end_ns"] // 10**9 - t0
    assert any(fault_from <= start <= fault_to for _, start in intervals), md
    assert (out / "overview-demo-job.png").exists()


def test_unknown_job_is_an_error_not_an_empty_report(run_dir, tmp_path, capsys):
    rc = cli.main(["report", str(run_dir), "--job", "nope", "--out", str(tmp_path / "r")])
    assert rc == 2
    assert "no records of job nope" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_missing_run_is_an_error(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "absent")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_firing_and_resolved_events_pair_by_id_and_open_ones_run_to_the_end():
    s = 10**9
    evs = [
        event("b", "straggler", "firing", 50 * s, 53 * s, rank=3),
        event("a", "network_path", "firing", 10 * s, 12 * s),
        event("a", "network_path", "resolved", 10 * s, 31 * s, end_ns=30 * s),
    ]
    a, b = anomaly_intervals(evs, end_ns=99 * s)
    assert (a.kind, a.start_ns, a.end_ns, a.detected_ns, a.open) == (
        "network_path",
        10 * s,
        30 * s,
        12 * s,
        False,
    )
    assert (b.kind, b.end_ns, b.detected_ns, b.open) == ("straggler", 99 * s, 53 * s, True)


def test_an_anomaly_shades_the_keys_its_key_matches_with_none_as_a_wildcard():
    i = Interval("network_path", 0, 1, "j", {"comm": None, "op": "AllReduce", "transport": "net"})
    assert i.covers(("j", "0xa", "AllReduce", "32MiB", "net"))
    assert not i.covers(("j", "0xa", "AllReduce", "32MiB", "nvlink"))
    assert not i.covers(("j", "0xa", "AllGather", "32MiB", "net"))
    assert not i.covers(("other", "0xa", "AllReduce", "32MiB", "net"))
