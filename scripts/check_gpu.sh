#!/usr/bin/env bash
# Check a machine before a long job: both recipes for a few steps on the GPU (float32 and mixed bf16)
# against the CPU, Transformer Engine attention, tokens/s, MFU and peak memory against the estimate,
# one DeepSeek-V4-Flash-width layer of each type, generation on the GPU against the CPU, a LoRA base kept
# as released (FP8 / FP4, dequantised per use) against the CPU, and where vllm is importable, vLLM serving
# to-vllm's adapters against transformers + peft (greedy tokens). One table on
# stdout, the same rows in a JSON file; exit code 1 when a step fails (titan_thd/check/__init__.py).
#
#   ./scripts/check_gpu.sh [--out check_gpu.json] [--device cpu|cuda|cuda:N] [--only 1] [-v]
#   ./scripts/check_gpu.sh --system-python ...   # the Python already installed (python3 or $PYTHON),
#                                                # no venv, no install: air-gapped nodes with their own torch
# Without CUDA (or with --device cpu) the steps that need CUDA say SKIP and the rest run in seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ "${1:-}" == "--system-python" ]]; then
  shift
  PY="${PYTHON:-python3}"
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" # the checkout itself, not an installed copy
else
  "$ROOT/scripts/setup_env.sh"
  PY="${TITAN_THD_VENV:-$ROOT/.venv}/bin/python"
fi
cd "$ROOT"
exec "$PY" -m titan_thd.check "$@"
