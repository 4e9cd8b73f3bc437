#!/usr/bin/env bash
# GPU validation of the ncclwatch plugin on one host with 2 GPUs. Run from the repo root:
#
#   bench/plugin/run_gpu.sh WORK_DIR OUT_DIR STAGE...
#
# Stages (in the order given):
#   build     make -C plugin; the do-nothing plugins; nvcc bench/plugin/nccl_bench.cu
#   accuracy  nccl_bench accuracy + graph with ncclwatch (NCCL called from C, system libnccl)
#   capture   torchrun capture.py with ncclwatch (PyTorch's NCCL), incl. a CUDA-graph loop
#   fixture   a short torchrun recorded as tests/fixtures/plugin_spool (job fixture-2xh200)
#   stress    nccl_bench stress with sampled GPU timing (1 group in 32): >= 10^6 ops of mixed
#             kinds and sizes, Send/Recv rings inside groups, a CUDA graph; no hang, exact counts
#   overhead  nccl_bench overhead: rounds REP_FIRST..REPS of {no plugin, do-nothing plugin
#             Coll|P2p, do-nothing plugin Coll|P2p|KernelCh, ncclwatch full timing, ncclwatch
#             sampled 1 in 32 and 1 in 128, NCCL Inspector (if built)} in random order, each
#             process pinned to CORES, sizes BENCH_SIZES (CONFIGS: a subset)
#
# Raw data stays in WORK_DIR; OUT_DIR gets a few summary files (Markdown reports, machine
# info, one tarball of raw results). NCCL_NVLS_ENABLE=0 throughout.
set -euo pipefail
WORK=${1:?work dir}
OUT=${2:?out dir}
shift 2
export NCCL_NVLS_ENABLE=0
PY=${PY:-python3}
B=$WORK/bin
PLUGIN=$PWD/plugin/build/libncclwatch-profiler.so
REPS=${REPS:-8}
CORES=${CORES:-2-9}
mkdir -p "$WORK" "$OUT" "$B"

log() { echo "[$(date +%T)] $*" | tee -a "$OUT/run.log"; }

stage_build() {
  make -C plugin >/dev/null
  gcc -std=c11 -O2 -fPIC -shared -DNOOP_MASK=0x46 -o "$B/libnoop-kch.so" bench/plugin/noop_plugin.c
  gcc -std=c11 -O2 -fPIC -shared -DNOOP_MASK=0x06 -o "$B/libnoop-coll.so" bench/plugin/noop_plugin.c
  nvcc -O2 -arch=sm_90 -o "$B/nccl_bench" bench/plugin/nccl_bench.cu -lnccl
  # NCCL Inspector from NVIDIA's nccl source (plugins/profiler/inspector), when provided.
  if [ -f .gpu/inspector/Makefile ]; then
    make -C .gpu/inspector -j8 CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" >"$WORK/inspector-build.log" 2>&1 \
      && cp .gpu/inspector/libnccl-profiler-inspector.so "$B/" || log "inspector build FAILED: $(tail -3 "$WORK/inspector-build.log")"
    cat .gpu/inspector/SOURCE >> "$OUT/machine.txt" 2>/dev/null || true
  fi
  {
    echo "date: $(date -u +%FT%TZ)"
    echo "host: $(hostname)  nproc: $(nproc)  cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    nvidia-smi topo -m | head -4
    $PY -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'
    echo "system libnccl: $(ls -l /usr/lib/x86_64-linux-gnu/libnccl.so* 2>/dev/null | awk '{print $NF}' | tr '\n' ' ')"
    nvcc --version | tail -2
  } > "$OUT/machine.txt" 2>&1
}

stage_accuracy() {
  local sp=$WORK/spool-accuracy gsp=$WORK/spool-graph
  rm -rf "$sp" "$gsp"
  NCCL_PROFILER_PLUGIN=$PLUGIN NCCLWATCH_SPOOL_DIR=$sp NCCLWATCH_JOB_ID=nccl-bench-accuracy \
    NCCLWATCH_DEBUG=1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV NCCL_DEBUG_FILE="$WORK/nccl-accuracy.%p.log" \
    "$B/nccl_bench" accuracy > "$WORK/accuracy.csv" 2> "$WORK/accuracy.err"
  NCCL_PROFILER_PLUGIN=$PLUGIN NCCLWATCH_SPOOL_DIR=$gsp NCCLWATCH_JOB_ID=nccl-bench-graph \
    NCCLWATCH_DEBUG=1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT NCCL_DEBUG_FILE="$WORK/nccl-graph.%p.log" \
    "$B/nccl_bench" graph > "$WORK/graph.csv" 2> "$WORK/graph.err" || echo "graph run failed: $(tail -3 "$WORK/graph.err")"
  {
    echo "## nccl_bench accuracy (system libnccl, CUDA events on the NCCL stream)"
    $PY bench/plugin/analyze.py accuracy "$WORK/accuracy.csv" "$sp" --json "$WORK/accuracy.json"
    echo
    echo "## nccl_bench graph"
    $PY bench/plugin/analyze.py accuracy "$WORK/graph.csv" "$gsp" --json "$WORK/graph.json" || true
  } > "$OUT/accuracy.md" 2>&1
  plugin_log accuracy graph
}

# What NCCL and the plugin logged (load line, host-timed ops, stale events), per stage.
plugin_log() {
  for s in "$@"; do
    echo "== $s"
    cat "$WORK"/nccl-"$s".*.log 2>/dev/null | grep -E "PROFILER|ncclwatch|NCCL version" | grep -v "host-timed" | sort | uniq -c | head -20
    echo "host-timed ops logged: $(cat "$WORK"/nccl-"$s".*.log 2>/dev/null | grep -c host-timed)"
    cat "$WORK"/nccl-"$s".*.log 2>/dev/null | grep host-timed | sed 's/^.*ncclwatch: //' | sort | uniq -c | sort -rn | head -8
  done >> "$OUT/plugin-log.txt"
}

stage_capture() {
  local sp=$WORK/spool-capture
  rm -rf "$sp" "$WORK/capture"
  NCCL_PROFILER_PLUGIN=$PLUGIN NCCLWATCH_SPOOL_DIR=$sp NCCLWATCH_JOB_ID=torch-capture \
    NCCLWATCH_DEBUG=1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT NCCL_DEBUG_FILE="$WORK/nccl-capture.%p.log" \
    $PY -m torch.distributed.run --standalone --nproc_per_node=2 bench/plugin/capture.py \
    --out "$WORK/capture" --graph > "$WORK/capture.log" 2>&1 || {
    tail -50 "$WORK/capture.log" >> "$OUT/run.log"
    return 1
  }
  $PY bench/plugin/analyze.py capture "$WORK/capture" "$sp" --json "$WORK/capture.json" > "$OUT/capture.md" 2>&1
  plugin_log capture
}

stage_fixture() {
  local sp=$WORK/spool-fixture
  rm -rf "$sp" "$WORK/fixture-calls"
  NCCL_PROFILER_PLUGIN=$PLUGIN NCCLWATCH_SPOOL_DIR=$sp NCCLWATCH_JOB_ID=fixture-2xh200 \
    $PY -m torch.distributed.run --standalone --nproc_per_node=2 bench/plugin/capture.py \
    --out "$WORK/fixture-calls" --calls 3 --warmup 1 --sizes 1024,1048576,33554432 > "$WORK/fixture.log" 2>&1
  tar -C "$sp" -czf "$OUT/fixture-spool.tar.gz" .
}

stage_stress() {
  # Sampled (1 group in 32) and, for comparison, full GPU timing: the same program.
  for sample in 32 1; do
    local sp=$WORK/spool-stress
    rm -rf "$sp"
    NCCL_PROFILER_PLUGIN=$PLUGIN NCCLWATCH_SPOOL_DIR=$sp NCCLWATCH_JOB_ID=stress NCCLWATCH_TIMING_SAMPLE=$sample \
      NCCLWATCH_RING_RECORDS=1048576 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT \
      NCCL_DEBUG_FILE="$WORK/nccl-stress-s$sample.%p.log" \
      timeout 300 "$B/nccl_bench" stress > "$WORK/stress-s$sample.csv" 2> "$WORK/stress-s$sample.err" ||
      log "stress run (1 in $sample) FAILED or hung: exit $?"
    { echo "## stress, NCCLWATCH_TIMING_SAMPLE=$sample"; echo
      $PY bench/plugin/analyze.py stress "$WORK/stress-s$sample.csv" "$sp" --json "$WORK/stress-s$sample.json"
      echo; } >> "$OUT/stress.md" 2>&1
    plugin_log "stress-s$sample"
  done
}

stage_overhead() {
  local sp=$WORK/spool-overhead idir=$WORK/inspector-overhead
  local configs=${CONFIGS:-none none2 noop_coll noop_kch ncclwatch_full ncclwatch_s32 ncclwatch_s128}
  [ -z "${CONFIGS:-}" ] && [ -f "$B/libnccl-profiler-inspector.so" ] && configs="$configs inspector"
  [ "${REP_FIRST:-1}" = 1 ] && : > "$WORK/overhead.csv"
  for rep in $(seq "${REP_FIRST:-1}" "$REPS"); do
    for cfg in $(shuf -e $configs); do
      sample=1
      case $cfg in
        none | none2) lib=none ;;
        noop_coll) lib=$B/libnoop-coll.so ;;
        noop_kch) lib=$B/libnoop-kch.so ;;
        ncclwatch_full) lib=$PLUGIN ;;
        ncclwatch_s32) lib=$PLUGIN sample=32 ;;
        ncclwatch_s128) lib=$PLUGIN sample=128 ;;
        inspector) lib=$B/libnccl-profiler-inspector.so ;;
      esac
      rm -rf "$sp" "$idir"
      # Pinned to the same cores every run: core migrations were most of the run-to-run noise.
      # Inspector as its README recommends for fine-grained output: JSON dumps every 500 µs,
      # every message size, P2P tracked.
      NCCL_PROFILER_PLUGIN=$lib NCCLWATCH_SPOOL_DIR=$sp NCCLWATCH_JOB_ID=overhead NCCLWATCH_TIMING_SAMPLE=$sample \
        NCCL_INSPECTOR_ENABLE=1 NCCL_INSPECTOR_DUMP_DIR=$idir NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS=500 \
        NCCL_INSPECTOR_DUMP_MIN_SIZE_BYTES=0 NCCL_INSPECTOR_ENABLE_P2P=1 \
        taskset -c "$CORES" "$B/nccl_bench" overhead "$cfg" "$rep" >> "$WORK/overhead.csv" 2>> "$WORK/overhead.log"
    done
    log "overhead rep $rep done"
    $PY bench/plugin/analyze.py overhead "$WORK/overhead.csv" --json "$WORK/overhead.json" > "$OUT/overhead.md" 2>&1 || true
  done
}

for s in "$@"; do
  log "stage $s"
  t0=$(date +%s)
  # A subshell outside any || list, so `set -e` stops the stage at its first failure.
  set +e
  (set -e; "stage_$s")
  rc=$?
  set -e
  [ "$rc" = 0 ] || log "stage $s FAILED (exit $rc)"
  log "stage $s took $(($(date +%s) - t0)) s"
  tar -C "$WORK" --exclude=spool-capture --exclude=spool-overhead --exclude=spool-fixture --exclude=spool-stress \
    --exclude=inspector-overhead --exclude=bin \
    -czf "$OUT/raw.tar.gz" . 2>/dev/null || true
done
