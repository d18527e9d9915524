package arbiter

import (
	"math"
	"time"
)

// The deadlines (docs/arbiter.md §Algorithm, steps 3 and 8): when a holder
// is dry, and when the next Tick could move a grant. NextDecision uses the
// functions Tick decides with.

// dryAt is the one dry deadline of pool p's holder in (Never: it launched
// since the previous Tick and has work queued): it is dry from then on.
// Quiet (nothing queued, nobody waiting): the quiet grace after its queue
// emptied, so that a host gap between two batches (a step reading its loss
// back) does not count. Otherwise the longest of its kernel, its queue
// bound and its reported queue (a holder that waits on its own queue
// launches at least once per kernel while busy), with a quarter of margin
// and a tick, after its last launch (or its grant plus the tail it was
// granted behind).
func (a *Arbiter) dryAt(in *instance, p *pool) time.Duration {
	switch {
	case in.quietFrom != Never:
		return in.quietFrom + DefaultFillGrace
	case in.launched > 0:
		return Never
	}
	last := max(in.launchAt, p.start+p.grace)
	return last + time.Duration(1.25*max(a.kernel(in), in.bound, float64(in.queued))) + DefaultTick
}

// NextDecision returns the earliest time after the last Tick at which a
// Tick could move a grant (the holder's v a slice ahead of a candidate's,
// a bucket running out or reaching its entry, a contested holder's dry
// deadline, a hand-off's grant, the fill grace's end), assuming the holder
// is charged 1 ns per ns and nothing else changes: never late, maybe
// early; what it cannot foresee wakes the enforcer (Wake) or is seen at
// its next tick. Never: nothing is foreseen.
func (a *Arbiter) NextDecision() time.Duration {
	if !a.started {
		return Never
	}
	t := min(a.poolNext(&a.on), a.poolNext(&a.off))
	if math.IsInf(t, 1) || t >= float64(Never-a.last-1) {
		return Never
	}
	// The rules compare strictly: the first Tick that sees t is 1 ns later.
	return a.last + time.Duration(math.Ceil(max(t, 0))) + 1
}

// Urgent reports whether the device may idle until NextDecision: a
// hand-off's grant time, the end of the fill grace, or the quiet grace of
// a contested holder, which a caller should keep to within a wake-up
// rather than a tick.
func (a *Arbiter) Urgent() bool {
	h := a.on.holder
	return !math.IsInf(a.handoffAfter(&a.on), 1) || !math.IsInf(a.fillNext(), 1) ||
		h >= 0 && a.contested && a.inst[h].quietFrom != Never
}

// Contested reports whether an online candidate waits beside a holder that refilled
// (step 9), whose quiet Wake no longer reports: ticks at least every DefaultTick.
func (a *Arbiter) Contested() bool {
	h := a.on.holder
	return h >= 0 && a.contested && !a.offWaits && a.inst[h].refilled
}

// poolNext is NextDecision for pool p: ns after the last Tick, +Inf for none.
func (a *Arbiter) poolNext(p *pool) float64 {
	h := p.holder
	if h < 0 {
		if p.off {
			return a.fillNext()
		}
		t := a.handoffAfter(p)
		if math.IsInf(t, 1) && a.fixed { // nobody can enter until a bucket reaches its entry
			for i := range a.inst {
				if in := &a.inst[i]; !in.off && in.demand {
					t = min(t, a.enterAfter(in))
				}
			}
		}
		return t
	}
	hi := &a.inst[h]
	t := math.Inf(1)
	if a.fixed && !hi.off && hi.w < 1 {
		t = max(0, hi.tokens) / (1 - hi.w) // its bucket runs out
	}
	// A waiting instance takes the grant once it may enter and the
	// holder's virtual time is a slice ahead of its own.
	contested := false
	for i := range a.inst {
		in := &a.inst[i]
		if i == h || in.off != p.off || !in.demand {
			continue
		}
		e := 0.0
		if !p.off {
			e = a.enterAfter(in)
		}
		contested = contested || e == 0
		t = min(t, max(e, (in.v-hi.v)*hi.w+a.slice(hi)))
	}
	if d := a.dryAt(hi, p); contested && d != Never && p.start < a.last { // (a new holder has not had the chance)
		t = min(t, max(0, float64(d-a.last)-1))
	}
	return t
}

// enterAfter is how long (ns) until online instance in's bucket reaches its
// entry at its earning rate (0: it may enter now).
func (a *Arbiter) enterAfter(in *instance) float64 {
	if !a.fixed {
		return 0
	}
	return max(0, (a.entry(in)-in.tokens)/in.w)
}

// fillNext is how long (ns after the last Tick) until an offline instance
// that waits may fill: the end of the fill grace, and of a tail it waits
// behind; +Inf if none waits or the online pool is not quiet.
func (a *Arbiter) fillNext() float64 {
	if a.off.holder >= 0 || !a.offWaits {
		return math.Inf(1)
	}
	at := a.fillAt()
	if at == Never {
		return math.Inf(1)
	}
	return max(float64(at-a.last), a.tailWait())
}
