package fakecuda

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// NVML's per-process queries (README.md, "NVML"): the running processes
// with their memory, process utilisation as a watcher samples it, pids in
// the caller's pid namespace. fctest's nvml-* checks do the calls; these
// tests judge what they print.

// nvmlProcesses: who is listed with how much memory (every allocation
// family), the count protocol, the v1/v2/v3 layouts, a process listed only
// while it has a context, frees, a SIGKILLed process gone with its memory.
func TestNVMLProcesses(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	out := e.run(0, filepath.Join(e.p.LibDir, "fctest"), "nvml-procs")
	if !strings.Contains(out, "nvml_procs=ok") {
		t.Fatalf("no nvml_procs=ok:\n%s", out)
	}
}

// window is one watcher answer of fctest nvml-util: its length (us) and
// the two processes' smUtil (-1: not listed).
type window struct {
	lenUS float64
	a, b  int
	end   bool // the children's work ended inside it
}

var windowRE = regexp.MustCompile(`^(\d+):(-?\d+):(-?\d+)(:end)?$`)

func parseWindows(t *testing.T, s string) []window {
	t.Helper()
	var ws []window
	for _, f := range strings.Split(s, ",") {
		g := windowRE.FindStringSubmatch(f)
		if g == nil {
			t.Fatalf("bad window %q in %q", f, s)
		}
		w := window{end: g[4] != ""}
		w.lenUS, _ = strconv.ParseFloat(g[1], 64)
		w.a, _ = strconv.Atoi(g[2])
		w.b, _ = strconv.Atoi(g[3])
		ws = append(ws, w)
	}
	return ws
}

// Process utilisation as a watcher reads it (every 250 ms, lastSeenTimeStamp
// the previous answer's timeStamp), for ~1 s of work: process a runs kernels
// flat out, process b (if any) one kernel per period. NVML's value over the
// whole run must be the truth (busy_ns over the window) to a point, and each
// 250 ms window must add up: a and b together hold the device all the time
// (a hold in progress at a sample counts; in the timer model a preempted
// kernel's waiting does not).
func TestNVMLProcessUtilization(t *testing.T) {
	for _, tc := range []struct {
		name, model string
		args        []string // a kernel us, b kernel us, b period us, ms
	}{
		{"slice_flat_and_30pct", "slice", []string{"2000", "3000", "10000", "1000"}},
		{"timer_flat_and_30pct", "timer:1ms", []string{"2000", "3000", "10000", "1000"}},
		{"kernel_flat_and_30pct", "kernel", []string{"2000", "3000", "10000", "1000"}},
		// 100 ms kernels: every sample falls inside one; without the hold
		// in progress a 250 ms window would read 80 or 100+.
		{"long_kernels", "slice", []string{"100000", "0", "0", "1000"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			withB := tc.args[1] != "0"
			var errs []string
			for try := 0; try < 3; try++ {
				e := newEnv(t, modelEnv(t, tc.model)...)
				out := e.run(0, filepath.Join(e.p.LibDir, "fctest"), append([]string{"nvml-util"}, tc.args...)...)
				if !strings.Contains(out, "nvml_util=ok") {
					t.Fatalf("no nvml_util=ok:\n%s", out)
				}
				m := Fields(out)
				errs = judgeUtil(t, m, parseWindows(t, m["windows"]), withB)
				t.Logf("try %d: %s", try, strings.Join(strings.Fields(out), " "))
				if len(errs) == 0 {
					return
				}
				t.Logf("try %d: %s", try, strings.Join(errs, "; "))
			}
			t.Error(strings.Join(errs, "; "))
		})
	}
}

func judgeUtil(t *testing.T, m map[string]string, ws []window, withB bool) []string {
	t.Helper()
	var errs []string
	procs := []string{"a"}
	if withB {
		procs = append(procs, "b")
	}
	for _, p := range procs {
		whole, truth, sum := num(t, m, "whole."+p), num(t, m, "truth."+p), num(t, m, "sum."+p)
		// rounding only: the whole run is one exact interval
		if math.Abs(whole-truth) > 1 {
			errs = append(errs, fmt.Sprintf("%s: NVML %.0f %% over the run, truth %.2f %%", p, whole, truth))
		}
		// the windows tile the run: their sum is the truth too
		if math.Abs(sum-truth) > 1 {
			errs = append(errs, fmt.Sprintf("%s: the windows add up to %.2f %%, truth %.2f %%", p, sum, truth))
		}
	}
	full := 0
	for i, w := range ws {
		if w.end {
			continue
		}
		full++
		if w.lenUS < 240000 || w.lenUS > 400000 {
			errs = append(errs, fmt.Sprintf("window %d is %.0f us long, want ~250 ms", i, w.lenUS))
		}
		switch {
		case !withB && w.a < 97:
			errs = append(errs, fmt.Sprintf("window %d: a flat out alone at %d %%", i, w.a))
		case withB && (w.a < 0 || w.b < 0):
			errs = append(errs, fmt.Sprintf("window %d: a process not listed: a %d b %d", i, w.a, w.b))
		case withB && (w.a+w.b < 94 || w.a+w.b > 101):
			// a is flat out: the device is always held by one of them
			// (hand-overs cost a wake-up each, to nobody)
			errs = append(errs, fmt.Sprintf("window %d: a %d %% + b %d %% = %d %%, want ~100", i, w.a, w.b, w.a+w.b))
		case withB && (w.b < 27 || w.b > 33):
			errs = append(errs, fmt.Sprintf("window %d: b at %d %%, want its duty of 30 %% +-3", i, w.b))
		}
	}
	if full < 3 {
		errs = append(errs, fmt.Sprintf("only %d full windows: %+v", full, ws))
	}
	return errs
}

// startHolder starts cmd (an mgpu-workload alloc --hold-ms -1, perhaps
// under unshare) and waits for its "holding" line.
func startHolder(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "holding") {
			go func() {
				for sc.Scan() {
				}
			}()
			return
		}
	}
	t.Fatalf("%v never held its memory", cmd.Args)
}

// childOf is the pid of a child of ppid (unshare --fork's one child).
func childOf(t *testing.T, ppid int) int {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		ents, _ := os.ReadDir("/proc")
		for _, d := range ents {
			pid, err := strconv.Atoi(d.Name())
			if err != nil {
				continue
			}
			b, err := os.ReadFile(filepath.Join("/proc", d.Name(), "status"))
			if err != nil {
				continue
			}
			if regexp.MustCompile(`(?m)^PPid:\s+` + strconv.Itoa(ppid) + `$`).Match(b) {
				return pid
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no child of %d", ppid)
		}
		time.Sleep(10 * time.Millisecond) // polling with a deadline
	}
}

type nvmlList struct {
	procs   map[int]uint64 // pid -> memory
	samples map[int]int    // pid -> smUtil
	out     string
}

var listRE = regexp.MustCompile(`(?m)^(proc|util) pid=(\d+) (mem|sm)=(\d+)$`)

func parseList(t *testing.T, out string) nvmlList {
	t.Helper()
	if !strings.Contains(out, "nvml_list=ok") {
		t.Fatalf("no nvml_list=ok:\n%s", out)
	}
	l := nvmlList{procs: map[int]uint64{}, samples: map[int]int{}, out: out}
	for _, g := range listRE.FindAllStringSubmatch(out, -1) {
		pid, _ := strconv.Atoi(g[2])
		v, _ := strconv.ParseUint(g[4], 10, 64)
		if g[1] == "proc" {
			l.procs[pid] = v
		} else {
			l.samples[pid] = int(v)
		}
	}
	return l
}

// A process in its own pid namespace (a container's) is reported with its
// pid in the NVML caller's namespace, as the driver does: the host pid for
// a caller on the host, its own pid for a caller in its namespace; a
// process the caller cannot see (another namespace) is left out.
func TestNVMLPIDNamespaces(t *testing.T) {
	t.Parallel()
	unshare, err1 := exec.LookPath("unshare")
	nsenter, err2 := exec.LookPath("nsenter")
	if err1 != nil || err2 != nil || os.Geteuid() != 0 {
		t.Skip("new pid namespaces need root, unshare(1) and nsenter(1)")
	}
	e := newEnv(t)
	fctest := filepath.Join(e.p.LibDir, "fctest")
	host := e.cmd(e.p.Workload, "alloc", "--api", "cuMemAlloc_v2", "--mib", "32", "--hold-ms", "-1")
	startHolder(t, host)
	inNS := e.cmd(unshare, "--pid", "--fork", "--kill-child", "--mount-proc", e.p.Workload, "alloc", "--api", "cuMemAlloc_v2", "--mib", "64", "--hold-ms", "-1")
	startHolder(t, inNS)
	nsHolder := childOf(t, inNS.Process.Pid)
	t.Cleanup(func() { _ = syscall.Kill(nsHolder, syscall.SIGKILL) }) // --kill-child too: it must not outlive the test
	compute := e.cmd(unshare, "--pid", "--fork", "--kill-child", "--mount-proc", e.p.Workload, "compute", "--kernel-us", "1000", "--seconds", "5")
	if err := compute.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = compute.Process.Kill()
		_ = compute.Wait()
	})
	nsCompute := childOf(t, compute.Process.Pid)
	deadline := time.Now().Add(10 * time.Second)
	for {
		d, _ := e.stat().Device(0)
		if p, ok := d.Proc(1); ok && p.BusyNs > 0 && len(d.Procs) == 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the compute process never ran: %+v", d)
		}
		time.Sleep(20 * time.Millisecond) // polling with a deadline
	}
	time.Sleep(300 * time.Millisecond) // not synchronisation: a stretch of compute for the sample

	// On the host: host pids.
	l := parseList(t, e.run(0, fctest, "nvml-list"))
	want := map[int]uint64{host.Process.Pid: 32 << 20, nsHolder: 64 << 20, nsCompute: 0}
	if len(l.procs) != 3 {
		t.Errorf("host: want 3 processes %v, got:\n%s", want, l.out)
	}
	for pid, mem := range want {
		if got, ok := l.procs[pid]; !ok || got != mem {
			t.Errorf("host: pid %d: want %d bytes, got %d (listed %v):\n%s", pid, mem, got, ok, l.out)
		}
	}
	if u, ok := l.samples[nsCompute]; !ok || u < 50 || len(l.samples) != 1 {
		t.Errorf("host: want one utilisation sample, of pid %d (flat out), got:\n%s", nsCompute, l.out)
	}

	// In the holder's namespace: it is pid 1 there; the others are not
	// visible.
	l = parseList(t, e.run(0, nsenter, "-t", strconv.Itoa(nsHolder), "-p", "-m", fctest, "nvml-list"))
	if len(l.procs) != 1 || l.procs[1] != 64<<20 || len(l.samples) != 0 {
		t.Errorf("in the holder's namespace: want only pid 1 with 64 MiB, got:\n%s", l.out)
	}

	// In a namespace of its own: nobody is visible.
	l = parseList(t, e.run(0, unshare, "--pid", "--fork", "--kill-child", "--mount-proc", fctest, "nvml-list"))
	if len(l.procs) != 0 || len(l.samples) != 0 {
		t.Errorf("in a new namespace: want nobody, got:\n%s", l.out)
	}
}

// goNVMLEnv makes the test binary the go-nvml helper (TestMain): the value
// is the directory of libnvidia-ml.so.1.
const goNVMLEnv = "FAKECUDA_GO_NVML_HELPER"

type goNVMLAnswer struct {
	Procs       []nvml.ProcessInfo
	ProcsRet    string
	Samples     []nvml.ProcessUtilizationSample
	SamplesRet  string
	Samples2    []nvml.ProcessUtilizationSample
	Samples2Ret string
	Samples3Ret string
}

// goNVMLHelper asks fakecuda's NVML through go-nvml, as the enforcer does,
// and prints the answers as JSON. NVML holds its state dir for the
// process's life, so it runs in a process of its own.
func goNVMLHelper() int {
	lib := nvml.New(nvml.WithLibraryPath(filepath.Join(os.Getenv(goNVMLEnv), "libnvidia-ml.so.1")))
	if ret := lib.Init(); ret != nvml.SUCCESS {
		fmt.Fprintln(os.Stderr, "init:", ret)
		return 1
	}
	dev, ret := lib.DeviceGetHandleByIndex(0)
	if ret != nvml.SUCCESS {
		fmt.Fprintln(os.Stderr, "handle:", ret)
		return 1
	}
	var a goNVMLAnswer
	var r nvml.Return
	a.Procs, r = dev.GetComputeRunningProcesses()
	a.ProcsRet = r.Error()
	a.Samples, r = dev.GetProcessUtilization(0)
	a.SamplesRet = r.Error()
	var last uint64
	for _, s := range a.Samples {
		last = max(last, s.TimeStamp)
	}
	time.Sleep(300 * time.Millisecond)
	a.Samples2, r = dev.GetProcessUtilization(last)
	a.Samples2Ret = r.Error()
	_, r = dev.GetProcessUtilization(uint64(time.Now().Add(time.Hour).UnixMicro()))
	a.Samples3Ret = r.Error()
	_ = lib.Shutdown()
	if err := json.NewEncoder(os.Stdout).Encode(a); err != nil {
		return 1
	}
	return 0
}

// go-nvml (which calls the _v3 entry point and nvmlErrorString) reads the
// processes and their utilisation.
func TestGoNVML(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	holder := e.cmd(e.p.Workload, "alloc", "--api", "cuMemAlloc_v2", "--mib", "64", "--hold-ms", "-1")
	startHolder(t, holder)
	compute := e.cmd(e.p.Workload, "compute", "--kernel-us", "1000", "--seconds", "5")
	if err := compute.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = compute.Process.Kill()
		_ = compute.Wait()
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		d, _ := e.stat().Device(0)
		if p, ok := d.Proc(compute.Process.Pid); ok && p.BusyNs > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the compute process never ran")
		}
		time.Sleep(20 * time.Millisecond) // polling with a deadline
	}
	helper := exec.Command(os.Args[0]) //nolint:gosec // the test binary itself
	helper.Env = Env(e.p, e.state, goNVMLEnv+"="+e.p.LibDir)
	out, err := helper.Output()
	if err != nil {
		t.Fatalf("go-nvml helper: %v\n%s", err, out)
	}
	var a goNVMLAnswer
	if err := json.Unmarshal(out, &a); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	t.Logf("%+v", a)
	if a.ProcsRet != "Success" || len(a.Procs) != 2 {
		t.Fatalf("want two processes, got %s %+v", a.ProcsRet, a.Procs)
	}
	for _, p := range a.Procs {
		want := map[int]uint64{holder.Process.Pid: 64 << 20, compute.Process.Pid: 0}
		if mem, ok := want[int(p.Pid)]; !ok || p.UsedGpuMemory != mem || p.GpuInstanceId != 0xFFFFFFFF || p.ComputeInstanceId != 0xFFFFFFFF {
			t.Errorf("process %+v, want one of %v without MIG ids", p, want)
		}
	}
	if a.SamplesRet != "Insufficient Size" && a.SamplesRet != "Success" {
		t.Errorf("first utilisation answer: %s", a.SamplesRet)
	}
	if len(a.Samples2) != 1 || int(a.Samples2[0].Pid) != compute.Process.Pid || a.Samples2[0].SmUtil < 85 {
		t.Errorf("utilisation over 300 ms: want the compute process flat out, got %s %+v", a.Samples2Ret, a.Samples2)
	}
	if a.Samples3Ret != "Not Found" {
		t.Errorf("utilisation after a timestamp in the future: %s, want Not Found", a.Samples3Ret)
	}
}
