package arbiter

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/mgpu-dev/mgpu/internal/policy"
)

// TestAcceptance: issue 32's acceptance on the virtual clock, over random
// devices of 2 to 4 instances that all have demand throughout (saturating,
// or training steps that synchronise every 8 kernels), every policy: each
// instance within ε of its target by throughput against running alone
// (fixed-share: its core; the burst policies: its core's part of the
// cores), the larger instance not short on average by more than half a
// point, and under the burst policies the throughput shares adding up to
// at least 98.
func TestAcceptance(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(99, 7))
	n := 300
	if testing.Short() {
		n = 60
	}
	worst := map[policy.Policy]float64{}
	var larger float64
	cases := 0
	minSum := math.Inf(1)
	for i := range n {
		c := drawCase(rng, i)
		c.offline = nil
		all := len(c.online) >= 2
		for _, in := range c.online {
			all = all && in.kind != propArrivals
		}
		if !all {
			continue
		}
		var sp []simSpec
		var sum float64
		for _, in := range c.online {
			sp = append(sp, in.spec())
			sum += float64(in.core)
		}
		s := enforcerSim(c.pol, 11*sec, len(c.online), sp...)
		s.run()
		big, tot := 0, 0.0
		for j, in := range c.online {
			want := 100 * float64(in.core) / sum
			if c.pol == policy.FixedShare {
				want = float64(in.core)
			}
			got := s.share(j, sec, 11*sec) / in.alone
			tot += got
			if e := got - want; math.Abs(e) > math.Abs(worst[c.pol]) {
				worst[c.pol] = e
			}
			if math.Abs(got-want) > eps {
				t.Errorf("%s: instance %d: %.2f by throughput, want %.2f ± %v", c.name, j, got, want, eps)
			}
			if in.core > c.online[big].core {
				big = j
			}
		}
		want := 100 * float64(c.online[big].core) / sum
		if c.pol == policy.FixedShare {
			want = float64(c.online[big].core)
		}
		larger += s.share(big, sec, 11*sec)/c.online[big].alone - want
		cases++
		if c.pol != policy.FixedShare {
			minSum = min(minSum, tot)
		}
	}
	t.Logf("%d cases: worst error %v, the larger instance %+.3f on average, burst throughput shares add up to >= %.2f", cases, worst, larger/float64(cases), minSum)
	if larger/float64(cases) < -0.5 {
		t.Errorf("the larger instance is short by %.3f on average, want at most 0.5", -larger/float64(cases))
	}
	if minSum < 98 {
		t.Errorf("burst policies: throughput shares add up to %.2f, want >= 98", minSum)
	}
}
