#!/usr/bin/env bash
# Where a training step's CPU time goes, by op kind: `perf record` on
# `tvq bench step --form vq` for each position term x cache-gradient
# mode at each T, its samples summed by what the sampled function does
# (matrix products, elementwise math, reductions, copies and layout,
# the kernel zeroing pages that the allocator gave back and took again,
# the rest), with the process's system-time share from /usr/bin/time.
# Shares are of all samples of the process, its start and warm-up step
# included.
#
#   scripts/profile-table.sh [SEQ_LENS] [MODES] [STEPS]
#
#   SEQ_LENS: space-separated (default "512 8192"); MODES: BIAS:CACHE_GRAD
#   pairs (default: all six); STEPS: timed steps per setting (default 2).
#
# Prints one JSON object per setting as it goes, then the table of
# docs/benchmarks.md ("By op kind") in Markdown on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ_LENS=${1:-512 8192}
MODES=${2:-toeplitz:window toeplitz:full xl:window xl:full rotary:window rotary:full}
STEPS=${3:-2}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tvq/target}"
cargo build --release -p tvq-cli >&2
tvq="$CARGO_TARGET_DIR/release/tvq"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

for t in $SEQ_LENS; do
  for mode in $MODES; do
    bias=${mode%%:*} cache=${mode##*:}
    /usr/bin/time -f "%U %S" -o "$tmp/time" \
      perf record -q -F 999 -e cpu-clock -o "$tmp/perf.data" -- \
      "$tvq" bench step --form vq --json --seq-len "$t" --steps "$STEPS" \
      --set "model.bias=\"$bias\"" --set "model.cache_grad=\"$cache\"" >"$tmp/bench.json" 2>/dev/null
    perf report -i "$tmp/perf.data" --no-children --sort dso,symbol --stdio -q \
      --percent-limit 0 2>/dev/null >"$tmp/report"
    python3 - "$tmp/report" "$tmp/time" "$tmp/bench.json" "$mode" "$t" <<'PY'
import json, re, sys
report, timing, bench, mode, t = sys.argv[1:]
# First match wins: the order puts the specific before the general.
KINDS = [
    ("page zeroing (kernel)", r"^\[kernel"),
    ("matmul", r"gemm"),
    ("gather/scatter", r"gather|scatter|select"),
    ("copy/layout", r"memmove|memcpy|memset|contiguous|StridedIter|slice|cat"),
    ("exp", r"expf|\bexp"),
    ("elementwise", r"unary|binary|macerator|broadcast|call_mut|mask|cast|zip|map"),
    ("reduce", r"reduce|sum|max|min|cumsum|argm"),
    ("alloc", r"\bmi_|_mi_|malloc|free|alloc"),
]
shares = {k: 0.0 for k, _ in KINDS}
shares["other"] = 0.0
top = []
for line in open(report):
    m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[[.k]\]\s+(.*)", line)
    if not m:
        continue
    pct, dso, sym = float(m.group(1)), m.group(2), m.group(3)
    for kind, pat in KINDS:
        if re.search(pat, dso + " " + sym if kind.endswith("(kernel)") else sym, re.I):
            shares[kind] += pct
            break
    else:
        shares["other"] += pct
        top.append((pct, sym[:70]))
user, system = map(float, open(timing).read().split()[-2:])
b = json.loads(open(bench).read().strip().splitlines()[-1])
row = {"mode": mode, "seq_len": int(t), "tokens_per_s": b["tokens_per_s"], "mfu": b.get("mfu"),
       "system_share": round(system / (user + system), 3), **{k: round(v, 1) for k, v in shares.items()},
       "other_top": sorted(top, reverse=True)[:3]}
print(json.dumps(row))
PY
  done
done | tee "$tmp/rows"

python3 - "$tmp/rows" >&2 <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
kinds = ["page zeroing (kernel)", "matmul", "copy/layout", "elementwise", "exp",
         "gather/scatter", "reduce", "alloc", "other"]
print("| T | bias : cache_grad | tokens/s | " + " | ".join(kinds) + " |")
print("|---|---|---|" + "---|" * len(kinds))
for r in rows:
    shares = " | ".join(f"{r[k]:.0f}%" for k in kinds)
    print(f"| {r['seq_len']:,} | {r['mode'].replace(':', ' : ')} | {r['tokens_per_s']:,.0f} | {shares} |")
PY
