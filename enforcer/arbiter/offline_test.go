package arbiter

import (
	"math"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/internal/policy"
)

// enforcerSim is a sim in the production configuration; the instances
// from off on are offline.
func enforcerSim(pol policy.Policy, end time.Duration, off int, sp ...simSpec) *sim {
	return enforcerSimFill(false, pol, end, off, sp...)
}

// offlineBound is the enforcer's offline queue bound.
const offlineBound = DefaultOfflineMaxQueued

// enforcerSimFill is enforcerSim with Config.FillOneAtATime (the
// enforcer's online_offline_switch = 2).
func enforcerSimFill(one bool, pol policy.Policy, end time.Duration, off int, sp ...simSpec) *sim {
	s := newSim(Config{Policy: pol, FillOneAtATime: one}, end, sp...)
	for i := off; i < len(sp); i++ {
		s.setOffline(i)
	}
	return s
}

// offline is a saturating instance of core c and kernels k (made offline
// by enforcerSim).
func offline(c int, k time.Duration) simSpec {
	return simSpec{core: c, klen: k, work: saturating{}}
}

// Two online fixed-share instances of 30 and 40 beside a saturating
// offline one: the online ones get 30 and 40 as if alone, the offline one
// the rest (issue 18's acceptance, on the virtual clock).
func TestOfflineTakesWhatFixedShareLeaves(t *testing.T) {
	t.Parallel()
	for _, k := range []time.Duration{100 * us, 500 * us} {
		s := enforcerSim(policy.FixedShare, 10*sec, 2,
			simSpec{core: 30, klen: k, work: saturating{}},
			simSpec{core: 40, klen: k, work: saturating{}},
			offline(50, k))
		s.run()
		a, b, c := s.share(0, sec, 10*sec), s.share(1, sec, 10*sec), s.share(2, sec, 10*sec)
		t.Logf("k=%v: online 30 -> %.2f, online 40 -> %.2f, offline -> %.2f, busy %.2f", k, a, b, c, a+b+c)
		if math.Abs(a-30) > eps || math.Abs(b-40) > eps || math.Abs(c-30) > eps {
			t.Errorf("k=%v: %.2f / %.2f / %.2f, want 30 / 40 / 30 ± %v", k, a, b, c, eps)
		}
	}
}

// An online instance busy 40 % of the time in bursts beside a saturating
// offline one, under each policy: the online one is served all it asks
// (as alone), the offline one gets at least 80 % of the rest, and the
// device stays at least 95 % busy: the online process wakes the enforcer
// when its queue drains, and the offline one fills from the fill grace on.
func TestOfflineFillsOnlineIdle(t *testing.T) {
	t.Parallel()
	for _, pol := range []policy.Policy{policy.FixedShare, policy.GuaranteedBurstShare, policy.NativeBurstShare} {
		for _, k := range []time.Duration{100 * us, 500 * us} {
			on := simSpec{core: 50, klen: k, work: &arrivals{job: 4 * ms, every: 10 * ms}}
			if pol == policy.FixedShare {
				on.core = 60 // room for its 40 % in bursts of 4 ms
			}
			s := enforcerSim(pol, 10*sec, 1, on, offline(100, k))
			s.run()
			a, c := s.share(0, sec, 10*sec), s.share(1, sec, 10*sec)
			t.Logf("%v k=%v: online -> %.2f, offline -> %.2f (%.0f %% of the idle time), busy %.2f", pol, k, a, c, 100*c/(100-a), a+c)
			if a < 40-eps {
				t.Errorf("%v k=%v: online %.2f, want its 40 %%", pol, k, a)
			}
			if c < 0.8*(100-a) || a+c < 95 {
				t.Errorf("%v k=%v: offline %.2f of the %.2f the online one leaves (want >= 80 %%), busy %.2f (want >= 95)", pol, k, c, 100-a, a+c)
			}
		}
	}
}

// An online instance's jobs (4 ms of kernels every 10 ms) beside a
// saturating offline instance finish at most one offline kernel later than
// alone when the offline one fills one kernel at a time
// (FillOneAtATime), at most its queue bound and a kernel later otherwise:
// the online holder keeps its grant while it is idle, so its first kernel
// goes to the device at once, behind what the offline instance has in
// flight, and its wake-up stops the offline instance.
func TestOnlineLatencyBesideOffline(t *testing.T) {
	t.Parallel()
	worst := func(s *sim) time.Duration {
		var w time.Duration
		for _, l := range s.insts[0].latencies[1:] { // the first job met a cold start
			w = max(w, l)
		}
		return w
	}
	for _, one := range []bool{true, false} {
		for _, pol := range []policy.Policy{policy.FixedShare, policy.GuaranteedBurstShare} {
			for _, k := range []time.Duration{100 * us, 500 * us} {
				on := simSpec{core: 60, klen: 100 * us, work: &arrivals{job: 4 * ms, every: 10 * ms}}
				alone := enforcerSimFill(one, pol, 5*sec, 1, on)
				alone.run()
				on.work = &arrivals{job: 4 * ms, every: 10 * ms}
				beside := enforcerSimFill(one, pol, 5*sec, 1, on, offline(100, k))
				beside.run()
				a, b := worst(alone), worst(beside)
				limit := a + k
				if !one {
					limit += offlineBound
				}
				t.Logf("one at a time %v, %v, offline k=%v: worst job latency alone %v, beside %v (%d jobs); offline %.2f",
					one, pol, k, a, b, len(beside.insts[0].latencies), beside.share(1, sec, 5*sec))
				if b > limit {
					t.Errorf("one at a time %v, %v, offline k=%v: worst job latency %v beside, %v alone, want at most %v", one, pol, k, b, a, limit)
				}
				if len(beside.insts[0].latencies) < 490 {
					t.Errorf("one at a time %v, %v, offline k=%v: %d jobs served, want 500", one, pol, k, len(beside.insts[0].latencies))
				}
			}
		}
	}
}

// An offline instance's first wait for the grant wakes the enforcer
// (Wake busy) only while a fill may start: the online pool quiet, nobody
// filling, the instance not seen waiting. A filler revoked by an online
// request still drains its tail when the request ends and waits only
// later; unreported, its fill would start at the loop's next regular
// tick, up to maxActiveTick later (switch 2 lost a third of the idle
// time to that in make bench's priority scenario).
func TestWakeOfflineFirstWait(t *testing.T) {
	t.Parallel()
	a := New(Config{Policy: policy.GuaranteedBurstShare})
	a.AddClass(1, 50, policy.Online)
	a.AddClass(2, 50, policy.Offline)
	wake := func(when string, want bool) {
		t.Helper()
		if busy, idle := a.Wake(2); busy != want || idle {
			t.Fatalf("%s: the offline instance's Wake is busy %v idle %v, want busy %v", when, busy, idle, want)
		}
	}
	only(t, a.Tick(ms, map[int]Usage{1: {Waiting: true}, 2: {Waiting: true}}), 1)
	wake("seen waiting", false)
	only(t, a.Tick(2*ms, map[int]Usage{1: {Queued: 500 * us, Launches: 1}, 2: {Queued: 200 * us}}), 1)
	wake("the online holder busy", false)
	only(t, a.Tick(3*ms, map[int]Usage{1: {GPUTime: ms, Launches: 1, IdleSince: 2900 * us}, 2: {Queued: 200 * us}}), 1)
	wake("the online holder quiet, the offline one draining", true)
	only(t, a.Tick(3200*us, map[int]Usage{1: {GPUTime: ms, Launches: 1, IdleSince: 2900 * us}, 2: {Waiting: true}}), 1, 2)
	wake("filling", false)
}

// Offline instances share what is left by their cores as weights, under
// every policy (a fixed-share device does not cap them).
func TestOfflineWeights(t *testing.T) {
	t.Parallel()
	for _, pol := range []policy.Policy{policy.FixedShare, policy.GuaranteedBurstShare, policy.NativeBurstShare} {
		s := enforcerSim(pol, 10*sec, 0, offline(25, 100*us), offline(75, 100*us))
		s.run()
		a, b := s.share(0, sec, 10*sec), s.share(1, sec, 10*sec)
		t.Logf("%v: offline 25 -> %.2f, offline 75 -> %.2f", pol, a, b)
		if math.Abs(a-25) > eps || math.Abs(b-75) > eps {
			t.Errorf("%v: %.2f / %.2f, want 25 / 75 ± %v", pol, a, b, eps)
		}
	}
}

// Without offline instances nothing changes: AddClass(online) is Add.
func TestOnlineClassIsAdd(t *testing.T) {
	t.Parallel()
	run := func(class bool) (float64, float64) {
		s := enforcerSim(policy.GuaranteedBurstShare, 5*sec, 2, specs([]int{30, 70}, 100*us)...)
		if class {
			for _, in := range s.insts {
				s.arb.AddClass(in.id, in.core, policy.Online)
			}
		}
		s.run()
		return s.share(0, sec, 5*sec), s.share(1, sec, 5*sec)
	}
	a1, b1 := run(false)
	a2, b2 := run(true)
	if a1 != a2 || b1 != b2 {
		t.Fatalf("Add %.4f/%.4f, AddClass online %.4f/%.4f", a1, b1, a2, b2)
	}
}

// The fill waits the quiet grace G only until an online holder is sparse:
// its last two quiet spells ran the fill in them and outlasted G and a
// wake-up. A server between requests, back after milliseconds, has its idle
// time filled as soon as its queue is seen empty from its third request on;
// a step loop's gaps are kept free of offline work: it comes back before the
// fill starts, one stall that lets the fill in does not make it sparse, and
// a tick that sees it back late, without the fill, says nothing.
func TestFillGraceForHostGaps(t *testing.T) {
	t.Parallel()
	a := fillGraceArbiter(false)
	var launches uint64
	busy := func(now time.Duration) []int {
		launches++
		return a.Tick(now, map[int]Usage{1: {Queued: 500 * us, Launches: launches}, 2: {Waiting: true}})
	}
	quiet := func(now, since time.Duration) []int {
		return a.Tick(now, map[int]Usage{1: {Launches: launches, IdleSince: since}, 2: {Waiting: true}})
	}
	// graced checks a quiet spell from since on at which the fill waits G.
	graced := func(since time.Duration) {
		t.Helper()
		only(t, quiet(since+50*us, since), 1)
		only(t, quiet(since+DefaultFillGrace+1, since), 1, 2)
	}
	only(t, a.Tick(0, map[int]Usage{1: {Waiting: true}, 2: {Waiting: true}}), 1)
	only(t, busy(ms), 1)
	graced(1900 * us)                    // the first spell
	only(t, busy(5*ms), 1)               // back after 3.1 ms, the fill running
	graced(5950 * us)                    // one long spell: a step loop's stall, say
	only(t, busy(9*ms), 1)               // a second in a row: sparse
	only(t, quiet(10*ms, 9950*us), 1, 2) // filled at once
	only(t, busy(10100*us), 1)           // back after 150 µs: a host gap
	graced(10950 * us)
	only(t, busy(14*ms), 1)
	graced(14950 * us)
	only(t, busy(18*ms), 1) // sparse again
	only(t, a.Tick(19*ms, map[int]Usage{1: {Launches: launches, IdleSince: 18950 * us}, 2: {}}), 1)
	only(t, busy(20*ms), 1) // back after 1.05 ms, no fill in the spell: a late tick
	graced(20950 * us)
}

// Under FillOneAtATime (online_offline_switch 2, latency first) the fill
// waits G after every quiet spell: a request that comes back at once (one
// running late) finds no offline kernel that G could have kept out.
func TestFillGraceLatencyFirst(t *testing.T) {
	t.Parallel()
	a := fillGraceArbiter(true)
	only(t, a.Tick(0, map[int]Usage{1: {Waiting: true}, 2: {Waiting: true}}), 1)
	for i, at := range []time.Duration{ms, 5 * ms, 9 * ms} { // spells of 3.1 ms with the fill in them
		only(t, a.Tick(at, map[int]Usage{1: {Queued: 500 * us, Launches: uint64(i + 1)}, 2: {Waiting: true}}), 1)
		q := at + 900*us
		only(t, a.Tick(at+ms, map[int]Usage{1: {Launches: uint64(i + 1), IdleSince: q}, 2: {Waiting: true}}), 1)
		only(t, a.Tick(q+DefaultFillGrace+1, map[int]Usage{1: {Launches: uint64(i + 1), IdleSince: q}, 2: {Waiting: true}}), 1, 2)
	}
}

// fillGraceArbiter is an online instance 1 and an offline instance 2.
func fillGraceArbiter(one bool) *Arbiter {
	a := New(Config{Policy: policy.GuaranteedBurstShare, FillOneAtATime: one})
	a.AddClass(1, 50, policy.Online)
	a.AddClass(2, 50, policy.Offline)
	return a
}
