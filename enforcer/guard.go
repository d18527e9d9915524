package enforcer

import (
	"fmt"
	"runtime/debug"
)

// guard runs f, which touches mapped regions, with e.mu held, and reports
// whether an access of f faulted.
//
// What a process can write cannot fault the enforcer's mappings but in one
// case. A slot is a sealed memfd (region.Renew): no descriptor can shrink
// it, and its page was allocated when it was made. But a process can punch
// a hole in its own slot (FALLOC_FL_PUNCH_HOLE; only a write seal, which
// would forbid its own writable mapping, stops that): the page is freed,
// and the enforcer's next access needs a new one, which the kernel refuses
// with SIGBUS when the host runs strict overcommit (vm.overcommit_memory =
// 2) at its commit limit. guard turns such a fault into a panic
// (debug.SetPanicOnFault), recovers it and releases the instance whose slot
// the address is in: a process can break only its own instance. A fault
// elsewhere, and any other panic, propagates.
func (e *Enforcer) guard(f func()) (faulted bool) {
	addr, faulted := fault(f)
	if faulted {
		e.releaseFaultedLocked(addr)
	}
	return faulted
}

// fault runs f with memory faults turned into panics, and recovers the
// panic of one: it returns the faulting address. Other panics propagate.
func fault(f func()) (addr uintptr, faulted bool) {
	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	defer func() {
		r := recover()
		if r == nil {
			return
		}
		a, ok := r.(interface{ Addr() uintptr })
		if !ok {
			panic(r)
		}
		addr, faulted = a.Addr(), true
	}()
	f()
	return 0, false
}

// releaseFaultedLocked releases the instance whose slot holds addr.
func (e *Enforcer) releaseFaultedLocked(addr uintptr) {
	for _, in := range e.list {
		if slot, ok := in.reg.SlotAt(addr); ok {
			e.o.log.Warn("an access to a process's slot faulted (it punched a hole in it, and the kernel cannot back the page again); releasing the instance",
				"instance", in.name, "container", in.containerID, "slot", slot, "pid", in.reg.Proc(slot).PID.Load())
			e.releaseLocked(in, "an access to a slot of one of its processes faulted")
			return
		}
	}
	panic(fmt.Sprintf("memory fault at %#x, in no slot of a region", addr))
}
