#!/usr/bin/env bash
# The same run writes the same bytes: two quick-start runs of STEPS steps
# with a checkpoint every EVERY, and a third killed with `kill -9` just
# after its first and second checkpoints and resumed each time, must leave
# byte-identical `checkpoints/` trees (sha256 of every file).
#
#   scripts/checkpoint-identity.sh            # STEPS=30 EVERY=10
#
# Env: STEPS, EVERY, CONFIG (configs/quickstart.toml), OUT (a scratch
# directory, default a new one under /var/tmp, removed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-30}
EVERY=${EVERY:-10}
CONFIG=${CONFIG:-configs/quickstart.toml}
OUT=${OUT:-$(mktemp -d /var/tmp/tvq-identity.XXXXXX)}
trap 'rm -rf "$OUT"' EXIT
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tvq/target}"
cargo build --release -p tvq-cli >&2
tvq="$CARGO_TARGET_DIR/release/tvq"
sets=(--set "train.steps=$STEPS" --set "train.checkpoint_every=$EVERY" --set "train.keep_checkpoints=10")

train() { "$tvq" train --config "$CONFIG" --run-dir "$OUT/$1" --quiet "${sets[@]}" "${@:2}" 2>/dev/null; }
tree() { (cd "$OUT/$1/checkpoints" && find . -type f | sort | xargs sha256sum); }

train a >/dev/null
train b >/dev/null
# The third run: killed right after checkpoints EVERY and 2 x EVERY.
for kill_after in "$EVERY" $((2 * EVERY)); do
  resume=()
  if [ -d "$OUT/c" ]; then resume=(--resume); fi
  # tvq itself in the background (not a function's subshell), so that
  # kill -9 reaches it.
  "$tvq" train --config "$CONFIG" --run-dir "$OUT/c" --quiet "${sets[@]}" "${resume[@]}" \
    >/dev/null 2>&1 &
  pid=$!
  manifest=$(printf '%s/c/checkpoints/step-%08d/manifest.json' "$OUT" "$kill_after")
  while [ ! -f "$manifest" ]; do
    kill -0 "$pid" 2>/dev/null || { echo "run c ended before step $kill_after" >&2; exit 1; }
    sleep 0.05
  done
  kill -9 "$pid"
  wait "$pid" 2>/dev/null || true
  echo "run c killed after its checkpoint at step $kill_after" >&2
done
train c --resume >/dev/null

tree a > "$OUT/a.sha256"
echo "run a: $(wc -l < "$OUT/a.sha256") checkpoint files"
for run in b c; do
  if tree "$run" | cmp -s - "$OUT/a.sha256"; then
    echo "run $run: identical to run a"
  else
    echo "run $run: DIFFERS from run a" >&2
    diff <(tree "$run") "$OUT/a.sha256" >&2 || true
    exit 1
  fi
done
