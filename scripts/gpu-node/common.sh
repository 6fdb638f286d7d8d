# Sourced by run.sh and probe.sh: what both do the same way on a GPU node.

# use_cuda PYTHON FIND_CUDA_PY WORK_DIR: finds the CUDA driver, NVRTC and
# headers (find_cuda.py), exports LD_LIBRARY_PATH and CUDA_PATH, and sets
# cuda_found to the one-line summary; on failure returns 1 with the reason
# in cuda_found.
use_cuda() {
  local found
  found="$("$1" "$2" "$3" 2>&1)" || { cuda_found="$found"; return 1; }
  # find_cuda.py prints: the one-line summary, then LD_LIBRARY_PATH dirs, then CUDA_PATH.
  cuda_found="$(echo "$found" | sed -n 1p)"
  export LD_LIBRARY_PATH="$(echo "$found" | sed -n 2p)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export CUDA_PATH="$(echo "$found" | sed -n 3p)"
}

# First light: two training steps of a tiny model (T = 512, d = 64, one
# layer), where every kernel of a step is compiled and autotuned for the
# first time. Append --device.
first_light=(bench step --json --batch 1 --form vq --precision f32 --steps 1 --seq-len 512
  --set model.d_model=64 --set model.d_k=16 --set model.d_v=64 --set model.n_code=16
  --set model.block_len=64 --set model.n_layer=1)
