package process

import (
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/test/fakecuda"
	"github.com/mgpu-dev/mgpu/test/harness"
)

// TestOnlineRequestsBesideOffline: an online request server (bursts of 10
// kernels of 200 µs every 5 ms, 40 % of the device) alone, then beside a
// saturating offline instance of 200 µs kernels (issues 18 and 35), under
// every device model and both online_offline_switch values that let
// offline work in.
//
// What mgpu controls is judged on the device's own timeline
// (fakecuda-ctl kernels): for each of ≥ 2,000 requests beside the offline
// instance, the device time the offline kernels ran between the request's
// first launch and the end of its last kernel. Its p99 stays within the
// bound docs/arbiter.md states ("Online and offline instances"): one
// offline kernel and 0.1 ms under switch 2, the offline queue bound
// (500 µs), one kernel and 0.1 ms under switch 1. Under switch 1 the
// offline instance fills at least 80 % of the time the server leaves idle
// (docs/arbiter.md; switch 2, which trades fill for latency, at least
// 60 %); the device's busy time is logged: its budget (>= 95 % under
// switch 1) is the bench's, on a quiet machine: inside one CI's whole
// test/process run the timer models read 93.8-94.6 (another 98.0-98.5). The median
// request, timed by the server's host clock, is at most slack later than
// alone (a fill that does not happen, or a request that waits for the
// enforcer's tick: up to 4 ms); the host-side tail is the bench's
// (`make bench -only priority`), with the host's scheduling in it. A case
// that misses is measured once more on a fresh node (shareCase): with a
// compiler on both CPUs the enforcer's wake-up comes late and the kernel
// model's p99 under switch 2 read 0.8 ms where a quiet host gives 0.24.
func TestOnlineRequestsBesideOffline(t *testing.T) {
	bounds := map[int]time.Duration{1: harness.OfflineDelayBound(1, 200*time.Microsecond), 2: harness.OfflineDelayBound(2, 200*time.Microsecond)}
	forEachModel(t, func(t *testing.T, model string) {
		for _, sw := range []int{2, 1} {
			t.Run(fmt.Sprintf("switch %d", sw), func(t *testing.T) {
				shareCase(t, func(t testing.TB) {
					nc := onModel(policy.FixedShare, model)
					nc.OnlineOffline = sw
					n := newNode(t, nc)
					alone := serveRequests(t, n, 3, nil)
					beside := serveRequests(t, n, 10.5, func() *harness.Job {
						return startJob(t, n, harness.RunSpec{Device: 0, Core: 100, MemoryMiB: 256, Class: "offline",
							Args: append([]string{"compute", "--seconds", "60"}, saturating("launch", 200, 16)...)})
					})
					a, b := median(alone.lat), median(beside.lat)
					d := harness.Percentiles(beside.delays, 50, 99, 100)
					t.Logf("switch %d: the offline kernels added, on the device, p50 %v p99 %v max %v to %d requests (bound %v at p99); median request %v alone, %v beside (host clock); the offline instance got %.1f %% of the idle time, the device was %.1f %% busy",
						sw, d[0], d[1], d[2], len(beside.delays), bounds[sw], a, b, beside.fill, beside.busy)
					if len(beside.delays) < 2000 {
						t.Errorf("%d requests beside the offline instance, want >= 2000", len(beside.delays))
					}
					if d[1] > bounds[sw] {
						t.Errorf("p99 of the device time offline kernels added to a request: %v, bound %v", d[1], bounds[sw])
					}
					if slack := 600 * time.Microsecond * time.Duration(3-sw); b > a+slack {
						t.Errorf("median request %v beside the offline instance, %v alone: more than %v later", b, a, slack)
					}
					if fill := map[int]float64{1: 80, 2: 60}[sw]; beside.fill < fill {
						t.Errorf("the offline instance got %.1f %% of the time the online one left idle, want >= %v", beside.fill, fill)
					}
				})
			})
		}
	})
}

// served is what serveRequests measured.
type served struct {
	lat    []time.Duration // each request's latency, by the server's clock
	delays []time.Duration // beside something: what its kernels added to each request on the device
	fill   float64         // beside something: its part of the device time the server left idle (percent)
	busy   float64         // beside something: the device's busy time (percent)
}

// serveRequests runs the request server for secs seconds, beside what
// start starts (nil: alone).
func serveRequests(t testing.TB, n *harness.Node, secs float64, start func() *harness.Job) served {
	t.Helper()
	var (
		other *harness.Job
		log   *fakecuda.KernelLog
		r     served
	)
	if start != nil {
		other = start()
		var err error
		if log, err = n.FollowKernels(0); err != nil {
			t.Fatal(err)
		}
	}
	a, err := n.Sample()
	if err != nil {
		t.Fatal(err)
	}
	j := startJob(t, n, harness.RunSpec{Device: 0, Core: 60, MemoryMiB: 256, Class: "online",
		Args: []string{"serve", "--kernel-us", "200", "--burst", "10", "--period-ms", "5", "--seconds", strconv.FormatFloat(secs, 'f', -1, 64), "--raw"}})
	srv := j.Pids() // while it runs (it has printed its start line)
	select {
	case <-j.Done():
	case <-time.After(time.Duration(secs*float64(time.Second)) + 60*time.Second):
		t.Fatal("serve did not finish")
	}
	z, err := n.Sample()
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^lat_us=([0-9]+)$`).FindAllStringSubmatch(j.Output(), -1)
	if len(m) < 100 {
		t.Fatalf("serve printed %d latencies: %s", len(m), j.Output())
	}
	for _, l := range m {
		us, _ := strconv.Atoi(l[1])
		r.lat = append(r.lat, time.Duration(us)*time.Microsecond)
	}
	if other == nil {
		return r
	}
	runs, err := log.Stop()
	if err != nil {
		t.Fatal(err)
	}
	o := harness.Share(a, z, 0, other.Pids())
	r.busy = harness.Share(a, z, 0, nil)
	on := r.busy - o
	r.fill = 100 * o / (100 - on)
	other.Kill()
	_ = other.Wait()
	reqs, err := harness.ParseRequests(j.Output())
	if err != nil {
		t.Fatal(err)
	}
	off := other.Pids()
	r.delays, err = harness.DeviceDelays(runs, func(p int) bool { return srv[p] }, func(p int) bool { return off[p] }, reqs, log.From)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// startJob starts a workload and waits until it prints its start line.
func startJob(t testing.TB, n *harness.Node, spec harness.RunSpec) *harness.Job {
	t.Helper()
	j, err := n.Start(spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(j.Kill)
	if err := j.WaitStarted(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	return j
}

func median(v []time.Duration) time.Duration {
	s := append([]time.Duration(nil), v...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}
