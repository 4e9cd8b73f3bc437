"""Building the wheel once per test session, away from the working tree.

The wheel is built from a copy of what goes into it, so the test never writes build/ or
plugin/build/ into a checkout that other work shares. Packages come from the wheelhouse
that scripts/setup.sh fills from requirements/ci.lock (no network); without it, from PyPI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("NCCLWATCH_CACHE_DIR", REPO / ".cache"))
WHEELHOUSE = CACHE / "wheelhouse"
FRAMEWORKS_PYTHON = CACHE / "frameworks-venv" / "bin" / "python"
# What the wheel is built from (MANIFEST.in's view of the tree).
SOURCES = ("ncclwatch", "ingest", "detectors", "alerting", "dashboards", "deploy",
           "plugin/src", "plugin/include", "plugin/Makefile", "pyproject.toml", "setup.py",
           "MANIFEST.in", "README.md", "LICENSE")


def index_args() -> list[str]:
    """pip arguments that install from the wheelhouse only, when setup.sh made one."""
    if (WHEELHOUSE / ".ncclwatch-setup").exists():
        return ["--no-index", "--find-links", str(WHEELHOUSE)]
    if os.environ.get("CI"):
        pytest.fail(f"no wheelhouse at {WHEELHOUSE}: scripts/setup.sh makes it")
    return []


def pip(*args: str, python: Path | None = None, timeout: float = 600) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    if python is not None:
        cmd += ["--python", str(python)]
    subprocess.run([*cmd, *args], check=True, timeout=timeout)


def build_wheel(out: Path) -> Path:
    src = out / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info", "*.so", "*.o")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    pip("wheel", "--no-deps", *index_args(), "-w", str(out / "dist"), str(src))
    (wheel,) = (out / "dist").glob("ncclwatch-*.whl")
    return wheel


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))
