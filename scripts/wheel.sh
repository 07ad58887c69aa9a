#!/usr/bin/env bash
# Builds the gpumem-estimate wheel (python/pyproject.toml) into DIR (default target/wheels):
# the `gpumem` release binary first, placed where the wheel takes its scripts from, then the
# Python packages and the native module with maturin (MATURIN, default `maturin` on PATH).
# Both share the workspace's target/ with `cargo build --release`.
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:-target/wheels}")"
cargo build --release -p gpumem-cli
mkdir -p python/build/wheel-data/scripts
cp target/release/gpumem python/build/wheel-data/scripts/gpumem
(cd python && "${MATURIN:-maturin}" build --release --out "$out" >&2)
ls "$out"/gpumem_estimate-*.whl
