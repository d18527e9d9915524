// Package arbiter decides which instance of one device may submit GPU work.
// It is pure logic on a virtual clock: time and the instances' measured
// usage are inputs, the grant holders are the output. The enforcer reads
// every instance's region counters, calls Tick, writes the grant words, and
// ticks again at NextDecision.
//
// The model is docs/arbiter.md §Algorithm, in brief: at most one online
// instance holds the grant; the order is per-instance virtual time (v +=
// charged · 100 / core, the lowest v holds next, a holder keeps the grant
// until it is a slice of its device time ahead); a fixed-share instance's
// cap is a token bucket, kept apart from the order; a holder that stops
// launching is dry past one deadline; the grant moves by one timed
// hand-off; offline instances are a second pool that fills the device
// while the online pool is quiet. Files by concern: arbiter.go (state
// and observation), select.go (eligibility and selection), handoff.go,
// fill.go (the offline pool and wake-ups), deadline.go (the deadlines).
//
// An Arbiter is not safe for concurrent use: the enforcer serialises calls.
package arbiter

import (
	"cmp"
	"math"
	"time"

	"github.com/mgpu-dev/mgpu/internal/policy"
)

// Defaults, the production configuration (docs/arbiter.md "Rules and
// constants"). The queue bounds are the shim's per class (the enforcer
// writes them as max_queued_ns); DefaultTick is its shortest tick interval.
const (
	DefaultPeriod           = 100 * time.Millisecond
	DefaultQuantum          = 20 * time.Millisecond
	DefaultMaxQueued        = 2 * time.Millisecond
	DefaultOfflineMaxQueued = 500 * time.Microsecond
	DefaultTick             = 1 * time.Millisecond
	DefaultLead             = 100 * time.Microsecond // a hand-off's grant before the tail ends, at least (a wake-up)
	DefaultFillGrace        = 200 * time.Microsecond // the quiet grace: a holder's or the online pool's
)

// Never is what NextDecision returns when it foresees no decision.
const Never = time.Duration(math.MaxInt64)

// Config configures an Arbiter. The zero value (with a Policy) is the
// production configuration.
type Config struct {
	Policy policy.Policy
	// Period (compute_timeslice) scales a fixed-share instance's bucket:
	// depth c/100 · Period. 0 selects DefaultPeriod.
	Period time.Duration
	// Quantum is the shortest slice (compute_timeslice_native_burst
	// under native-burst-share). 0 selects DefaultQuantum.
	Quantum time.Duration
	// FillOneAtATime: an offline instance filling beside an online holder
	// keeps one kernel in flight (online_offline_switch = 2).
	FillOneAtATime bool
}

// Usage is what the enforcer reads from an instance's region at a tick.
type Usage struct {
	GPUTime  time.Duration // cumulative measured GPU time (monotonic)
	Queued   time.Duration // submitted, not yet known complete
	Waiting  bool          // a thread is blocked waiting for a grant
	Launches uint64        // cumulative gated launches
	// IdleSince is when the instance's queue last became empty (0: not
	// reported); read while Queued is 0 and nobody waits.
	IdleSince time.Duration
}

// InstanceStats are an instance's cumulative accounting.
type InstanceStats struct {
	Core      int
	Granted   time.Duration // time it held the grant
	Used      time.Duration // measured GPU time charged since it was added
	Throttled time.Duration // time it had demand but no grant
	Tokens    time.Duration // fixed-share bucket (online), else 0
	Lag       time.Duration // device time it is behind its pool's holder in virtual time (negative: ahead; 0 without a holder)
	Grants    uint64        // times it was granted after not holding
	Demand    bool          // it had demand at the last tick
	Holding   bool          // it holds the grant now
}

type instance struct {
	id    int
	core  int
	w     float64 // core / 100
	off   bool    // offline pool
	bound float64 // its queue bound, ns

	seen, waiting   bool
	lastGPU, queued time.Duration
	lastLaunches    uint64
	launched        uint64        // launches since the previous tick
	launchAt        time.Duration // estimated time of its last launch
	quietFrom       time.Duration // since when nothing queued and nobody waits; Never: busy
	refilled        bool          // holding, one of its quiet spells ended in a launch (since its grant)
	longSpells      int           // as a holder, its last quiet spells in a row that the fill ran in and that outlasted G and a wake-up
	demand          bool
	joined          bool          // demand at this tick after none at the previous
	idleFrom        time.Duration // the tick that first saw it without demand

	v          float64 // virtual time, ns / w
	tokens     float64 // fixed-share bucket, ns
	kSum, lSum float64 // decayed sums for the mean kernel

	st InstanceStats
}

// pool is one class's grant: its holder and since when.
type pool struct {
	off    bool
	holder int           // index, -1 none
	start  time.Duration // grant time
	grace  time.Duration // tail of another instance it was granted behind
	vmin   float64       // lowest v among its demanders at the last tick that had any
}

// Arbiter is the arbiter of one device.
type Arbiter struct {
	fixed     bool
	period    float64
	quantum   float64    // the shortest slice
	bound     [2]float64 // online, offline queue bounds
	fillOne   bool
	inst      []instance
	index     map[int]int
	started   bool
	last      time.Duration
	on, off   pool
	tailFrom  int           // the last revoked holder whose tail may still run, -1 none
	tailEnd   time.Duration // when that tail is estimated to end
	offWaits  bool          // an offline instance had demand at the last tick
	contested bool          // an online instance other than the holder is a candidate
	out       []int
}

// New returns an arbiter for one device.
func New(cfg Config) *Arbiter {
	def := func(d, v time.Duration) float64 { return float64(cmp.Or(max(d, 0), v)) }
	return &Arbiter{
		fixed:    cfg.Policy == policy.FixedShare || !cfg.Policy.Valid(),
		period:   def(cfg.Period, DefaultPeriod),
		quantum:  def(cfg.Quantum, DefaultQuantum),
		bound:    [2]float64{float64(DefaultMaxQueued), float64(DefaultOfflineMaxQueued)},
		fillOne:  cfg.FillOneAtATime,
		index:    make(map[int]int),
		on:       pool{holder: -1},
		off:      pool{off: true, holder: -1},
		tailFrom: -1,
		out:      make([]int, 0, 2),
	}
}

// Add registers online instance id with its core (clamped to 1..100).
// Adding a known id updates its core and keeps its accounting. The first
// Tick that carries its usage takes its counters as the baseline.
func (a *Arbiter) Add(id int, core int) { a.AddClass(id, core, policy.Online) }

// AddClass is Add with the instance's class: an offline instance is in the
// offline pool, which fills the device while the online pool is quiet.
func (a *Arbiter) AddClass(id int, core int, class policy.Class) {
	core = min(max(core, 1), 100)
	off := class == policy.Offline
	b := a.bound[0]
	if off {
		b = a.bound[1]
	}
	if i, ok := a.index[id]; ok {
		in := &a.inst[i]
		if in.off != off { // it leaves its pool's grant
			for _, p := range []*pool{&a.on, &a.off} {
				if p.holder == i {
					p.holder = -1
				}
			}
		}
		in.core, in.w, in.off, in.bound, in.st.Core = core, float64(core)/100, off, b, core
		return
	}
	a.index[id] = len(a.inst)
	a.inst = append(a.inst, instance{id: id, core: core, w: float64(core) / 100, off: off, bound: b,
		quietFrom: Never, v: a.poolOf(off).vmin, st: InstanceStats{Core: core}})
	in := &a.inst[len(a.inst)-1]
	in.tokens = a.entry(in) // enough to enter at once, no more
}

// Remove forgets instance id; it is never granted again.
func (a *Arbiter) Remove(id int) {
	i, ok := a.index[id]
	if !ok {
		return
	}
	delete(a.index, id)
	last := len(a.inst) - 1
	move := func(x *int) {
		switch *x {
		case i:
			*x = -1
		case last:
			*x = i
		}
	}
	move(&a.on.holder)
	move(&a.off.holder)
	move(&a.tailFrom)
	if i != last {
		a.inst[i] = a.inst[last]
		a.index[a.inst[i].id] = i
	}
	a.inst[last] = instance{}
	a.inst = a.inst[:last]
}

// Len returns the number of registered instances.
func (a *Arbiter) Len() int { return len(a.inst) }

// Holder returns the online instance that holds the grant, if any.
func (a *Arbiter) Holder() (int, bool) {
	if a.on.holder < 0 {
		return 0, false
	}
	return a.inst[a.on.holder].id, true
}

// Stats returns the accounting of instance id (the zero value if unknown).
func (a *Arbiter) Stats(id int) InstanceStats {
	i, ok := a.index[id]
	if !ok {
		return InstanceStats{}
	}
	in := &a.inst[i]
	s := in.st
	if a.fixed && !in.off {
		s.Tokens = time.Duration(in.tokens)
	}
	if h := a.poolOf(in.off).holder; h >= 0 {
		s.Lag = time.Duration((a.inst[h].v - in.v) * in.w)
	}
	s.Demand = in.demand
	s.Holding = a.on.holder == i || a.off.holder == i
	return s
}

func (a *Arbiter) poolOf(off bool) *pool {
	if off {
		return &a.off
	}
	return &a.on
}

// kernelDecay weights the mean kernel estimate towards recent ticks.
const kernelDecay = 7.0 / 8.0

// Tick advances the arbiter to now (a value before the previous tick counts
// as no time passing) with the usage read at this tick; an instance missing
// from usage has no demand and no new GPU time. It returns the ids that
// hold a grant until the next tick: at most one online instance and one
// offline instance filling beside it. The slice is reused by the next Tick.
func (a *Arbiter) Tick(now time.Duration, usage map[int]Usage) []int {
	var dt time.Duration
	prev := a.last
	if a.started && now > a.last {
		dt = now - a.last
	}
	if !a.started || now > a.last {
		a.last = now
	}
	a.started = true
	for i := range a.inst {
		a.observe(i, usage, dt, prev, now)
	}
	a.join(&a.on)
	a.join(&a.off)
	a.decide(now)
	a.out = a.out[:0]
	for _, p := range []*pool{&a.on, &a.off} {
		if p.holder >= 0 {
			a.out = append(a.out, a.inst[p.holder].id)
		}
	}
	return a.out
}

// observe reads instance i's usage at now: charges what it measured (its
// virtual time and bucket), updates its kernel estimate and its demand.
func (a *Arbiter) observe(i int, usage map[int]Usage, dt, prev, now time.Duration) {
	in := &a.inst[i]
	p := a.poolOf(in.off)
	if dt > 0 {
		if p.holder == i {
			in.st.Granted += dt
		} else if in.demand {
			in.st.Throttled += dt
		}
	}
	had := in.demand
	u, ok := usage[in.id]
	var used time.Duration
	if ok {
		if in.seen && u.GPUTime >= in.lastGPU {
			used = u.GPUTime - in.lastGPU
		}
		in.launched = 0
		if in.seen && u.Launches >= in.lastLaunches {
			in.launched = u.Launches - in.lastLaunches
		}
		in.seen = true
		in.lastGPU, in.lastLaunches = u.GPUTime, u.Launches
		in.queued, in.waiting = max(u.Queued, 0), u.Waiting
	} else {
		in.queued, in.waiting, in.launched = 0, false, 0
	}
	if used > 0 || in.launched > 0 {
		in.kSum = in.kSum*kernelDecay + float64(used)
		in.lSum = in.lSum*kernelDecay + float64(in.launched)
	}
	if in.launched > 0 {
		in.launchAt = now - min(dt, time.Duration(a.kernel(in)))/2
	}
	c := float64(used)
	in.st.Used += used
	in.v += c / in.w
	if a.fixed && !in.off {
		in.tokens = min(max(in.tokens+in.w*float64(dt)-c, -a.period), a.depth(in))
	}
	// A quiet spell of the holder seen at the previous tick, or reported since,
	// ended in a launch: it refilled (Wake); one seen counts for fillAt.
	in.refilled = in.refilled || p.holder == i && in.launched > 0 && (in.quietFrom != Never || ok && u.IdleSince > prev)
	if p.holder == i && in.launched > 0 && in.quietFrom != Never {
		in.longSpells++
		if a.off.holder < 0 || now-in.quietFrom <= DefaultFillGrace+DefaultLead {
			in.longSpells = 0
		}
	}
	in.quietFrom = quietFrom(in, u, ok, prev, now)
	in.demand = in.waiting || (p.holder == i && now < a.dryAt(in, p)) // not dry
	in.joined = in.demand && !had
	if had && !in.demand {
		in.idleFrom = now
	}
}

// quietFrom is since when instance in has had nothing queued and no thread
// waiting, as the Tick at now sees it (Never while it has): the time its
// processes report (Usage.IdleSince), not before the previous Tick if it
// launched since, else the first Tick that saw it quiet.
func quietFrom(in *instance, u Usage, ok bool, prev, now time.Duration) time.Duration {
	if !ok {
		return now
	}
	if u.Queued > 0 || u.Waiting {
		return Never
	}
	fresh := in.launched > 0 || in.quietFrom == Never
	if u.IdleSince > 0 && u.IdleSince <= now {
		if fresh {
			return max(u.IdleSince, prev)
		}
		return u.IdleSince
	}
	if fresh {
		return now
	}
	return in.quietFrom
}

// kernel returns the instance's recent mean kernel length (ns), 0 if unknown.
func (a *Arbiter) kernel(in *instance) float64 {
	if in.lSum <= 0 {
		return 0
	}
	return in.kSum / in.lSum
}
