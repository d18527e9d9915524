package enforcer

import (
	"math"
	"strings"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/region"
)

// What a process writes into its proc file is input, not truth: it may
// write anything at any moment. The enforcer accepts a slot's cumulative
// counters only as totals of its own that never go backwards and never
// grow faster than the bounds below, and clamps the instantaneous ones, so
// that no value a tenant writes can overflow the sums, move the arbiter's
// accounting backwards (credit it did not earn) or stall a hand-off.
// Overstating GPU time only charges the tenant itself; understating it is
// what the driver backstop catches.
const (
	// A process's streams are timed separately and may overlap, so its
	// GPU time may grow faster than wall time, but not this much faster.
	gpuRate  = 8
	gpuSlack = uint64(time.Second)
	// One launch per 10 ns is beyond any real launch rate.
	launchPerNs = 10
	launchSlack = 1 << 20
	// The shim takes back the count of a launch that found the grant
	// revoked while it waited for queue room (one per waiting thread):
	// launches may fall by this much between two reads.
	launchTakeBack = 1024
	// Threads waiting at once, each accruing throttled time.
	throttleRate = 4096
	maxWaiting   = 1 << 20
	// satCap keeps every sum far from overflowing int64 nanoseconds.
	satCap = uint64(1) << 60
)

// sane is what the enforcer accepted from one slot's counters.
type sane struct {
	rawGPU, rawLaunches, rawThrottled uint64 // the values read last
	gpu, launches, throttled          uint64 // accepted growth since the first read
	gpu0, launches0, throttled0       uint64 // taken at the first read of a trusted slot
	since, last                       time.Duration
	started                           bool // since is set
	trusted                           bool // the first read is taken as it is (a slot restored after a restart)
	bad                               bool // reported once
}

// total is the GPU time accepted of the slot so far.
func (s *sane) total() uint64 { return s.gpu0 + s.gpu }

// counts are one sanitized reading of a slot.
type counts struct {
	gpu, launches, throttled, queued, mem uint64
	idle                                  uint64 // when its queue last emptied, while it is empty (0: unknown)
	waiting                               bool
}

// read takes a slot's counters at now (the tick's clock), bounded by
// maxQueued (the most GPU time one process may report queued). It returns
// the accepted values and what was out of range (nothing is built on
// this path: a slot that lies at every tick must not make ticks allocate).
func (s *sane) read(p region.Proc, now time.Duration, maxQueued uint64) (counts, oddity) {
	var why oddity
	if !s.started {
		s.started, s.since = true, now
		if s.trusted {
			s.rawGPU, s.rawLaunches, s.rawThrottled = p.GPUNs.Load(), p.Launches.Load(), p.ThrottledNs.Load()
			s.gpu0, s.launches0, s.throttled0 = min(s.rawGPU, satCap), min(s.rawLaunches, satCap), min(s.rawThrottled, satCap)
		}
	}
	if now > s.last {
		s.last = now
	}
	life := uint64(max(s.last-s.since, 0)) //nolint:gosec // non-negative
	s.gpu, s.rawGPU = accept(s.gpu, s.rawGPU, p.GPUNs.Load(), sat(gpuRate*life, gpuSlack), gpuBack, &why)
	rawL := p.Launches.Load()
	if rawL < s.rawLaunches && s.rawLaunches-rawL <= launchTakeBack {
		s.launches -= min(s.launches, s.rawLaunches-rawL) // launches taken back
		s.rawLaunches = rawL
	}
	s.launches, s.rawLaunches = accept(s.launches, s.rawLaunches, rawL, sat(life/launchPerNs, launchSlack), launchesBack, &why)
	s.throttled, s.rawThrottled = accept(s.throttled, s.rawThrottled, p.ThrottledNs.Load(), sat(throttleRate*min(life, satCap/throttleRate), gpuSlack), throttledBack, &why)
	c := counts{gpu: s.total(), launches: s.launches0 + s.launches, throttled: s.throttled0 + s.throttled}
	c.queued = p.QueuedNs.Load()
	if c.queued > maxQueued {
		c.queued, why = maxQueued, why|queuedRange
	}
	// What the process's allocations hold: what it reserved, less what
	// it reserved ahead of them.
	c.mem = p.MemReserved.Load()
	c.mem -= min(c.mem, p.MemAhead.Load())
	if c.mem > satCap {
		c.mem, why = satCap, why|memRange
	}
	if c.queued == 0 {
		c.idle = p.IdleNs.Load() // only ever compared with the tick's clock
	}
	w := p.Waiting.Load()
	if w > maxWaiting {
		why |= waitingRange
	}
	c.waiting = w > 0
	return c, why
}

// oddity says what a reading found out of range.
type oddity uint16

// Oddities; a cumulative counter's "went backwards" bit, shifted left once,
// is its "grew too fast" bit.
const (
	gpuBack oddity = 1 << iota
	gpuFast
	launchesBack
	launchesFast
	throttledBack
	throttledFast
	queuedRange
	memRange
	waitingRange
)

var oddityText = [...]string{
	"gpu_ns went backwards", "gpu_ns grew faster than wall time allows",
	"launches went backwards", "launches grew faster than wall time allows",
	"throttled_ns went backwards", "throttled_ns grew faster than wall time allows",
	"queued_ns out of range", "mem_reserved out of range", "waiting out of range",
}

func (o oddity) String() string {
	var b strings.Builder
	for i, t := range oddityText {
		if o&(1<<i) != 0 {
			if b.Len() > 0 {
				b.WriteString("; ")
			}
			b.WriteString(t)
		}
	}
	return b.String()
}

// accept adds the growth of a cumulative counter from prev to raw to total,
// up to limit for the total; a counter that went backwards is re-baselined
// (nothing added). back is the counter's "went backwards" oddity. It
// returns the new total and the new baseline.
func accept(total, prev, raw, limit uint64, back oddity, why *oddity) (uint64, uint64) {
	if raw < prev {
		*why |= back
		return total, raw
	}
	d := raw - prev
	if room := limit - min(total, limit); d > room {
		*why |= back << 1
		d = room
	}
	return total + d, raw
}

// sat is a + b, saturating at satCap.
func sat(a, b uint64) uint64 {
	if a > satCap || b > satCap || a+b > satCap {
		return satCap
	}
	return a + b
}

// queueCap is the most GPU time one process may report queued: its queue
// bound several times over, or a period (one honest kernel may be longer
// than the bound), whichever is larger.
func queueCap(maxQueuedNs, periodNs uint64) uint64 {
	return max(8*maxQueuedNs, 2*periodNs)
}

// clampDuration converts a sum of accepted nanoseconds for the arbiter.
func clampDuration(ns uint64) time.Duration {
	if ns > math.MaxInt64/2 {
		return math.MaxInt64 / 2
	}
	return time.Duration(ns) //nolint:gosec // bounded above
}
