#!/usr/bin/env bash
# The device check (benchmarks/device_check.py): ResNet-50 bf16 + XLA and float16, engine against the
# bare loop, MFU against the GPU's peak, mirrored over every GPU, the async checkpoint's blocking ratio.
# One JSON on stdout, the logs on stderr; under 8 minutes on a machine with GPUs.
#   benchmarks/device_check.sh [--json=PATH]      on the GPU machine
#   benchmarks/device_check.sh --tiny             on CPU, in seconds (the same fields)
set -euo pipefail
cd "$(dirname "$0")/.."
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The check keeps to its own --budget_s (420 s); this is the hard stop.
exec timeout --signal=TERM --kill-after=10 470 "${PYTHON:-python}" -m benchmarks.device_check "$@"
