#!/usr/bin/env bash
# What TensorBoard logging and --trace cost a quick-start run: interleaved
# rounds of the same 300 steps (no evaluation, no checkpoint but the last)
# with log.tensorboard = false, with TensorBoard (the default), and with
# TensorBoard and --trace; the wall-clock and CPU (user + system) seconds
# of each whole run. Ratios within one run of this script are what counts.
#
#   scripts/logging-overhead.sh [ROUNDS] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
STEPS=${2:-300}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tvq/target}"
cargo build --release -p tvq-cli >&2
tvq="$CARGO_TARGET_DIR/release/tvq"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() { # EXTRA... -> "wall cpu" seconds
  rm -rf "$tmp/run"
  /usr/bin/time -f "%e %U %S" -o "$tmp/time" \
    "$tvq" train --config configs/quickstart.toml --run-dir "$tmp/run" --quiet --max-steps "$STEPS" \
    --peak-tflops 1 --set eval.every=0 --set eval.sample_every=0 \
    --set train.checkpoint_every=100000 "$@" >/dev/null 2>&1
  awk '{printf "%.2f %.2f", $1, $2 + $3}' "$tmp/time"
}
printf '%-6s %22s %22s %22s\n' round "off: wall cpu (s)" "tensorboard: wall cpu" "tb + trace: wall cpu"
for r in $(seq "$ROUNDS"); do
  off=$(run --set log.tensorboard=false)
  tb=$(run)
  trace=$(run --trace "$tmp/trace.json")
  printf '%-6s %22s %22s %22s\n' "$r" "$off" "$tb" "$trace"
done
