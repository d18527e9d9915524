package shim_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

var allocAPIs = []string{"cuMemAlloc_v2", "cuMemAllocPitch_v2", "cuMemAllocManaged", "cuMemAllocAsync",
	"cuMemAllocFromPoolAsync", "cuMemCreate", "cuArrayCreate_v2", "cuArray3DCreate_v2"}

// The exported dynamic symbols are exactly the list in src/shim.def (+ dlsym),
// and the library needs nothing but libc.
func TestExports(t *testing.T) {
	t.Parallel()
	def, err := os.ReadFile("src/shim.def")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"dlsym"}
	for _, m := range regexp.MustCompile(`(?m)^MGPU_(?:CU|NVML)\((\w+)`).FindAllStringSubmatch(string(def), -1) {
		want = append(want, m[1])
	}
	sort.Strings(want)
	for _, lib := range []string{shimLib, asanLib} {
		out, err := exec.Command("nm", "-D", "--defined-only", lib).Output() //nolint:gosec // test
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			f := strings.Fields(l)
			if len(f) == 3 && (f[1] == "T" || f[1] == "W" || f[1] == "i") {
				got = append(got, f[2])
			} else if len(f) == 3 && lib == shimLib {
				t.Errorf("%s: unexpected exported symbol %q", lib, l)
			}
		}
		sort.Strings(got)
		if lib == asanLib {
			continue // the sanitizer runtime adds its own hooks
		}
		if strings.Join(got, " ") != strings.Join(want, " ") {
			t.Errorf("exported:\n got %v\nwant %v", got, want)
		}
	}
	out, err := exec.Command("readelf", "-d", shimLib).Output() //nolint:gosec // test
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range regexp.MustCompile(`\(NEEDED\).*\[(.*)\]`).FindAllStringSubmatch(string(out), -1) {
		switch m[1] {
		case "libc.so.6", "libdl.so.2", "libpthread.so.0":
		default:
			t.Errorf("needs %s", m[1])
		}
	}
}

// Programs that never use CUDA run unchanged and never contact the enforcer.
func TestNoCUDANoWork(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	s := newServer(t, e.run, 0)
	for _, asan := range []bool{false, true} {
		e.asan = asan
		r := e.run1("/bin/true")
		if r.code != 0 || r.err != "" {
			t.Fatalf("asan=%v: /bin/true: code %d stderr %q", asan, r.code, r.err)
		}
		r = e.run1("/bin/sh", "-c", "echo hello; ls / >/dev/null")
		if r.code != 0 || r.out != "hello\n" {
			t.Fatalf("asan=%v: sh: code %d out %q err %q", asan, r.code, r.out, r.err)
		}
	}
	if n := s.conns.Load(); n != 0 {
		t.Fatalf("%d connections from programs that do not use CUDA", n)
	}
}

func TestInfoReportsQuota(t *testing.T) {
	t.Parallel()
	for _, asan := range []bool{false, true} {
		t.Run(fmt.Sprintf("asan=%v", asan), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.asan = asan
			newServer(t, e.run, 0, withQuota(1024))
			for _, resolve := range []string{"direct", "proc", "runtime"} {
				r := e.wl("--resolve", resolve, "info")
				if r.code != 0 {
					t.Fatalf("%s: code %d: %s", resolve, r.code, r.err)
				}
				m := kv(r.out)
				for _, k := range []string{"device.0.total_mem", "device.0.mem_total", "device.0.mem_free",
					"nvml.0.total", "nvml.0.free", "nvml.0.v2.total", "nvml.0.v2.free"} {
					if got := u64(t, m, k); got != 1024*mib {
						t.Errorf("%s: %s=%d, want %d", resolve, k, got, 1024*mib)
					}
				}
			}
		})
	}
}

// A 1024 MiB quota shared by two processes: every allocation API is refused
// over the quota, and reports the quota in cuMemGetInfo.
func TestQuotaEveryAPI(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"direct", "proc", "runtime", "runtime-asan"} {
		resolve, asan := strings.CutSuffix(name, "-asan")
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.asan = asan
			s := newServer(t, e.run, 0, withQuota(1024))
			holder, lines, _ := e.bg(workload, "alloc", "--api", "cuMemAlloc_v2", "--mib", "600", "--hold-ms", "-1")
			waitLine(t, lines, "holding")
			if got := s.used(); got != 600*mib {
				t.Fatalf("instance uses %d after the holder's 600 MiB", got)
			}
			for _, api := range allocAPIs {
				r := e.wl("--resolve", resolve, "alloc", "--api", api, "--mib", "200", "--count", "3", "--free")
				if r.code != 2 {
					t.Errorf("%s: exit %d, want 2 (one allocation out of memory)\n%s%s", api, r.code, r.out, r.err)
					continue
				}
				for i, want := range []string{"CUDA_SUCCESS", "CUDA_SUCCESS", "CUDA_ERROR_OUT_OF_MEMORY"} {
					if !strings.Contains(r.out, fmt.Sprintf("alloc %d %s 200MiB -> %s", i, api, want)) {
						t.Errorf("%s: allocation %d is not %s:\n%s", api, i, want, r.out)
					}
				}
				// The first meminfo line is taken while 600+400 MiB are held.
				m := kv(strings.SplitN(r.out[strings.Index(r.out, "mem_free="):], "\n", 2)[0])
				if u64(t, m, "mem_total") != 1024*mib || u64(t, m, "mem_free") != 24*mib {
					t.Errorf("%s: meminfo %v, want total 1024 MiB free 24 MiB", api, m)
				}
				if got := s.used(); got != 600*mib {
					t.Errorf("%s: instance uses %d after the process exited, want %d", api, got, 600*mib)
				}
			}
			// The holder dies by SIGKILL; once its slot is reaped, its memory is free.
			_ = holder.Process.Kill()
			_ = holder.Wait()
			s.reap()
			if got := s.used(); got != 0 {
				t.Fatalf("instance uses %d after reaping the killed holder", got)
			}
			r := e.wl("--resolve", resolve, "alloc", "--api", "cuMemAlloc_v2", "--mib", "1000")
			if r.code != 0 {
				t.Fatalf("1000 MiB after the holder died: exit %d\n%s%s", r.code, r.out, r.err)
			}
		})
	}
}

// Eight processes churning allocations never take the instance over its
// quota, by the region's sum or by fakecuda's own count, and end at zero.
func TestChurnNeverExceeds(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	s := newServer(t, e.run, 0, withQuota(1024))
	var wg sync.WaitGroup
	var stop atomic.Bool
	var maxRegion, samples atomic.Uint64
	sampled := make(chan struct{})
	defer func() { stop.Store(true); <-sampled }()
	go func() {
		defer close(sampled)
		for !stop.Load() {
			if u := s.used(); u > maxRegion.Load() {
				maxRegion.Store(u)
			}
			samples.Add(1)
		}
	}()
	var maxFake uint64
	results := make([]result, 8)
	for i := range results {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			api := []string{"cuMemAlloc_v2", "cuMemAllocAsync", "cuMemCreate", "cuMemAllocManaged"}[i%4]
			results[i] = e.wl("alloc-churn", "--api", api, "--mib", "300", "--iterations", "1500", "--threads", "2")
		}(i)
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	for running := true; running; {
		select {
		case <-done:
			running = false
		default:
			if st := e.fcstatAny(); len(st.Devices) > 0 && st.Devices[0].MemUsed > maxFake {
				maxFake = st.Devices[0].MemUsed
			}
		}
	}
	stop.Store(true)
	<-sampled
	var ok, oom uint64
	for i, r := range results {
		if r.code != 0 {
			t.Fatalf("churn %d: exit %d\n%s%s", i, r.code, r.out, r.err)
		}
		m := kv(r.out)
		ok += u64(t, m, "ok")
		oom += u64(t, m, "oom")
	}
	t.Logf("ok=%d oom=%d max raw region sum %d MiB (%d samples), max fakecuda %d MiB", ok, oom, maxRegion.Load()/mib,
		samples.Load(), maxFake/mib)
	// The region's raw sum includes tentative reservations (added, then taken
	// back when over the limit), so only the driver's count is bounded at
	// every instant; the region must come back to exactly zero.
	if maxFake > 1024*mib {
		t.Fatalf("over the quota: fakecuda counted %d", maxFake)
	}
	if oom == 0 || ok == 0 {
		t.Fatalf("no contention: ok=%d oom=%d", ok, oom)
	}
	if u := s.used(); u != 0 {
		t.Fatalf("region sum %d at the end", u)
	}
	if u := e.fcstat().Devices[0].MemUsed; u != 0 {
		t.Fatalf("fakecuda mem_used %d at the end", u)
	}
}

// No enforcer: CUDA initialisation fails with one clear line; MGPU_FAIL_OPEN=1
// runs without limits.
func TestFailClosed(t *testing.T) {
	t.Parallel()
	for _, asan := range []bool{false, true} {
		t.Run(fmt.Sprintf("asan=%v", asan), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.asan = asan
			sock := filepath.Join(e.run, "gpu0", "client", "client.sock")
			for _, resolve := range []string{"direct", "runtime"} {
				r := e.wl("--resolve", resolve, "alloc", "--api", "cuMemAlloc_v2", "--mib", "1")
				lines := mgpuLines(r.err)
				if r.code == 0 || len(lines) != 1 || !strings.Contains(lines[0], "cannot attach to "+sock+": ") ||
					!strings.Contains(lines[0], "set MGPU_FAIL_OPEN=1") || !strings.Contains(r.err, "cuInit") {
					t.Fatalf("%s: exit %d, stderr:\n%s", resolve, r.code, r.err)
				}
			}
			// Refused by the enforcer: its message is shown.
			s := newServer(t, e.run, 0)
			msg := "no mgpu instance for this container"
			s.refuse.Store(&msg)
			r := e.wl("info")
			if lines := mgpuLines(r.err); r.code == 0 || len(lines) != 1 || !strings.Contains(lines[0], ": "+msg+";") {
				t.Fatalf("refused: exit %d, stderr:\n%s", r.code, r.err)
			}
			e.extra = []string{"MGPU_FAIL_OPEN=1"}
			r = e.wl("alloc", "--api", "cuMemAlloc_v2", "--mib", "2048")
			if lines := mgpuLines(r.err); r.code != 0 || len(lines) != 1 || !strings.Contains(lines[0], "WITHOUT limits") {
				t.Fatalf("fail-open: exit %d\n%s%s", r.code, r.out, r.err)
			}
		})
	}
}

// cuInit sends the attach request, lets the real driver initialise while
// the enforcer answers, and reads the reply after: the test server holds
// its answer until the process has the thread fakecuda's cuInit starts (its
// keeper), which a shim that waited for the reply before the real cuInit
// would never show.
func TestAttachBesideDriverInit(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	s := newServer(t, e.run, 0)
	saw := make(chan int, 4)
	hold := func(pid int) {
		deadline := time.Now().Add(5 * time.Second)
		for {
			ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
			if err == nil && len(ents) >= 2 || time.Now().After(deadline) {
				saw <- len(ents)
				return
			}
			time.Sleep(200 * time.Microsecond) // polling the process's threads, not waiting for time
		}
	}
	s.beforeReply.Store(&hold)
	r := e.wl("info")
	if r.code != 0 {
		t.Fatalf("info: exit %d\n%s%s", r.code, r.out, r.err)
	}
	if n := <-saw; n < 2 {
		t.Fatalf("the attach was answered only after 5 s without the real driver initialising (%d thread): cuInit waits for the reply before the driver", n)
	}
	if !strings.Contains(r.out, "device.0.mem_total=1073741824") {
		t.Fatalf("info does not report the quota:\n%s", r.out)
	}
}

// Small allocations reserve ahead (mgpu_region.h): a lone process still
// gets its whole quota, the instance reports what its allocations hold
// (not what was reserved ahead), and another process is refused no
// earlier than two chunks (min(4 MiB, quota / 256)) per other process
// before the quota, and never past it.
func TestReserveAhead(t *testing.T) {
	t.Parallel()
	const chunk = 64 * mib / 256 // 256 KiB for a 64 MiB quota
	e := newEnv(t)
	s := newServer(t, e.run, 0, withQuota(64))
	alloc := func(count int, extra ...string) []string {
		return append([]string{"alloc", "--api", "cuMemAlloc_v2", "--mib", "0.125", "--count", strconv.Itoa(count)}, extra...)
	}
	// Alone: 128 KiB at a time, exactly 512 of them fit.
	r := e.wl(alloc(600)...)
	if got := u64(t, kv(r.out), "allocated"); r.code != 2 || got != 512 {
		t.Fatalf("alone: exit %d, %d allocations of 128 KiB fit in 64 MiB, want 512\n%s", r.code, got, r.err)
	}
	if m := kv(r.out[strings.LastIndex(r.out, "mem_free="):]); u64(t, m, "mem_free") != 0 {
		t.Fatalf("alone, the quota allocated: meminfo %v, want mem_free 0", m)
	}
	// A holder of 1 MiB in 128 KiB allocations: 1 MiB is reported, what it
	// holds ahead is at most two chunks, and another process is told
	// 63 MiB are free.
	holder, lines, _ := e.bg(workload, alloc(8, "--hold-ms", "-1")...)
	defer func() { _ = holder.Process.Kill() }()
	waitLine(t, lines, "holding")
	held, reserved := s.reservedSum()
	if held != mib || reserved-held > 2*chunk {
		t.Fatalf("holder: holds %d and reserved %d, want 1 MiB and at most %d ahead", held, reserved, 2*chunk)
	}
	r = e.wl("info")
	if m := kv(r.out); u64(t, m, "device.0.mem_free") != 63*mib || u64(t, m, "nvml.0.used") != mib {
		t.Fatalf("beside the holder: %v, want mem_free 63 MiB and nvml used 1 MiB", m)
	}
	// Beside it: refused at most two chunks early, never over the quota.
	r = e.wl(alloc(600)...)
	got := u64(t, kv(r.out), "allocated")
	if lo, hi := uint64((63*mib-2*chunk)/(mib/8)), uint64(63*mib/(mib/8)); r.code != 2 || got < lo || got > hi {
		t.Fatalf("beside the holder: exit %d, %d allocations of 128 KiB, want %d to %d\n%s", r.code, got, lo, hi, r.err)
	}
	t.Logf("beside a holder of 1 MiB (%d bytes ahead): %d of 128 KiB allocated, %d fit in what is free", reserved-held, got, 63*mib/(mib/8))
}

// A forked child that uses CUDA attaches with its own slot.
func TestForkedChild(t *testing.T) {
	t.Parallel()
	for _, asan := range []bool{false, true} {
		t.Run(fmt.Sprintf("asan=%v", asan), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.asan = asan
			s := newServer(t, e.run, 0, withQuota(64))
			r := e.wl("fork", "--kernel-us", "1000")
			if r.code != 0 {
				t.Fatalf("exit %d\n%s%s", r.code, r.out, r.err)
			}
			pids := regexp.MustCompile(`(?m)^(parent|child|parent-after) pid=(\d+) ok`).FindAllStringSubmatch(r.out, -1)
			if len(pids) != 3 || pids[0][2] != pids[2][2] || pids[1][2] == pids[0][2] {
				t.Fatalf("output:\n%s", r.out)
			}
			claimed := s.claimedPids()
			if len(claimed) != 2 || claimed[0] != pids[0][2] || claimed[1] != pids[1][2] {
				t.Fatalf("attached pids %v, want parent %s then child %s", claimed, pids[0][2], pids[1][2])
			}
			if u := s.used(); u != 0 {
				t.Fatalf("instance uses %d at the end", u)
			}
		})
	}
}
