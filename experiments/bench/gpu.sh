#!/usr/bin/env bash
# GPT-124M bfloat16 training MFU on one GPU (written for one H200), in under 8 minutes.
#
#   experiments/bench/gpu.sh            # on the GPU machine, from anywhere in the repo
#   experiments/bench/gpu.sh --small    # a tiny GPT on any device (checks the script on a CPU)
#
# Needs only Python 3 with jax (GPU build), flax and optax: nothing is installed, nothing is
# downloaded. The Python is $PYTHON, else the checkout's .venv (docs/getting-started-gpu.md
# installs there), else python3. Prints a table whose mfu column is model FLOPs / s over the
# datasheet peak, and writes bench_results/gpu_mfu.json (gpu_mfu_small.json).
# What runs and how MFU is counted: experiments/bench/gpu_mfu.py.
set -euo pipefail

cd "$(dirname "$0")/../.."
if [[ -z ${PYTHON:-} ]]; then
  PYTHON=python3
  [[ -x .venv/bin/python ]] && PYTHON=.venv/bin/python
fi
TIME_LIMIT_SEC=470  # a hard stop under 8 minutes; no variant starts after 300 s

fail() { echo "error: $*" >&2; exit 2; }

command -v "$PYTHON" >/dev/null || fail "$PYTHON not found; set PYTHON=/path/to/python3"
"$PYTHON" - <<'PY' || fail "the Python packages above are missing; this script installs nothing"
import importlib, sys
missing = []
for name in ("jax", "flax", "optax", "numpy"):
    try:
        importlib.import_module(name)
    except ImportError as e:
        missing.append(f"{name} ({e})")
if missing:
    print("missing: " + ", ".join(missing), file=sys.stderr)
    sys.exit(1)
PY

if [[ " $* " != *" --small "* ]]; then
  "$PYTHON" -c 'import jax, sys; d = jax.devices()[0]; sys.exit(d.platform != "gpu")' \
    || fail "JAX sees no GPU ($("$PYTHON" -c 'import jax; print(jax.devices()[0].device_kind)' 2>&1 | tail -1)); run with --small to check the script on a CPU"
fi

exec timeout --signal=KILL "$TIME_LIMIT_SEC" "$PYTHON" -m experiments.bench.gpu_mfu "$@"
