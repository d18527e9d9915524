package backstop

import (
	"errors"
	"fmt"
	"os"

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
// production).
type HostProcs struct{ FS procfs.FS }

// StartTime implements Procs. A zombie has exited.
func (h HostProcs) StartTime(pid int) (uint64, error) {
	st, err := h.FS.Stat(pid)
	gone := errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ESRCH)
	if gone || err == nil && (st.State == 'Z' || st.State == 'X') {
		return 0, fmt.Errorf("pid %d: %w", pid, os.ErrProcessDone)
	}
	if err != nil {
		return 0, err
	}
	return st.StartTime, nil
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
func NewPidfdKiller() PidfdKiller { return PidfdKiller{Procs: HostProcs{FS: procfs.Host}} }

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
