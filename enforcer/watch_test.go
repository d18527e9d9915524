package enforcer

import (
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/api"
)

// exitedPidfds starts a sleeper, returns a pidfd of it and a second
// descriptor of the same open file, and kill makes it exit.
func exitedPidfds(t *testing.T) (pidfd, dup int, kill func()) {
	t.Helper()
	sl := startSleeper(t, nil)
	pidfd, err := unix.PidfdOpen(sl.Process.Pid, 0)
	if err != nil {
		t.Skipf("pidfd_open: %v", err)
	}
	dup, err = unix.FcntlInt(uintptr(pidfd), unix.F_DUPFD_CLOEXEC, 0) //nolint:gosec // a valid fd
	if err != nil {
		t.Fatal(err)
	}
	return pidfd, dup, func() { _ = sl.Process.Kill(); _ = sl.Wait() }
}

// A descriptor the watcher stops watching is never reported again, even
// while another descriptor of the same open file lives. epoll itself keeps
// reporting a closed descriptor then (the control below): that made the
// watcher spin on a process's exit until the attach handler closed its own
// pidfd, and could report the number once reused for another process.
func TestWatcherRemove(t *testing.T) {
	w, err := newWatcher()
	if err != nil {
		t.Fatal(err)
	}
	defer w.close()
	events := make([]unix.EpollEvent, 8)

	// Control: closed without remove, the registration outlives it.
	keep, closed, kill := exitedPidfds(t)
	defer func() { _ = unix.Close(keep) }()
	if _, err := w.add(closed); err != nil {
		t.Fatal(err)
	}
	_ = unix.Close(closed)
	kill()
	n, err := w.wait(events, time.Now().Add(2*time.Second))
	if err != nil || n != 1 || int(events[0].Fd) != closed {
		t.Fatalf("control: epoll should report the closed descriptor %d of a live file: n=%d err=%v", closed, n, err)
	}
	w.remove(closed) // the descriptor is gone: this fails, and changes nothing
	if n, _ := w.wait(events, time.Now().Add(50*time.Millisecond)); n != 1 {
		t.Fatalf("control: a removal by the closed number took effect (%d events)", n)
	}
	_ = unix.Close(keep) // the file's last descriptor: the registration goes with it

	keep2, watched, kill2 := exitedPidfds(t)
	defer func() { _ = unix.Close(keep2) }()
	if _, err := w.add(watched); err != nil {
		t.Fatal(err)
	}
	w.remove(watched)
	_ = unix.Close(watched)
	kill2()
	if n, err := w.wait(events, time.Now().Add(200*time.Millisecond)); n != 0 || err != nil {
		t.Fatalf("a removed descriptor was reported: %d events (fd %d), err=%v", n, events[0].Fd, err)
	}
}

// An event of a registration that was removed, its number then reused for
// another process's pidfd, never reaps that process.
func TestStaleWatchEventReapsNothing(t *testing.T) {
	env := newEnv(t, nil)
	e, _ := env.start(t)
	c := env.client()
	if _, err := c.Create(ctx, tree(os.Getpid(), 40, 2048)); err != nil {
		t.Fatal(err)
	}
	h := startAttachHelper(t, api.ClientSocket(env.runDir()), &syscall.SysProcAttr{})
	if !strings.HasPrefix(h.line, "ok slot=") {
		t.Fatalf("helper: %s", h.line)
	}
	e.mu.Lock()
	var (
		fd  = -1
		ref watchRef
	)
	for f, r := range e.watches {
		if r.slot >= 0 {
			fd, ref = f, r
		}
	}
	if fd < 0 {
		e.mu.Unlock()
		t.Fatal("the attached process's pidfd is not watched")
	}
	handled, _ := e.exitedLocked(watchEvent{fd: fd, seq: ref.seq - 1})
	used := ref.in.slotUsed(ref.slot)
	e.mu.Unlock()
	if handled || !used {
		t.Fatalf("an event of an earlier registration of descriptor %d reaped the live process (handled %v, slot used %v)", fd, handled, used)
	}
	stats, err := c.Stats(ctx)
	if err != nil || len(stats) != 1 || len(stats[0].Processes) != 1 {
		t.Fatalf("after a stale event: %+v, %v", stats, err)
	}
	h.exit()
	eventually(t, 2*time.Second, "the exited process's slot reaped", func() bool {
		s, _ := c.Stats(ctx)
		return len(s) == 1 && len(s[0].Processes) == 0
	})
}
