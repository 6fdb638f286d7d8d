"""What `transformers` computes with a folder of `tvq export --format hf`,
for crates/cli/tests/cli/hf.rs to hold against tvq: one JSON object on
stdout.

    hf_check.py DIR STREAM.json PROMPT SAVE_DIR

STREAM.json holds tvq's input ids `[T]` and logits `[T, vocab]` of one
stream; PROMPT is a text to continue greedily; SAVE_DIR receives the model
and tokenizer saved again by `transformers` (for `tvq import --hf`).
"""

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is in the folder
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.utils import logging  # noqa: E402

logging.set_verbosity_error()
folder, stream_path, prompt, save_dir = sys.argv[1:5]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
stream = json.load(open(stream_path))
ids = torch.tensor([stream["ids"]])
tvq_logits = torch.tensor(stream["logits"])
out = {}
with torch.no_grad():
    logits = model(ids).logits[0]
    out["logits_max_diff"] = (logits - tvq_logits).abs().max().item()
    # The same stream through the cache: a prompt that ends inside a
    # block, then one token a call.
    first = model.config.block_len + 5
    step = model(ids[:, :first])
    pieces, cache = [step.logits[0]], step.cache
    for i in range(first, ids.shape[1]):
        step = model(ids[:, i:i + 1], cache=cache)
        pieces.append(step.logits[0])
        cache = step.cache
    out["cached_max_diff"] = (torch.cat(pieces) - logits).abs().max().item()
    # Right padding changes nothing before it; left padding is refused.
    pad = torch.zeros(1, 3, dtype=torch.long)
    padded = torch.cat([ids, pad], 1)
    mask = torch.cat([torch.ones_like(ids), pad], 1)
    out["right_padded_max_diff"] = (model(padded, attention_mask=mask).logits[0, :ids.shape[1]] - logits).abs().max().item()
    try:
        model(padded.flip(1), attention_mask=mask.flip(1))
        out["left_padding"] = "accepted"
    except ValueError as e:
        out["left_padding"] = str(e)
encoded = tokenizer(prompt, return_tensors="pt").input_ids
out["prompt_ids"] = encoded[0].tolist()
out["plain_ids"] = tokenizer(prompt, add_special_tokens=False).input_ids
generated = model.generate(encoded, max_new_tokens=64, do_sample=False)
out["greedy"] = tokenizer.decode(generated[0, encoded.shape[1]:], skip_special_tokens=True)
model.save_pretrained(save_dir)
tokenizer.save_pretrained(save_dir)
print(json.dumps(out))
