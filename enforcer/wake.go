package enforcer

import (
	"errors"
	mathbits "math/bits"
	"os"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/region"
)

// The wake path (mgpu_region.h, MGPU_ATTACH_FLAG_WAKE): what the arbiter
// cannot foresee and must not learn of up to maxActiveTick late — new
// demand from an instance that neither holds the grant nor was seen
// waiting, a contested holder going quiet, an online instance beside an
// offline one getting work or going quiet (docs/arbiter.md step 9) — its
// processes report by waking the loop, when the region's wake word asks
// them to: each instance has a SOCK_DGRAM socket pair, whose receiving end
// only the enforcer holds (in an epoll set the active loop waits on) and
// whose sending end the instance's processes get on request. A tenant can
// do nothing with its end but send (it may shut it down or fill it: that
// only keeps its own wake-ups from arriving), and what it sends is never
// read as data: a wake-up makes the loop tick at once, but no sooner than
// minWakeTick after the previous tick, and the datagrams are discarded at
// that tick. The loop polls the set only while it is active (an instance
// has demand or holds the grant), and listens to an instance's
// socket only while its wake word is set: a tenant that was not asked
// cannot wake it at all, one that was and sends without pause makes it
// tick every minWakeTick at most.

// errNoWake: the loop has no epoll set, so it cannot be woken.
var errNoWake = errors.New("the enforcer has no epoll set (epoll_create1 failed); it is not woken by processes")

// minWakeTick is the shortest interval between a tick and one a process
// woke the loop for: a tenant that sends without pause makes the loop tick
// at most this often.
const minWakeTick = 50 * time.Microsecond

// wakeDrainMax bounds the datagrams discarded from one instance's socket at
// one tick (it holds a few hundred at most; the rest wait for the next).
const wakeDrainMax = 256

// newEpoll returns the loop's epoll set, or -1 if the kernel refuses one:
// the loop then sleeps without it and processes' wake-ups are not heard
// (they change nothing else).
func newEpoll() int {
	fd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return -1
	}
	return fd
}

// wakeFDLocked returns a duplicate of instance in's sending end (the caller
// closes it), making the pair on first use.
func (e *Enforcer) wakeFDLocked(in *instance) (int, error) {
	if e.epfd < 0 {
		return -1, errNoWake
	}
	if in.wakeSend < 0 {
		p, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return -1, err
		}
		ev := unix.EpollEvent{Events: wakeEvents(in.reg.L().Wake.Load()), Fd: int32(p[0])} //nolint:gosec // fds fit in int32
		if err := unix.EpollCtl(e.epfd, unix.EPOLL_CTL_ADD, p[0], &ev); err != nil {
			_ = unix.Close(p[0])
			_ = unix.Close(p[1])
			return -1, err
		}
		// The tenants' end only sends: a tenant cannot read what the
		// others send, there being nobody else on it but the enforcer.
		_ = unix.Shutdown(p[1], unix.SHUT_RD)
		in.wakeRecv, in.wakeSend = p[0], p[1]
	}
	return unix.FcntlInt(uintptr(in.wakeSend), unix.F_DUPFD_CLOEXEC, 0) //nolint:gosec // a valid fd
}

// wakeEvents is what the loop listens for on an instance's socket: nothing
// while its wake word is 0, so that a tenant nobody asked cannot wake it.
func wakeEvents(word uint32) uint32 {
	if word == 0 {
		return 0
	}
	return unix.EPOLLIN
}

// setWakeLocked writes instance in's wake word and listens to its socket
// accordingly.
func (e *Enforcer) setWakeLocked(in *instance, word uint32) {
	old := in.reg.L().Wake.Swap(word)
	if in.wakeRecv >= 0 && (old == 0) != (word == 0) {
		ev := unix.EpollEvent{Events: wakeEvents(word), Fd: int32(in.wakeRecv)} //nolint:gosec // fds fit in int32

		// Raw (pollNow): epoll_ctl does not block.
		_, _, _ = unix.RawSyscall6(unix.SYS_EPOLL_CTL, uintptr(e.epfd), unix.EPOLL_CTL_MOD, uintptr(in.wakeRecv), uintptr(unsafe.Pointer(&ev)), 0, 0) //nolint:gosec // the system call reads ev
	}
}

// missedWakeLocked reports whether instance in, whose wake word this tick
// changed from old to word, already did what the word asks to hear of:
// got work (region.WakeBusy: something queued where the tick read
// nothing, or a thread waits where none did) or went quiet
// (region.WakeIdle: nothing queued nor waiting where the tick read work)
// since its slots were read at the start of the tick (readQueued,
// readWaiting). Its processes read the word after they store queued_ns or
// waiting, and the word is written before this reads them (all
// sequentially consistent), so a change is either sent on the socket or
// seen here; the loop then ticks again at once instead of at its next
// decision, up to maxActiveTick later. What the tick read (a revoked
// holder's tail, a quiet holder) is already known: no tick again for it.
func (e *Enforcer) missedWakeLocked(in *instance, old, word uint32) bool {
	busy := word&region.WakeBusy != 0 && old&region.WakeBusy == 0
	idle := word&region.WakeIdle != 0 && old&region.WakeIdle == 0
	if !busy && !idle {
		return false
	}
	queued, waiting := false, false
	for w, bits := range in.used {
		for bits != 0 {
			b := mathbits.TrailingZeros64(bits)
			bits &= bits - 1
			p := in.reg.Proc(w*64 + b)
			queued = queued || p.QueuedNs.Load() > 0
			waiting = waiting || p.Waiting.Load() > 0
		}
	}
	if busy {
		return queued && in.readQueued == 0 || waiting && !in.readWaiting
	}
	return !queued && !waiting && (in.readQueued > 0 || in.readWaiting)
}

// closeWakeLocked closes instance in's pair (leaving the epoll set first,
// so that the loop never polls a reused descriptor number).
func (e *Enforcer) closeWakeLocked(in *instance) {
	if in.wakeRecv >= 0 {
		_ = unix.EpollCtl(e.epfd, unix.EPOLL_CTL_DEL, in.wakeRecv, nil)
		_ = unix.Close(in.wakeRecv)
		in.wakeRecv = -1
	}
	if in.wakeSend >= 0 {
		_ = unix.Close(in.wakeSend)
		in.wakeSend = -1
	}
}

// drainWakesLocked discards what the instances' processes sent, from the
// sockets the epoll set reports readable: those listened to (wake word set)
// that hold a datagram, not every instance's (one receive each per woken
// tick was most of the loop's system calls with 16 instances asked for
// their first wait).
func (e *Enforcer) drainWakesLocked() {
	var evs [16]unix.EpollEvent
	var b [8]byte
	// One pass per 16 instances at most: a tenant that sends without pause
	// cannot keep the tick here.
	for pass := 0; e.epfd >= 0 && pass <= len(e.list)/len(evs); pass++ {
		n := e.pollNow(evs[:])
		if n <= 0 {
			return
		}
		for _, ev := range evs[:n] {
			for range wakeDrainMax {
				_, _, errno := unix.RawSyscall6(unix.SYS_RECVFROM, uintptr(ev.Fd), uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), unix.MSG_DONTWAIT, 0, 0) //nolint:gosec // the system call writes b
				if errno != 0 {
					break
				}
			}
		}
		if n < len(evs) {
			return
		}
	}
}

// loopWait is the active loop's wait: a timerfd (CLOCK_MONOTONIC, set to
// the next tick, edge-triggered) in the epoll set of wake sockets, and that
// set on the Go runtime's poller (an epoll descriptor is readable while it
// has events). For a wait of rawWaitMax or more the loop's goroutine parks
// there and gives its P back, so that with every P idle the runtime's
// sysmon thread sleeps instead of polling every 10 ms, and the timerfd
// fires to the nanosecond (the runtime's own timers wait in epoll_pwait
// with millisecond timeouts). Blocking the thread for every wait kept a P
// busy while the loop slept: sysmon then polled, and the loop had to yield
// its P every few milliseconds; with 16 busy instances that cost the
// enforcer 1.6-2.2 % of a core on the 2-vCPU CI VM, this 1.0-1.6 %
// (docs/enforcer.md).
type loopWait struct {
	tfd int
	f   *os.File // a duplicate of the epoll set's descriptor, on the poller
	rc  syscall.RawConn
}

// newLoopWait returns the loop's wait, or nil where the kernel refuses one
// of its parts (the loop then sleeps on the runtime's timers).
func (e *Enforcer) newLoopWait() *loopWait {
	if e.epfd < 0 {
		return nil
	}
	tfd, err := unix.TimerfdCreate(unix.CLOCK_MONOTONIC, unix.TFD_NONBLOCK|unix.TFD_CLOEXEC)
	if err != nil {
		return nil
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLET, Fd: int32(tfd)} //nolint:gosec // fds fit in int32
	if err := unix.EpollCtl(e.epfd, unix.EPOLL_CTL_ADD, tfd, &ev); err != nil {
		_ = unix.Close(tfd)
		return nil
	}
	w := &loopWait{tfd: tfd}
	dup, err := unix.FcntlInt(uintptr(e.epfd), unix.F_DUPFD_CLOEXEC, 0) //nolint:gosec // a valid fd
	if err == nil {
		if err = unix.SetNonblock(dup, true); err != nil {
			_ = unix.Close(dup)
		}
	}
	if err == nil {
		w.f = os.NewFile(uintptr(dup), "wake-epoll") //nolint:gosec // a descriptor just made
		w.rc, err = w.f.SyscallConn()
	}
	if err != nil {
		e.closeLoopWait(w)
		return nil
	}
	return w
}

func (e *Enforcer) closeLoopWait(w *loopWait) {
	if w == nil {
		return
	}
	if w.f != nil {
		_ = w.f.Close()
	}
	_ = unix.EpollCtl(e.epfd, unix.EPOLL_CTL_DEL, w.tfd, nil)
	_ = unix.Close(w.tfd)
}

// pollNow returns the events pending on the epoll set, at most len(evs),
// without waiting, or -errno. The loop's system calls that cannot block
// are raw: an ordinary one tells the runtime it may block, which wakes the
// runtime's sysmon thread whenever it sleeps (every P idle), a context
// switch per call.
func (e *Enforcer) pollNow(evs []unix.EpollEvent) int {
	r, _, errno := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT, uintptr(e.epfd), uintptr(unsafe.Pointer(&evs[0])), uintptr(len(evs)), 0, 0, 0) //nolint:gosec // the system call writes evs
	if errno != 0 {
		return -int(errno)
	}
	return int(r) //nolint:gosec // at most len(evs)
}

// rawWaitMax: a wait shorter than this blocks the loop's thread in
// epoll_pwait2 (waitRaw) instead of parking on the poller. Parking costs the
// thread a pass through the runtime's scheduler (looking for other work,
// then sleeping), which a short wait, typically the quiet grace after a
// holder's queue emptied, pays inside that holder's host gap: an online
// step loop beside offline work lost about 1 point more of throughput when
// those waits parked (test/process TestOnlineStepsBesideOffline,
// docs/enforcer.md). Blocking the thread keeps its P, cheap for this long.
const rawWaitMax = time.Millisecond

// waitUntil waits until CLOCK_MONOTONIC reaches at, or until a process
// wakes the loop: it then sleeps on until minWakeTick after last (the
// previous tick), if that is sooner than at, and returns whether it was
// woken. It parks on the poller (loopWait) unless the wait is shorter than
// rawWaitMax.
func (e *Enforcer) waitUntil(w *loopWait, at, last time.Duration) bool {
	now := monotonic()
	if now >= at {
		return false
	}
	if at-now < rawWaitMax {
		if woken, ok := e.waitRaw(w, at, last); ok {
			return woken
		}
	}
	// Raw system calls (pollNow).
	spec := unix.ItimerSpec{Value: unix.NsecToTimespec(int64(at))}
	if _, _, errno := unix.RawSyscall6(unix.SYS_TIMERFD_SETTIME, uintptr(w.tfd), unix.TFD_TIMER_ABSTIME, uintptr(unsafe.Pointer(&spec)), 0, 0, 0); errno != 0 { //nolint:gosec // the system call reads spec
		sleepUntil(at)
		return false
	}
	woken, fired := false, false
	var evs [4]unix.EpollEvent
	_ = w.rc.Read(func(uintptr) bool {
		n := e.pollNow(evs[:])
		if n < 0 {
			return n != -int(unix.EINTR)
		}
		for _, ev := range evs[:n] {
			if int(ev.Fd) == w.tfd {
				fired = true
			} else {
				woken = true
			}
		}
		return n > 0
	})
	if woken && !fired {
		now = monotonic()
		if t := min(at, max(now, last+minWakeTick)); t > now {
			sleepUntil(t)
		}
	}
	return woken
}

// waitRaw is waitUntil blocking the thread in epoll_pwait2 (a raw system
// call: the goroutine keeps its thread and its P); ok is false where the
// kernel has no epoll_pwait2 (Linux < 5.11). The loop's timerfd may report
// an earlier setting meanwhile: that is not a wake-up.
func (e *Enforcer) waitRaw(w *loopWait, at, last time.Duration) (woken, ok bool) {
	var evs [4]unix.EpollEvent
	for now := monotonic(); now < at; now = monotonic() {
		if woken {
			sleepUntil(at)
			continue
		}
		ts := unix.NsecToTimespec(int64(at - now))
		r, _, errno := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT2, uintptr(e.epfd), uintptr(unsafe.Pointer(&evs[0])), uintptr(len(evs)), uintptr(unsafe.Pointer(&ts)), 0, 0) //nolint:gosec // the system call writes evs and reads ts; both outlive it
		if errno == unix.ENOSYS {
			return false, false
		}
		if errno != 0 { // EINTR
			continue
		}
		for _, ev := range evs[:r] {
			if int(ev.Fd) != w.tfd {
				woken = true
				at = min(at, max(now, last+minWakeTick))
			}
		}
	}
	return woken, true
}
