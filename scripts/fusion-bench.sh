#!/usr/bin/env bash
# Fused against unfused GPU kernels, measured in one run: builds tvq twice
# (the default build, and `--no-default-features`, which leaves out burn's
# `fusion` and `autotune`; in its own target directory so that neither
# build undoes the other), then times the full training step on the same
# wgpu device with each, alternating, and counts the kernels each launches
# per step (cubecl's execution log: the launches of a 3-step benchmark less
# those of a 1-step one, halved, at the first length).
#
#   SEQ_LEN=512,2048 ROUNDS=2 scripts/fusion-bench.sh [extra `tvq bench` arguments]
#
# Default: the benchmark model at T = $SEQ_LEN (512,2048) on wgpu's default
# adapter (Mesa's lavapipe on a machine without a GPU: there only the ratio
# and the kernel counts mean anything), $ROUNDS (2) alternating rounds.
# Writes OUT/results.jsonl and OUT/summary.md (OUT: $FUSION_BENCH_OUT,
# default fusion-bench/).
set -euo pipefail
cd "$(dirname "$0")/.."

out="${FUSION_BENCH_OUT:-fusion-bench}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
results="$out/results.jsonl"
: > "$results"
fused_dir="${CARGO_TARGET_DIR:-$HOME/.cache/tvq/target}"
unfused_dir="${UNFUSED_TARGET_DIR:-$HOME/.cache/tvq/target-unfused}"

echo "fusion-bench: building (fused: $fused_dir, unfused: $unfused_dir)"
CARGO_TARGET_DIR="$fused_dir" cargo build --release --workspace --quiet
CARGO_TARGET_DIR="$unfused_dir" cargo build --release -p tvq-cli --no-default-features --quiet

seq_len="${SEQ_LEN:-512,2048}"
args=(bench step --device wgpu --form vq --json "$@")
rounds="${ROUNDS:-2}"
for round in $(seq "$rounds"); do
  for build in fused unfused; do
    dir="$fused_dir"; [ "$build" = unfused ] && dir="$unfused_dir"
    echo "fusion-bench: round $round, $build"
    "$dir/release/tvq" "${args[@]}" --seq-len "$seq_len" --steps 3 \
      | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l); r['build'] = '$build'; r['round'] = $round; print(json.dumps(r))
" >> "$results"
  done
done

# Kernel launches per step: cubecl logs every launch with profiling at
# level \"minimal\" (a cubecl.toml in the working directory turns it on).
for build in fused unfused; do
  dir="$fused_dir"; [ "$build" = unfused ] && dir="$unfused_dir"
  count_dir="$(mktemp -d)"
  for steps in 1 3; do
    printf '[profiling.logger]\nlevel = "minimal"\nfile = "%s/kernels-%s.log"\nappend = false\n' \
      "$count_dir" "$steps" > "$count_dir/cubecl.toml"
    (cd "$count_dir" && "$dir/release/tvq" "${args[@]}" --seq-len "${seq_len%%,*}" \
      --steps "$steps" > /dev/null)
  done
  python3 - "$count_dir" "$build" >> "$results" <<'EOF'
import json, sys
d, build = sys.argv[1], sys.argv[2]
count = {s: sum(1 for _ in open(f"{d}/kernels-{s}.log")) for s in (1, 3)}
# Both runs time one length after a warm-up step: the second runs 2 more steps.
print(json.dumps({"form": "kernels", "build": build, "per_step": (count[3] - count[1]) / 2}))
EOF
  rm -rf "$count_dir"
done

python3 - "$results" > "$out/summary.md" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
steps = [r for r in rows if r.get("form") == "vq" and "tokens_per_s" in r]
kernels = {r["build"]: r["per_step"] for r in rows if r.get("form") == "kernels"}
device = steps[0]["device"] if steps else "?"
print(f"device: {device}\n")
print("| seq_len | fused tokens/s | unfused tokens/s | fused / unfused |")
print("|---|---|---|---|")
for t in sorted({r["seq_len"] for r in steps}):
    best = {b: max(r["tokens_per_s"] for r in steps if r["seq_len"] == t and r["build"] == b)
            for b in ("fused", "unfused")}
    print(f"| {t} | {best['fused']:,.0f} | {best['unfused']:,.0f} | "
          f"{best['fused'] / best['unfused']:.2f}x |")
if kernels:
    print(f"\nkernel launches per training step (the first length): "
          f"fused {kernels.get('fused', 0):,.0f}, unfused {kernels.get('unfused', 0):,.0f}")
EOF
cat "$out/summary.md"
