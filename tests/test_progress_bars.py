"""Progress bars of ``watch`` (replaying a recording) and ``replay``: drawn on stderr only
when it is a terminal, never mixed into event lines, and absent from pipes and logs.

Real processes; stderr is a pseudo-terminal where a terminal is wanted."""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from ncclwatch_testkit.drivers import write_spool

pytest.importorskip("tqdm")


def run_with_terminal_stderr(args: list[str], cwd: Path) -> tuple[str, str]:
    """Run ``ncclwatch ARGS``: stdout to a pipe, stderr to a pseudo-terminal."""
    primary, secondary = os.openpty()
    # a new pseudo-terminal is 0 columns wide, where tqdm draws nothing: make it 100
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    env = {**os.environ, "NCCLWATCH_JOB_ID": "progress-test"}
    proc = subprocess.Popen([sys.executable, "-m", "ncclwatch.cli", *args], stdout=subprocess.PIPE,
                            stderr=secondary, cwd=cwd, env=env)
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(primary, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    out = proc.stdout.read().decode()
    assert proc.wait(60) == 0
    os.close(primary)
    return out, b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("command", ["watch", "replay"])
def test_a_bar_on_a_terminal_and_event_lines_kept_whole(tmp_path, command):
    spool = tmp_path / "spool"
    write_spool(spool)
    args = (["watch", str(spool), "--speed", "0", "--metrics-port", "-1"] if command == "watch"
            else ["replay", "--files", str(spool), "--detect"])
    out, err = run_with_terminal_stderr(args, tmp_path)
    events = [line for line in out.splitlines() if line.startswith(("FIRING", "RESOLVED"))]
    assert events, out[-2000:]
    assert "\r" not in out and all(" [" in e and e.endswith("]") for e in events)
    assert "%|" in err and ("replaying" in err if command == "watch" else "replay" in err)


def test_no_bar_without_a_terminal_or_with_no_progress(tmp_path):
    spool = tmp_path / "spool"
    write_spool(spool)
    env = {**os.environ, "NCCLWATCH_JOB_ID": "progress-test"}
    piped = subprocess.run([sys.executable, "-m", "ncclwatch.cli", "watch", str(spool), "--speed", "0",
                            "--metrics-port", "-1"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert piped.returncode == 0 and "%|" not in piped.stderr and "\r" not in piped.stderr
    _, err = run_with_terminal_stderr(["watch", str(spool), "--speed", "0", "--metrics-port", "-1",
                                       "--no-progress"], tmp_path)
    assert "%|" not in err
