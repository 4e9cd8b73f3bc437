"""A full disk under the forwarder: one log line, a metric, retries, nothing lost.

The unit tests write through ``/dev/full`` (every write fails with ``ENOSPC``). The
forwarding test puts the state directory on an 8 MiB tmpfs, mostly filled, while Kafka
is unreachable (``testing.TcpGate`` in front of the real broker, closed, then opened):
the spill buffer fills the disk, the checkpoint cannot be written, and the forwarder
must neither crash nor lose or strand a record, neither while the disk is full nor
once space returns and Kafka answers.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path

import pytest
from ncclwatch.ingest import checkpoint
from ncclwatch.ingest.buffer import DiskBuffer
from ncclwatch.ingest.forward import Forwarder, Options
from ncclwatch.ingest.metrics import ForwarderMetrics
from ncclwatch_testkit import services as testing
from ncclwatch_testkit.synth import write_spool
from test_ingest_forward_kafka import consume, make_cfg, records_of

from ncclwatch.records import OpRecord, parse_line


def _full(path: Path) -> None:
    """Make ``path`` a file whose writes fail with ENOSPC."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    path.symlink_to("/dev/full")


def test_a_failed_buffer_write_leaves_no_torn_frame_and_the_next_one_succeeds(tmp_path):
    b = DiskBuffer(str(tmp_path), file_bytes=10)
    b.append([("t", b"k", b"first" * 4)])  # fills file 0: the next append opens file 1
    _full(tmp_path / "buffer.000000000001.bin")
    with pytest.raises(OSError) as e:
        b.append([("t", b"k", b"lost?")])
    assert e.value.errno == 28  # ENOSPC
    (tmp_path / "buffer.000000000001.bin").unlink()  # space is back
    b.append([("t", b"k", b"second")])
    again = DiskBuffer(str(tmp_path))
    got = []
    while (m := again.peek()) is not None:
        got.append(m[0][2])
        again.advance()
    assert got == [b"first" * 4, b"second"]


def test_a_checkpoint_that_cannot_be_written_leaves_no_temp_file_and_the_old_one_intact(tmp_path):
    path = str(tmp_path / "n" / "checkpoint.json")
    checkpoint.save(path, {"acked": {"a": 1}})
    _full(Path(f"{path}.tmp.{os.getpid()}"))
    with pytest.raises(OSError):
        checkpoint.save(path, {"acked": {"a": 2}})
    assert sorted(os.listdir(tmp_path / "n")) == ["checkpoint.json"]
    assert checkpoint.load(path) == {"acked": {"a": 1}}
    # a temp file of a process killed while saving is removed at the next start
    stale = Path(f"{path}.tmp.999999999")
    stale.write_text("{")
    assert checkpoint.remove_stale_temps(path) == [str(stale)]


def test_state_files_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        b = DiskBuffer(str(tmp_path / "state" / "buffer"))
        b.append([("t", None, b"record content")])
        checkpoint.save(str(tmp_path / "state" / "checkpoint.json"), {})
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "state").rglob("*")}
    assert modes == {"buffer": 0o700, "buffer.000000000000.bin": 0o600, "checkpoint.json": 0o600}


def test_forwarder_with_a_full_buffer_disk_holds_batches_in_memory_and_pauses(tmp_path, caplog):
    from ncclwatch import config

    cfg = config.load(None, environ={"NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    spool = tmp_path / "spool"
    write_spool(str(spool), streams=1, ops_per_stream=3000)
    opts = Options(spool_dir=str(spool), state_dir=str(tmp_path / "state"), node_id="n", batch_size=200)
    metrics = ForwarderMetrics()
    fwd = Forwarder(cfg, opts, metrics=metrics)
    _full(tmp_path / "state" / "n" / "buffer" / "buffer.000000000000.bin")
    caplog.set_level(logging.INFO, "ncclwatch.forward")
    for _ in range(40):
        fwd.step()  # would raise ENOSPC before
    assert fwd.disk.failing("buffer") and any(b.held for b in fwd.delivery.batches)
    behind = fwd.spool.bytes_behind()
    for _ in range(5):
        fwd.step()
    assert fwd.spool.bytes_behind() == behind > 0  # reading paused: the spool keeps the rest
    failed = [r for r in caplog.records if "event=disk_write_failed" in r.getMessage()]
    assert len(failed) == 1 and "errno=ENOSPC" in failed[0].getMessage()
    assert metrics.registry.get_sample_value(
        "ncclwatch_forwarder_disk_write_errors_total", {"where": "buffer", "errno": "ENOSPC"}) >= 1
    assert metrics.registry.get_sample_value("ncclwatch_forwarder_disk_write_failing", {"where": "buffer"}) == 1
    fwd.close()


# --- a full file system during forwarding, with the real broker ------------------------------


def _wait(cond, timeout_s: float, what: str, thread: threading.Thread) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert thread.is_alive(), f"the forwarder stopped while waiting for: {what}"
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.05)


@pytest.mark.kafka
def test_a_full_disk_during_forwarding_loses_nothing_once_space_and_kafka_return(
        kafka_bootstrap, tmp_path, small_fs, caplog):
    gate = testing.TcpGate(kafka_bootstrap)  # closed: Kafka is down
    cfg = make_cfg(gate.address)
    spool = tmp_path / "spool"
    paths = write_spool(str(spool), streams=2, ops_per_stream=12000, segment_ops=4000)
    expected = {parse_line(x).id for p in paths for x in Path(p).read_bytes().split(b"\n") if x}
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (6 << 20))  # 2 MiB left of 8 (small_fs); the spool is ~13 MB
    state = small_fs / "state"
    opts = Options(spool_dir=str(spool), state_dir=str(state), node_id="n1", batch_size=500,
                   stall_s=3.0, compression="gzip")
    metrics = ForwarderMetrics()
    caplog.set_level(logging.INFO, "ncclwatch.forward")
    fwd = Forwarder(cfg, opts, metrics=metrics)
    crashed: list[BaseException] = []

    def run() -> None:
        try:
            fwd.run()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            crashed.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        # Kafka down, disk full: the buffer fills the disk, batches wait in memory.
        _wait(lambda: fwd.disk.failing("buffer"), 60, "the buffer disk to fill", t)
        _wait(lambda: any(b.held for b in fwd.delivery.batches), 30, "batches held in memory", t)
        behind = fwd.spool.bytes_behind()

        def errors() -> float:
            return metrics.registry.get_sample_value(
                "ncclwatch_forwarder_disk_write_errors_total", {"where": "buffer", "errno": "ENOSPC"}) or 0

        # a while of retries (each loop also waits out a Kafka bootstrap): still alive,
        # still paused, nothing dropped, and logged once (below)
        _wait(lambda: errors() >= 3, 60, "retries of the buffer write", t)
        assert fwd.spool.bytes_behind() == behind > 0
        retries = errors()

        # Space comes back: the buffer takes more, until the disk is full again.
        filler.unlink()
        _wait(lambda: fwd.delivery.buffer.disk_bytes > 3 << 20, 60, "spilling again", t)

        # Kafka comes back: the buffer drains, held batches go directly, the spool empties.
        gate.open()
        _wait(lambda: fwd.delivery.mode == "direct" and fwd.delivery.buffer.empty() and fwd.spool.bytes_behind() == 0
              and not any(not b.done for b in fwd.delivery.batches), 180, "everything sent", t)
        _wait(lambda: not fwd.disk.failing("checkpoint") and not fwd.delivery.dirty, 30, "a checkpoint", t)
    finally:
        fwd.stop()
        t.join(60)
        gate.close()
    assert not crashed, crashed
    ops = [r for _, _, r in records_of(consume(kafka_bootstrap, cfg.topics.ops)) if isinstance(r, OpRecord)]
    counts = collections.Counter(r.id for r in ops)
    assert set(counts) == expected  # nothing lost
    ckpt = json.loads((state / "n1" / "checkpoint.json").read_text())
    assert all(ckpt["acked"].get(p, os.path.getsize(p)) == os.path.getsize(p)
               for p in paths if os.path.exists(p))  # no stuck position
    leftovers = [p.name for p in state.rglob("*") if ".tmp" in p.name]
    assert leftovers == []
    failed = [r.getMessage() for r in caplog.records if "event=disk_write_failed" in r.getMessage()]
    recovered = [r.getMessage() for r in caplog.records if "event=disk_write_recovered" in r.getMessage()]
    assert failed and len(failed) <= len(recovered) + 1  # one line per episode, not per retry
    print(f"\nfull disk: {len(expected)} records, {sum(counts.values()) - len(counts)} duplicates, "
          f"{int(retries)}+ ENOSPC retries, {len(failed)} disk-full episode(s) logged")
