// Package region mirrors the per-instance shared region of
// enforcer/shim/include/mgpu_region.h in Go: the layout (as Go structs whose
// offsets a test checks against the C header), creating and opening a
// region (its control file and its slots' sealed memfds), mapping them,
// finding a slot's memfd again in the processes that hold it after an
// enforcer restart, handing descriptors to a process (read-only where the
// process must not write), atomic access to their shared words, and waking
// the futex waiters of the grant word.
package region

import (
	"sync/atomic"
	"unsafe"
)

// Constants of mgpu_region.h.
const (
	Magic           uint32 = 0x5550474d // MGPU_REGION_MAGIC, "MGPU" little-endian
	Version         uint32 = 4          // MGPU_REGION_VERSION
	MaxProcs               = 128        // MGPU_REGION_MAX_PROCS
	ControlFileSize        = 8192       // MGPU_CONTROL_FILE_SIZE, bytes
	ProcFileSize           = 4096       // MGPU_PROC_FILE_SIZE, bytes

	HeaderSize = 256 // bytes of the control file before slots[0]
	SlotSize   = 32  // sizeof(mgpu_slot_t)
	ProcSize   = 64  // sizeof(mgpu_proc_t)
)

// Policy codes (MGPU_POLICY_*), equal to policy.Policy values.
const (
	PolicyFixedShare           uint32 = 0
	PolicyGuaranteedBurstShare uint32 = 1
	PolicyNativeBurstShare     uint32 = 2
)

// Grant values (MGPU_GRANT_*) of Layout.Grant other than 0 (wait).
const (
	GrantAll uint32 = 1 // granted
	GrantOne uint32 = 2 // granted, at most one launch outstanding per stream
)

// Wake bits (MGPU_WAKE_*) of Layout.Wake.
const (
	WakeBusy uint32 = 1
	WakeIdle uint32 = 2
)

// Slot mirrors mgpu_slot_t: the owner of a process slot and the identity
// of the slot's memfd, in the control file, written by the enforcer only.
type Slot struct {
	PID       atomic.Uint32 // host pid owning the slot; 0 = free
	Reserved  uint32
	StartTime atomic.Uint64 // /proc/<pid>/stat starttime (clock ticks), written before PID
	// ProcDev and ProcIno are the st_dev and st_ino of the slot's proc
	// memfd: how a restarted enforcer recognises it among the mappings and
	// descriptors of the instance's processes (Recover).
	ProcDev atomic.Uint64
	ProcIno atomic.Uint64
}

// Counters mirrors mgpu_proc_t: what one attached process reports, in its
// own proc memfd. Every value is untrusted input.
type Counters struct {
	Waiting     atomic.Uint32 // threads blocked on the grant
	Reserved32  uint32
	MemReserved atomic.Uint64 // device bytes held
	GPUNs       atomic.Uint64 // cumulative measured GPU time
	QueuedNs    atomic.Uint64 // submitted GPU time not yet known complete
	Launches    atomic.Uint64 // cumulative gated launches
	ThrottledNs atomic.Uint64 // cumulative time threads waited for a grant
	IdleNs      atomic.Uint64 // CLOCK_MONOTONIC when QueuedNs last fell to 0 (0: never)
	MemAhead    atomic.Uint64 // of MemReserved, reserved ahead of the process's allocations
}

// Layout mirrors mgpu_control_t, the control file.
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
	Contended atomic.Uint32
	// Wake says when the enforcer wants the processes to wake it at once
	// (WakeBusy, WakeIdle; see mgpu_region.h).
	Wake atomic.Uint32
	// Used mirrors the enforcer's set of taken slots (bit i%64 of
	// Used[i/64] for slot i): what the shim sums memory reservations over.
	// A bit is set after the slot's owner is written, cleared after its
	// counters are.
	Used        [MaxProcs / 64]atomic.Uint64
	ReservedCtl [3]uint64

	ReservedTail [16]uint64

	Slots [MaxProcs]Slot
}

// Compile-time checks of the sizes the header asserts; the offsets of every
// field are checked against the C header by layout_cgo_test.go.
var (
	_ [ProcSize - unsafe.Sizeof(Counters{})]byte
	_ [unsafe.Sizeof(Counters{}) - ProcSize]byte
	_ [SlotSize - unsafe.Sizeof(Slot{})]byte
	_ [unsafe.Sizeof(Slot{}) - SlotSize]byte
	_ [HeaderSize + SlotSize*MaxProcs - unsafe.Sizeof(Layout{})]byte
	_ [unsafe.Sizeof(Layout{}) - (HeaderSize + SlotSize*MaxProcs)]byte
	_ [ControlFileSize - unsafe.Sizeof(Layout{})]byte
	_ [ProcFileSize - unsafe.Sizeof(Counters{})]byte
)
