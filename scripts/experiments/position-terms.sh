#!/usr/bin/env bash
# The position-term table of docs/learning.md ("At the official setting"):
# XL, Toeplitz (as it was: zero start, common rate; and as it is), windowed
# rotary (with and without its position channel) and the quadratic form trained on data/kjv.txt at
# configs/kjv-official.toml, two seeds each, then scored on the whole
# validation split with the state reset every 512 tokens (the
# official protocol) and carried through each row. About 20 minutes per run
# on 2 cores; runs already finished are not trained again.
#
#   scripts/experiments/position-terms.sh [RUNS_DIR] [--set KEY=VALUE ...]
#
# Extra --set options go to every training run (e.g. --set train.steps=10
# for a dry run). Needs `tvq` on PATH, or set TVQ=path/to/tvq.
set -euo pipefail

runs="${1:-runs/position-terms}"
shift || true
tvq="${TVQ:-tvq}"
mkdir -p "$runs"

declare -A form=(
    [xl]="--set model.bias=xl"
    [toeplitz]="--set model.bias=toeplitz"
    [toeplitz-zero]="--set model.bias=toeplitz --set model.toeplitz_locality=0 --set train.toeplitz_lr_scale=1"
    [rotary]="--set model.bias=rotary"
    [rotary-nochannel]="--set model.bias=rotary --set model.rotary_channel=0"
    [quadratic]="--set model.bias=xl --set model.attention=quadratic"
)

bits() { grep -o '"bits_per_byte":[0-9.]*' | cut -d: -f2; }

printf '%-14s %-5s %-16s %-10s\n' form seed "reset every 512" carried
for name in xl toeplitz-zero toeplitz rotary rotary-nochannel quadratic; do
    for seed in 0 1; do
        dir="$runs/$name-$seed"
        if [[ ! -e "$dir/finished" ]]; then
            # An interrupted run goes on from its last checkpoint.
            resume=()
            [[ -d "$dir/checkpoints" ]] && resume=(--resume)
            # shellcheck disable=SC2086  # the form's options are words
            "$tvq" train --config configs/kjv-official.toml --run-dir "$dir" \
                ${form[$name]} --set train.seed="$seed" "$@" "${resume[@]}" --quiet \
                > "$dir.log"
            touch "$dir/finished"
        fi
        reset=$("$tvq" eval --checkpoint "$dir" --reset-every 512 --json | bits)
        # The trainer's final validation carries the state through each row
        # (under the config's cache_limit).
        carried=$(grep '"kind":"final_eval"' "$dir/metrics.jsonl" | tail -1 | bits)
        printf '%-14s %-5s %-16.4f %-10.4f\n' "$name" "$seed" "$reset" "$carried"
    done
done
