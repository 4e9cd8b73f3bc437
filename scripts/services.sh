#!/usr/bin/env bash
# Local, real test services bound to 127.0.0.1 on free ports.
#
#   scripts/services.sh start|stop|restart|status|env|logs [kafka|prometheus|alertmanager|node-exporter|all]
#
# State lives in ${NCCLWATCH_STATE_DIR:-<repo>/var/services}: per service a directory with its
# pid file, log, data dir, config and recorded port(s); endpoints.env (KEY=VALUE lines) lists the
# endpoints.  Ports are recorded on first start and reused later (a stopped Kafka comes back on
# the same port with the same data dir).  `start` is idempotent and waits until every service is
# really ready; `stop` sends SIGTERM, waits, then SIGKILL.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${NCCLWATCH_STATE_DIR:-$REPO/var/services}"
CACHE_DIR="${NCCLWATCH_CACHE_DIR:-$REPO/.cache}"
KAFKA_LIBS="$CACHE_DIR/kafka/libs"
ENDPOINTS="$STATE/endpoints.env"
HOST=127.0.0.1
ALL=(node-exporter alertmanager prometheus kafka)

PROMETHEUS_BIN="${NCCLWATCH_PROMETHEUS_BIN:-/usr/bin/prometheus}"
ALERTMANAGER_BIN="${NCCLWATCH_ALERTMANAGER_BIN:-/usr/bin/prometheus-alertmanager}"
NODE_EXPORTER_BIN="${NCCLWATCH_NODE_EXPORTER_BIN:-/usr/bin/prometheus-node-exporter}"
KAFKA_HEAP="${NCCLWATCH_KAFKA_HEAP:--Xmx512m -Xms128m}"
READY_TIMEOUT="${NCCLWATCH_READY_TIMEOUT:-120}"

log() { printf '[services] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# A python for helpers: the project's venv when present (has kafka-python), else the system one.
if [[ -x $REPO/.venv/bin/python ]]; then
    PY="$REPO/.venv/bin/python"
else
    PY="$(command -v python3)"
fi

sdir() { echo "$STATE/$1"; }
pidfile() { echo "$STATE/$1/pid"; }
logfile() { echo "$STATE/$1/$1.log"; }

# ---------------------------------------------------------------- ports
port_free() {
    "$PY" - "$1" <<'EOF'
import socket, sys
s = socket.socket()
# like the servers do: a port whose old connections linger in TIME_WAIT is still usable
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
finally:
    s.close()
EOF
}

# port_open PORT: something accepts connections there (never binds: no race with a starting server)
port_open() {
    "$PY" - "$1" <<'EOF'
import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1).close()
except OSError:
    sys.exit(1)
EOF
}

free_port() {
    "$PY" - <<'EOF'
import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
s.close()
EOF
}

# port_for SERVICE [KEY]: the recorded port, allocated (and recorded) on first use.
port_for() {
    local svc="$1" key="${2:-port}" f p
    f="$(sdir "$svc")/$key"
    if [[ -s $f ]]; then
        cat "$f"
        return
    fi
    mkdir -p "$(sdir "$svc")"
    while :; do
        p="$(free_port)"
        # never hand out a port already recorded for another service
        if ! grep -qsx "$p" "$STATE"/*/port "$STATE"/*/controller_port; then
            break
        fi
    done
    echo "$p" >"$f"
    echo "$p"
}

# Before (re)starting: if the recorded port was taken by someone else meanwhile, pick a new one.
claim_port() {
    local svc="$1" key="${2:-port}" p
    p="$(port_for "$svc" "$key")"
    if ! port_free "$p"; then
        log "WARNING: recorded $svc $key $p is in use by another process; picking a new port"
        rm -f "$(sdir "$svc")/$key"
        p="$(port_for "$svc" "$key")"
    fi
    echo "$p"
}

# ---------------------------------------------------------------- processes
binary_of() {
    case "$1" in
        kafka) echo java ;;
        prometheus) basename "$PROMETHEUS_BIN" ;;
        alertmanager) basename "$ALERTMANAGER_BIN" ;;
        node-exporter) basename "$NODE_EXPORTER_BIN" ;;
    esac
}

# Running = pid file names a live process whose command line is ours and mentions our state dir.
is_running() {
    local svc="$1" pf pid cmd
    pf="$(pidfile "$svc")"
    [[ -s $pf ]] || return 1
    pid="$(cat "$pf")"
    [[ -r /proc/$pid/cmdline ]] || return 1
    cmd="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" || return 1
    [[ $cmd == *"$(binary_of "$svc")"* && $cmd == *"$STATE/$svc"* ]]
}

# alive PID: the process exists and is not a zombie (our own exited children stay zombies).
alive() {
    local st
    st="$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)" || return 1
    [[ -n $st && $st != Z && $st != X ]]
}

log_tail() {
    local f
    f="$(logfile "$1")"
    if [[ -f $f ]]; then
        log "---- last lines of $f ----"
        tail -n "${2:-40}" "$f" >&2
        log "----"
    fi
}

# launch SERVICE CMD...: detached (own session), output to the service log, pid recorded.
launch() {
    local svc="$1"
    shift
    local lf
    lf="$(logfile "$svc")"
    printf '\n==== %s starting: %s\n' "$(date -Is)" "$*" >>"$lf"
    setsid "$@" >>"$lf" 2>&1 </dev/null 9>&- &
    echo $! >"$(pidfile "$svc")"
}

http_ready() {
    "$PY" - "$1" <<'EOF'
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=2) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
EOF
}

kafka_ready() {
    local port="$1"
    # cheap first: until the listener accepts connections there is nothing to ask
    port_open "$port" || return 1
    if "$PY" -c 'import kafka' 2>/dev/null; then
        "$PY" - "$HOST:$port" <<'EOF'
import logging, sys
logging.disable(logging.CRITICAL)
from kafka import KafkaAdminClient
try:
    a = KafkaAdminClient(bootstrap_servers=sys.argv[1], request_timeout_ms=5000,
                         client_id="ncclwatch-services")
    try:
        cluster = a.describe_cluster()
        a.list_topics()
        # A fresh broker creates __consumer_offsets on the first FindCoordinator and
        # answers CoordinatorNotAvailable until it has: ready means groups work too.
        a.list_group_offsets("ncclwatch-services-ready")
    finally:
        a.close()
except Exception:
    sys.exit(1)
sys.exit(0 if cluster.get("brokers") else 1)
EOF
    else
        # no kafka-python yet (setup not run): broker start line plus an open port
        grep -q 'Kafka Server started' "$(logfile kafka)" 2>/dev/null
    fi
}

# wait_ready SERVICE CHECK...: poll CHECK until success; fail with the log tail.
wait_ready() {
    local svc="$1"
    shift
    local deadline=$((SECONDS + READY_TIMEOUT)) pid
    pid="$(cat "$(pidfile "$svc")")"
    while ((SECONDS < deadline)); do
        if ! alive "$pid"; then
            log_tail "$svc" 60
            die "$svc exited during startup (log: $(logfile "$svc"))"
        fi
        if "$@"; then
            return 0
        fi
        sleep 0.2
    done
    log_tail "$svc" 60
    die "$svc not ready after ${READY_TIMEOUT}s (log: $(logfile "$svc"))"
}

# ---------------------------------------------------------------- per-service start
start_node_exporter() {
    local d port
    d="$(sdir node-exporter)"
    mkdir -p "$d/textfile"
    port="$(claim_port node-exporter)"
    [[ -x $NODE_EXPORTER_BIN ]] || die "$NODE_EXPORTER_BIN missing: run scripts/setup.sh"
    launch node-exporter "$NODE_EXPORTER_BIN" \
        --web.listen-address="$HOST:$port" \
        --collector.textfile.directory="$d/textfile"
    wait_ready node-exporter http_ready "http://$HOST:$port/metrics"
}

write_alertmanager_config() {
    local d="$1" hook="${NCCLWATCH_TEST_WEBHOOK_PORT:-9}"
    cat >"$d/alertmanager.yml" <<EOF
# Generated by scripts/services.sh. Tests may replace this file and POST /-/reload.
global:
  resolve_timeout: 1m
route:
  receiver: webhook
  group_by: ['alertname']
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: webhook
    webhook_configs:
      - url: 'http://127.0.0.1:${hook}/'
        send_resolved: true
EOF
}

start_alertmanager() {
    local d port
    d="$(sdir alertmanager)"
    mkdir -p "$d/data"
    port="$(claim_port alertmanager)"
    [[ -x $ALERTMANAGER_BIN ]] || die "$ALERTMANAGER_BIN missing: run scripts/setup.sh"
    write_alertmanager_config "$d"
    # --web.external-url keeps the API at the root; reload is always on (POST /-/reload).
    launch alertmanager "$ALERTMANAGER_BIN" \
        --config.file="$d/alertmanager.yml" \
        --storage.path="$d/data" \
        --web.listen-address="$HOST:$port" \
        --web.external-url="http://$HOST:$port/" \
        --cluster.listen-address=
    wait_ready alertmanager http_ready "http://$HOST:$port/-/ready"
}

write_prometheus_config() {
    local d="$1" ne_port="$2" am_port="$3"
    mkdir -p "$d/rules"
    [[ -f $d/targets.json ]] || echo '[]' >"$d/targets.json"
    cat >"$d/prometheus.yml.new" <<EOF
# Generated by scripts/services.sh (rewritten on every start). Tests add scrape targets by
# rewriting $d/targets.json (file_sd, picked up within ~1 s) and rules in $d/rules/*.yml
# (then POST /-/reload).
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - '$d/rules/*.yml'
alerting:
  alertmanagers:
    - static_configs:
        - targets: ['127.0.0.1:${am_port}']
scrape_configs:
  - job_name: node
    static_configs:
      - targets: ['127.0.0.1:${ne_port}']
  - job_name: ncclwatch
    file_sd_configs:
      - files: ['$d/targets.json']
        refresh_interval: 1s
EOF
    if [[ -f $d/prometheus.yml ]] && cmp -s "$d/prometheus.yml.new" "$d/prometheus.yml"; then
        rm -f "$d/prometheus.yml.new"
        return 1 # unchanged
    fi
    mv "$d/prometheus.yml.new" "$d/prometheus.yml"
    return 0
}

start_prometheus() {
    local d port
    d="$(sdir prometheus)"
    mkdir -p "$d/data"
    port="$(claim_port prometheus)"
    [[ -x $PROMETHEUS_BIN ]] || die "$PROMETHEUS_BIN missing: run scripts/setup.sh"
    write_prometheus_config "$d" "$(port_for node-exporter)" "$(port_for alertmanager)" || true
    launch prometheus "$PROMETHEUS_BIN" \
        --config.file="$d/prometheus.yml" \
        --storage.tsdb.path="$d/data" \
        --storage.tsdb.retention.time=2d \
        --web.listen-address="$HOST:$port" \
        --web.external-url="http://$HOST:$port/" \
        --web.enable-lifecycle \
        --web.enable-admin-api \
        --rules.alert.resend-delay=2s
    wait_ready prometheus http_ready "http://$HOST:$port/-/ready"
}

# (--rules.alert.resend-delay=2s: after a reload Prometheus forgets its Alertmanagers for up to
# ~5 s; firing alerts dropped then would otherwise only be resent a minute later.)

# Prometheus already running: keep its config in line with the other services' ports.
refresh_prometheus_config() {
    local d port
    d="$(sdir prometheus)"
    port="$(port_for prometheus)"
    if write_prometheus_config "$d" "$(port_for node-exporter)" "$(port_for alertmanager)"; then
        log "prometheus config changed; reloading"
        "$PY" -c "import urllib.request as u; u.urlopen(u.Request('http://$HOST:$port/-/reload', method='POST'), timeout=10)"
    fi
}

write_kafka_config() {
    local d="$1" port="$2" cport="$3"
    cat >"$d/server.properties" <<EOF
# Generated by scripts/services.sh: single-node KRaft (combined broker + controller).
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:${cport}
listeners=PLAINTEXT://127.0.0.1:${port},CONTROLLER://127.0.0.1:${cport}
advertised.listeners=PLAINTEXT://127.0.0.1:${port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$d/data
num.partitions=1
default.replication.factor=1
min.insync.replicas=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=10
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=true
delete.topic.enable=true
EOF
    cat >"$d/log4j.properties" <<EOF
log4j.rootLogger=INFO, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka=INFO
log4j.logger.org.apache.kafka=INFO
log4j.logger.kafka.request.logger=WARN
log4j.logger.state.change.logger=WARN
log4j.logger.kafka.log.LogCleaner=WARN
EOF
}

start_kafka() {
    local d port cport
    d="$(sdir kafka)"
    mkdir -p "$d/data" "$d/logs"
    compgen -G "$KAFKA_LIBS/kafka_2.13-*.jar" >/dev/null \
        || die "Kafka jars missing in $KAFKA_LIBS: run scripts/setup.sh"
    command -v java >/dev/null || die "java missing: run scripts/setup.sh"
    port="$(claim_port kafka)"
    cport="$(claim_port kafka controller_port)"
    write_kafka_config "$d" "$port" "$cport"
    local heap jcmd
    read -ra heap <<<"$KAFKA_HEAP"
    jcmd=(java "${heap[@]}" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true
        -Dlog4j.configuration="file:$d/log4j.properties" -Dkafka.logs.dir="$d/logs"
        -cp "$KAFKA_LIBS/*")
    if [[ ! -f $d/data/meta.properties ]]; then
        local cid
        # Not starting with "-" (StorageTool would read it as an option), as Kafka's own ids.
        cid="$("$PY" -c 'import base64, uuid
c = "-"
while c.startswith("-"):
    c = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
print(c)')"
        log "formatting Kafka storage (cluster id $cid)"
        "${jcmd[@]}" kafka.tools.StorageTool format -t "$cid" -c "$d/server.properties" \
            --ignore-formatted >>"$(logfile kafka)" 2>&1 \
            || { log_tail kafka; die "kafka storage format failed"; }
    fi
    launch kafka "${jcmd[@]}" kafka.Kafka "$d/server.properties"
    wait_ready kafka kafka_ready "$port"
}

# ---------------------------------------------------------------- endpoints
write_endpoints() {
    local tmp="$ENDPOINTS.tmp.$$"
    {
        echo "# Generated by scripts/services.sh; KEY=VALUE, no quoting needed."
        echo "NCCLWATCH_STATE_DIR=$STATE"
        [[ -s $STATE/kafka/port ]] && echo "NCCLWATCH_KAFKA_BOOTSTRAP=$HOST:$(cat "$STATE/kafka/port")"
        [[ -s $STATE/prometheus/port ]] && echo "NCCLWATCH_PROMETHEUS_URL=http://$HOST:$(cat "$STATE/prometheus/port")"
        [[ -s $STATE/alertmanager/port ]] && echo "NCCLWATCH_ALERTMANAGER_URL=http://$HOST:$(cat "$STATE/alertmanager/port")"
        [[ -s $STATE/node-exporter/port ]] && echo "NCCLWATCH_NODE_EXPORTER_URL=http://$HOST:$(cat "$STATE/node-exporter/port")"
        echo "NCCLWATCH_TEXTFILE_DIR=$STATE/node-exporter/textfile"
        echo "NCCLWATCH_PROMETHEUS_TARGETS_FILE=$STATE/prometheus/targets.json"
        echo "NCCLWATCH_PROMETHEUS_RULES_DIR=$STATE/prometheus/rules"
        echo "NCCLWATCH_ALERTMANAGER_CONFIG=$STATE/alertmanager/alertmanager.yml"
    } >"$tmp"
    mv "$tmp" "$ENDPOINTS"
}

endpoint_of() {
    case "$1" in
        kafka) echo "kafka=$HOST:$(cat "$STATE/kafka/port")" ;;
        *) echo "$1=http://$HOST:$(cat "$STATE/$1/port")" ;;
    esac
}

# ---------------------------------------------------------------- commands
start_one() {
    local svc="$1"
    if is_running "$svc"; then
        log "$svc already running (pid $(cat "$(pidfile "$svc")")): $(endpoint_of "$svc")"
        [[ $svc == prometheus ]] && refresh_prometheus_config
        return 0
    fi
    rm -f "$(pidfile "$svc")"
    local t0=$SECONDS
    case "$svc" in
        kafka) start_kafka ;;
        prometheus) start_prometheus ;;
        alertmanager) start_alertmanager ;;
        node-exporter) start_node_exporter ;;
    esac
    log "$svc started (pid $(cat "$(pidfile "$svc")"), $((SECONDS - t0))s): $(endpoint_of "$svc")"
    if [[ $svc == node-exporter || $svc == alertmanager ]] && is_running prometheus; then
        refresh_prometheus_config
    fi
}

stop_one() {
    local svc="$1" pid i
    if ! is_running "$svc"; then
        rm -f "$(pidfile "$svc")"
        log "$svc not running"
        return 0
    fi
    pid="$(cat "$(pidfile "$svc")")"
    kill -TERM "$pid" 2>/dev/null || true
    # Kafka's controlled shutdown takes a few seconds; the Go daemons stop at once.
    for ((i = 0; i < 300; i++)); do
        alive "$pid" || break
        sleep 0.1
    done
    if alive "$pid"; then
        log "$svc (pid $pid) ignored SIGTERM for 30s; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        for ((i = 0; i < 50; i++)); do
            alive "$pid" || break
            sleep 0.1
        done
    fi
    rm -f "$(pidfile "$svc")"
    log "$svc stopped"
}

status_one() {
    local svc="$1"
    if is_running "$svc"; then
        echo "$svc: running (pid $(cat "$(pidfile "$svc")")) $(endpoint_of "$svc")"
        return 0
    fi
    echo "$svc: stopped"
    return 1
}

usage() {
    cat >&2 <<EOF
usage: $0 start|stop|restart|status|env|logs [kafka|prometheus|alertmanager|node-exporter|all]
  start    start (idempotent) and wait until ready; prints endpoints.env
  stop     SIGTERM, wait, SIGKILL; state (data, ports) is kept
  status   exit 0 iff all named services are running
  env      print endpoints as 'export KEY=VALUE' lines (eval "\$($0 env)"), plus
           NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS / NCCLWATCH_ALERTING_ALERTMANAGER_URL for the CLI
  logs     tail the services' logs
state: $STATE   endpoints: $ENDPOINTS
EOF
    exit 2
}

cmd="${1:-}"
shift || true
targets=("$@")
((${#targets[@]})) || targets=(all)
svcs=()
for t in "${targets[@]}"; do
    case "$t" in
        all) svcs+=("${ALL[@]}") ;;
        kafka | prometheus | alertmanager | node-exporter) svcs+=("$t") ;;
        node_exporter) svcs+=(node-exporter) ;;
        *) usage ;;
    esac
done

mkdir -p "$STATE"
# Serialize start/stop between concurrent callers (parallel test sessions, engineers).
lock() {
    exec 9>"$STATE/.lock"
    flock -w 300 9 || die "could not lock $STATE/.lock"
}

case "$cmd" in
    start)
        lock
        for s in "${svcs[@]}"; do
            start_one "$s"
        done
        write_endpoints
        cat "$ENDPOINTS"
        ;;
    stop)
        lock
        # reverse order: kafka and prometheus first, node-exporter last
        for ((i = ${#svcs[@]} - 1; i >= 0; i--)); do
            stop_one "${svcs[$i]}"
        done
        ;;
    restart)
        "$0" stop "${targets[@]}"
        "$0" start "${targets[@]}"
        ;;
    status)
        rc=0
        for s in "${svcs[@]}"; do
            status_one "$s" || rc=3
        done
        exit $rc
        ;;
    env)
        [[ -f $ENDPOINTS ]] || die "no $ENDPOINTS yet: run $0 start"
        sed -n 's/^\(NCCLWATCH_[A-Z_]*=.*\)$/export \1/p' "$ENDPOINTS"
        # the same endpoints under ncclwatch's own config names (ncclwatch/config.py)
        sed -n -e 's/^NCCLWATCH_KAFKA_BOOTSTRAP=\(.*\)$/export NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS=\1/p' \
            -e 's/^NCCLWATCH_ALERTMANAGER_URL=\(.*\)$/export NCCLWATCH_ALERTING_ALERTMANAGER_URL=\1/p' "$ENDPOINTS"
        ;;
    logs)
        for s in "${svcs[@]}"; do
            log_tail "$s" "${NCCLWATCH_LOG_LINES:-40}"
        done
        ;;
    *) usage ;;
esac
