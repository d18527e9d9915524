package enforcer

import (
	"errors"
	mathbits "math/bits"
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

// errNoWake: the kernel lacks epoll_pwait2, so the loop cannot be woken.
var errNoWake = errors.New("this kernel has no epoll_pwait2 (Linux 5.11); the enforcer is not woken by processes")

// minWakeTick is the shortest interval between a tick and one a process
// woke the loop for: a tenant that sends without pause makes the loop tick
// at most this often.
const minWakeTick = 50 * time.Microsecond

// wakeDrainMax bounds the datagrams discarded from one instance's socket at
// one tick (it holds a few hundred at most; the rest wait for the next).
const wakeDrainMax = 256

// newEpoll returns the loop's epoll set, or -1 where the kernel has no
// epoll_pwait2 (Linux < 5.11): the loop then sleeps as before and
// processes' wake-ups are not heard (they change nothing else).
func newEpoll() int {
	fd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return -1
	}
	var ts unix.Timespec
	var ev [1]unix.EpollEvent
	_, _, errno := unix.Syscall6(unix.SYS_EPOLL_PWAIT2, uintptr(fd), uintptr(unsafe.Pointer(&ev[0])), 1, uintptr(unsafe.Pointer(&ts)), 0, 0) //nolint:gosec // the system call writes ev and reads ts
	if errno == unix.ENOSYS {
		_ = unix.Close(fd)
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
		_ = unix.EpollCtl(e.epfd, unix.EPOLL_CTL_MOD, in.wakeRecv, &ev)
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
		n, err := unix.EpollWait(e.epfd, evs[:], 0)
		if err != nil || n <= 0 {
			return
		}
		for _, ev := range evs[:n] {
			for range wakeDrainMax {
				if _, _, err := unix.Recvfrom(int(ev.Fd), b[:], unix.MSG_DONTWAIT); err != nil {
					break
				}
			}
		}
		if n < len(evs) {
			return
		}
	}
}

// waitUntil blocks the calling thread until CLOCK_MONOTONIC reaches at (see
// sleepUntil), or until a process wakes the loop: it then sleeps on until
// minWakeTick after last (the previous tick), if that is sooner than at,
// and returns whether it was woken.
func (e *Enforcer) waitUntil(at, last time.Duration) bool {
	woken := false
	var evs [1]unix.EpollEvent
	for now := monotonic(); now < at; now = monotonic() {
		if woken || e.epfd < 0 {
			sleepUntil(at)
			continue
		}
		ts := unix.NsecToTimespec(int64(at - now))
		n, _, _ := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT2, uintptr(e.epfd), uintptr(unsafe.Pointer(&evs[0])), 1, uintptr(unsafe.Pointer(&ts)), 0, 0) //nolint:gosec // the system call writes evs and reads ts; both outlive it
		// n is an event count, or -errno as a uintptr (negative as an int).
		if int(n) > 0 { //nolint:gosec // see above
			woken = true
			at = min(at, max(now, last+minWakeTick))
		}
	}
	return woken
}
