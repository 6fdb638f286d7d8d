#!/usr/bin/env bash
# One command on a machine with an NVIDIA GPU and its driver: builds tvq,
# runs the GPU tests on CUDA, benchmarks training (VQ and quadratic, 2,048 to
# 32,768 tokens, f32), generation, and 200 quick-start steps on CUDA. Writes
# every measurement to OUT/results.jsonl and a summary table to OUT/summary.md
# (OUT: $GPU_CHECK_OUT, default gpu-check/).
#
#   scripts/gpu-check.sh
#
# Without a GPU it stops at once with one line saying so. Training is
# measured in f32 and bf16, and in every activation checkpointing mode at
# 8,192 and 32,768 tokens (scripts/memory-bench.sh on CUDA; its peak RSS is
# host memory, not the GPU's).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU or driver on this machine (nvidia-smi finds none); nothing to check" >&2
  exit 1
fi

out="${GPU_CHECK_OUT:-gpu-check}"
mkdir -p "$out"
results="$out/results.jsonl"
: > "$results"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tvq/target}"
tvq="$CARGO_TARGET_DIR/release/tvq"

gpu="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
echo "gpu-check: $gpu"
echo "{\"form\": \"gpu\", \"nvidia_smi\": \"$gpu\"}" >> "$results"

echo "gpu-check: building"
cargo build --workspace --release --quiet

echo "gpu-check: tests on CUDA (TVQ_TEST_DEVICE=cuda)"
tests_status=passed
TVQ_TEST_DEVICE=cuda cargo test --workspace --release > "$out/tests.log" 2>&1 || tests_status=FAILED
# A test that skips reads "ok" to cargo: on the GPU machine every skip
# fails the check but two that are not about the GPU under test: a missing
# Python tensorboard package, and the train crate's tests of two wgpu
# devices (placement across devices, which need a Vulkan driver beside
# CUDA's; tvq_testkit::Gpu::missing names them "no wgpu GPU").
skipped=$(grep "SKIPPED" "$out/tests.log" | grep -v -e "Python's tensorboard" -e ": no wgpu GPU" || true)
if [ -n "$skipped" ]; then
  tests_status=FAILED
  echo "gpu-check: tests skipped:" >&2
  echo "$skipped" >&2
fi
echo "{\"form\": \"tests\", \"device\": \"cuda\", \"status\": \"$tests_status\"}" >> "$results"

echo "gpu-check: training throughput"
"$tvq" bench --device cuda --json --optimizer --seq-len 2048,8192,32768 --form vq,quadratic \
  --precision f32,bf16 --max-score-gib 16 >> "$results"
echo "gpu-check: memory by activation checkpointing mode and precision"
DEVICE=cuda SEQ_LENS="8192 32768" scripts/memory-bench.sh >> "$results" || true
# The enwik8 config's widths, as many layers as the GPU holds at 8k tokens.
"$tvq" bench --device cuda --json --optimizer --config configs/enwik8.toml --seq-len 8192 \
  --batch 1 --set model.n_layer=4 --form vq >> "$results" || true

echo "gpu-check: generation"
"$tvq" bench --device cuda --json --generate --seq-len 1024,8192,65536 >> "$results"

echo "gpu-check: 200 quick-start steps"
run="$out/quickstart"
rm -rf "$run"
"$tvq" train --config configs/quickstart.toml --device cuda --run-dir "$run" --max-steps 200 \
  --quiet > "$out/quickstart.log" 2>&1
python3 - "$run/metrics.jsonl" >> "$results" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
train = [r for r in rows if r["kind"] == "train"][10:]
final = [r for r in rows if r["kind"] == "final_eval"]
print(json.dumps({
    "form": "quickstart", "device": "cuda", "steps": 200,
    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train),
    "mfu": statistics.median(r.get("mfu") or 0 for r in train),
    "validation_bits_per_byte": final[-1]["bits_per_byte"] if final else None,
}))
EOF

python3 - "$results" > "$out/summary.md" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| what | seq_len | tokens/s | mfu | note |")
print("|---|---|---|---|---|")
for r in rows:
    form = r.get("form")
    if form in ("vq", "quadratic"):
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        tps = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else r.get("skipped", "-")
        note = f"batch {r['batch']}, {r.get('precision', 'f32')}, {r.get('activation_checkpointing', 'none')}"
        print(f"| train {form} | {r['seq_len']} | {tps} | {mfu} | {note} |")
    elif form == "generate":
        print(f"| generate | {r['context']} | {r['prefill_tokens_per_s']:,.0f} prefill | - | "
              f"{r['per_token_ms']:.2f} ms/token |")
    elif form == "quickstart":
        bpb = r["validation_bits_per_byte"]
        bpb = f"{bpb:.3f}" if bpb is not None else "-"
        print(f"| quick start, 200 steps | 256 | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | "
              f"validation {bpb} bits/byte |")
    else:
        print(f"| {form} | - | - | - | {r.get('nvidia_smi', r.get('status', ''))} |")
EOF
cat "$out/summary.md"
echo "gpu-check: tests $tests_status; results in $results"
[ "$tests_status" = passed ]
