package enforcer

import (
	"context"
	"math/bits"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/arbiter"
	"github.com/mgpu-dev/mgpu/enforcer/region"
)

// loop is the arbitration loop: every tick it reads the instances' counters,
// asks the arbiter who may submit work, and writes the grant words. While
// any instance has demand or a grant it ticks at the arbiter's next decision
// point (Arbiter.NextDecision: a slice ending, a virtual time overtaking another
// or running out, a holder that may run dry), but no sooner than
// o.activeTick after the previous tick (while the device may idle until
// then, Arbiter.Urgent: at least minUrgentTick later) and no later than
// o.maxActiveTick, so
// that what the arbiter cannot foresee (an instance starting to wait, a
// holder emptying its queue) is noticed within o.maxActiveTick. It ticks
// every o.idleTick while processes are attached but idle, and every
// o.dormantTick when no process is attached. Creating an instance or
// attaching a process wakes it at once (while active: at the next tick).
// While active, a process whose region's wake word asks for it wakes the
// loop at once, and the loop waits on the runtime's poller (waitUntil,
// wake.go).
func (e *Enforcer) loop(ctx context.Context) {
	t := time.NewTimer(0)
	defer t.Stop()
	w := e.newLoopWait()
	defer e.closeLoopWait(w)
	done := ctx.Done()
	for {
		select {
		case <-done:
			return
		case <-t.C:
		case <-e.kick:
			if !t.Stop() {
				select {
				case <-t.C:
				default:
				}
			}
		}
		e.woken = false
		last := monotonic()
		at, active := e.tick()
		// While active, wait for the next tick on the poller (waitUntil);
		// a process may wake it. Without a loopWait (the kernel refused a
		// timerfd) the loop sleeps on the runtime's timer, and no process
		// wakes it.
		for active && w != nil {
			e.woken = e.waitUntil(w, at, last)
			select {
			case <-done:
				return
			default:
			}
			select {
			case <-e.kick: // served by the tick below
			default:
			}
			last = monotonic()
			at, active = e.tick()
		}
		t.Reset(max(0, at-monotonic()))
	}
}

// minUrgentTick is the shortest interval between two ticks while the
// device may idle until the next decision (arbiter.Urgent: a hand-off
// waiting for a tail, the fill grace, a quiet holder's grace).
const minUrgentTick = 20 * time.Microsecond

// sleepUntil blocks the calling thread until CLOCK_MONOTONIC reaches at, or
// a signal arrives. It is a raw system call, which the scheduler does not
// see: the goroutine keeps its thread and its P. The active loop uses it
// only for the short rest after a process woke it (at most minWakeTick) and
// should its timerfd refuse a setting (waitUntil). A stop-the-world's
// preemption signal ends the sleep at once (nanosleep is never restarted
// after a handler), and the caller is preempted at its next call.
func sleepUntil(at time.Duration) {
	ts := unix.NsecToTimespec(int64(at))
	_, _, _ = unix.RawSyscall6(unix.SYS_CLOCK_NANOSLEEP, unix.CLOCK_MONOTONIC, unix.TIMER_ABSTIME,
		uintptr(unsafe.Pointer(&ts)), 0, 0, 0) //nolint:gosec // the system call reads the timespec; ts outlives it
}

// The loop's clock is CLOCK_MONOTONIC (the clock of heartbeat_ns and of
// sleepUntil), read through the runtime's vDSO clock, which is
// CLOCK_MONOTONIC too, from an anchor taken once: clock_gettime(2) as a
// system call cost more than the rest of a tick's reads.
var (
	monoAnchor   = time.Now()
	monoAnchorNs = clockGettime()
)

// monotonic returns CLOCK_MONOTONIC.
func monotonic() time.Duration { return monoAnchorNs + time.Since(monoAnchor) }

func clockGettime() time.Duration {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return time.Duration(ts.Nano())
}

// tick runs one arbitration step at the current time and returns when the
// next is due and whether anything is active (see loop).
func (e *Enforcer) tick() (at time.Duration, active bool) {
	return e.tickAt(monotonic())
}

// mayHaveQueued says whether in may still have work on the device at now:
// the shim submits only under the grant, so an instance that never held it,
// or whose last hold ended longer ago than its tail could take to run, has
// nothing queued whatever its slots report. What it reports is then not
// taken as work on the device: it would mark every other instance's
// batches as shared with foreign work (timed by the clean estimate) and
// hold hand-offs for a tail that does not exist.
func (e *Enforcer) mayHaveQueued(in *instance, now time.Duration) bool {
	if !in.held {
		return false
	}
	return now-in.heldAt <= tailWindow(in.heldQueued, e.settings.Period())
}

// tailWindow is how long after its last hold an instance's queued work
// (queued, reported then) may still run: four times its length (it may
// alternate with other contexts' work on a device that time-slices) plus a
// period.
func tailWindow(queued uint64, period time.Duration) time.Duration {
	return clampDuration(sat(4*min(queued, satCap/4), uint64(period))) //nolint:gosec // positive
}

// tickAt runs one arbitration step at now. It does not allocate: usage
// entries are overwritten in place (when they changed) and only slots in
// use are read.
func (e *Enforcer) tickAt(now time.Duration) (at time.Duration, active bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed || len(e.list) == 0 {
		return now + e.o.dormantTick, false
	}
	next, active := e.o.dormantTick, false
	e.guard(func() { next, active = e.tickLocked(now) })
	return now + next, active
}

func (e *Enforcer) tickLocked(now time.Duration) (time.Duration, bool) {
	if e.woken {
		e.drainWakesLocked()
	}
	active, attached := false, false
	// An instance may share the GPU with another one's work when some
	// other instance holds the grant or still has work queued (a revoked
	// holder's tail): its event timings may then include that work. onGPU
	// counts the instances with work queued, then the holder.
	onGPU := 0
	for _, in := range e.list {
		u := arbiter.Usage{}
		gpu, launches := in.reapedGPU, in.reapedLaunches
		var queued, idle uint64
		for w, word := range in.used {
			for word != 0 {
				b := bits.TrailingZeros64(word)
				word &= word - 1
				c := e.readSlot(in, w*64+b, now)
				gpu = sat(gpu, c.gpu)
				queued = sat(queued, c.queued)
				launches = sat(launches, c.launches)
				u.Waiting = u.Waiting || c.waiting
				idle = max(idle, c.idle)
			}
		}
		in.readQueued, in.readWaiting = queued, u.Waiting
		if queued > 0 && !e.mayHaveQueued(in, now) {
			queued = 0
		}
		u.GPUTime = clampDuration(gpu) // accepted ns since the instance began
		u.Queued = clampDuration(queued)
		u.Launches = launches
		if idle <= uint64(now) { //nolint:gosec // now > 0
			u.IdleSince = time.Duration(idle) //nolint:gosec // at most now
		}
		if u.Waiting || queued > 0 || gpu != in.lastGPU || launches != in.lastLaunches {
			active = true
		}
		if queued > 0 {
			onGPU++
		}
		attached = attached || in.nused > 0
		in.lastGPU, in.lastLaunches = gpu, launches
		if old, ok := e.usage[in.id]; !ok || old != u { // a lookup is cheaper than an assignment
			e.usage[in.id] = u
		}
	}
	granted := e.arb.Tick(now, e.usage)
	for _, g := range granted {
		if u, ok := e.usage[g]; ok && u.Queued == 0 {
			onGPU++
		}
	}
	missed := false
	for _, in := range e.list {
		var v uint32
		self := 0
		queued := e.usage[in.id].Queued
		if isGranted(granted, in.id) {
			v = region.GrantAll
			if e.arb.OneAtATime(in.id) {
				v = region.GrantOne
			}
			active = true
			in.held, in.heldAt, in.heldQueued = true, now, uint64(queued) //nolint:gosec // non-negative
		}
		if v != 0 || queued > 0 {
			self = 1
		}
		var c uint32
		if onGPU > self {
			c = 1
		}
		// Before the grant: a new holder's first batch must see it.
		if in.reg.L().Contended.Load() != c {
			in.reg.L().Contended.Store(c)
		}
		// Compared with the word itself, not with what was written last
		// (processes have the control file read-only; this also repairs
		// a word changed behind the enforcer's back, e.g. on the host).
		if in.reg.L().Grant.Load() != v {
			in.reg.SetGrant(v)
		}
		var wake uint32
		if busy, idle := e.arb.Wake(in.id); busy {
			wake = region.WakeBusy
		} else if idle {
			wake = region.WakeIdle
		}
		if old := in.reg.L().Wake.Load(); old != wake {
			e.setWakeLocked(in, wake)
			missed = missed || e.missedWakeLocked(in, old, wake)
		}
		in.reg.L().HeartbeatNs.Store(uint64(now)) //nolint:gosec // monotonic, positive
	}
	switch {
	case missed:
		return 0, true
	case active:
		// At the arbiter's next decision, within the bounds. A revoked
		// holder's tail reported drained clears the new holder's
		// Contended word at the next tick, not sooner: timed hand-offs
		// grant as the tail ends, and the shim charges a contended batch
		// what it measured unless another instance's work evidently ran
		// inside it (ticking again for it cost a third of the ticks of
		// 16 busy instances).
		d := e.o.maxActiveTick
		if e.arb.Contested() {
			// The holder's going quiet is not reported (arbiter.Wake):
			// looked for every tick.
			d = e.o.activeTick
		}
		if t := e.arb.NextDecision(); t-now < d { // Never-now does not overflow: now > 0
			d = t - now
		}
		if e.arb.Urgent() {
			// The device may idle until then (a hand-off's grant, the
			// end of a grace): kept to within a wake-up, not a tick.
			return max(d, minUrgentTick), true
		}
		return max(d, e.o.activeTick), true
	case attached:
		return e.o.idleTick, false
	default:
		return e.o.dormantTick, false
	}
}

// isGranted reports whether id is among the arbiter's grant holders.
func isGranted(granted []int, id int) bool {
	for _, g := range granted {
		if g == id {
			return true
		}
	}
	return false
}
