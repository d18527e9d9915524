package process

import (
	"context"
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/test/harness"
)

var allocAPIs = []string{
	"cuMemAlloc_v2", "cuMemAllocPitch_v2", "cuMemAllocManaged", "cuMemAllocAsync",
	"cuMemAllocFromPoolAsync", "cuMemCreate", "cuArrayCreate_v2", "cuArray3DCreate_v2",
}

// TestQuotaSharedByTwoProcesses: a 1024 MiB quota shared by two processes of
// one instance; the allocation that would pass it fails with
// CUDA_ERROR_OUT_OF_MEMORY whichever API makes it; cuMemGetInfo reports the
// quota; a SIGKILLed process's memory is available again within 1 s.
func TestQuotaSharedByTwoProcesses(t *testing.T) { bothShims(t, testQuotaSharedByTwoProcesses) }

func testQuotaSharedByTwoProcesses(t *testing.T, asan bool) {
	n := newNode(t, harness.NodeConfig{ASan: asan})
	sh, err := n.Shell(0, 10, 1024)
	if err != nil {
		t.Fatal(err)
	}
	for _, apiName := range allocAPIs {
		t.Run(apiName, func(t *testing.T) {
			holder, err := sh.Spawn("alloc", "--api", apiName, "--mib", "600", "--hold-ms", "-1")
			if err != nil {
				t.Fatal(err)
			}
			if err := holder.WaitOutput("holding", 10*time.Second); err != nil {
				t.Fatal(err)
			}
			info := runToEnd(t, sh, "info")
			if total := kv(t, info, "device.0.mem_total"); total != 1024<<20 {
				t.Errorf("cuMemGetInfo total %d, want %d (the quota)", total, 1024<<20)
			}
			if free := kv(t, info, "device.0.mem_free"); free != 424<<20 {
				t.Errorf("cuMemGetInfo free %d, want %d", free, 424<<20)
			}
			if total := kv(t, info, "device.0.total_mem"); total != 1024<<20 {
				t.Errorf("cuDeviceTotalMem %d, want the quota", total)
			}
			over := runToEnd(t, sh, "alloc", "--api", apiName, "--mib", "600")
			if !strings.Contains(over, "-> CUDA_ERROR_OUT_OF_MEMORY (2)") {
				t.Fatalf("second 600 MiB allocation did not fail with OOM:\n%s", over)
			}
			if err := syscall.Kill(holder.PID, syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			killed := time.Now()
			if err := holder.WaitExit(time.Second); err != nil {
				t.Fatal(err)
			}
			// The dead process's reservation must come back within 1 s.
			var last string
			err = harness.WaitFor(time.Second-time.Since(killed), func() error {
				last = runToEnd(t, sh, "alloc", "--api", apiName, "--mib", "600", "--free")
				if strings.Contains(last, "-> CUDA_SUCCESS (0)") {
					return nil
				}
				return fmt.Errorf("still out of memory")
			})
			if err != nil {
				t.Fatalf("600 MiB not available within 1 s of SIGKILL: %v\n%s", err, last)
			}
		})
	}
}

// TestChurnNeverExceedsQuota: 8 processes allocating and freeing
// concurrently in one instance never exceed the quota, as the simulated
// device's own counter shows, and end at zero.
func TestChurnNeverExceedsQuota(t *testing.T) { bothShims(t, testChurnNeverExceedsQuota) }

func testChurnNeverExceedsQuota(t *testing.T, asan bool) {
	n := newNode(t, harness.NodeConfig{ASan: asan})
	const quotaMiB = 1024
	sh, err := n.Shell(0, 10, quotaMiB)
	if err != nil {
		t.Fatal(err)
	}
	var procs []harness.Proc
	for i := 0; i < 8; i++ {
		p, err := sh.Spawn("alloc-churn", "--api", allocAPIs[i%len(allocAPIs)], "--mib", "192", "--iterations", "200000", "--threads", "2")
		if err != nil {
			t.Fatal(err)
		}
		procs = append(procs, p)
	}
	var peak uint64
	samples := 0
	for {
		running := false
		for _, p := range procs {
			running = running || p.Alive()
		}
		s, err := n.Sample()
		if err != nil {
			t.Fatal(err)
		}
		d, _ := s.State.Device(0)
		peak = max(peak, d.MemUsed)
		samples++
		if d.MemUsed > quotaMiB<<20 {
			t.Fatalf("device holds %d MiB for a %d MiB quota", d.MemUsed>>20, quotaMiB)
		}
		if !running {
			break
		}
	}
	oomSeen := 0
	for _, p := range procs {
		out := p.Output()
		if !strings.Contains(out, "churn api=") {
			t.Fatalf("pid %d did not finish its churn:\n%s", p.PID, out)
		}
		if m := regexp.MustCompile(`oom=(\d+) errors=(\d+)`).FindStringSubmatch(out); m != nil {
			if m[2] != "0" {
				t.Errorf("pid %d: errors other than OOM: %s", p.PID, out)
			}
			v, _ := strconv.Atoi(m[1])
			oomSeen += v
		}
	}
	s, err := n.Sample()
	if err != nil {
		t.Fatal(err)
	}
	if d, _ := s.State.Device(0); d.MemUsed != 0 {
		t.Errorf("device holds %d bytes after every process ended", d.MemUsed)
	}
	err = harness.WaitFor(2*time.Second, func() error {
		st, err := n.Client(0).Stats(context.Background())
		if err != nil {
			return err
		}
		for _, is := range st {
			if is.MemoryUsedBytes != 0 {
				return fmt.Errorf("instance %s still accounts %d bytes", is.Name, is.MemoryUsedBytes)
			}
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}
	t.Logf("peak %d MiB of %d over %d samples; %d allocations refused", peak>>20, quotaMiB, samples, oomSeen)
	if oomSeen == 0 {
		t.Errorf("no allocation was refused: 8 processes × 2 threads × 192 MiB should contend for 1024 MiB")
	}
}

// TestRuntimeResolvePathLimited: a workload that resolves the driver like
// the CUDA runtime (dlopen + dlsym(handle, "cuGetProcAddress_v2")) is
// limited like the others.
func TestRuntimeResolvePathLimited(t *testing.T) { bothShims(t, testRuntimeResolvePathLimited) }

func testRuntimeResolvePathLimited(t *testing.T, asan bool) {
	n := newNode(t, harness.NodeConfig{ASan: asan})
	sh, err := n.Shell(0, 10, 1024)
	if err != nil {
		t.Fatal(err)
	}
	info := runToEnd(t, sh, "--resolve", "runtime", "info")
	if total := kv(t, info, "device.0.mem_total"); total != 1024<<20 {
		t.Errorf("runtime path: total %d, want the quota", total)
	}
	for _, apiName := range []string{"cuMemAlloc_v2", "cuMemAllocAsync", "cuMemCreate"} {
		out := runToEnd(t, sh, "--resolve", "runtime", "alloc", "--api", apiName, "--mib", "700", "--count", "2")
		if !strings.Contains(out, "alloc 0 "+apiName+" 700MiB -> CUDA_SUCCESS") || !strings.Contains(out, "alloc 1 "+apiName+" 700MiB -> CUDA_ERROR_OUT_OF_MEMORY (2)") {
			t.Errorf("%s through the runtime path not limited:\n%s", apiName, out)
		}
	}
}

// TestOutsideInstanceFailsClosed: a process in no instance cannot initialise
// CUDA and is told why in one line; MGPU_FAIL_OPEN=1 lets it run.
func TestOutsideInstanceFailsClosed(t *testing.T) { bothShims(t, testOutsideInstanceFailsClosed) }

func testOutsideInstanceFailsClosed(t *testing.T, asan bool) {
	n := newNode(t, harness.NodeConfig{ASan: asan})
	cmd := exec.Command(n.Paths.Workload, "info")
	cmd.Env = n.ShimEnv(0)
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("workload outside any instance succeeded:\n%s", out)
	}
	var mgpuLines []string
	for _, l := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(l, "mgpu: ") {
			mgpuLines = append(mgpuLines, l)
		}
	}
	if len(mgpuLines) != 1 || !strings.Contains(mgpuLines[0], "no mgpu instance") {
		t.Errorf("want one clear mgpu: line, got:\n%s", out)
	}
	cmd = exec.Command(n.Paths.Workload, "info")
	cmd.Env = n.ShimEnv(0, "MGPU_FAIL_OPEN=1")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("MGPU_FAIL_OPEN=1: %v\n%s", err, out)
	}
	// A process that never calls CUDA is not affected at all.
	cmd = exec.Command("/bin/true")
	cmd.Env = n.ShimEnv(0)
	if out, err := cmd.CombinedOutput(); err != nil || len(out) != 0 {
		t.Errorf("/bin/true with the shim preloaded: %v %q", err, out)
	}
}

// TestForkedChildLimited: a child forked by a CUDA process is attached on
// its own and limited by the same instance.
func TestForkedChildLimited(t *testing.T) { bothShims(t, testForkedChildLimited) }

func testForkedChildLimited(t *testing.T, asan bool) {
	n := newNode(t, harness.NodeConfig{ASan: asan})
	sh, err := n.Shell(0, 10, 1024)
	if err != nil {
		t.Fatal(err)
	}
	out := runToEnd(t, sh, "fork", "--kernel-us", "100")
	for _, want := range []string{"parent", "child", "parent-after"} {
		if !regexp.MustCompile(`(?m)^` + want + ` .*ok`).MatchString(out) {
			t.Errorf("fork: no %q ok line:\n%s", want, out)
		}
	}
	if strings.Contains(out, "mgpu:") {
		t.Errorf("fork printed an mgpu error:\n%s", out)
	}
}

// bothShims runs a test with the shim and with its ASan/UBSan build.
func bothShims(t *testing.T, f func(t *testing.T, asan bool)) {
	for _, asan := range []bool{false, true} {
		t.Run(map[bool]string{false: "shim", true: "asan"}[asan], func(t *testing.T) { f(t, asan) })
	}
}

// runToEnd spawns mgpu-workload args in the shell and returns its output
// once it exits.
func runToEnd(t *testing.T, sh *harness.Shell, args ...string) string {
	t.Helper()
	p, err := sh.Spawn(args...)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.WaitExit(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	return p.Output()
}

// kv returns the integer value of key in key=value output.
func kv(t *testing.T, out, key string) uint64 {
	t.Helper()
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(key) + `=(\d+)`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("no %s in output:\n%s", key, out)
	}
	v, _ := strconv.ParseUint(m[1], 10, 64)
	return v
}
