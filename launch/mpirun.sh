#!/usr/bin/env bash
# Open MPI: NUM_PROCESSES processes over the hosts of HOSTFILE (default: this host), each the
# train entry point; jddp reads rank and size from Open MPI's variables (JAX's detection).
#   launch/mpirun.sh 4 hosts.txt --config=experiments/configs/gpt_124m.py --workdir=runs/gpt
# hosts.txt lists one host per line ("node1 slots=1"); every host needs this repo and its .venv
# at the same path.
# One start, no restarts: mpirun ends with the exit code of the first process that failed (Open
# MPI's rule), one of docs/errors.md's table: 2 a mistake (running it again as it is cannot
# help), 75 retryable, 130 interrupted, anything else a failure. Whatever runs this script
# decides on it (the table says how jddp's own launchers do).
set -euo pipefail
if [[ $# -lt 2 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NUM_PROCESSES HOSTFILE|- [train flags...]" >&2
  exit 2
fi
nproc=$1
hostfile=$2
shift 2
cd "$(dirname "$0")/.."
python=${PYTHON:-$PWD/.venv/bin/python}
hosts=()
[[ $hostfile != - ]] && hosts=(--hostfile "$hostfile")
exec mpirun -np "$nproc" "${hosts[@]}" --bind-to none -x PATH -x XLA_FLAGS -x PYTHONPATH \
  "$python" -m experiments.train "$@"
