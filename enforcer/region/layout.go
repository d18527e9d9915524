// Package region mirrors the per-instance shared region of
// enforcer/shim/include/mgpu_region.h in Go: the layout (as Go structs whose
// offsets a test checks against the C header), creating and opening region
// files, mapping them, atomic access to their shared words, and waking the
// futex waiters of the grant word.
package region

import (
	"sync/atomic"
	"unsafe"
)

// Constants of mgpu_region.h.
const (
	Magic    uint32 = 0x5550474d // MGPU_REGION_MAGIC, "MGPU" little-endian
	Version  uint32 = 1          // MGPU_REGION_VERSION
	MaxProcs        = 128        // MGPU_REGION_MAX_PROCS
	FileSize        = 12288      // MGPU_REGION_FILE_SIZE, bytes

	HeaderSize = 256 // bytes before procs[0]
	ProcSize   = 64  // sizeof(mgpu_proc_t)
)

// Policy codes (MGPU_POLICY_*), equal to policy.Policy values.
const (
	PolicyFixedShare           uint32 = 0
	PolicyGuaranteedBurstShare uint32 = 1
	PolicyNativeBurstShare     uint32 = 2
)

// Proc mirrors mgpu_proc_t: one attached process. The enforcer writes PID
// and StartTime; the shim writes the counters of its own slot only.
type Proc struct {
	PID         atomic.Uint32 // host pid owning the slot; 0 = free
	Waiting     atomic.Uint32 // threads blocked on the grant
	MemReserved atomic.Uint64 // device bytes held
	GPUNs       atomic.Uint64 // cumulative measured GPU time
	QueuedNs    atomic.Uint64 // submitted GPU time not yet known complete
	Launches    atomic.Uint64 // cumulative gated launches
	ThrottledNs atomic.Uint64 // cumulative time threads waited for a grant
	StartTime   atomic.Uint64 // /proc/<pid>/stat starttime (clock ticks); plain in C, written before PID
	Reserved    uint64
}

// Layout mirrors mgpu_region_t.
type Layout struct {
	// Identity and quotas: written before the region is handed out.
	Magic       uint32
	Version     uint32
	Size        uint32
	MaxProcs    uint32
	DeviceIndex uint32
	InstanceID  uint32
	Policy      uint32
	Core        uint32
	MemoryLimit uint64 // bytes
	PeriodNs    uint64
	MaxQueuedNs uint64
	ReservedHdr uint64

	// Control: written by the enforcer.
	Grant         atomic.Uint32 // futex word: 0 = wait, otherwise granted
	EnforcerEpoch atomic.Uint32 // bumped by every enforcer start that adopts the region
	HeartbeatNs   atomic.Uint64 // CLOCK_MONOTONIC of the last arbitration tick
	// Contended is 1 while another instance of the device may have work on
	// the GPU (it holds the grant or has not reported its queue drained):
	// the shim then charges batches by its clean per-launch estimate.
	Contended     atomic.Uint32
	ReservedCtl32 uint32
	ReservedCtl   [5]uint64

	ReservedTail [16]uint64

	Procs [MaxProcs]Proc
}

// Compile-time checks of the sizes the header asserts; the offsets of every
// field are checked against the C header by layout_cgo_test.go.
var (
	_ [ProcSize - unsafe.Sizeof(Proc{})]byte
	_ [unsafe.Sizeof(Proc{}) - ProcSize]byte
	_ [HeaderSize + ProcSize*MaxProcs - unsafe.Sizeof(Layout{})]byte
	_ [unsafe.Sizeof(Layout{}) - (HeaderSize + ProcSize*MaxProcs)]byte
	_ [FileSize - unsafe.Sizeof(Layout{})]byte
)
