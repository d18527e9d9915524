"""report.py - what test/gpu/run.sh reads and prints (a real GPU only).

    report.py stats SOCKET              one snapshot of the enforcer's GET /v1/stats
    report.py case DIR ALONE SPEC...    the rows of one share case
    report.py timeline FILE ALONE       a matmul's progress lines as % of ALONE
    report.py priority DIR LABEL        one online/offline case: the request server's
                                        latency alone and beside the offline instance

A snapshot is one JSON line: {"t": monotonic seconds, "instances": [...]}.
A case directory holds out.<i> (torchload.py matmul output), stats0 and stats1
(snapshots taken inside the measured window) and pmon (nvidia-smi pmon -s u).
SPEC is core:target: the instance's quota and the share it should get, in %.
For each workload it prints three measures of its share of the GPU:
  tput   its matmul rate / the same loop's rate alone on the GPU;
  shim   GPU time the shim measured (gpu_ns) / wall time, between stats0 and stats1;
  pmon   the driver's per-process SM utilisation (nvidia-smi pmon), mean over samples.
"""
import json
import re
import socket
import sys
import time


def stats(sock_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(sock_path)
    t = time.monotonic()
    s.sendall(b"GET /v1/stats HTTP/1.0\r\nHost: mgpu\r\n\r\n")
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    body = data.split(b"\r\n\r\n", 1)[1]
    print(json.dumps({"t": t, "instances": json.loads(body)["instances"]}))


def kv(path):
    out = {}
    try:
        with open(path, errors="replace") as f:
            for line in f:
                for m in re.finditer(r"(\w+)=(\S+)", line):
                    out[m.group(1)] = m.group(2)
    except OSError:
        pass
    return out


def load(path):
    try:
        with open(path) as f:
            return json.loads(f.read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return None


def by_pid(snap):
    res = {}
    if not snap:
        return res
    for inst in snap["instances"]:
        for p in inst.get("processes") or []:
            res[p["pid"]] = inst
    return res


def pmon(path):
    """Mean SM % per pid over pmon's samples ('-' counts as 0)."""
    samples = {}
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith("#"):
                    continue
                cols = line.split()
                if len(cols) < 4 or not cols[1].isdigit():
                    continue
                sm = cols[3]
                samples.setdefault(int(cols[1]), []).append(float(sm) if sm.replace(".", "").isdigit() else 0.0)
    except OSError:
        return None
    return {pid: sum(v) / len(v) for pid, v in samples.items()} if samples else None


def case(d, alone, specs):
    alone = float(alone) if alone else 0.0
    s0, s1 = load(f"{d}/stats0"), load(f"{d}/stats1")
    p0, p1 = by_pid(s0), by_pid(s1)
    sm = pmon(f"{d}/pmon")
    label = d.rstrip("/").split("/")[-1]
    total = 0.0
    for i, spec in enumerate(specs):
        core, target = spec.split(":")[:2]
        o = kv(f"{d}/out.{i}")
        rate = float(o.get("rate", 0) or 0)
        pid = int(o["pid"]) if o.get("pid", "").isdigit() else -1
        tput = 100 * rate / alone if alone > 0 and rate > 0 else None
        shim = None
        if pid in p0 and pid in p1 and s1["t"] > s0["t"]:
            shim = 100 * (p1[pid]["gpu_ns"] - p0[pid]["gpu_ns"]) / 1e9 / (s1["t"] - s0["t"])
        pm = sm.get(pid) if sm else None
        if tput is not None:
            total += tput
        idle = "idle" if "idle" in o else ""
        f = lambda v: "-" if v is None else f"{v:6.1f}"  # noqa: E731
        print(f"{label:<28} core {core:>3} target {target:>4}  tput {f(tput)}  shim {f(shim)}  pmon {f(pm)} {idle}".rstrip())
        if "error" in o or (rate == 0 and not idle):
            print(f"{'':<28} workload {i} did not report a rate; its output:")
            try:
                with open(f"{d}/out.{i}", errors="replace") as fh:
                    for line in fh.readlines()[-6:]:
                        print(f"{'':<30}{line.rstrip()[:200]}")
            except OSError:
                pass
    print(f"{label:<28} sum of tput {total:6.1f}")


def timeline(path, alone):
    alone = float(alone)
    pts = []
    with open(path, errors="replace") as f:
        for line in f:
            m = re.match(r"progress t=(\S+) rate=(\S+)", line)
            if m:
                pts.append((float(m.group(1)), 100 * float(m.group(2)) / alone))
    print(" ".join(f"{t:.1f}s:{p:.0f}%" for t, p in pts))


def priority(d, label):
    """DIR holds serve (torchload.py serve), turns (`alone|beside FROM TO`
    lines, CLOCK_MONOTONIC seconds) and stats0.K / stats1.K (snapshots
    inside beside turn K). A request counts on the side its arrival falls
    in: 20 ms after a turn's start (an offline process just killed may
    still have work on the GPU) to 30 ms before its end (a later one may
    run into the next turn). Shares are what the shim measured (gpu_ns)."""
    o = kv(f"{d}/serve")
    t0 = float(o.get("mono", "nan"))
    lat = []
    try:
        with open(f"{d}/serve", errors="replace") as f:
            lat = [int(m.group(1)) / 1000 for m in re.finditer(r"^lat_us=(\d+)$", f.read(), re.M)]
    except OSError:
        pass
    turns = []
    try:
        with open(f"{d}/turns") as f:
            turns = [(w[0], float(w[1]), float(w[2])) for w in (line.split() for line in f) if len(w) == 3]
    except OSError:
        pass
    period = float(o.get("period_ms", 5)) / 1000
    side = {"alone": [], "beside": []}
    for i, v in enumerate(lat):
        at = t0 + i * period
        for kind, a, b in turns:
            if a + 0.02 <= at < b - 0.03:
                side[kind].append(v)
                break
    on = off = 0.0
    k = 0
    while True:
        s0, s1 = load(f"{d}/stats0.{k}"), load(f"{d}/stats1.{k}")
        if s0 is None and s1 is None:
            break
        k += 1
        if not s0 or not s1 or s1["t"] <= s0["t"]:
            continue
        g0 = {i["name"]: i for i in s0["instances"]}
        for inst in s1["instances"]:
            if inst["name"] in g0:
                share = (inst["gpu_ns"] - g0[inst["name"]]["gpu_ns"]) / 1e9 / (s1["t"] - s0["t"])
                if inst["core"] == 100:
                    off += share
                else:
                    on += share
    n = max(1, sum(1 for kind, _, _ in turns if kind == "beside"))
    on, off = 100 * on / n, 100 * off / n

    def pct(v, p):
        v = sorted(v)
        return v[min(len(v), max(1, -(-len(v) * p // 100))) - 1] if v else float("nan")

    a, b = side["alone"], side["beside"]
    row = " ".join(f"p{p} {pct(a, p):.2f} / {pct(b, p):.2f}" for p in (50, 90, 99))
    ratio = pct(b, 99) / pct(a, 99) if a and b else float("nan")
    idle = 100 * off / (100 - on) if on < 100 else float("nan")
    print(f"{label:<10} requests {len(a)} / {len(b)}  {row} ms  p99 ratio {ratio:.2f}  "
          f"online {on:.1f} %  offline {off:.1f} % ({idle:.1f} % of the idle time)  busy {on + off:.1f} %")


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "stats":
        stats(args[0])
    elif cmd == "case":
        case(args[0], args[1], args[2:])
    elif cmd == "timeline":
        timeline(args[0], args[1])
    elif cmd == "priority":
        priority(args[0], args[1])
    else:
        sys.exit(f"report.py: unknown command {cmd}")


if __name__ == "__main__":
    main()
