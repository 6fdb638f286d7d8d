#!/usr/bin/env bash
# Builds the GPU-node bundle: everything `run.sh` needs on a machine with an
# NVIDIA driver and Python (PyTorch optional) but no Rust and no network.
#
#   scripts/gpu-bundle.sh [OUT_DIR]     # default dist/
#
# TVQ_BIN=PATH bundles that binary instead of building one (the tests use
# their own build); TVQ_BUNDLE_XZ sets xz's level (default -9).
# TVQ_UNFUSED_BIN=PATH adds a build without burn's fusion and autotuning
# (`cargo build --release -p tvq-cli --no-default-features`, in a target
# directory of its own), which starts at once on a fresh GPU node: run.sh
# then times with it and measures the default build's cold start apart.
#
# Writes OUT_DIR/tvq-gpu/ (the folder) and OUT_DIR/tvq-gpu.tar (the same as
# one file): a stripped release `tvq` compressed with xz, the configs, the
# King James Bible corpus, the kernel cache (data/kernel-cache/), the
# Python scripts and run.sh. Fails if the bundle exceeds 40 MiB (56 MiB
# with the unfused build). Copy it to the node, then:
#
#   tar xf tvq-gpu.tar && tvq-gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-dist}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tvq/target}"

bin="${TVQ_BIN:-}"
if [ -z "$bin" ]; then
  cargo build --release -p tvq-cli --quiet
  bin="$CARGO_TARGET_DIR/release/tvq"
fi
bundle="$out/tvq-gpu"
rm -rf "$bundle" "$out/tvq-gpu.tar"
mkdir -p "$bundle/configs" "$bundle/data" "$bundle/scripts"
# Stripped (debug line tables off), then xz: 535 MB -> about 15 MB.
strip -o "$bundle/tvq" "$bin"
xz "${TVQ_BUNDLE_XZ:--9}" -T0 "$bundle/tvq"
limit=40
if [ -n "${TVQ_UNFUSED_BIN:-}" ]; then
  strip -o "$bundle/tvq-unfused" "$TVQ_UNFUSED_BIN"
  xz "${TVQ_BUNDLE_XZ:--9}" -T0 "$bundle/tvq-unfused"
  limit=56
fi
cp configs/*.toml "$bundle/configs/"
cp data/kjv.txt "$bundle/data/"
# The kernel cache of earlier GPU sessions: autotune results and compiled
# kernels (run.sh brings them back, and seeds the node's cache with these).
if [ -d data/kernel-cache ]; then cp -r data/kernel-cache "$bundle/kernel-cache"; fi
cp scripts/gpu-node/run.sh "$bundle/"
cp scripts/gpu-node/common.sh scripts/gpu-node/find_cuda.py scripts/gpu-node/summary.py scripts/torch_reference.py "$bundle/scripts/"
chmod +x "$bundle/run.sh"
{
  echo "tvq GPU bundle"
  echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%MZ) on $(uname -m)"
  echo
  echo "Run ./run.sh (CUDA) or ./run.sh --device cpu --small; ./run.sh --help for options."
} > "$bundle/README.txt"
tar -C "$out" -cf "$out/tvq-gpu.tar" tvq-gpu
size=$(stat -c %s "$out/tvq-gpu.tar")
echo "gpu-bundle: $out/tvq-gpu.tar, $((size / 1024 / 1024)) MiB ($size bytes)"
if [ "$size" -gt $((limit * 1024 * 1024)) ]; then
  echo "gpu-bundle: the bundle is over $limit MiB" >&2
  exit 1
fi
