package arbiter

import (
	"math"
	"time"
)

// The hand-off (docs/arbiter.md §Algorithm, step 6): A's queued tail still
// runs when the grant leaves it; the next holder is granted its lead before
// that tail is estimated to end, or at the first tick that sees A report
// nothing queued, so their work does not interleave and the device stays busy.

// longTailPoll is how often the deadlines look for the end of a tail of one
// long kernel (whose end is only as well known as its launch).
const longTailPoll = 250 * time.Microsecond

// revoke ends pool p's hold at now and records the holder's tail (the
// longer of it and a tail still recorded).
func (a *Arbiter) revoke(p *pool, now time.Duration) {
	h := p.holder
	p.holder = -1
	if end := now + time.Duration(a.tail(h, now)); !a.tailLeft() || end > a.tailEnd {
		a.tailFrom, a.tailEnd = h, end
	}
}

// tailLeft reports whether the recorded tail may still be running.
func (a *Arbiter) tailLeft() bool { return a.tailFrom >= 0 && a.inst[a.tailFrom].queued > 0 }

// tailWaits reports whether granting i at now waits for the recorded tail.
func (a *Arbiter) tailWaits(i int, now time.Duration) bool {
	return a.tailFrom != i && a.tailLeft() && float64(a.tailEnd-now) > a.lead(a.tailFrom)
}

// grant makes i pool p's holder at now.
func (a *Arbiter) grant(p *pool, i int, now time.Duration) {
	p.grace = 0
	if a.tailFrom >= 0 && a.tailFrom != i && a.tailLeft() {
		p.grace = max(0, a.tailEnd-now)
	}
	a.tailFrom = -1
	p.holder, p.start = i, now
	a.inst[i].refilled = false
	a.inst[i].st.Grants++
}

// tail estimates how much of instance i's queued work is still to run at
// now: its queue of n = max(1, bound/k) kernels of mean length k is full
// right after its last launch and drains from then on; what it reports
// queued (which lags completions) bounds the estimate.
func (a *Arbiter) tail(i int, now time.Duration) float64 {
	in := &a.inst[i]
	q := float64(in.queued)
	k := a.kernel(in)
	if q <= 0 || k <= 0 {
		return min(q, in.bound)
	}
	n := max(1, math.Floor(in.bound/k))
	return min(q, max(0, n*k-float64(now-in.launchAt)))
}

// lead is how long before the estimated end of instance i's tail the next
// holder is granted: DefaultLead (its wake-up), plus one of i's kernels up
// to b/4 (the shim learns of completions a mark, about b/4, at a time).
func (a *Arbiter) lead(i int) float64 {
	in := &a.inst[i]
	return float64(DefaultLead) + min(a.kernel(in), in.bound/4)
}

// handoffAfter is how long (ns after the last Tick) until a grant waiting
// for the recorded tail may go; +Inf if none waits.
func (a *Arbiter) handoffAfter(p *pool) float64 {
	if p.holder >= 0 || !a.tailLeft() || a.best(p) < 0 {
		return math.Inf(1)
	}
	return a.tailWait()
}

// tailWait is how long (ns after the last Tick) until a grant may go past
// the recorded tail (0 if there is none): its lead before the estimated
// end; the end of one long kernel is looked for every longTailPoll.
func (a *Arbiter) tailWait() float64 {
	if !a.tailLeft() {
		return 0
	}
	t := max(0, float64(a.tailEnd-a.last)-a.lead(a.tailFrom))
	if in := &a.inst[a.tailFrom]; 2*a.kernel(in) > in.bound {
		t = min(t, float64(longTailPoll))
	}
	return t
}
