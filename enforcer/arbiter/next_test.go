package arbiter

import (
	"fmt"
	"maps"
	"math"
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
// is charged; a revoked holder's queue drains in real time.
type model struct {
	usage map[int]Usage
	at    time.Duration // time of the last advance
	held  map[int]time.Duration
}

func newModel(a *Arbiter) *model {
	m := &model{usage: map[int]Usage{}, held: map[int]time.Duration{}}
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
			m.held[id] = now
		} else if at, ok := m.held[id]; ok {
			x.Queued = max(0, DefaultMaxQueued-(now-at))
		}
		u[id] = x
	}
	return u
}

// TestNextDecisionExact drives arbiters under NextDecision's assumptions
// and ticks exactly where it says: at each step a Tick 1 µs before the
// returned time must leave the grant where it is (never late), and most
// Ticks 1 µs after it must move it (slices ending, virtual times crossing
// and buckets running out are exact; a fixed-share instance's bucket
// reaching its entry is foreseen although the holder may keep its slice).
func TestNextDecisionExact(t *testing.T) {
	t.Parallel()
	six := make([]int, 16)
	for i := range six {
		six[i] = 6
	}
	for _, p := range []policy.Policy{policy.FixedShare, policy.GuaranteedBurstShare, policy.NativeBurstShare} {
		for _, core := range [][]int{{30}, {30, 70}, {20, 30, 50}, {60, 80}, six} {
			for _, q := range []time.Duration{5 * ms, DefaultQuantum} {
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
					moved := 0
					const steps = 300
					for step := range steps {
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
						if holderOf(after) != h {
							moved++
						}
						u := m.usageAt(a, n+us)
						a.Tick(n+us, u)
						m.usage, m.at = u, n+us
					}
					if moved < steps*3/4 {
						t.Fatalf("the grant moved at %d of %d next decisions, want at least 3/4", moved, steps)
					}
				})
			}
		}
	}
}

// TestNextDecisionDry: the events that depend on the holder stopping.
func TestNextDecisionDry(t *testing.T) {
	t.Parallel()
	a := New(Config{Policy: policy.GuaranteedBurstShare, Quantum: 50 * ms})
	a.Add(1, 30)
	a.Add(2, 70)
	// 1 holds alone, launching 100 µs kernels with a full queue.
	u := map[int]Usage{1: {Waiting: true}, 2: {}}
	only(t, a.Tick(0, u), 1)
	now := time.Duration(0)
	var gpu time.Duration
	var launches uint64
	work := func() {
		now += ms
		gpu += ms
		launches += 10
		u[1] = Usage{GPUTime: gpu, Queued: 2 * ms, Launches: launches}
	}
	for range 20 {
		work()
		only(t, a.Tick(now, u), 1)
	}
	if n := a.NextDecision(); n != Never {
		t.Fatalf("a lone burst holder: NextDecision %v, want Never", n)
	}
	// 2 waits (joining level with 1, its lag clamped to a slice); 1 keeps
	// launching: the next decision is when 1 is a slice (50 ms of its
	// device time) ahead of 2, 50 ms from its grant at 0, not sooner.
	u[2] = Usage{Waiting: true}
	work()
	only(t, a.Tick(now, u), 1)
	if n := a.NextDecision(); n != 50*ms+1 {
		t.Fatalf("a saturating holder: NextDecision %v, want it a slice ahead (50 ms)", n)
	}
	// 1 stops launching with its queue (2 ms) reported: it may be dry at
	// its deadline, 1.25 × 2 ms + a tick after its last launch.
	now += ms
	gpu += ms
	u[1] = Usage{GPUTime: gpu, Queued: 2 * ms, Launches: launches}
	only(t, a.Tick(now, u), 1)
	last := a.inst[a.index[1]].launchAt
	if n, want := a.NextDecision(), last+2500*us+DefaultTick; n != want {
		t.Fatalf("a holder that stopped launching: NextDecision %v, want its dry deadline %v", n, want)
	}
	// Its queue drains: quiet for a tick, it is dry, and the grant moves
	// to 2.
	now += ms
	gpu += ms
	u[1] = Usage{GPUTime: gpu, Launches: launches, IdleSince: now - DefaultTick}
	only(t, a.Tick(now, u), 2)
}

// TestNextDecisionFixedEntry: with nobody holding, a fixed-share waiter is
// granted when its bucket reaches its entry (half a slice), and
// NextDecision says when.
func TestNextDecisionFixedEntry(t *testing.T) {
	t.Parallel()
	a := New(Config{Policy: policy.FixedShare})
	a.Add(1, 30)
	u := map[int]Usage{1: {Waiting: true}}
	only(t, a.Tick(0, u), 1)
	// It uses its bucket (30 ms) and 1 ms more.
	u[1] = Usage{GPUTime: 43 * ms, Launches: 430}
	only(t, a.Tick(43*ms, u))
	tokens := float64(a.Stats(1).Tokens)
	u[1] = Usage{GPUTime: 43 * ms, Launches: 430, Waiting: true}
	want := 43*ms + time.Duration(math.Ceil((float64(DefaultQuantum)/2-tokens)/0.3)) + 1
	if n := a.NextDecision(); n < want-us || n > want+us {
		t.Fatalf("NextDecision %v, want %v", n, want)
	}
	only(t, a.Tick(want-10*us, u))
	only(t, a.Tick(want+10*us, u), 1)
	if n := New(Config{}).NextDecision(); n != Never {
		t.Fatalf("an arbiter never ticked: %v", n)
	}
}

// TestTickRate: with the enforcer's loop (sim_test.go) saturating
// instances make it tick at most once per DefaultTick (the loop looks at a
// contested holder every tick: Arbiter.Contested), plus, for kernels
// longer than half the queue bound, the polls for the end of a hand-off's
// tail (one per longTailPoll of a kernel per hand-off).
func TestTickRate(t *testing.T) {
	t.Parallel()
	six := make([]int, 16)
	for i := range six {
		six[i] = 6
	}
	for _, k := range []time.Duration{50 * us, 5 * ms} {
		for _, p := range []policy.Policy{policy.FixedShare, policy.GuaranteedBurstShare, policy.NativeBurstShare} {
			for _, core := range [][]int{{30, 70}, {20, 30, 50}, {30}, six} {
				s := newSim(Config{Policy: p}, 5*sec, specs(core, k)...)
				s.run()
				perSec := float64(s.ticks) / 5
				limit := float64(time.Second / DefaultTick)
				if 2*k > DefaultMaxQueued {
					limit += float64(s.handoffs) / 5 * float64(k/longTailPoll)
				}
				t.Logf("%v %v k=%v: %.0f ticks/s (limit %.0f), %d hand-offs, %d woken", p, core, k, perSec, limit, s.handoffs, s.wakes)
				if perSec > limit {
					t.Errorf("%v %v k=%v: %.0f ticks/s, want <= %.0f", p, core, k, perSec, limit)
				}
			}
		}
	}
}
