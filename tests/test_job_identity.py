"""Job identity: one documented order of sources, the same in Python and in the plugin."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
from ncclwatch.ingest import throughput

REPO = Path(__file__).resolve().parents[1]
CASES = json.loads((REPO / "tests" / "vectors" / "job_id.json").read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=[json.dumps(c["env"]) for c in CASES])
def test_vectors_shared_with_the_plugin(case):
    assert throughput.job_identity(case["env"]) == (case["job"], case["source"])


def test_plugin_reads_the_same_variables_in_the_same_order():
    # The C tests run the vectors; this keeps the two lists of names from drifting apart.
    src = (REPO / "plugin" / "src" / "config.c").read_text()
    explicit = re.search(r"nw_job_explicit\[\] = \{([^}]*)\}", src).group(1)
    k8s = re.search(r"nw_job_k8s\[\] = \{([^}]*)\}", src).group(1)
    assert re.findall(r'"(\w+)"', explicit) == list(throughput.EXPLICIT_SOURCES)
    assert re.findall(r'"(\w+)"', k8s) == [name for name, _ in throughput.K8S_SOURCES]
    assert f'"{throughput.K8S_NAMESPACE}"' in src and f'"{throughput.ELASTIC_UNSET}"' in src


def test_every_source_is_documented_in_deploy_guide():
    doc = (REPO / "docs" / "deploy.md").read_text()
    section = doc[doc.index("## Job identity"):]
    for name in [*throughput.EXPLICIT_SOURCES, *(n for n, _ in throughput.K8S_SOURCES),
                 throughput.K8S_NAMESPACE, throughput.ELASTIC_SOURCE]:
        assert f"`{name}`" in section, name


def test_fallback_warns_once_per_process_naming_the_fix(monkeypatch):
    for name in [*throughput.EXPLICIT_SOURCES, *(n for n, _ in throughput.K8S_SOURCES)]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setattr(throughput, "_job_warned", False)
    with pytest.warns(RuntimeWarning, match="NCCLWATCH_JOB_ID") as caught:
        assert throughput.job_id() == "unknown"
    assert "torchrun's default" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert throughput.job_id() == "unknown"  # no second warning


def test_explicit_environment_mapping_never_warns(monkeypatch):
    monkeypatch.setattr(throughput, "_job_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert throughput.job_id({}) == "unknown"


def test_kubernetes_job_reaches_the_throughput_record(tmp_path, monkeypatch):
    monkeypatch.delenv("NCCLWATCH_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("PYTORCHJOB_NAME", "")
    monkeypatch.setenv("JOBSET_NAME", "llm-pretrain")
    monkeypatch.setenv("POD_NAMESPACE", "team-a")
    throughput.report_throughput(100.0, 1, spool_dir=str(tmp_path), rank=0)
    (line,) = (tmp_path / "team-a%2Fllm-pretrain").glob("*-throughput-*.jsonl")
    assert json.loads(line.read_text())["job"] == "team-a/llm-pretrain"
