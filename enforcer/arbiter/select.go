package arbiter

import "time"

// Eligibility and selection (docs/arbiter.md §Algorithm, steps 1, 2, 4, 5).

// slice is instance in's slice of device time: how far ahead of a
// candidate it may run before the candidate takes the grant, and so about
// its shortest hold: the quantum, and at least two of its kernels and two
// of its queues, so that a hold is never shorter than the tail it leaves
// behind.
func (a *Arbiter) slice(in *instance) float64 {
	return max(a.quantum, 2*a.kernel(in), 2*in.bound)
}

// depth is a fixed-share instance's bucket depth: c/100 · Period, and at
// least one slice.
func (a *Arbiter) depth(in *instance) float64 {
	return max(in.w*a.period, a.slice(in))
}

// entry is the bucket a fixed-share non-holder needs to take the grant.
func (a *Arbiter) entry(in *instance) float64 { return a.slice(in) / 2 }

// eligible reports whether instance i may hold the grant (a holder) or take
// it (anyone else): only a fixed-share online instance's bucket limits it.
func (a *Arbiter) eligible(i int, holder bool) bool {
	in := &a.inst[i]
	if !a.fixed || in.off {
		return true
	}
	if holder {
		return in.tokens > 0
	}
	return in.tokens >= a.entry(in)
}

// candidate reports whether instance i, not pool p's holder, could be
// granted now: it has demand and is eligible.
func (a *Arbiter) candidate(p *pool, i int) bool {
	in := &a.inst[i]
	return i != p.holder && in.off == p.off && in.demand && a.eligible(i, false)
}

// best is pool p's candidate with the lowest virtual time (ties: the
// earliest registered), -1 if none.
func (a *Arbiter) best(p *pool) int {
	b := -1
	for i := range a.inst {
		if a.candidate(p, i) && (b < 0 || a.inst[i].v < a.inst[b].v) {
			b = i
		}
	}
	return b
}

// join places the instances of pool p that gained demand at this tick
// after more than a slice without it: such an instance keeps at most one
// slice of lag (device time) behind the lowest virtual time of the others
// with demand (or the pool's last known lowest), so it does not bank the
// time it left unused. One back sooner (its tail drained between two
// holds, a step synchronised) keeps its place: its lag is the turn it is
// owed. It then records the pool's lowest.
func (a *Arbiter) join(p *pool) {
	ref, any := 0.0, false
	for i := range a.inst {
		if in := &a.inst[i]; in.off == p.off && in.demand && !in.joined && (!any || in.v < ref) {
			ref, any = in.v, true
		}
	}
	if !any {
		ref = p.vmin
	}
	low, seen := 0.0, false
	for i := range a.inst {
		in := &a.inst[i]
		if in.off != p.off || !in.demand {
			continue
		}
		if in.joined && float64(a.last-in.idleFrom) > a.slice(in) {
			in.v = max(in.v, ref-a.slice(in)/in.w)
		}
		if !seen || in.v < low {
			low, seen = in.v, true
		}
	}
	if seen {
		p.vmin = low
	}
}

// keeps reports whether pool p's holder keeps the grant, b being the best
// candidate: it must stay eligible; against a candidate it also needs
// demand and to be less than one of its slices ahead of it in virtual time
// (its slice of device time, S/w).
func (a *Arbiter) keeps(p *pool, b int) bool {
	h := p.holder
	if h < 0 || !a.eligible(h, true) {
		return false
	}
	if b < 0 {
		return true
	}
	hi := &a.inst[h]
	return hi.demand && hi.v-a.inst[b].v <= a.slice(hi)/hi.w
}

// choose is who should hold pool p after this tick (-1: nobody).
func (a *Arbiter) choose(p *pool) int {
	b := a.best(p)
	if a.keeps(p, b) {
		return p.holder
	}
	return b
}

// decide moves the grants at now: the online pool first, then the offline
// fill while the online pool is quiet.
func (a *Arbiter) decide(now time.Duration) {
	next := a.choose(&a.on)
	if next >= 0 && next != a.on.holder && a.off.holder >= 0 {
		// An online instance enters: the fill gives way, and the grant
		// waits for the offline tail as for a revoked holder's.
		a.revoke(&a.off, now)
	}
	a.move(&a.on, next, now)
	a.contested = a.best(&a.on) >= 0
	f := -1
	if at := a.fillAt(); at != Never && at <= now {
		f = a.choose(&a.off)
	}
	a.move(&a.off, f, now)
	a.offWaits = false
	for i := range a.inst {
		a.offWaits = a.offWaits || a.inst[i].off && a.inst[i].demand
	}
}

// move gives pool p's grant to next at now, by the hand-off (handoff.go).
func (a *Arbiter) move(p *pool, next int, now time.Duration) {
	if next == p.holder {
		return
	}
	if p.holder >= 0 {
		a.revoke(p, now)
	}
	if next >= 0 && a.tailWaits(next, now) {
		next = -1
	}
	if next >= 0 {
		a.grant(p, next, now)
	}
}
