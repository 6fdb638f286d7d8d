#!/usr/bin/env bash
# Recall at lengths a model was not trained on (docs/learning.md, "Short
# first"): evaluates trained MQAR runs on the validation examples of each
# length in LENS, with no training at that length. Each run keeps its own
# config (task, pairs, seed), with data.sequence_len set to the length and
# the examples read in segments of at most SEG tokens (default 256). The
# quadratic form keeps no state from one segment to the next, so it sees
# a whole example only with SEG=0 (whole examples; BATCH=N rows per batch
# keeps its [T, T] scores in memory).
#
#   LENS="256 1024 4096" scripts/experiments/recall-lengths.sh OUT.jsonl RUN_DIR...
#
# Appends one JSON line per run and length to OUT.jsonl (the run, the
# length, the segment, the accuracy, the accuracy by distance and, for
# Transformer-VQ, by code sharing (docs/data.md, "Code sharing"); a run,
# length and segment already there are not evaluated again) and prints a
# Markdown table, one row per run, one column per length. TVQ_BIN=PATH runs
# that binary instead of building this tree's. EVAL_FLAGS="--code-limit 4"
# passes flags to `tvq eval` (recorded as "flags"; give each set of flags
# its own OUT.jsonl, as a run and length already there are skipped).
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: scripts/experiments/recall-lengths.sh OUT.jsonl RUN_DIR...}"
shift
[ "$#" -gt 0 ] || { echo "usage: scripts/experiments/recall-lengths.sh OUT.jsonl RUN_DIR..." >&2; exit 2; }
LENS=${LENS:-256 1024 4096}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tvq/target}"
if [ -n "${TVQ_BIN:-}" ]; then
  tvq="$TVQ_BIN"
else
  cargo build --release -p tvq-cli --quiet
  tvq="$CARGO_TARGET_DIR/release/tvq"
fi
mkdir -p "$(dirname "$out")"
touch "$out"
configs="$(mktemp -d)"
trap 'rm -rf "$configs"' EXIT

for run in "$@"; do
  for len in $LENS; do
    seg=${SEG:-256}
    seg=$(( seg == 0 || len < seg ? len : seg ))
    if grep -qF "\"run\": \"$run\", \"seq_len\": $len, \"segment\": $seg," "$out"; then continue; fi
    config="$configs/t$len.toml"
    # The run's config with the length changed: sequence_len in [data],
    # update_len (and batch_size) in [data] and [eval], the only keys of
    # these names.
    sed -e "s/^sequence_len = .*/sequence_len = $len/" -e "s/^update_len = .*/update_len = $seg/" \
      -e "${BATCH:+s/^batch_size = .*/batch_size = $BATCH/}" "$run/config.toml" > "$config"
    # shellcheck disable=SC2086 # EVAL_FLAGS is a list of flags
    report="$("$tvq" eval --checkpoint "$run" --config "$config" --json ${EVAL_FLAGS:-} 2>/dev/null)" ||
      { echo "recall-lengths: $run at $len tokens failed" >&2; continue; }
    python3 - "$run" "$len" "$seg" "$report" "${EVAL_FLAGS:-}" >> "$out" <<'PY'
import json, sys
run, length, segment, report, flags = sys.argv[1:]
r = json.loads(report)["recall"]
row = {"run": run, "seq_len": int(length), "segment": int(segment),
       "accuracy": r["accuracy"], "by_distance": r["by_distance"], "flags": flags}
for key in ("code_sharing", "code_sharing_joint"):
    if key in r:
        row[key] = r[key]
print(json.dumps(row))
PY
    echo "recall-lengths: $run at $len tokens: $(tail -1 "$out" | python3 -c 'import json,sys; print(round(100*json.load(sys.stdin)["accuracy"], 1))')%"
  done
done

python3 - "$out" "$@" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
runs = sys.argv[2:]
lens = sorted({r["seq_len"] for r in rows if r["run"] in runs})
print("| run | " + " | ".join(f"T = {n:,}" for n in lens) + " |")
print("|---|" + "---|" * len(lens))
for run in runs:
    acc = {r["seq_len"]: r["accuracy"] for r in rows if r["run"] == run}
    print(f"| {run} | " + " | ".join(f"{100 * acc[n]:.1f}%" if n in acc else "-" for n in lens) + " |")
PY
