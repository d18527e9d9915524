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
	DefaultFillGrace = 50 * time.Microsecond
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
	// FillGrace is how long every online instance must have been quiet
	// (nothing queued, no thread waiting for the grant) before an offline
	// instance fills the device beside them: a host gap inside an online
	// request shorter than this does not let offline work in. 0 selects
	// DefaultFillGrace.
	FillGrace time.Duration
	// FillOneAtATime: an offline instance that fills the device beside an
	// online holder keeps one kernel in flight (OneAtATime), so that an
	// online request finds at most that kernel ahead of its own; otherwise
	// it keeps its queue bound (more of the idle time filled, a longer
	// wait for the online request).
	FillOneAtATime bool
}

// Usage is what the enforcer reads from an instance's region at a tick.
type Usage struct {
	GPUTime  time.Duration // cumulative measured GPU time (monotonic; all processes, dead ones included)
	Queued   time.Duration // estimated GPU time submitted but not yet known complete
	Waiting  bool          // at least one thread is blocked waiting for a grant
	Launches uint64        // cumulative gated launches
	// IdleSince is when the instance's queue last became empty, as its
	// processes report it (0: not reported). It is read only while Queued
	// is 0 and nobody waits; a value after the Tick's time is ignored.
	IdleSince time.Duration
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
	quietFrom    time.Duration // since when nothing is queued and nobody waits; Never: not quiet
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

	holder    int // index into inst, -1 none; always an online instance
	holdStart time.Duration
	holdGrace time.Duration // previous holder's tail the holder waited behind

	// The offline instance that fills the device beside the quiet online
	// instances (see AddClass), -1 none, and since when.
	fill      int
	fillStart time.Duration
	fillGrace time.Duration
	fillOne   bool // Config.FillOneAtATime
	offWaits  bool // an offline instance had demand at the last Tick (Wake)

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
	if cfg.FillGrace <= 0 {
		cfg.FillGrace = DefaultFillGrace
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
		fill:      -1,
		fillGrace: cfg.FillGrace,
		fillOne:   cfg.FillOneAtATime,
		tailFrom:  -1,
		out:       make([]int, 0, 2),
	}
}

// Add registers instance id with its core (1..100; values outside are
// clamped). Adding a known id updates its core and keeps its accounting.
// The first Tick that carries the instance's usage takes its counters as
// the baseline, so GPU time used before Add is not charged.
func (a *Arbiter) Add(id int, core int) { a.AddClass(id, core, policy.Online) }

// AddClass is Add with the instance's class. The online instances are
// arbitrated as if the offline ones did not exist: one of them holds the
// grant as before, and keeps it while it is idle. An offline instance is
// granted beside it (it "fills" the device) only while every online
// instance is quiet, and has been for the fill grace (Config.FillGrace):
// nothing queued, no thread waiting for the grant, or waiting but not
// allowed to enter (a fixed-share instance at its cap). The fill is
// revoked at the first Tick that sees an online instance queue work or
// wait (Wake tells the enforcer which instances should wake it for that).
// The offline instances share the filled time among themselves in
// proportion to their cores, whatever the policy.
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
	a.inst = append(a.inst, instance{id: id, core: core, weight: float64(core), offline: off, quietFrom: Never, st: InstanceStats{Core: core}})
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
	if a.fill == i {
		a.fill = -1
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
		if a.fill == last {
			a.fill = i
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
	s.Holding = a.holder == i || a.fill == i
	return s
}

// kernelDecay weights the mean kernel length estimate towards recent ticks.
const kernelDecay = 7.0 / 8.0

// Tick advances the arbiter to now (monotonic; a value before the previous
// tick counts as no time passing) with the usage of the instances read at
// this tick. An instance missing from usage is treated as having no demand
// and no new GPU time. Tick returns the ids that hold a grant until the next
// tick: at most one online instance and one offline instance filling the
// device beside it. The returned slice is reused by the next Tick.
func (a *Arbiter) Tick(now time.Duration, usage map[int]Usage) []int {
	var dt time.Duration
	prev := a.last
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
	offDemand := false // an offline instance wants the device (else no fill)
	nd := 0
	for i := range a.inst {
		in := &a.inst[i]
		if dt > 0 {
			if a.holder == i || a.fill == i {
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
			in.quietFrom = now
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
		in.quietFrom = quietFrom(in, u, launched, prev, now)
		switch i {
		case a.holder:
			in.demand = u.Waiting || !a.dry(in, launched, now, a.holdStart, a.holdGrace)
		case a.fill:
			in.demand = u.Waiting || !a.dry(in, launched, now, a.fillStart, 0)
		default:
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
		offDemand = offDemand || in.offline && in.demand
		if in.earns {
			if in.offline {
				offWd += in.weight
			} else {
				wd += in.weight
				nd++ // online instances only: offline ones never take the holder's grant
			}
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
		if next >= 0 && a.fill >= 0 {
			// An online instance enters (its credit, a wake-up): the
			// filling offline instance gives way, and the hand-off
			// waits for its tail as for a revoked holder's, so that
			// the two do not interleave. (An online holder that gets
			// work keeps its grant and does not wait.)
			a.revokeFill(now)
		}
		if next >= 0 && !a.grant(next, now) {
			next = -1
		}
	}
	a.holder = next
	if f := a.chooseFill(now, offDemand); f != a.fill {
		if a.fill < 0 && f >= 0 && a.tailHolds(f, now) {
			// A revoked online holder's tail still runs: the fill
			// starts as a hand-off would, so that the two do not
			// interleave (a device switches between processes at a
			// cost).
			f = -1
		}
		if a.fill < 0 && f >= 0 {
			a.tailFrom = -1
		}
		a.fill, a.fillStart = f, now
		if f >= 0 {
			a.inst[f].st.Grants++
		}
	}
	a.offWaits = a.offlineWaits()
	a.out = a.out[:0]
	if next >= 0 {
		a.out = append(a.out, a.inst[next].id)
	}
	if a.fill >= 0 {
		a.out = append(a.out, a.inst[a.fill].id)
	}
	return a.out
}

// quietFrom is since when instance in (its usage u, launched launches since
// the Tick at prev) has had nothing queued and no thread waiting, as the
// Tick at now sees it: Never while it has; otherwise the time its processes
// report (Usage.IdleSince), or the Tick that first saw it quiet. A launch
// since the previous Tick, or work seen then, means it was busy after prev.
func quietFrom(in *instance, u Usage, launched uint64, prev, now time.Duration) time.Duration {
	if u.Queued > 0 || u.Waiting {
		return Never
	}
	lower := time.Duration(0)
	if launched > 0 || in.quietFrom == Never {
		lower = prev
	}
	if u.IdleSince > 0 && u.IdleSince <= now {
		return max(u.IdleSince, lower)
	}
	if launched > 0 || in.quietFrom == Never {
		return now
	}
	return in.quietFrom
}

// fillAt is the time from which an offline instance may fill the device:
// the fill grace after the online holder became quiet (the Tick's time if
// none holds); Never while the holder is busy or another online instance
// may enter. An online instance that waits but may not enter (held back by
// its policy) does not keep the offline ones out, nor does the tail of a
// revoked one.
func (a *Arbiter) fillAt() time.Duration {
	at := a.last
	for i := range a.inst {
		in := &a.inst[i]
		switch {
		case in.offline:
		case i == a.holder:
			if in.quietFrom == Never {
				return Never
			}
			at = max(at, in.quietFrom+a.fillGrace)
		case a.canEnter(i):
			return Never
		}
	}
	return at
}

// chooseFill decides which offline instance fills the device after this
// Tick: none unless the online instances have been quiet for the fill
// grace; else the filling one keeps it while it has demand, unless another
// leads it by the hysteresis, or at all once it has filled for a Quantum;
// the highest credit wins. With no fill and no offline demand it is none,
// whatever the online instances do (fillAt is then not worked out).
func (a *Arbiter) chooseFill(now time.Duration, offDemand bool) int {
	if !offDemand && a.fill < 0 {
		return -1
	}
	if at := a.fillAt(); at == Never || at > now {
		return -1
	}
	f, best := a.fill, -1
	for i := range a.inst {
		if in := &a.inst[i]; i != f && in.offline && in.demand && (best < 0 || in.credit > a.inst[best].credit) {
			best = i
		}
	}
	if f < 0 || (!a.inst[f].demand && best >= 0) {
		return best
	}
	if best >= 0 {
		hc, bc := a.inst[f].credit, a.inst[best].credit
		if bc > hc+a.hysteresis(&a.inst[f], &a.inst[best]) || (now-a.fillStart >= a.quantum && bc > hc) {
			return best
		}
	}
	return f
}

// Wake says when the enforcer wants to hear from instance id's processes
// at once rather than at its next Tick (the shim wakes it, mgpu_region.h):
// busy, when one queues work or starts waiting for the grant (an offline
// instance fills the device beside it, and must stop); idle, when its queue
// empties (an offline instance waits for the online ones to be quiet, and
// this one is not).
func (a *Arbiter) Wake(id int) (busy, idle bool) {
	i, ok := a.index[id]
	if !ok || a.inst[i].offline {
		return false, false
	}
	if a.fill >= 0 {
		return true, false
	}
	return false, a.inst[i].quietFrom == Never && a.offWaits
}

// OneAtATime reports whether instance id holds its grant only to keep one
// kernel in flight (Config.FillOneAtATime): it is the offline instance
// filling the device beside an online holder, which may get work at any
// moment and then finds that one kernel ahead of its own (mgpu_region.h,
// MGPU_GRANT_ONE). An offline instance filling while no online instance
// holds (they are held back by their policy; their return is foreseen and
// handed off as a hold is) keeps its queue bound.
func (a *Arbiter) OneAtATime(id int) bool {
	i, ok := a.index[id]
	return ok && a.fillOne && i == a.fill && a.holder >= 0
}

// offlineWaits reports whether an offline instance waits to fill.
func (a *Arbiter) offlineWaits() bool {
	for i := range a.inst {
		if in := &a.inst[i]; in.offline && in.demand {
			return true
		}
	}
	return false
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

// choose decides which online instance holds the grant after this tick
// (the offline ones are left to chooseFill): the holder keeps it unless a
// candidate leads it by the hysteresis, or at all once it has held a
// Quantum; the highest credit wins.
func (a *Arbiter) choose(now time.Duration) int {
	h := a.holder
	best := -1
	for i := range a.inst {
		if i == h || a.inst[i].offline || !a.canEnter(i) {
			continue
		}
		if best < 0 || a.inst[i].credit > a.inst[best].credit {
			best = i
		}
	}
	next := best
	if h >= 0 && a.canHold(h, best >= 0) {
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

// canHold reports whether holder i (an online instance: an offline one only
// ever fills) may keep the grant. A holder that ran dry keeps it only while
// nobody else can take it (keeping costs nothing).
func (a *Arbiter) canHold(i int, contested bool) bool {
	in := &a.inst[i]
	if contested && !in.demand {
		return false
	}
	return !a.fixed || in.credit > 0
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
func (a *Arbiter) dry(in *instance, launched uint64, now, start, grace time.Duration) bool {
	if launched > 0 {
		return false
	}
	if in.queued == 0 && now > start {
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
	last := max(in.launchAt, start+grace)
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

// revokeFill ends the fill at now: the next holder's hand-off waits for the
// longer of the filling instance's tail and a revoked holder's.
func (a *Arbiter) revokeFill(now time.Duration) {
	if end := now + time.Duration(a.tail(a.fill, now)); a.tailFrom < 0 || end > a.tailEnd {
		a.tailFrom, a.tailEnd = a.fill, end
	}
	a.fill = -1
}

// grant makes i the holder at now; it reports false when the hand-off mode
// says to wait for the previous holder's tail.
func (a *Arbiter) grant(i int, now time.Duration) bool {
	if a.tailHolds(i, now) {
		return false
	}
	if a.tailFrom >= 0 && a.tailFrom != i && a.mode() == HandoffOverlap {
		if rem := float64(a.tailEnd - now); rem > 0 {
			a.inst[i].discount += rem
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

// mode is the hand-off mode for the last revoked holder's tail.
func (a *Arbiter) mode() Handoff {
	if a.handoff != HandoffAdaptive {
		return a.handoff
	}
	if a.longKernels(a.tailFrom) {
		return HandoffDrain
	}
	return HandoffOverlap
}

// tailHolds reports whether granting i at now waits for the last revoked
// holder's tail (the hand-off mode says so).
func (a *Arbiter) tailHolds(i int, now time.Duration) bool {
	if a.tailFrom < 0 || a.tailFrom == i || a.inst[a.tailFrom].queued <= 0 {
		return false
	}
	rem := float64(a.tailEnd - now)
	switch a.mode() {
	case HandoffDrain:
		return rem > a.tickEst/2
	case HandoffTimed:
		return rem > a.leadOf(a.tailFrom)
	}
	return false
}

// tailNext is how long (ns after the last Tick) until a hand-off waiting
// for the last revoked holder's tail may go: at any Tick (the tail ends
// when its queue is reported empty), a timed hand-off at the latest its
// lead before the estimated end.
func (a *Arbiter) tailNext() float64 {
	t := 0.0
	if a.handoff == HandoffTimed {
		t = max(0, float64(a.tailEnd-a.last)-a.leadOf(a.tailFrom))
		if a.longKernels(a.tailFrom) {
			// The remaining part of one long kernel is only as well
			// known as the time of its launch, which a tick brackets:
			// look for its report of the end as well.
			t = min(t, float64(longTailPoll))
		}
	}
	return t
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

// FillPending reports whether an offline instance waits for the fill grace
// of the quiet online instances to end: NextDecision is then the time to
// let it in, which a caller should keep to (like a timed hand-off).
func (a *Arbiter) FillPending() bool {
	return a.fill < 0 && a.offlineWaits() && a.fillAt() != Never
}

// waitsForTail reports whether an instance other than the last revoked
// holder could be granted now (and so waits for that holder's tail).
func (a *Arbiter) waitsForTail() bool {
	for i := range a.inst {
		if i != a.tailFrom && !a.inst[i].offline && a.canEnter(i) {
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
	return a.after(min(a.onlineNext(), a.fillNext()))
}

// onlineNext is NextDecision among the online instances: ns after the last
// Tick, +Inf for none.
func (a *Arbiter) onlineNext() float64 {
	t := math.Inf(1) // ns after a.last
	h := a.holder
	if h < 0 {
		for i := range a.inst {
			if in := &a.inst[i]; in.demand && !in.offline {
				t = min(t, a.enterAfter(in))
			}
		}
		// Somebody could enter but the hand-off waits for a tail to drain:
		// it ends when the queue is reported empty, or is estimated done
		// (the estimate is only as good as the last launch's time).
		if a.tailFrom >= 0 && a.waitsForTail() {
			t = a.tailNext()
		}
		return t
	}
	hi := &a.inst[h]
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
		if i == h || !in.demand || in.offline {
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
	return t
}

// fillNext is NextDecision for the offline instances: ns after the last
// Tick, +Inf for none. While one fills the device: another offline one
// takes over once it leads by the hysteresis (or the filling one has filled
// for a Quantum), or the filling one runs dry; an online instance that may
// enter is foreseen by onlineNext, one that queues work is not (Wake). While
// one waits: the end of the fill grace of the quiet online instances.
func (a *Arbiter) fillNext() float64 {
	f := a.fill
	t := math.Inf(1)
	if f < 0 {
		if !a.offlineWaits() {
			return t
		}
		if at := a.fillAt(); at != Never {
			t = max(0, float64(at-a.last))
			if a.tailFrom >= 0 {
				t = max(t, a.tailNext())
			}
		}
		return t
	}
	fi := &a.inst[f]
	quantumAt := max(0, float64(a.fillStart+a.quantum-a.last))
	for i := range a.inst {
		in := &a.inst[i]
		if i == f || !in.demand || !in.offline {
			continue
		}
		// Credits move only by what is charged: a Tick a Quantum in (or
		// once the filling one runs dry) re-decides.
		t = min(t, quantumAt, a.fillDryAfter())
		if in.credit > fi.credit+a.hysteresis(fi, in) {
			t = 0
		}
	}
	return min(t, a.period)
}

// fillDryAfter is how long (ns after the last Tick) until the filling
// offline instance may be called dry (see dry).
func (a *Arbiter) fillDryAfter() float64 {
	fi := &a.inst[a.fill]
	if !fi.demand {
		return 0
	}
	if fi.launched > 0 {
		return math.Inf(1)
	}
	last := max(fi.launchAt, a.fillStart)
	d := 1.25*max(a.kernel(fi), a.maxQueued, float64(fi.queued)) - float64(a.last-last)
	return min(a.tail(a.fill, a.last), max(0, 8.0/7.0*d+a.tickEst))
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

// enterAfter is how long (ns) online non-holder in must keep earning, at
// its fixed-share rate, to reach its entry threshold (0: it may enter now);
// burst candidates may always enter. Offline instances never enter: they
// fill (chooseFill).
func (a *Arbiter) enterAfter(in *instance) float64 {
	if !a.fixed {
		return 0
	}
	thr := min(a.hysteresis(in, in), a.cap(in)/2)
	if in.credit >= thr {
		return 0
	}
	return (thr - in.credit) / (in.weight / 100)
}
