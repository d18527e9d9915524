package process

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/test/harness"
	tol "github.com/mgpu-dev/mgpu/test/shares"
)

// allModels are the simulated GPU's device models the share suite runs
// under (DESIGN.md, "The simulated GPU"): enforcement must not depend on
// how the device interleaves the work of several processes.
var allModels = []string{"slice", "timer:1ms", "timer:2ms", "kernel"}

// deviceModels is the list of device models to run under:
// MGPU_DEVICE_MODELS (comma separated, e.g. "timer:1ms,kernel"), default
// all of them.
func deviceModels() []string {
	v := strings.TrimSpace(os.Getenv("MGPU_DEVICE_MODELS"))
	if v == "" {
		return allModels
	}
	var out []string
	for _, m := range strings.Split(v, ",") {
		if m = strings.TrimSpace(m); m != "" {
			out = append(out, m)
		}
	}
	return out
}

// forEachModel runs f as one subtest per device model.
func forEachModel(t *testing.T, f func(t *testing.T, model string)) {
	for _, m := range deviceModels() {
		t.Run(m, func(t *testing.T) { f(t, m) })
	}
}

// forEachModelCase runs share case f (shareCase) as one subtest per device
// model.
func forEachModelCase(t *testing.T, f func(t testing.TB, model string)) {
	forEachModel(t, func(t *testing.T, model string) {
		shareCase(t, func(t testing.TB) { f(t, model) })
	})
}

func onModel(p policy.Policy, model string) harness.NodeConfig {
	return harness.NodeConfig{Policies: map[int]policy.Policy{0: p}, DeviceModel: model}
}

// TestFixedShareUnderDeviceModels: the fixed-share cases that break a
// scheduler-dependent accounting: very different kernel lengths side by
// side, many instances with mixed kernels and launch paths, graphs of
// several kernels. Each instance within ±2 points over the window (the
// nearEdge cases: the regression tolerance).
func TestFixedShareUnderDeviceModels(t *testing.T) {
	win := tol.Window()
	resolve := func(how string, args []string) []string { return append([]string{"--resolve", how}, args...) }
	cases := []struct {
		name  string
		loads []load
	}{
		{"30/70 500us", []load{{30, saturating("launch", 500, 8)}, {70, saturating("launch", 500, 8)}}},
		{"20/30/50 1ms", []load{{20, saturating("launch", 1000, 4)}, {30, saturating("launch", 1000, 4)}, {50, saturating("launch", 1000, 4)}}},
		{"30 8ms / 70 100us launchex", []load{{30, saturating("launchex", 8000, 2)}, {70, saturating("launchex", 100, 64)}}},
		{"30 20ms / 70 50us", []load{{30, saturating("launch", 20000, 2)}, {70, saturating("launch", 50, 64)}}},
		{"30 runtime 1ms / 70 graph 10x500us", []load{{30, resolve("runtime", saturating("launch", 1000, 4))}, {70, saturating("graph", 500, 2, "--graph-nodes", "10")}}},
		{"six of 15 mixed", []load{
			{15, saturating("launch", 50, 64)},
			{15, resolve("proc", saturating("launch", 200, 16))},
			{15, resolve("runtime", saturating("launch", 1000, 4))},
			{15, saturating("launchex", 2000, 2)},
			{15, saturating("graph", 100, 4, "--graph-nodes", "5")},
			{15, saturating("coop", 500, 8)},
		}},
	}
	forEachModel(t, func(t *testing.T, model string) {
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				shareCase(t, func(t testing.TB) {
					shares, _ := measureSharesDev(t, onModel(policy.FixedShare, model), tc.loads, time.Second, win)
					for i, l := range tc.loads {
						if d := shares[i] - float64(l.core); d > epsilon || d < -epsilon {
							t.Errorf("instance %d (core %d, %s): %.2f%%, want %d ± %.0f", i, l.core, strings.Join(l.args, " "), shares[i], l.core, epsilon)
						}
					}
				})
			})
		}
	})
}

// TestGuaranteedBurstBothBusy: guaranteed-burst-share 30/70, both
// saturating with different kernels (500 µs launches against graphs of
// 10 × 400 µs): each within ±2 and the device busy >= 97 %.
func TestGuaranteedBurstBothBusy(t *testing.T) {
	loads := []load{{30, saturating("launch", 500, 8)}, {70, saturating("graph", 400, 2, "--graph-nodes", "10")}}
	forEachModelCase(t, func(t testing.TB, model string) {
		shares, dev := measureSharesDev(t, onModel(policy.GuaranteedBurstShare, model), loads, time.Second, tol.Window())
		within(t, "core 30", shares[0], 30)
		within(t, "core 70", shares[1], 70)
		busyAtLeast(t, dev, 97)
	})
}

func busyAtLeast(t testing.TB, dev, floor float64) {
	t.Helper()
	if dev < floor {
		t.Errorf("device busy %.2f%% with total demand >= 100 %%, want >= %.0f", dev, floor)
	}
}

// TestFixedShareSynchronisedSteps: training loops that read every step's
// result back (a step of kernels, then a synchronisation: the queue runs
// empty each step) split the device by their cores under fixed-share, under
// every device model. Their holds leave some device time idle, so the
// assertion is on each instance's part of the time the device ran their
// work (share / the shares' sum), within ±2 points, and on the device
// staying busy. A real GPU (H200, PyTorch matmul loops) showed the bug this
// guards: the smallest instance absorbed all the idle time, a 30 beside a
// 70 getting 21 % and a 20 beside a 30 and a 50 11 %; this simulated
// workload reproduced it (23.9 / 70.5).
func TestFixedShareSynchronisedSteps(t *testing.T) {
	step := func(kernelUS int) []string {
		return saturating("launch", kernelUS, 8, "--sync-every", "8", "--host-us", "10")
	}
	for _, tc := range []struct {
		name  string
		loads []load
	}{
		{"30/70 steps of 8 x 200us", []load{{30, step(200)}, {70, step(200)}}},
		{"20/30/50 steps of 8 x 500us", []load{{20, step(500)}, {30, step(500)}, {50, step(500)}}},
		// Beside a saturating 70 the 30's steps ran at 18.6 (16.2 under
		// kernel) and the 70 at 78.8, over its cap.
		{"30 steps of 8 x 200us / 70 saturating", []load{{30, step(200)}, {70, saturating("launch", 200, 8)}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			forEachModelCase(t, func(t testing.TB, model string) {
				shares, dev := measureSharesDev(t, onModel(policy.FixedShare, model), tc.loads, time.Second, tol.Window())
				var sum float64
				for _, s := range shares {
					sum += s
				}
				for i, l := range tc.loads {
					within(t, fmt.Sprintf("instance %d (core %d): part of the device time used", i, l.core), 100*shares[i]/sum, float64(l.core))
				}
				if dev < 85 {
					t.Errorf("device busy %.2f%%, want >= 85 (one such loop alone keeps it about 96%% busy)", dev)
				}
			})
		})
	}
}

// TestOnlineOfflineShares: two online fixed-share instances of 30 and 40
// beside a saturating offline one (online_offline_switch = 1): the online
// ones get 30 and 40 ± 2 as if alone, and the offline one the rest of the
// device: at most 2 points of it idle (issue 18; docs/arbiter.md "Online
// and offline instances"), under every device model. (Against a fixed 30
// the offline one measured 27.98-29.35: the online ones overrun their caps
// by up to 0.8 points beside it, which comes out of its time.)
func TestOnlineOfflineShares(t *testing.T) {
	loads := []load{
		{30, saturating("launch", 200, 16)},
		{40, saturating("launch", 200, 16)},
		{50, append([]string{"--class", "offline"}, saturating("launch", 200, 16)...)},
	}
	forEachModelCase(t, func(t testing.TB, model string) {
		nc := onModel(policy.FixedShare, model)
		nc.OnlineOffline = 1
		shares, _ := measureSharesDev(t, nc, loads, time.Second, tol.Window())
		within(t, "online 30", shares[0], 30)
		within(t, "online 40", shares[1], 40)
		if rest := 100 - shares[0] - shares[1]; shares[2] < rest-epsilon {
			t.Errorf("offline: %.2f%% of the %.2f%% the online instances leave, want all of it - %.0f", shares[2], rest, epsilon)
		}
	})
}

// stepLoss bounds what the online step loop of TestOnlineStepsBesideOffline
// may lose beside offline work. With G the loop loses 0.8–2.9 points per
// 4 s window on the 2-vCPU CI VM (no offline work runs in its gaps: the
// loss is the host time of the wake-ups that report its quiet, which the
// loop alone does not pay; 2026-12-06/07, several loop variants), and
// 5–12 when the fill is granted before G ends, which is what this guards
// against; a bound of 2 failed correct code in CI.
const stepLoss = 3.0

// TestOnlineStepsBesideOffline: an online training loop (8 kernels of
// 250 µs, then a synchronisation and 120 µs on the host) keeps its
// throughput beside a saturating offline instance (online_offline_switch
// 1) within stepLoss points of what it has alone, under every device model:
// its host gaps are shorter than the quiet grace G, so offline work never
// gets in between its steps (docs/arbiter.md "What an online request finds
// on the device").
func TestOnlineStepsBesideOffline(t *testing.T) {
	step := saturating("launch", 250, 8, "--sync-every", "8", "--host-us", "120")
	offline := append([]string{"--class", "offline"}, saturating("launch", 200, 16)...)
	forEachModelCase(t, func(t testing.TB, model string) {
		nc := onModel(policy.FixedShare, model)
		nc.OnlineOffline = 1
		_, _, alone := measureAll(t, nc, []load{{100, step}}, time.Second, 4*time.Second)
		_, _, beside := measureAll(t, nc, []load{{100, step}, {100, offline}}, time.Second, 4*time.Second)
		t.Logf("the step loop's kernel throughput alone %.2f %%, beside the offline instance %.2f %% (offline %.2f %%)", alone[0], beside[0], beside[1])
		if beside[0] < alone[0]-stepLoss {
			t.Errorf("the online step loop beside the offline instance: %.2f %% of the device in kernels, alone %.2f: more than %.0f points less", beside[0], alone[0], stepLoss)
		}
	})
}

// TestSharesByThroughput: training loops that synchronise every 8 kernels
// of 250 µs and spend 10 µs on the host (issue 32's "steps" rows), on a
// device that spends 20 µs of its own before each kernel (so a loop alone
// keeps it busy with kernels about 91 % of the time), under every device
// model and every policy, judged as a user judges them: each instance's
// kernel throughput beside the other divided by the same loop's throughput
// alone, within ±2 points of its target; under the burst policies the two
// add up to at least 98.
//
// Two such loops beside each other once kept the device 95–98 % busy where
// one alone keeps it 99 %, the larger instance 1–3 points short (issue 32):
// every tick and every grant's wake-up took host time inside the loops'
// synchronisation gaps on a 2-vCPU host (docs/arbiter-history.md).
func TestSharesByThroughput(t *testing.T) {
	win := tol.Window()
	step := saturating("launch", 250, 8, "--sync-every", "8", "--host-us", "10")
	for _, model := range deviceModels() {
		t.Run(model, func(t *testing.T) {
			dev := model + "+gap:20us"
			_, _, alone := measureAll(t, onModel(policy.NativeBurstShare, dev), []load{{100, step}}, time.Second, win)
			t.Logf("alone: kernels ran %.2f%% of the time", alone[0])
			if alone[0] <= 0 {
				t.Fatal("no throughput alone")
			}
			for _, tc := range []struct {
				p      policy.Policy
				cores  [2]int
				target [2]float64
			}{
				{policy.FixedShare, [2]int{30, 70}, [2]float64{30, 70}},
				{policy.GuaranteedBurstShare, [2]int{30, 70}, [2]float64{30, 70}},
				{policy.NativeBurstShare, [2]int{10, 30}, [2]float64{25, 75}},
			} {
				t.Run(tc.p.String(), func(t *testing.T) {
					shareCase(t, func(t testing.TB) {
						_, _, k := measureAll(t, onModel(tc.p, dev), []load{{tc.cores[0], step}, {tc.cores[1], step}}, time.Second, win)
						var sum float64
						for i := range k {
							got := 100 * k[i] / alone[0]
							sum += got
							t.Logf("core %d: throughput %.2f%% of alone (target %.0f)", tc.cores[i], got, tc.target[i])
							within(t, fmt.Sprintf("core %d: throughput against alone", tc.cores[i]), got, tc.target[i])
						}
						if tc.p != policy.FixedShare && sum < 98 {
							t.Errorf("the throughput shares add up to %.2f, want >= 98 (burst policies, demand >= 100)", sum)
						}
					})
				})
			}
		})
	}
}
