package region

import (
	"errors"
	"fmt"
	"math"
	"os"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Params are the identity and quotas written into a new region's header.
type Params struct {
	DeviceIndex uint32
	InstanceID  uint32
	Policy      uint32 // MGPU_POLICY_*
	Core        uint32 // 1..100
	MemoryLimit uint64 // bytes
	PeriodNs    uint64
	MaxQueuedNs uint64
}

// Region is one mapped region file.
type Region struct {
	f   *os.File
	mem []byte
	l   *Layout
}

// ErrInvalid is returned (wrapped) by Open for a file that is not a valid
// region.
var ErrInvalid = errors.New("not a valid mgpu region")

// Create makes a new region file at path (mode 0600; it must not exist),
// sized to FileSize, with its header filled from p, and maps it.
func Create(path string, p Params) (*Region, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600) //nolint:gosec // the enforcer's own run directory
	if err != nil {
		return nil, fmt.Errorf("create region: %w", err)
	}
	if err := f.Truncate(FileSize); err != nil {
		_ = f.Close()
		_ = os.Remove(path)
		return nil, fmt.Errorf("create region %q: %w", path, err)
	}
	r, err := mapFile(f)
	if err != nil {
		_ = f.Close()
		_ = os.Remove(path)
		return nil, fmt.Errorf("create region %q: %w", path, err)
	}
	l := r.l
	l.Version = Version
	l.Size = FileSize
	l.MaxProcs = MaxProcs
	l.DeviceIndex = p.DeviceIndex
	l.InstanceID = p.InstanceID
	l.Policy = p.Policy
	l.Core = p.Core
	l.MemoryLimit = p.MemoryLimit
	l.PeriodNs = p.PeriodNs
	l.MaxQueuedNs = p.MaxQueuedNs
	// Magic last: a reader that sees it sees a complete header.
	atomic.StoreUint32(&l.Magic, Magic)
	if err := f.Sync(); err != nil {
		_ = r.Close()
		_ = os.Remove(path)
		return nil, fmt.Errorf("create region %q: %w", path, err)
	}
	return r, nil
}

// Open maps an existing region file and checks its header.
func Open(path string) (*Region, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0) //nolint:gosec // the enforcer's own run directory
	if err != nil {
		return nil, fmt.Errorf("open region: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("open region %q: %w", path, err)
	}
	if st.Size() != FileSize {
		_ = f.Close()
		return nil, fmt.Errorf("open region %q: %w: size %d, want %d", path, ErrInvalid, st.Size(), FileSize)
	}
	r, err := mapFile(f)
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("open region %q: %w", path, err)
	}
	if err := r.check(); err != nil {
		_ = r.Close()
		return nil, fmt.Errorf("open region %q: %w", path, err)
	}
	return r, nil
}

func (r *Region) check() error {
	l := r.l
	switch {
	case l.Magic != Magic:
		return fmt.Errorf("%w: magic %#x, want %#x", ErrInvalid, l.Magic, Magic)
	case l.Version != Version:
		return fmt.Errorf("%w: version %d, want %d", ErrInvalid, l.Version, Version)
	case l.Size != FileSize:
		return fmt.Errorf("%w: size field %d, want %d", ErrInvalid, l.Size, FileSize)
	case l.MaxProcs != MaxProcs:
		return fmt.Errorf("%w: max_procs %d, want %d", ErrInvalid, l.MaxProcs, MaxProcs)
	}
	return nil
}

func mapFile(f *os.File) (*Region, error) {
	mem, err := unix.Mmap(int(f.Fd()), 0, FileSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED) //nolint:gosec // fds fit in int
	if err != nil {
		return nil, fmt.Errorf("mmap: %w", err)
	}
	return &Region{f: f, mem: mem, l: (*Layout)(unsafe.Pointer(&mem[0]))}, nil
}

// L returns the mapped layout. It is valid until Close.
func (r *Region) L() *Layout { return r.l }

// Proc returns slot i (0 <= i < MaxProcs).
func (r *Region) Proc(i int) *Proc { return &r.l.Procs[i] }

// File returns the open region file, e.g. to pass its descriptor to a client.
func (r *Region) File() *os.File { return r.f }

// Params reads the identity and quotas from the header.
func (r *Region) Params() Params {
	l := r.l
	return Params{
		DeviceIndex: l.DeviceIndex, InstanceID: l.InstanceID, Policy: l.Policy, Core: l.Core,
		MemoryLimit: l.MemoryLimit, PeriodNs: l.PeriodNs, MaxQueuedNs: l.MaxQueuedNs,
	}
}

// SetGrant stores the grant word and wakes its waiters when it becomes
// nonzero. It reports whether the value changed.
func (r *Region) SetGrant(v uint32) bool {
	if r.l.Grant.Swap(v) == v {
		return false
	}
	if v != 0 {
		r.Wake()
	}
	return true
}

// Wake wakes every thread waiting on the grant word (FUTEX_WAKE, INT_MAX,
// shared futex: the waiters live in other processes).
func (r *Region) Wake() {
	Wake(&r.l.Grant)
}

// Wake issues FUTEX_WAKE (not private) for all waiters on the word.
func Wake(w *atomic.Uint32) {
	_, _, _ = unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(w)), futexWake, math.MaxInt32, 0, 0, 0)
}

const futexWake = 1 // FUTEX_WAKE, without FUTEX_PRIVATE_FLAG

// Intact reports whether the file still has its full size. A process that
// holds the (writable) descriptor can truncate it; accessing the mapping
// beyond the new end then faults (SIGBUS).
func (r *Region) Intact() bool {
	st, err := r.f.Stat()
	return err == nil && st.Size() == FileSize
}

// Repair restores the file's size, so that the mapping is valid again (the
// truncated part reads as zeros).
func (r *Region) Repair() error {
	return r.f.Truncate(FileSize)
}

// Close unmaps the region and closes its file. The file stays.
func (r *Region) Close() error {
	if r.mem == nil {
		return nil
	}
	err := unix.Munmap(r.mem)
	r.mem, r.l = nil, nil
	if cerr := r.f.Close(); err == nil {
		err = cerr
	}
	return err
}

// Clear frees slot p: it zeroes the counters, then the start time, then the
// pid (last, so a slot with a pid always has its start time).
func (p *Proc) Clear() {
	p.Waiting.Store(0)
	p.MemReserved.Store(0)
	p.GPUNs.Store(0)
	p.QueuedNs.Store(0)
	p.Launches.Store(0)
	p.ThrottledNs.Store(0)
	p.StartTime.Store(0)
	p.PID.Store(0)
}

// Claim assigns a free slot to a process: start time first, then pid.
func (p *Proc) Claim(pid uint32, startTime uint64) {
	p.StartTime.Store(startTime)
	p.PID.Store(pid)
}
