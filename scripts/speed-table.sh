#!/usr/bin/env bash
# Training speed of every position term x cache-gradient mode, optionally
# against another commit in the same run: tokens/s and MFU of the whole
# training step (`tvq bench --form vq --optimizer`) for
# model.bias = toeplitz | xl | rotary and model.cache_grad = window | full
# at each T. With BASE, the binary of commit BASE (built in a temporary
# git worktree that shares the target directory, so only tvq's crates
# rebuild) and the working tree's (or commit NEW's, NEW=<commit> in the
# environment) run alternately, ROUNDS rounds, and the last column is
# new / base of the summed tokens/s. EXTRA: more `tvq bench` arguments
# (e.g. EXTRA="--set train.workers=2").
#
#   scripts/speed-table.sh [BASE] [ROUNDS] [SEQ_LENS] [MODES]
#
#   MODES: space-separated BIAS:CACHE_GRAD pairs (default: all six);
#   "default:default" measures the config's defaults.
#
# Figures are only comparable within one run of the script (the machine is
# shared); the MFU is against the measured matrix peak of this CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:-}
ROUNDS=${2:-2}
SEQ_LENS=${3:-512,2048,8192}
MODES=${4:-toeplitz:window toeplitz:full xl:window xl:full rotary:window rotary:full}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tvq/target}"
tmp=$(mktemp -d)
NEW=${NEW:-}
cleanup() {
  for tree in base new; do git worktree remove --force "$tmp/$tree" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

build() { # DIR OUT: builds tvq from DIR and copies the binary to OUT
  # Every source touched so that cargo compiles this tree's crates and
  # copies out its binary: the trees share one target directory, where a
  # crate's artifacts are named alike in both, so a build that finds them
  # fresh would link the other tree's libraries (touching only main.rs did
  # that to the model, data and train crates).
  find "$1/crates" -name '*.rs' -exec touch {} +
  (cd "$1" && cargo build --release -p tvq-cli >&2)
  cp "$CARGO_TARGET_DIR/release/tvq" "$2"
}
binaries=(new)
if [ -n "$BASE" ]; then
  git worktree add --detach "$tmp/base" "$BASE" >&2
  build "$tmp/base" "$tmp/tvq-base"
  binaries=(base new)
fi
if [ -n "$NEW" ]; then
  git worktree add --detach "$tmp/new" "$NEW" >&2
  build "$tmp/new" "$tmp/tvq-new"
else
  build . "$tmp/tvq-new"
fi
if [ -n "$BASE" ] && cmp -s "$tmp/tvq-base" "$tmp/tvq-new"; then
  echo "speed-table: the two binaries are the same file" >&2
  exit 1
fi

bench() { # BINARY BIAS CACHE -> one JSON line per T
  local set=()
  [ "$2" != default ] && set+=(--set "model.bias=\"$2\"")
  [ "$3" != default ] && set+=(--set "model.cache_grad=\"$3\"")
  # shellcheck disable=SC2086 # EXTRA is split into arguments on purpose
  "$tmp/tvq-$1" bench --form vq --optimizer --json --seq-len "$SEQ_LENS" "${set[@]}" ${EXTRA:-}
}

for r in $(seq "$ROUNDS"); do
  for mode in $MODES; do
    for b in "${binaries[@]}"; do
      bench "$b" "${mode%%:*}" "${mode##*:}" | sed "s/^/$r $b $mode /" >>"$tmp/results"
    done
  done
done

python3 - "$tmp/results" "${binaries[@]}" <<'EOF'
import json, sys
from collections import defaultdict
path, binaries = sys.argv[1], sys.argv[2:]
rows = defaultdict(list)  # (mode, T, binary) -> [(tok/s, mfu)]
for line in open(path):
    r, b, mode, obj = line.split(" ", 3)
    o = json.loads(obj)
    rows[(mode, o["seq_len"], b)].append((o["tokens_per_s"], o.get("mfu")))
keys = sorted({(m, t) for m, t, _ in rows}, key=lambda k: (k[0], k[1]))
head = f"{'bias:cache_grad':<18} {'T':>6}"
for b in binaries:
    head += f" {b + ' tok/s (rounds)':>28} {'mfu':>6}"
if len(binaries) == 2:
    head += f" {'new/base':>9}"
print(head)
for mode, t in keys:
    line = f"{mode:<18} {t:>6}"
    sums = {}
    for b in binaries:
        runs = rows[(mode, t, b)]
        sums[b] = sum(x for x, _ in runs)
        mfus = [m for _, m in runs if m is not None]
        mfu = f"{100 * max(mfus):.0f}%" if mfus else "-"
        line += f" {' / '.join(f'{x:,.0f}' for x, _ in runs):>28} {mfu:>6}"
    if len(binaries) == 2:
        line += f" {sums['new'] / sums['base']:>9.3f}"
    print(line)
EOF
