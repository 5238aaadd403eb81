#!/bin/bash
# No-admin mode: run one ckptd per node of a job as a background job step, with no
# Prolog/Epilog. From the batch script (see example-noadmin.sbatch):
#
#   ckptd-node.sh start --root /ckpt/run-42   # one daemon a node; returns once all answer
#   srun python train.py ...                  # the ranks find $CKPTD_SOCKET
#   ckptd-node.sh stop                        # SIGTERM, bounded wait for them to drain
#
# start   (batch script) launches the daemons' step in the background,
#             srun --overlap --nodes=N --ntasks=N --ntasks-per-node=1 ckptd-node.sh serve ...
#         with N the job's node count given explicitly: inside an allocation srun inherits
#         SLURM_NTASKS (the job's task count), and --ntasks-per-node=1 alone would then be
#         ignored ("can't honor --ntasks-per-node") and start several daemons a node. Then
#         it runs `wait` on every node the same way, and fails (after stopping the step)
#         unless every node's daemon answers within CKPTD_START_TIMEOUT seconds.
# stop    (batch script) sends SIGTERM to the daemons' tasks (`scancel --signal=TERM
#         JOB.STEP`: the tasks get the signal, the step is not cancelled, no SIGKILL
#         follows), so each daemon finishes a promotion under way and exits 0; waits up to
#         CKPTD_STOP_GRACE seconds for the step to end, then kills it and exits 1.
#         (Do not `kill` the daemons' srun: srun answers SIGTERM with "forcing job
#         termination" and its tasks are SIGKILLed at once.)
# serve   (one task a node, run by start) runs ckptd in the foreground of its task.
# wait    (one task a node, run by start) returns once the node's daemon answers
#         `ckptd health`.
# socket  prints the node's socket path (what its ranks need in $CKPTD_SOCKET).
#
# The socket and journal live in a per-job directory on the node,
#
#   ${CKPTD_RUN_DIR:-${TMPDIR:-/tmp}/ckptd-%j}/ckptd.sock
#
# where %j is the job id and %N the node's Slurm name ($SLURMD_NODENAME), expanded on
# each node. By default the path is the same on every node, so the batch script exports
# CKPTD_SOCKET once. (Under job_container/tmpfs, /tmp is private to the job and shared by
# its steps on a node, which is what this needs.) Several Slurm nodes on one host (a test
# cluster) need a directory each and a node name each: CKPTD_RUN_DIR=/tmp/ckptd-%j-%N
# CKPTD_NODE=%N, and each rank takes its socket from `ckptd-node.sh socket`.
# Arguments after "start" (or "serve") go to `ckptd serve` (--root, --config, ...).
#
# Settings (environment): CKPTD_BIN (ckptd), CKPTD_RUN_DIR, CKPTD_STATE_DIR
# (CKPTD_RUN_DIR/state), CKPTD_NODE (--node; default the hostname), CKPTD_LOG (srun
# --output of the daemons' step: ckptd-%j-%N.log), CKPTD_STEP_NAME (ckptd),
# CKPTD_START_TIMEOUT (60 s), CKPTD_STOP_GRACE (90 s; keep it below the time between the
# batch script's --signal and the time limit).
set -euo pipefail

CKPTD_BIN=${CKPTD_BIN:-ckptd}
CKPTD_START_TIMEOUT=${CKPTD_START_TIMEOUT:-60}
CKPTD_STOP_GRACE=${CKPTD_STOP_GRACE:-90}
CKPTD_STEP_NAME=${CKPTD_STEP_NAME:-ckptd}
CKPTD_LOG=${CKPTD_LOG:-ckptd-%j-%N.log}
job=${SLURM_JOB_ID:?run this inside a Slurm job}
self=$(readlink -f -- "${BASH_SOURCE[0]}")

# %j: the job id, %N: this node's Slurm name.
expand() {
	local text=$1 node=${SLURMD_NODENAME:-$(hostname -s)}
	text=${text//'%j'/$job}
	printf '%s' "${text//'%N'/$node}"
}
dir=$(expand "${CKPTD_RUN_DIR:-${TMPDIR:-/tmp}/ckptd-%j}")
sock=$dir/ckptd.sock

# One task on every node of the job, whatever the job's own task layout says.
one_per_node() {
	local nodes=${SLURM_JOB_NUM_NODES:?run this in a batch script or salloc}
	srun --overlap --nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1 "$@"
}

# The job's steps named $CKPTD_STEP_NAME that are still running (JOB.STEP ids).
daemon_steps() {
	squeue --noheader --steps --jobs="$job" --format='%i %j' |
		awk -v name="$CKPTD_STEP_NAME" '$2 == name { print $1 }'
}

stop_daemons() {
	local steps deadline
	steps=$(daemon_steps)
	[[ -n $steps ]] || return 0
	# shellcheck disable=SC2086 # one id per word
	scancel --signal=TERM $steps
	deadline=$((SECONDS + CKPTD_STOP_GRACE))
	while [[ -n $(daemon_steps) ]]; do
		if ((SECONDS >= deadline)); then
			echo "ckptd-node.sh: ckptd still running ${CKPTD_STOP_GRACE}s after SIGTERM; killing step $steps" >&2
			# shellcheck disable=SC2086
			scancel --signal=KILL $steps || true
			return 1
		fi
		sleep 0.5
	done
}

case ${1:-} in
start)
	shift
	# </dev/null: the background step must not read the batch script's stdin.
	one_per_node --job-name="$CKPTD_STEP_NAME" --kill-on-bad-exit=0 --output="$CKPTD_LOG" \
		"$self" serve "$@" </dev/null &
	if ! one_per_node --job-name="$CKPTD_STEP_NAME-wait" "$self" wait; then
		stop_daemons || true
		exit 1
	fi
	;;
stop)
	stop_daemons
	;;
serve)
	shift
	mkdir -p -m 0700 -- "$dir"
	node=()
	if [[ -n ${CKPTD_NODE:-} ]]; then
		node=(--node "$(expand "$CKPTD_NODE")")
	fi
	state=$(expand "${CKPTD_STATE_DIR:-$dir/state}")
	# exec: the step's SIGTERM (`stop`, scancel, the end of the job) reaches ckptd itself,
	# which finishes a promotion under way before it exits.
	exec "$CKPTD_BIN" serve --socket "$sock" --state-dir "$state" "${node[@]}" "$@"
	;;
wait)
	deadline=$((SECONDS + CKPTD_START_TIMEOUT))
	until "$CKPTD_BIN" health --socket "$sock" --timeout 2 >/dev/null 2>&1; do
		if ((SECONDS >= deadline)); then
			echo "ckptd-node.sh: ckptd on $(hostname) not healthy after ${CKPTD_START_TIMEOUT}s:" >&2
			"$CKPTD_BIN" health --socket "$sock" --timeout 2 >&2 || true
			exit 1
		fi
		sleep 0.5
	done
	;;
socket)
	printf '%s\n' "$sock"
	;;
*)
	echo "usage: ckptd-node.sh start|serve [ckptd serve options] | wait | stop | socket" >&2
	exit 2
	;;
esac
