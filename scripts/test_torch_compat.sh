#!/usr/bin/env bash
# A cheap part of the suite under another torch release, in an environment of its own (default
# torch 2.11.0, the air-gapped GPU stack's; PyPI's build of it is the CUDA one, ~5 GB, which runs on
# the CPU too). What it leaves out: FSDP over several ranks, which torch 2.11 refuses in one line
# (no FSDPModule.set_reduce_scatter_unused_params: parallel/fsdp.py).
#   ./scripts/test_torch_compat.sh                                  # creates .venv-torch-2.11.0 once
#   TORCH_VERSION=2.12.0 ./scripts/test_torch_compat.sh
#   TITAN_THD_COMPAT_VENV=/path/to/venv ./scripts/test_torch_compat.sh   # a venv that has that torch
# Other arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${TORCH_VERSION:-2.11.0}"
VENV="${TITAN_THD_COMPAT_VENV:-$ROOT/.venv-torch-$VERSION}"
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[compat] creating $VENV with torch $VERSION" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
  # The project's dependencies without its torch pin (pyproject.toml), then the tests'.
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "torch==$VERSION" "torchdata>=0.11" \
    "tensorboard>=2.16" "numpy>=1.26" "tokenizers>=0.19" "tqdm>=4.66" "pyarrow>=15" "safetensors>=0.4" \
    "pytest>=8" "pytest-timeout>=2.3"
fi
"$VENV/bin/python" -c 'import torch; print(f"[compat] torch {torch.__version__}")'
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not extended" \
  tests/test_config.py tests/test_startup.py tests/ops tests/memory/test_plan.py tests/models/dsv4/test_model.py \
  tests/models/test_llama.py tests/data/test_dataloader.py tests/test_train.py tests/test_check_gpu.py \
  -k "not two_ranks" "$@"
