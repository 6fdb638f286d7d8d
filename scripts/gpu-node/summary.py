"""The GPU node's figures (run.sh's results.jsonl) as one Markdown table.

    python3 summary.py table RESULTS.jsonl
    python3 summary.py quickstart RUN/metrics.jsonl DEVICE   # one JSON line

MFU is against the matrix-product peak `tvq check` measured in the same
run, in the precision of the row (f32 or bf16), so that tvq and PyTorch
are held to one yardstick.
"""

import json
import statistics
import sys


def quickstart(path, device):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    steady = train[min(10, len(train) // 2):]
    final = [r for r in rows if r.get("kind") == "final_eval"]
    print(json.dumps({
        "form": "quickstart", "device": device, "steps": len(train),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady) if steady else None,
        "validation_bits_per_byte": final[-1]["bits_per_byte"] if final else None,
    }))


def pass_of(r):
    """A products line's pass; lines from before the passes were timed are forward ones."""
    return r.get("pass", "forward")


def fmt(x, spec=",.0f"):
    return "-" if x is None else format(x, spec)


def table(path):
    rows = [json.loads(l) for l in open(path) if l.strip().startswith("{")]
    peaks = {}
    for r in rows:
        for p in r.get("peaks", []):
            if p.get("flops_per_s"):
                peaks[p["precision"]] = p["flops_per_s"]

    def mfu(r):
        peak = peaks.get(r.get("precision", "f32"))
        if not (peak and r.get("tokens_per_s") and r.get("flops_per_token")):
            return "-"
        return f"{100 * r['tokens_per_s'] * r['flops_per_token'] / peak:.1f}%"

    def key(r):
        return (r.get("seq_len"), r.get("precision", "f32"))

    torch = {}
    for r in rows:
        if r.get("form") == "torch" and r.get("tokens_per_s"):
            torch[(r["impl"],) + key(r)] = r["tokens_per_s"]

    out = ["| what | T | precision | tokens/s | MFU | tvq / PyTorch eager | tvq / compiled | tvq / SDPA quadratic |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        form = r.get("form")
        if form == "vq" and r.get("part", "").startswith("train"):
            ratios = []
            for impl in ("eager", "compiled", "sdpa"):
                other = torch.get((impl,) + key(r))
                ratios.append(f"{r['tokens_per_s'] / other:.2f}x" if other and r.get("tokens_per_s") else "-")
            kernels = "fused kernels" if r.get("kernels") else "composed"
            out.append(f"| tvq step ({r.get('batch', 1)} row, {r.get('activation_checkpointing', 'none')}, {kernels}) | {r['seq_len']:,} | {r.get('precision')} | "
                       f"{fmt(r.get('tokens_per_s'))} | {mfu(r)} | " + " | ".join(ratios) + " |")
        elif form == "kernels":
            # The model's forward and backward passes, fused and composed:
            # passes only, so not a step, and no ratio to PyTorch's steps.
            units = {"kernels-units": ", tile products on the units",
                     "kernels-slice256": ", slices of 256 value channels"}.get(r.get("part"), "")
            out.append(f"| passes, fused kernels{units} (attention in {r['fused_sublayers']}, quantizer in "
                       f"{r.get('fused_quantizers', 0)} of {r['sublayers']} sublayers; "
                       f"loss diff {r['loss_diff']:.1e}) | {r['seq_len']:,} | {r.get('precision')} | "
                       f"{fmt(r.get('fused_tokens_per_s'))} | - | | | |")
            out.append(f"| passes, composed ops ({r['speedup']:.2f}x slower)" if r["speedup"] >= 1 else
                       f"| passes, composed ops ({1 / r['speedup']:.2f}x faster)")
            out[-1] += f" | {r['seq_len']:,} | {r.get('precision')} | {fmt(r.get('composed_tokens_per_s'))} | - | | | |"
        elif form == "vq" and r.get("part") == "cold-start":
            out.append(f"| the default build's cold start: first step {fmt(r.get('first_step_s'), ',.1f')} s "
                       f"(compiling, autotuning), then | {r['seq_len']:,} | {r.get('precision')} | "
                       f"{fmt(r.get('tokens_per_s'))} | {mfu(r)} | | | |")
        elif form == "vq" and r.get("part") == "first-light":
            out.append(f"| first light: a tiny model's step on {r.get('device')} | {r['seq_len']:,} | {r.get('precision')} | "
                       f"{fmt(r.get('tokens_per_s'))} | - | | | |")
        elif form == "torch":
            note = r.get("skipped") or r.get("error")
            out.append(f"| PyTorch {r['impl']} | {r['seq_len']:,} | {r.get('precision')} | "
                       f"{fmt(r.get('tokens_per_s')) if not note else note} | {mfu(r)} | | | |")
        elif form == "generate":
            out.append(f"| generate after {r['context']:,} tokens | {r['context']:,} | f32 | "
                       f"{fmt(r['prefill_tokens_per_s'])} prefill, {r['per_token_ms']:.2f} ms/token | - | | | |")
        elif form == "quickstart":
            bpb = r.get("validation_bits_per_byte")
            out.append(f"| quick start, {r['steps']} steps on {r['device']} | 256 | f32 | "
                       f"{fmt(r.get('tokens_per_s'))} | - | | | validation {fmt(bpb, '.3f')} bits/byte |")
        elif "checks" in r:
            passed = sum(1 for c in r["checks"] if c["worst"] is None or c["worst"] <= c["tolerance"])
            worst = [c["name"] for c in r["checks"] if not (c["worst"] is None or c["worst"] <= c["tolerance"])]
            shown = ", ".join(f"{p} {v / 1e12:.1f} TFLOP/s" for p, v in peaks.items())
            out.append(f"| tvq check on {r['device']}: {passed} of {len(r['checks'])} passed"
                       f"{' (failed: ' + '; '.join(worst) + ')' if worst else ''} | | | | peaks: {shown} | | | |")
        elif form == "part" and r.get("status") != "passed":
            out.append(f"| part {r['part']}: {r['status']} {r.get('why', '')} | | | | | | | |")
    # Where a profiled step's device time went (`tvq bench step --profile`),
    # the ten largest kernels of each part and length.
    profiled = [r for r in rows if r.get("form") == "profile"]
    for part, t in sorted({(r.get("part", ""), r["seq_len"]) for r in profiled}):
        at = sorted((r for r in profiled if r.get("part", "") == part and r["seq_len"] == t),
                    key=lambda r: -r["seconds"])
        out += ["", f"Profile ({part or 'tvq bench step --profile'}) of a training step at T = {t:,}: "
                    f"{sum(r['launches_per_step'] for r in at):,.0f} launches per step",
                "", "| kernel | launches per step | time per step ms | share |", "|---|---|---|---|"]
        for r in at[:10]:
            kernel = r["kernel"].replace("|", "\\|")  # cubecl's names hold "|"
            out.append(f"| {kernel} | {r['launches_per_step']:,.1f} | {1e3 * r['seconds'] / r['steps']:.3f} | {100 * r['share']:.1f}% |")
    # The model's matrix products at its own shapes: tvq's rate beside
    # PyTorch's (cuBLAS on CUDA) at the same shape and precision.
    mine = [r for r in rows if r.get("form") == "products" and "impl" not in r and "strategy" not in r
            and r.get("flops_per_s")]
    theirs = {}
    for r in rows:
        if r.get("form") == "products" and r.get("impl"):
            theirs[(r["name"], pass_of(r), r["seq_len"], r["precision"], r["impl"])] = r["flops_per_s"]
    if mine:
        out += ["", "Matrix products at the model's shapes (GFLOP/s; tvq against PyTorch's torch.matmul)",
                "", "| product | pass | T | precision | batch x [m, k] x [k, n] | tvq | PyTorch | PyTorch TF32 | tvq / PyTorch |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            at = (r["name"], pass_of(r), r["seq_len"], r["precision"])
            torch_rate = theirs.get(at + ("torch-tf32",)) or theirs.get(at + ("torch",))
            ratio = f"{r['flops_per_s'] / torch_rate:.2f}x" if torch_rate else "-"
            shape = f"{r['batch']:,} x [{r['m']:,}, {r['k']:,}] x [{r['k']:,}, {r['n']:,}]"
            out.append(f"| {r['name']} | {at[1]} | {r['seq_len']:,} | {r['precision']} | {shape} | {r['flops_per_s'] / 1e9:,.1f} | "
                       f"{fmt(theirs.get(at + ('torch',)) and theirs[at + ('torch',)] / 1e9, ',.1f')} | "
                       f"{fmt(theirs.get(at + ('torch-tf32',)) and theirs[at + ('torch-tf32',)] / 1e9, ',.1f')} | {ratio} |")
        # What the products alone cost a VQ step (each product `count`
        # times, in its three passes): a floor under the step's time, tvq's
        # against PyTorch's at the same shapes where it timed every one.
        for t, precision in dict.fromkeys((r["seq_len"], r["precision"]) for r in mine):
            at = [r for r in mine if (r["seq_len"], r["precision"]) == (t, precision) and r["attention"] == "vq"]
            if not at:
                continue
            passes = {pass_of(r) for r in at}
            ours = sum(r["count"] * r["flops"] / r["flops_per_s"] for r in at)
            key = lambda r, impl: (r["name"], pass_of(r), t, precision, impl)
            rates = [theirs.get(key(r, "torch-tf32")) or theirs.get(key(r, "torch")) for r in at]
            line = (f"A VQ step's products at T = {t:,}, {precision} ({', '.join(sorted(passes))}): "
                    f"tvq {1e3 * ours:,.2f} ms")
            if all(rates):
                torch_s = sum(r["count"] * r["flops"] / rate for r, rate in zip(at, rates))
                line += f", PyTorch {1e3 * torch_s:,.2f} ms (tvq / PyTorch {ours / torch_s:.2f}x the time)"
            out += ["", line]
    # Each of cubek's strategies at those shapes (`--strategies`): burn's
    # untuned choice, the fastest strategy whose result agrees with it, and
    # how many strategies ran, disagreed or could not run.
    swept = [r for r in rows if r.get("form") == "products" and "strategy" in r]
    if swept:
        out += ["", "cubek's strategies at the model's shapes (GFLOP/s; `tvq bench products --strategies`; "
                    "agreeing: within 2% of auto's largest entry)",
                "", "| product | pass | T | precision | auto | fastest agreeing | its rate | / auto | / PyTorch "
                    "| ran, disagreed, unavailable |", "|---|---|---|---|---|---|---|---|---|---|"]
        key = lambda r: (r["name"], pass_of(r), r["seq_len"], r["precision"])
        for at in dict.fromkeys(key(r) for r in swept):  # the model's order
            these = [r for r in swept if key(r) == at]
            auto = next((r.get("flops_per_s") for r in these if r["strategy"] == "auto"), None)
            ran = [r for r in these if r["strategy"] != "auto" and r.get("flops_per_s")]
            agree = [r for r in ran if r.get("max_rel_diff", 1) <= 0.02]
            best = max(agree, key=lambda r: r["flops_per_s"], default=None)
            torch_rate = theirs.get(at + ("torch",))
            rate = best and best["flops_per_s"]
            out.append(f"| {at[0]} | {at[1]} | {at[2]:,} | {at[3]} | {fmt(auto and auto / 1e9, ',.1f')} | "
                       f"{best['strategy'] if best else '-'} | {fmt(rate and rate / 1e9, ',.1f')} | "
                       f"{fmt(rate and auto and rate / auto, '.2f')} | {fmt(rate and torch_rate and rate / torch_rate, '.2f')} | "
                       f"{len(ran)}, {len(ran) - len(agree)}, {sum('unavailable' in r for r in these)} |")
    print("\n".join(out))


if __name__ == "__main__":
    if sys.argv[1] == "table":
        table(sys.argv[2])
    elif sys.argv[1] == "quickstart":
        quickstart(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"summary.py: unknown command {sys.argv[1]}")
