#!/usr/bin/env bash
# Kernel launches per training step on wgpu, by segment length: the
# launches of `tvq bench step --profile`'s timed steps (after its warm-up
# step, which tunes), summed over kernels. `--profile` waits for cubecl's
# log to settle; the length of a plain run's log is not a count, since the
# process can exit before cubecl's logging thread has written all of it.
#
#   scripts/launch-count.sh [LENGTHS] [extra tvq bench step flags...]
#   scripts/launch-count.sh "2048 8192" --set 'train.kernels="fused"'
#
# TVQ_BIN=PATH uses that binary (default: target/release/tvq, built).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tvq/target}"
lens="${1:-2048 8192}"
shift || true
bin="${TVQ_BIN:-}"
if [ -z "$bin" ]; then
  cargo build --release -p tvq-cli --quiet
  bin="$CARGO_TARGET_DIR/release/tvq"
fi
for t in $lens; do
  per_step=$("$bin" bench step --device wgpu --seq-len "$t" --batch 1 --steps 2 --form vq --json --profile "$@" |
    grep -o '"launches_per_step":[0-9.]*' | cut -d: -f2 | awk '{s += $1} END {print s}')
  echo "{\"form\": \"launches\", \"seq_len\": $t, \"per_step\": $per_step}"
done
