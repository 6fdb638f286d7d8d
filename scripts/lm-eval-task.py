"""Writes data/lm-eval/kjv_verse_ending.jsonl: the local data of the
lm-evaluation-harness task data/lm-eval/kjv_verse_ending.yaml.

Each item is a verse of the test split of data/kjv.txt (its last 5% of
bytes, which tvq never trains on) cut after half of its words: the context
is the reference and the first half, the choices are its true ending and
the endings of three other verses of the split (drawn with a fixed seed),
the gold index where the true one stands.

    python3 scripts/lm-eval-task.py [N]   # N items, default 200
"""

import json
import random
import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
n_items = int(sys.argv[1]) if len(sys.argv) > 1 else 200
data = (root / "data/kjv.txt").read_bytes()
test = data[len(data) * 19 // 20:].decode("utf-8", "replace")
verses = []
for line in test.splitlines()[1:]:  # the first line starts mid-verse
    words = line.split()
    if len(words) >= 8:
        half = len(words) // 2
        verses.append((" ".join(words[:half]), " ".join(words[half:])))
rng = random.Random(0)
chosen = rng.sample(range(len(verses)), n_items)
out = root / "data/lm-eval/kjv_verse_ending.jsonl"
with out.open("w") as f:
    for i in chosen:
        others = rng.sample([j for j in range(len(verses)) if j != i], 3)
        choices = [verses[j][1] for j in others]
        gold = rng.randrange(4)
        choices.insert(gold, verses[i][1])
        f.write(json.dumps({"context": verses[i][0], "choices": choices, "gold": gold}) + "\n")
print(f"wrote {n_items} items to {out.relative_to(root)}")
