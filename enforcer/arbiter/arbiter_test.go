package arbiter

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/internal/policy"
)

func only(t *testing.T, got []int, want ...int) {
	t.Helper()
	if len(got) != len(want) || (len(want) == 1 && got[0] != want[0]) {
		t.Fatalf("granted %v, want %v", got, want)
	}
}

func TestDefaults(t *testing.T) {
	t.Parallel()
	a := New(Config{})
	if a.period != float64(DefaultPeriod) || a.quantum != DefaultQuantum || a.maxQueued != float64(DefaultMaxQueued) {
		t.Fatalf("defaults not applied: %+v", a)
	}
	if !a.fixed {
		t.Fatal("zero policy is not fixed-share")
	}
}

func TestRemoveHolderNeverGranted(t *testing.T) {
	t.Parallel()
	a := New(Config{Policy: policy.NativeBurstShare})
	a.Add(1, 50)
	a.Add(2, 50)
	u := map[int]Usage{1: {Waiting: true}, 2: {}}
	only(t, a.Tick(0, u), 1)
	a.Remove(1)
	u[2] = Usage{Waiting: true}
	only(t, a.Tick(ms, u), 2)
	for now := 2 * ms; now < 50*ms; now += ms {
		for _, id := range a.Tick(now, u) {
			if id == 1 {
				t.Fatalf("removed id granted at %v", now)
			}
		}
	}
	if s := a.Stats(1); s != (InstanceStats{}) {
		t.Fatalf("stats of removed id: %+v", s)
	}
	a.Remove(1) // unknown: no-op
	if a.Len() != 1 {
		t.Fatalf("Len = %d", a.Len())
	}
}

func TestMissingUsageHasNoDemand(t *testing.T) {
	t.Parallel()
	a := New(Config{Policy: policy.GuaranteedBurstShare})
	a.Add(1, 30)
	only(t, a.Tick(0, map[int]Usage{}))
	only(t, a.Tick(ms, nil))
}

func TestFixedShareNeedsCredit(t *testing.T) {
	t.Parallel()
	a := New(Config{Policy: policy.FixedShare})
	a.Add(1, 50)
	u := map[int]Usage{1: {Waiting: true}}
	// Credit starts at 0; the entry threshold is the hysteresis
	// (max(Quantum/5, 2*MaxQueued) = 2 ms), earned at 0.5 ms per ms.
	for i := 0; i < 4; i++ {
		only(t, a.Tick(time.Duration(i)*ms, u))
	}
	only(t, a.Tick(4*ms, u), 1)
	if s := a.Stats(1); !s.Holding || s.Grants != 1 || s.Credit != 2*ms {
		t.Fatalf("stats %+v", s)
	}
	// It ran 3 ms of GPU work in the next tick: credit 2 + 0.5 - 3 < 0.
	u[1] = Usage{GPUTime: 3 * ms, Launches: 60, Queued: ms}
	only(t, a.Tick(5*ms, u))
	s := a.Stats(1)
	if s.Credit != -500*us || s.Used != 3*ms || s.Charged != 3*ms || s.Granted != ms {
		t.Fatalf("stats %+v", s)
	}
}

func TestBaselineAndCounterReset(t *testing.T) {
	t.Parallel()
	a := New(Config{Policy: policy.NativeBurstShare})
	a.Add(1, 10)
	// GPU time from before the arbiter knew the instance is not charged.
	only(t, a.Tick(0, map[int]Usage{1: {GPUTime: 10 * sec, Launches: 1e6, Waiting: true}}), 1)
	if s := a.Stats(1); s.Used != 0 {
		t.Fatalf("pre-existing GPU time charged: %+v", s)
	}
	// A counter that goes backwards (a reset) charges nothing and becomes
	// the new baseline.
	a.Tick(ms, map[int]Usage{1: {GPUTime: ms, Launches: 5, Waiting: true}})
	a.Tick(2*ms, map[int]Usage{1: {GPUTime: 2 * ms, Launches: 10}})
	if s := a.Stats(1); s.Used != ms {
		t.Fatalf("Used = %v, want 1ms", s.Used)
	}
}

func TestAddUpdatesCoreAndClamps(t *testing.T) {
	t.Parallel()
	a := New(Config{})
	a.Add(7, 0)
	if c := a.Stats(7).Core; c != 1 {
		t.Fatalf("core %d, want 1", c)
	}
	a.Add(7, 1000)
	if c := a.Stats(7).Core; c != 100 || a.Len() != 1 {
		t.Fatalf("core %d len %d", c, a.Len())
	}
}

// TestFixedShareCap: an idle fixed-share instance banks at most
// max(c/100*Period, Quantum) of credit.
func TestFixedShareCap(t *testing.T) {
	t.Parallel()
	for _, c := range []int{1, 30, 100} {
		a := New(Config{Policy: policy.FixedShare})
		a.Add(1, c)
		for now := time.Duration(0); now <= 10*sec; now += 100 * ms {
			a.Tick(now, map[int]Usage{1: {}})
		}
		want := max(time.Duration(c)*DefaultPeriod/100, DefaultQuantum)
		if got := a.Stats(1).Credit; got != want {
			t.Errorf("core %d: credit %v after 10s idle, want %v", c, got, want)
		}
	}
}

// TestBurstNoBanking: under the burst policies an instance without demand
// earns nothing, so it returns from idle at the average, not ahead.
func TestBurstNoBanking(t *testing.T) {
	t.Parallel()
	a := New(Config{Policy: policy.GuaranteedBurstShare})
	a.Add(1, 30)
	a.Add(2, 70)
	var g1 time.Duration
	for now := time.Duration(0); now < sec; now += ms {
		g1 += ms
		a.Tick(now, map[int]Usage{1: {GPUTime: g1, Launches: uint64(now / us), Waiting: true}, 2: {}})
		if c := a.Stats(2).Credit; c > 0 {
			t.Fatalf("idle instance banked %v at %v", c, now)
		}
	}
	if s := a.Stats(1); s.Credit != 0 || !s.Holding {
		t.Fatalf("lone demander %+v", s)
	}
}

// TestHolderOfOneLongKernelIsNotDry: a holder that reports one long kernel
// queued (8 ms) and launches nothing while it runs keeps the grant beside a
// waiting instance, though its mean kernel is not known (a launch counted
// while it waited for room and taken back at a revoke once made it look
// 3.5 ms long): it is called dry only after its queued work could have run.
func TestHolderOfOneLongKernelIsNotDry(t *testing.T) {
	t.Parallel()
	a := New(Config{Policy: policy.GuaranteedBurstShare, Quantum: sec})
	a.Add(1, 70)
	a.Add(2, 30)
	a.Tick(0, map[int]Usage{1: {Waiting: true}, 2: {}})
	if h, ok := a.Holder(); !ok || h != 1 {
		t.Fatalf("holder %v %v, want 1", h, ok)
	}
	a.Tick(ms, map[int]Usage{1: {Launches: 1, Queued: 8 * ms}, 2: {}})
	for now := 2 * ms; now <= 9*ms; now += ms {
		a.Tick(now, map[int]Usage{1: {Launches: 1, Queued: 8 * ms}, 2: {Waiting: true}})
		if h, _ := a.Holder(); h != 1 {
			t.Fatalf("at %v (its 8 ms kernel launched at 1 ms still runs): the grant went to %d", now, h)
		}
	}
	a.Tick(20*ms, map[int]Usage{1: {Launches: 1, Queued: 8 * ms}, 2: {Waiting: true}})
	if h, _ := a.Holder(); h != 2 {
		t.Fatalf("19 ms after its last launch with 8 ms queued: holder %d, want the waiting instance", h)
	}
}

// TestStatsThrottled: a waiting non-holder accumulates throttled time.
func TestStatsThrottled(t *testing.T) {
	t.Parallel()
	a := New(Config{Policy: policy.NativeBurstShare, Quantum: sec})
	a.Add(1, 50)
	a.Add(2, 50)
	u := map[int]Usage{1: {Waiting: true}, 2: {Waiting: true}}
	only(t, a.Tick(0, u), 1)
	u[1] = Usage{GPUTime: 0, Launches: 1, Queued: ms}
	a.Tick(ms, u)
	if s := a.Stats(2); s.Throttled != ms {
		t.Fatalf("throttled %v, want 1ms", s.Throttled)
	}
	if s := a.Stats(1); s.Granted != ms {
		t.Fatalf("granted %v, want 1ms", s.Granted)
	}
}

// checkOps drives an arbiter with operations decoded from data and checks
// its invariants after every tick:
//   - at most one id is granted, and it is registered (never a removed one);
//   - credits are finite and within [-Period, cap];
//   - under fixed-share the holder has credit > 0;
//   - under the burst policies with overlapping hand-offs, someone holds
//     whenever an instance waits (work conservation);
//   - per-instance accounting never goes negative.
func checkOps(t *testing.T, data []byte) {
	if len(data) < 2 {
		return
	}
	p := policy.Policy(data[0] % 3)
	mode := Handoff(data[1] % 4)
	a := New(Config{Policy: p, Handoff: mode, Period: 20 * ms, Quantum: 3 * ms})
	data = data[2:]
	type ctr struct {
		gpu, queued time.Duration
		launches    uint64
	}
	ctrs := map[int]*ctr{}
	usage := map[int]Usage{}
	var now time.Duration
	for len(data) >= 4 {
		op, id, x, y := data[0]%8, int(data[1]%8), data[2], data[3]
		data = data[4:]
		switch op {
		case 0:
			a.Add(id, int(x))
			if ctrs[id] == nil {
				ctrs[id] = &ctr{}
			}
		case 1:
			a.Remove(id)
			delete(ctrs, id)
		default:
			now += time.Duration(x) * 20 * us // 0..5 ms, 0 included
			clear(usage)
			waiting := false
			for cid, c := range ctrs {
				r := uint(y) + uint(cid)
				if r%5 == 0 {
					continue // no usage this tick
				}
				c.gpu += time.Duration(r%7) * 300 * us
				c.launches += uint64(r % 3)
				c.queued = time.Duration(r%4) * 400 * us
				w := r%2 == 0
				waiting = waiting || w
				usage[cid] = Usage{GPUTime: c.gpu, Queued: c.queued, Waiting: w, Launches: c.launches}
			}
			if y == 255 && len(ctrs) > 0 {
				for cid := range ctrs { // a counter reset
					ctrs[cid].gpu = 0
					break
				}
			}
			got := a.Tick(now, usage)
			if len(got) > 1 {
				t.Fatalf("granted %v: more than one", got)
			}
			if n := a.NextDecision(); n != Never && n <= now {
				t.Fatalf("NextDecision %v at %v: not after the tick", n, now)
			}
			for _, g := range got {
				if _, ok := ctrs[g]; !ok {
					t.Fatalf("granted unregistered id %d", g)
				}
				if s := a.Stats(g); !s.Holding || (p == policy.FixedShare && s.Credit <= 0) {
					t.Fatalf("holder %d: %+v", g, s)
				}
			}
			if p != policy.FixedShare && mode == HandoffOverlap && waiting && len(got) == 0 {
				t.Fatalf("burst policy left the device idle while an instance waits")
			}
			for cid := range ctrs {
				in := &a.inst[a.index[cid]]
				if math.IsNaN(in.credit) || math.IsInf(in.credit, 0) || in.credit < -a.period-1 || (a.fixed && in.credit > a.cap(in)+1) {
					t.Fatalf("credit of %d out of range: %v", cid, in.credit)
				}
				s := in.st
				if s.Used < 0 || s.Charged < 0 || s.Granted < 0 || s.Throttled < 0 || s.Charged > s.Used || in.discount < 0 {
					t.Fatalf("accounting of %d: %+v discount %v", cid, s, in.discount)
				}
			}
		}
	}
}

func FuzzArbiter(f *testing.F) {
	f.Add([]byte{0, 0, 0, 1, 30, 0, 0, 2, 70, 0, 2, 0, 50, 3, 2, 0, 50, 4, 1, 1, 0, 0, 2, 0, 50, 5})
	f.Add([]byte{1, 1, 0, 3, 10, 0, 0, 4, 90, 0, 3, 0, 255, 2, 4, 0, 10, 255, 1, 3, 0, 0, 5, 0, 1, 1})
	f.Add([]byte{2, 2, 0, 0, 100, 0, 0, 7, 100, 0, 6, 5, 200, 8, 7, 5, 0, 9, 1, 0, 0, 0, 7, 5, 10, 10})
	f.Fuzz(checkOps)
}

// TestRandomOps runs the fuzz invariants on random sequences, so they are
// exercised by a plain `go test`.
func TestRandomOps(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(7, 7))
	buf := make([]byte, 4002)
	for range 300 {
		for i := range buf {
			buf[i] = byte(rng.Uint32())
		}
		checkOps(t, buf)
	}
}

func benchTick(b *testing.B, n int, p policy.Policy) { benchTickNext(b, n, p, false) }

// benchTickNext is benchTick, with a NextDecision after every Tick if next.
func benchTickNext(b *testing.B, n int, p policy.Policy, next bool) {
	a := New(Config{Policy: p})
	usage := make(map[int]Usage, n)
	for i := range n {
		a.Add(i, 100/n+1)
		usage[i] = Usage{Waiting: true}
	}
	var now time.Duration
	prev := -1
	// Steady state: the holder runs 1 ms per tick, everybody else waits.
	// Only the holder's and the previous holder's usage change, so the
	// harness costs O(1) per tick.
	step := func() {
		now += ms
		g := a.Tick(now, usage)
		if next {
			a.NextDecision()
		}
		cur := -1
		if len(g) > 0 {
			cur = g[0]
		}
		if prev >= 0 && prev != cur {
			u := usage[prev]
			u.Waiting, u.Queued = true, 0
			usage[prev] = u
		}
		if cur >= 0 {
			u := usage[cur]
			u.GPUTime += ms
			u.Launches += 20
			u.Queued, u.Waiting = ms, false
			usage[cur] = u
		}
		prev = cur
	}
	for range 1000 {
		step()
	}
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		step()
	}
}

func BenchmarkTick16(b *testing.B) {
	for _, p := range []policy.Policy{policy.FixedShare, policy.NativeBurstShare} {
		b.Run(p.String(), func(b *testing.B) { benchTick(b, 16, p) })
	}
}

func BenchmarkTick64(b *testing.B) {
	for _, p := range []policy.Policy{policy.FixedShare, policy.NativeBurstShare} {
		b.Run(p.String(), func(b *testing.B) { benchTick(b, 64, p) })
	}
}

// BenchmarkTickNext16 is BenchmarkTick16 with the enforcer's NextDecision
// after every Tick.
func BenchmarkTickNext16(b *testing.B) {
	for _, p := range []policy.Policy{policy.FixedShare, policy.NativeBurstShare} {
		b.Run(p.String(), func(b *testing.B) { benchTickNext(b, 16, p, true) })
	}
}

func BenchmarkTickNext64(b *testing.B) {
	for _, p := range []policy.Policy{policy.FixedShare, policy.NativeBurstShare} {
		b.Run(p.String(), func(b *testing.B) { benchTickNext(b, 64, p, true) })
	}
}

// TestFixedShareHoldersThatLeaveIdle: instances whose holds leave part of
// the device idle (an application that reads every step's result back lets
// its queue run empty) still split the device by their cores under
// fixed-share. The idle time is credit nobody can spend; it used to pile up
// until the smallest cap stopped it, and the smallest instance lost all of
// it: a 30 beside a 70 got 21 % of an H200, a 20 beside a 30 and a 50 11 %.
func TestFixedShareHoldersThatLeaveIdle(t *testing.T) {
	t.Parallel()
	for _, cores := range [][]int{{30, 70}, {20, 30, 50}} {
		t.Run(fmt.Sprint(cores), func(t *testing.T) {
			t.Parallel()
			// The enforcer's settings (enforcer/instance.go).
			a := New(Config{Policy: policy.FixedShare, MaxQueued: 2 * ms, Handoff: HandoffTimed, Quantum: 20 * ms})
			usage := map[int]Usage{}
			for i, c := range cores {
				a.Add(i, c)
				usage[i] = Usage{Waiting: true}
			}
			const busy = 0.9 // of each hold
			used := make([]time.Duration, len(cores))
			var now time.Duration
			for now = 0; now < 20*sec; now += ms {
				h, held := a.Holder()
				for id, u := range usage {
					u.Waiting = !held || id != h
					u.Queued = 0
					if held && id == h {
						d := time.Duration(busy * float64(ms))
						u.GPUTime += d
						u.Launches += 4
						u.Queued = ms
						used[id] += d
					}
					usage[id] = u
				}
				a.Tick(now, usage)
			}
			var sum time.Duration
			for _, u := range used {
				sum += u
			}
			for i, c := range cores {
				split := 100 * float64(used[i]) / float64(sum)
				if math.Abs(split-float64(c)) > 1 {
					t.Errorf("instance %d (core %d): %.2f %% of the time used, want %d ± 1 (device %.1f %% busy)",
						i, c, split, c, 100*float64(sum)/float64(now))
				}
			}
		})
	}
}
