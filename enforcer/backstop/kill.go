package backstop

import (
	"errors"
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/procfs"
)

// Procs tells the start time of a host process, which identifies it across
// pid reuse.
type Procs interface {
	// StartTime returns the start time of pid (clock ticks after boot,
	// /proc/<pid>/stat field 22); an error wrapping os.ErrProcessDone when
	// the process has exited.
	StartTime(pid int) (uint64, error)
}

// HostProcs reads start times from a proc file system (procfs.Host in
// production). Made by NewHostProcs, it remembers the start time of each
// process it read while a pidfd of that process shows it alive: a pid
// cannot name another process before that one has exited, so asking again
// about a live process costs one poll, not a read of /proc (the watcher
// asks about every process on the device at every check).
type HostProcs struct {
	FS     procfs.FS
	starts *startCache // nil: nothing is remembered
}

// NewHostProcs returns a HostProcs of fs that remembers start times.
func NewHostProcs(fs procfs.FS) HostProcs {
	return HostProcs{FS: fs, starts: &startCache{m: map[int]startEntry{}}}
}

// StartTime implements Procs. A zombie has exited.
func (h HostProcs) StartTime(pid int) (uint64, error) {
	if st, ok := h.starts.get(pid); ok {
		return st, nil
	}
	// A pidfd opened before the read names the process read if it still
	// lives after it.
	fd := -1
	if h.starts != nil {
		if f, err := unix.PidfdOpen(pid, 0); err == nil {
			fd = f
		}
	}
	st, err := h.FS.Stat(pid)
	gone := errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ESRCH)
	if gone || err == nil && (st.State == 'Z' || st.State == 'X') {
		err = fmt.Errorf("pid %d: %w", pid, os.ErrProcessDone)
	}
	if err != nil || fd < 0 || procfs.PidfdExited(fd) {
		if fd >= 0 {
			_ = unix.Close(fd)
		}
		if err != nil {
			return 0, err
		}
		return st.StartTime, nil
	}
	h.starts.put(pid, st.StartTime, fd)
	return st.StartTime, nil
}

// startCache is HostProcs' memory: per pid, the start time read and a
// pidfd of the process it was read of.
type startCache struct {
	mu sync.Mutex
	m  map[int]startEntry
}

type startEntry struct {
	start uint64
	pidfd int
}

// maxStartCache bounds the processes remembered (each holds a pidfd).
const maxStartCache = 4096

// get returns pid's start time if its process still lives; an entry of
// one that exited is dropped.
func (c *startCache) get(pid int) (uint64, bool) {
	if c == nil {
		return 0, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[pid]
	if !ok {
		return 0, false
	}
	if procfs.PidfdExited(e.pidfd) {
		_ = unix.Close(e.pidfd)
		delete(c.m, pid)
		return 0, false
	}
	return e.start, true
}

// put remembers pid's start time; the cache keeps pidfd.
func (c *startCache) put(pid int, start uint64, pidfd int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if old, ok := c.m[pid]; ok {
		_ = unix.Close(old.pidfd)
	} else if len(c.m) >= maxStartCache {
		for _, e := range c.m {
			_ = unix.Close(e.pidfd)
		}
		clear(c.m)
	}
	c.m[pid] = startEntry{start: start, pidfd: pidfd}
}

// Target is a process to kill: the pid and the start time it had when it
// was attributed.
type Target struct {
	PID       int
	StartTime uint64
}

// ErrPidReused is returned (wrapped) by a Killer that refuses to signal a
// pid because it now names another process than the one observed.
var ErrPidReused = errors.New("pid reused by another process")

// Killer kills processes that violate their instance's quota.
type Killer interface {
	// Kill sends SIGKILL to t if, and only if, t.PID is still the process
	// that started at t.StartTime. It returns an error wrapping
	// os.ErrProcessDone when the process has exited and ErrPidReused when
	// the pid names another process.
	Kill(t Target) error
}

// PidfdKiller is the real Killer: it opens a pidfd of the pid, checks the
// start time of the process the pidfd refers to, and signals through the
// pidfd, so that a pid reused between the check and the signal is never
// signalled (Linux >= 5.3).
type PidfdKiller struct{ Procs Procs }

// NewPidfdKiller returns a PidfdKiller over the host's /proc.
func NewPidfdKiller() PidfdKiller { return PidfdKiller{Procs: NewHostProcs(procfs.Host)} }

// Kill implements Killer.
func (k PidfdKiller) Kill(t Target) error {
	if t.PID <= 0 {
		return fmt.Errorf("pid %d: not a process", t.PID)
	}
	fd, err := unix.PidfdOpen(t.PID, 0)
	if errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("pid %d: %w", t.PID, os.ErrProcessDone)
	}
	if err != nil {
		return fmt.Errorf("pidfd_open %d: %w", t.PID, err)
	}
	defer func() { _ = unix.Close(fd) }()
	// The pidfd now pins the process: if the start time still matches,
	// the pidfd refers to the observed process, and a signal through it
	// cannot reach a later process of the same pid.
	st, err := k.Procs.StartTime(t.PID)
	if err != nil {
		return err
	}
	if st != t.StartTime {
		return fmt.Errorf("pid %d: %w (start time %d, observed %d)", t.PID, ErrPidReused, st, t.StartTime)
	}
	if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil {
		if errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("pid %d: %w", t.PID, os.ErrProcessDone)
		}
		return fmt.Errorf("pidfd_send_signal %d: %w", t.PID, err)
	}
	return nil
}
