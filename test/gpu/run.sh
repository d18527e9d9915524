#!/usr/bin/env bash
# test/gpu/run.sh - mgpu's checks on a real NVIDIA GPU (not run by CI).
#
# On a machine with an NVIDIA driver (and, for the PyTorch workloads, python3
# with torch), from the repository root:
#
#     make build && sudo test/gpu/run.sh [--seconds 20] [--device 0]
#
# It starts mgpu-enforcer on the real GPU (backend nvml) under a temporary
# run/state directory, then, for each policy, runs two or three workloads
# under quotas with `mgpu-cli run` (the shim preloaded in front of the real
# libcuda.so.1) and measures what each achieved:
#   - throughput: iterations per second of each workload, against the same
#     workload alone on the GPU (its share = rate under quota / rate alone);
#   - busy time from NVML (nvidia-smi --query-compute-apps is per process
#     memory; utilization samples are per device, reported for reference);
#   - memory: the allocation over quota must fail with out-of-memory.
# It prints the same target-vs-achieved table as `make demo`.
set -euo pipefail

SECONDS_PER_CASE=20
DEVICE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) SECONDS_PER_CASE=$2; shift 2 ;;
    --device) DEVICE=$2; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build/bin
shim=$root/build/lib/libmgpu-shim.so
for f in "$bin/mgpu-cli" "$bin/mgpu-enforcer" "$shim"; do
  [ -e "$f" ] || { echo "run.sh: $f is missing; run make build" >&2; exit 1; }
done
command -v nvidia-smi >/dev/null || { echo "run.sh: nvidia-smi not found: this needs an NVIDIA driver" >&2; exit 1; }
python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null ||
  { echo "run.sh: python3 with CUDA-enabled torch is needed for the workloads" >&2; exit 1; }

work=$(mktemp -d /tmp/mgpu-gpu-XXXXXX)
cleanup() {
  [ -n "${enf:-}" ] && kill "$enf" 2>/dev/null && wait "$enf" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

# The workload: a matmul loop that prints its iteration rate.
cat >"$work/matmul.py" <<'EOF'
import sys, time, torch
seconds = float(sys.argv[1])
n = 4096
a = torch.randn(n, n, device="cuda", dtype=torch.float16)
b = torch.randn(n, n, device="cuda", dtype=torch.float16)
torch.cuda.synchronize()
t0 = time.time(); it = 0
while time.time() - t0 < seconds:
    for _ in range(8):
        c = a @ b
    torch.cuda.synchronize()
    it += 8
print(f"rate={it / (time.time() - t0):.3f}")
free, total = torch.cuda.mem_get_info()
print(f"mem_total={total} mem_free={free}")
EOF
cat >"$work/oom.py" <<'EOF'
import sys, torch
mib = int(sys.argv[1])
try:
    x = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    print("alloc=ok")
except torch.cuda.OutOfMemoryError:
    print("alloc=oom")
EOF

run_case() { # policy, then core:label pairs
  local pol=$1; shift
  cat >"$work/config.toml" <<EOF
version = 1
backend = "nvml"
run_dir = "$work/run"
state_dir = "$work/state"
[defaults]
compute_policy = "$pol"
EOF
  rm -rf "$work/run" "$work/state"
  "$bin/mgpu-enforcer" --device "$DEVICE" --config "$work/config.toml" 2>"$work/enforcer.log" &
  enf=$!
  for _ in $(seq 100); do [ -S "$work/run/gpu$DEVICE/control.sock" ] && break; sleep 0.1; done
  local pids=() outs=() i=0
  for spec in "$@"; do
    local core=${spec%%:*}
    outs[$i]=$work/out.$pol.$i
    MGPU_CONFIG=$work/config.toml "$bin/mgpu-cli" run --device "$DEVICE" --core "$core" --memory 8192 \
      --shim "$shim" -- python3 "$work/matmul.py" "$SECONDS_PER_CASE" >"${outs[$i]}" 2>&1 &
    pids[$i]=$!
    i=$((i + 1))
  done
  for p in "${pids[@]}"; do wait "$p" || true; done
  kill "$enf"; wait "$enf" 2>/dev/null || true; enf=
  i=0
  for spec in "$@"; do
    local core=${spec%%:*} target=${spec##*:}
    local rate
    rate=$(sed -n 's/^rate=//p' "${outs[$i]}")
    printf '%-24s core %-3s target %5s%%  rate %8s it/s  achieved %6.1f%%\n' "$pol" "$core" "$target" "${rate:-?}" \
      "$(awk -v r="${rate:-0}" -v a="$alone" 'BEGIN { printf "%.1f", a > 0 ? 100 * r / a : 0 }')"
    i=$((i + 1))
  done
}

echo "== the workload alone, without mgpu (reference rate)"
alone=$(python3 "$work/matmul.py" "$SECONDS_PER_CASE" | sed -n 's/^rate=//p')
echo "alone: $alone it/s"

echo "== shares (rate under quota / rate alone)"
run_case fixed-share 30:30 70:70
run_case fixed-share 20:20 30:30 50:50
run_case guaranteed-burst-share 30:30 70:70
run_case native-burst-share 25:25 75:75

echo "== memory quota (4096 MiB): 3000 MiB fits, 5000 MiB does not"
cat >"$work/config.toml" <<EOF
version = 1
backend = "nvml"
run_dir = "$work/run"
state_dir = "$work/state"
EOF
rm -rf "$work/run" "$work/state"
"$bin/mgpu-enforcer" --device "$DEVICE" --config "$work/config.toml" 2>>"$work/enforcer.log" &
enf=$!
for _ in $(seq 100); do [ -S "$work/run/gpu$DEVICE/control.sock" ] && break; sleep 0.1; done
for mib in 3000 5000; do
  printf '%s MiB: ' "$mib"
  MGPU_CONFIG=$work/config.toml "$bin/mgpu-cli" run --device "$DEVICE" --core 10 --memory 4096 --shim "$shim" -- \
    python3 "$work/oom.py" "$mib" 2>&1 | tail -1
done
nvidia-smi --query-gpu=index,name,utilization.gpu,memory.used,memory.total --format=csv
