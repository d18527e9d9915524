package process

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/test/harness"
	tol "github.com/mgpu-dev/mgpu/test/shares"
)

// epsilon is the tolerance asserted: the normative 2 points,
// unless MGPU_STRICT_SHARES=0 asks for a regression guard (test/shares).
var epsilon = tol.Tolerance()

// load is one saturating workload of a share scenario.
type load struct {
	core int
	args []string // mgpu-workload compute options (after "compute"; "--class C" first: the instance's priority class)
}

func saturating(api string, kernelUS, depth int, extra ...string) []string {
	return append([]string{"--api", api, "--kernel-us", strconv.Itoa(kernelUS), "--depth", strconv.Itoa(depth)}, extra...)
}

// measureShares starts the loads on device 0 of a node with policy p, waits
// until they all launch, lets them settle for warm, and returns the share of
// device time (percent) each achieved over the window, measured from the
// simulated device's per-process busy time.
func measureShares(t testing.TB, p policy.Policy, loads []load, warm, win time.Duration) []float64 {
	t.Helper()
	return measureSharesOn(t, harness.NodeConfig{Policies: map[int]policy.Policy{0: p}}, loads, warm, win)
}

// measureSharesOn is measureShares on a node configured by nc (device 0's
// policy from nc.Policies).
func measureSharesOn(t testing.TB, nc harness.NodeConfig, loads []load, warm, win time.Duration) []float64 {
	t.Helper()
	shares, _ := measureSharesDev(t, nc, loads, warm, win)
	return shares
}

// measureSharesDev is measureSharesOn that also returns the device's busy
// share (percent) over the window.
func measureSharesDev(t testing.TB, nc harness.NodeConfig, loads []load, warm, win time.Duration) ([]float64, float64) {
	t.Helper()
	shares, dev, _ := measureAll(t, nc, loads, warm, win)
	return shares, dev
}

// measureAll is measureSharesDev that also returns each load's kernel
// throughput (harness.KernelShare, percent of the window).
func measureAll(t testing.TB, nc harness.NodeConfig, loads []load, warm, win time.Duration) ([]float64, float64, []float64) {
	t.Helper()
	p := nc.Policies[0]
	n := newNode(t, nc)
	secs := (warm + win + 5*time.Second).Seconds()
	procs := make([]harness.Proc, len(loads))
	for i, l := range loads {
		class := ""
		if len(l.args) > 1 && l.args[0] == "--class" {
			class, l.args = l.args[1], l.args[2:]
		}
		sh, err := n.ShellClass(0, l.core, 1024, class)
		if err != nil {
			t.Fatal(err)
		}
		args := []string{}
		if len(l.args) > 0 && l.args[0] == "--resolve" {
			args = append(args, l.args[:2]...)
			l.args = l.args[2:]
		}
		args = append(args, "compute", "--seconds", fmt.Sprintf("%.1f", secs))
		args = append(args, l.args...)
		if procs[i], err = sh.Spawn(args...); err != nil {
			t.Fatal(err)
		}
	}
	for _, pr := range procs {
		if err := pr.WaitOutput("start", 15*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(warm) // settling time before the window, not synchronisation
	ma := measured(t, n)
	hostA, hostErr := harness.ReadHostCPU()
	a, err := n.Sample()
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(win) // the measurement window
	b, err := n.Sample()
	if err != nil {
		t.Fatal(err)
	}
	mb := measured(t, n)
	hostB, err := harness.ReadHostCPU()
	if hostErr == nil {
		hostErr = err
	}
	shares := make([]float64, len(procs))
	kernels := make([]float64, len(procs))
	for i, pr := range procs {
		if !pr.Alive() {
			t.Fatalf("workload %d ended during the window:\n%s", i, pr.Output())
		}
		shares[i] = harness.Share(a, b, 0, map[int]bool{pr.PID: true})
		kernels[i] = harness.KernelShare(a, b, 0, map[int]bool{pr.PID: true})
	}
	dev := harness.Share(a, b, 0, nil)
	// What the enforcer charged, beside what the device ran: where a share
	// is off, this says whether the accounting or the arbitration is.
	charged := make([]float64, len(procs))
	for i, pr := range procs {
		charged[i] = 100 * float64(mb[pr.PID]-ma[pr.PID]) / float64(b.At.Sub(a.At))
	}
	t.Logf("measured by the shims (GPU time the enforcer charged): %v", round(charged))
	model := nc.DeviceModel
	if model == "" {
		model = "slice"
	}
	steal := "unknown"
	if hostErr == nil {
		steal = fmt.Sprintf("%.2f%%", harness.StealPercent(hostA, hostB))
	}
	hand, idle := holderChanges(a, b)
	cores := make([]int, len(loads))
	for i, l := range loads {
		cores[i] = l.core
	}
	t.Logf("%s shares over %v (device model %s), cores %v: %v (device %.2f%%, %.0f hand-offs/s, %.0f idle spells/s; host CPU stolen by the hypervisor: %s)",
		p, win, model, cores, round(shares), dev, hand, idle, steal)
	return shares, dev, kernels
}

// holderChanges is how often device 0 passed from one process to another
// (hand-offs) and was left with no holder (idle spells) between two
// samples, per second.
func holderChanges(a, b harness.Sample) (handoffs, idles float64) {
	da, _ := a.State.Device(0)
	db, _ := b.State.Device(0)
	s := b.At.Sub(a.At).Seconds()
	return float64(db.Handoffs-da.Handoffs) / s, float64(db.Idles-da.Idles) / s
}

// stats0 is device 0's GET /v1/stats.
func stats0(t testing.TB, n *harness.Node) []api.InstanceStats {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := n.Client(0).Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// measured returns the GPU time the shims measured per attached process
// (host pid), from device 0's enforcer.
func measured(t testing.TB, n *harness.Node) map[int]uint64 {
	t.Helper()
	out := map[int]uint64{}
	for _, in := range stats0(t, n) {
		for _, p := range in.Processes {
			out[p.PID] = p.GPUNs
		}
	}
	return out
}

func round(v []float64) []string {
	out := make([]string, len(v))
	for i, x := range v {
		out[i] = strconv.FormatFloat(x, 'f', 2, 64)
	}
	return out
}

func within(t testing.TB, what string, got, want float64) {
	t.Helper()
	if math.Abs(got-want) > epsilon {
		t.Errorf("%s: %.2f%%, want %.0f ± %.0f", what, got, want, epsilon)
	}
}

func TestFixedShare(t *testing.T) {
	win := tol.Window()
	for _, tc := range []struct {
		name  string
		loads []load
	}{
		{"30/70 launch 50us depth 1000", []load{{30, saturating("launch", 50, 1000)}, {70, saturating("launch", 50, 1000)}}},
		{"20/30/50 launch 1ms", []load{{20, saturating("launch", 1000, 4)}, {30, saturating("launch", 1000, 4)}, {50, saturating("launch", 1000, 4)}}},
		{"30/70 launchex 5ms", []load{{30, saturating("launchex", 5000, 4)}, {70, saturating("launchex", 5000, 4)}}},
		{"30/70 cuGetProcAddress_v2 50us", []load{{30, append([]string{"--resolve", "proc"}, saturating("launch", 50, 64)...)}, {70, append([]string{"--resolve", "proc"}, saturating("launch", 50, 64)...)}}},
		{"30/70 runtime path 500us", []load{{30, append([]string{"--resolve", "runtime"}, saturating("launch", 500, 8)...)}, {70, append([]string{"--resolve", "runtime"}, saturating("launch", 500, 8)...)}}},
		{"30/70 graph 5ms", []load{{30, saturating("graph", 5000, 2, "--graph-nodes", "4")}, {70, saturating("graph", 5000, 2, "--graph-nodes", "4")}}},
		{"30/70 graph 50us", []load{{30, saturating("graph", 50, 4, "--graph-nodes", "16")}, {70, saturating("graph", 50, 4, "--graph-nodes", "16")}}},
		// Each thread on its own stream: one instance's demand, counted once.
		{"30 two threads two streams / 70", []load{{30, saturating("launch", 200, 16, "--streams", "2", "--threads", "2")}, {70, saturating("launch", 200, 16)}}},
		{"30 four threads four streams 50us / 70", []load{{30, saturating("launch", 50, 64, "--streams", "4", "--threads", "4")}, {70, saturating("launch", 50, 64)}}},
		// Threads sharing one stream launch in turn; before they did, the
		// 30 went unmeasured and took 38-61 % of the device.
		{"30 four threads one stream 50us / 70", []load{{30, saturating("launch", 50, 64, "--threads", "4")}, {70, saturating("launch", 200, 16)}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			shareCase(t, func(t testing.TB) {
				shares := measureShares(t, policy.FixedShare, tc.loads, time.Second, win)
				for i, l := range tc.loads {
					within(t, fmt.Sprintf("instance %d (core %d)", i, l.core), shares[i], float64(l.core))
				}
			})
		})
	}
}

// The ASan/UBSan build of the shim enforces the same shares (the launch
// path with a shared stream and with two streams of one instance): a
// sanitizer report ends the workload (exit 99), which fails the window.
func TestFixedShareASan(t *testing.T) {
	nc := harness.NodeConfig{Policies: map[int]policy.Policy{0: policy.FixedShare}, ASan: true}
	loads := []load{{30, saturating("launch", 200, 16, "--streams", "2", "--threads", "2")}, {70, saturating("launch", 100, 64, "--threads", "2")}}
	shareCase(t, func(t testing.TB) {
		shares := measureSharesOn(t, nc, loads, time.Second, tol.Window())
		for i, l := range loads {
			within(t, fmt.Sprintf("instance %d (core %d, ASan shim)", i, l.core), shares[i], float64(l.core))
		}
	})
}

func TestFixedShareLoneInstanceCapped(t *testing.T) {
	forEachModelCase(t, testFixedShareLoneInstanceCapped)
}

func testFixedShareLoneInstanceCapped(t testing.TB, model string) {
	shares := measureSharesOn(t, onModel(policy.FixedShare, model), []load{{30, saturating("launch", 100, 64)}}, time.Second, tol.Window())
	if shares[0] > 30+epsilon {
		t.Errorf("a lone 30%% instance used %.2f%% of an otherwise idle GPU, want <= %.0f", shares[0], 30+epsilon)
	}
	if shares[0] < 30-epsilon {
		t.Errorf("a lone saturating 30%% instance got %.2f%%, want >= %.0f", shares[0], 30-epsilon)
	}
}

// TestNativeBurstShare: two saturating instances of weights 1 : 3 share
// the device 25 / 75 ± 2 under native-burst-share, with equal kernels and
// with different kernels and launch paths (issue 32's case: 700 µs
// launches beside 250 µs cuLaunchKernelEx), and keep it >= 97 % busy.
func TestNativeBurstShare(t *testing.T) {
	cases := []struct {
		name  string
		loads []load
	}{
		{"1:3 100us", []load{{1, saturating("launch", 100, 64)}, {3, saturating("launch", 100, 64)}}},
		{"10:30 700us / 250us launchex", []load{{10, saturating("launch", 700, 4)}, {30, saturating("launchex", 250, 8)}}},
	}
	forEachModel(t, func(t *testing.T, model string) {
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				shareCase(t, func(t testing.TB) {
					shares, dev := measureSharesDev(t, onModel(policy.NativeBurstShare, model), tc.loads, time.Second, tol.Window())
					within(t, fmt.Sprintf("weight %d", tc.loads[0].core), shares[0], 25)
					within(t, fmt.Sprintf("weight %d", tc.loads[1].core), shares[1], 75)
					busyAtLeast(t, dev, 97)
				})
			})
		}
	})
}

// TestGuaranteedBurstShare: 30/70 with the 70 idle → the 30 gets >= 95 % of
// the device; when the 70 resumes it gets >= 68 % measured over
// some 50 ms window ending by 100 ms after its first launch, and keeps it.
func TestGuaranteedBurstShare(t *testing.T) { forEachModelCase(t, testGuaranteedBurstShare) }

func testGuaranteedBurstShare(t testing.TB, model string) {
	n := newNode(t, onModel(policy.GuaranteedBurstShare, model))
	const idle = 4 * time.Second
	sa, err := n.Shell(0, 30, 1024)
	if err != nil {
		t.Fatal(err)
	}
	sb, err := n.Shell(0, 70, 1024)
	if err != nil {
		t.Fatal(err)
	}
	a, err := sa.Spawn("compute", "--api", "launch", "--kernel-us", "100", "--depth", "64", "--seconds", "12")
	if err != nil {
		t.Fatal(err)
	}
	b, err := sb.Spawn("compute", "--api", "launch", "--kernel-us", "100", "--depth", "64", "--seconds", "6",
		"--idle-ms", strconv.Itoa(int(idle/time.Millisecond)))
	if err != nil {
		t.Fatal(err)
	}
	if err := a.WaitOutput("start", 15*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := b.WaitOutput("idle ms=", 15*time.Second); err != nil {
		t.Fatal(err)
	}
	pa, pb := map[int]bool{a.PID: true}, map[int]bool{b.PID: true}
	time.Sleep(500 * time.Millisecond) // settle
	s0, err := n.Sample()
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second) // window
	s1, err := n.Sample()
	if err != nil {
		t.Fatal(err)
	}
	if got := harness.Share(s0, s1, 0, pa); got < 95 {
		t.Errorf("with the 70 idle the 30 got %.2f%% of the device, want >= 95", got)
	} else {
		t.Logf("70 idle: the 30 got %.2f%%", got)
	}
	// "Reaches >= 68 % within 100 ms": its share over some 50 ms window
	// that ends by 100 ms after its first launch. A 50 ms window holds only
	// about two hand-off cycles of a 30/70 pair (docs/arbiter.md), so one
	// fixed window reads anywhere from 60 to 85 % of a 70 % share; the
	// device is therefore sampled every 2 ms and every such window is read.
	// The samples carry the simulated device's own clock and its hold in
	// progress, so a window is exact to the microsecond. Sampling is one
	// process (harness.Watch: a process started per sample took most of a
	// core from the workloads), and starts just before the 70 is due back
	// (it prints when), not when this test notices its first launch: that
	// came up to 40 ms late, leaving one or two windows to read.
	due, ok := harness.StampAt(b.Output(), "until_mono_ns=")
	if !ok {
		t.Fatalf("the 70 did not say when it resumes: %q", b.Output())
	}
	time.Sleep(time.Until(due.Add(-20 * time.Millisecond))) // pacing of the samples, not synchronisation
	rs, resumed, err := watchThroughStart(n, b, 100*time.Millisecond, 2*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	best, bestAt := 0.0, time.Duration(0)
	for i := range rs {
		j := lastBefore(rs[:i], rs[i].At.Add(-50*time.Millisecond))
		if j < 0 || rs[i].At.After(resumed.Add(100*time.Millisecond)) {
			continue
		}
		if v := harness.Share(rs[j], rs[i], 0, pb); v > best {
			best, bestAt = v, rs[i].At.Sub(resumed).Round(time.Millisecond)
		}
	}
	time.Sleep(2 * time.Second)
	r1 := rs[len(rs)-1]
	r2, err := n.Sample()
	if err != nil {
		t.Fatal(err)
	}
	late := harness.Share(r1, r2, 0, pb)
	t.Logf("the 70 after resuming: best 50 ms window %.2f%% (ending %v after), %.2f%% over the next 2 s; the 30: %.2f%%",
		best, bestAt, late, harness.Share(r1, r2, 0, pa))
	if floor := 70 - epsilon; best < floor {
		t.Errorf("the 70 did not reach %.0f%% in any 50 ms window ending within 100 ms of resuming (best %.2f%%)", floor, best)
	}
	lateFloor := 70 - epsilon
	if late < lateFloor {
		t.Errorf("the 70 got %.2f%% over the 2 s after resuming, want >= %.0f", late, lateFloor)
	}
	if got := harness.Share(r1, r2, 0, pa); got < 30-epsilon {
		t.Errorf("the 30 got %.2f%% while both were busy, want >= %.0f", got, 30-epsilon)
	}
}

// watchThroughStart samples the simulated device every step until a
// sample is more than after past p's first launch (its "start mono_ns="),
// and returns the samples and that launch's time.
func watchThroughStart(n *harness.Node, p harness.Proc, after, step time.Duration) ([]harness.Sample, time.Time, error) {
	w, err := n.Watch(step)
	if err != nil {
		return nil, time.Time{}, err
	}
	var started time.Time
	waitErr := harness.WaitFor(15*time.Second, func() error {
		var ok bool
		if started, ok = harness.StartedAt(p.Output()); !ok {
			return fmt.Errorf("pid %d did not start launching: %q", p.PID, p.Output())
		}
		if rs := w.Samples(); len(rs) == 0 || !rs[len(rs)-1].At.After(started.Add(after)) {
			return fmt.Errorf("no sample %v after pid %d started yet", after, p.PID)
		}
		return nil
	})
	rs, err := w.Stop()
	if waitErr != nil {
		return nil, time.Time{}, waitErr
	}
	return rs, started, err
}

// lastBefore is the index of the last sample at or before t (-1: none).
func lastBefore(rs []harness.Sample, t time.Time) int {
	for j := len(rs) - 1; j >= 0; j-- {
		if !rs[j].At.After(t) {
			return j
		}
	}
	return -1
}
