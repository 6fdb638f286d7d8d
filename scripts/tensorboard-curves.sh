#!/usr/bin/env bash
# A run's TensorBoard scalars as TensorBoard's own reader (Python's
# `tensorboard` package) finds them in RUN_DIR/tb/, drawn as a grid of the
# dashboard's main charts (docs/tensorboard-quickstart.png for the README).
#
#   scripts/tensorboard-curves.sh RUN_DIR [OUT.png]
set -euo pipefail
RUN=${1:?usage: scripts/tensorboard-curves.sh RUN_DIR [OUT.png]}
OUT=${2:-docs/tensorboard-quickstart.png}
python3 - "$RUN/tb" "$OUT" <<'PY'
import sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
charts = [
    ("bits per byte", ["train/bits_per_byte", "eval/bits_per_byte", "final_eval/bits_per_byte"]),
    ("learning rate", ["train/lr"]),
    ("gradient norm (before clipping)", ["train/grad_norm"]),
    ("codebook usage", ["train/codebook_usage"]),
    ("tokens/s", ["train/tokens_per_s"]),
    ("peak host memory (GiB)", ["train/peak_rss_bytes"]),
]
tags = set(acc.Tags()["scalars"])
fig, axes = plt.subplots(2, 3, figsize=(12, 6))
for ax, (title, series) in zip(axes.flat, charts):
    for tag in (t for t in series if t in tags):
        steps, values = zip(*[(e.step, e.value) for e in acc.Scalars(tag)])
        if tag.endswith("peak_rss_bytes"):
            values = [v / 2**30 for v in values]
        style = {"marker": "o", "linestyle": "-"} if not tag.startswith("train/") else {"linewidth": 0.8}
        ax.plot(steps, values, label=tag, **style)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    if len(series) > 1:
        ax.legend(fontsize=7)
fig.suptitle("/".join(sys.argv[1].rstrip("/").split("/")[-3:]) + ", as TensorBoard's reader finds it")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
PY
