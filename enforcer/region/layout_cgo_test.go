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
	var p Proc
	var l Layout
	want := map[string]uint64{
		"sizeof(mgpu_proc_t)":          uint64(unsafe.Sizeof(p)),
		"mgpu_proc_t.pid":              uint64(unsafe.Offsetof(p.PID)),
		"mgpu_proc_t.waiting":          uint64(unsafe.Offsetof(p.Waiting)),
		"mgpu_proc_t.mem_reserved":     uint64(unsafe.Offsetof(p.MemReserved)),
		"mgpu_proc_t.gpu_ns":           uint64(unsafe.Offsetof(p.GPUNs)),
		"mgpu_proc_t.queued_ns":        uint64(unsafe.Offsetof(p.QueuedNs)),
		"mgpu_proc_t.launches":         uint64(unsafe.Offsetof(p.Launches)),
		"mgpu_proc_t.throttled_ns":     uint64(unsafe.Offsetof(p.ThrottledNs)),
		"mgpu_proc_t.start_time":       uint64(unsafe.Offsetof(p.StartTime)),
		"mgpu_proc_t.reserved":         uint64(unsafe.Offsetof(p.Reserved)),
		"sizeof(mgpu_region_t)":        uint64(unsafe.Sizeof(l)),
		"mgpu_region_t.magic":          uint64(unsafe.Offsetof(l.Magic)),
		"mgpu_region_t.version":        uint64(unsafe.Offsetof(l.Version)),
		"mgpu_region_t.size":           uint64(unsafe.Offsetof(l.Size)),
		"mgpu_region_t.max_procs":      uint64(unsafe.Offsetof(l.MaxProcs)),
		"mgpu_region_t.device_index":   uint64(unsafe.Offsetof(l.DeviceIndex)),
		"mgpu_region_t.instance_id":    uint64(unsafe.Offsetof(l.InstanceID)),
		"mgpu_region_t.policy":         uint64(unsafe.Offsetof(l.Policy)),
		"mgpu_region_t.core":           uint64(unsafe.Offsetof(l.Core)),
		"mgpu_region_t.memory_limit":   uint64(unsafe.Offsetof(l.MemoryLimit)),
		"mgpu_region_t.period_ns":      uint64(unsafe.Offsetof(l.PeriodNs)),
		"mgpu_region_t.max_queued_ns":  uint64(unsafe.Offsetof(l.MaxQueuedNs)),
		"mgpu_region_t.reserved_hdr":   uint64(unsafe.Offsetof(l.ReservedHdr)),
		"mgpu_region_t.grant":          uint64(unsafe.Offsetof(l.Grant)),
		"mgpu_region_t.enforcer_epoch": uint64(unsafe.Offsetof(l.EnforcerEpoch)),
		"mgpu_region_t.heartbeat_ns":   uint64(unsafe.Offsetof(l.HeartbeatNs)),
		"mgpu_region_t.contended":      uint64(unsafe.Offsetof(l.Contended)),
		"mgpu_region_t.reserved_ctl32": uint64(unsafe.Offsetof(l.ReservedCtl32)),
		"mgpu_region_t.reserved_ctl":   uint64(unsafe.Offsetof(l.ReservedCtl)),
		"mgpu_region_t.reserved_tail":  uint64(unsafe.Offsetof(l.ReservedTail)),
		"mgpu_region_t.procs":          uint64(unsafe.Offsetof(l.Procs)),

		"MGPU_REGION_MAGIC":                  uint64(Magic),
		"MGPU_REGION_VERSION":                uint64(Version),
		"MGPU_REGION_MAX_PROCS":              MaxProcs,
		"MGPU_REGION_FILE_SIZE":              FileSize,
		"MGPU_POLICY_FIXED_SHARE":            uint64(PolicyFixedShare),
		"MGPU_POLICY_GUARANTEED_BURST_SHARE": uint64(PolicyGuaranteedBurstShare),
		"MGPU_POLICY_NATIVE_BURST_SHARE":     uint64(PolicyNativeBurstShare),
	}
	c := cheader.Values()
	for name, goVal := range want {
		cVal, ok := c[name]
		if !ok {
			t.Errorf("%s: not in the C table", name)
			continue
		}
		if cVal != goVal {
			t.Errorf("%s: C has %d, Go has %d", name, cVal, goVal)
		}
	}
	// Every region/proc entry of the C table must be checked here.
	for name := range c {
		if _, ok := want[name]; !ok && (hasPrefix(name, "mgpu_proc_t.") || hasPrefix(name, "mgpu_region_t.") ||
			hasPrefix(name, "MGPU_REGION_") || hasPrefix(name, "MGPU_POLICY_")) {
			t.Errorf("%s: in the C table but not checked against Go", name)
		}
	}
	if HeaderSize != unsafe.Offsetof(l.Procs) || ProcSize != unsafe.Sizeof(p) {
		t.Errorf("HeaderSize/ProcSize constants disagree with the structs")
	}
}

func hasPrefix(s, p string) bool { return len(s) >= len(p) && s[:len(p)] == p }
