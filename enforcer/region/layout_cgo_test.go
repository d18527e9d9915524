//go:build cgo

package region

import (
	"testing"
	"unsafe"

	"github.com/mgpu-dev/mgpu/enforcer/internal/cheader"
)

// TestLayoutMatchesHeader checks every size, offset and constant of the Go
// mirror against mgpu_region.h as compiled by the C compiler.
func TestLayoutMatchesHeader(t *testing.T) {
	t.Parallel()
	var (
		c Counters
		s Slot
		l Layout
	)
	want := map[string]uint64{
		"sizeof(mgpu_slot_t)":           uint64(unsafe.Sizeof(s)),
		"mgpu_slot_t.pid":               uint64(unsafe.Offsetof(s.PID)),
		"mgpu_slot_t.reserved":          uint64(unsafe.Offsetof(s.Reserved)),
		"mgpu_slot_t.start_time":        uint64(unsafe.Offsetof(s.StartTime)),
		"mgpu_slot_t.proc_dev":          uint64(unsafe.Offsetof(s.ProcDev)),
		"mgpu_slot_t.proc_ino":          uint64(unsafe.Offsetof(s.ProcIno)),
		"sizeof(mgpu_proc_t)":           uint64(unsafe.Sizeof(c)),
		"mgpu_proc_t.waiting":           uint64(unsafe.Offsetof(c.Waiting)),
		"mgpu_proc_t.reserved32":        uint64(unsafe.Offsetof(c.Reserved32)),
		"mgpu_proc_t.mem_reserved":      uint64(unsafe.Offsetof(c.MemReserved)),
		"mgpu_proc_t.gpu_ns":            uint64(unsafe.Offsetof(c.GPUNs)),
		"mgpu_proc_t.queued_ns":         uint64(unsafe.Offsetof(c.QueuedNs)),
		"mgpu_proc_t.launches":          uint64(unsafe.Offsetof(c.Launches)),
		"mgpu_proc_t.throttled_ns":      uint64(unsafe.Offsetof(c.ThrottledNs)),
		"mgpu_proc_t.idle_ns":           uint64(unsafe.Offsetof(c.IdleNs)),
		"mgpu_proc_t.mem_ahead":         uint64(unsafe.Offsetof(c.MemAhead)),
		"mgpu_control_t.magic":          uint64(unsafe.Offsetof(l.Magic)),
		"mgpu_control_t.version":        uint64(unsafe.Offsetof(l.Version)),
		"mgpu_control_t.size":           uint64(unsafe.Offsetof(l.Size)),
		"mgpu_control_t.max_procs":      uint64(unsafe.Offsetof(l.MaxProcs)),
		"mgpu_control_t.device_index":   uint64(unsafe.Offsetof(l.DeviceIndex)),
		"mgpu_control_t.instance_id":    uint64(unsafe.Offsetof(l.InstanceID)),
		"mgpu_control_t.policy":         uint64(unsafe.Offsetof(l.Policy)),
		"mgpu_control_t.core":           uint64(unsafe.Offsetof(l.Core)),
		"mgpu_control_t.memory_limit":   uint64(unsafe.Offsetof(l.MemoryLimit)),
		"mgpu_control_t.period_ns":      uint64(unsafe.Offsetof(l.PeriodNs)),
		"mgpu_control_t.max_queued_ns":  uint64(unsafe.Offsetof(l.MaxQueuedNs)),
		"mgpu_control_t.reserved_hdr":   uint64(unsafe.Offsetof(l.ReservedHdr)),
		"mgpu_control_t.grant":          uint64(unsafe.Offsetof(l.Grant)),
		"mgpu_control_t.enforcer_epoch": uint64(unsafe.Offsetof(l.EnforcerEpoch)),
		"mgpu_control_t.heartbeat_ns":   uint64(unsafe.Offsetof(l.HeartbeatNs)),
		"mgpu_control_t.contended":      uint64(unsafe.Offsetof(l.Contended)),
		"mgpu_control_t.wake":           uint64(unsafe.Offsetof(l.Wake)),
		"mgpu_control_t.used":           uint64(unsafe.Offsetof(l.Used)),
		"mgpu_control_t.reserved_ctl":   uint64(unsafe.Offsetof(l.ReservedCtl)),
		"mgpu_control_t.reserved_tail":  uint64(unsafe.Offsetof(l.ReservedTail)),
		"mgpu_control_t.slots":          uint64(unsafe.Offsetof(l.Slots)),
		"sizeof(mgpu_control_t)":        uint64(unsafe.Sizeof(l)),

		"MGPU_REGION_MAGIC":                  uint64(Magic),
		"MGPU_REGION_VERSION":                uint64(Version),
		"MGPU_REGION_MAX_PROCS":              MaxProcs,
		"MGPU_CONTROL_FILE_SIZE":             ControlFileSize,
		"MGPU_PROC_FILE_SIZE":                ProcFileSize,
		"MGPU_POLICY_FIXED_SHARE":            uint64(PolicyFixedShare),
		"MGPU_POLICY_GUARANTEED_BURST_SHARE": uint64(PolicyGuaranteedBurstShare),
		"MGPU_POLICY_NATIVE_BURST_SHARE":     uint64(PolicyNativeBurstShare),
		"MGPU_GRANT_ALL":                     uint64(GrantAll),
		"MGPU_GRANT_ONE":                     uint64(GrantOne),
		"MGPU_WAKE_BUSY":                     uint64(WakeBusy),
		"MGPU_WAKE_IDLE":                     uint64(WakeIdle),
	}
	cv := cheader.Values()
	for name, goVal := range want {
		cVal, ok := cv[name]
		if !ok {
			t.Errorf("%s: not in the C table", name)
			continue
		}
		if cVal != goVal {
			t.Errorf("%s: C has %d, Go has %d", name, cVal, goVal)
		}
	}
	// Every region/proc entry of the C table must be checked here.
	for name := range cv {
		if _, ok := want[name]; !ok && (hasPrefix(name, "mgpu_proc_t.") || hasPrefix(name, "mgpu_slot_t.") || hasPrefix(name, "mgpu_control_t.") ||
			hasPrefix(name, "MGPU_REGION_") || hasPrefix(name, "MGPU_CONTROL_") || hasPrefix(name, "MGPU_PROC_") || hasPrefix(name, "MGPU_POLICY_") || hasPrefix(name, "MGPU_WAKE_") || hasPrefix(name, "MGPU_GRANT_")) {
			t.Errorf("%s: in the C table but not checked against Go", name)
		}
	}
	if HeaderSize != unsafe.Offsetof(l.Slots) || ProcSize != unsafe.Sizeof(c) || SlotSize != unsafe.Sizeof(s) {
		t.Errorf("HeaderSize/ProcSize constants disagree with the structs")
	}
}

func hasPrefix(s, p string) bool { return len(s) >= len(p) && s[:len(p)] == p }
