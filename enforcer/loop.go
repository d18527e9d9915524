package enforcer

import (
	"context"
	"math/bits"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/arbiter"
)

// loop is the arbitration loop: every tick it reads the instances' counters,
// asks the arbiter who may submit work, and writes the grant words. It ticks
// every o.activeTick while any instance has demand or a grant, every
// o.idleTick while processes are attached but idle, and every o.dormantTick
// when no process is attached. Creating an instance or attaching a process
// wakes it at once.
func (e *Enforcer) loop(ctx context.Context) {
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
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
		t.Reset(e.tick())
	}
}

// monotonic returns CLOCK_MONOTONIC (the clock of heartbeat_ns).
func monotonic() time.Duration {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return time.Duration(ts.Nano())
}

// tick runs one arbitration step and returns the delay until the next. It
// does not allocate: usage entries are overwritten in place and only slots
// in use are read.
func (e *Enforcer) tick() time.Duration {
	now := monotonic()
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed || len(e.list) == 0 {
		return e.o.dormantTick
	}
	next := e.o.dormantTick
	e.guard(func() { next = e.tickLocked(now) })
	return next
}

func (e *Enforcer) tickLocked(now time.Duration) time.Duration {
	active, attached := false, false
	for _, in := range e.list {
		u := arbiter.Usage{}
		gpu, launches := in.reapedGPU, in.reapedLaunches
		var queued uint64
		for w, word := range in.used {
			for word != 0 {
				b := bits.TrailingZeros64(word)
				word &= word - 1
				p := &in.reg.L().Procs[w*64+b]
				gpu += p.GPUNs.Load()
				queued += p.QueuedNs.Load()
				launches += p.Launches.Load()
				if p.Waiting.Load() > 0 {
					u.Waiting = true
				}
			}
		}
		u.GPUTime = time.Duration(gpu)   //nolint:gosec // ns since the instance began
		u.Queued = time.Duration(queued) //nolint:gosec // bounded by max_queued_ns per process
		u.Launches = launches
		if u.Waiting || queued > 0 || gpu != in.lastGPU || launches != in.lastLaunches {
			active = true
		}
		attached = attached || in.nused > 0
		in.lastGPU, in.lastLaunches = gpu, launches
		e.usage[in.id] = u
	}
	granted := e.arb.Tick(now, e.usage)
	// An instance may share the GPU with another one's work when some
	// other instance holds the grant or still has work queued (a revoked
	// holder's tail): its event timings may then include that work.
	onGPU := 0
	for _, in := range e.list {
		if e.usage[in.id].Queued > 0 || isGranted(granted, in.id) {
			onGPU++
		}
	}
	for _, in := range e.list {
		var v uint32
		self := 0
		if isGranted(granted, in.id) {
			v = 1
			active = true
		}
		if v == 1 || e.usage[in.id].Queued > 0 {
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
		// Compared with the word itself, not with what was written last:
		// a process that sets its own grant is overruled at the next tick.
		if in.reg.L().Grant.Load() != v {
			in.reg.SetGrant(v)
		}
		in.reg.L().HeartbeatNs.Store(uint64(now)) //nolint:gosec // monotonic, positive
	}
	switch {
	case active:
		return e.o.activeTick
	case attached:
		return e.o.idleTick
	default:
		return e.o.dormantTick
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
