#!/usr/bin/env python3
"""Recall by where the symbols come from, after a curriculum that grew the
MQAR vocabulary (docs/learning.md, "Growing the vocabulary with the roles
kept").

With `data.mqar.role_period = P` and `vocab = 2P`, the keys are `1..P/2`
(the first period's, the ones a model trained at `vocab = P` knows) and
`P..3P/2` (new), the values `P/2..P` (known) and `3P/2..2P` (new). This
writes four task files (`tvq eval --task-file`), each example's keys from
one group and values from one, and prints each checkpoint's accuracy on
each:

    scripts/experiments/recall_roles.py OUT_DIR CHECKPOINT...
    PERIOD=64 PAIRS=32 LEN=256 TVQ_BIN=target/release/tvq scripts/experiments/recall_roles.py ...

Examples are every key asked once, at places drawn uniformly from the
query region, as tvq's generator does (with Python's own random numbers:
the examples are not the validation split's). Symbol `s` is token `s + 3`.
"""

import json
import os
import random
import subprocess
import sys


def write_task(path, keys, values, pairs, length, n=256, seed=0):
    """n examples of `pairs` pairs, `length` tokens, as a task file."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            ks = rng.sample(keys, pairs)
            vs = [rng.choice(values) for _ in ks]
            symbols = [0] * length
            for i, (k, v) in enumerate(zip(ks, vs)):
                symbols[2 * i], symbols[2 * i + 1] = k, v
            slots = rng.sample(range((length - 2 * pairs) // 2), pairs)
            answers = []
            for i, slot in enumerate(slots):
                at = 2 * pairs + 2 * slot
                symbols[at], symbols[at + 1] = ks[i], vs[i]
                answers.append({"pos": at + 1, "token": vs[i] + 3, "distance": at - 2 * i})
            answers.sort(key=lambda a: a["pos"])
            f.write(json.dumps({"tokens": [s + 3 for s in symbols], "answers": answers}) + "\n")


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: scripts/experiments/recall_roles.py OUT_DIR CHECKPOINT...")
    out, checkpoints = sys.argv[1], sys.argv[2:]
    period, pairs, length = (int(os.environ.get(k, d)) for k, d in
                             [("PERIOD", 64), ("PAIRS", 32), ("LEN", 256)])
    tvq = os.environ.get("TVQ_BIN", "target/release/tvq")
    half = period // 2
    groups = {
        "keys": {"known": list(range(1, half)), "new": list(range(period, period + half))},
        "values": {"known": list(range(half, period)), "new": list(range(period + half, 2 * period))},
    }
    os.makedirs(out, exist_ok=True)
    tasks = []
    for kg, keys in groups["keys"].items():
        for vg, values in groups["values"].items():
            name = f"keys-{kg}-values-{vg}"
            path = os.path.join(out, name + ".jsonl")
            write_task(path, keys, values, min(pairs, len(keys)), length)
            tasks.append((name, path))
    print("| checkpoint | " + " | ".join(n for n, _ in tasks) + " |")
    print("|---|" + "---|" * len(tasks))
    for ckpt in checkpoints:
        row = []
        for _, path in tasks:
            try:
                res = subprocess.run([tvq, "eval", "--checkpoint", ckpt, "--task-file", path,
                                      "--json"], capture_output=True, text=True)
            except OSError as e:
                sys.exit(f"recall_roles: {tvq} (TVQ_BIN): {e.strerror}")
            if res.returncode != 0:
                last = (res.stderr.strip().splitlines() or ["failed"])[-1]
                sys.exit(f"recall_roles: {ckpt}: {last}")
            row.append(f"{100 * json.loads(res.stdout)['recall']['accuracy']:.1f}%")
        print(f"| {ckpt} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
