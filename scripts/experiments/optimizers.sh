#!/usr/bin/env bash
# Muon against AdamW (docs/learning.md, "Muon"): one config trained at equal
# steps and data with each optimizer at each learning rate and seed; the
# final validation's bits per byte (the whole split) of each run. Runs
# already finished are not trained again.
#
#   CONFIG=configs/quickstart.toml RUNS=runs/optimizers \
#   ADAMW_LRS="2e-3" MUON_LRS="2e-3 4e-3" SEEDS="0 1" scripts/experiments/optimizers.sh [--set KEY=VALUE ...]
#
# Extra --set options go to every training run. Needs `tvq` on PATH, or set
# TVQ=path/to/tvq.
set -euo pipefail

config="${CONFIG:-configs/quickstart.toml}"
runs="${RUNS:-runs/optimizers}"
tvq="${TVQ:-tvq}"
mkdir -p "$runs"

bits() { grep -o '"bits_per_byte":[0-9.]*' | cut -d: -f2; }

printf '%-6s %-8s %-5s %-10s %-10s\n' optim lr seed bpb tokens/s
for optim in adamw muon; do
    lrs_var="${optim^^}_LRS"
    for lr in ${!lrs_var:-}; do
        for seed in ${SEEDS:-0 1}; do
            dir="$runs/$(basename "$config" .toml)-$optim-$lr-$seed"
            if [[ ! -e "$dir/finished" ]]; then
                resume=()
                [[ -d "$dir/checkpoints" ]] && resume=(--resume)
                "$tvq" train --config "$config" --run-dir "$dir" \
                    --set train.optimizer.name="$optim" --set train.lr="$lr" \
                    --set train.seed="$seed" "$@" "${resume[@]}" --quiet > "$dir.log" 2>&1
                touch "$dir/finished"
            fi
            final=$(grep '"kind":"final_eval"' "$dir/metrics.jsonl" | tail -1 | bits)
            speed=$(grep -o '"tokens_per_s":[0-9.]*' "$dir/metrics.jsonl" | tail -20 \
                | cut -d: -f2 | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
            printf '%-6s %-8s %-5s %-10.4f %-10.0f\n' "$optim" "$lr" "$seed" "$final" "$speed"
        done
    done
done
