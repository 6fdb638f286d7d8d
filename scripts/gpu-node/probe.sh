#!/usr/bin/env bash
# A diagnosis on a GPU node: the fused (default) and the unfused build of tvq
# side by side, in one call on the device machine, every part under its own
# limit and the whole under DEADLINE seconds (docs/benchmarks.md, "The second
# run on a GPU" and after). Run from the repository root, after building
# dist/probe/ on the development machine:
#
#   mkdir -p dist/probe
#   strip --strip-debug -o /tmp/f "$CARGO_TARGET_DIR/release/tvq" && xz -6 -T0 -c /tmp/f > dist/probe/tvq-fused.xz
#   CARGO_TARGET_DIR=~/.cache/tvq/target-unfused cargo build --release -p tvq-cli --no-default-features
#   (the same strip and xz of that build, to dist/probe/tvq-unfused.xz)
#
#   OUT=DIR DEADLINE=470 scripts/gpu-node/probe.sh    # DEVICE=cpu: the script's own test
#   # the next session's: the default build's first step at enwik8 widths
#   OUT=DIR DEADLINE=560 FIRST=fused CHECK=fused FUSED=fused WIDE_FIRST=1 FIRST_S=480 scripts/gpu-node/probe.sh
#
# Variants: a build dist/probe/tvq-NAME.xz is variant NAME, and NAME-min is
# that build with cubecl's autotuning at its `minimal` level (which only
# buckets matrix shapes more coarsely); each has its own kernel cache.
# Everything comes back as OUT/r.tgz (the device machine returns few files).
# A: first light (scripts/gpu-node/common.sh; with WIDE_FIRST=1 the step
#    of B instead) of every variant in FIRST (default fused fused-min) at
#    the same time, and `tvq check` of CHECK (default unfused), while a
#    monitor samples every thread's CPU time and kernel wait, the compile
#    logs and nvidia-smi every 3 s (compiling, or stuck?); gdb stacks at
#    STACK_AT seconds.
# B: the training step at enwik8 widths, T = 8,192 (f32; bf16 too where
#    fused), of the unfused build and of the first variant in FUSED
#    (default fused-min fused) that passed A, one after the other; then that
#    variant's quick start (100 steps).
set -uo pipefail
root="$(pwd)"
pack="${OUT:?OUT is the folder to write to}/r.tgz"
deadline="${DEADLINE:-470}"
started=$(date +%s)
work=/tmp/tvq-probe out=/tmp/tvq-probe/res
rm -rf "$work" && mkdir -p "$work" "$out/logs"
left() { echo $(( deadline - ($(date +%s) - started) )); }
note() { echo "[$(( $(date +%s) - started )) s] $*" | tee -a "$out/probe.log"; }

for xz in dist/probe/tvq-*.xz; do
  build="$(basename "$xz" .xz)"
  xz -dc "$xz" > "$work/$build" && chmod +x "$work/$build" &
done
wait
note "unpacked: $(ls -la $work/tvq-* | awk '{print $5, $9}' | tr '\n' ' ')"

device="${DEVICE:-cuda}"
. scripts/gpu-node/common.sh
if [ "$device" = cuda ]; then
  use_cuda python3 scripts/gpu-node/find_cuda.py "$work/cuda" || { note "find_cuda: $cuda_found"; exit 1; }
  note "cuda: $cuda_found"
fi
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
note "tools: gdb=$(command -v gdb || echo none) eu-stack=$(command -v eu-stack || echo none) nproc=$(nproc)"

# run VARIANT NAME LIMIT ARGS...: the variant's tvq in its own working
# directory (its cubecl.toml logs every compiled kernel and autotune result)
# and kernel cache.
run() {
  local variant="$1" name="$2" limit="$3"; shift 3
  local cwd="$work/$variant/cwd" t0=$(date +%s) status level=""
  mkdir -p "$cwd" "$work/$variant/cache"
  case "$variant" in *-min) level="level = \"minimal\"\n" ;; esac
  printf "[compilation.logger]\nlevel = \"basic\"\nfile = \"%s\"\n[autotune]\n${level}[autotune.logger]\nlevel = \"minimal\"\nfile = \"%s\"\n" \
    "$out/logs/$variant-kernels.log" "$out/logs/$variant-autotune.log" > "$cwd/cubecl.toml"
  note "$variant $name: start (limit $limit s)"
  (cd "$cwd" && XDG_CACHE_HOME="$work/$variant/cache" timeout --kill-after=5 "$limit" \
    "$work/tvq-${variant%-min}" "$@" > "$out/logs/$variant-$name.log" 2>&1)
  status=$?
  note "$variant $name: exit $status after $(( $(date +%s) - t0 )) s; $(grep -c . "$out/logs/$variant-kernels.log" 2>/dev/null || echo 0) kernel-log lines; last: $(tail -c 300 "$out/logs/$variant-$name.log" | tr '\n' ' ')"
  return $status
}

python3 - "$out/monitor.log" "$work" "$out/logs" <<'EOF' &
# Every 3 s: per tvq process, the threads that used CPU since the last
# sample (name, state, CPU seconds, kernel wait), the compile logs' sizes and
# the GPU's utilisation and memory.
import glob, os, subprocess, sys, time
log, work, logs = sys.argv[1:]
prev, t0 = {}, time.time()
hz = os.sysconf("SC_CLK_TCK")
with open(log, "w") as f:
    while True:
        lines = [f"--- {time.time() - t0:.0f} s"]
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                exe = os.readlink(f"/proc/{pid}/exe")
            except OSError:
                continue
            if not exe.startswith(work):
                continue
            busy, n = [], 0
            for task in glob.glob(f"/proc/{pid}/task/*"):
                try:
                    stat = open(f"{task}/stat").read()
                    comm = stat[stat.index("(") + 1:stat.rindex(")")]
                    rest = stat[stat.rindex(")") + 2:].split()
                    ticks = int(rest[11]) + int(rest[12])
                    wchan = open(f"{task}/wchan").read().strip()
                except (OSError, ValueError):
                    continue
                n += 1
                d = ticks - prev.get(task, 0)
                prev[task] = ticks
                if d > 0 or rest[0] == "R":
                    busy.append(f"{comm}:{rest[0]}:+{d / hz:.1f}s:{wchan}")
            try:
                variant = os.readlink(f"/proc/{pid}/cwd").split("/")[-2]
            except OSError:
                variant = "?"
            lines.append(f"{variant} pid {pid}: {n} threads; busy: {' '.join(busy) or 'none'}")
        for k in sorted(glob.glob(f"{logs}/*-kernels.log")):
            lines.append(f"{os.path.basename(k)}: {os.path.getsize(k)} bytes")
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=5).stdout.strip()
            lines.append(f"gpu: {smi}")
        except Exception as e:
            lines.append(f"gpu: {e}")
        f.write("\n".join(lines) + "\n")
        f.flush()
        time.sleep(3)
EOF
monitor=$!

# Stacks of whatever is still running at each of STACK_AT seconds, where gdb exists.
stacks() {
  command -v gdb >/dev/null || return 0
  local at
  for at in ${STACK_AT:-90 170}; do
    sleep $(( at - ($(date +%s) - started) > 0 ? at - ($(date +%s) - started) : 0 ))
    for exe in /proc/[0-9]*/exe; do
      case "$(readlink "$exe")" in "$work"/tvq-*) ;; *) continue ;; esac
      pid="${exe#/proc/}" pid="${pid%/exe}"
      timeout 30 gdb -batch -p "$pid" -ex "thread apply all bt 30" > "$out/logs/stacks-$at-$pid.txt" 2>&1
    done
  done
}
stacks & stacker=$!

# The training step at enwik8 widths, T = 8,192.
wide=(bench step --device "$device" --json --batch 1 --form vq --steps 2 --config "$root/configs/enwik8.toml"
  --set model.n_layer=4 --set model.dropout_residual=0 --set model.dropout_layer=0
  --set model.dropout_sinusoid=0 --seq-len 8192)
# A: first lights and checks at once; WIDE_FIRST=1 makes the first light
# that step (f32, bf16), so that autotuning is spent on the shapes timed.
first=("${first_light[@]}" --device "$device")
[ "${WIDE_FIRST:-0}" = 1 ] && first=("${wide[@]}" --precision f32,bf16)
passed=""
pids=()
for variant in ${FIRST-fused fused-min}; do
  (run "$variant" first-light "${FIRST_S:-240}" "${first[@]}" && echo "$variant" >> "$work/passed") &
  pids+=($!)
done
for variant in ${CHECK-unfused}; do
  run "$variant" check 150 check --device "$device" --json & pids+=($!)
done
wait "${pids[@]}"
[ -f "$work/passed" ] && passed="$(tr '\n' ' ' < "$work/passed")"
note "first light passed: ${passed:-none}"

# B: the step at T = 8,192, unfused then the first fused variant that passed.
[ "$(left)" -gt 60 ] && run unfused step-8192 60 "${wide[@]}" --precision f32
fused=""
for variant in ${FUSED-fused-min fused}; do
  case " $passed " in *" $variant "*) fused=$variant; break ;; esac
done
if [ -n "$fused" ]; then
  [ "$(left)" -gt 60 ] && run "$fused" step-8192 $(( $(left) > 200 ? 160 : $(left) - 30 )) \
    "${wide[@]}" --precision f32,bf16
  [ "$(left)" -gt 45 ] && run "$fused" quickstart $(( $(left) > 120 ? 90 : $(left) - 15 )) \
    train --config "$root/configs/quickstart.toml" --device "$device" --run-dir "$work/qs-$fused" \
    --max-steps 100 --quiet --set train.workers=1 --set "data.path=$root/data/kjv.txt"
  cp "$work/qs-$fused/metrics.jsonl" "$out/quickstart-metrics.jsonl" 2>/dev/null
fi
kill $monitor $stacker 2>/dev/null
note "done"
# Everything as one file (the device machine returns only a few).
tar -C "$work" -czf "$pack" res
