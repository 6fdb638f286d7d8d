#!/usr/bin/env bash
# The three learning-rate schedules as tvq logs them: a short run of a tiny
# model on the quick start's corpus for each of cosine, wsd (linear, sqrt
# and cosine decay) and constant, then the `lr` column of each run's
# metrics.jsonl drawn to docs/schedules.png (Python with matplotlib).
#
#   scripts/schedules.sh [OUT.png]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/schedules.png}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tvq/target}"
cargo build --release -p tvq-cli >&2
tvq="$CARGO_TARGET_DIR/release/tvq"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() {
  "$tvq" train --config configs/quickstart.toml --run-dir "$tmp/$1" --quiet \
    --set model.d_model=16 --set model.d_k=8 --set model.d_v=16 --set model.n_layer=1 \
    --set train.steps=300 --set train.warmup_steps=30 --set eval.every=0 \
    --set train.checkpoint_every=1000 --set "train.schedule=\"$2\"" "${@:3}" >/dev/null 2>&1
}
run cosine cosine
run wsd-linear wsd --set 'train.decay_shape="linear"'
run wsd-sqrt wsd --set 'train.decay_shape="sqrt"'
run wsd-cosine wsd --set 'train.decay_shape="cosine"'
run constant constant
python3 - "$tmp" "$OUT" <<'PY'
import json, sys, pathlib
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
runs, out = pathlib.Path(sys.argv[1]), sys.argv[2]
fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
for name in ["cosine", "wsd-linear", "wsd-sqrt", "wsd-cosine", "constant"]:
    rows = [json.loads(l) for l in (runs / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "train"]
    label = name.replace("wsd-", "wsd, decay_shape = ")
    ax.plot([r["step"] for r in rows], [r["lr"] for r in rows], label=label)
ax.set_xlabel("step (train.steps = 300, warmup_steps = 30, wsd decay_fraction = 0.2)")
ax.set_ylabel("learning rate")
ax.set_title("train.schedule, as logged in metrics.jsonl (lr = 2e-3, lr_floor = 0.1)")
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
fig.tight_layout()
fig.savefig(out)
print(f"wrote {out}")
PY
