package arbiter

import "time"

// The offline pool (docs/arbiter.md §Algorithm, steps 7, 9): it fills only while the online pool is quiet.

const sparseSpells = 2 // long quiet spells in a row that make a holder sparse (step 7)

// fillAt is when the offline pool may hold: G after the online holder went
// quiet unless it is sparse (and not fillOne), else the last Tick's time;
// Never while it is busy or an online candidate waits (not one its bucket holds back).
func (a *Arbiter) fillAt() time.Duration {
	h := a.on.holder
	switch {
	case a.contested || h >= 0 && a.inst[h].quietFrom == Never:
		return Never
	case h >= 0 && (a.fillOne || a.inst[h].longSpells < sparseSpells):
		return max(a.last, a.inst[h].quietFrom+DefaultFillGrace)
	}
	return a.last
}

// Wake says when the enforcer wants to hear from instance id's processes
// at once (mgpu_region.h, docs/arbiter.md step 9): busy, when one queues
// work or starts waiting, while an offline instance fills (online id must
// stop it) or id neither holds nor was seen waiting (new demand; offline,
// only while a fill may start); idle (online), when its queue empties while
// offline work waits, or holding contested until a quiet spell ends in a launch.
func (a *Arbiter) Wake(id int) (busy, idle bool) {
	i, ok := a.index[id]
	if !ok {
		return false, false
	}
	in := &a.inst[i]
	if in.off {
		return a.off.holder < 0 && !in.demand && a.fillAt() != Never, false
	}
	if a.off.holder >= 0 || a.on.holder != i && !in.demand {
		return true, false
	}
	return false, in.quietFrom == Never && (a.offWaits || a.on.holder == i && a.contested && !in.refilled)
}

// OneAtATime reports whether instance id holds its grant only to keep one
// kernel in flight (Config.FillOneAtATime, MGPU_GRANT_ONE): it fills
// beside an online holder, which may get work at any moment.
func (a *Arbiter) OneAtATime(id int) bool {
	i, ok := a.index[id]
	return ok && a.fillOne && i == a.off.holder && a.on.holder >= 0
}
