#!/usr/bin/env bash
# Regenerate the plain manifests in this folder from the Helm chart (tests/test_helm_chart.py
# checks that they match). helm: scripts/setup.sh builds it into .cache/bin.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
HELM="${HELM:-$REPO/.cache/bin/helm}"
render() {
    local out="$1"; shift
    {
        echo "# Generated from deploy/helm/ncclwatch by deploy/kubernetes/render.sh; do not edit."
        echo "# helm template ${*:-(chart defaults)}"
        echo "---"
        "$HELM" template ncclwatch "$REPO/deploy/helm/ncclwatch" --namespace ncclwatch \
            --kube-version 1.33.0 "$@" | sed '1{/^---$/d}'
    } >"$HERE/$out"
}
render ncclwatch.yaml
render training-job-example.yaml --set "trainingPod.exampleJob=true,trainingPod.snippet=false,forwarder.enabled=false,worker.enabled=false,serviceMonitor.enabled=false,prometheusRule.enabled=false"
