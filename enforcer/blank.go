package enforcer

import (
	"path/filepath"
	"runtime"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/region"
)

// blankName is the blank region's directory in the regions directory. It
// is no instance's name, so an enforcer that starts after a crash removes
// a stale one with the stray regions.
const blankName = ".blank"

// newRegionLocked makes instance in's region at path: it installs the
// blank region made ahead of time (a rename and a header: what a create
// waits for when a container starts) or, when none is ready, makes one
// there. Create starts making the next blank region once the state is
// written (its control file would otherwise share the state's journal
// commit).
func (e *Enforcer) newRegionLocked(path string, p region.Params) (*region.Region, error) {
	if b := e.blank; b != nil {
		e.blank = nil
		err := b.Install(path, p)
		if err == nil {
			return b, nil
		}
		e.o.log.Warn("install the blank region; making one", "err", err)
		_ = b.Close()
		_ = region.Remove(b.Dir())
	}
	return region.Create(path, p)
}

// refillBlankLocked starts making a blank region in the background unless
// one is ready, being made, or the enforcer is closing.
func (e *Enforcer) refillBlankLocked() {
	if e.blank != nil || e.blanking || e.closed {
		return
	}
	e.blanking = true
	e.bg.Add(1)
	go func() {
		defer e.bg.Done()
		// On a thread of its own at the lowest priority: the blank is made
		// just after a create, while the engine goes on starting the
		// container, and must not take the CPU from it. The thread ends
		// with the goroutine (locked, never unlocked).
		runtime.LockOSThread()
		_ = unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), 19)
		path := filepath.Join(e.regions, blankName)
		_ = region.Remove(path) // one left by a failed install
		r, err := region.CreateBlank(path)
		e.mu.Lock()
		defer e.mu.Unlock()
		e.blanking = false
		switch {
		case err != nil:
			e.o.log.Warn("make a blank region ahead of the next create", "err", err)
		case e.closed:
			_ = r.Close()
			_ = region.Remove(path)
		default:
			e.blank = r
		}
	}()
}

// dropBlankLocked removes the blank region (at close: the next enforcer
// makes its own).
func (e *Enforcer) dropBlankLocked() {
	if e.blank != nil {
		_ = e.blank.Close()
		_ = region.Remove(e.blank.Dir())
		e.blank = nil
	}
}
