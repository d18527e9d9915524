package enforcer

import (
	"runtime/debug"
)

// guard runs f, which touches mapped regions, with e.mu held. Every process
// of an instance holds a writable descriptor of its own proc file (a shared
// writable mapping needs one), so it can truncate the file; inotify tells
// the enforcer at once (watch.go), but an access beyond the new end before
// that faults (SIGBUS). guard turns such a fault into a panic
// (debug.SetPanicOnFault), recovers it, restores the size of every
// truncated file and releases its instance: a process can break only its
// own instance, never the enforcer. Other panics propagate.
func (e *Enforcer) guard(f func()) (faulted bool) {
	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	defer func() {
		r := recover()
		if r == nil {
			return
		}
		if _, ok := r.(interface{ Addr() uintptr }); !ok {
			panic(r)
		}
		faulted = true
		e.repairLocked()
	}()
	f()
	return false
}

// repairLocked restores truncated regions and releases their instances.
func (e *Enforcer) repairLocked() {
	for _, in := range append([]*instance(nil), e.list...) {
		if in.reg.Intact() {
			continue
		}
		if err := in.reg.Repair(); err != nil {
			e.o.log.Error("restore the size of a truncated region", "instance", in.name, "err", err)
			continue
		}
		e.o.log.Warn("a process truncated its instance's region; releasing the instance", "instance", in.name, "container", in.containerID)
		e.releaseLocked(in, "one of its processes truncated its region")
	}
}
