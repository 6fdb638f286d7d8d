#!/usr/bin/env bash
# tvq on a GPU node without Rust: one command, every part under its own time
# limit. Made by scripts/gpu-bundle.sh; run from the unpacked bundle:
#
#   ./run.sh                      # CUDA: kernels, the step against PyTorch, profile, ...
#   ./run.sh --device cpu --small # every part end to end on the CPU, small
#
# Options: --device cuda|cpu (default cuda), --small (small sizes),
# --out DIR (default ./results), --layers N (layers of the enwik8-width
# model, default 4), --parts LIST (comma separated, default all, in the
# order they run: first-light,kernels,kernels-units,kernels-slice256,train-fused,train,torch,profile,
# profile-composed,profile-toeplitz,train-long,torch-long,cold-start,products,products-torch,
# products-strategies,check,generate,quickstart), --build default|unfused (the build the parts time; default:
# the unfused one where the bundle has it, as it starts at once, while the
# cold-start part times the default build's first step apart),
# --budget SECONDS (the whole run's time, default 450, so that with the binary's unpacking and
# the summary it ends within 8 minutes; 1500 with --small: each part's
# limit is cut to what is left, and a part with less than 15 s left is
# skipped, which is why the parts run in the order a GPU session needs
# them), --pack FILE (the whole OUT directory as one .tar.gz, for a node
# that returns few files). Nothing here builds or downloads anything.
#
# Writes every figure to OUT/results.jsonl, each part's output to
# OUT/logs/PART.log, the kernels cubecl compiled to OUT/logs/kernels.log,
# and the summary table to OUT/summary.md. The first part, first-light, is
# two steps of a tiny model under a generous limit (its kernels are compiled
# and cached for the parts after it); if it fails the other parts are
# skipped, as they would fail the same way. Any other part that fails or
# runs past its limit prints one line and the others go on; the exit status
# is non-zero if any part failed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
device=cuda small=0 out="$here/results" layers=4 pack="" budget="" build=""
parts=first-light,kernels,kernels-units,kernels-slice256,train-fused,train,torch,profile,profile-composed,profile-toeplitz
parts+=,train-long,torch-long,cold-start
parts+=,products,products-torch,products-strategies,check,generate,quickstart
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --small) small=1; shift ;;
    --out) out="$2"; shift 2 ;;
    --layers) layers="$2"; shift 2 ;;
    --parts) parts="$2"; shift 2 ;;
    --pack) pack="$2"; shift 2 ;;
    --budget) budget="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$device" in cuda|cpu) ;; *) echo "run.sh: --device is cuda or cpu, not $device" >&2; exit 2 ;; esac
[ -z "$build" ] && { [ -f "$here/tvq-unfused.xz" ] && build=unfused || build=default; }
case "$build" in
  default) ;;
  unfused) [ -f "$here/tvq-unfused.xz" ] || { echo "run.sh: this bundle has no unfused build" >&2; exit 2; } ;;
  *) echo "run.sh: --build is default or unfused, not $build" >&2; exit 2 ;;
esac
[ -z "$budget" ] && { [ $small = 1 ] && budget=1500 || budget=450; }
case "$budget" in ''|*[!0-9]*) echo "run.sh: --budget is a number of seconds, not $budget" >&2; exit 2 ;; esac
mkdir -p "$out/logs"
out="$(cd "$out" && pwd)"
[ -n "$pack" ] && pack="$(cd "$(dirname "$pack")" && pwd)/$(basename "$pack")"
results="$out/results.jsonl"
# cubecl reads cubecl.toml from the working directory: name every kernel it
# compiles (what a slow or failing first step was doing). tvq keeps compiled
# kernels and autotune results under $XDG_CACHE_HOME/tvq for the next part.
cd "$out"
printf '[compilation.logger]\nlevel = "basic"\nfile = "%s"\n' "$out/logs/kernels.log" > cubecl.toml
# What an earlier GPU session tuned (the repository's data/kernel-cache/,
# shipped in the bundle as kernel-cache/) seeds tvq's cache here, files
# already there kept; what this run tuned comes back in OUT/kernel-cache/,
# to commit there for the next bundle (docs/benchmarks.md, "Kernel caches").
# seed DIR: copies the bundle's kernel cache into DIR (files already there
# kept) and unpacks its compiled kernels (stored as .xz: 126 MB become 4.2).
seed() {
  [ -d "$here/kernel-cache" ] || return 0
  mkdir -p "$1" && cp -rn "$here/kernel-cache/." "$1/" || return 1
  local packed
  find "$1" -name '*.xz' | while read -r packed; do
    [ -e "${packed%.xz}" ] || python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$packed" "${packed%.xz}"
    rm -f "$packed"
  done
}
cache_home="${XDG_CACHE_HOME:-$HOME/.cache}/tvq"
if [ "$device" = cuda ]; then
  seed "$cache_home" && [ -d "$here/kernel-cache" ] && echo "run.sh: kernel cache seeded from the bundle"
fi
: > "$results"
started=$(date +%s)

# --- the binaries: unpacked once, next to this script -------------------------
# unpack NAME: bin/NAME from NAME.xz.
unpack() {
  local bin="$here/bin/$1"
  [ -x "$bin" ] && return 0
  mkdir -p "$here/bin"
  if command -v xz >/dev/null; then
    xz -dc "$here/$1.xz" > "$bin.part"
  else
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$here/$1.xz" "$bin.part"
  fi || { echo "run.sh: cannot unpack $1.xz (needs xz or python3)" >&2; return 1; }
  chmod +x "$bin.part" && mv "$bin.part" "$bin"
}
unpack tvq || exit 1
default_tvq="$here/bin/tvq" tvq="$here/bin/tvq"
if [ "$build" = unfused ]; then
  unpack tvq-unfused || exit 1
  tvq="$here/bin/tvq-unfused"
fi

# --- CUDA: the driver from the system, NVRTC and headers from the system or
# from the installed PyTorch's wheels ------------------------------------------
python="$(command -v python3 || true)"
. "$here/scripts/common.sh"
if [ "$device" = cuda ]; then
  use_cuda "$python" "$here/scripts/find_cuda.py" "$here/cuda" || { echo "run.sh: $cuda_found" >&2; exit 1; }
  echo "run.sh: $cuda_found"
fi
echo "{\"form\": \"node\", \"device\": \"$device\", \"small\": $small, \"build\": \"$build\", \"host\": \"$(hostname)\", \"tvq\": \"$("$tvq" --version)\"}" >> "$results"
if command -v nvidia-smi >/dev/null && [ "$device" = cuda ]; then
  gpu="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
  echo "run.sh: $gpu"
  echo "{\"form\": \"gpu\", \"nvidia_smi\": \"$gpu\"}" >> "$results"
fi

failed=0
# part NAME SECONDS COMMAND...: runs COMMAND under a time limit (cut to what
# is left of the budget), its output to OUT/logs/NAME.log and its JSON lines
# (those starting with {) to the results.
wanted() { case ",$parts," in *",$1,"*) return 0 ;; esac; return 1; }
part() {
  local name="$1" limit="$2"; shift 2
  wanted "$name" || return 0
  local log="$out/logs/$name.log" t0=$(date +%s) status
  rm -f "$log"
  local left=$(( budget - (t0 - started) ))
  if [ $left -lt 15 ]; then
    echo "run.sh: part $name skipped: the ${budget} s budget is spent" >&2
    echo "{\"form\": \"part\", \"part\": \"$name\", \"status\": \"skipped\", \"why\": \"the ${budget} s budget is spent\"}" >> "$results"
    return 0
  fi
  [ "$limit" -gt $left ] && limit=$left
  echo "run.sh: $name (limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  status=$?
  grep '^{' "$log" | sed "s/^{/{\"part\": \"$name\", /" >> "$results" || true
  if [ $status -ne 0 ]; then
    failed=$((failed + 1))
    local why="exit $status"
    [ $status -eq 124 ] && why="over its ${limit} s limit"
    echo "run.sh: part $name FAILED ($why): $(grep -v '^{' "$log" | tail -1 | cut -c1-200)" >&2
    echo "{\"form\": \"part\", \"part\": \"$name\", \"status\": \"failed\", \"why\": \"$why\"}" >> "$results"
  else
    echo "{\"form\": \"part\", \"part\": \"$name\", \"status\": \"passed\", \"seconds\": $(( $(date +%s) - t0 ))}" >> "$results"
  fi
}

# Limits (seconds): first light's from the first run on an H100, where a tiny
# model's first two steps did not end within 45 s (docs/benchmarks.md, "The
# first run on a GPU"); the others sized from FLOP counts; the small CPU
# run's from the 2-core development machine. The budget cuts them further.
# On a fresh node the default (fused, autotuned) build's first light took
# more than 300 s ("The third run on a GPU"), unless the bundle's kernel
# cache spares the tuning: the unfused build times the parts then, and the
# cold-start part gives the default build what is left.
if [ $small = 1 ]; then
  seq_lens=512,1024 long_lens=2048 bench_set=(--set model.d_model=64 --set model.d_k=16
    --set model.d_v=64 --set model.n_code=16 --set model.block_len=64 --set model.n_layer=1)
  gen_lens=256,1024 qs_steps=4
  limit_first=120 limit_check=120 limit_kernels=120 limit_train=120 limit_profile=120 limit_long=60
  limit_torch=400 limit_torch_long=200 limit_cold=120 limit_products=120 limit_strategies=120 limit_generate=60 limit_qs=180
else
  seq_lens=8192,32768 long_lens=131072 bench_set=(--config "$here/configs/enwik8.toml"
    --set "model.n_layer=$layers" --set model.dropout_residual=0 --set model.dropout_layer=0
    --set model.dropout_sinusoid=0)
  gen_lens=1024,8192,65536 qs_steps=200
  limit_first=240 limit_check=60 limit_kernels=90 limit_train=90 limit_profile=45 limit_long=60
  limit_torch=180 limit_torch_long=180 limit_cold=240 limit_products=90 limit_strategies=240 limit_generate=45 limit_qs=60
fi
precisions=f32,bf16
[ "$device" = cpu ] && precisions=f32
first_len="${seq_lens%%,*}" long_precision="${precisions##*,}"

# 0. First light: two steps of a tiny model, where every kernel of a step is
# compiled (NVRTC) and autotuned for the first time.
part first-light "$limit_first" "$tvq" "${first_light[@]}" --device "$device"
if grep -q '"part": "first-light", "status": "failed"' "$results"; then
  echo "run.sh: first light failed, so the other parts are skipped (see $out/logs/first-light.log)" >&2
  parts=none
fi

# 1. The fused attention and quantizer kernels against the composed ops in
# the model's forward and backward passes, f32 (what the kernels cover), on
# the GPU's cubecl backend, with the two ways' loss and gradient apart.
if [ "$device" = cuda ]; then
  part kernels "$limit_kernels" "$tvq" bench kernels --device cuda --json --batch 1 --precision f32 \
    --steps 2 "${bench_set[@]}" --seq-len "$first_len"
  # ... and with the kernels' tile products on the units, not the tensor
  # cores (TVQ_TENSOR_CORES=0): what the tensor cores buy, in the same run.
  part kernels-units "$limit_kernels" env TVQ_TENSOR_CORES=0 "$tvq" bench kernels --device cuda \
    --json --batch 1 --precision f32 --steps 2 "${bench_set[@]}" --seq-len "$first_len"
  # ... and in slices of 256 value channels (TVQ_ATTENTION_SLICE): scores
  # computed twice as often at enwik8's width, in cubes of fewer registers,
  # so twice as many resident (docs/nvrtc-kernels-h100.jsonl).
  part kernels-slice256 "$limit_kernels" env TVQ_ATTENTION_SLICE=256 "$tvq" bench kernels \
    --device cuda --json --batch 1 --precision f32 --steps 2 "${bench_set[@]}" --seq-len "$first_len"
fi

# 2. tvq's training step (forward, backward, clipping, AdamW, EMA), one row
# per step: first on the device's fused kernels, then as a run gets it by
# default (train.kernels "auto": composed on a GPU), f32 and bf16 each (the
# attention kernel computes in f32 under either; bf16 is a GPU's default).
# (--steps is each part's own: clap takes a flag once.)
train=("$tvq" bench step --device "$device" --json --batch 1 --form vq "${bench_set[@]}")
part train-fused "$limit_train" "${train[@]}" --steps 2 --precision "$precisions" --seq-len "$seq_lens" \
  --set 'train.kernels="fused"'
part train "$limit_train" "${train[@]}" --steps 2 --precision "$precisions" --seq-len "$seq_lens"

# 3. The same model in PyTorch (eager, compiled) and the quadratic SDPA
# baseline of the same widths, where PyTorch is installed, at the first
# length (torch.compile's first step takes about 55 s per length and
# precision on an H200).
torch=0
[ -n "$python" ] && "$python" -c "import torch" 2>/dev/null && torch=1
torch_bench=("$python" "$here/scripts/torch_reference.py" bench --device "$device" --json)
[ $small = 1 ] && torch_bench+=(--small) || torch_bench+=(--layers "$layers")
if ! wanted torch; then
  :
elif [ $torch = 1 ]; then
  part torch "$limit_torch" "${torch_bench[@]}" --seq-len "$first_len" --precision "$precisions"
else
  echo "run.sh: part torch skipped: no python3 with torch here" >&2
  echo "{\"form\": \"part\", \"part\": \"torch\", \"status\": \"skipped\"}" >> "$results"
fi

# 4. Where a step's device time goes, by kernel, on the fused kernels at the
# first length, bf16 (cubecl times each launch alone: the profiled step is
# slower).
if [ "$device" = cuda ]; then
  part profile "$limit_profile" "${train[@]}" --precision bf16 --steps 1 --seq-len "$first_len" \
    --set 'train.kernels="fused"' --profile
  # ... and as a run gets it by default (composed, bf16).
  part profile-composed "$limit_profile" "${train[@]}" --precision bf16 --steps 1 \
    --seq-len "$first_len" --profile
  # ... and with the position term a config gets by default (Toeplitz).
  part profile-toeplitz "$limit_profile" "${train[@]}" --precision bf16 --steps 1 \
    --seq-len "$first_len" --set 'model.bias="toeplitz"' --profile
fi

# 5. The longest segments: tvq's step on the fused kernels (which keep no
# score tensor, so no activation checkpointing), then PyTorch compiled at
# the other lengths (the SDPA baseline's step at 131,072 alone would take
# minutes).
part train-long "$limit_long" "${train[@]}" --steps 2 --precision "$long_precision" --seq-len "$long_lens" \
  --set 'train.kernels="fused"'
if [ $torch = 1 ]; then
  part torch-long "$limit_torch_long" "${torch_bench[@]}" --seq-len "${seq_lens#*,},$long_lens" \
    --precision "$long_precision" --impl compiled
fi

# 6. The default build's cold start: its first steps at the first length as
# a run gets them by default, with a kernel cache of its own (seeded from
# the bundle's, as a user's fresh node would be): compiling and autotuning.
# What it tuned comes back in OUT/kernel-cache/, to commit under
# data/kernel-cache/ for the next bundle (docs/benchmarks.md, "Kernel
# caches").
if [ "$device" = cuda ] && [ "$build" != default ]; then
  # (A fresh driver cache too: CUDA keeps what it built from PTX under
  # CUDA_CACHE_PATH, and a fresh node has none.)
  cold="$(mktemp -d)" && seed "$cold/tvq"
  part cold-start "$limit_cold" env XDG_CACHE_HOME="$cold" CUDA_CACHE_PATH="$cold/nv" "$default_tvq" bench step \
    --device cuda --json --batch 1 --form vq --steps 2 "${bench_set[@]}" \
    --precision "$long_precision" --seq-len "$first_len"
  cache_home="$cold/tvq"
fi

# 7. The model's matrix products at its own shapes, at the first length,
# each in the forward pass and as the backward pass's two gradients: tvq's,
# then PyTorch's (cuBLAS on CUDA) at the same shapes, read from tvq's lines.
part products "$limit_products" "$tvq" bench products --device "$device" --json --batch 1 \
  --precision "$precisions" "${bench_set[@]}" --seq-len "$first_len"
if [ $torch = 1 ] && [ -s "$out/logs/products.log" ]; then
  part products-torch "$limit_products" "$python" "$here/scripts/torch_reference.py" products \
    --device "$device" --json --from "$out/logs/products.log"
fi
# ... and each of cubek's strategies that burn's autotuning chooses among,
# bf16 (a GPU run's products), each checked against burn's untuned choice:
# the most a tuned build can reach at each shape (about 25 kernels compiled
# per shape and pass; the lines stream, so a part cut short keeps the
# shapes done, the forward pass's first).
if [ "$device" = cuda ]; then
  part products-strategies "$limit_strategies" "$tvq" bench products --device cuda --json --batch 1 \
    --precision bf16 --strategies "${bench_set[@]}" --seq-len "$first_len"
fi

# 8. The device against the CPU (and its measured peaks, the MFU's yardstick).
part check "$limit_check" "$tvq" check --device "$device" --json

# 9. Generation: time to the first token (block-form prefill) and per token.
part generate "$limit_generate" "$tvq" bench generate --device "$device" --json --seq-len "$gen_lens" --new-tokens 32

# 10. The quick start on the device.
run="$out/quickstart"
rm -rf "$run"
qs=(--set train.workers=1)
[ "$device" = cpu ] && qs=(--set train.workers=2)
[ $small = 1 ] && qs+=(--set eval.segments=1 --set eval.every=1000000 --set eval.sample_every=0)
part quickstart "$limit_qs" "$tvq" train --config "$here/configs/quickstart.toml" --device "$device" \
  --run-dir "$run" --max-steps "$qs_steps" --quiet "${qs[@]}" --set "data.path=$here/data/kjv.txt"
if [ -f "$run/metrics.jsonl" ]; then
  "$python" "$here/scripts/summary.py" quickstart "$run/metrics.jsonl" "$device" >> "$results"
fi

if [ "$device" = cuda ] && [ -d "$cache_home" ]; then
  mkdir -p "$out/kernel-cache" && cp -r "$cache_home/." "$out/kernel-cache/"
fi
"$python" "$here/scripts/summary.py" table "$results" | tee "$out/summary.md"
echo "run.sh: $(( $(date +%s) - started )) s in all; $failed part(s) failed; figures in $results"
if [ -n "$pack" ]; then
  tar -C "$(dirname "$out")" -czf "$pack" "$(basename "$out")" && echo "run.sh: packed into $pack"
fi
[ $failed -eq 0 ]
