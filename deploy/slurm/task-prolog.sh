#!/bin/bash
# Slurm TaskProlog for ncclwatch: load the NCCL profiler plugin into every task of every
# job, spooling to the node's forwarder (docs/deploy.md).
#
#   slurm.conf:  TaskProlog=/etc/slurm/ncclwatch-task-prolog.sh
#
# Slurm runs this as the job's user before each task and exports the variables of every
# "export NAME=value" line it prints. The plugin takes its job id from SLURM_JOB_ID.
# A job opts out with NCCLWATCH_DISABLE=1, and a job that loads a profiler plugin of its
# own (NCCL Inspector, say: NCCL loads one) keeps it; the forwarder can read Inspector's
# output instead (`ncclwatch forward --inspector-dir`).

NCCLWATCH_PLUGIN="${NCCLWATCH_PLUGIN:-/opt/ncclwatch/lib/libncclwatch-profiler.so}"
NCCLWATCH_SPOOL="${NCCLWATCH_SPOOL:-/var/spool/ncclwatch}"
NCCLWATCH_TEXTFILE="${NCCLWATCH_TEXTFILE:-/var/lib/ncclwatch-textfile}"

if [[ ${NCCLWATCH_DISABLE:-0} == 1 || -n ${NCCL_PROFILER_PLUGIN:-} ]]; then
    exit 0
fi
if [[ ! -r $NCCLWATCH_PLUGIN || ! -d $NCCLWATCH_SPOOL ]]; then
    # Not installed on this node: run the job unprofiled rather than fail it.
    exit 0
fi
echo "export NCCL_PROFILER_PLUGIN=$NCCLWATCH_PLUGIN"
echo "export NCCLWATCH_SPOOL_DIR=$NCCLWATCH_SPOOL"
if [[ -d $NCCLWATCH_TEXTFILE && -z ${NCCLWATCH_INSPECTOR_PROM_DIR:-} ]]; then
    echo "export NCCLWATCH_INSPECTOR_PROM_DIR=$NCCLWATCH_TEXTFILE"
fi
exit 0
