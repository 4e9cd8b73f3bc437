#!/bin/bash
# Slurm Epilog for ncclwatch (only needed when the forwarder runs with --no-delete-acked).
#
#   slurm.conf:  Epilog=/etc/slurm/ncclwatch-epilog.sh
#
# Runs as root on each node when a job ends. The forwarder reads a job's spool within a
# second or so of it being written; give it a grace period, then remove the job's
# directory. The forwarder's checkpoint forgets files that are gone.

NCCLWATCH_SPOOL="${NCCLWATCH_SPOOL:-/var/spool/ncclwatch}"
NCCLWATCH_EPILOG_GRACE_S="${NCCLWATCH_EPILOG_GRACE_S:-30}"

job="${SLURM_JOB_ID:-}"
# The plugin names the directory after the job id; refuse anything that is not one.
if [[ ! $job =~ ^[0-9]+(_[0-9]+)?$ ]]; then
    exit 0
fi
dir="$NCCLWATCH_SPOOL/$job"
if [[ -d $dir && ! -L $dir ]]; then
    sleep "$NCCLWATCH_EPILOG_GRACE_S"
    rm -rf --one-file-system -- "$dir"
fi
exit 0
