"""Finds what tvq's CUDA backend loads at run time, on a machine without a
CUDA toolkit: the driver (libcuda.so.1, from the system), NVRTC (libnvrtc,
which compiles the kernels) and the CUDA headers NVRTC includes, each from
the system's CUDA or else from the wheels of the installed PyTorch
(nvidia/cu13 or nvidia/cuda_*).

    python3 find_cuda.py WORK_DIR

Prints three lines: a one-line summary of what was found, the directories
for LD_LIBRARY_PATH, and the directory for CUDA_PATH (whose include/ holds
cuda_runtime.h). Missing pieces: one line on stderr naming them, exit 1.
WORK_DIR receives links where the pieces must be gathered in one place.
"""

import glob
import importlib.util
import os
import subprocess
import sys

LIB_DIRS = [
    "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/nvidia/lib64",
    "/usr/lib/wsl/lib", "/usr/local/cuda/lib64", "/usr/local/cuda/compat",
]


def ldconfig(name):
    """Paths of `name*` that the dynamic linker's cache knows."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        out = ""
    paths = [l.split("=>")[-1].strip() for l in out.splitlines() if l.strip().startswith(name)]
    for d in LIB_DIRS + os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        if d:
            paths += glob.glob(os.path.join(d, name + "*"))
    return [p for p in paths if os.path.exists(p)]


def wheel_roots():
    """The `nvidia` package directories of the installed CUDA wheels."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations) if spec else []


def main():
    work = os.path.abspath(sys.argv[1])
    missing, said, lib_dirs = [], [], []

    driver = ldconfig("libcuda.so.1") or ldconfig("libcuda.so")
    if driver:
        said.append(f"driver {driver[0]}")
        lib_dirs.append(os.path.dirname(driver[0]))
    else:
        missing.append("the NVIDIA driver's libcuda.so.1")

    roots = wheel_roots()
    nvrtc = ldconfig("libnvrtc.so")
    source = "system"
    if not nvrtc:
        for root in roots:
            nvrtc += glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*"))
        source = "PyTorch's wheels"
    nvrtc = sorted(p for p in nvrtc if "builtins" not in p and "alt" not in os.path.basename(p))
    if nvrtc:
        found = nvrtc[-1]
        said.append(f"NVRTC {found} ({source})")
        # Every name tvq's loader tries (libnvrtc.so, .so.12, .so.13, ...) in one directory.
        links = os.path.join(work, "lib")
        os.makedirs(links, exist_ok=True)
        for name in ["libnvrtc.so"] + [f"libnvrtc.so.{m}" for m in (11, 12, 13)]:
            link = os.path.join(links, name)
            if os.path.lexists(link):
                os.remove(link)
            os.symlink(found, link)
        lib_dirs += [links, os.path.dirname(found)]  # the builtins sit beside it
    else:
        missing.append("NVRTC (libnvrtc.so: a CUDA toolkit, or PyTorch's CUDA wheels)")

    cuda_path = None
    for candidate in [os.environ.get("CUDA_PATH"), "/usr/local/cuda", "/opt/cuda"]:
        if candidate and os.path.exists(os.path.join(candidate, "include", "cuda_runtime.h")):
            cuda_path = candidate
            said.append(f"headers {candidate}/include (system)")
            break
    if cuda_path is None:
        includes = [d for root in roots for d in glob.glob(os.path.join(root, "*", "include"))]
        whole = [d for d in includes if os.path.exists(os.path.join(d, "cuda_runtime.h"))]
        # CUDA 13's wheels hold one toolkit-like tree (nvidia/cu13: include/, lib/).
        complete = [d for d in whole if glob.glob(os.path.join(os.path.dirname(d), "lib", "libnvrtc.so*"))]
        if complete:
            cuda_path = os.path.dirname(complete[0])
        elif whole:
            # CUDA 12's wheels spread the headers over nvidia/*/include: one
            # include/ of links to all of them.
            cuda_path = work
            merged = os.path.join(work, "include")
            os.makedirs(merged, exist_ok=True)
            for d in sorted(includes, key=lambda d: d not in whole):
                for entry in os.listdir(d):
                    link = os.path.join(merged, entry)
                    if not os.path.lexists(link):
                        os.symlink(os.path.join(d, entry), link)
        if cuda_path:
            said.append(f"headers {cuda_path}/include (PyTorch's wheels)")
        else:
            missing.append("the CUDA headers (cuda_runtime.h: a CUDA toolkit, or PyTorch's CUDA wheels)")

    if missing:
        print("missing " + "; ".join(missing), file=sys.stderr)
        sys.exit(1)
    print("CUDA: " + ", ".join(said))
    print(":".join(dict.fromkeys(lib_dirs)))
    print(cuda_path)


if __name__ == "__main__":
    main()
