"""lm-evaluation-harness's accuracy on the repository's local task
(data/lm-eval/kjv_verse_ending.yaml) for a folder of `tvq export --format
hf`, beside the same accuracy computed here directly from the model's
log-probabilities, item by item, for crates/cli/tests/cli/hf.rs: one JSON
object.

    lm_eval_check.py DIR OUT_DIR LIMIT   (run from the repository root)
"""

import glob
import json
import os
import subprocess
import sys

folder, out_dir, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
run = subprocess.run(
    [sys.executable, "-m", "lm_eval", "--model", "hf",
     "--model_args", f"pretrained={folder},trust_remote_code=True,add_bos_token=True,dtype=float32",
     "--tasks", "kjv_verse_ending", "--include_path", "data/lm-eval", "--device", "cpu",
     "--batch_size", "8", "--limit", str(limit), "--output_path", out_dir, "--log_samples"],
    env=env, capture_output=True, text=True)
if run.returncode != 0:
    sys.exit(run.stderr[-4000:])
results = glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True)
lm_eval_acc = json.load(open(results[0]))["results"]["kjv_verse_ending"]["acc,none"]
samples = glob.glob(os.path.join(out_dir, "**", "samples_kjv_verse_ending_*.jsonl"), recursive=True)
lm_eval_right = {}
for line in open(samples[0]):
    sample = json.loads(line)
    lm_eval_right[sample["doc_id"]] = bool(sample["acc"])

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
eos = model.config.eos_token_id
right = []
items = [json.loads(line) for line in open("data/lm-eval/kjv_verse_ending.jsonl")][:limit]
with torch.no_grad():
    for item in items:
        context = [eos] + [b + 3 for b in item["context"].encode()]
        scores = []
        for choice in item["choices"]:
            ending = [b + 3 for b in (" " + choice).encode()]
            ids = torch.tensor([context + ending])
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)
            n = len(context)
            scores.append(sum(logp[n - 1 + i, t].item() for i, t in enumerate(ending)))
        right.append(max(range(len(scores)), key=scores.__getitem__) == item["gold"])
agree = sum(lm_eval_right.get(i) == r for i, r in enumerate(right))
print(json.dumps({"lm_eval_acc": lm_eval_acc, "direct_acc": sum(right) / len(right), "items": len(right),
                  "agree": agree}))
