#!/bin/bash
# Slurm Prolog for ncclwatch on nodes shared by several users (docs/deploy.md, "Shared
# nodes: whose records a job directory holds").
#
#   slurm.conf:  Prolog=/etc/slurm/ncclwatch-prolog.sh
#   spool:       root-owned and not world-writable (deploy/systemd/ncclwatch-tmpfiles.conf,
#                the "shared nodes" line), so that only this script creates job directories
#
# Runs as root on each node before a job starts: creates <spool>/<job id> owned by the
# job's user, mode 0755. A directory of that name left by anyone else is removed first:
# with the forwarder's spool_trust = "owner", the owner of a job's directory is who may
# write that job's records.

NCCLWATCH_SPOOL="${NCCLWATCH_SPOOL:-/var/spool/ncclwatch}"

job="${SLURM_JOB_ID:-}"
uid="${SLURM_JOB_UID:-}"
gid="${SLURM_JOB_GID:-$uid}"
# The plugin names the directory after the job id; refuse anything that is not one.
if [[ ! $job =~ ^[0-9]+(_[0-9]+)?$ || ! $uid =~ ^[0-9]+$ || ! $gid =~ ^[0-9]+$ ]]; then
    exit 0
fi
[[ -d $NCCLWATCH_SPOOL ]] || exit 0
dir="$NCCLWATCH_SPOOL/$job"
if [[ -e $dir || -L $dir ]]; then
    if [[ -d $dir && ! -L $dir && $(stat -c %u "$dir") == "$uid" ]] \
        && (( ($(stat -c '%#a' "$dir") & 8#002) == 0 )); then
        exit 0  # already the job's (a requeued job, or a second prolog run)
    fi
    rm -rf --one-file-system -- "$dir"
fi
install -d -m 0755 -o "$uid" -g "$gid" -- "$dir"
exit 0
