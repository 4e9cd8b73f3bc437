#!/usr/bin/env bash
# What one device call runs (from the repository root, $OUT set by the device tool):
# environment facts, the plugin build, then `record.py suite` with the arguments given
# here appended. Everything useful lands under $OUT (at most 8 files come back):
#   suite.log, suite.json, and one <run>.tar.gz per run.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/scenario-out}
mkdir -p "$OUT"
LOG="$OUT/suite.log"
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m
  nproc; grep -m1 "model name" /proc/cpuinfo
  ip -br addr 2>/dev/null || cat /proc/net/dev
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
} >"$LOG" 2>&1
if [ -f plugin/Makefile ]; then
  make -C plugin >>"$LOG" 2>&1 || echo "plugin build FAILED" >>"$LOG"
fi
ls -la plugin/build/*.so >>"$LOG" 2>&1
WATCH_PATH=""
if ls .gpu/scenarios/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/scenario-site .gpu/scenarios/whl/*.whl >>"$LOG" 2>&1 && WATCH_PATH=/tmp/scenario-site
fi
# The device tool carries at most 64 MiB (tree + carry): .gpu may hold the Inspector sources
# and the tc binary with its libraries as .gpu/inspector.tar.xz and .gpu/scenarios/tc.tar.xz,
# unpacked here (with Python's tarfile: no xz binary needed) where the folders are not there.
for pair in ".gpu/inspector.tar.xz:.gpu" ".gpu/scenarios/tc.tar.xz:.gpu/scenarios"; do
  ARCHIVE=${pair%%:*}; DEST=${pair#*:}
  if [ -f "$ARCHIVE" ] && [ ! -e "${ARCHIVE%.tar.xz}" ]; then
    python3 -c 'import sys, tarfile; t = tarfile.open(sys.argv[1])
t.extractall(sys.argv[2], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))' \
      "$ARCHIVE" "$DEST" >>"$LOG" 2>&1 || echo "unpacking $ARCHIVE FAILED" >>"$LOG"
  fi
done
INSPECTOR=""
if [ -f .gpu/inspector/Makefile ]; then
  # NCCL Inspector from NVIDIA's nccl source (plugins/profiler/inspector), built here.
  CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  if make -C .gpu/inspector -j8 CUDA_HOME="$CUDA_HOME" >>"$LOG" 2>&1; then
    INSPECTOR=$PWD/.gpu/inspector/libnccl-profiler-inspector.so
    export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  else
    echo "inspector build FAILED" >>"$LOG"
  fi
fi
TC=""
if [ -x .gpu/scenarios/tc/tc ]; then
  TC="env LD_LIBRARY_PATH=$PWD/.gpu/scenarios/tc $PWD/.gpu/scenarios/tc/tc"
  $TC qdisc show >>"$LOG" 2>&1
fi
PYTHONUNBUFFERED=1 python3 bench/scenarios/record.py suite --out /tmp/scenario-runs --tar "$OUT" \
  --tc "$TC" --allow-tc --watch-pythonpath "$WATCH_PATH" --inspector-plugin "$INSPECTOR" "$@" \
  2>&1 | tee -a "$LOG"
cp /tmp/scenario-runs/suite.json "$OUT/" 2>/dev/null
ls -la "$OUT" >>"$LOG"
