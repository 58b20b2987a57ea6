#!/usr/bin/env bash
# The device check of issue 23, in one call on a lent GPU (or a TPU host): the real-shape
# engine and learner in bfloat16 against the device's roofline and peak (device_check.py
# says what each number is). Needs jax with the device's plugin (`pip install
# 'raytunix[cuda]'` or '[tpu]'; the lent GPU machines' image has jax 0.11 with CUDA 13),
# flax, optax, pyarrow and pyyaml; not Ray. Prints one JSON object and writes it to
# $OUT/device_check.json (or ./device_check.json). Arguments go to device_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c 'import jax; d = jax.devices()[0]; print("device:", d.platform, d.device_kind, "jax", jax.__version__)' >&2
out="${OUT:-.}/device_check.json"
# About 4 minutes on an H100 by estimate (compiles included); the limit leaves room.
timeout 450 python3 benchmarks/device_check.py "$@" | tee "$out"
