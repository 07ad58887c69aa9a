#!/usr/bin/env bash
# Builds the gpumem-estimate wheel (python/pyproject.toml) into DIR (default target/wheels):
# the `gpumem` release binary first, placed where the wheel takes its scripts from, then the
# Python packages and the native module with maturin (MATURIN, default `maturin` on PATH).
# Both share the workspace's target/ with `cargo build --release`. GPUMEM_BIN, when set, is a
# release binary already built (the test suite's: `cargo build -p gpumem-cli` unifies other
# features than `cargo test --workspace` and would build much of the workspace again).
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:-target/wheels}")"
bin="${GPUMEM_BIN:-}"
if [ -z "$bin" ]; then
  cargo build --release -p gpumem-cli
  bin=target/release/gpumem
fi
mkdir -p python/build/wheel-data/scripts
cp "$bin" python/build/wheel-data/scripts/gpumem
(cd python && "${MATURIN:-maturin}" build --release --out "$out" >&2)
ls "$out"/gpumem_estimate-*.whl
