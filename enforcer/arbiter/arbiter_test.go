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
	if a.period != float64(DefaultPeriod) || a.quantum != float64(DefaultQuantum) || a.bound != [2]float64{float64(DefaultMaxQueued), float64(DefaultOfflineMaxQueued)} {
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

func TestFixedShareBucket(t *testing.T) {
	t.Parallel()
	a := New(Config{Policy: policy.FixedShare})
	a.Add(1, 50)
	u := map[int]Usage{1: {Waiting: true}}
	// The bucket starts with its entry, half a slice (10 ms).
	only(t, a.Tick(0, u), 1)
	if s := a.Stats(1); !s.Holding || s.Grants != 1 || s.Tokens != 10*ms {
		t.Fatalf("stats %+v", s)
	}
	// It runs back to back: the bucket (earning 0.5 ns per ns) runs out
	// at 20 ms, and the holder loses the grant.
	u[1] = Usage{GPUTime: 19 * ms, Launches: 190, Queued: ms}
	only(t, a.Tick(19*ms, u), 1)
	u[1] = Usage{GPUTime: 21 * ms, Launches: 210, Queued: ms}
	only(t, a.Tick(21*ms, u))
	s := a.Stats(1)
	if s.Tokens != -500*us || s.Used != 21*ms || s.Granted != 21*ms {
		t.Fatalf("stats %+v", s)
	}
	// Waiting, it takes the grant back once its bucket holds its entry
	// again, 21 ms later.
	u[1] = Usage{GPUTime: 21 * ms, Launches: 210, Waiting: true}
	only(t, a.Tick(41*ms, u))
	only(t, a.Tick(42*ms+us, u), 1)
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

// TestFixedShareCap: an idle fixed-share instance's bucket fills to
// max(c/100 · Period, slice) and no further.
func TestFixedShareCap(t *testing.T) {
	t.Parallel()
	for _, c := range []int{1, 30, 100} {
		a := New(Config{Policy: policy.FixedShare})
		a.Add(1, c)
		for now := time.Duration(0); now <= 10*sec; now += 100 * ms {
			a.Tick(now, map[int]Usage{1: {}})
		}
		want := max(time.Duration(c)*DefaultPeriod/100, 2*DefaultQuantum/2, 2*DefaultMaxQueued)
		if got := a.Stats(1).Tokens; got != want {
			t.Errorf("core %d: bucket %v after 10s idle, want %v", c, got, want)
		}
	}
}

// TestBurstNoBanking: under the burst policies an instance that was idle
// joins at most one slice of lag behind the others: it does not bank the
// time it left unused.
func TestBurstNoBanking(t *testing.T) {
	t.Parallel()
	a := New(Config{Policy: policy.GuaranteedBurstShare})
	a.Add(1, 30)
	a.Add(2, 70)
	var g1 time.Duration
	only(t, a.Tick(0, map[int]Usage{1: {Waiting: true}, 2: {}}), 1)
	for now := ms; now < sec; now += ms {
		g1 += ms
		a.Tick(now, map[int]Usage{1: {GPUTime: g1, Launches: uint64(now / us), Queued: ms}, 2: {}})
	}
	a.Tick(sec, map[int]Usage{1: {GPUTime: g1, Launches: uint64(sec / us), Queued: ms}, 2: {Waiting: true}})
	i1, i2 := &a.inst[a.index[1]], &a.inst[a.index[2]]
	if lag := time.Duration((i1.v - i2.v) * i2.w); lag > DefaultQuantum+us || lag < DefaultQuantum-us {
		t.Fatalf("an instance back after 1 s idle has a lag of %v, want one slice (%v)", lag, DefaultQuantum)
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
	// Dry 19 ms after its last launch with 8 ms queued: the grant goes
	// to the waiting instance once 1's tail (at most its queue bound) has
	// run.
	a.Tick(20*ms, map[int]Usage{1: {Launches: 1, Queued: 8 * ms}, 2: {Waiting: true}})
	if h, ok := a.Holder(); ok && h == 1 {
		t.Fatalf("19 ms after its last launch with 8 ms queued: still the holder")
	}
	a.Tick(20*ms+DefaultMaxQueued, map[int]Usage{1: {Launches: 1, Queued: 8 * ms}, 2: {Waiting: true}})
	if h, _ := a.Holder(); h != 2 {
		t.Fatalf("a queue bound after 1 was called dry: holder %d, want the waiting instance", h)
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
//   - at most one online and one offline id are granted, and they are
//     registered (never a removed one);
//   - virtual times and buckets are finite, buckets within [-Period, depth];
//   - under fixed-share an online holder's bucket is positive;
//   - under the burst policies someone holds whenever an online instance
//     waits, unless a hand-off waits for a tail (Urgent);
//   - NextDecision is after the tick;
//   - per-instance accounting never goes negative.
func checkOps(t *testing.T, data []byte) {
	if len(data) < 2 {
		return
	}
	p := policy.Policy(data[0] % 3)
	a := New(Config{Policy: p, Period: 20 * ms, Quantum: 3 * ms, FillOneAtATime: data[1]%2 == 0})
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
			class := policy.Online
			if y%4 == 0 {
				class = policy.Offline
			}
			a.AddClass(id, int(x), class)
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
				waiting = waiting || w && !a.inst[a.index[cid]].off
				usage[cid] = Usage{GPUTime: c.gpu, Queued: c.queued, Waiting: w, Launches: c.launches, IdleSince: now - time.Duration(r%3)*us}
			}
			if y == 255 && len(ctrs) > 0 {
				for cid := range ctrs { // a counter reset
					ctrs[cid].gpu = 0
					break
				}
			}
			got := a.Tick(now, usage)
			if len(got) > 2 {
				t.Fatalf("granted %v: more than two", got)
			}
			if n := a.NextDecision(); n != Never && n <= now {
				t.Fatalf("NextDecision %v at %v: not after the tick", n, now)
			}
			var classes [2]int
			for _, g := range got {
				if _, ok := ctrs[g]; !ok {
					t.Fatalf("granted unregistered id %d", g)
				}
				in := &a.inst[a.index[g]]
				if in.off {
					classes[1]++
				} else {
					classes[0]++
				}
				if s := a.Stats(g); !s.Holding || (p == policy.FixedShare && !in.off && s.Tokens <= 0) {
					t.Fatalf("holder %d: %+v", g, s)
				}
			}
			if classes[0] > 1 || classes[1] > 1 {
				t.Fatalf("granted %v: two of one class", got)
			}
			if p != policy.FixedShare && waiting && classes[0] == 0 && !a.Urgent() {
				t.Fatalf("burst policy left the device to nobody while an online instance waits: %+v tail %d %v on %+v", a.inst, a.tailFrom, a.tailEnd, a.on)
			}
			for cid := range ctrs {
				in := &a.inst[a.index[cid]]
				if math.IsNaN(in.v) || math.IsInf(in.v, 0) || math.IsNaN(in.tokens) || a.fixed && !in.off && (in.tokens < -a.period-1 || in.tokens > a.depth(in)+1) {
					t.Fatalf("state of %d out of range: v %v, bucket %v", cid, in.v, in.tokens)
				}
				s := in.st
				if s.Used < 0 || s.Granted < 0 || s.Throttled < 0 {
					t.Fatalf("accounting of %d: %+v", cid, s)
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

// TestFixedShareHoldersThatLeaveIdle: instances whose holds leave part of
// the device idle (an application that reads every step's result back lets
// its queue run empty) still split the device by their cores under
// fixed-share. The idle time fills buckets, not anyone's place in line (it
// used to pile up as credit until the smallest cap stopped it, and the
// smallest instance lost all of it: a 30 beside a 70 got 21 % of an H200,
// a 20 beside a 30 and a 50 11 %).
func TestFixedShareHoldersThatLeaveIdle(t *testing.T) {
	t.Parallel()
	for _, cores := range [][]int{{30, 70}, {20, 30, 50}} {
		t.Run(fmt.Sprint(cores), func(t *testing.T) {
			t.Parallel()
			// The enforcer's settings (enforcer/instance.go).
			a := New(Config{Policy: policy.FixedShare})
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
