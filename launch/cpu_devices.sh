#!/usr/bin/env bash
# Train on N simulated CPU devices of this machine (they share its cores): handy to try data
# parallelism without accelerators.
#   launch/cpu_devices.sh 8 --config=experiments/configs/digits_mlp.py --workdir=runs/ddp8
set -euo pipefail
if [[ $# -lt 1 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NUM_DEVICES [train flags...]" >&2
  exit 2
fi
devices=$1
shift
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${devices}"
exec "$python" -m experiments.train "$@"
