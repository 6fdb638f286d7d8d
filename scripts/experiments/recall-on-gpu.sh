#!/usr/bin/env bash
# MQAR recall runs on a GPU node (docs/learning.md, "Recall"): the sweeps of
# a plan, all at once on the node's one GPU, each a scripts/experiments/recall-sweep.sh
# whose training runs stop after LIMIT seconds at most (then evaluated where
# they stopped), evaluated on the node's CPU, and everything back as
# OUT/r.tgz (per run: the log, config.toml, metrics.jsonl and the weights as
# a `tvq export`). Run from the repository root, after building dist/node/
# on the development machine with the unfused build (the default build
# autotunes for more than five minutes on a fresh node: docs/benchmarks.md,
# "The third run on a GPU"):
#
#   CARGO_TARGET_DIR=~/.cache/tvq/target-unfused cargo build --release -p tvq-cli --no-default-features
#   mkdir -p dist/node && strip -o /tmp/tvq ~/.cache/tvq/target-unfused/release/tvq \
#     && xz -6 -T0 -c /tmp/tvq > dist/node/tvq.xz && git rev-parse --short HEAD > dist/node/commit
#   (and copy into dist/node/ any run a plan line starts from, FROM=dist/node/...)
#
#   OUT=DIR LIMIT=400 scripts/experiments/recall-on-gpu.sh scripts/experiments/recall-on-gpu.plan
#   OUT=DIR LIMIT=60 DEVICE=cpu scripts/experiments/recall-on-gpu.sh PLAN   # the script's own test
#
# PLAN: one sweep per line, "NAME VAR=VALUE ...", with recall-sweep.sh's
# variables (FORMS, PAIRS, LENS, SEEDS, EXTRA, FROM; shell quoting, run by
# eval: a plan is a script of its own, trusted as one); "#"
# starts a comment. Sweep NAME writes /tmp/tvq-recall/NAME/, its own kernel
# cache beside it (several processes never share one cache file).
set -uo pipefail
plan="${1:?usage: OUT=DIR LIMIT=SECONDS scripts/experiments/recall-on-gpu.sh PLAN}"
out="${OUT:?OUT is the folder to write to}"
export LIMIT="${LIMIT:?LIMIT is the seconds each training run may take}"
export DEVICE="${DEVICE:-cuda}"
work=/tmp/tvq-recall bin=/tmp/tvq-recall-bin
started=$(date +%s)
note() { echo "[$(( $(date +%s) - started )) s] $*" | tee -a "$out/recall.log"; }
rm -rf "$work" "$bin" && mkdir -p "$work" "$bin" "$out"

xz -dc dist/node/tvq.xz > "$bin/tvq" && chmod +x "$bin/tvq" || { note "cannot unpack dist/node/tvq.xz"; exit 1; }
export TVQ_BIN="$bin/tvq" TVQ_COMMIT="$(cat dist/node/commit 2>/dev/null || echo unknown)"
note "tvq $("$TVQ_BIN" --version) (commit $TVQ_COMMIT), device $DEVICE, limit $LIMIT s per run"
if [ "$DEVICE" = cuda ]; then
  . scripts/gpu-node/common.sh
  use_cuda python3 scripts/gpu-node/find_cuda.py "$bin/cuda" || { note "find_cuda: $cuda_found"; exit 1; }
  note "cuda: $cuda_found"
  nvidia-smi --query-gpu=timestamp,name,utilization.gpu,memory.used --format=csv -l 5 > "$out/gpu.csv" 2>&1 &
  monitor=$!
fi

names=() pids=()
while read -r name vars; do
  case "$name" in ''|'#'*) continue ;; esac
  names+=("$name")
  mkdir -p "$work/$name/cache"
  note "$name: $vars"
  (eval "export $vars" && XDG_CACHE_HOME="$work/$name/cache" scripts/experiments/recall-sweep.sh "$work/$name") \
    < /dev/null > "$work/$name.log" 2>&1 &
  pids+=($!)
done < "$plan"
wait "${pids[@]}"
note "sweeps done"

for name in "${names[@]}"; do
  note "$name: $(tail -1 "$work/$name.log")"
  # Every row with its sweep's name: two lines may train runs of one name.
  sed "s/^{/{\"sweep\": \"$name\", /" "$work/$name/results.jsonl" >> "$out/results.jsonl" 2>/dev/null
  for run in "$work/$name"/*/; do
    run="${run%/}"
    [ -f "$run/config.toml" ] || continue
    "$TVQ_BIN" export --checkpoint "$run" --out "$run.safetensors" > /dev/null 2>&1 || note "$run: no export"
  done
done
tar -C "$work" -czf "$out/r.tgz" --exclude=cache --exclude=checkpoints --exclude='*.png' --exclude=train.lock .
note "packed $(stat -c %s "$out/r.tgz") bytes"
[ -n "${monitor:-}" ] && kill "$monitor"
exit 0
