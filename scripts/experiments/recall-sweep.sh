#!/usr/bin/env bash
# Recall accuracy of Transformer-VQ against the quadratic form at equal
# parameters and equal training examples (docs/learning.md, "Recall"):
# for each form (FORMS), number of pairs (PAIRS), example length (LENS) and
# seed (SEEDS), train configs/mqar.toml with those settings, then
# `tvq eval --json` on the validation split. The forms are "quadratic", or
# "vq:S:BIAS[:KEYS]" (S codes, bias toeplitz or xl, window keys quantized
# (default) or exact: model.window_keys). Every other setting is the config's
# (override with EXTRA="--set train.steps=800 ...").
#
#   scripts/experiments/recall-sweep.sh OUT_DIR
#   FORMS="quadratic vq:32:toeplitz vq:128:toeplitz" PAIRS="4 8" LENS="64 256" SEEDS="0 1" \
#     scripts/experiments/recall-sweep.sh runs/recall
#
# FROM=DIR starts each run from the weights of the run of the same form and
# seed in the sweep DIR, whatever its pairs and length (train.init_from; DIR
# must hold one such run): a curriculum of lengths, e.g.
# FROM=runs/recall-t64 LENS=256, or of pairs, e.g. FROM=runs/recall-p8 PAIRS=16.
#
# TVQ_BIN=PATH runs that binary instead of building this tree's; the
# results then record TVQ_COMMIT (the commit it was built from) if given,
# else the binary's file name. DEVICE=cuda (or wgpu) trains on that device
# (the evaluation stays on the CPU, so its figures compare with CPU-trained
# runs'); LIMIT=SECONDS stops each training run after that long, as Ctrl-C
# does (a checkpoint, then stop), and evaluates it where it stopped: the
# row's "steps" says how far it got (scripts/experiments/recall-on-gpu.sh).
#
# Writes OUT_DIR/results.jsonl (one line per run: the settings with FROM and
# EXTRA, the device, the steps trained, the window, the accuracy, the
# accuracy by distance and by code sharing (VQ: how many other pairs shared
# a cached answer's code), the validation's accuracy at each evaluation and
# the first step where it reached 90%, the commit) and
# prints a Markdown table, one row per setting, one column per seed: the
# accuracy, in brackets the step where it first reached 90%, and "far", the
# accuracy of the answers further back than the window (two blocks), which
# only the compressed cache can give. A run already in results.jsonl is not
# run again, so an interrupted sweep continues.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: scripts/experiments/recall-sweep.sh OUT_DIR}"
FORMS=${FORMS:-quadratic vq:32:toeplitz vq:128:toeplitz}
PAIRS=${PAIRS:-4}
LENS=${LENS:-64}
SEEDS=${SEEDS:-0 1}
EXTRA=${EXTRA:-}
DEVICE=${DEVICE:-cpu}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tvq/target}"
if [ -n "${TVQ_BIN:-}" ]; then
  tvq="$TVQ_BIN"
  commit="${TVQ_COMMIT:-$(basename "$tvq")}"
else
  cargo build --release -p tvq-cli --quiet
  tvq="$CARGO_TARGET_DIR/release/tvq"
  commit="$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo '+dirty')"
fi
mkdir -p "$out"
results="$out/results.jsonl"
touch "$results"

for form in $FORMS; do
  IFS=: read -r attention codes bias keys <<< "$form"
  set_form=(--set "model.attention=$attention")
  [ -n "${codes:-}" ] && set_form+=(--set "model.n_code=$codes")
  [ -n "${bias:-}" ] && set_form+=(--set "model.bias=$bias")
  [ -n "${keys:-}" ] && set_form+=(--set "model.window_keys=$keys")
  for pairs in $PAIRS; do
    for len in $LENS; do
      for seed in $SEEDS; do
        name="$form-p$pairs-t$len-s$seed"
        if grep -q "\"name\": \"$name\"" "$results"; then continue; fi
        run="$out/$name"
        rm -rf "$run"
        # Examples of `len` tokens, read in segments of at most 256.
        seg=$(( len < 256 ? len : 256 ))
        init=()
        if [ -n "${FROM:-}" ]; then
          sources=("$FROM/$form"-p*-t*-s"$seed")
          if [ "${#sources[@]}" -ne 1 ] || [ ! -d "${sources[0]}" ]; then
            echo "recall-sweep: $name: no single run to start from in $FROM" >&2; continue
          fi
          init=(--set "train.init_from=${sources[0]}")
        fi
        limit=()
        [ -n "${LIMIT:-}" ] && limit=(timeout -s INT --kill-after=60 "$LIMIT")
        status=0
        # shellcheck disable=SC2086
        "${limit[@]}" "$tvq" train --config configs/mqar.toml --run-dir "$run" --quiet --device "$DEVICE" \
          "${set_form[@]}" --set "data.mqar.pairs=$pairs" --set "data.sequence_len=$len" \
          --set "data.update_len=$seg" --set "eval.update_len=$seg" --set "train.seed=$seed" \
          --set "data.mqar.seed=$seed" "${init[@]}" $EXTRA > "$run.log" 2>&1 || status=$?
        # Stopped by LIMIT (timeout's 124) after its checkpoint: evaluated where it stopped.
        if [ $status -ne 0 ] && { [ $status -ne 124 ] || ! grep -q "^stopped at step" "$run.log"; }; then
          echo "recall-sweep: $name failed (see $run.log)" >&2; continue
        fi
        report="$("$tvq" eval --checkpoint "$run" --json 2>/dev/null)"
        python3 - "$name" "$form" "$pairs" "$len" "$seed" "$commit" "$report" "$run" "$DEVICE" \
          "${FROM:-}" "$EXTRA" >> "$results" <<'PY'
import json, re, sys
name, form, pairs, length, seed, commit, report, run, device, start, extra = sys.argv[1:]
r = json.loads(report)
# The validation's accuracy at each evaluation of the run: how soon it learned.
metrics = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
curve = [(m["step"], m["recall"]["accuracy"]) for m in metrics if m.get("kind") == "eval" and "recall" in m]
# The window: the present and the previous block (the run's own block_len).
block = re.search(r"^block_len = (\d+)$", open(f"{run}/config.toml").read(), re.M)
print(json.dumps({"name": name, "form": form, "pairs": int(pairs), "seq_len": int(length),
                  "seed": int(seed), "commit": commit, "device": device,
                  "from": start or None, "extra": extra,
                  "steps": max((m["step"] for m in metrics if m.get("kind") == "train"), default=0),
                  "accuracy": r["recall"]["accuracy"],
                  "loss": r["loss"], "by_distance": r["recall"]["by_distance"],
                  "code_sharing": r["recall"].get("code_sharing", []),
                  "code_sharing_joint": r["recall"].get("code_sharing_joint", []),
                  "window": 2 * int(block.group(1)) if block else None,
                  "steps_to_90": next((s for s, a in curve if a >= 0.9), None),
                  "curve": curve}))
PY
        echo "recall-sweep: $name: accuracy $(python3 -c 'import json,sys; print(round(100*json.loads(sys.argv[1])["recall"]["accuracy"], 2))' "$report")%"
      done
    done
  done
done

python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
seeds = sorted({r["seed"] for r in rows})

def beyond_window(r):
    """The accuracy of the answers in the distance buckets wholly beyond the
    window, where only the compressed cache holds their pair (None without
    a window or such answers; for the quadratic form, the same distances)."""
    far = [b for b in r["by_distance"] if r.get("window") and b["first"] > r["window"]]
    answers = sum(b["answers"] for b in far)
    return sum(b["correct"] for b in far) / answers if answers else None

print("| form | pairs | T | " + " | ".join(f"seed {s}" for s in seeds) + " |")
print("|---|---|---|" + "---|" * len(seeds))
keys = sorted({(r["form"], r["pairs"], r["seq_len"]) for r in rows}, key=lambda k: (k[1], k[2], k[0]))
def cell(r):
    first, far = r.get("steps_to_90"), beyond_window(r)
    return (f"{100 * r['accuracy']:.1f}%" + (f" ({first:,})" if first else "")
            + (f", far {100 * far:.0f}%" if far is not None else ""))

for k in keys:
    by_seed = {r["seed"]: r for r in rows if (r["form"], r["pairs"], r["seq_len"]) == k}
    cells = [cell(by_seed[s]) if s in by_seed else "-" for s in seeds]
    print(f"| {k[0]} | {k[1]} | {k[2]:,} | " + " | ".join(cells) + " |")
PY
