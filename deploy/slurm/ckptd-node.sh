#!/bin/bash
# No-admin mode: run one ckptd per node of a job as a background job step, with no
# Prolog/Epilog. From the batch script (see example-noadmin.sbatch):
#
#   srun --overlap --ntasks-per-node=1 --nodes="$SLURM_JOB_NUM_NODES" \
#       ckptd-node.sh serve --root /ckpt/run-42 &
#   srun --overlap --ntasks-per-node=1 --nodes="$SLURM_JOB_NUM_NODES" ckptd-node.sh wait
#
# "serve" runs ckptd in the foreground of its task (srun keeps the step alive), with its
# socket and journal in a per-job directory on the node; "wait" returns once the node's
# daemon answers `ckptd health` (or fails after CKPTD_START_TIMEOUT seconds). The socket
# path is the same on every node, and what the ranks find in $CKPTD_SOCKET:
#
#   ${CKPTD_RUN_DIR:-${TMPDIR:-/tmp}/ckptd-$SLURM_JOB_ID}/ckptd.sock
#
# (under job_container/tmpfs, /tmp is private to the job, and shared by its steps on a
# node, which is what this needs). Extra arguments after "serve" go to `ckptd serve`
# (--root, --config, --metrics-listen ...). The step is part of the job: it ends when
# the job ends. Stop it with SIGTERM once the trainer's step has exited, so it can finish
# a promotion under way (example-noadmin.sbatch does).
set -euo pipefail

CKPTD_BIN=${CKPTD_BIN:-ckptd}
CKPTD_START_TIMEOUT=${CKPTD_START_TIMEOUT:-60}
job=${SLURM_JOB_ID:?run this inside a Slurm job (srun)}
dir=${CKPTD_RUN_DIR:-${TMPDIR:-/tmp}/ckptd-$job}
sock=$dir/ckptd.sock

case ${1:-} in
serve)
	shift
	mkdir -p -m 0700 -- "$dir"
	# exec: srun's SIGTERM (scancel, the end of the job, `kill` of the srun) reaches
	# ckptd itself, which finishes a promotion under way before it exits.
	exec "$CKPTD_BIN" serve --socket "$sock" --state-dir "${CKPTD_STATE_DIR:-$dir/state}" "$@"
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
*)
	echo "usage: ckptd-node.sh serve [ckptd serve options] | wait" >&2
	exit 2
	;;
esac
