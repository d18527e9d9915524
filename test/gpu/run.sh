#!/usr/bin/env bash
# test/gpu/run.sh - mgpu's checks on a real NVIDIA GPU (not run by CI).
#
#     make build && sudo test/gpu/run.sh [--seconds 10] [--device 0] [--out DIR]
#                                        [--build DIR] [--only PHASES] [--cases LABELS]
#
# Needs root (the enforcer makes read-only region views), an NVIDIA driver
# (nvidia-smi, libcuda.so.1, libnvidia-ml.so.1) and python3 with CUDA torch.
# It starts mgpu-enforcer on the real GPU (backend nvml) under a temporary
# run/state directory and runs, phase by phase (--only a,b: some of them):
#   smoke     torch under the shim: cudaMemGetInfo reports the quota, a matmul runs
#   shares    per policy, PyTorch matmul loops under quotas (mgpu-cli run); each
#             workload's share three ways: tput (its rate / the rate alone),
#             shim (GPU time the shim measured / wall time), pmon (the driver's
#             per-process SM utilisation, nvidia-smi pmon)
#   memory    a 4096 MiB quota: 3000 MiB fits, 5000 MiB is out of memory; every
#             allocation API of mgpu-workload against the real driver
#   backstop  processes that skip the shim (LD_PRELOAD unset, dlmopen): over the
#             memory quota killed; flat-out compute beside a guaranteed 70 killed
#             and the 70 back; a process of no instance logged; fail-closed
#   allowance a tenant that fills its 4096 MiB quota (4000 MiB) while the backstop
#             kills over quota + memory_allowance_mib (512, then 1024): what
#             NVML charges its process beyond what the shim counts
#   launch    host time per tiny kernel launch, alone and under the shim
#   priority  online/offline co-location, online_offline_switch 1 and 2: a
#             torch request server (online, fixed-share core 60, 10 products
#             of n = 4096 every 5 ms) runs throughout; a saturating offline
#             matmul loop is started and killed every second beside it; the
#             server's latency p50/p90/p99 alone and beside (each request on
#             the side it arrived in, 2 x --seconds turns a side), and the
#             offline instance's part of the idle time
#             (--cases fixed-30-70,...: only those share cases; the labels are
#             the first column of the table)
# Workloads measure the same window: they warm up, then start together.
# --out DIR gets summary.txt (what is printed) and logs.tgz (every log).
# Prebuilt binaries: --build DIR with bin/{mgpu-cli,mgpu-enforcer,mgpu-workload}
# and lib/libmgpu-shim.so (default: the repository's build/).
set -uo pipefail

SECS=10
DEVICE=0
OUTDIR=
ONLY=smoke,shares,memory,backstop,allowance,launch,priority
CASES=
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=$root/build
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) SECS=$2; shift 2 ;;
    --device) DEVICE=$2; shift 2 ;;
    --out) OUTDIR=$2; shift 2 ;;
    --build) build=$(cd "$2" && pwd); shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --cases) CASES=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
bin=$build/bin
shim=$build/lib/libmgpu-shim.so
cli=$bin/mgpu-cli
wl=$bin/mgpu-workload
for f in "$cli" "$bin/mgpu-enforcer" "$wl" "$shim"; do
  [ -e "$f" ] || { echo "run.sh: $f is missing; run make build (or --build DIR)" >&2; exit 1; }
done
command -v nvidia-smi >/dev/null || { echo "run.sh: nvidia-smi not found: this needs an NVIDIA driver" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "run.sh: run as root (the enforcer needs CAP_SYS_ADMIN)" >&2; exit 1; }
python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null ||
  { echo "run.sh: python3 with CUDA-enabled torch is needed for the workloads" >&2; exit 1; }

work=$(mktemp -d /tmp/mgpu-gpu-XXXXXX)
summary=$work/summary.txt
enf=
cleanup() {
  stop_enforcer
  pkill -f "$work/" 2>/dev/null
  if [ -n "$OUTDIR" ]; then
    mkdir -p "$OUTDIR"
    cp "$summary" "$OUTDIR/summary.txt"
    tar czf "$OUTDIR/logs.tgz" -C "$work" --exclude='run' --exclude='state' . 2>/dev/null
  fi
  rm -rf "$work"
}
trap cleanup EXIT
say() { echo "$*" | tee -a "$summary"; }
has() { case ",$ONLY," in *",$1,"*) return 0 ;; esac; return 1; }
tl() { python3 "$here/torchload.py" "$@"; }

# start_enforcer POLICY [TOML]: an enforcer on the device with a fresh run dir.
start_enforcer() {
  stop_enforcer
  # RUN_SH_BACKEND=sim: a dry run of this script on the simulated GPU (with a
  # stand-in for torch on PYTHONPATH), to check the script itself.
  cat >"$work/config.toml" <<EOF
version = 1
backend = "${RUN_SH_BACKEND:-nvml}"
run_dir = "$work/run"
state_dir = "$work/state"
[defaults]
compute_policy = "$1"
${2:-}
EOF
  [ "${RUN_SH_BACKEND:-}" = sim ] && printf '[[sim.gpu]]\nname = "Simulated-GPU-80GB"\nmemory_mib = 81920\n' >>"$work/config.toml"
  rm -rf "$work/run" "$work/state"
  echo "=== enforcer $1 $(date +%T.%N)" >>"$work/enforcer.log"
  local from
  from=$(wc -l <"$work/enforcer.log")
  "$bin/mgpu-enforcer" --device "$DEVICE" --config "$work/config.toml" >>"$work/enforcer.log" 2>&1 &
  enf=$!
  for _ in $(seq 200); do
    [ -S "$work/run/gpu$DEVICE/control.sock" ] && return 0
    kill -0 "$enf" 2>/dev/null || break
    sleep 0.05
  done
  say "enforcer did not start; its log:"; tail -n +"$from" "$work/enforcer.log" | head -5 | tee -a "$summary"
  enf=
  return 1
}
stop_enforcer() {
  if [ -n "${enf:-}" ]; then kill "$enf" 2>/dev/null; wait "$enf" 2>/dev/null; fi
  enf=
}
mrun() { # seconds core memory cmd...: mgpu-cli run with the shim, under a timeout
  local t=$1 core=$2 mem=$3; shift 3
  timeout -k 5 "$t" env MGPU_CONFIG="$work/config.toml" "$cli" run --device "$DEVICE" --core "$core" \
    --memory "$mem" --shim "$shim" -- "$@"
}
mrunc() { # class seconds core memory cmd...: mrun with --class, always with & (it execs: $! is timeout's pid)
  local c=$1 t=$2 core=$3 mem=$4; shift 4
  exec timeout -k 5 "$t" env MGPU_CONFIG="$work/config.toml" "$cli" run --device "$DEVICE" --core "$core" \
    --memory "$mem" --class "$c" --shim "$shim" -- "$@"
}
mono() { python3 -c 'import time; print(f"{time.monotonic():.6f}")'; }
# await PIDS -- TEST...: polls TEST every 50 ms, at most 120 s, while every
# process of PIDS (space-separated) runs; succeeds once TEST does.
await() {
  local pids=$1; shift 2
  for _ in $(seq 2400); do
    "$@" && return 0
    for p in $pids; do kill -0 "$p" 2>/dev/null || return 1; done
    sleep 0.05
  done
  return 1
}
all_ready() { local j; for ((j = 0; j < $2; j++)); do [ -e "$1/ready.$j" ] || return 1; done; }
snap() { python3 "$here/report.py" stats "$work/run/gpu$DEVICE/control.sock" >"$1" 2>>"$work/report.err"; }

# ---- facts
{
  echo "== $(date -u +%FT%TZ) $(uname -r)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_mode --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  echo "libraries: $(ldconfig -p | grep -oE '(libcuda|libnvidia-ml)\.so\.1 .*' | tr '\n' ' ') LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
} 2>&1 | tee -a "$summary"

alone=
alone8k=
reference() { # n -> rate alone, no mgpu
  timeout $((SECS + 120)) python3 "$here/torchload.py" matmul --n "$1" --seconds "$SECS" >"$work/alone.$1.$2" 2>&1
  sed -n 's/^rate=\([0-9.]*\).*/\1/p' "$work/alone.$1.$2"
}

# ---- smoke
if has smoke; then
  say "== smoke: torch under the shim (quota 8192 MiB)"
  if start_enforcer fixed-share; then
    mrun 120 100 8192 python3 $here/torchload.py matmul --seconds 2 \
      >"$work/smoke.out" 2>&1
    say "exit $? : $(grep -E 'mem_total|rate=|mgpu:|Error|error' "$work/smoke.out" | head -4 | tr '\n' ' ')"
    stop_enforcer
  fi
fi

# ---- shares
# share_case LABEL POLICY N SPEC... (SPEC core:target, or core:target:idle)
share_case() {
  local label=$1 pol=$2 n=$3; shift 3
  if [ -n "$CASES" ]; then case ",$CASES," in *",$label,"*) ;; *) return 0 ;; esac; fi
  local d=$work/cases/$label
  mkdir -p "$d"
  start_enforcer "$pol" || return
  local pids=() i=0 spec
  for spec in "$@"; do
    local core=${spec%%:*} idle=
    [ "${spec##*:}" = idle ] && idle=--idle
    mrun $((SECS + 150)) "$core" 16384 python3 "$here/torchload.py" matmul --n "$n" --seconds "$SECS" \
      --ready "$d/ready.$i" --go "$d/go" $idle >"$d/out.$i" 2>&1 &
    pids+=($!)
    i=$((i + 1))
  done
  if await "${pids[*]}" -- all_ready "$d" "$i"; then
    timeout $((SECS + 5)) nvidia-smi pmon -s u -d 1 -c "$SECS" >"$d/pmon" 2>&1 &
    local pm=$!
    touch "$d/go"
    sleep 0.5
    snap "$d/stats0"
    sleep "$(awk -v s="$SECS" 'BEGIN { print s - 2 }')"
    snap "$d/stats1"
    wait "$pm" 2>/dev/null
  else
    say "$label: the workloads did not all warm up (one ended, or 120 s passed)"
  fi
  for p in "${pids[@]}"; do wait "$p"; done
  stop_enforcer
  local a=$alone
  [ "$n" = 8192 ] && a=$alone8k
  python3 "$here/report.py" case "$d" "$a" "$@" 2>&1 | tee -a "$summary"
}

if has shares; then
  say "== the matmul alone, without mgpu (${SECS} s windows)"
  alone=$(reference 4096 a)
  case ",${CASES:-n8192}," in *n8192*) alone8k=$(reference 8192 a) ;; esac
  say "alone: n=4096 ${alone:-?} it/s, n=8192 ${alone8k:-?} it/s"
  say "== shares (% of the GPU): tput = rate / rate alone, shim = measured GPU time, pmon = driver SM %"
  share_case fixed-30-70 fixed-share 4096 30:30 70:70
  share_case fixed-30-70-n8192 fixed-share 8192 30:30 70:70
  share_case fixed-20-30-50 fixed-share 4096 20:20 30:30 50:50
  share_case fixed-lone-30 fixed-share 4096 30:30
  share_case guaranteed-30-70 guaranteed-burst-share 4096 30:30 70:70
  share_case guaranteed-30-70idle guaranteed-burst-share 4096 30:100 70:0:idle
  share_case native-1-3 native-burst-share 4096 25:25 75:75
  again=$(reference 4096 b)
  say "alone again at the end: n=4096 ${again:-?} it/s"
fi

# ---- memory
if has memory; then
  say "== memory: a 4096 MiB quota"
  if start_enforcer fixed-share; then
    for mib in 3000 5000; do
      mrun 120 10 4096 python3 $here/torchload.py alloc --mib $mib \
        >"$work/alloc.$mib" 2>&1
      say "torch ${mib} MiB: $(grep -E '^(mem_total|alloc=)|mgpu:' "$work/alloc.$mib" | tr '\n' ' ')"
    done
    say "mgpu-workload, 5 x 1024 MiB under 4096 MiB (resolved as the CUDA runtime does):"
    for api in cuMemAlloc_v2 cuMemAllocPitch_v2 cuMemAllocManaged cuMemAllocAsync cuMemAllocFromPoolAsync cuMemCreate cuArrayCreate_v2 cuArray3DCreate_v2; do
      mrun 60 10 4096 $wl --resolve runtime alloc --api $api --mib 1024 --count 5 --free \
        >"$work/wl.$api" 2>&1
      say "  $api: exit $? $(grep -E '^allocated=|mgpu:|error' "$work/wl.$api" | head -2 | tr '\n' ' ')"
    done
    mrun 60 10 4096 $wl info >"$work/wl.info" 2>&1
    say "  info: $(grep -E 'device.0.(total_mem|mem_total)|nvml.0.(total|used)=' "$work/wl.info" | tr '\n' ' ')"
    stop_enforcer
  fi
fi

# ---- backstop
if has backstop; then
  say "== backstop: processes that skip the shim (memory_allowance_mib 1024, compute_on_violation kill)"
  bs='[backstop]
memory_allowance_mib = 1024
compute_on_violation = "kill"'
  if start_enforcer guaranteed-burst-share "$bs"; then
    for how in unset dlmopen; do
      pre=(env -u LD_PRELOAD "$wl")
      [ "$how" = dlmopen ] && pre=("$wl" --resolve dlmopen)
      t0=$(date +%s.%N)
      mrun 60 10 1024 ${pre[*]} alloc --api cuMemAlloc_v2 --mib 4096 --hold-ms 20000 \
        >"$work/bypass.mem.$how" 2>&1
      rc=$?
      t1=$(date +%s.%N)
      say "  memory bypass ($how), 4096 MiB in a 1024 MiB instance: exit $rc after $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }') s (holds 20 s unless killed): $(grep -E '^alloc 0' "$work/bypass.mem.$how" | head -1)"
    done
    d=$work/cases/bypass-compute
    mkdir -p "$d"
    mrun $((SECS + 150)) 70 16384 python3 "$here/torchload.py" matmul --seconds $((SECS + 6)) \
      --ready "$d/ready.0" --go "$d/go" >"$d/out.0" 2>&1 &
    p70=$!
    await "$p70" -- test -e "$d/ready.0"
    touch "$d/go"
    sleep 3
    t0=$(date +%s.%N)
    mrun $((SECS + 150)) 30 16384 env -u LD_PRELOAD python3 "$here/torchload.py" matmul --seconds "$SECS" >"$d/out.1" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    wait $p70
    say "  compute bypass beside a guaranteed 70: exit $rc after $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }') s (torch start-up included; $SECS s of matmul unless killed)"
    say "  the 70's rate, % of alone (go at 0 s, bypass started at 3 s): $(python3 "$here/report.py" timeline "$d/out.0" "${alone:-1}" 2>&1)"
    timeout 60 python3 "$here/torchload.py" matmul --seconds 3 >"$work/unattributed.out" 2>&1
    say "  a process of no instance: $(grep -c 'kind=unattributed' "$work/enforcer.log") enforcer log lines name it (kind=unattributed)"
    stop_enforcer
    say "  backstop log lines:"
    grep -E 'backstop' "$work/enforcer.log" | cut -c1-300 | tail -12 | tee -a "$summary"
  fi
  timeout 60 env LD_PRELOAD="$shim" MGPU_RUN_DIR="$work/run" python3 "$here/torchload.py" alloc --mib 1 >"$work/failclosed.out" 2>&1
  say "  fail closed (shim, no enforcer): exit $? $(grep -m1 'mgpu:' "$work/failclosed.out")"
fi

# ---- allowance
if has allowance; then
  say "== allowance: 4000 MiB held in a 4096 MiB instance, memory_on_violation kill"
  for allow in 512 1024; do
    start_enforcer fixed-share "[backstop]
memory_allowance_mib = $allow" || continue
    out=$work/allowance.$allow
    mrun 120 10 4096 python3 "$here/torchload.py" alloc --mib 4000 --hold 6 >"$out" 2>&1 &
    p=$!
    await "$p" -- grep -q '^alloc=' "$out"
    sleep 1
    nv=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>&1 | tr '\n' ' ')
    wait $p
    rc=$?
    say "  allowance $allow MiB: exit $rc, $(grep -E '^(alloc|held)=' "$out" | tr '\n' ' ') nvidia-smi: $nv"
    grep -E 'kind=memory' "$work/enforcer.log" | tail -n 2 | cut -c1-300 | tee -a "$summary"
    stop_enforcer
  done
fi

# ---- launch
if has launch; then
  say "== launch: host time per tiny kernel launch (torch x.add_(1)), alone vs under the shim, interleaved"
  if start_enforcer fixed-share; then
    for r in 1 2; do
      a=$(timeout 120 python3 "$here/torchload.py" launches | sed -n 's/^us_per_launch=\([0-9.]*\).*/\1/p')
      s=$(mrun 120 100 8192 python3 $here/torchload.py launches 2>&1 | sed -n 's/^us_per_launch=\([0-9.]*\).*/\1/p')
      say "  run $r: alone ${a:-?} us, shim ${s:-?} us"
    done
    stop_enforcer
  fi
fi
# ---- priority
# priority_case SWITCH: the request server throughout, the offline loop in
# and out every second (the turns are recorded in CLOCK_MONOTONIC seconds,
# the server's clock), two shim snapshots inside each turn beside.
priority_case() {
  local sw=$1 k
  local d=$work/priority/switch$sw turns=$((2 * SECS))
  mkdir -p "$d"
  : >"$d/turns"
  start_enforcer fixed-share "online_offline_switch = $sw" || return
  mrunc online $((turns * 10 + 120)) 60 16384 python3 "$here/torchload.py" serve \
    --seconds $((turns * 10 + 60)) >"$d/serve" 2>&1 &
  local srv=$!
  if ! await "$srv" -- grep -q '^start ' "$d/serve"; then
    say "  switch $sw: the server did not start: $(tail -n 3 "$d/serve" | tr '\n' ' ')"
    stop_enforcer
    return
  fi
  for ((k = 0; k < turns; k++)); do
    local a0 b0 b1 off
    a0=$(mono)
    sleep 1
    echo "alone $a0 $(mono)" >>"$d/turns"
    mrunc offline 300 100 16384 python3 "$here/torchload.py" matmul --seconds 240 \
      --ready "$d/ready.$k" >"$d/offline.$k" 2>&1 &
    off=$!
    if ! await "$off" -- test -e "$d/ready.$k"; then
      say "  switch $sw: the offline loop did not start: $(tail -n 3 "$d/offline.$k" | tr '\n' ' ')"
      kill "$off" 2>/dev/null
      wait "$off" 2>/dev/null
      break
    fi
    snap "$d/stats0.$k"
    b0=$(mono)
    sleep 1
    b1=$(mono)
    snap "$d/stats1.$k"
    kill "$off" 2>/dev/null # timeout passes SIGTERM to mgpu-cli, which passes it on
    wait "$off" 2>/dev/null
    echo "beside $b0 $b1" >>"$d/turns"
  done
  kill "$srv" 2>/dev/null # the server reports what it served
  wait "$srv" 2>/dev/null
  stop_enforcer
  python3 "$here/report.py" priority "$d" "switch $sw" 2>&1 | tee -a "$summary"
}

if has priority; then
  say "== priority: a request server (online, fixed-share 60) alone and beside a saturating offline loop"
  priority_case 1
  priority_case 2
fi

say "== enforcer log: $(grep -ciE 'level=(WARN|ERROR)' "$work/enforcer.log") warnings/errors"
grep -E 'level=(WARN|ERROR)' "$work/enforcer.log" | grep -v backstop | cut -c1-300 | head -8 | tee -a "$summary"
