package shim_test

import (
	"os"
	"strconv"
	"testing"
)

// TestOverhead measures what the shim adds per launch (fast path, grant set)
// and per allocation+free pair on fakecuda, side by side in one run.  It
// logs the numbers; MGPU_SHIM_BENCH_ASSERT=1 also asserts the launch target
// (<= 50 ns added), which needs a quiet machine.
func TestOverhead(t *testing.T) {
	e := newEnv(t)
	newServer(t, e.run, 0, withQuota(4096))
	best := func(pre bool, key string, args ...string) float64 {
		e.nopre = !pre
		defer func() { e.nopre = false }()
		b := 0.0
		for i := 0; i < 5; i++ {
			r := e.wl(args...)
			if r.code != 0 {
				t.Fatalf("%v: exit %d: %s", args, r.code, r.err)
			}
			v, err := strconv.ParseFloat(kv(r.out)[key], 64)
			if err != nil {
				t.Fatalf("%v: %s: %v", args, r.out, err)
			}
			if i == 0 || v < b {
				b = v
			}
		}
		return b
	}
	launch := []string{"bench-launch", "--n", "200000"}
	alloc := []string{"bench-alloc", "--n", "20000"}
	l0, l1 := best(false, "ns_per_launch", launch...), best(true, "ns_per_launch", launch...)
	a0, a1 := best(false, "ns_per_alloc", alloc...), best(true, "ns_per_alloc", alloc...)
	t.Logf("launch: %.1f ns without the shim, %.1f ns with it: +%.1f ns", l0, l1, l1-l0)
	t.Logf("alloc+free: %.1f ns without the shim, %.1f ns with it: +%.1f ns", a0, a1, a1-a0)
	if os.Getenv("MGPU_SHIM_BENCH_ASSERT") == "1" && l1-l0 > 50 {
		t.Fatalf("the shim adds %.1f ns per launch (target 50)", l1-l0)
	}
}
