#!/usr/bin/env bash
# The whole test suite: lints first (rustfmt, clippy with warnings as errors, ruff on python/,
# no import circles between modules), then Rust (all crates) and the Python tracer against real PyTorch releases.
# Installs what the tests need into cached virtual environments (torch from the package index,
# CPU is enough: the tracer never touches a GPU):
#   pinned  — the release the Rust bridge tests and the recorded figures use;
#   newest  — the newest releases on the index, so a new torch that breaks the tracer fails CI.
# The tracer's tests run against both; the Rust bridge tests against the pinned one. If torch
# cannot be installed the bridge tests report a skip; once it is installed they are required.
# GPUMEM_PYTHON, when set, replaces both environments.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${GPUMEM_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpumem-ci}"
COMMON="timm==1.0.31 transformers==5.24.0 segmentation-models-pytorch==0.6.0 peft==0.21.2 bitsandbytes==0.50.2 torchao==0.16.0 liger-kernel==0.8.5 lightning==2.6.1 psutil==7.2.2 pytest==9.2.0 numpy==2.4.6 jsonschema==4.25.1"
# litgpt, whose own model, LoRA and loss the tracer runs (litgpt: models), pins
# huggingface-hub<1.4 where transformers 5 needs 1.31 or later; its model code imports neither
# (Lightning, psutil and PyYAML it does, in COMMON), so it is installed without its dependencies.
LITGPT="litgpt==0.5.13"
MODULES="torch, torchvision, timm, transformers, segmentation_models_pytorch, peft, bitsandbytes, liger_kernel, litgpt.lora, pytest, jsonschema"
PINNED="torch==2.9.1 torchvision==0.24.1 $COMMON"
NEWEST="torch==2.15.0 torchvision==0.29.2 $COMMON"
# The trainers whose own code the tracer runs where it is installed — torchtitan (its activation
# checkpointing and models: python/tests/test_titan.py) and torchtune (its chunked cross-entropy
# and optimizer-in-backward hooks: python/tests/test_torchtune.py): the releases gpumem's
# restatements state (ac.py's TITAN_RELEASE, losses.py) with the torch of their time, torchao as
# torchtune 0.6.1 imports it, their dependencies pinned as they resolved (about 12 minutes to
# install from nothing on 2 cores, beside another install; torch's wheel brings CUDA's
# libraries, which stay unused).
TITAN="torch==2.10.0 torchtitan==0.2.2 torchtune==0.6.1 torchao==0.13.0 torchdata==0.11.0 datasets==5.2.0 tokenizers==0.23.3 tomli==2.5.0 fsspec==2026.9.0 tyro==1.0.17 tensorboard==2.21.0 einops==0.8.2 pillow==13.0.0 huggingface_hub==2.4.0 safetensors==0.8.0 kagglehub==1.0.3 sentencepiece==0.2.3 tiktoken==0.14.0 blobfile==3.3.0 omegaconf==2.4.0 psutil==7.2.2 pytest==9.2.0 numpy==2.4.6 jsonschema==4.25.1"
RUFF="0.17.6"
MATURIN="maturin==1.16.0"

# venv PACKAGES MODULES [NO_DEPS]: the cached environment's interpreter, installed on first use
# (and again unless MODULES import), NO_DEPS then installed without their dependencies; empty
# if the install failed.
venv() {
  local dir="$CACHE/venv-$(echo "$1${3:+ $3}" | cksum | cut -d' ' -f1)"
  if ! "$dir/bin/python" -c "import $2" 2>/dev/null; then
    echo "== installing $1${3:+ and, without dependencies, $3} into $dir (cached)" >&2
    rm -rf "$dir"
    mkdir -p "$CACHE"
    python3 -m venv "$dir"
    # shellcheck disable=SC2086
    if ! "$dir/bin/pip" install -q --disable-pip-version-check $1 >&2 \
      || { [ -n "${3:-}" ] && ! "$dir/bin/pip" install -q --disable-pip-version-check --no-deps $3 >&2; }; then
      echo "WARNING: could not install $1 ${3:-}" >&2
      return 0
    fi
  fi
  echo "$dir/bin/python"
}

# The environments install in the background while the lints run (pip waits on the network and
# the disk, clippy on the CPUs); each is awaited where its tests need it, and `venv` then finds it
# installed. Their install logs are shown when awaited.
prefetch="$(mktemp -d)"
declare -A fetching=()
prefetch() {
  venv "$@" > /dev/null 2> "$prefetch/$(echo "$1" | cksum | cut -d' ' -f1).log" &
  fetching["$1"]=$!
}
# awaited PACKAGES MODULES [NO_DEPS]: sets `got` to the environment's interpreter (as `venv` prints it)
# once its background install is done. Not called in $(…): a subshell cannot wait for it.
awaited() {
  if [ -n "${fetching[$1]:-}" ]; then
    wait "${fetching[$1]}" || true
    cat "$prefetch/$(echo "$1" | cksum | cut -d' ' -f1).log" >&2
    unset "fetching[$1]"
  fi
  got="$(venv "$@")"
}
if [ -z "${GPUMEM_PYTHON:-}" ]; then
  prefetch "$PINNED" "$MODULES" "$LITGPT"
  prefetch "$NEWEST" "$MODULES" "$LITGPT"
fi
prefetch "$TITAN" "torch, torchtitan, torchtune, pytest"
prefetch "$MATURIN" "maturin"

# Lints, before anything slow: formatting, clippy (a dev-profile check build of every target,
# warnings as errors), and ruff (lint and format, configured in python/pyproject.toml) from a
# small cached environment of its own.
for component in rustfmt clippy; do
  if ! cargo "${component/rustfmt/fmt}" --version >/dev/null 2>&1; then
    echo "== installing the $component component" >&2
    rustup component add "$component" >&2
  fi
done
echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy (-D warnings)"
cargo clippy --workspace --all-targets -- -D warnings
ruff="$CACHE/venv-ruff-$RUFF/bin/ruff"
if [ "$("$ruff" --version 2>/dev/null)" != "ruff $RUFF" ]; then
  echo "== installing ruff $RUFF into $CACHE/venv-ruff-$RUFF (cached)" >&2
  rm -rf "$CACHE/venv-ruff-$RUFF"
  mkdir -p "$CACHE"
  python3 -m venv "$CACHE/venv-ruff-$RUFF"
  "$CACHE/venv-ruff-$RUFF/bin/pip" install -q --disable-pip-version-check "ruff==$RUFF" >&2 \
    || { echo "FAILED: could not install ruff==$RUFF" >&2; exit 1; }
fi
echo "== ruff check, ruff format --check (python/)"
"$ruff" check python
"$ruff" format --check python
echo "== import circles (crates/, python/)"
python3 scripts/import-cycles.py
# The release build of every test while the environments are still installing (on a fresh
# machine pip takes about 12 minutes, mostly waiting on the network and the disk): the Rust
# tests further down then only run.
echo "== cargo test --release --no-run (while the environments install)"
cargo test --release --workspace --no-run

tracer_tests() {
  echo "== Python tracer tests ($1: $("$1" -c 'import torch; print("torch", torch.__version__)'))"
  (cd python && PYTHONDONTWRITEBYTECODE=1 "$1" -m pytest -q -p no:cacheprovider tests)
}

if [ -n "${GPUMEM_PYTHON:-}" ]; then
  tracer_tests "$GPUMEM_PYTHON"
else
  awaited "$PINNED" "$MODULES" "$LITGPT"
  pinned="$got"
  awaited "$NEWEST" "$MODULES" "$LITGPT"
  newest="$got"
  # The two environments' tests run side by side (each mostly one core: tracing is on meta
  # tensors), their output shown in order; either failing fails the run.
  logs="$(mktemp -d)"
  pids=()
  for py in "$pinned" "$newest"; do
    if [ -n "$py" ]; then
      tracer_tests "$py" > "$logs/${#pids[@]}.log" 2>&1 &
      pids+=($!)
    else
      echo "SKIPPED: Python tracer tests in an environment that did not install"
    fi
  done
  failed=0
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || failed=1
    cat "$logs/$i.log"
  done
  rm -rf "$logs"
  [ "$failed" = 0 ] || { echo "FAILED: Python tracer tests"; exit 1; }
  if [ -n "$pinned" ]; then export GPUMEM_PYTHON="$pinned"; fi
fi

# The trainers' own code (python/tests/test_titan.py, test_torchtune.py): required here — a
# trainer that cannot be installed fails the run (the tests skip only outside CI).
awaited "$TITAN" "torch, torchtitan, torchtune, pytest"
titan="$got"
[ -n "$titan" ] || { echo "FAILED: could not install $TITAN"; exit 1; }
export GPUMEM_TITAN_PYTHON="$titan" GPUMEM_TEST_REQUIRE_TITAN=1

if [ -n "${GPUMEM_PYTHON:-}" ]; then
  export GPUMEM_TEST_REQUIRE_TORCH=1
else
  echo "SKIPPED: PyTorch bridge tests (no PyTorch)"
fi
# The Slurm integration test (crates/gpumem-cli/tests/slurm.rs) starts a throwaway cluster of
# Debian's slurmctld, slurmd and munged itself; installed here where this runs as root with apt.
slurm_installed() {
  PATH="$PATH:/usr/sbin:/sbin" command -v slurmctld >/dev/null && PATH="$PATH:/usr/sbin:/sbin" command -v slurmd >/dev/null \
    && command -v sbatch >/dev/null && PATH="$PATH:/usr/sbin:/sbin" command -v munged >/dev/null
}
install_slurm() {
  slurm_installed && return 0
  { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; } || return 1
  echo "== installing slurmctld, slurmd, slurm-client and munge (Debian)" >&2
  local pkgs="slurmctld slurmd slurm-client munge"
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $pkgs >&2 \
    || { DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $pkgs >&2; } \
    || return 1
  slurm_installed
}
if install_slurm; then
  export GPUMEM_TEST_REQUIRE_SLURM=1
else
  echo "SKIPPED: the Slurm integration test (Slurm is not installed and cannot be here)"
fi

# The trainers' tests (mostly one core: one trace at a time) run beside the Rust tests, their
# output shown after them; either failing fails the run.
titan_log="$(mktemp)"
(cd python && PYTHONDONTWRITEBYTECODE=1 "$titan" -m pytest -q -p no:cacheprovider tests/test_titan.py tests/test_torchtune.py) \
  > "$titan_log" 2>&1 &
titan_tests=$!
echo "== Rust tests (bridge against ${GPUMEM_PYTHON:-nothing})"
rust=0
cargo test --release --workspace || rust=$?
echo "== trainers' own code: torchtitan and torchtune tests ($("$titan" -c 'import torch, torchtitan, torchtune; print("torch", torch.__version__, "torchtitan", torchtitan.__version__, "torchtune", torchtune.__version__)'))"
trainers=0
wait "$titan_tests" || trainers=$?
cat "$titan_log"
rm -f "$titan_log"
[ "$trainers" = 0 ] || { echo "FAILED: the trainers' own code tests"; exit 1; }
[ "$rust" = 0 ] || { echo "FAILED: Rust tests"; exit 1; }

# The gpumem-estimate wheel (scripts/wheel.sh: maturin over the same target/), installed into a
# fresh virtual environment as a user installs it, torch taken from the pinned environment (a
# .pth file: nothing downloaded again); its API tests (python/tests/test_api.py) run there, from
# outside python/ so that `gpumem` is the installed package.
if [ -n "${GPUMEM_PYTHON:-}" ]; then
  awaited "$MATURIN" "maturin"
  [ -n "$got" ] || { echo "FAILED: could not install $MATURIN"; exit 1; }
  echo "== the gpumem-estimate wheel: build, install into a fresh venv, API tests"
  wheels="$(mktemp -d)"
  GPUMEM_BIN=target/release/gpumem MATURIN="$(dirname "$got")/maturin" scripts/wheel.sh "$wheels" > /dev/null
  fresh="$wheels/venv"
  python3 -m venv "$fresh"
  "$GPUMEM_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
    > "$("$fresh/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch-from-pinned.pth"
  "$fresh/bin/pip" install -q --no-deps --disable-pip-version-check "$wheels"/gpumem_estimate-*.whl
  # Lightning, for its callback and a Lightning script under `gpumem run` (its other
  # requirements come with the pinned environment).
  "$fresh/bin/pip" install -q --no-deps --disable-pip-version-check \
    lightning==2.6.6 lightning-utilities==0.15.2 torchmetrics==1.8.2
  tests="$PWD/python/tests/test_api.py"
  (cd "$wheels" && env -u GPUMEM_PYTHON GPUMEM_TEST_REQUIRE_WHEEL=1 PYTHONDONTWRITEBYTECODE=1 \
    "$fresh/bin/python" -m pytest -q -p no:cacheprovider "$tests")
  rm -rf "$wheels"
else
  echo "SKIPPED: the wheel's API tests (no PyTorch)"
fi
