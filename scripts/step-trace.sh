#!/usr/bin/env bash
# One training step of the benchmark model, as a picture: `tvq bench
# step --trace` on the default model (T = 2,048, batch 4, 2 worker
# threads), without and with full activation checkpointing; the last timed
# step of each trace drawn as a timeline, one row per thread
# (docs/step-trace.png), and each phase's time printed as a Markdown table
# (Python with matplotlib).
#
#   scripts/step-trace.sh [OUT.png] [extra tvq bench flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/step-trace.png}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tvq/target}"
cargo build --release -p tvq-cli >&2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for mode in none full; do
  "$CARGO_TARGET_DIR/release/tvq" bench step --form vq --seq-len 2048 --steps 2 \
    --set train.workers=2 --set "train.activation_checkpointing='$mode'" \
    --trace "$tmp/$mode.json" "${@:2}" >&2
done
python3 - "$tmp" "$OUT" <<'PY'
import json, sys, collections
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

colors = {"step": "#dddddd", "shard": "#bbbbbb", "forward": "#4c72b0",
          "backward": "#dd8452", "recompute": "#c44e52", "all_reduce": "#8172b3",
          "optimizer": "#55a868", "ema": "#937860"}

def last_step(path):
    """The spans (thread, name, begin, end, depth) of the trace's last step."""
    events = [e for e in json.load(open(path)) if e.get("ph") in ("B", "E")]
    spans, stacks = [], collections.defaultdict(list)
    for e in events:
        stack = stacks[e["tid"]]
        if e["ph"] == "B":
            stack.append(e)
        else:
            b = stack.pop()
            spans.append((e["tid"], b["name"], b["ts"], e["ts"], len(stack)))
    t0, t1 = max((s[2], s[3]) for s in spans if s[1] == "step")
    # Parents first, so that the phases inside them are drawn on top.
    inside = sorted((s for s in spans if s[2] >= t0 and s[3] <= t1), key=lambda s: s[4])
    return inside, t0, t1

modes = ["none", "full"]
fig, axes = plt.subplots(2, 1, figsize=(10, 5.2), sharex=True)
for ax, mode in zip(axes, modes):
    spans, t0, t1 = last_step(f"{sys.argv[1]}/{mode}.json")
    threads = sorted({s[0] for s in spans}, key=lambda t: min(s[2] for s in spans if s[0] == t))
    for row, tid in enumerate(threads):
        for _, name, b, e, depth in (s for s in spans if s[0] == tid):
            ax.barh(row, (e - b) / 1e3, left=(b - t0) / 1e3, height=0.8 - 0.15 * depth,
                    color=colors.get(name, "#999999"), edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(threads)), ["main"] + [f"worker {i}" for i in range(1, len(threads))])
    ax.invert_yaxis()
    ax.set_title(f"activation_checkpointing = \"{mode}\": {(t1 - t0) / 1e3:.0f} ms", fontsize=10)

    total = (t1 - t0) / 1e3
    per_thread = collections.defaultdict(lambda: collections.defaultdict(float))
    for tid, name, b, e, _ in spans:
        per_thread[name][tid] += (e - b) / 1e3
    print(f"\nactivation_checkpointing = {mode}\n")
    print(f"| phase | threads | ms per thread | share of the step's {total:.0f} ms |")
    print("|---|---|---|---|")
    for name, by_thread in sorted(per_thread.items(), key=lambda kv: -max(kv[1].values())):
        ms = sum(by_thread.values()) / len(by_thread)
        print(f"| {name} | {len(by_thread)} | {ms:.1f} | {100 * ms / total:.1f}% |")
axes[-1].set_xlabel("milliseconds into the step")
fig.legend(handles=[Patch(color=c, label=n) for n, c in colors.items()],
           loc="lower center", ncol=len(colors), fontsize=8, frameon=False)
fig.suptitle("One training step (tvq bench step --trace, T = 2,048, batch 4, 2 workers)")
fig.tight_layout(rect=(0, 0.05, 1, 1))
fig.savefig(sys.argv[2], dpi=120)
PY
