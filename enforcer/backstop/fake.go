package backstop

import (
	"fmt"
	"maps"
	"os"
	"slices"
	"sync"
	"time"
)

// FakeSource is a Source for tests: it reports what its fields say.
type FakeSource struct {
	mu sync.Mutex
	// Procs is what Processes returns.
	Procs []Process
	// Busy is what the next GPUTime returns; GPUTime empties it.
	Busy map[int]time.Duration
	// ProcsErr and BusyErr, when set, are returned instead.
	ProcsErr, BusyErr error
}

// Set replaces what the source reports.
func (f *FakeSource) Set(procs []Process, busy map[int]time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Procs, f.Busy = procs, busy
}

// Fail makes the queries fail (nil: succeed).
func (f *FakeSource) Fail(procsErr, busyErr error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ProcsErr, f.BusyErr = procsErr, busyErr
}

// Processes implements Source.
func (f *FakeSource) Processes() ([]Process, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ProcsErr != nil {
		return nil, f.ProcsErr
	}
	return slices.Clone(f.Procs), nil
}

// GPUTime implements Source.
func (f *FakeSource) GPUTime() (map[int]time.Duration, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.BusyErr != nil {
		return nil, f.BusyErr
	}
	b := maps.Clone(f.Busy)
	f.Busy = nil
	return b, nil
}

// FakeProcs is a Procs for tests: the start time of each live pid.
type FakeProcs struct {
	mu    sync.Mutex
	start map[int]uint64
}

// NewFakeProcs returns processes with the given start times.
func NewFakeProcs(start map[int]uint64) *FakeProcs {
	return &FakeProcs{start: maps.Clone(start)}
}

// Start sets (or, with ok false, removes) a process.
func (f *FakeProcs) Start(pid int, startTime uint64, ok bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.start == nil {
		f.start = map[int]uint64{}
	}
	if ok {
		f.start[pid] = startTime
	} else {
		delete(f.start, pid)
	}
}

// StartTime implements Procs.
func (f *FakeProcs) StartTime(pid int) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, ok := f.start[pid]
	if !ok {
		return 0, fmt.Errorf("pid %d: %w", pid, os.ErrProcessDone)
	}
	return st, nil
}

// FakeKiller is a Killer for tests: it records what it is asked to kill
// and, when Procs is set, removes the process there as a kill would (after
// the same start-time check as PidfdKiller).
type FakeKiller struct {
	mu     sync.Mutex
	Procs  *FakeProcs
	Err    error // returned by every Kill when set
	killed []Target
}

// Kill implements Killer.
func (f *FakeKiller) Kill(t Target) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.Err != nil {
		return f.Err
	}
	if f.Procs != nil {
		st, err := f.Procs.StartTime(t.PID)
		if err != nil {
			return err
		}
		if st != t.StartTime {
			return fmt.Errorf("pid %d: %w", t.PID, ErrPidReused)
		}
		f.Procs.Start(t.PID, 0, false)
	}
	f.killed = append(f.killed, t)
	return nil
}

// Killed returns what was killed, in order.
func (f *FakeKiller) Killed() []Target {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.killed)
}
