#!/usr/bin/env bash
# Peak memory and tokens/s of a whole training step (forward, backward,
# AdamW) for each activation checkpointing mode and precision, at several
# segment lengths: the table of docs/benchmarks.md ("Memory"). Each setting
# runs in its own process, so that its peak RSS is its own.
#
#   scripts/memory-bench.sh > docs/memory-bench-cpu.jsonl
#
# Env: SEQ_LENS (default "512 8192 32768 131072"), ROWS (4), PRECISIONS
# ("f32 bf16"), MODES ("none selective full"), DEVICE (cpu), MEM_GIB (the
# machine's memory; settings whose estimate exceeds it are reported as
# skipped instead of run); further arguments go to tvq bench.
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ_LENS=${SEQ_LENS:-"512 8192 32768 131072"}
ROWS=${ROWS:-4}
PRECISIONS=${PRECISIONS:-"f32 bf16"}
MODES=${MODES:-"none selective full"}
DEVICE=${DEVICE:-cpu}
MEM_GIB=${MEM_GIB:-$(awk '/MemTotal/ {printf "%d", $2 / 1048576}' /proc/meminfo)}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tvq/target}"
cargo build --workspace --release >&2
tvq="$CARGO_TARGET_DIR/release/tvq"

# Activation bytes per token of the benchmark model, measured at T = 8,192 x
# 4 in f32 (docs/benchmarks.md), plus 0.5 GiB for the process: an estimate
# to skip what cannot fit, not a measurement.
per_token() {
  case $1 in none) echo 135000 ;; selective) echo 96000 ;; full) echo 38000 ;; esac
}

for t in $SEQ_LENS; do
  for p in $PRECISIONS; do
    for m in $MODES; do
      need=$(( ROWS * t * $(per_token "$m") / 1048576 + 512 ))
      if (( need > MEM_GIB * 1024 )); then
        printf '{"form":"vq","seq_len":%d,"batch":%d,"precision":"%s","activation_checkpointing":"%s","skipped":"needs about %d MiB, more than the machine'"'"'s %d GiB"}\n' \
          "$t" "$ROWS" "$p" "$m" "$need" "$MEM_GIB"
        continue
      fi
      steps=2
      if (( t > 8192 )); then steps=1; fi
      "$tvq" bench step --device "$DEVICE" --form vq --json --batch "$ROWS" \
        --seq-len "$t" --precision "$p" --checkpointing "$m" --steps "$steps" "$@" \
        | grep '^{'
    done
  done
done
