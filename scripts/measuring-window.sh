#!/usr/bin/env bash
# How the number of timed steps changes tvq's and torch.compile's tokens/s
# at one sequence length (docs/benchmarks.md, "Outputs written without
# zeroing, SiLU's backward in place, and the script's window"):
#
#   TVQ_PYTHON=path/to/python-with-torch scripts/measuring-window.sh [ROUNDS] [STEPS...]
#
# For each round and each STEPS (default 2 4), tvq bench step and
# scripts/torch_reference.py (torch.compile) in turn, the benchmark model
# of scripts/against-torch.sh (2 rows, 2 threads each) at SEQ_LEN (default
# 512). Prints one JSON line per measurement, then each side's mean.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tvq/target}"
python="${TVQ_PYTHON:-python3}"
rounds="${1:-3}"
shift $(($# > 0 ? 1 : 0))
windows=("$@")
[ ${#windows[@]} -gt 0 ] || windows=(2 4)
seq_len="${SEQ_LEN:-512}"
cargo build --release -p tvq-cli --quiet
tvq="$CARGO_TARGET_DIR/release/tvq"
out="$(mktemp)"
for round in $(seq "$rounds"); do
  for steps in "${windows[@]}"; do
    "$tvq" bench step --json --form vq --batch 2 --set train.workers=2 --steps "$steps" \
      --seq-len "$seq_len" | grep '^{' |
      sed "s/^{/{\"round\": $round, \"steps\": $steps, /" | tee -a "$out"
    "$python" scripts/torch_reference.py bench --widths bench --batch 2 --threads 2 \
      --steps "$steps" --seq-len "$seq_len" --impl compiled --json |
      sed "s/^{/{\"round\": $round, \"steps\": $steps, /" | tee -a "$out"
  done
done
"$python" - "$out" <<'PY'
import json, sys
by = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    side = "tvq" if r["form"] == "vq" else "torch.compile"
    by.setdefault((r["steps"], side), []).append(r["tokens_per_s"])
for steps in sorted({k[0] for k in by}):
    tvq, torch = by.get((steps, "tvq"), []), by.get((steps, "torch.compile"), [])
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    print(f"{steps} steps: tvq {mean(tvq):,.0f}, torch.compile {mean(torch):,.0f}, "
          f"tvq / compiled {sum(tvq) / sum(torch):.2f}x")
PY
