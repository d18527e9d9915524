package arbiter

import (
	"math/rand/v2"
	"slices"
	"time"

	"github.com/mgpu-dev/mgpu/internal/policy"
)

// This file is a discrete-event model of one time-sliced device, its shim
// and the enforcer's tick loop, on a virtual clock:
//
//   - the device runs one kernel at a time, in submission order across all
//     instances (a kernel submitted behind another instance's work waits);
//   - each instance is one process whose shim launches kernels of a fixed
//     length while it holds the grant and its queued work is below the queue
//     bound (one kernel is always allowed when nothing is queued, so a kernel
//     longer than the bound runs alone);
//   - the shim times each kernel with events: measured = end -
//     max(submit, previous end on its stream), which includes time spent
//     waiting behind another instance's tail (with sim.contended: a kernel
//     submitted behind another instance's work is charged at most its
//     length, as today's shim charges a batch that ran while the region's
//     contended word was set by its clean estimate);
//   - the shim publishes measured time lazily: a completion becomes visible
//     in the region at the process's next flush (every simFlush, with a
//     per-instance phase), so GPUTime lags by up to simFlush and Queued
//     (submitted minus reported) over-estimates;
//   - a process without the grant waits for it (Usage.Waiting) once its
//     queue has drained: until then its thread waits for room in its own
//     queue, as the shim's does;
//   - a process whose work runs out synchronises once its queue drains: it
//     then reports everything at once, and the time its queue emptied
//     (Usage.IdleSince);
//   - the enforcer ticks as its loop does (enforcer/loop.go): at
//     NextDecision, no sooner than DefaultTick after the previous tick
//     (simUrgentTick while Arbiter.Urgent) and no later than simMaxTick
//     (DefaultTick while Arbiter.Contested),
//     and when a process the arbiter asks to wake it (Arbiter.Wake)
//     starts submitting or goes idle, no sooner than simWakeTick after the
//     previous tick; with sim.jitter (a loaded host) each tick is late by
//     up to 2 ms more.

const (
	simFlush      = time.Millisecond
	simBin        = time.Millisecond
	simUrgentTick = 20 * time.Microsecond // enforcer minUrgentTick
	simMaxTick    = 20 * time.Millisecond // enforcer maxActiveTick
	simWakeTick   = 50 * time.Microsecond // enforcer minWakeTick
)

// workload says when an instance has GPU work to submit.
type workload interface {
	has(now time.Duration) bool
	consume(k time.Duration)
	// next returns the next time after now at which has may turn true
	// by itself (a block of work arriving), or -1.
	next(now time.Duration) time.Duration
}

// saturating has work inside [on, off) (off 0: forever).
type saturating struct{ on, off time.Duration }

func (w saturating) has(now time.Duration) bool {
	return now >= w.on && (w.off == 0 || now < w.off)
}
func (w saturating) consume(time.Duration) {}
func (w saturating) next(now time.Duration) time.Duration {
	if now < w.on {
		return w.on
	}
	return -1
}

// arrivals gets a block of job GPU time every every (open loop): it uses
// job/every of the device when it is served.
type arrivals struct {
	job, every time.Duration
	backlog    time.Duration
	arrived    time.Duration // time of the last arrival
	started    bool
}

func (w *arrivals) catchUp(now time.Duration) {
	if !w.started {
		w.started = true
		w.backlog = w.job
		w.arrived = 0
	}
	for w.arrived+w.every <= now {
		w.arrived += w.every
		w.backlog += w.job
	}
}
func (w *arrivals) has(now time.Duration) bool { w.catchUp(now); return w.backlog > 0 }
func (w *arrivals) consume(k time.Duration)    { w.backlog -= k }
func (w *arrivals) next(now time.Duration) time.Duration {
	w.catchUp(now)
	return w.arrived + w.every
}

// steps is a training loop: a step of n kernels, then it synchronises (waits
// for its queue to drain) and spends gap on the host before the next step.
type steps struct {
	n, left   int
	gap       time.Duration
	blocked   bool
	resumeAt  time.Duration
	init      bool
	stepsDone int
}

func (w *steps) has(now time.Duration) bool {
	if !w.init {
		w.init, w.left = true, w.n
	}
	if w.blocked && w.resumeAt >= 0 && now >= w.resumeAt {
		w.blocked, w.left = false, w.n
	}
	return !w.blocked
}
func (w *steps) consume(time.Duration) {
	if w.left--; w.left <= 0 {
		w.blocked, w.resumeAt = true, -1 // until the queue drains
	}
}
func (w *steps) next(now time.Duration) time.Duration {
	if w.blocked && w.resumeAt > now {
		return w.resumeAt
	}
	return -1
}

// drained is called when the instance's queue drains: a blocked step
// resumes gap later.
func (w *steps) drained(now time.Duration) {
	if w.blocked && w.resumeAt < 0 {
		w.resumeAt = now + w.gap
		w.stepsDone++
	}
}

// drainer is a workload that waits for its queue to drain.
type drainer interface{ drained(now time.Duration) }

type simKernel struct {
	inst          int
	length        time.Duration
	submit, start time.Duration
	behind        bool // submitted behind another instance's work
}

type simInst struct {
	id    int
	core  int
	klen  time.Duration
	work  workload
	bound time.Duration // the shim's queue bound
	off   bool          // offline class

	granted    bool
	waits      bool          // a thread waits for the grant (it has work, none in flight)
	fresh      bool          // granted at the last tick, nothing submitted since
	inflightNs time.Duration // real, known to the shim
	submitted  time.Duration // sum of kernel lengths submitted (the shim's estimate)
	launches   uint64
	lastEnd    time.Duration
	phase      time.Duration
	idleSince  time.Duration   // when its queue last drained with no work left (0: never)
	latencies  []time.Duration // arrivals: from the last arrival to the drain that served it

	stallUntil time.Duration

	pending  []simReport
	repGPU   time.Duration
	repDone  time.Duration
	busy     []float64 // ns executed per simBin
	executed time.Duration
	measured time.Duration
}

type simReport struct {
	at, measured, length time.Duration
}

type simSpec struct {
	core int
	klen time.Duration
	work workload
}

type sim struct {
	arb    *Arbiter
	insts  []*simInst
	bound  time.Duration
	end    time.Duration
	jitter bool // each tick up to 2 ms late (a loaded host)
	// stalls: a process is descheduled after one kernel completion in
	// stalls (0: never) for up to 3 ms (a loaded host): it refills its
	// queue late, and may be called dry
	stalls   int
	rng      *rand.Rand
	fifo     []simKernel
	running  bool
	cur      simKernel
	devEnd   time.Duration
	nextTick time.Duration
	lastTick time.Duration
	wakes    int // ticks a process woke the enforcer for
	usage    map[int]Usage
	ticks    int
	multi    int // ticks that returned more than one id
	// hand-offs: the other instances' work still to run on the device
	// when a new holder submitted its first kernel (its summed wait)
	handoffs int
	ahead    time.Duration
	// revokes: ticks that took the online grant from a holder with work
	// still on the device, and that work summed
	revokes     int
	revokedTail time.Duration
	// the most offline work an online kernel was submitted behind
	offAhead time.Duration
	onTick   func(now time.Duration, granted []int)
	now      time.Duration
}

func newSim(cfg Config, end time.Duration, specs ...simSpec) *sim {
	s := &sim{
		arb:   New(cfg),
		bound: DefaultMaxQueued,
		end:   end,
		rng:   rand.New(rand.NewPCG(1, 2)),
		usage: make(map[int]Usage),
	}
	bins := int(end/simBin) + 1
	for i, sp := range specs {
		in := &simInst{
			id:    100 + i,
			core:  sp.core,
			klen:  sp.klen,
			work:  sp.work,
			phase: time.Duration(i*397) * time.Microsecond % simFlush,
			busy:  make([]float64, bins),
			bound: s.bound,
		}
		s.insts = append(s.insts, in)
		s.arb.Add(in.id, in.core)
	}
	return s
}

// setOffline makes instance i offline, with the offline queue bound.
func (s *sim) setOffline(i int) {
	in := s.insts[i]
	in.bound = DefaultOfflineMaxQueued
	in.off = true
	s.arb.AddClass(in.id, in.core, policy.Offline)
}

func (s *sim) run() {
	for {
		t := s.nextTick
		if s.running && s.devEnd <= t {
			t = s.devEnd
		}
		for _, in := range s.insts {
			if n := in.work.next(s.now); n >= 0 && n < t {
				t = n
			}
			if in.stallUntil > s.now && in.stallUntil < t {
				t = in.stallUntil
			}
		}
		if t >= s.end {
			return
		}
		s.now = t
		switch {
		case s.running && s.devEnd == t:
			s.complete(t)
		case t == s.nextTick:
			s.tick(t)
		default:
			for i := range s.insts {
				s.submit(i, t)
			}
		}
	}
}

func (s *sim) submit(i int, now time.Duration) {
	in := s.insts[i]
	if now < in.stallUntil {
		return
	}
	if in.inflightNs == 0 && in.work.has(now) {
		// The shim's busy wake: its queue rises from 0 (granted), or a
		// thread starts waiting for the grant (once per wait).
		start := in.granted || !in.waits
		in.waits = !in.granted
		if busy, _ := s.arb.Wake(in.id); busy && start {
			s.wakeUp(now)
		}
	}
	bound := in.bound
	if s.arb.OneAtATime(in.id) {
		bound = 0 // one kernel at a time (MGPU_GRANT_ONE)
	}
	for in.granted && in.work.has(now) && (in.inflightNs == 0 || in.inflightNs+in.klen <= bound) {
		k := simKernel{inst: i, length: in.klen, submit: now, behind: s.workAhead(i, now) > 0}
		if !in.off {
			s.offAhead = max(s.offAhead, s.offlineAhead(now))
		}
		if in.fresh {
			in.fresh = false
			s.handoffs++
			s.ahead += s.workAhead(i, now)
		}
		in.inflightNs += in.klen
		in.submitted += in.klen
		in.launches++
		in.work.consume(in.klen)
		if !s.running {
			s.startKernel(k, now)
		} else {
			s.fifo = append(s.fifo, k)
		}
	}
}

// workAhead is the other instances' work the device has still to run at
// now: what a kernel instance i submits now waits behind.
func (s *sim) workAhead(i int, now time.Duration) time.Duration {
	var w time.Duration
	if s.running && s.cur.inst != i {
		w += s.devEnd - now
	}
	for _, k := range s.fifo {
		if k.inst != i {
			w += k.length
		}
	}
	return w
}

// workOf is instance i's work the device has still to run at now.
func (s *sim) workOf(i int, now time.Duration) time.Duration {
	var w time.Duration
	if s.running && s.cur.inst == i {
		w += s.devEnd - now
	}
	for _, k := range s.fifo {
		if k.inst == i {
			w += k.length
		}
	}
	return w
}

// offlineAhead is the offline instances' work the device has still to run
// at now.
func (s *sim) offlineAhead(now time.Duration) time.Duration {
	var w time.Duration
	if s.running && s.insts[s.cur.inst].off {
		w += s.devEnd - now
	}
	for _, k := range s.fifo {
		if s.insts[k.inst].off {
			w += k.length
		}
	}
	return w
}

func (s *sim) startKernel(k simKernel, now time.Duration) {
	k.start = now
	s.cur = k
	s.running = true
	s.devEnd = now + k.length
}

func (s *sim) complete(now time.Duration) {
	k := s.cur
	in := s.insts[k.inst]
	s.addBusy(in, k.start, now)
	in.executed += k.length
	m := now - max(k.submit, in.lastEnd)
	if k.behind { // the shim's contended charging
		m = min(m, k.length)
	}
	in.measured += m
	in.lastEnd = now
	in.inflightNs -= k.length
	if d, ok := in.work.(drainer); ok && in.inflightNs == 0 {
		d.drained(now)
	}
	at := in.phase + ((now-in.phase+simFlush-1)/simFlush)*simFlush
	if in.inflightNs == 0 && !in.work.has(now) {
		if w, ok := in.work.(*arrivals); ok {
			in.latencies = append(in.latencies, now-w.arrived)
		}
		at = now // it synchronises: everything is reported
		for j := range in.pending {
			in.pending[j].at = now
		}
		in.idleSince = now
		if _, idle := s.arb.Wake(in.id); idle {
			s.wakeUp(now)
		}
	}
	in.pending = append(in.pending, simReport{at: at, measured: m, length: k.length})
	if s.stalls > 0 && s.rng.IntN(s.stalls) == 0 {
		in.stallUntil = now + time.Duration(s.rng.Int64N(int64(3*time.Millisecond)))
	}
	s.running = false
	if len(s.fifo) > 0 {
		n := s.fifo[0]
		copy(s.fifo, s.fifo[1:])
		s.fifo = s.fifo[:len(s.fifo)-1]
		s.startKernel(n, now)
	}
	s.submit(k.inst, now)
}

func (s *sim) addBusy(in *simInst, from, to time.Duration) {
	for from < to {
		b := from / simBin
		e := min(to, (b+1)*simBin)
		in.busy[b] += float64(e - from)
		from = e
	}
}

func (s *sim) tick(now time.Duration) {
	for _, in := range s.insts {
		n := 0
		for _, r := range in.pending {
			if r.at > now {
				break
			}
			in.repGPU += r.measured
			in.repDone += r.length
			n++
		}
		in.pending = in.pending[:copy(in.pending, in.pending[n:])]
		s.usage[in.id] = Usage{
			GPUTime:   in.repGPU,
			Queued:    in.submitted - in.repDone,
			Waiting:   in.work.has(now) && !in.granted && in.inflightNs == 0,
			Launches:  in.launches,
			IdleSince: in.idleSince,
		}
	}
	g := s.arb.Tick(now, s.usage)
	s.lastTick = now
	s.ticks++
	if len(g) > 1 {
		s.multi++
	}
	if s.onTick != nil {
		s.onTick(now, g)
	}
	for i, in := range s.insts {
		was := in.granted
		if was && !in.off && !slices.Contains(g, in.id) {
			if w := s.workOf(i, now); w > 0 {
				s.revokes++
				s.revokedTail += w
			}
		}
		in.granted = false
		for _, id := range g {
			if id == in.id {
				in.granted = true
			}
		}
		in.fresh = in.fresh && in.granted || in.granted && !was
	}
	for i := range s.insts {
		s.submit(i, now)
	}
	lo := DefaultTick
	if s.arb.Urgent() {
		lo = simUrgentTick
	}
	hi := simMaxTick
	if s.arb.Contested() {
		hi = DefaultTick
	}
	s.nextTick = min(max(s.arb.NextDecision(), now+lo), now+hi)
	if s.jitter {
		s.nextTick += time.Duration(s.rng.Int64N(int64(2 * time.Millisecond)))
	}
}

// wakeUp is a process waking the enforcer's loop at now: it ticks at once,
// or simWakeTick after its previous tick.
func (s *sim) wakeUp(now time.Duration) {
	if t := max(now, s.lastTick+simWakeTick); t < s.nextTick {
		s.nextTick = t
		s.wakes++
	}
}

// share returns instance i's percentage of device time in [from, to)
// (bin-aligned).
func (s *sim) share(i int, from, to time.Duration) float64 {
	var sum float64
	for b := from / simBin; b < to/simBin; b++ {
		sum += s.insts[i].busy[b]
	}
	return 100 * sum / float64(to-from)
}

// firstRun returns how long after from instance i first ran (bin-aligned).
func (s *sim) firstRun(i int, from time.Duration) time.Duration {
	for b := from / simBin; int(b) < len(s.insts[i].busy); b++ {
		if s.insts[i].busy[b] > 0 {
			return b*simBin - from
		}
	}
	return s.end - from
}

// busy returns the device's busy percentage in [from, to).
func (s *sim) busy(from, to time.Duration) float64 {
	var sum float64
	for i := range s.insts {
		sum += s.share(i, from, to)
	}
	return sum
}

// minSliding returns the lowest share of instance i over any window of
// length w that starts in [from, to-w] (bin steps).
func (s *sim) minSliding(i int, from, to, w time.Duration) float64 {
	m := 1e9
	for a := from; a+w <= to; a += simBin {
		m = min(m, s.share(i, a, a+w))
	}
	return m
}

// maxSliding is minSliding's upper counterpart.
func (s *sim) maxSliding(i int, from, to, w time.Duration) float64 {
	m := -1e9
	for a := from; a+w <= to; a += simBin {
		m = max(m, s.share(i, a, a+w))
	}
	return m
}
