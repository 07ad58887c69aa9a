#!/usr/bin/env bash
# Do two gpumem binaries give the same answers? `gpumem eval` (JSON, rows.csv, plots, stdout) on
# every measurement CSV of ../shared/data that eval reads, and `gpumem simulate --compare` on the
# four CARMA traces and docs/examples/llm-jobs.toml; each binary with its own trace cache (PyTorch
# rows are traced with GPUMEM_PYTHON). Prints one line per output and exits 1 on any difference.
# What a refactor that changes no behaviour must keep (issue 32's acceptance).
#
#   GPUMEM_PYTHON=/path/to/python scripts/same-answers.sh OLD_GPUMEM NEW_GPUMEM [WORKDIR]
set -uo pipefail
cd "$(dirname "$0")/.."
old=$1 new=$2 work=${3:-$(mktemp -d /tmp/gpumem-same.XXXXXX)}
data=../shared/data
answers() { # BINARY OUT
  local bin=$1 out=$2 name
  mkdir -p "$out"
  export GPUMEM_CACHE=$out/cache
  while read -r name csv gpu extra; do
    # shellcheck disable=SC2086
    "$bin" eval "$data/$csv" --gpu "$gpu" $extra --json > "$out/eval-$name.json" 2>&1
    # shellcheck disable=SC2086
    "$bin" eval "$data/$csv" --gpu "$gpu" $extra --out-dir "$out/rows-$name" 2>&1 \
      | sed "s#$out#OUT#g" > "$out/rows-$name.txt"
  done <<'CSVS'
mlp gpumemnet_mlp_a100_40gb.csv a100-40gb
cnn gpumemnet_cnn_a100_dev.csv a100-40gb
tf gpumemnet_transformer_a100_dev.csv a100-40gb
rw paper_realworld_a100_40gb.csv a100-40gb
rw-kept paper_realworld_a100_40gb.csv a100-40gb --outputs kept
h200 h200/realworld_dev_h200.csv h200
syn1 h200/synthetic_collect1.csv h200
syn2 h200/synthetic_collect2.csv h200
CSVS
  for t in philly_trace-t1 philly_trace-t2 philly_heavy-60-tasks philly_mix-90-tasks; do
    "$bin" simulate --trace "$data/carma/$t.csv" --tasks "$data/carma/carma_tasks.csv" \
      --gpus 4xa100-40gb --compare --json > "$out/sim-$t.json" 2>&1
  done
  "$bin" simulate --jobs docs/examples/llm-jobs.toml --gpus 8xh100-80gb-sxm --compare --json \
    > "$out/sim-llm.json" 2>&1
}
answers "$old" "$work/old" & answers "$new" "$work/new"; wait
different=0
for f in "$work"/old/*.json "$work"/old/*.txt "$work"/old/rows-*/*; do
  rel=${f#"$work"/old/}
  if cmp -s "$f" "$work/new/$rel"; then echo "same $rel"; else echo "DIFFERENT $rel"; different=1; fi
done
exit $different
