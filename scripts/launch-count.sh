#!/usr/bin/env bash
# Kernel launches per training step on wgpu, by segment length: cubecl's
# execution log of a 3-step benchmark less a 1-step one (each after one
# warm-up step), halved, once autotuning is cached (a first untimed run of
# each length tunes, so that tuning's trial launches are not counted).
# Each of the two is the fewer lines of two runs: a run that tunes again
# all the same (seen beside a compilation) only adds lines.
#
#   scripts/launch-count.sh [LENGTHS] [extra tvq bench step flags...]
#   scripts/launch-count.sh "2048 8192"
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
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
steps() { # LENGTH STEPS: the number of launches logged
  printf '[profiling.logger]\nlevel = "minimal"\nfile = "%s/log"\nappend = false\n' "$work" > cubecl.toml
  "$bin" bench step --device wgpu --seq-len "$1" --batch 1 --steps "$2" --form vq --json "${@:3}" > /dev/null
  wc -l < log
}
fewer() { echo $(( $1 < $2 ? $1 : $2 )); }
for t in $lens; do
  steps "$t" 1 "$@" > /dev/null # autotuning, cached for the runs below
  one=$(fewer "$(steps "$t" 1 "$@")" "$(steps "$t" 1 "$@")")
  three=$(fewer "$(steps "$t" 3 "$@")" "$(steps "$t" 3 "$@")")
  echo "{\"form\": \"launches\", \"seq_len\": $t, \"per_step\": $(( (three - one) / 2 )), \"one_step_log\": $one, \"three_step_log\": $three}"
done
