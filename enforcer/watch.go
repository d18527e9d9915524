package enforcer

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// watcher waits, with epoll, for pidfds to become readable (their process
// exited). An eventfd wakes it for shutdown.
//
// The epoll descriptor is itself on the Go runtime's poller (an epoll
// descriptor is readable while it has events): watch parks its goroutine
// there instead of blocking a thread in epoll_wait. A goroutine blocked in
// a system call holds its P until sysmon retakes it, and each retake sets
// sysmon polling every 20 µs again; on a small VM, where a context switch
// costs tens of microseconds, that polling was a third of the enforcer's
// CPU while processes came and went.
type watcher struct {
	ep, ev int
	f      *os.File        // ep, on the runtime's poller
	rc     syscall.RawConn // f's
	// seq numbers registrations: an event carries its registration's
	// number beside the descriptor's, and counts only while that
	// descriptor is still registered under it (watchRef.seq), never for a
	// later registration that reuses the number.
	seq int32
}

func newWatcher() (*watcher, error) {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("epoll_create1: %w", err)
	}
	if err := unix.SetNonblock(ep, true); err != nil {
		_ = unix.Close(ep)
		return nil, fmt.Errorf("epoll descriptor: %w", err)
	}
	f := os.NewFile(uintptr(ep), "epoll") //nolint:gosec // a descriptor just made
	rc, err := f.SyscallConn()
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("epoll descriptor: %w", err)
	}
	ev, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	w := &watcher{ep: ep, ev: ev, f: f, rc: rc}
	if _, err := w.add(ev); err != nil {
		w.close()
		return nil, err
	}
	return w, nil
}

// wait returns the events pending on the watcher, waiting for one until
// deadline (none: n == 0).
func (w *watcher) wait(events []unix.EpollEvent, deadline time.Time) (int, error) {
	if err := w.f.SetReadDeadline(deadline); err != nil {
		return 0, err
	}
	var n int
	var werr error
	err := w.rc.Read(func(fd uintptr) bool {
		n, werr = unix.EpollWait(int(fd), events, 0) //nolint:gosec // the descriptor is ep
		if errors.Is(werr, unix.EINTR) {
			n, werr = 0, nil
		}
		return n > 0 || werr != nil
	})
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	return n, werr
}

// add watches fd and returns the registration's number (add is called
// under the enforcer's lock, as remove is).
func (w *watcher) add(fd int) (int32, error) {
	w.seq++
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd), Pad: w.seq} //nolint:gosec // fds fit in int32
	if err := unix.EpollCtl(w.ep, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		return 0, fmt.Errorf("epoll_ctl: %w", err)
	}
	return w.seq, nil
}

// remove stops watching fd, which the caller closes next. Closing alone is
// not enough: epoll keeps a registration while any descriptor of the same
// open file lives, and would go on reporting the closed number.
func (w *watcher) remove(fd int) {
	_ = unix.EpollCtl(w.ep, unix.EPOLL_CTL_DEL, fd, nil)
}

// stop wakes a pending wait so that watch returns.
func (w *watcher) stop() {
	var one = [8]byte{1}
	_, _ = unix.Write(w.ev, one[:])
}

func (w *watcher) close() {
	_ = unix.Close(w.ev)
	_ = w.f.Close()
}

// reapSaveDelay bounds how long the state file may lag behind the reaped
// totals of exited processes: a process's exit changes only those totals,
// and writing the file at every exit was most of the enforcer's work per
// process. A crash within that time loses the GPU time and launches of the
// processes reaped in it from the instance's totals (what a crash just
// after an exit always lost); releases and sweeps are written at once.
const reapSaveDelay = time.Second

// watch reaps slots and instances as their processes exit, and sweeps
// every o.sweep for what no pidfd watches.
func (e *Enforcer) watch(ctx context.Context) {
	events := make([]unix.EpollEvent, 64)
	exited := make([]watchEvent, 0, 64)
	nextSweep := time.Now().Add(e.o.sweep)
	var pending time.Time // when reaped totals not yet written were first reaped
	for ctx.Err() == nil {
		wake := nextSweep
		if !pending.IsZero() {
			wake = minTime(wake, pending.Add(reapSaveDelay))
		}
		n, err := e.w.wait(events, wake.Add(time.Millisecond))
		if err != nil {
			e.o.log.Error("epoll_wait", "err", err)
			return
		}
		exited = exited[:0]
		for _, ev := range events[:max(n, 0)] {
			if int(ev.Fd) == e.w.ev {
				return
			}
			exited = append(exited, watchEvent{fd: int(ev.Fd), seq: ev.Pad})
		}
		reaped, saveNow := false, false
		if len(exited) > 0 {
			e.mu.Lock()
			for _, ev := range exited {
				if e.guard(func() {
					handled, released := e.exitedLocked(ev)
					reaped = reaped || handled
					saveNow = saveNow || released
				}) {
					saveNow = true // the fault released an instance
				}
			}
			e.mu.Unlock()
		}
		if !time.Now().Before(nextSweep) {
			saveNow = e.sweep() || saveNow
			nextSweep = time.Now().Add(e.o.sweep)
		}
		if reaped && pending.IsZero() {
			pending = time.Now()
		}
		if saveNow || (!pending.IsZero() && time.Since(pending) >= reapSaveDelay) {
			if err := e.save(); err != nil {
				e.o.log.Error("write state", "err", err)
			}
			pending = time.Time{}
		}
		if reaped || saveNow {
			e.kickLoop()
		}
	}
}

// watchLocked watches pidfd, which stands for ref (an instance's root
// process or one of its slots' processes), and owns it from now on. It
// returns the descriptor to keep in the instance: pidfd, or -1 when it
// cannot be watched (it is closed, and the sweep finds the exit through
// /proc instead).
func (e *Enforcer) watchLocked(pidfd int, ref watchRef) int {
	seq, err := e.w.add(pidfd)
	if err != nil {
		e.o.log.Warn("watch process", "instance", ref.in.name, "slot", ref.slot, "err", err)
		_ = unix.Close(pidfd)
		return -1
	}
	ref.seq = seq
	e.watches[pidfd] = ref
	return pidfd
}

// unwatchLocked stops watching pidfd and closes it.
func (e *Enforcer) unwatchLocked(pidfd int) {
	delete(e.watches, pidfd)
	e.w.remove(pidfd)
	_ = unix.Close(pidfd)
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// watchEvent is an event of the watcher: a registration's descriptor and
// number.
type watchEvent struct {
	fd  int
	seq int32
}

// exitedLocked handles a readable pidfd: the process it stands for exited.
// handled says the pidfd was watched (by the registration the event is
// of: one removed since, with its number reused, is not it); released,
// that an instance was released with it.
func (e *Enforcer) exitedLocked(ev watchEvent) (handled, released bool) {
	ref, ok := e.watches[ev.fd]
	if !ok || ref.seq != ev.seq {
		return false, false
	}
	in := ref.in
	if ref.slot < 0 {
		e.unwatchLocked(ev.fd)
		in.rootFD = -1
		in.rootGone = true
	} else {
		e.reapSlotLocked(in, ref.slot)
	}
	if in.rootGone && in.nused == 0 {
		e.releaseLocked(in, "its processes are gone")
		return true, true
	}
	return true, false
}

// reapSlotLocked frees slot i: its counters are folded into the instance's
// totals and zeroed (its reserved memory is released with them).
func (e *Enforcer) reapSlotLocked(in *instance, i int) {
	if !in.slotUsed(i) {
		return
	}
	if fd := in.slotFD[i]; fd >= 0 {
		e.unwatchLocked(fd)
		in.slotFD[i] = -1
	}
	p := in.reg.Proc(i)
	e.o.log.Debug("reaped", "instance", in.name, "slot", i, "pid", p.PID.Load(), "gpu_ns", p.GPUNs.Load())
	e.fold(in, i)
	p.Clear()
	in.clearUsed(i)
}

// sweep checks, through /proc, what has no pidfd (pidfd_open failed).
func (e *Enforcer) sweep() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	changed := false
	// A slot's fault during the sweep releases an instance, which is a
	// change too.
	faulted := e.guard(func() { changed = e.sweepLocked() })
	return changed || faulted
}

func (e *Enforcer) sweepLocked() bool {
	changed := false
	for _, in := range append([]*instance(nil), e.list...) {
		if !in.rootGone && in.rootFD < 0 && !e.alive(in.pid, in.startTime) {
			in.rootGone = true
			changed = true
		}
		in.forSlots(func(i int) {
			p := in.reg.Proc(i)
			if in.slotFD[i] < 0 && !e.alive(int(p.PID.Load()), p.StartTime.Load()) {
				e.reapSlotLocked(in, i)
				changed = true
			}
		})
		if in.rootGone && in.nused == 0 {
			e.releaseLocked(in, "its processes are gone")
			changed = true
		}
	}
	return changed
}
