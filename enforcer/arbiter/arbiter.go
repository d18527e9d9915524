// Package arbiter decides, tick by tick, which instance of one device may
// submit GPU work. It is pure logic: time and the instances' measured usage
// are inputs, a list of grant holders is the output. The enforcer daemon
// reads the counters of every instance's shared region, calls Tick, writes
// the grant words (futexes), and ticks again at NextDecision (the earliest
// time the grant could move), 1 to 4 ms later while anything is active.
//
// # Model
//
// The device runs one kernel at a time. The shim bounds every process's
// queued work to max_queued_ns (DefaultMaxQueued) and reports the GPU time it
// measured with events, lazily. The arbiter therefore grants one instance at
// a time (an exclusive holder per device): an instance's event timings are
// only accurate when its work does not wait behind another instance's work.
//
// # Algorithm
//
// Every instance has a credit, in nanoseconds of device time. Each tick the
// measured GPU time that appeared since the previous tick is charged:
// credit -= charged. Credit is earned by policy:
//
//   - fixed-share: credit += c/100 * dt (wall time), whether or not the device
//     is busy. Credit is capped at max(c/100 * Period, Quantum), so an
//     instance returning from idle bursts at most about one period's worth,
//     and floored at -Period. Only an instance with credit > 0 may hold; a
//     non-holder needs credit >= min(H, cap/2) to be picked (H below).
//     While the instances with demand subscribe the whole device (cores
//     summing to 100), what a waiting one earns beyond its cap is taken
//     from all of them in proportion to their cores (shedAtCaps), so that
//     time nobody used is not lost by the instance with the smallest cap
//     alone.
//   - guaranteed-burst-share and native-burst-share: the device time charged
//     to anyone in the tick is handed out to the instances with demand in
//     proportion to c (credit += c/Σc_demand * charged_total). Instances
//     without demand earn nothing and their credit is clamped to <= 0 (no
//     banking; debt from over-run is kept). Credits of the instances with
//     demand are re-centred on zero every tick, so an instance that resumes
//     joins at the average. Someone with demand always holds
//     (work-conserving). With admission keeping Σc <= 100 the guaranteed
//     policy's guarantee follows: a saturating instance gets at least
//     c/Σc_demand >= c/100 of the device.
//
// "Demand": a non-holder has demand when a thread waits for a grant
// (it cannot submit without one). The holder has demand until it runs dry:
// nothing queued and nothing launched since the previous tick, or no launch
// for 1.25 times the longest of its mean kernel, the queue bound and its
// reported queued work, plus a tick (a saturating holder
// refills its queue at every completion). A dry holder keeps the grant only
// while nobody else waits, so the device is handed on as soon as the holder
// stops using it.
//
// The holder keeps the grant while it has demand (and, under fixed-share,
// credit > 0) unless another candidate's credit exceeds the holder's by more
// than the hysteresis H = max(Quantum/5, 2 kernels of either), or the holder
// has held for a Quantum and another candidate has more credit. Then the
// candidate with the highest credit is granted. Over-run (work queued before
// a revoke that ran after it, up to one kernel when kernels are longer than
// the queue bound) is charged when it is reported, which makes credit
// negative, and is paid back.
//
// # Hand-off
//
// When the grant moves from A to B, A's queued tail still runs; B's first
// kernel waits behind it and B's events time that wait. The modes
// (Config.Handoff): HandoffOverlap grants B at once and discounts from B's
// next measured GPU time A's estimated remaining tail (from A's Queued, the
// queue bound and A's mean kernel length and last launch); HandoffDrain
// grants nobody until A's tail is estimated done or A reports nothing
// queued; HandoffImmediate grants at once without a discount;
// HandoffTimed grants B a lead before A's tail is estimated to end, or once
// A reports nothing queued, so that on a device that time-slices or
// alternates between processes the two do not interleave (the enforcer's
// mode). HandoffAdaptive (the zero value) overlaps when A's kernels are short (the
// tail is a full queue, known to within a kernel) and drains when they are
// longer than half the queue bound (the remaining part of one long kernel is
// not known). The tests measure all five; see docs/arbiter.md.
//
// # Defaults
//
// Period 100 ms (fixed-share bank c/100*Period; any 10 s window then holds
// at most Period*c/100 extra, <= 1 point), Quantum 5 ms (H = 1 ms), queue
// bound 1 ms, tick 1 ms. A shorter quantum tracks shares over shorter
// windows (50 ms windows stay within 2 points at 1 ms ticks) at the cost of
// more hand-offs; each costs the error of one tail estimate.
//
// An Arbiter is not safe for concurrent use: the enforcer serialises calls.
package arbiter

import (
	"math"
	"time"

	"github.com/mgpu-dev/mgpu/internal/policy"
)

// Defaults. DefaultMaxQueued is the value the enforcer should write into a
// region's max_queued_ns; DefaultTick is the tick interval the arbiter is
// designed for: the regular tick of the virtual-clock tests, and the
// shortest interval of the enforcer, which otherwise ticks at NextDecision.
const (
	DefaultPeriod    = 100 * time.Millisecond
	DefaultQuantum   = 5 * time.Millisecond
	DefaultMaxQueued = 1 * time.Millisecond
	DefaultTick      = 1 * time.Millisecond
	DefaultLead      = 100 * time.Microsecond
)

// Handoff selects what happens to the device when the grant moves from one
// instance to another while the first still has work queued.
type Handoff int

const (
	// HandoffAdaptive overlaps when the previous holder's tail is a queue
	// of short kernels (its length is then known to within a kernel) and
	// drains when it is one long kernel (whose remaining time is not).
	HandoffAdaptive Handoff = iota
	// HandoffOverlap grants the new holder at once and discounts the
	// estimated wait behind the previous holder's tail from its charge.
	HandoffOverlap
	// HandoffDrain grants nobody until the previous holder's tail is
	// estimated to have run.
	HandoffDrain
	// HandoffImmediate grants at once and charges the new holder for
	// whatever its events measured (over-charge included).
	HandoffImmediate
	// HandoffTimed grants the new holder when the previous holder's tail
	// is estimated to end, less a lead (Config.Lead, the new holder's
	// wake-up, and the part of the tail the shim's reports overstate), or
	// as soon as the tail is reported done: the two instances' work does
	// not interleave on a device that time-slices or alternates between
	// processes, and the device stays busy through the hand-off.
	HandoffTimed
)

// String returns the mode's name.
func (h Handoff) String() string {
	switch h {
	case HandoffAdaptive:
		return "adaptive"
	case HandoffOverlap:
		return "overlap"
	case HandoffDrain:
		return "drain"
	case HandoffImmediate:
		return "immediate"
	case HandoffTimed:
		return "timed"
	}
	return "handoff(?)"
}

// Config configures an Arbiter. Zero values select the defaults.
type Config struct {
	Policy policy.Policy // the device's policy
	// Period is the arbitration period (compute_timeslice). It bounds the
	// credit a fixed-share instance can bank (c/100 * Period) and the debt
	// any instance can carry (Period). 0 selects DefaultPeriod.
	Period time.Duration
	// Quantum is the longest continuous hold before re-deciding
	// (compute_timeslice_native_burst for native-burst-share). The
	// hysteresis is Quantum/5. 0 selects DefaultQuantum.
	Quantum time.Duration
	// MaxQueued is the shim's per-process queue bound (max_queued_ns), used
	// to estimate a revoked holder's tail. 0 selects DefaultMaxQueued.
	MaxQueued time.Duration
	// Handoff selects the hand-off mode; the zero value is HandoffAdaptive.
	Handoff Handoff
	// Lead is how long before the previous holder's tail is estimated to
	// end a timed hand-off grants the next holder, at least: about the
	// time from a grant to the new holder's first work on the device (a
	// thread's wake-up and a launch). 0 selects DefaultLead.
	Lead time.Duration
}

// Usage is what the enforcer reads from an instance's region at a tick.
type Usage struct {
	GPUTime  time.Duration // cumulative measured GPU time (monotonic; all processes, dead ones included)
	Queued   time.Duration // estimated GPU time submitted but not yet known complete
	Waiting  bool          // at least one thread is blocked waiting for a grant
	Launches uint64        // cumulative gated launches
}

// InstanceStats are an instance's cumulative accounting.
type InstanceStats struct {
	Core       int
	Granted    time.Duration // time it held the grant
	Used       time.Duration // measured GPU time seen since it was added
	Charged    time.Duration // Used minus the hand-off discount
	Discounted time.Duration // hand-off discount applied (HandoffOverlap)
	Throttled  time.Duration // time it had demand but no grant
	Credit     time.Duration // current credit (negative: debt)
	Grants     uint64        // times it was granted after not holding
	Demand     bool          // it had demand at the last tick
	Holding    bool          // it holds the grant now
}

type instance struct {
	id      int
	core    int
	weight  float64
	offline bool // policy.Offline: only time no online instance wants

	seen         bool
	lastGPU      time.Duration
	lastLaunches uint64
	queued       time.Duration
	waiting      bool
	launchAt     time.Duration // estimated time of its last launch
	launched     uint64        // launches seen at the last tick
	dryAt        time.Duration // when it last ran dry holding the grant while others waited
	dried        bool          // dryAt is set
	demand       bool
	earns        bool    // burst policies: shares the device time charged this tick (demand, or work still queued)
	charged      float64 // this tick, ns

	credit   float64 // ns
	discount float64 // ns still to discount (overlap hand-off)
	kSum     float64 // decayed sums for the mean kernel length
	lSum     float64

	st InstanceStats
}

// Arbiter is the time-slice arbiter of one device. Not safe for concurrent
// use.
type Arbiter struct {
	pol       policy.Policy
	fixed     bool
	period    float64
	quantum   time.Duration
	hyst      float64
	maxQueued float64
	handoff   Handoff
	lead      time.Duration

	inst  []instance
	index map[int]int

	started bool
	last    time.Duration
	tickEst float64 // EWMA of the tick interval, ns

	holder    int // index into inst, -1 none
	holdStart time.Duration
	holdGrace time.Duration // previous holder's tail the holder waited behind

	tailFrom int           // index of the last revoked holder, -1 none
	tailEnd  time.Duration // when its tail is estimated to end

	out []int
}

// New returns an arbiter for one device.
func New(cfg Config) *Arbiter {
	if cfg.Period <= 0 {
		cfg.Period = DefaultPeriod
	}
	if cfg.Quantum <= 0 {
		cfg.Quantum = DefaultQuantum
	}
	if cfg.MaxQueued <= 0 {
		cfg.MaxQueued = DefaultMaxQueued
	}
	if cfg.Lead <= 0 {
		cfg.Lead = DefaultLead
	}
	return &Arbiter{
		pol:     cfg.Policy,
		fixed:   cfg.Policy == policy.FixedShare || !cfg.Policy.Valid(),
		period:  float64(cfg.Period),
		quantum: cfg.Quantum,
		// A hold shorter than the previous holder's queued tail is pure
		// loss (the tails interleave), so the hysteresis is never below
		// twice the queue bound.
		hyst:      max(float64(cfg.Quantum)/5, 2*float64(cfg.MaxQueued)),
		maxQueued: float64(cfg.MaxQueued),
		handoff:   cfg.Handoff,
		lead:      cfg.Lead,
		index:     make(map[int]int),
		tickEst:   float64(DefaultTick),
		holder:    -1,
		tailFrom:  -1,
		out:       make([]int, 0, 1),
	}
}

// Add registers instance id with its core (1..100; values outside are
// clamped). Adding a known id updates its core and keeps its accounting.
// The first Tick that carries the instance's usage takes its counters as
// the baseline, so GPU time used before Add is not charged.
func (a *Arbiter) Add(id int, core int) { a.AddClass(id, core, policy.Online) }

// AddClass is Add with the instance's class. Offline instances are granted
// only when no online instance can be (the online ones are arbitrated as
// if the offline ones did not exist) and share that time among themselves
// in proportion to their cores, whatever the policy; an online instance
// that can be granted takes the grant from an offline holder at once.
func (a *Arbiter) AddClass(id int, core int, class policy.Class) {
	core = min(max(core, 1), 100)
	off := class == policy.Offline
	if i, ok := a.index[id]; ok {
		a.inst[i].core = core
		a.inst[i].weight = float64(core)
		a.inst[i].offline = off
		a.inst[i].st.Core = core
		return
	}
	a.index[id] = len(a.inst)
	a.inst = append(a.inst, instance{id: id, core: core, weight: float64(core), offline: off, st: InstanceStats{Core: core}})
}

// Remove forgets instance id; it is never granted again (unless re-added).
func (a *Arbiter) Remove(id int) {
	i, ok := a.index[id]
	if !ok {
		return
	}
	delete(a.index, id)
	if a.holder == i {
		a.holder = -1
	}
	if a.tailFrom == i {
		a.tailFrom = -1
	}
	last := len(a.inst) - 1
	if i != last {
		a.inst[i] = a.inst[last]
		a.index[a.inst[i].id] = i
		if a.holder == last {
			a.holder = i
		}
		if a.tailFrom == last {
			a.tailFrom = i
		}
	}
	a.inst[last] = instance{}
	a.inst = a.inst[:last]
}

// Len returns the number of registered instances.
func (a *Arbiter) Len() int { return len(a.inst) }

// Holder returns the instance that holds the grant, if any.
func (a *Arbiter) Holder() (int, bool) {
	if a.holder < 0 {
		return 0, false
	}
	return a.inst[a.holder].id, true
}

// Stats returns the accounting of instance id (the zero value if unknown).
func (a *Arbiter) Stats(id int) InstanceStats {
	i, ok := a.index[id]
	if !ok {
		return InstanceStats{}
	}
	in := &a.inst[i]
	s := in.st
	s.Credit = time.Duration(in.credit)
	s.Demand = in.demand
	s.Holding = a.holder == i
	return s
}

// kernelDecay weights the mean kernel length estimate towards recent ticks.
const kernelDecay = 7.0 / 8.0

// Tick advances the arbiter to now (monotonic; a value before the previous
// tick counts as no time passing) with the usage of the instances read at
// this tick. An instance missing from usage is treated as having no demand
// and no new GPU time. Tick returns the ids that hold a grant until the next
// tick: at most one. The returned slice is reused by the next Tick.
func (a *Arbiter) Tick(now time.Duration, usage map[int]Usage) []int {
	var dt time.Duration
	if a.started {
		if now > a.last {
			dt = now - a.last
			a.last = now
			a.tickEst += (float64(dt) - a.tickEst) / 8
		}
	} else {
		a.started = true
		a.last = now
	}

	// 1. Observe and charge. Online and offline instances are separate
	// pools: what an offline instance is charged is shared among the
	// offline ones only, and the other way round.
	var total, wd, offTotal, offWd float64
	nd := 0
	for i := range a.inst {
		in := &a.inst[i]
		if dt > 0 {
			if a.holder == i {
				in.st.Granted += dt
			} else if in.demand {
				in.st.Throttled += dt
			}
		}
		in.charged = 0
		u, ok := usage[in.id]
		if !ok {
			in.demand = false
			in.earns = false
			in.queued = 0
			in.launched = 0
			continue
		}
		var used time.Duration
		var launched uint64
		if in.seen {
			if u.GPUTime >= in.lastGPU {
				used = u.GPUTime - in.lastGPU
			}
			if u.Launches >= in.lastLaunches {
				launched = u.Launches - in.lastLaunches
			}
		}
		in.seen = true
		in.lastGPU, in.lastLaunches = u.GPUTime, u.Launches
		in.launched = launched
		in.queued = max(u.Queued, 0)
		in.waiting = u.Waiting
		if used > 0 || launched > 0 {
			in.kSum = in.kSum*kernelDecay + float64(used)
			in.lSum = in.lSum*kernelDecay + float64(launched)
		}
		if launched > 0 {
			in.launchAt = now - min(dt, time.Duration(a.kernel(in)))/2
		}
		c := float64(used)
		if in.discount > 0 {
			d := min(c, in.discount)
			c -= d
			in.discount -= d
			in.st.Discounted += time.Duration(d)
		}
		in.st.Used += used
		in.st.Charged += time.Duration(c)
		in.charged = c
		if in.offline {
			offTotal += c
		} else {
			total += c
		}
		if a.holder == i {
			in.demand = u.Waiting || !a.dry(in, launched, now)
		} else {
			in.demand = u.Waiting
			if in.queued == 0 {
				in.discount = 0 // everything it ran has been reported
			}
		}
		// Under the burst policies an instance whose queued work still
		// runs after a revoke keeps earning: its threads wait on that
		// work (the shim's queue bound, the application's events), not on
		// the grant, until it completes; it wants the device as much as
		// one that waits for the grant.
		in.earns = in.demand || in.queued > 0
		if in.earns {
			if in.offline {
				offWd += in.weight
			} else {
				wd += in.weight
			}
			nd++
		}
	}
	if h := a.holder; h >= 0 && !a.inst[h].demand && nd > 0 {
		// The holder ran dry while others waited: NextDecision expects it
		// to do so again (see dryProne).
		a.inst[h].dryAt, a.inst[h].dried = now, true
	}

	// 2. Earn credit.
	if a.fixed {
		acc := float64(min(dt, time.Duration(a.period)))
		for i := range a.inst {
			in := &a.inst[i]
			if !in.offline {
				in.credit += in.weight/100*acc - in.charged
			}
		}
		a.shedAtCaps()
		for i := range a.inst {
			in := &a.inst[i]
			if !in.offline {
				in.credit = min(max(in.credit, -a.period), a.cap(in))
			}
		}
	} else {
		a.shareCharged(false, total, wd)
	}
	a.shareCharged(true, offTotal, offWd)

	// 3. Decide.
	h := a.holder
	next := a.choose(now)
	if next != h {
		if h >= 0 {
			a.revoke(h, now)
		}
		if next >= 0 && !a.grant(next, now) {
			next = -1
		}
	}
	a.holder = next
	a.out = a.out[:0]
	if next >= 0 {
		a.out = append(a.out, a.inst[next].id)
	}
	return a.out
}

// shareCharged is the burst policies' earning, and every policy's for the
// offline instances: the device time charged this tick to the instances of
// one class (total) is handed to those of the class that earn, in
// proportion to their weights (wd in all), and their credits are
// re-centred on zero; the others keep no credit (debt is kept).
func (a *Arbiter) shareCharged(offline bool, total, wd float64) {
	var sum float64
	n := 0
	for i := range a.inst {
		in := &a.inst[i]
		if in.offline != offline {
			continue
		}
		if in.earns {
			in.credit += in.weight/wd*total - in.charged
			sum += in.credit
			n++
		} else {
			in.credit = min(in.credit-in.charged, 0)
		}
	}
	if n > 0 {
		mean := sum / float64(n)
		for i := range a.inst {
			in := &a.inst[i]
			if in.offline == offline && in.earns {
				in.credit -= mean
			}
		}
	}
	for i := range a.inst {
		in := &a.inst[i]
		if in.offline == offline {
			in.credit = max(in.credit, -a.period)
		}
	}
}

// choose decides who holds the grant after this tick. Among the online
// instances: the holder keeps it unless a candidate leads it by the
// hysteresis, or at all once it has held a Quantum; the highest credit
// wins. The offline instances are arbitrated the same way among
// themselves, only when no online instance holds or can enter; an online
// candidate takes the grant from an offline holder at once.
func (a *Arbiter) choose(now time.Duration) int {
	h := a.holder
	bestOn, bestOff := -1, -1
	for i := range a.inst {
		if i == h || !a.canEnter(i) {
			continue
		}
		b := &bestOn
		if a.inst[i].offline {
			b = &bestOff
		}
		if *b < 0 || a.inst[i].credit > a.inst[*b].credit {
			*b = i
		}
	}
	pick := func(h, best int, contested bool) int {
		next := best
		if h >= 0 && a.canHold(h, contested) {
			next = h
			if best >= 0 {
				hc, bc := a.inst[h].credit, a.inst[best].credit
				hy := a.hysteresis(&a.inst[h], &a.inst[best])
				if bc > hc+hy || (now-a.holdStart >= a.quantum && bc > hc) {
					next = best
				}
			}
		}
		return next
	}
	if h < 0 || !a.inst[h].offline {
		if next := pick(h, bestOn, bestOn >= 0 || bestOff >= 0); next >= 0 {
			return next
		}
		return bestOff
	}
	if bestOn >= 0 {
		return bestOn // online work preempts offline at once
	}
	return pick(h, bestOff, bestOff >= 0)
}

// shedAtCaps: under fixed-share, while the instances with demand subscribe
// the whole device (their cores sum to 100), credit one of them earns beyond
// its cap is taken from all of them in proportion to their cores, not from
// it alone (a waiting one: the holder's is clamped as before).
//
// Every instance earns its share of wall time and is charged only the time
// it uses, so time nobody uses (hand-offs, a holder whose queue runs empty
// between synchronised steps) leaves credit that the instances with demand
// cannot all spend: their credits drift up until a cap stops them. The caps
// are proportional to the cores, so the instance with the smallest cap
// reached its own first, waiting while a larger one held the grant, and
// lost the whole drift: with PyTorch loops that read every step's result
// back, a fixed-share 30 beside a 70 got 21 % of an H200 (the 70 its 70 %),
// a 20 beside a 30 and a 50 got 11 %, and the simulated GPU showed the same
// with mgpu-workload --sync-every. Shed in proportion to the cores, the
// loss is shared as the device is, and the others' credit no longer stays
// above the capped one's, so the grant reaches it. Credit below the caps is
// untouched: the drift still lets holders make up for lost time as before.
func (a *Arbiter) shedAtCaps() {
	var w, lambda float64
	for i := range a.inst {
		in := &a.inst[i]
		if !in.demand || in.offline {
			continue
		}
		w += in.weight
		if over := in.credit - a.cap(in); over > 0 && i != a.holder {
			lambda = max(lambda, over/in.weight)
		}
	}
	if lambda <= 0 || w != 100 {
		return
	}
	for i := range a.inst {
		if in := &a.inst[i]; in.demand && !in.offline {
			in.credit -= lambda * in.weight
		}
	}
}

// cap is a fixed-share instance's credit ceiling.
// It holds at least three of the instance's kernels: the hysteresis a
// candidate must lead by is two kernels, so a lower cap would make an
// instance of long kernels lose the credit it earns while it waits.
func (a *Arbiter) cap(in *instance) float64 {
	return max(in.weight/100*a.period, float64(a.quantum), 3*a.kernel(in))
}

// canHold reports whether holder i may keep the grant. A holder that ran dry
// keeps it only while nobody else can take it (keeping costs nothing).
func (a *Arbiter) canHold(i int, contested bool) bool {
	in := &a.inst[i]
	if contested && !in.demand {
		return false
	}
	return !a.fixed || in.offline || in.credit > 0
}

// canEnter reports whether non-holder i may be granted: it waits for a
// grant and, under fixed-share, has banked at least the entry threshold
// (the hysteresis, at most half its cap), so holds are not needlessly short.
func (a *Arbiter) canEnter(i int) bool {
	in := &a.inst[i]
	return in.demand && a.enterAfter(in) <= 0
}

// hysteresis is the credit lead a candidate needs to take the grant from
// the holder: Quantum/5, and at least two kernels of either instance, so
// that instances with long kernels are not handed off every kernel.
func (a *Arbiter) hysteresis(h, b *instance) float64 {
	return max(a.hyst, 2*a.kernel(h), 2*a.kernel(b))
}

// kernel returns the instance's recent mean kernel length (ns), 0 if unknown.
func (a *Arbiter) kernel(in *instance) float64 {
	if in.lSum <= 0 {
		return 0
	}
	return in.kSum / in.lSum
}

// dry reports whether the holder has stopped submitting. A saturating
// holder refills its queue whenever a kernel completes (Launches counts at
// submission, before the completion is reported), so its reported Queued
// never reaches zero, and it launches within about one kernel length of its
// previous launch, or of the grant plus the previous holder's tail it waits
// behind. So: nothing queued and nothing launched since the last tick, or no
// launch for 1.25 times the longest of its kernel, the bound and what it
// reports queued, plus a tick, means it has run out of
// work (or is busy on the CPU); what it queued runs anyway.
func (a *Arbiter) dry(in *instance, launched uint64, now time.Duration) bool {
	if launched > 0 {
		return false
	}
	if in.queued == 0 && now > a.holdStart {
		return true
	}
	// A holder that waits on its own queue (the shim's bound, the
	// application's events) launches at least once per kernel while it is
	// busy; calling it dry between two launches hands its grant and its
	// banked credit to the others. It is dry once it has launched nothing
	// for longer than its queued work can take (the queue is bounded): its
	// reported queue may lag, an idle application does not update it. The
	// queued work is at least what it reports: the mean kernel is an
	// estimate, which a launch counted while it waited for room and then
	// taken back at a revoke makes short (a 70 of 8 ms kernels was called
	// dry before every second kernel, from an estimate of 3.5 ms, and got
	// 65 % beside a 30 of 100 µs kernels).
	last := max(in.launchAt, a.holdStart+a.holdGrace)
	return float64(now-last) > 1.25*max(a.kernel(in), a.maxQueued, float64(in.queued))+a.tickEst
}

// tail estimates how much of instance i's queued work is still to run at
// now. A shim queue holds n = max(1, bound/k) kernels of mean length k and is
// refilled at every completion, so right after the last launch it holds n*k
// and drains from then on. The reported Queued (which lags completions)
// bounds the estimate.
func (a *Arbiter) tail(i int, now time.Duration) float64 {
	in := &a.inst[i]
	q := float64(in.queued)
	if q <= 0 {
		return 0
	}
	k := a.kernel(in)
	if k <= 0 {
		return min(q, a.maxQueued)
	}
	n := max(1, float64(int64(a.maxQueued/k)))
	return min(q, max(0, n*k-float64(now-in.launchAt)))
}

func (a *Arbiter) revoke(i int, now time.Duration) {
	a.tailFrom = i
	a.tailEnd = now + time.Duration(a.tail(i, now))
}

// grant makes i the holder at now; it reports false when the hand-off mode
// says to wait for the previous holder's tail.
func (a *Arbiter) grant(i int, now time.Duration) bool {
	if a.tailFrom >= 0 && a.tailFrom != i {
		rem := float64(a.tailEnd - now)
		mode := a.handoff
		if mode == HandoffAdaptive {
			mode = HandoffOverlap
			if a.longKernels(a.tailFrom) {
				mode = HandoffDrain
			}
		}
		switch mode {
		case HandoffDrain:
			if rem > a.tickEst/2 && a.inst[a.tailFrom].queued > 0 {
				return false
			}
		case HandoffTimed:
			if rem > a.leadOf(a.tailFrom) && a.inst[a.tailFrom].queued > 0 {
				return false
			}
		case HandoffOverlap:
			if rem > 0 {
				a.inst[i].discount += rem
			}
		}
	}
	a.holdGrace = 0
	if a.tailFrom >= 0 && a.tailFrom != i {
		a.holdGrace = max(0, a.tailEnd-now)
	}
	a.tailFrom = -1
	a.holdStart = now
	a.inst[i].st.Grants++
	return true
}

// longKernels reports whether instance i's kernels are longer than half the
// queue bound: its queued tail is then the remaining part of one kernel,
// whose end is only as well known as the time of its launch.
func (a *Arbiter) longKernels(i int) bool { return 2*a.kernel(&a.inst[i]) > a.maxQueued }

// longTailPoll is how often NextDecision looks for the end of a timed
// hand-off's tail of long kernels (see NextDecision).
const longTailPoll = 250 * time.Microsecond

// leadOf is how long before the estimated end of instance i's tail a timed
// hand-off grants the next holder: Lead, plus one of i's kernels up to a
// quarter of the queue bound. The shim learns of completions a mark at a
// time (a mark is about a quarter of the bound, or one kernel if longer)
// and refills its queue a wake-up after one, so its queue holds less than
// its reports say by about that much.
func (a *Arbiter) leadOf(i int) float64 {
	return float64(a.lead) + min(a.kernel(&a.inst[i]), a.maxQueued/4)
}

// HandingOff reports whether the grant is between two holders: a timed
// hand-off waits for the previous holder's tail. NextDecision is then the
// time to grant the next holder, which a caller should keep to even where
// it otherwise ticks no more often than every DefaultTick.
func (a *Arbiter) HandingOff() bool {
	return a.handoff == HandoffTimed && a.holder < 0 && a.tailFrom >= 0 && a.waitsForTail()
}

// waitsForTail reports whether an instance other than the last revoked
// holder could be granted now (and so waits for that holder's tail).
func (a *Arbiter) waitsForTail() bool {
	for i := range a.inst {
		if i != a.tailFrom && a.canEnter(i) {
			return true
		}
	}
	return false
}

// Never is what NextDecision returns when it foresees no decision.
const Never = time.Duration(math.MaxInt64)

// dryProne is how long NextDecision expects a holder that ran dry while
// others waited to do so again, at any Tick: a caller that ticks at
// NextDecision then notices it at once (work conservation), while a holder
// that keeps its queue full is not polled for it. A holder that runs dry
// less often costs the caller's longest interval once per dryProne.
const dryProne = time.Second

// NextDecision returns the earliest time after the last Tick at which a
// Tick could change the grant, given the credits, the kernel estimates and
// the earn and charge rates as they stand after that Tick: the holder is
// charged one nanosecond per nanosecond (a device busy with its work, the
// most it can be charged) once its hand-off discount is used up, nobody else
// is charged, and no instance starts or stops waiting. It foresees
//
//   - under fixed-share, the holder's credit running out;
//   - under fixed-share, a waiting instance's credit reaching its entry
//     threshold (when nobody holds, or the holder runs dry);
//   - a waiting instance's credit overtaking the holder's by the hysteresis,
//     or at all once the holder has held a Quantum;
//   - the holder being called dry while another instance could take the
//     grant: at any Tick if it ran dry so within the last dryProne; once
//     its queue drains or its launch deadline passes if it launched nothing
//     at the last Tick;
//   - a drained hand-off waiting for a tail: at any Tick (the tail ends
//     when its queue is reported empty).
//
// Under these assumptions the time is exact for the credit events (a Tick
// just before it keeps the grant where it is, one just after moves it;
// TestNextDecisionExact), or early where candidates' hysteresis differ
// (long kernels) or beyond a Period, and never late for the others. What it
// cannot foresee (an instance starting to wait, a holder emptying its queue,
// reports that lag or differ from the assumed rates) a caller that sleeps
// until the returned time must notice by ticking at least every few
// milliseconds anyway; a Tick earlier than needed only costs the tick.
// Never: nothing is foreseen (nobody waits, or a burst holder has no rival).
func (a *Arbiter) NextDecision() time.Duration {
	if !a.started {
		return Never
	}
	t := math.Inf(1) // ns after a.last
	h := a.holder
	if h < 0 {
		for i := range a.inst {
			if in := &a.inst[i]; in.demand {
				t = min(t, a.enterAfter(in))
			}
		}
		// Somebody could enter but the hand-off waits for a tail to drain:
		// it ends when the queue is reported empty, or is estimated done
		// (the estimate is only as good as the last launch's time): at
		// any Tick; a timed hand-off at the latest its lead before the
		// estimated end.
		if a.tailFrom >= 0 && a.waitsForTail() {
			t = 0
			if a.handoff == HandoffTimed {
				t = max(0, float64(a.tailEnd-a.last)-a.leadOf(a.tailFrom))
				if a.longKernels(a.tailFrom) {
					// The remaining part of one long kernel is only as
					// well known as the time of its launch, which a tick
					// brackets: look for its report of the end as well.
					t = min(t, float64(longTailPoll))
				}
			}
		}
		return a.after(t)
	}
	hi := &a.inst[h]
	if hi.offline {
		// An offline holder: an online waiter takes the grant once it
		// may enter; another offline one at the latest once the holder
		// has held a Quantum; anyone once it runs dry.
		quantumAt := max(0, float64(a.holdStart+a.quantum-a.last))
		for i := range a.inst {
			in := &a.inst[i]
			if i == h || !in.demand {
				continue
			}
			if in.offline {
				t = min(t, quantumAt, a.dryAfter(h))
			} else {
				t = min(t, a.enterAfter(in))
			}
		}
		return a.after(min(t, a.period))
	}
	o := outlook{fixed: a.fixed, disc: max(0, hi.discount), hc: hi.credit, hcap: math.Inf(1), freeze: math.Inf(1)}
	if a.fixed {
		o.he, o.hcap, o.freeze = hi.weight/100, a.cap(hi), a.freezeAfter(h)
		t = min(t, o.reach(0, -1, 0, 0)) // credit > 0 no longer holds
	} else {
		wd := 0.0
		for i := range a.inst {
			if (a.inst[i].earns || i == h) && !a.inst[i].offline {
				wd += a.inst[i].weight
			}
		}
		o.he, o.wd = hi.weight/wd, wd
	}
	quantumAt := float64(a.holdStart + a.quantum - a.last)
	enter := math.Inf(1) // the earliest a candidate may enter
	for i := range a.inst {
		in := &a.inst[i]
		if i == h || !in.demand {
			continue
		}
		if in.offline { // enters only when the holder cannot hold (runs dry)
			enter = min(enter, a.enterAfter(in))
			continue
		}
		te, ceil := a.enterAfter(in), math.Inf(1)
		if a.fixed {
			ceil = a.cap(in)
			if te > o.freeze {
				te = math.Inf(1) // nobody earns once the credits are frozen
			}
		}
		enter = min(enter, te)
		if te >= t {
			continue // it cannot enter before what is foreseen already
		}
		rate := in.weight / 100
		if !a.fixed {
			rate = in.weight / o.wd
		}
		lead := o.reach(a.hysteresis(hi, in), in.credit, rate, ceil)
		if quantumAt < lead { // or any lead, once the holder has held a Quantum
			lead = min(lead, max(quantumAt, o.reach(0, in.credit, rate, ceil)))
		}
		t = min(t, max(te, lead))
	}
	if !math.IsInf(enter, 1) {
		t = min(t, max(a.dryAfter(h), enter))
	}
	// Beyond a period the earnings are capped (dt is): come back then.
	if !math.IsInf(t, 1) {
		t = min(t, a.period)
	}
	return a.after(t)
}

// freezeAfter is how long (ns after the last Tick) until, under
// fixed-share, a waiting instance with demand reaches its cap while the
// instances with demand subscribe the whole device: from then on what any
// of them earns is shed again (shedAtCaps) and only the holder's credit
// moves. +Inf if that does not happen.
func (a *Arbiter) freezeAfter(h int) float64 {
	var w float64
	t := math.Inf(1)
	for i := range a.inst {
		in := &a.inst[i]
		if !in.demand || in.offline {
			continue
		}
		w += in.weight
		if i != h {
			t = min(t, max(0, (a.cap(in)-in.credit)/(in.weight/100)))
		}
	}
	if w != 100 {
		return math.Inf(1)
	}
	return t
}

// dryAfter is how long (ns after the last Tick) until holder h may be
// called dry (see dry and NextDecision).
func (a *Arbiter) dryAfter(h int) float64 {
	hi := &a.inst[h]
	switch {
	case !hi.demand || (hi.dried && a.last-hi.dryAt < dryProne):
		return 0
	case hi.launched == 0 && a.holdStart < a.last: // (a new holder has not had the chance)
		// Once its queue drains (its tail, then the report: the next Tick
		// may see it), at the latest after no launch for longer than
		// D + tickEst, tickEst being the next Tick's (an EWMA the interval
		// moves by 1/8).
		last := max(hi.launchAt, a.holdStart+a.holdGrace)
		d := 1.25*max(a.kernel(hi), a.maxQueued, float64(hi.queued)) - float64(a.last-last)
		return min(a.tail(h, a.last), max(0, 8.0/7.0*d+a.tickEst))
	}
	return math.Inf(1) // it launches: it goes on
}

// outlook is the holder's credit at the next Tick, as NextDecision assumes
// it: after the hand-off discount (disc ns, not charged) it is charged
// 1 ns/ns. Fixed-share: it earns he ns/ns of wall time throughout, up to
// hcap (applied once, at that Tick). Burst: the holder's charge is all there
// is to hand out, so nobody earns during the discount, then the holder
// earns he and a candidate of weight w earns w/wd.
type outlook struct {
	fixed      bool
	disc       float64
	hc, he, wd float64
	hcap       float64
	freeze     float64 // fixed-share: from then on nobody earns (shedAtCaps); +Inf if never
}

// earning is how much of [0, t] earns credit.
func (o *outlook) earning(t float64) float64 {
	if o.fixed {
		return min(t, o.freeze)
	}
	return max(0, t-o.disc)
}

// holder is the holder's credit at a Tick t after the last.
func (o *outlook) holder(t float64) float64 {
	if o.fixed {
		return min(o.hc+o.he*o.earning(t)-max(0, t-o.disc), o.hcap)
	}
	return o.hc - (1-o.he)*max(0, t-o.disc)
}

// reach returns the first t >= 0 at which a Tick sees a candidate's credit
// (c at the last Tick, earning rate up to ceil) lead the holder's by x
// (rate -1: the candidate is the zero line, so reach(0, -1, ..) is when the
// holder's credit falls to 0); +Inf if never. Both are piecewise linear in
// t: the candidate's bends where it reaches ceil, the holder's at the end
// of the discount and where it meets its ceiling.
func (o *outlook) reach(x, c, rate, ceil float64) float64 {
	lead := func(t float64) float64 {
		if rate < 0 {
			return -o.holder(t)
		}
		return min(c+rate*o.earning(t), ceil) - o.holder(t)
	}
	inf := math.Inf(1)
	bp := [5]float64{o.disc, inf, inf, inf, o.freeze} // breakpoints, then sorted
	if rate > 0 && !math.IsInf(ceil, 1) {
		bp[1] = max(0, (ceil-c)/rate)
		if !o.fixed {
			bp[1] += o.disc
		}
	}
	if o.fixed && !math.IsInf(o.hcap, 1) {
		if o.he > 0 { // rising to its ceiling during the discount
			bp[2] = max(0, (o.hcap-o.hc)/o.he)
		}
		if b := 1 - o.he; b > 0 { // and back under it
			bp[3] = o.disc + max(0, o.hc+o.he*o.disc-o.hcap)/b
		}
	}
	for i := 1; i < len(bp); i++ { // sort (insertion: 5 values)
		for j := i; j > 0 && bp[j] < bp[j-1]; j-- {
			bp[j], bp[j-1] = bp[j-1], bp[j]
		}
	}
	from := 0.0
	for i := 0; i <= len(bp); i++ {
		to := inf
		if i < len(bp) {
			to = bp[i]
		}
		if to <= from {
			continue
		}
		l := lead(from)
		if l >= x {
			return from
		}
		var slope float64
		if math.IsInf(to, 1) {
			slope = (lead(from+1e6) - l) / 1e6 // linear beyond the last breakpoint
		} else {
			slope = (lead(to) - l) / (to - from)
		}
		if slope > 0 {
			if t := from + (x-l)/slope; t <= to {
				return t
			}
		}
		from = to
	}
	return inf
}

// after converts a delay (ns after the last Tick) into the time of the
// first Tick that sees it: the rules compare strictly, so 1 ns later.
func (a *Arbiter) after(t float64) time.Duration {
	if math.IsInf(t, 1) || math.IsNaN(t) || t >= float64(Never-a.last-1) {
		return Never
	}
	return a.last + time.Duration(math.Ceil(max(t, 0))) + 1
}

// enterAfter is how long (ns) non-holder in must keep earning, at its
// fixed-share rate, to reach its entry threshold (0: it may enter now);
// burst candidates may always enter.
func (a *Arbiter) enterAfter(in *instance) float64 {
	if !a.fixed || in.offline {
		return 0
	}
	thr := min(a.hysteresis(in, in), a.cap(in)/2)
	if in.credit >= thr {
		return 0
	}
	return (thr - in.credit) / (in.weight / 100)
}
