#!/usr/bin/env bash
# tvq's training step against the same model in PyTorch (scripts/torch_reference.py:
# eager and torch.compile) on the CPU, in one run, round by round:
#
#   TVQ_PYTHON=path/to/python-with-torch scripts/against-torch.sh [ROUNDS]
#
# The model is tvq bench's default (d_model 256, d_k 64, d_v 512, 128
# codes, blocks of 128, 2 layers, Toeplitz bias); 2 rows per step; the whole
# step (forward, backward, clipping, AdamW, EMA); tvq on 2 worker threads,
# with its fused kernels (the default) and composed (train.kernels =
# "composed"), PyTorch on 2 threads; STEPS (default 4) timed steps each,
# after tvq's one warm-up step and PyTorch's two (a shorter window reads
# start-up effects, such as the allocator's first purge, as much as the
# step). Prints one JSON line per measurement, then the ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tvq/target}"
python="${TVQ_PYTHON:-python3}"
rounds="${1:-2}"
seq_lens="${SEQ_LENS:-512,2048,8192}"
steps="${STEPS:-4}"
cargo build --release -p tvq-cli --quiet
tvq="$CARGO_TARGET_DIR/release/tvq"
out="$(mktemp)"
for round in $(seq "$rounds"); do
  for kernels in fused composed; do
    "$tvq" bench step --json --form vq --batch 2 --set train.workers=2 --steps "$steps" \
      --set "train.kernels=\"$kernels\"" --seq-len "$seq_lens" |
      sed "s/^{/{\"round\": $round, /" | tee -a "$out"
  done
  "$python" scripts/torch_reference.py bench --widths bench --batch 2 --threads 2 --steps "$steps" \
    --seq-len "$seq_lens" --impl eager,compiled --json | sed "s/^{/{\"round\": $round, /" | tee -a "$out"
done
"$python" - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    if r["form"] == "vq":
        name = "tvq" if r.get("kernels") else "composed"
    else:
        name = r["impl"]
    by.setdefault((name, r["seq_len"]), []).append(r.get("tokens_per_s"))
print("| T | tvq tok/s | tvq composed | PyTorch eager | compiled | tvq / composed | tvq / eager | tvq / compiled |")
print("|---|---|---|---|---|---|---|---|")
for t in sorted({k[1] for k in by}):
    get = lambda n: [x for x in by.get((n, t), []) if x]
    tvq, composed = get("tvq"), get("composed")
    eager, comp = get("eager"), get("compiled")
    fmt = lambda xs: " / ".join(f"{x:,.0f}" for x in xs) or "-"
    ratio = lambda a, b: f"{sum(a) / sum(b):.2f}x" if a and b else "-"
    print(
        f"| {t:,} | {fmt(tvq)} | {fmt(composed)} | {fmt(eager)} | {fmt(comp)} "
        f"| {ratio(tvq, composed)} | {ratio(tvq, eager)} | {ratio(tvq, comp)} |"
    )
PY
