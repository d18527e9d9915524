package arbiter

import (
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/internal/policy"
)

// clone returns an independent copy of a (the instances hold no pointers).
func clone(a *Arbiter) *Arbiter {
	b := *a
	b.inst = slices.Clone(a.inst)
	b.index = maps.Clone(a.index)
	b.out = make([]int, 0, 1)
	return &b
}

func holderOf(a *Arbiter) int {
	if id, ok := a.Holder(); ok {
		return id
	}
	return -1
}

// model is NextDecision's assumption made true: every instance waits for
// the grant, the holder runs 50 µs kernels back to back and is charged one
// nanosecond per nanosecond (a full queue, reported at once), nobody else
// is charged.
type model struct {
	usage map[int]Usage
	at    time.Duration // time of the last advance
}

func newModel(a *Arbiter) *model {
	m := &model{usage: map[int]Usage{}}
	for _, in := range a.inst {
		m.usage[in.id] = Usage{Waiting: true}
	}
	return m
}

// usageAt returns the usage at now (without recording it).
func (m *model) usageAt(a *Arbiter, now time.Duration) map[int]Usage {
	u := maps.Clone(m.usage)
	h, ok := a.Holder()
	for id, x := range u {
		x.Waiting = !ok || id != h
		if ok && id == h {
			dt := now - m.at
			x.GPUTime += dt
			x.Launches += uint64(dt / (50 * us))
			x.Queued = DefaultMaxQueued
		} else {
			x.Queued = 0
		}
		u[id] = x
	}
	return u
}

// TestNextDecisionExact drives arbiters under NextDecision's assumptions
// and ticks exactly where it says: at each step a Tick 1 µs before the
// returned time must leave the grant where it is, and a Tick 1 µs after it
// must move it (every foreseen event happens in this model: credits run
// out, candidates overtake by the hysteresis or at a quantum's end, a
// fixed-share instance reaches its entry threshold). Too late a time fails
// the first check, too early a time the second.
func TestNextDecisionExact(t *testing.T) {
	t.Parallel()
	six := make([]int, 16)
	for i := range six {
		six[i] = 6
	}
	for _, p := range []policy.Policy{policy.FixedShare, policy.GuaranteedBurstShare, policy.NativeBurstShare} {
		for _, core := range [][]int{{30}, {30, 70}, {20, 30, 50}, {60, 80}, six} {
			for _, q := range []time.Duration{DefaultQuantum, 20 * ms} {
				if len(core) == 1 && p != policy.FixedShare {
					continue // a lone burst holder never loses the grant
				}
				t.Run(fmt.Sprintf("%v/%v/q=%v", p, core, q), func(t *testing.T) {
					t.Parallel()
					a := New(Config{Policy: p, Quantum: q})
					for i, c := range core {
						a.Add(i, c)
					}
					m := newModel(a)
					// Settle: 1 ms ticks for 300 ms.
					for now := time.Duration(0); now <= 300*ms; now += ms {
						u := m.usageAt(a, now)
						a.Tick(now, u)
						m.usage, m.at = u, now
					}
					for step := range 300 {
						n := a.NextDecision()
						if n == Never || n <= m.at {
							t.Fatalf("step %d at %v: NextDecision %v", step, m.at, n)
						}
						before, after := clone(a), clone(a)
						h := holderOf(a)
						before.Tick(n-us, m.usageAt(before, n-us))
						if got := holderOf(before); got != h {
							t.Fatalf("step %d: the grant moved %d -> %d at %v, before NextDecision %v (last tick %v)", step, h, got, n-us, n, m.at)
						}
						after.Tick(n+us, m.usageAt(after, n+us))
						if got := holderOf(after); got == h {
							t.Fatalf("step %d: the grant stayed with %d at %v, after NextDecision %v (last tick %v)", step, h, n+us, n, m.at)
						}
						u := m.usageAt(a, n+us)
						a.Tick(n+us, u)
						m.usage, m.at = u, n+us
					}
				})
			}
		}
	}
}

// TestNextDecisionDry: the events that depend on the holder stopping.
func TestNextDecisionDry(t *testing.T) {
	t.Parallel()
	a := New(Config{Policy: policy.GuaranteedBurstShare, Quantum: 50 * ms}) // H = 10 ms
	a.Add(1, 30)
	a.Add(2, 70)
	// 1 holds alone, launching 100 µs kernels with a full queue.
	u := map[int]Usage{1: {Waiting: true}, 2: {}}
	only(t, a.Tick(0, u), 1)
	now := time.Duration(0)
	var gpu time.Duration
	var launches uint64
	for range 20 {
		now += ms
		gpu += ms
		launches += 10
		u[1] = Usage{GPUTime: gpu, Queued: ms, Launches: launches}
		only(t, a.Tick(now, u), 1)
	}
	if n := a.NextDecision(); n != Never {
		t.Fatalf("a lone burst holder: NextDecision %v, want Never", n)
	}
	// 2 waits; 1 keeps launching: the next decision is the hysteresis
	// crossing, later than the next millisecond.
	u[2] = Usage{Waiting: true}
	now += ms
	gpu += ms
	launches += 10
	u[1] = Usage{GPUTime: gpu, Queued: ms, Launches: launches}
	only(t, a.Tick(now, u), 1)
	if n := a.NextDecision(); n-now < ms {
		t.Fatalf("a saturating holder: NextDecision %v after the tick, want the hysteresis crossing (>= 1 ms)", n-now)
	}
	// 1 stops launching; its queue (1 ms) is still reported: it is dry
	// once the queue drains, so the next decision is within its tail.
	now += ms
	gpu += ms
	u[1] = Usage{GPUTime: gpu, Queued: ms, Launches: launches}
	only(t, a.Tick(now, u), 1)
	if n := a.NextDecision(); n-now > ms+us {
		t.Fatalf("a holder that stopped launching: NextDecision %v after the tick, want <= its tail (1 ms)", n-now)
	}
	// Its queue drains: dry, the grant moves to 2.
	now += ms
	gpu += ms
	u[1] = Usage{GPUTime: gpu, Launches: launches}
	only(t, a.Tick(now, u), 2)
	// 2 runs, then 1 gets the grant back and saturates again: having run
	// dry while 2 waited, it may do so at any tick.
	var gpu2 time.Duration
	var l2 uint64
	for holderOf(a) != 1 {
		now += ms
		gpu2 += ms
		l2 += 10
		u[1] = Usage{GPUTime: gpu, Launches: launches, Waiting: true}
		u[2] = Usage{GPUTime: gpu2, Queued: ms, Launches: l2}
		a.Tick(now, u)
		if now > 200*ms {
			t.Fatal("1 never got the grant back")
		}
	}
	// 1 busy for a tick, 2 waiting: 1 keeps the grant.
	busyWhileWaited := func() {
		now += ms
		gpu += ms
		launches += 10
		u[1] = Usage{GPUTime: gpu, Queued: ms, Launches: launches}
		u[2] = Usage{GPUTime: gpu2, Launches: l2, Waiting: true}
		only(t, a.Tick(now, u), 1)
	}
	busyWhileWaited()
	if n := a.NextDecision(); n != now+1 {
		t.Fatalf("a holder that ran dry %v ago: NextDecision %v after the tick, want the next tick", now-a.inst[a.index[1]].dryAt, n-now)
	}
	// A second later that is forgotten.
	for end := now + dryProne; now <= end; {
		now += ms
		gpu += ms
		launches += 10
		u[1] = Usage{GPUTime: gpu, Queued: ms, Launches: launches, Waiting: true}
		u[2] = Usage{GPUTime: gpu2, Launches: l2}
		only(t, a.Tick(now, u), 1)
	}
	busyWhileWaited()
	if n := a.NextDecision(); n-now < ms {
		t.Fatalf("%v after it ran dry: NextDecision %v after the tick, want the hysteresis crossing", dryProne, n-now)
	}
}

// TestNextDecisionFixedEntry: with nobody holding, a fixed-share waiter is
// granted when its credit reaches the entry threshold, and NextDecision says
// when.
func TestNextDecisionFixedEntry(t *testing.T) {
	t.Parallel()
	a := New(Config{Policy: policy.FixedShare})
	a.Add(1, 30)
	u := map[int]Usage{1: {Waiting: true}}
	only(t, a.Tick(0, u))
	// Entry at min(H, cap/2) = H = 2 ms of credit, earned at 0.3 ns/ns.
	want := time.Duration(float64(a.hyst)/0.3) + 1
	if n := a.NextDecision(); n < want-us || n > want+us {
		t.Fatalf("NextDecision %v, want %v", n, want)
	}
	only(t, a.Tick(want-10*us, u))
	only(t, a.Tick(want+10*us, u), 1)
	if n := New(Config{}).NextDecision(); n != Never {
		t.Fatalf("an arbiter never ticked: %v", n)
	}
}

// TestNextDecisionTicks runs the virtual-clock scenarios with the
// enforcer's loop: a tick at NextDecision, no sooner than 1 ms and no later
// than 4 ms after the previous one. Shares, reclaim and work conservation
// hold as with 1 ms ticks (the same bounds as the other tests), at a
// fraction of the ticks. The table it logs is in docs/arbiter.md.
func TestNextDecisionTicks(t *testing.T) {
	t.Parallel()
	six := make([]int, 16)
	for i := range six {
		six[i] = 6
	}
	t0 := 5 * sec
	type tcase struct {
		name     string
		cfg      Config
		end      time.Duration
		specs    func() []simSpec
		checks   []bound
		maxTicks float64 // per second, with next-decision ticks
	}
	var cases []tcase
	for _, k := range []time.Duration{50 * us, 5 * ms} {
		for _, core := range [][]int{{30, 70}, {20, 30, 50}, {30}, six} {
			core := core
			lo := eps
			if len(core) == 16 {
				lo = 0.5 // 16 × 6 runs the device at 96 %, see TestFixedShare64
			}
			var checks []bound
			for i, c := range core[:min(3, len(core))] {
				checks = append(checks, bound{fmt.Sprintf("share[%d] (core %d)", i, c), shareOf(i, 0, 10*sec), float64(c) - eps, float64(c) + lo})
			}
			if len(core) == 1 {
				checks = append(checks, bound{"max share over any 1s window", func(s *sim) float64 { return s.maxSliding(0, 0, 10*sec, sec) }, 0, 30 + eps})
			}
			if len(core) == 16 {
				checks = []bound{{"share[0] (core 6)", shareOf(0, 0, 10*sec), 6 - eps, 6 + eps}, {"share[15] (core 6)", shareOf(15, 0, 10*sec), 6 - eps, 6 + eps}}
			}
			cases = append(cases, tcase{fmt.Sprintf("fixed %v/k=%v", core, k), Config{Policy: policy.FixedShare}, 10 * sec,
				func() []simSpec { return specs(core, k) }, checks, 700})
		}
		for _, core := range [][]int{{25, 75}, {60, 80}} {
			core := core
			cases = append(cases, tcase{fmt.Sprintf("native %v/k=%v", core, k), Config{Policy: policy.NativeBurstShare}, 10 * sec,
				func() []simSpec { return specs(core, k) }, targets(core, 100, eps), 700})
		}
		cases = append(cases, tcase{fmt.Sprintf("guaranteed [30 70]/k=%v", k), Config{Policy: policy.GuaranteedBurstShare}, 10 * sec,
			func() []simSpec { return specs([]int{30, 70}, k) }, targets([]int{30, 70}, 100, eps), 700})
		win50 := 68.0
		if k == 5*ms {
			win50 = 0 // 10 kernels a window, see TestGuaranteedBurst
		}
		cases = append(cases, tcase{fmt.Sprintf("guaranteed reclaim/k=%v", k), Config{Policy: policy.GuaranteedBurstShare}, t0 + 2*sec,
			func() []simSpec { return []simSpec{{30, k, sat()}, {70, k, saturating{on: t0}}} },
			[]bound{
				{"30 alone: share over [0,t0)", shareOf(0, 0, t0), 95, 100},
				{"70 over [t0+50ms,t0+100ms)", shareOf(1, t0+50*ms, t0+100*ms), win50, 100},
				{"70 over [t0,t0+1s)", shareOf(1, t0, t0+sec), 70 - eps, 100},
				{"70 over [t0,t0+2s)", shareOf(1, t0, t0+2*sec), 70 - eps, 70 + eps},
			}, 700})
		cases = append(cases, tcase{fmt.Sprintf("guaranteed conserving/k=%v", k), Config{Policy: policy.GuaranteedBurstShare}, 10 * sec,
			func() []simSpec { return []simSpec{{30, k, sat()}, {70, k, &arrivals{job: 8 * ms, every: 20 * ms}}} },
			[]bound{
				{"device busy over [0,10s)", busyOf(0, 10*sec), 93, 100},
				{"30 over [0,10s)", shareOf(0, 0, 10*sec), 53, 100},
				{"70 over [0,10s)", shareOf(1, 0, 10*sec), 40 - eps, 40 + eps},
			}, 800})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var res [2]string
			for j, w := range []*wakeBounds{nil, {ms, 4 * ms}} {
				s := newSim(tc.cfg, tc.end, tc.specs()...)
				s.wake = w
				s.run()
				perSec := float64(s.ticks) / tc.end.Seconds()
				res[j] = fmt.Sprintf("%4.0f ticks/s", perSec)
				for _, b := range tc.checks {
					res[j] += fmt.Sprintf(" · %.2f", b.get(s))
				}
				if w == nil {
					continue
				}
				if perSec > tc.maxTicks {
					t.Errorf("%.0f ticks/s, want <= %.0f", perSec, tc.maxTicks)
				}
				for _, b := range tc.checks {
					if got := b.get(s); got < b.lo || got > b.hi {
						t.Errorf("%s = %.2f, want %.2f..%.2f", b.what, got, b.lo, b.hi)
					}
				}
			}
			t.Logf("%-34s 1 ms: %s | next: %s", tc.name, res[0], res[1])
		})
	}
}
