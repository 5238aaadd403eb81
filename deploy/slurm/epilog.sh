#!/bin/bash
# Slurm Epilog: stop the ckptd that prolog.sh started for this job on this node.
#
# slurmd runs this as root on every node of the job once all its steps have ended. The
# trainers are gone by then, but ckptd may still be promoting the last save (fsync,
# rename, pointer update): SIGTERM lets it finish that and exit; only after
# CKPTD_STOP_GRACE seconds does it get SIGKILL. Keep the grace below slurm.conf's
# PrologEpilogTimeout, if one is set.
#
# A failing Epilog drains the node, so this script always exits 0.

set -uo pipefail
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH

CKPTD_RUN_BASE=/run/ckptd-slurm
CKPTD_STOP_GRACE=90 # seconds
CKPTD_SLURM_ENV=${CKPTD_SLURM_ENV:-/etc/ckptd/slurm.env} # as in prolog.sh
if [[ -r $CKPTD_SLURM_ENV ]]; then
	# shellcheck source=/dev/null
	. "$CKPTD_SLURM_ENV"
fi

job=${SLURM_JOB_ID:-}
[[ -n $job ]] || exit 0
dir=$CKPTD_RUN_BASE/$job

log() { logger -t ckptd-epilog -- "job $job: $*" || true; }

# True while $1 is a live (not zombie) ckptd process of the job's user: a pid file can
# outlive its process, and the pid may have been reused since.
is_our_ckptd() {
	local fields uid
	fields=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
	fields=${fields##*) } # the fields after "(comm) ": state first
	[[ ${fields%% *} != Z ]] || return 1
	uid=$(stat -c %u "/proc/$1" 2>/dev/null) || return 1
	[[ $uid == "${SLURM_JOB_UID:-$uid}" ]] || return 1
	tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -q ckptd
}

pid=
if [[ -s $dir/ckptd.pid ]]; then
	pid=$(<"$dir/ckptd.pid")
fi
if [[ $pid =~ ^[0-9]+$ ]] && is_our_ckptd "$pid"; then
	kill -TERM "$pid" 2>/dev/null
	deadline=$((SECONDS + CKPTD_STOP_GRACE))
	while is_our_ckptd "$pid" && ((SECONDS < deadline)); do
		sleep 0.5
	done
	if is_our_ckptd "$pid"; then
		log "ckptd (pid $pid) still running ${CKPTD_STOP_GRACE}s after SIGTERM; killing it"
		kill -KILL "$pid" 2>/dev/null
	else
		log "ckptd (pid $pid) stopped"
	fi
fi
rm -rf -- "$dir"
exit 0
