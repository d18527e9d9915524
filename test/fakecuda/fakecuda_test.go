package fakecuda

import (
	"bufio"
	"bytes"
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

var (
	buildOnce sync.Once
	buildErr  error
	buildDir  string
	paths     Paths
)

func TestMain(m *testing.M) {
	if os.Getenv(goNVMLEnv) != "" {
		os.Exit(goNVMLHelper()) // nvml_test.go: this binary as an NVML caller
	}
	rc := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir) //nolint:errcheck // temporary build
	}
	os.Exit(rc)
}

// built builds fakecuda and the workload once (into a temporary build
// directory, so concurrent builds of build/ by others do not interfere).
func built(t *testing.T) Paths {
	t.Helper()
	for _, tool := range []string{"make", "gcc"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed: %v", tool, err)
		}
	}
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "fakecuda-build-")
		if err != nil {
			buildErr = err
			return
		}
		buildDir = dir
		buildErr = Build(dir)
		paths = PathsIn(dir)
	})
	if buildErr != nil {
		t.Fatalf("build: %v", buildErr)
	}
	return paths
}

type env struct {
	t     *testing.T
	p     Paths
	state string
	extra []string
}

func newEnv(t *testing.T, extra ...string) *env {
	return &env{t: t, p: built(t), state: t.TempDir(), extra: extra}
}

func (e *env) cmd(bin string, args ...string) *exec.Cmd {
	c := exec.Command(bin, args...)
	c.Env = Env(e.p, e.state, e.extra...)
	return c
}

// run runs bin and returns stdout; a non-zero exit other than wantRC fails.
func (e *env) run(wantRC int, bin string, args ...string) string {
	e.t.Helper()
	c := e.cmd(bin, args...)
	var stderr bytes.Buffer
	c.Stderr = &stderr
	out, err := c.Output()
	rc := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		rc = ee.ExitCode()
	} else if err != nil {
		e.t.Fatalf("%s %v: %v", bin, args, err)
	}
	if rc != wantRC {
		e.t.Fatalf("%s %v: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", filepath.Base(bin), args, rc, wantRC, out, stderr.String())
	}
	return string(out)
}

func (e *env) workload(wantRC int, args ...string) string {
	e.t.Helper()
	return e.run(wantRC, e.p.Workload, args...)
}

func (e *env) stat() State {
	e.t.Helper()
	s, err := StatWith(e.p.Ctl, e.state)
	if err != nil {
		e.t.Fatal(err)
	}
	return s
}

func num(t *testing.T, m map[string]string, k string) float64 {
	t.Helper()
	v, err := strconv.ParseFloat(m[k], 64)
	if err != nil {
		t.Fatalf("key %q: %v (have %v)", k, err, m)
	}
	return v
}

func TestExportsMatchTheList(t *testing.T) {
	t.Parallel()
	p := built(t)
	list, err := os.ReadFile("src/fc_procs.def")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^FC_(?:SYM|PTSZ)\(\w+, (\w+), \d+\)`).FindAllStringSubmatch(string(list), -1) {
		want[m[1]] = true
	}
	if len(want) < 70 {
		t.Fatalf("parsed only %d entries from fc_procs.def", len(want))
	}
	nvmlList, err := os.ReadFile("src/fc_nvml.def")
	if err != nil {
		t.Fatal(err)
	}
	wantNVML := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^FC_NVML\((\w+)\)`).FindAllStringSubmatch(string(nvmlList), -1) {
		wantNVML[m[1]] = true
	}
	if !wantNVML["nvmlDeviceGetComputeRunningProcesses_v3"] || !wantNVML["nvmlDeviceGetProcessUtilization"] {
		t.Fatalf("fc_nvml.def misses the process queries: %v", wantNVML)
	}
	for lib, check := range map[string]func(string) bool{
		"libcuda.so.1":      func(s string) bool { return want[s] },
		"libnvidia-ml.so.1": func(s string) bool { return wantNVML[s] },
	} {
		f, err := elf.Open(filepath.Join(p.LibDir, lib))
		if err != nil {
			t.Fatal(err)
		}
		syms, err := f.DynamicSymbols()
		_ = f.Close()
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, s := range syms {
			if s.Section == elf.SHN_UNDEF || elf.ST_BIND(s.Info) != elf.STB_GLOBAL {
				continue
			}
			n++
			if !check(s.Name) {
				t.Errorf("%s exports %q, which is not in its list", lib, s.Name)
			}
		}
		if lib == "libcuda.so.1" && n != len(want) {
			t.Errorf("libcuda.so.1 exports %d symbols, the list has %d", n, len(want))
		}
		if lib == "libnvidia-ml.so.1" && n != len(wantNVML) {
			t.Errorf("libnvidia-ml.so.1 exports %d symbols, the list has %d", n, len(wantNVML))
		}
	}
}

func TestSemantics(t *testing.T) {
	for _, name := range []string{"procaddr", "ptsz", "graph", "memory", "async", "slice"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			out := e.run(0, filepath.Join(e.p.LibDir, "fctest"), name)
			m := Fields(out)
			switch name {
			case "async":
				// A launch (plus two event records) returns at once; the
				// 100 ms kernel is measured by its events.
				if v := num(t, m, "launch_ns"); v > 5e6 {
					t.Errorf("launching took %.0f ns: not asynchronous", v)
				}
				if v := num(t, m, "elapsed_ms"); v < 99 || v > 130 {
					t.Errorf("event elapsed %.3f ms, want ~100", v)
				}
				if v := num(t, m, "sync_ns"); v < 99e6 {
					t.Errorf("synchronize returned after %.0f ns, before the kernel ended", v)
				}
				if v := num(t, m, "ctxsync_ns"); v < 60e6 {
					t.Errorf("cuCtxSynchronize returned after %.0f ns, want >= 60 ms (two 30 ms kernels)", v)
				}
			case "slice":
				// The default 4 ms slice: renewed at the parent's last
				// kernel although its other stream waited, so the child
				// waits about a slice, and never much more (no starvation).
				if v := num(t, m, "other_wait_us"); v < 3000 || v > 20000 {
					t.Errorf("the other process waited %.0f us for the device, want a slice (~4000 us)", v)
				}
			case "graph":
				if v := num(t, m, "capture_graph_ms"); v < 99 || v > 140 {
					t.Errorf("captured graph of 5x20 ms ran %.3f ms", v)
				}
				if v := num(t, m, "node_graph_ms"); v < 39 || v > 70 {
					t.Errorf("node graph 20+0+20 ms ran %.3f ms", v)
				}
			}
			if !strings.Contains(out, name+"=ok") && name != "async" {
				t.Errorf("no %s=ok in output:\n%s", name, out)
			}
		})
	}
}

func TestInfoAndVisibleDevices(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "FAKECUDA_DEVICES=3", "CUDA_VISIBLE_DEVICES=2,0", "FAKECUDA_MEMORY_MIB=2048", "FAKECUDA_NAME=Test GPU")
	out := e.workload(0, "info")
	lines := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		k, v, _ := strings.Cut(l, "=")
		lines[k] = v
	}
	want := map[string]string{
		"driver_version":     "12040",
		"device_count":       "2",
		"device.0.uuid":      UUID(2),
		"device.1.uuid":      UUID(0),
		"device.0.name":      "Test GPU",
		"device.0.total_mem": "2147483648",
		"device.0.mem_free":  "2147483648",
		"nvml.device_count":  "3", // NVML sees host indexes
		"nvml.2.index":       "2",
		"nvml.2.total":       "2147483648",
		"nvml.2.v2.free":     "2147483648",
	}
	for k, v := range want {
		if lines[k] != v {
			t.Errorf("%s=%q, want %q", k, lines[k], v)
		}
	}
	s := e.stat()
	if len(s.Devices) != 3 {
		t.Fatalf("stat shows %d devices, want 3: %+v", len(s.Devices), s)
	}
	if d, _ := s.Device(2); d.UUID != UUID(2) || d.MemTotal != 2<<30 || d.Name != "Test GPU" {
		t.Errorf("device 2 in stat: %+v", d)
	}
}

func TestMemoryTotalAndOOM(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "FAKECUDA_MEMORY_MIB=1024")
	for _, api := range []string{"cuMemAlloc_v2", "cuMemAllocPitch_v2", "cuMemAllocManaged", "cuMemAllocAsync",
		"cuMemAllocFromPoolAsync", "cuMemCreate", "cuArrayCreate_v2", "cuArray3DCreate_v2"} {
		out := e.workload(2, "alloc", "--api", api, "--mib", "400", "--count", "3", "--free")
		for i, want := range []string{"CUDA_SUCCESS (0)", "CUDA_SUCCESS (0)", "CUDA_ERROR_OUT_OF_MEMORY (2)"} {
			line := fmt.Sprintf("alloc %d %s 400MiB -> %s", i, api, want)
			if !strings.Contains(out, line) {
				t.Errorf("%s: missing %q in\n%s", api, line, out)
			}
		}
		if !strings.Contains(out, fmt.Sprintf("mem_free=%d mem_total=%d", (1024-800)<<20, 1024<<20)) ||
			!strings.Contains(out, fmt.Sprintf("mem_free=%d mem_total=%d", 1024<<20, 1024<<20)) {
			t.Errorf("%s: memory info before/after free wrong:\n%s", api, out)
		}
	}
	if d, _ := e.stat().Device(0); d.MemUsed != 0 {
		t.Errorf("device memory after all frees: %d", d.MemUsed)
	}
}

// A process holding memory is SIGKILLed: like the driver, its memory returns.
func TestKilledProcessMemoryReturns(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "FAKECUDA_MEMORY_MIB=1024")
	holder := e.cmd(e.p.Workload, "alloc", "--api", "cuMemAlloc_v2", "--mib", "700", "--hold-ms", "-1")
	stdout, err := holder.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	defer holder.Process.Kill() //nolint:errcheck // cleanup
	sc := bufio.NewScanner(stdout)
	for sc.Scan() && !strings.HasPrefix(sc.Text(), "holding") {
	}
	d, _ := e.stat().Device(0)
	if p, ok := d.Proc(holder.Process.Pid); !ok || !p.Alive || p.MemUsed != 700<<20 || d.MemUsed != 700<<20 {
		t.Fatalf("holder not accounted: %+v", d)
	}
	e.workload(2, "alloc", "--api", "cuMemAlloc_v2", "--mib", "700")
	if err := holder.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	holder.Wait() //nolint:errcheck // killed on purpose
	// The allocation that would fail reaps the dead process first.
	e.workload(0, "alloc", "--api", "cuMemAlloc_v2", "--mib", "700")
	d, _ = e.stat().Device(0)
	if p, ok := d.Proc(holder.Process.Pid); !ok || p.Alive || p.MemUsed != 0 || d.MemUsed != 0 {
		t.Fatalf("after kill: %+v", d)
	}
}

// Killing a process while it holds the device does not wedge it: the other
// process gets the device within the liveness poll.
func TestKilledOwnerReleasesDevice(t *testing.T) {
	t.Parallel()
	killedOwnerReleasesDevice(t, newEnv(t))
}

// The same in the other device models. The timer model's slice is long
// (1 s) so that the owner dies inside it: only the liveness check can hand
// the device on (nobody preempts a dead process's kernel).
func TestKilledOwnerReleasesDeviceModels(t *testing.T) {
	for _, spec := range []string{"kernel", "timer:1000ms"} {
		t.Run(strings.ReplaceAll(spec, ":", "_"), func(t *testing.T) {
			t.Parallel()
			killedOwnerReleasesDevice(t, newEnv(t, modelEnv(t, spec)...))
		})
	}
}

func killedOwnerReleasesDevice(t *testing.T, e *env) {
	t.Helper()
	long := e.cmd(e.p.Workload, "compute", "--kernel-us", "5000000", "--depth", "1", "--seconds", "0.01")
	if err := long.Start(); err != nil {
		t.Fatal(err)
	}
	defer long.Process.Kill() //nolint:errcheck // cleanup
	deadline := time.Now().Add(10 * time.Second)
	for {
		d, _ := e.stat().Device(0)
		if p, ok := d.Proc(long.Process.Pid); ok && p.Alive {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the long kernel process never registered")
		}
		time.Sleep(10 * time.Millisecond) // polling with a deadline
	}
	// Let the 5 s kernel start, then kill it while it owns the device.
	next := e.cmd(e.p.Workload, "compute", "--kernel-us", "1000", "--depth", "1", "--seconds", "0.2")
	if err := next.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // not synchronisation: gives the kernel time to be running
	start := time.Now()
	if err := long.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	long.Wait() //nolint:errcheck // killed on purpose
	if err := next.Wait(); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el > 3*time.Second {
		t.Errorf("second process finished %v after the owner died", el)
	}
}

// A process killed inside a long kernel hands the device on about as soon
// as it is dead (a real driver tears its context down at once), not at a
// slow liveness poll: a server beside a batch job that is killed must not
// stall. The waiter re-checks the owner every 10 ms at most (1 ms after
// the owner's kernel should have ended, for short ones); the bound leaves
// room for a loaded machine's wake-up latency, and the 100 ms poll this
// replaced handed over after 50 ms on average.
func TestKilledOwnerHandover(t *testing.T) {
	for _, spec := range []string{"slice", "timer:1000ms", "kernel"} {
		t.Run(strings.ReplaceAll(spec, ":", "_"), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, modelEnv(t, spec)...)
			var worst float64
			for range 5 {
				worst = max(worst, num(t, Fields(e.run(0, filepath.Join(e.p.LibDir, "fctest"), "killed-owner")), "handover_us"))
			}
			t.Logf("worst hand-over of 5: %.0f us after the owner's death", worst)
			if worst > 30000 {
				t.Errorf("the device passed on %.0f us after its owner died, want <= 30 ms", worst)
			}
		})
	}
}

// Two saturating processes share one device: each gets about half of the
// device time and the device is busy about all the time, never more.
func TestTwoProcessesShareTheDevice(t *testing.T) {
	twoProcessesShareTheDevice(t, newEnv(t), 3.0)
}

// The same, shorter, in the other device models.
func TestTwoProcessesShareTheDeviceModels(t *testing.T) {
	for _, spec := range []string{"timer:1ms", "kernel"} {
		t.Run(strings.ReplaceAll(spec, ":", "_"), func(t *testing.T) {
			twoProcessesShareTheDevice(t, newEnv(t, modelEnv(t, spec)...), 1.0)
		})
	}
}

func twoProcessesShareTheDevice(t *testing.T, e *env, seconds float64) {
	t.Helper()
	var cmds []*exec.Cmd
	var outs []*bytes.Buffer
	start := time.Now()
	for i := 0; i < 2; i++ {
		c := e.cmd(e.p.Workload, "compute", "--kernel-us", "2000", "--depth", "2", "--seconds", fmt.Sprint(seconds))
		b := &bytes.Buffer{}
		c.Stdout = b
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		cmds, outs = append(cmds, c), append(outs, b)
	}
	for _, c := range cmds {
		if err := c.Wait(); err != nil {
			t.Fatal(err)
		}
	}
	wall := time.Since(start)
	d, _ := e.stat().Device(0)
	var busy [2]float64
	for i, c := range cmds {
		p, ok := d.Proc(c.Process.Pid)
		if !ok {
			t.Fatalf("pid %d not in %+v", c.Process.Pid, d)
		}
		busy[i] = float64(p.BusyNs)
	}
	total := busy[0] + busy[1]
	t.Logf("busy %.0f ms + %.0f ms = %.0f ms, device %.0f ms, wall %v; %s %s", busy[0]/1e6, busy[1]/1e6, total/1e6,
		float64(d.BusyNs)/1e6, wall, strings.TrimSpace(outs[0].String()), strings.TrimSpace(outs[1].String()))
	for i := range busy {
		if share := busy[i] / total; share < 0.42 || share > 0.58 {
			t.Errorf("process %d got %.1f%% of the device, want ~50%%", i, share*100)
		}
	}
	if float64(d.BusyNs) < 0.85*seconds*1e9 {
		t.Errorf("device busy %.0f ms over a %.1f s run: not saturated", float64(d.BusyNs)/1e6, seconds)
	}
	if float64(d.BusyNs) > float64(wall.Nanoseconds())*1.01 {
		t.Errorf("device busy %.0f ms exceeds the wall time %v: kernels overlapped", float64(d.BusyNs)/1e6, wall)
	}
}

// A process's streams are one context: the device passing from one of its
// streams to another is its time, as if they ran concurrently on a real GPU
// (before, each hand-over's wake-up latency went to nobody: 17 % of a
// two-stream process's time with 50 µs kernels).
func TestOwnStreamsHoldTheDevice(t *testing.T) {
	e := newEnv(t)
	out := e.run(0, e.p.Workload, "compute", "--kernel-us", "50", "--depth", "1", "--streams", "2", "--threads", "2", "--seconds", "1")
	wall := num(t, Fields(out), "wall_ns")
	d, _ := e.stat().Device(0)
	if len(d.Procs) != 1 {
		t.Fatalf("want one process, have %+v", d.Procs)
	}
	p := d.Procs[0]
	t.Logf("busy %.1f ms, kernels %.1f ms, wall %.1f ms", float64(p.BusyNs)/1e6, float64(p.KernelNs)/1e6, wall/1e6)
	if float64(p.BusyNs) < 0.95*wall {
		t.Errorf("a process keeping two streams busy held the device %.1f%% of the time, want >= 95%%", 100*float64(p.BusyNs)/wall)
	}
	if float64(p.BusyNs) > wall*1.01 {
		t.Errorf("busy %.0f ns exceeds the wall time %.0f ns", float64(p.BusyNs), wall)
	}
}

func TestResolvePaths(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, args := range [][]string{
		{"--resolve", "proc", "compute", "--api", "launchex"},
		{"--resolve", "runtime", "compute", "--api", "launch"},
		{"--resolve", "runtime", "--ptsz", "compute", "--api", "coop", "--null-stream", "--threads", "2"},
		{"--resolve", "proc", "--ptsz", "compute", "--api", "graph", "--graph-build", "nodes"},
		{"--ptsz", "compute", "--api", "graph", "--streams", "2", "--threads", "2"},
	} {
		before, _ := e.stat().Device(0)
		out := e.workload(0, append(args, "--kernel-us", "1000", "--seconds", "0.3")...)
		m := Fields(out)
		after, _ := e.stat().Device(0)
		launches := num(t, m, "launches")
		if launches < 50 {
			t.Errorf("%v: only %v launches", args, launches)
		}
		if ran := float64(after.Kernels - before.Kernels); ran != launches {
			t.Errorf("%v: %v kernels ran on the device, %v launched", args, ran, launches)
		}
	}
}

func TestForkChild(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	out := e.workload(0, "fork", "--kernel-us", "20000")
	pids := regexp.MustCompile(`(?m)^(parent|child|parent-after) pid=(\d+) ok elapsed_ms=([\d.]+)$`).FindAllStringSubmatch(out, -1)
	if len(pids) != 3 {
		t.Fatalf("want parent, child, parent-after ok lines:\n%s", out)
	}
	for _, m := range pids {
		if ms, _ := strconv.ParseFloat(m[3], 64); ms < 19.5 || ms > 60 {
			t.Errorf("%s: kernel of 20 ms took %s ms", m[1], m[3])
		}
	}
	d, _ := e.stat().Device(0)
	for _, m := range pids[:2] {
		pid, _ := strconv.Atoi(m[2])
		if p, ok := d.Proc(pid); !ok || p.Kernels < 1 {
			t.Errorf("%s pid %d has no kernels in %+v", m[1], pid, d)
		}
	}
}

func TestChurnAndReset(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "FAKECUDA_MEMORY_MIB=1000")
	var wg sync.WaitGroup
	outs := make([]string, 3)
	for i := range outs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			outs[i] = e.workload(0, "alloc-churn", "--mib", "300", "--iterations", "2000", "--threads", "2")
		}()
	}
	wg.Wait()
	for _, out := range outs {
		m := Fields(out)
		if num(t, m, "ok")+num(t, m, "oom") != 4000 || num(t, m, "errors") != 0 {
			t.Errorf("churn: %s", out)
		}
	}
	d, _ := e.stat().Device(0)
	if d.MemUsed != 0 || len(d.Procs) != 3 {
		t.Errorf("after churn: %+v", d)
	}
	e.workload(0, "compute", "--kernel-us", "1000", "--seconds", "0.1")
	if d, _ = e.stat().Device(0); d.BusyNs == 0 {
		t.Fatal("no busy time recorded")
	}
	if err := ResetWith(e.p.Ctl, e.state); err != nil {
		t.Fatal(err)
	}
	if d, _ = e.stat().Device(0); d.BusyNs != 0 || len(d.Procs) != 0 {
		t.Errorf("after reset: %+v", d)
	}
}

func TestBenchmarksRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	m := Fields(e.workload(0, "bench-launch", "--n", "50000"))
	if v := num(t, m, "ns_per_launch"); v <= 0 || v > 20000 {
		t.Errorf("ns_per_launch=%v", v)
	}
	m = Fields(e.workload(0, "bench-alloc", "--n", "20000", "--bytes", "4096"))
	if v := num(t, m, "ns_per_alloc"); v <= 0 || v > 20000 {
		t.Errorf("ns_per_alloc=%v", v)
	}
	t.Logf("ns_per_launch and ns_per_alloc: %v", m)
}

// serve (the request/response workload): one request per period, none
// faster than its kernels, percentiles in order.
func TestServeReportsLatencies(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	m := Fields(e.workload(0, "serve", "--kernel-us", "100", "--burst", "5", "--period-ms", "4", "--seconds", "0.4", "--depth", "2"))
	if n := num(t, m, "requests"); n != 100 {
		t.Errorf("requests=%v, want 100 (0.4 s every 4 ms)", n)
	}
	lo, p50, p90, p99, hi := num(t, m, "min_us"), num(t, m, "p50_us"), num(t, m, "p90_us"), num(t, m, "p99_us"), num(t, m, "max_us")
	if lo < 500 || lo > p50 || p50 > p90 || p90 > p99 || p99 > hi {
		t.Errorf("latencies min %v p50 %v p90 %v p99 %v max %v µs: a request is 5 kernels of 100 µs", lo, p50, p90, p99, hi)
	}
	if b := num(t, m, "busy_ns"); b != 100*5*100000 {
		t.Errorf("busy_ns=%v", b)
	}
	t.Logf("serve: %v", m)
	c := e.cmd(e.p.Workload, "serve", "--burst", "0")
	if out, err := c.CombinedOutput(); err == nil || !strings.Contains(string(out), "serve needs --kernel-us >= 0, --burst >= 1") {
		t.Errorf("bad options: %v %q", err, out)
	}
}

// The C parts under ASan and UBSan: the semantics checks, a multi-stream
// compute run and fork.
func TestSanitizerBuild(t *testing.T) {
	if testing.Short() {
		t.Skip("sanitizer build skipped in -short mode")
	}
	built(t) // skips without gcc/make
	t.Parallel()
	dir := t.TempDir()
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	for _, sub := range []string{"test/fakecuda", "test/workload"} {
		c := exec.Command("make", "-s", "-C", filepath.Join(root, sub), "BUILD="+dir, "SANITIZE=1")
		if out, err := c.CombinedOutput(); err != nil {
			t.Fatalf("make SANITIZE=1 %s: %v\n%s", sub, err, out)
		}
	}
	e := &env{t: t, p: PathsIn(dir), state: t.TempDir(),
		extra: []string{"ASAN_OPTIONS=detect_leaks=0:abort_on_error=1", "UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1"}}
	for _, name := range []string{"procaddr", "ptsz", "graph", "memory", "async", "slice", "nvml-procs", "nvml-list"} {
		e.run(0, filepath.Join(e.p.LibDir, "fctest"), name)
	}
	e.run(0, filepath.Join(e.p.LibDir, "fctest"), "nvml-util", "2000", "3000", "10000", "500")
	e.workload(0, "--ptsz", "compute", "--kernel-us", "500", "--seconds", "0.3", "--streams", "3", "--threads", "2")
	e.workload(0, "--resolve", "runtime", "compute", "--api", "graph", "--kernel-us", "500", "--seconds", "0.2")
	e.workload(0, "fork", "--kernel-us", "1000")
	e.workload(0, "alloc-churn", "--api", "cuMemAllocAsync", "--mib", "1", "--iterations", "500", "--threads", "2")
	// the other device models: preemption, hand-over after each kernel
	for _, tc := range []struct {
		spec string
		args []string
	}{
		{"timer:1ms", []string{"share", "2", "5000", "2"}},
		{"timer:1ms", []string{"share", "3", "300", "10"}},
		{"kernel", []string{"share", "2", "500", "10"}},
	} {
		m := &env{t: t, p: e.p, state: t.TempDir(), extra: append(slices.Clone(e.extra), modelEnv(t, tc.spec)...)}
		m.run(0, filepath.Join(m.p.LibDir, "fctest"), tc.args...)
		m.run(0, filepath.Join(m.p.LibDir, "fctest"), "slice")
	}
}

// Processes are told apart by pid namespace: a process reports its own pid
// namespace, and two processes that are both pid 1 of their own namespace
// (two containers' first processes) get separate entries and busy times.
func TestPIDNamespaces(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var self syscall.Stat_t
	if err := syscall.Stat("/proc/self/ns/pid", &self); err != nil {
		t.Skipf("no /proc/self/ns/pid: %v", err)
	}
	c := e.cmd(e.p.Workload, "compute", "--kernel-us", "1000", "--depth", "2", "--seconds", "0.1")
	if out, err := c.CombinedOutput(); err != nil {
		t.Fatalf("workload: %v\n%s", err, out)
	}
	d, _ := e.stat().Device(0)
	if p, ok := d.Proc(c.Process.Pid); !ok || p.PIDNS != self.Ino || p.BusyNs == 0 {
		t.Fatalf("pid %d: want pidns %d and busy time, got %+v", c.Process.Pid, self.Ino, d.Procs)
	}
	if got := d.BusyNsIn(self.Ino); got != d.BusyNs {
		t.Errorf("BusyNsIn(the test's pidns) = %d, want the device's %d", got, d.BusyNs)
	}

	unshare, err := exec.LookPath("unshare")
	if err != nil || os.Geteuid() != 0 {
		t.Skip("new pid namespaces need root and unshare(1)")
	}
	if err := ResetWith(e.p.Ctl, e.state); err != nil {
		t.Fatal(err)
	}
	var cmds []*exec.Cmd
	var outs []*bytes.Buffer
	for _, us := range []string{"1000", "3000"} {
		c := e.cmd(unshare, "--pid", "--fork", "--mount-proc", e.p.Workload,
			"compute", "--kernel-us", us, "--depth", "2", "--seconds", "0.5")
		b := &bytes.Buffer{}
		c.Stdout, c.Stderr = b, b
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		cmds, outs = append(cmds, c), append(outs, b)
	}
	for i, c := range cmds {
		if err := c.Wait(); err != nil {
			t.Fatalf("unshare workload: %v\n%s", err, outs[i])
		}
	}
	d, _ = e.stat().Device(0)
	var ones []Proc
	for _, p := range d.Procs {
		if p.PID == 1 {
			ones = append(ones, p)
		}
	}
	if len(ones) != 2 || ones[0].PIDNS == ones[1].PIDNS || ones[0].PIDNS == self.Ino || ones[1].PIDNS == self.Ino ||
		ones[0].PIDNS == 0 || ones[1].PIDNS == 0 {
		t.Fatalf("want two pid-1 entries of two new pid namespaces, got %+v", d.Procs)
	}
	var sum uint64
	for _, p := range ones {
		if got := d.BusyNsIn(p.PIDNS); got != p.BusyNs || got == 0 {
			t.Errorf("BusyNsIn(%d) = %d, want the entry's %d (> 0)", p.PIDNS, got, p.BusyNs)
		}
		sum += p.BusyNs
	}
	if sum != d.BusyNs {
		t.Errorf("the two namespaces used %d ns, the device %d ns", sum, d.BusyNs)
	}
}

// Watch samples from one process, and every sample counts the hold in
// progress: a process running one 300 ms kernel is seen using the device
// between two samples 10 ms apart (before, its busy time moved only when
// the kernel ended, so short windows read 0 % or several hundred).
func TestWatchCountsTheHoldInProgress(t *testing.T) {
	e := newEnv(t)
	c := e.cmd(e.p.Workload, "compute", "--kernel-us", "300000", "--depth", "1", "--seconds", "0.2")
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Wait() }()
	var first uint64 // the process's busy time when first seen holding
	deadline := time.Now().Add(10 * time.Second)
	for {
		if d, ok := e.stat().Device(0); ok {
			if p, ok := d.Proc(c.Process.Pid); ok && p.BusyNs > 0 {
				first = p.BusyNs
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("the workload never held the device")
		}
		time.Sleep(time.Millisecond) // poll interval
	}
	w, err := WatchWith(e.p.Ctl, e.state, 10*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	for len(w.States()) < 8 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond) // poll interval
	}
	ss, err := w.Stop()
	if err != nil {
		t.Fatal(err)
	}
	if len(ss) < 8 {
		t.Fatalf("%d samples in 10 s at 10 ms", len(ss))
	}
	grew := 0
	for i := 1; i < len(ss); i++ {
		if ss[i].AtNs <= ss[i-1].AtNs {
			t.Fatalf("sample %d at %d, not after %d", i, ss[i].AtNs, ss[i-1].AtNs)
		}
		a, _ := ss[i-1].Device(0)
		b, _ := ss[i].Device(0)
		pa, _ := a.Proc(c.Process.Pid)
		pb, _ := b.Proc(c.Process.Pid)
		wall := ss[i].AtNs - ss[i-1].AtNs
		if pb.BusyNs < pa.BusyNs || pb.BusyNs-pa.BusyNs > wall {
			t.Errorf("samples %d-%d: busy %d -> %d over %d ns of wall", i-1, i, pa.BusyNs, pb.BusyNs, wall)
		}
		if pb.BusyNs-pa.BusyNs >= wall*9/10 {
			grew++
		}
	}
	if last, _ := ss[len(ss)-1].Device(0); grew < len(ss)/2 {
		p, _ := last.Proc(c.Process.Pid)
		t.Errorf("busy time grew with the wall time in %d of %d intervals (from %d to %d ns)", grew, len(ss)-1, first, p.BusyNs)
	}
	if _, err := WatchWith(e.p.Ctl, e.state, 50*time.Microsecond); err == nil {
		t.Error("a 50 µs watch interval was accepted")
	}
	out, err := e.cmd(e.p.Ctl, "watch", "1ms").CombinedOutput()
	if ee := (*exec.ExitError)(nil); !errors.As(err, &ee) || ee.ExitCode() != 2 || !strings.Contains(string(out), "want microseconds") {
		t.Errorf("fakecuda-ctl watch 1ms: %v: %s", err, out)
	}
}
