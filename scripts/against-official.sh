#!/usr/bin/env bash
# tvq's training step against the official JAX code's, in one run: the
# official `train_op` (scripts/official_step.py) and `tvq bench step --form vq`
# for each MODE take turns, ROUNDS rounds, at the same sizes
# (batch 4, d_model 256, 4 GAU sublayers, S = L = 128; T tokens per
# optimizer step). Prints a Markdown table of tokens/s per round and the
# ratio of summed tokens/s, tvq / official.
#
#   PYTHON=/path/to/venv/bin/python scripts/against-official.sh OFFICIAL_SRC \
#     [ROUNDS] [SEQ_LENS] [MODES]
#
#   OFFICIAL_SRC: the `src` folder of a checkout of the official code (see
#   scripts/official_step.py for it and its Python packages). ROUNDS: 2.
#   SEQ_LENS: comma-separated (512,2048,8192). MODES: BIAS:CACHE_GRAD pairs
#   ("xl:full toeplitz:window"; xl:full is what the official code computes).
#   EXTRA: more `tvq bench` arguments (default "--set train.workers=2").
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1:?usage: scripts/against-official.sh OFFICIAL_SRC [ROUNDS] [SEQ_LENS] [MODES]}
ROUNDS=${2:-2}
SEQ_LENS=${3:-512,2048,8192}
MODES=${4:-xl:full toeplitz:window}
PYTHON=${PYTHON:-python3}
EXTRA=${EXTRA:---set train.workers=2}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tvq/target}"
cargo build --release -p tvq-cli >&2
tvq="$CARGO_TARGET_DIR/release/tvq"
log=$(mktemp)
trap 'rm -f "$log"' EXIT

for ((r = 1; r <= ROUNDS; r++)); do
  # shellcheck disable=SC2086 # SEQ_LENS' commas become separate arguments
  "$PYTHON" scripts/official_step.py "$SRC" ${SEQ_LENS//,/ } |
    awk '$1 == "official" {print "official", $2, $3}' | tee -a "$log" >&2
  for mode in $MODES; do
    # shellcheck disable=SC2086 # EXTRA is a list of arguments
    "$tvq" bench step --form vq --seq-len "$SEQ_LENS" --steps 3 $EXTRA \
      --set model.bias="\"${mode%%:*}\"" --set model.cache_grad="\"${mode##*:}\"" |
      awk -v m="$mode" '$1 == "vq" {print m, $2, $5}' | tee -a "$log" >&2
  done
done

awk -v modes="$MODES" '
  { rate[$1, $2] = rate[$1, $2] (rate[$1, $2] == "" ? "" : " / ") $3; sum[$1, $2] += $3
    if (!($2 in seen)) { seen[$2] = 1; lens[++n] = $2 } }
  END {
    k = split(modes, m, " ")
    printf "| T | official tok/s (rounds)"
    for (i = 1; i <= k; i++) printf " | tvq %s tok/s (rounds) | tvq / official", m[i]
    printf " |\n|---|---"; for (i = 1; i <= k; i++) printf "|---|---"; print "|"
    for (j = 1; j <= n; j++) {
      t = lens[j]; printf "| %s | %s", t, rate["official", t]
      for (i = 1; i <= k; i++) printf " | %s | %.2fx", rate[m[i], t], sum[m[i], t] / sum["official", t]
      print " |"
    }
  }' "$log"
