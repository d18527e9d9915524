"""torchload.py - the PyTorch workloads of test/gpu/run.sh (a real GPU only).

    torchload.py matmul [--n 4096] [--seconds 10] [--ready F --go F] [--idle]
    torchload.py alloc --mib N [--hold S]
    torchload.py launches [--n 20000]
    torchload.py serve [--n 4096] [--burst 10] [--period-ms 5] [--seconds 60]

matmul: multiplies two n x n fp16 matrices in batches of 8 (one
synchronisation per batch), prints `progress t= rate=` about every 0.5 s and
`rate=` (iterations per second over the measured window) at the end. With
--ready/--go it warms up (cuBLAS, the first kernels), creates the ready file
and waits for the go file before measuring, so that several workloads measure
the same window. --idle: the same set-up, then it sleeps through the window
without launching (an attached, idle instance).

alloc: one allocation of N MiB with torch.empty; prints `alloc=ok` or
`alloc=oom`, and what cudaMemGetInfo reports; --hold S keeps it S seconds
(then prints `held=S`).

launches: n tiny kernels (x.add_(1)) in a row; prints `us_per_launch=`
(host time per launch, which the shim's launch path is part of).

serve: an inference server's shape. Requests arrive every --period-ms
(open loop: on schedule whether or not the previous one is done); each is
--burst n x n fp16 products and one synchronisation. Three unmeasured
requests warm it up; then it prints `start mono=` (CLOCK_MONOTONIC seconds:
request i arrives at mono + i x period), serves until --seconds pass or
SIGTERM/SIGINT arrives (the request in progress completes), and prints
`requests= p50_us= p90_us= p99_us=` and one `lat_us=` line per request in
arrival order (its latency from its scheduled arrival to its completion).

Every line is `key=value ...`; nothing here knows about mgpu.
"""
import argparse
import os
import signal
import sys
import time


def wait_for(path, limit):
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            print(f"error=no go file {path} after {limit}s", flush=True)
            sys.exit(3)
        time.sleep(0.002)


def meminfo(torch):
    free, total = torch.cuda.mem_get_info()
    print(f"mem_total_mib={total >> 20} mem_free_mib={free >> 20}", flush=True)


def matmul(a):
    import torch

    print(f"pid={os.getpid()}", flush=True)
    n = a.n
    x = torch.randn(n, n, device="cuda", dtype=torch.float16)
    y = torch.randn(n, n, device="cuda", dtype=torch.float16)
    for _ in range(4):
        x @ y
    torch.cuda.synchronize()
    meminfo(torch)
    if a.ready:
        with open(a.ready, "w"):
            pass
    if a.go:
        wait_for(a.go, 300)
    print(f"go_epoch={time.time():.6f}", flush=True)
    if a.idle:
        time.sleep(a.seconds)
        print("idle=done", flush=True)
        return
    t0 = time.monotonic()
    deadline = t0 + a.seconds
    it = 0
    last, last_it = t0, 0
    while True:
        for _ in range(8):
            x @ y
        torch.cuda.synchronize()
        it += 8
        now = time.monotonic()
        if now - last >= 0.5:
            print(f"progress t={now - t0:.3f} rate={(it - last_it) / (now - last):.2f}", flush=True)
            last, last_it = now, it
        if now >= deadline:
            break
    print(f"rate={it / (now - t0):.3f} iterations={it} seconds={now - t0:.3f}", flush=True)


def alloc(a):
    import torch

    meminfo(torch)
    try:
        x = torch.empty(a.mib << 20, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        torch.cuda.synchronize()
        print("alloc=ok", flush=True)
        if a.hold > 0:
            time.sleep(a.hold)
            print(f"held={a.hold}", flush=True)
    except torch.cuda.OutOfMemoryError as e:
        print(f"alloc=oom ({str(e).splitlines()[0][:120]})", flush=True)


def launches(a):
    import torch

    x = torch.zeros(1, device="cuda")
    for _ in range(1000):
        x.add_(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.n):
        x.add_(1)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(f"us_per_launch={1e6 * dt / a.n:.3f} launches={a.n} value={int(x.item())}", flush=True)


def serve(a):
    import torch

    x = torch.randn(a.n, a.n, device="cuda", dtype=torch.float16)
    y = torch.randn(a.n, a.n, device="cuda", dtype=torch.float16)

    def request():
        for _ in range(a.burst):
            x @ y
        torch.cuda.synchronize()

    for _ in range(3):
        request()
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    period = a.period_ms / 1000
    t0 = time.monotonic()
    print(f"start mono={t0:.6f} period_ms={a.period_ms} pid={os.getpid()}", flush=True)
    lat = []
    while not stop:
        arrive = t0 + len(lat) * period
        if arrive >= t0 + a.seconds:
            break
        now = time.monotonic()
        if now < arrive:
            time.sleep(arrive - now)
            if stop:
                break
        request()
        lat.append(time.monotonic() - arrive)
    s = sorted(lat)

    def pct(p):
        return int(1e6 * s[min(len(s), max(1, -(-len(s) * p // 100))) - 1]) if s else 0

    print(f"requests={len(lat)} p50_us={pct(50)} p90_us={pct(90)} p99_us={pct(99)}", flush=True)
    print("\n".join(f"lat_us={int(1e6 * v)}" for v in lat), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("matmul")
    m.add_argument("--n", type=int, default=4096)
    m.add_argument("--seconds", type=float, default=10)
    m.add_argument("--ready")
    m.add_argument("--go")
    m.add_argument("--idle", action="store_true")
    al = sub.add_parser("alloc")
    al.add_argument("--mib", type=int, required=True)
    al.add_argument("--hold", type=float, default=0)
    la = sub.add_parser("launches")
    la.add_argument("--n", type=int, default=20000)
    sv = sub.add_parser("serve")
    sv.add_argument("--n", type=int, default=4096)
    sv.add_argument("--burst", type=int, default=10)
    sv.add_argument("--period-ms", type=float, default=5)
    sv.add_argument("--seconds", type=float, default=60)
    a = p.parse_args()
    {"matmul": matmul, "alloc": alloc, "launches": launches, "serve": serve}[a.cmd](a)


if __name__ == "__main__":
    main()
