#!/usr/bin/env bash
# A diagnosis on a GPU node: the fused (default) and the unfused build of tvq
# side by side, in one call on the device machine, every part under its own
# limit and the whole under DEADLINE seconds (docs/benchmarks.md, "The second
# run on a GPU"). Run from the repository root, after building dist/probe/
# on the development machine:
#
#   mkdir -p dist/probe
#   strip --strip-debug -o /tmp/f "$CARGO_TARGET_DIR/release/tvq" && xz -6 -T0 -c /tmp/f > dist/probe/tvq-fused.xz
#   CARGO_TARGET_DIR=~/.cache/tvq/target-unfused cargo build --release -p tvq-cli --no-default-features
#   (the same strip and xz of that build, to dist/probe/tvq-unfused.xz)
#
#   OUT=DIR DEADLINE=470 scripts/gpu-node/probe.sh    # DEVICE=cpu: the script's own test
#
# Everything comes back as OUT/r.tgz (the device machine returns few files).
# A: first light (two steps of a tiny model) with both builds at the same
#    time, each with its own kernel cache, while a monitor samples every
#    thread's CPU time and kernel wait, the compile logs and nvidia-smi
#    every 3 s (compiling, or stuck?); gdb stacks at STACK_AT seconds.
# A2: the fused first light again on its warm kernel cache.
# B: with a build that passed (the fused one first): the quick start, the
#    enwik8-width step at T = 8,192 (f32, bf16), tvq check; then the
#    unfused step, for the ratio.
set -uo pipefail
root="$(pwd)"
pack="${OUT:?OUT is the folder to write to}/r.tgz"
deadline="${DEADLINE:-470}"
started=$(date +%s)
work=/tmp/tvq-probe out=/tmp/tvq-probe/res
rm -rf "$work" && mkdir -p "$work" "$out/logs"
left() { echo $(( deadline - ($(date +%s) - started) )); }
note() { echo "[$(( $(date +%s) - started )) s] $*" | tee -a "$out/probe.log"; }

for build in fused unfused; do
  mkdir -p "$work/$build/cache" "$work/$build/cwd"
  xz -dc "dist/probe/tvq-$build.xz" > "$work/$build/tvq" && chmod +x "$work/$build/tvq" &
done
wait
note "unpacked: $(ls -la $work/*/tvq | awk '{print $5, $9}' | tr '\n' ' ')"

device="${DEVICE:-cuda}"
[ "$device" = cuda ] && { found="$(python3 scripts/gpu-node/find_cuda.py "$work/cuda" 2>&1)" || { note "find_cuda: $found"; exit 1; }
note "cuda: $(echo "$found" | sed -n 1p)"
export LD_LIBRARY_PATH="$(echo "$found" | sed -n 2p)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDA_PATH="$(echo "$found" | sed -n 3p)"; }
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
note "tools: gdb=$(command -v gdb || echo none) eu-stack=$(command -v eu-stack || echo none) nproc=$(nproc)"

# run BUILD NAME LIMIT ARGS...: the build's tvq in its own working directory
# (its cubecl.toml logs every compiled kernel) and kernel cache.
run() {
  local build="$1" name="$2" limit="$3"; shift 3
  local cwd="$work/$build/cwd" t0=$(date +%s) status
  printf '[compilation.logger]\nlevel = "basic"\nfile = "%s"\n[autotune.logger]\nlevel = "minimal"\nfile = "%s"\n' \
    "$out/logs/$build-kernels.log" "$out/logs/$build-autotune.log" > "$cwd/cubecl.toml"
  note "$build $name: start (limit $limit s)"
  (cd "$cwd" && XDG_CACHE_HOME="$work/$build/cache" timeout --kill-after=5 "$limit" \
    "$work/$build/tvq" "$@" > "$out/logs/$build-$name.log" 2>&1)
  status=$?
  note "$build $name: exit $status after $(( $(date +%s) - t0 )) s; $(grep -c . "$out/logs/$build-kernels.log" 2>/dev/null || echo 0) kernel-log lines; last: $(tail -c 300 "$out/logs/$build-$name.log" | tr '\n' ' ')"
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
            lines.append(f"{exe.split('/')[-2]} pid {pid}: {n} threads; busy: {' '.join(busy) or 'none'}")
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
      case "$(readlink "$exe")" in "$work"/*/tvq) ;; *) continue ;; esac
      pid="${exe#/proc/}" pid="${pid%/exe}"
      timeout 30 gdb -batch -p "$pid" -ex "thread apply all bt 30" > "$out/logs/stacks-$at-$pid.txt" 2>&1
    done
  done
}
stacks & stacker=$!

tiny=(bench step --device "$device" --json --batch 1 --form vq --precision f32 --steps 1 --seq-len 512
  --set model.d_model=64 --set model.d_k=16 --set model.d_v=64 --set model.n_code=16
  --set model.block_len=64 --set model.n_layer=1)
first=${FIRST_S:-200}
ok_fused=1 ok_unfused=1
run fused first-light "$first" "${tiny[@]}" & pf=$!
run unfused first-light "$first" "${tiny[@]}" & pu=$!
wait $pf || ok_fused=0
wait $pu || ok_unfused=0
note "first light: fused $ok_fused, unfused $ok_unfused"

if [ $ok_fused = 1 ]; then
  run fused first-light-warm 45 "${tiny[@]}"
fi
best=""
[ $ok_unfused = 1 ] && best=unfused
[ $ok_fused = 1 ] && best=fused
if [ -n "$best" ]; then
  wide=(bench step --device "$device" --json --batch 1 --form vq --steps 2 --config "$root/configs/enwik8.toml"
    --set model.n_layer=4 --set model.dropout_residual=0 --set model.dropout_layer=0
    --set model.dropout_sinusoid=0 --seq-len 8192)
  [ "$(left)" -gt 60 ] && run "$best" quickstart $(( $(left) > 150 ? 120 : $(left) - 20 )) \
    train --config "$root/configs/quickstart.toml" --device "$device" --run-dir "$work/qs-$best" \
    --max-steps 100 --quiet --set train.workers=1 --set "data.path=$root/data/kjv.txt"
  cp "$work/qs-$best/metrics.jsonl" "$out/quickstart-metrics.jsonl" 2>/dev/null
  [ "$(left)" -gt 60 ] && run "$best" step-8192 $(( $(left) > 130 ? 110 : $(left) - 20 )) \
    "${wide[@]}" --precision f32,bf16
  [ "$(left)" -gt 50 ] && run "$best" check 45 check --device "$device" --json
  if [ "$best" = fused ] && [ $ok_unfused = 1 ] && [ "$(left)" -gt 60 ]; then
    run unfused step-8192 $(( $(left) - 20 )) "${wide[@]}" --precision f32
  fi
fi
kill $monitor $stacker 2>/dev/null
note "done"
# Everything as one file (the device machine returns only a few).
tar -C "$work" -czf "$pack" res
