#!/usr/bin/env bash
# The whole test suite: Rust (all crates) and the Python tracer against a real PyTorch.
# Installs what the tests need into a cached virtual environment (torch from the package index,
# CPU is enough: the tracer never touches a GPU). If torch cannot be installed the bridge tests
# report a skip; once it is installed they are required.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${GPUMEM_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpumem-ci}"
PY_PACKAGES="torch==2.9.1 torchvision==0.24.1 timm==1.0.31 transformers==5.24.0 segmentation-models-pytorch==0.6.0 pytest==9.2.0 numpy==2.4.6"
VENV="$CACHE/venv-$(echo "$PY_PACKAGES" | cksum | cut -d' ' -f1)"

if [ -z "${GPUMEM_PYTHON:-}" ]; then
  if ! "$VENV/bin/python" -c "import torch, torchvision, timm, transformers, segmentation_models_pytorch, pytest" 2>/dev/null; then
    echo "== installing the tracer's test environment into $VENV (cached)"
    rm -rf "$VENV"
    mkdir -p "$CACHE"
    python3 -m venv "$VENV"
    # shellcheck disable=SC2086
    if ! "$VENV/bin/pip" install -q --disable-pip-version-check $PY_PACKAGES; then
      echo "WARNING: could not install PyTorch; the PyTorch bridge tests will be skipped"
    fi
  fi
  if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    export GPUMEM_PYTHON="$VENV/bin/python"
  fi
fi

if [ -n "${GPUMEM_PYTHON:-}" ]; then
  export GPUMEM_TEST_REQUIRE_TORCH=1
  echo "== Python tracer tests ($GPUMEM_PYTHON)"
  (cd python && PYTHONDONTWRITEBYTECODE=1 "$GPUMEM_PYTHON" -m pytest -q -p no:cacheprovider tests)
else
  echo "SKIPPED: Python tracer tests (no PyTorch)"
fi

echo "== Rust tests"
cargo test --release --workspace
