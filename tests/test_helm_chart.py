"""deploy/helm/ncclwatch: rendered with helm, every object checked against Kubernetes' schemas.

Core kinds are validated against the Kubernetes JSON schemas (strict: unknown fields are
errors) that the kubernetes-validate package ships; the Prometheus Operator kinds are
decoded strictly into the operator's Go types by tests/k8s/crdcheck. helm and crdcheck are
built by scripts/setup.sh from the Go module proxy. No cluster is involved: nothing here
shows that pods schedule, that hostPath permissions work on a real node, or that
Prometheus picks the ServiceMonitors up (docs/deploy.md lists what was not run).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml
from packaging_support import CACHE, REPO

CHART = REPO / "deploy" / "helm" / "ncclwatch"
MANIFESTS = REPO / "deploy" / "kubernetes"
KUBE_VERSIONS = ("1.29.0", "1.33.0")  # the oldest and a current release the chart targets
RENDER_ARGS = ["--namespace", "ncclwatch", "--kube-version", "1.33.0"]
# The committed plain manifests: file -> helm arguments.
COMMITTED = {
    "ncclwatch.yaml": [],
    "training-job-example.yaml": ["--set", "trainingPod.exampleJob=true,trainingPod.snippet=false,"
                                  "forwarder.enabled=false,worker.enabled=false,"
                                  "serviceMonitor.enabled=false,prometheusRule.enabled=false"],
}
VARIANTS = {
    "defaults": [],
    "init-container-no-delete": ["--set", "plugin.mode=initContainer,forwarder.deleteAcked=false,"
                                 "trainingPod.exampleJob=true,scrapeConfig.enabled=true,"
                                 "kafka.existingSecret=kafka-creds,worker.replicas=8",
                                 "--set-string", "config=[detector]\nthreshold = 0.2\n"],
    "no-operator": ["--set", "serviceMonitor.enabled=false,prometheusRule.enabled=false,"
                    "scrapeConfig.enabled=true"],
    "forwarders-only": ["--set", "worker.enabled=false"],
}


def tool(name: str) -> str:
    path = CACHE / "bin" / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} not found: scripts/setup.sh builds it into {path.parent}")
        pytest.skip(f"{name} not built (scripts/setup.sh)")
    return found


def render(*args: str) -> str:
    proc = subprocess.run([tool("helm"), "template", "ncclwatch", str(CHART), *RENDER_ARGS, *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def objects(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_lint_passes():
    proc = subprocess.run([tool("helm"), "lint", "--strict", str(CHART), "--kube-version", "1.33.0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_rendered_object_validates_against_the_kubernetes_schemas(variant, tmp_path):
    text = render(*VARIANTS[variant])
    docs = objects(text)
    assert docs
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{variant}: {doc['kind']}/{doc['metadata']['name']} on {version}: {e.message} "
                            f"at {'.'.join(map(str, e.path))}")
    (tmp_path / "rendered.yaml").write_text(text)
    proc = subprocess.run([tool("ncclwatch-crdcheck"), str(tmp_path / "rendered.yaml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    operator_kinds = sum(d["apiVersion"].startswith("monitoring.coreos.com/") for d in docs)
    assert proc.stdout.count("ok ") == operator_kinds


def test_the_validator_catches_a_misspelt_field():
    (daemonset,) = [d for d in objects(render()) if d["kind"] == "DaemonSet"]
    daemonset["spec"]["template"]["spec"]["tolerations"][0]["efect"] = "NoSchedule"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, "1.33.0", strict=True)


@pytest.mark.parametrize("name", list(COMMITTED))
def test_committed_manifests_are_the_chart_rendered(name):
    want = render(*COMMITTED[name])
    got = (MANIFESTS / name).read_text()
    header, _, body = got.partition("\n---\n")
    assert header.startswith("#") and body == want.removeprefix("---\n"), (
        f"deploy/kubernetes/{name} is stale: run deploy/kubernetes/render.sh")


def test_prometheus_rule_carries_the_alerting_rules_file():
    copy = CHART / "files" / "ncclwatch.rules.yml"
    assert copy.read_text() == (REPO / "alerting" / "rules" / "ncclwatch.rules.yml").read_text(), (
        "the chart's copy of alerting/rules/ncclwatch.rules.yml differs: copy it again")
    (rule,) = [d for d in objects(render()) if d["kind"] == "PrometheusRule"]
    assert rule["spec"] == yaml.safe_load(copy.read_text())


def by_kind(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def test_forwarder_runs_on_gpu_nodes_and_worker_without_root():
    docs = objects(render())
    ds = by_kind(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert ds["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {(t["key"], t["effect"]) for t in ds["tolerations"]} >= {("nvidia.com/gpu", "NoSchedule")}
    fwd = ds["containers"][0]
    # deleting acked segments of other users' jobs: root with DAC_OVERRIDE and nothing else
    assert fwd["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]}
    assert fwd["securityContext"]["readOnlyRootFilesystem"] is True
    assert fwd["resources"]["requests"] and fwd["resources"]["limits"]
    worker = by_kind(docs, "Deployment")["spec"]["template"]["spec"]
    assert worker["securityContext"]["runAsNonRoot"] is True
    c = worker["containers"][0]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["resources"]["requests"] and c["resources"]["limits"]
    no_delete = objects(render("--set", "forwarder.deleteAcked=false"))
    ds = by_kind(no_delete, "DaemonSet")["spec"]["template"]["spec"]
    assert ds["securityContext"]["runAsNonRoot"] is True
    assert ds["containers"][0]["args"] == ["forward", "--no-delete-acked"]


def test_workers_never_outnumber_partitions():
    docs = objects(render("--set", "worker.replicas=10,kafka.partitions=6"))
    assert by_kind(docs, "Deployment")["spec"]["replicas"] == 6


def test_training_pods_get_their_job_identity_from_labels_through_the_downward_api():
    from ncclwatch.ingest.throughput import K8S_NAMESPACE, K8S_SOURCES

    job = by_kind(objects(render("--set", "trainingPod.exampleJob=true")), "Job")
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[K8S_NAMESPACE]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    for name, where in K8S_SOURCES:
        kind, key = where.split()  # "label training.kubeflow.org/job-name"
        field = {"label": "labels", "annotation": "annotations"}[kind]
        assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.{field}['{key}']"
    assert env["NCCL_PROFILER_PLUGIN"]["value"] == "/opt/ncclwatch/lib/libncclwatch-profiler.so"


def test_service_monitors_keep_the_training_job_label_and_add_node_and_cluster():
    docs = objects(render("--set", "cluster=prod-a"))
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"ncclwatch-forwarder", "ncclwatch-worker"}
    for m in monitors:
        (ep,) = m["spec"]["endpoints"]
        assert ep["honorLabels"] is True
        assert {r["targetLabel"] for r in ep["relabelings"]} == {"node", "cluster"}
        assert {"targetLabel": "cluster", "replacement": "prod-a"} in ep["relabelings"]
