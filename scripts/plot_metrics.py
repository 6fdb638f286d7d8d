#!/usr/bin/env python3
"""Plot a run's loss curves from metrics.jsonl to a PNG.

    python3 scripts/plot_metrics.py runs/quickstart [--out runs/quickstart/loss.png]

Needs matplotlib (pip install matplotlib). Training bits per byte per step
(thin) and its 25-step moving average, plus the periodic and final
validation bits per byte (points).
"""
import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=pathlib.Path, help="run directory holding metrics.jsonl")
    parser.add_argument("--out", type=pathlib.Path, help="PNG to write (default: RUN_DIR/loss.png)")
    args = parser.parse_args()
    lines = [json.loads(l) for l in (args.run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    train = [m for m in lines if m["kind"] == "train"]
    evals = [m for m in lines if m["kind"] in ("eval", "final_eval")]
    if not train:
        raise SystemExit(f"{args.run_dir}/metrics.jsonl has no training steps")
    steps = [m["step"] for m in train]
    bpb = [m["bits_per_byte"] for m in train]
    window = 25
    smooth = [sum(bpb[max(0, i - window + 1) : i + 1]) / len(bpb[max(0, i - window + 1) : i + 1]) for i in range(len(bpb))]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, bpb, lw=0.5, alpha=0.4, color="tab:blue", label="train (per step)")
    ax.plot(steps, smooth, lw=1.5, color="tab:blue", label=f"train ({window}-step mean)")
    if evals:
        ax.plot([m["step"] for m in evals], [m["bits_per_byte"] for m in evals], "o-", color="tab:red", label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("bits per byte")
    ax.set_title(f"{args.run_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    out = args.out or args.run_dir / "loss.png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
