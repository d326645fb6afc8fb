#!/usr/bin/env bash
# Open MPI: NUM_PROCESSES processes over the hosts of HOSTFILE (- for this host), each running
# the command given, unchanged: your own script that builds a jddp.Trainer (it joins the job by
# itself: jddp reads rank and size from Open MPI's variables, JAX's detection), jddp-train, or
# anything else. Flags alone (the first starts with -) run the repository's train entry point.
#   launch/mpirun.sh 4 hosts.txt python my_train.py --workdir=/shared/runs/a
#   launch/mpirun.sh 4 hosts.txt --config=experiments/configs/gpt_124m.py --workdir=runs/gpt
# hosts.txt lists one host per line ("node1 slots=1"); every host needs the same environment at
# the same path (PATH is passed on: activate the virtual environment first), and the workdir on
# storage every host mounts.
# One start, no restarts: mpirun ends with the exit code of the first process that failed (Open
# MPI's rule), one of docs/errors.md's table: 2 a mistake (running it again as it is cannot
# help), 75 retryable, 130 interrupted, anything else a failure. Whatever runs this script
# decides on it (the table says how jddp's own launchers do).
set -euo pipefail
if [[ $# -lt 2 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NUM_PROCESSES HOSTFILE|- COMMAND... | [train flags...]" >&2
  exit 2
fi
nproc=$1
hostfile=$2
shift 2
hosts=()
[[ $hostfile != - ]] && hosts=(--hostfile "$hostfile")
command=("$@") # run from here, as given
if [[ $# -eq 0 || $1 == -* ]]; then # flags alone: the train entry point, run from the repository
  cd "$(dirname "$0")/.."
  command=("${PYTHON:-$PWD/.venv/bin/python}" -m experiments.train "$@")
fi
exec mpirun -np "$nproc" "${hosts[@]}" --bind-to none -x PATH -x XLA_FLAGS -x PYTHONPATH \
  "${command[@]}"
