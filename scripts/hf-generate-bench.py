"""Per-token cost of `generate()` on a folder of `tvq export --format hf`
by context length: one JSON line per length. Greedy, one stream, prompts
of random bytes; the time per new token is (time of 1 + N new tokens -
time of 1) / N, so reading the prompt is not in it.

    python3 scripts/hf-generate-bench.py DIR --seq-len 1024,8192,32768 [--new-tokens 64] [--threads 2]
"""

import argparse
import json
import time
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--seq-len", default="1024,8192,32768")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.folder, trust_remote_code=True)
    gen = torch.Generator().manual_seed(0)
    for t in (int(s) for s in args.seq_len.split(",")):
        ids = torch.randint(3, 259, (1, t), generator=gen)
        ids[0, 0] = model.config.eos_token_id

        def timed(n):
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            return time.perf_counter() - start

        timed(1)  # warm-up
        first = timed(1)
        whole = timed(1 + args.new_tokens)
        per_token = (whole - first) / args.new_tokens
        print(json.dumps({"bench": "hf_generate", "seq_len": t, "time_to_first_token_s": round(first, 4),
                          "ms_per_new_token": round(per_token * 1e3, 3), "new_tokens": args.new_tokens,
                          "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
