#!/usr/bin/env bash
# What one device call runs for real Megatron-LM runs (megatron_run.py): the plugin's
# build, tc and a Megatron-LM tree unpacked from .gpu (.gpu/scenarios/tc.tar.xz,
# .gpu/megatron.tar.xz: a release's megatron/ and pretrain_gpt.py, fetched on the
# development machine, never committed), then the plan. Results under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/megatron-out}
mkdir -p "$OUT"
LOG="$OUT/suite.log"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'; } >"$LOG" 2>&1
make -C plugin >>"$LOG" 2>&1 || echo "plugin build FAILED" >>"$LOG"
for pair in ".gpu/scenarios/tc.tar.xz:.gpu/scenarios" ".gpu/megatron.tar.xz:.gpu"; do
  ARCHIVE=${pair%%:*}; DEST=${pair#*:}
  if [ -f "$ARCHIVE" ] && [ ! -e "${ARCHIVE%.tar.xz}" ]; then
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
      "$ARCHIVE" "$DEST" >>"$LOG" 2>&1 || echo "unpacking $ARCHIVE FAILED" >>"$LOG"
  fi
done
for pair in ".gpu/inspector.tar.xz:.gpu"; do
  ARCHIVE=${pair%%:*}; DEST=${pair#*:}
  [ -f "$ARCHIVE" ] && [ ! -e "${ARCHIVE%.tar.xz}" ] && python3 -c 'import sys, tarfile
tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$ARCHIVE" "$DEST" >>"$LOG" 2>&1
done
INSPECTOR=""
if [ -f .gpu/inspector/Makefile ]; then  # NCCL Inspector from NVIDIA's nccl source, built here
  CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  make -C .gpu/inspector -j8 CUDA_HOME="$CUDA_HOME" >>"$LOG" 2>&1 \
    && INSPECTOR=$PWD/.gpu/inspector/libnccl-profiler-inspector.so || echo "inspector build FAILED" >>"$LOG"
  export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
TC="env LD_LIBRARY_PATH=$PWD/.gpu/scenarios/tc $PWD/.gpu/scenarios/tc/tc"
PYTHONUNBUFFERED=1 python3 bench/scenarios/megatron_run.py --megatron "$PWD/.gpu/megatron" \
  --out /tmp/megatron-runs --tar "$OUT" --tc "$TC" --inspector-plugin "$INSPECTOR" "$@" 2>&1 | tee -a "$LOG"
