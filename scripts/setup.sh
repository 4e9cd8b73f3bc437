#!/usr/bin/env bash
# One idempotent setup command for a fresh Debian 12 machine (and fast when already done):
#   - Debian packages: prometheus, prometheus-alertmanager, prometheus-node-exporter
#     (never left running as system services: scripts/services.sh starts our own on 127.0.0.1),
#     build-essential if gcc is missing, a JDK/Maven if missing;
#   - .venv (python3.11) with `pip install -e '.[dev]'`, constrained by requirements/ci.lock;
#   - a wheelhouse of the locked packages (the packaging test installs each extra from it);
#   - the test kit (testkit/, `ncclwatch_testkit`) into .venv, editable, from that wheelhouse;
#   - helm built from the Go module proxy (the chart test renders deploy/helm/ncclwatch);
#   - .cache/frameworks-venv with torch, Lightning and transformers for the callback tests
#     (NCCLWATCH_SKIP_FRAMEWORKS=1 skips it: ~5.6 GB);
#   - the C profiler plugin (`make -C plugin`) when plugin/Makefile exists;
#   - Apache Kafka jars from Maven Central (scripts/kafka/pom.xml) into
#     ${NCCLWATCH_CACHE_DIR:-<repo>/.cache}/kafka/libs.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_DIR="${NCCLWATCH_CACHE_DIR:-$REPO/.cache}"
KAFKA_DIR="$CACHE_DIR/kafka"
VENV="$REPO/.venv"
export DEBIAN_FRONTEND=noninteractive

log() { printf '[setup] %s\n' "$*" >&2; }

SUDO=""
if [[ $(id -u) -ne 0 ]]; then
    SUDO="sudo -n"
fi

sha() { sha256sum "$@" | sha256sum | cut -c1-16; }

# ---------------------------------------------------------------- Debian packages
pkg_installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'
}

apt_lists_present() {
    compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null
}

apt_install() {
    local pkgs=("$@")
    # Keep packages from starting their daemons during installation (policy-rc.d 101 = "deny").
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
        $SUDO chmod 755 "$policy"
        made_policy=1
    fi
    local rc=0
    if ! apt_lists_present; then
        log "apt-get update"
        $SUDO apt-get update -qq || rc=$?
    fi
    if [[ $rc -eq 0 ]]; then
        log "apt-get install ${pkgs[*]}"
        if ! $SUDO apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null; then
            log "install failed; retrying after apt-get update"
            $SUDO apt-get update -qq && $SUDO apt-get install -y -q --no-install-recommends \
                "${pkgs[@]}" >/dev/null || rc=$?
        fi
    fi
    if [[ $made_policy -eq 1 ]]; then
        $SUDO rm -f "$policy"
    fi
    return $rc
}

# Make sure the distro units/init scripts of the monitoring stack are stopped and disabled.
disable_system_service() {
    local svc="$1"
    if [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null; then
        if systemctl is-enabled --quiet "$svc" 2>/dev/null || systemctl is-active --quiet "$svc" 2>/dev/null; then
            log "disabling system service $svc"
            $SUDO systemctl disable --now "$svc" >/dev/null 2>&1 || true
        fi
    elif [[ -x /etc/init.d/$svc ]]; then
        if "/etc/init.d/$svc" status >/dev/null 2>&1; then
            log "stopping system service $svc"
            $SUDO "/etc/init.d/$svc" stop >/dev/null 2>&1 || true
        fi
        $SUDO update-rc.d "$svc" disable >/dev/null 2>&1 || true
    fi
}

MON_PKGS=(prometheus prometheus-alertmanager prometheus-node-exporter)
want=()
for p in "${MON_PKGS[@]}"; do
    pkg_installed "$p" || want+=("$p")
done
command -v gcc >/dev/null && command -v make >/dev/null || want+=(build-essential)
command -v java >/dev/null || want+=(openjdk-17-jdk-headless)
command -v mvn >/dev/null || want+=(maven)
command -v flock >/dev/null && command -v setsid >/dev/null || want+=(util-linux)
if ((${#want[@]})); then
    apt_install "${want[@]}"
    for p in "${MON_PKGS[@]}"; do
        disable_system_service "$p"
    done
fi

# ---------------------------------------------------------------- Python venv
PY="${NCCLWATCH_PYTHON:-}"
if [[ -z $PY ]]; then
    for cand in python3.11 python3; do
        if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))' 2>/dev/null; then
            PY="$cand"
            break
        fi
    done
fi
[[ -n $PY ]] || { log "python >= 3.11 not found"; exit 1; }

if [[ ! -x $VENV/bin/python ]] || ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
    log "creating $VENV with $PY"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
stamp="$VENV/.ncclwatch-setup"
LOCK="$REPO/requirements/ci.lock"
want_stamp="$(sha "$REPO/pyproject.toml" "$LOCK")"
if [[ ! -f $stamp || $(cat "$stamp") != "$want_stamp" ]] \
    || ! (cd /tmp && "$VENV/bin/python" -c 'import kafka, pytest, hypothesis, ncclwatch' 2>/dev/null); then
    log "pip install -e '.[dev]' -c requirements/ci.lock"
    "$VENV/bin/python" -m pip install -q -e "${REPO}[dev]" -c "$LOCK"
    echo "$want_stamp" >"$stamp"
fi

# The locked packages as files, plus the build backend: tests/test_packaging.py installs the
# wheel with each extra into fresh venvs from here, without the network.
WHEELHOUSE="$CACHE_DIR/wheelhouse"
wstamp="$WHEELHOUSE/.ncclwatch-setup"
want_wstamp="$(sha "$LOCK" "$REPO/pyproject.toml")"
if [[ ! -f $wstamp || $(cat "$wstamp") != "$want_wstamp" ]]; then
    log "pip download the locked packages into $WHEELHOUSE"
    mkdir -p "$WHEELHOUSE"
    "$VENV/bin/python" -m pip download -q -d "$WHEELHOUSE" -r "$LOCK" \
        "$(sed -n 's/^requires = \["\(setuptools[^"]*\)".*/\1/p' "$REPO/pyproject.toml")" wheel
    echo "$want_wstamp" >"$wstamp"
fi

# The test kit (testkit/README.md): the services harness and synthetic data generators that
# tests/ and bench/ import. Its own distribution, not in the ncclwatch wheel or image;
# editable, built offline from the wheelhouse above (setuptools, wheel; no dependencies).
tstamp="$VENV/.ncclwatch-testkit-setup"
want_tstamp="$(sha "$REPO/testkit/pyproject.toml")"
if [[ ! -f $tstamp || $(cat "$tstamp") != "$want_tstamp" ]] \
    || ! (cd /tmp && "$VENV/bin/python" -c 'import ncclwatch_testkit' 2>/dev/null); then
    log "pip install -e testkit --no-deps (offline, from $WHEELHOUSE)"
    "$VENV/bin/python" -m pip install -q --no-deps --no-index --find-links "$WHEELHOUSE" -e "$REPO/testkit"
    echo "$want_tstamp" >"$tstamp"
fi

# ---------------------------------------------------------------- helm (Go module proxy)
# (`go install` does not stamp helm's own version string, so a stamp file records it.)
HELM_VERSION=v3.19.0
HELM="$CACHE_DIR/bin/helm"
if [[ ! -x $HELM || $(cat "$HELM.version" 2>/dev/null) != "$HELM_VERSION" ]]; then
    if command -v go >/dev/null; then
        log "go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION (a few minutes, once)"
        GOBIN="$CACHE_DIR/bin" GOFLAGS=-trimpath go install -ldflags='-s -w' \
            "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
        echo "$HELM_VERSION" >"$HELM.version"
    else
        log "go not found: helm not built; the Helm chart test fails under CI"
    fi
fi

# crdcheck: decodes rendered ServiceMonitors/PrometheusRules strictly into the Prometheus
# Operator's Go types (tests/k8s/crdcheck; its modules come from the Go module proxy).
CRDCHECK="$CACHE_DIR/bin/ncclwatch-crdcheck"
cstamp="$CRDCHECK.stamp"
want_cstamp="$(sha "$REPO"/tests/k8s/crdcheck/{go.mod,go.sum,main.go})"
if [[ ! -x $CRDCHECK || $(cat "$cstamp" 2>/dev/null) != "$want_cstamp" ]] && command -v go >/dev/null; then
    log "go build tests/k8s/crdcheck"
    (cd "$REPO/tests/k8s/crdcheck" && go build -o "$CRDCHECK" .)
    echo "$want_cstamp" >"$cstamp"
fi

# ---------------------------------------------------------------- training frameworks
FW_VENV="$CACHE_DIR/frameworks-venv"
FW_REQ="$REPO/requirements/frameworks.txt"
fstamp="$FW_VENV/.ncclwatch-setup"
want_fstamp="$(sha "$FW_REQ")"
if [[ ${NCCLWATCH_SKIP_FRAMEWORKS:-0} == 1 ]]; then
    log "NCCLWATCH_SKIP_FRAMEWORKS=1: no frameworks venv (the callback tests skip)"
elif [[ ! -f $fstamp || $(cat "$fstamp") != "$want_fstamp" ]]; then
    log "creating $FW_VENV: torch, lightning, transformers (~5.6 GB, a few minutes)"
    rm -rf "$FW_VENV"
    "$PY" -m venv "$FW_VENV"
    "$FW_VENV/bin/python" -m pip install -q --upgrade pip
    "$FW_VENV/bin/python" -m pip install -q -r "$FW_REQ"
    echo "$want_fstamp" >"$fstamp"
fi

# ---------------------------------------------------------------- C plugin
if [[ -f $REPO/plugin/Makefile ]]; then
    log "make -C plugin"
    make -s -C "$REPO/plugin"
fi

# ---------------------------------------------------------------- Kafka from Maven Central
POM="$REPO/scripts/kafka/pom.xml"
kstamp="$KAFKA_DIR/libs/.ncclwatch-setup"
want_kstamp="$(sha "$POM")"
if [[ ! -f $kstamp || $(cat "$kstamp") != "$want_kstamp" ]]; then
    log "assembling Kafka jars into $KAFKA_DIR/libs (mvn dependency:copy-dependencies)"
    mkdir -p "$KAFKA_DIR"
    tmp="$KAFKA_DIR/libs.tmp.$$"
    rm -rf "$tmp"
    mvn -q -B -f "$POM" dependency:copy-dependencies -DoutputDirectory="$tmp" >&2
    ls "$tmp"/kafka_2.13-*.jar >/dev/null
    basename "$(ls "$tmp"/kafka_2.13-*.jar)" .jar | sed 's/^kafka_2.13-//' >"$tmp/VERSION"
    echo "$want_kstamp" >"$tmp/.ncclwatch-setup"
    rm -rf "$KAFKA_DIR/libs"
    mv "$tmp" "$KAFKA_DIR/libs"
fi

log "ok: venv=$VENV kafka=$(cat "$KAFKA_DIR/libs/VERSION") ($KAFKA_DIR/libs)"
