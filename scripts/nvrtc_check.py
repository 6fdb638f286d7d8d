#!/usr/bin/env python3
"""Compiles CUDA C++ kernels with NVRTC to machine code for one GPU
architecture, as cubecl's CUDA runtime compiles them, and reports what
ptxas says of each: registers, spills, shared memory.

No GPU is needed: NVRTC and CUDA's headers come with PyTorch's CUDA wheels
(`pip install torch`: modules `cuda.bindings`, `nvidia.cu13`, `triton`). The tests
of tvq's fused kernels call it (crates/model/src/kernel/attention.rs) to
prove that their tensor-core form compiles where no GPU is.

    nvrtc_check.py [--arch sm_90a] FILE.cu...

Prints one JSON object per file: {"file", "kernel", "registers",
"spill_stores", "spill_loads", "stack"} (per unit; bytes) from ptxas's
`-v`, "units" (per cube, from `__launch_bounds__`) and "shared" (bytes of
cubecl's dynamic shared memory, from its comments in the source) and, for
sm_90 / sm_90a, "cubes_per_sm": how many cubes an H100 or H200 keeps
resident at once on one multiprocessor, by the CUDA occupancy rules for
compute capability 9.0. Exits 1 after printing NVRTC's log for a file that
does not compile.
"""

import argparse
import json
import os
import re
import sys

from cuda.bindings import nvrtc
import nvidia.cu13
import triton


def check(result):
    """The value of an NVRTC call, or an exit with its error."""
    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        sys.exit(f"NVRTC: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
    return rest[0] if len(rest) == 1 else rest


def include_path():
    """CUDA's headers (mma.h and the crt/ it includes): a toolkit's at
    $CUDA_PATH, as cubecl's runtime takes them, else the CUDA wheel's
    (with `nvidia-cuda-crt`), else the copy Triton ships (a dependency of
    PyTorch's CUDA wheels)."""
    roots = [os.path.join(os.environ.get("CUDA_PATH", "/usr/local/cuda"), "include")]
    roots += [os.path.join(root, "include") for root in nvidia.cu13.__path__]
    roots += [os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")]
    for path in roots:
        if os.path.isfile(os.path.join(path, "crt", "mma.h")):
            return path
    sys.exit(f"no CUDA headers with crt/mma.h in {roots}")


def cubes_per_sm(registers, units, shared):
    """Resident cubes per multiprocessor of compute capability 9.0: 64 K
    registers (256 a warp at a time, 8 a unit), 64 warps, 32 cubes, 228 KiB
    of shared memory with 1 KiB a cube reserved."""
    warps = -(-units // 32)
    per_warp = -(-(-(-registers // 8) * 8 * 32) // 256) * 256
    by_registers = 65536 // (per_warp * warps) if registers else 32
    by_shared = 233472 // (shared + 1024)
    return min(by_registers, 64 // warps, 32, by_shared)


def compile_file(path, arch, include):
    """ptxas's figures for the kernel in `path`, or (None, log)."""
    source = open(path, "rb").read()
    program = check(nvrtc.nvrtcCreateProgram(source, path.encode(), 0, [], []))
    options = [
        f"--gpu-architecture={arch}".encode(),
        f"--include-path={include}".encode(),
        b"--ptxas-options=-v",
        b"-lineinfo",
    ]
    cccl = os.path.join(include, "cccl")
    if os.path.isdir(cccl):
        options.append(f"--include-path={cccl}".encode())
    (err,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
    size = check(nvrtc.nvrtcGetProgramLogSize(program))
    log = b" " * size
    check(nvrtc.nvrtcGetProgramLog(program, log))
    log = log.decode(errors="replace").rstrip("\x00 \n")
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return None, log
    figures = {"file": os.path.basename(path)}
    kernel = re.search(r"Compiling entry function '(\w+)'", log)
    figures["kernel"] = kernel.group(1) if kernel else None
    for key, pattern in [
        ("stack", r"(\d+) bytes stack frame"),
        ("spill_stores", r"(\d+) bytes spill stores"),
        ("spill_loads", r"(\d+) bytes spill loads"),
        ("registers", r"Used (\d+) registers"),
    ]:
        found = re.search(pattern, log)
        figures[key] = int(found.group(1)) if found else 0
    text = source.decode(errors="replace")
    bounds = re.search(r"__launch_bounds__\((\d+)\)", text)
    figures["units"] = int(bounds.group(1)) if bounds else None
    figures["shared"] = sum(int(b) for b in re.findall(r"Shared array size: \d+, (\d+) bytes", text))
    if arch in ("sm_90", "sm_90a") and figures["units"]:
        figures["cubes_per_sm"] = cubes_per_sm(figures["registers"], figures["units"], figures["shared"])
    return figures, log


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="CUDA C++ sources")
    parser.add_argument("--arch", default="sm_90a", help="GPU architecture (sm_90a: H100)")
    args = parser.parse_args()
    include = include_path()
    failed = False
    for path in args.files:
        figures, log = compile_file(path, args.arch, include)
        if figures is None:
            print(f"{path} does not compile for {args.arch}:\n{log}", file=sys.stderr)
            failed = True
        else:
            print(json.dumps(figures), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
