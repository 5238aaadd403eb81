#!/bin/bash
# Slurm Prolog: start one ckptd for this job on this node, as the job's user.
#
# slurm.conf:
#   Prolog=/etc/slurm/prolog.d/ckptd-prolog.sh   (or call this from your prolog)
#   Epilog=/etc/slurm/epilog.d/ckptd-epilog.sh
#   PrologFlags=Alloc    # run on every node at allocation, before the batch script
#
# slurmd runs this as root once per node per job. It starts nothing unless the job
# names its checkpoint root(s) in its comment (the Prolog cannot see the job's own
# environment, but recent Slurm versions pass the comment as $SLURM_JOB_COMMENT):
#   sbatch --comment="ckptd_root=/ckpt/run-42" job.sbatch
# Several roots: repeat the token or separate paths with commas. Other words in the
# comment are ignored.
#
# The daemon listens on $CKPTD_RUN_BASE/$SLURM_JOB_ID/ckptd.sock (default
# /run/ckptd-slurm/<jobid>/ckptd.sock): under /run rather than /tmp because
# job_container/tmpfs gives each job a private /tmp the daemon would not share. The
# directory is mode 0700 and owned by the job's user, so only that user's ranks (and
# root) can reach the socket. Jobs export CKPTD_SOCKET to the same path (example.sbatch).
#
# A failing Prolog drains the node and requeues the job, so problems with ckptd are
# logged (logger -t ckptd-prolog) and the script still exits 0 unless
# CKPTD_PROLOG_STRICT=1; the job's ranks then fail to connect, with a clear error.
#
# Site settings can be overridden in /etc/ckptd/slurm.env (sourced if present; a
# wrapper that runs this script may name another file in $CKPTD_SLURM_ENV). It is
# sourced on each node with the job's SLURM_* variables set, so a value may depend on
# them: several Slurm nodes on one host (a test cluster) need a socket directory and a
# node name each, e.g. CKPTD_RUN_BASE=/run/ckptd-slurm/$SLURMD_NODENAME and
# CKPTD_NODE=$SLURMD_NODENAME (keep the same CKPTD_RUN_BASE for epilog.sh).

set -euo pipefail
set -f # paths from the job comment must never be glob-expanded
# Slurm runs prologs without a search path.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH

CKPTD_BIN=/usr/local/bin/ckptd
CKPTD_RUN_BASE=/run/ckptd-slurm
CKPTD_LOG_BASE=/var/log/ckptd-slurm # events, one JSON line each; rotate or prune these
CKPTD_CONFIG=/etc/ckptd/slurm.toml  # optional: lease, save_timeout, log_level
CKPTD_START_TIMEOUT=30              # seconds to wait for `ckptd health` to succeed
CKPTD_PROLOG_STRICT=0
CKPTD_NODE= # --node: this node's name in multi-node saves; empty: the hostname
CKPTD_SLURM_ENV=${CKPTD_SLURM_ENV:-/etc/ckptd/slurm.env}
if [[ -r $CKPTD_SLURM_ENV ]]; then
	# shellcheck source=/dev/null
	. "$CKPTD_SLURM_ENV"
fi

job=${SLURM_JOB_ID:?not run by slurmd}
uid=${SLURM_JOB_UID:?}
gid=${SLURM_JOB_GID:-$(id -g "$uid")}
dir=$CKPTD_RUN_BASE/$job
sock=$dir/ckptd.sock

log() { logger -t ckptd-prolog -- "job $job: $*" || true; }

# SIGKILL the ckptd that $dir/ckptd.pid names, if that pid is still a ckptd: the file
# may be left from a run whose Epilog never ran, and its pid reused since.
kill_recorded() {
	local pid
	[[ -s $dir/ckptd.pid ]] || return 0
	pid=$(<"$dir/ckptd.pid")
	[[ $pid =~ ^[0-9]+$ ]] || return 0
	if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q ckptd; then
		kill -KILL "$pid" 2>/dev/null || true
	fi
}

give_up() {
	log "$*"
	kill_recorded
	rm -rf -- "$dir"
	[[ $CKPTD_PROLOG_STRICT == 1 ]] && exit 1
	exit 0
}

# Roots named in the job comment: "ckptd_root=/a,/b ckptd_root=/c".
roots=()
read -r -a words <<<"${SLURM_JOB_COMMENT:-}"
for word in "${words[@]}"; do
	if [[ $word == ckptd_root=* ]]; then
		IFS=, read -r -a paths <<<"${word#ckptd_root=}"
		roots+=("${paths[@]}")
	fi
done
if ((${#roots[@]} == 0)); then
	exit 0 # this job does not use ckptd
fi

# --state-dir: the journal lives next to the socket, in the job's own 0700 directory
# created below (the job's user has no writable default there: HOME=/).
args=(serve --socket "$sock" --state-dir "$dir/state")
for root in "${roots[@]}"; do
	# ckptd itself checks, as the job's user, that the root exists and is usable; this
	# script runs as root and touches no user path, it only rejects relative ones.
	[[ $root == /* ]] || give_up "checkpoint root '$root' is not an absolute path"
	args+=(--root "$root")
done
if [[ -r $CKPTD_CONFIG ]]; then
	args+=(--config "$CKPTD_CONFIG")
fi
if [[ -n $CKPTD_NODE ]]; then
	args+=(--node "$CKPTD_NODE")
fi

# A requeued job keeps its id: clear what a previous run on this node left behind.
kill_recorded
rm -rf -- "$dir"
install -d -m 0755 -o root -g root "$CKPTD_RUN_BASE" "$CKPTD_LOG_BASE"
install -d -m 0700 -o "$uid" -g "$gid" "$dir" "$dir/state"
logfile=$CKPTD_LOG_BASE/$job.${CKPTD_NODE:-$(hostname -s)}.jsonl

# setsid: own session, so the daemon outlives this script and is not part of any job
# step (steps kill everything in their cgroup when they end; the Epilog stops ckptd
# gracefully instead). setsid and setpriv exec in place, so $! is ckptd's pid.
setsid setpriv --reuid="$uid" --regid="$gid" --init-groups \
	env -i PATH="$PATH" HOME=/ LANG=C.UTF-8 CKPTD_SOCKET="$sock" \
	"$CKPTD_BIN" "${args[@]}" </dev/null >>"$logfile" 2>&1 &
pid=$!
echo "$pid" >"$dir/ckptd.pid"
log "started ckptd (pid $pid) on $sock for ${roots[*]}; events in $logfile"

# Wait, bounded, until the daemon answers on its socket and can write its journal.
deadline=$((SECONDS + CKPTD_START_TIMEOUT))
until "$CKPTD_BIN" health --socket "$sock" --timeout 2 >/dev/null 2>&1; do
	kill -0 "$pid" 2>/dev/null || give_up "ckptd exited during start-up; see $logfile"
	if ((SECONDS >= deadline)); then
		why=$("$CKPTD_BIN" health --socket "$sock" --timeout 2 2>&1) || true
		give_up "ckptd not healthy within ${CKPTD_START_TIMEOUT}s: $why"
	fi
	sleep 0.2
done
exit 0
