package region

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
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

// Region is one mapped region: its control file and its proc files.
type Region struct {
	dir   string
	ctl   []byte
	l     *Layout
	procs [MaxProcs][]byte
	c     [MaxProcs]*Counters
}

// Proc is slot i of a region: its owner (control file) and its counters
// (the slot's proc file).
type Proc struct {
	*Slot
	*Counters
}

// ErrInvalid is returned (wrapped) by Open for a directory that is not a
// valid region.
var ErrInvalid = errors.New("not a valid mgpu region")

// ControlName is the name of the control file in a region directory.
const ControlName = "control"

// ProcName returns the name of slot i's proc file in a region directory.
func ProcName(i int) string { return fmt.Sprintf("proc.%03d", i) }

// Create makes a new region directory at dir (mode 0700; it must not
// exist) with its control file filled from p and MaxProcs zeroed proc
// files (all 0600), and maps them.
func Create(dir string, p Params) (*Region, error) {
	r, err := CreateBlank(dir)
	if err != nil {
		return nil, err
	}
	r.fill(p)
	return r, nil
}

// CreateBlank makes a region directory at dir (mode 0700; it must not
// exist) with all its files, zeroed and mapped, but no header: no reader
// takes it for a region until Install moves it into place and writes one.
// Making the 129 files is what a create costs (3-9 ms here); an enforcer
// makes a blank region ahead of time so that the create a container start
// waits for is a rename.
func CreateBlank(dir string) (*Region, error) {
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create region: %w", err)
	}
	r, err := create(dir)
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("create region %q: %w", dir, err)
	}
	return r, nil
}

// Install renames a blank region (CreateBlank) to dir, which must not
// exist or be an empty directory, and writes its header from p. On error
// the region stays blank where it was.
func (r *Region) Install(dir string, p Params) error {
	if r.l.Magic != 0 {
		return fmt.Errorf("install region %q: %s already has a header", dir, r.dir)
	}
	if err := os.Rename(r.dir, dir); err != nil {
		return fmt.Errorf("install region: %w", err)
	}
	r.dir = dir
	r.fill(p)
	return nil
}

func create(dir string) (*Region, error) {
	// Each file is created, sized and mapped through one descriptor,
	// opened relative to the directory: opening each of the 129 files
	// twice through os.OpenFile cost 8 ms here.
	dfd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", dir, err)
	}
	defer func() { _ = unix.Close(dfd) }()
	r := &Region{dir: dir}
	for i := range MaxProcs {
		if r.procs[i], err = makeMapped(dfd, ProcName(i), ProcFileSize); err != nil {
			_ = r.Close()
			return nil, err
		}
		r.c[i] = (*Counters)(unsafe.Pointer(&r.procs[i][0]))
	}
	if r.ctl, err = makeMapped(dfd, ControlName, ControlFileSize); err != nil {
		_ = r.Close()
		return nil, err
	}
	r.l = (*Layout)(unsafe.Pointer(&r.ctl[0]))
	return r, nil
}

// fill writes the header of a blank region, magic last. Processes map the
// same pages, so a store is visible at once; the files live in the run
// directory (tmpfs on a node), so nothing is written back.
func (r *Region) fill(p Params) {
	l := r.l
	l.Version = Version
	l.Size = ControlFileSize
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
}

// makeMapped creates name in the directory dfd (0600, it must not exist),
// sizes it and maps it shared.
func makeMapped(dfd int, name string, size int) ([]byte, error) {
	fd, err := unix.Openat(dfd, name, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", name, err)
	}
	defer func() { _ = unix.Close(fd) }()
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		return nil, fmt.Errorf("size %s: %w", name, err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %s: %w", name, err)
	}
	return mem, nil
}

// Open maps an existing region directory and checks its header.
func Open(dir string) (*Region, error) {
	for i := -1; i < MaxProcs; i++ {
		name, size := ControlName, int64(ControlFileSize)
		if i >= 0 {
			name, size = ProcName(i), ProcFileSize
		}
		st, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			if i < 0 && !errors.Is(err, os.ErrNotExist) {
				return nil, fmt.Errorf("open region: %w", err)
			}
			if errors.Is(err, os.ErrNotExist) {
				if _, derr := os.Stat(dir); derr != nil {
					return nil, fmt.Errorf("open region: %w", derr)
				}
				return nil, fmt.Errorf("open region %q: %w: %s is missing", dir, ErrInvalid, name)
			}
			return nil, fmt.Errorf("open region: %w", err)
		}
		if !st.Mode().IsRegular() || st.Size() != size {
			return nil, fmt.Errorf("open region %q: %w: %s has size %d, want %d", dir, ErrInvalid, name, st.Size(), size)
		}
	}
	r, err := mapDir(dir)
	if err != nil {
		return nil, fmt.Errorf("open region %q: %w", dir, err)
	}
	if err := r.check(); err != nil {
		_ = r.Close()
		return nil, fmt.Errorf("open region %q: %w", dir, err)
	}
	return r, nil
}

// Remove deletes a region directory and its files (the mappings of
// processes that still have them stay valid).
func Remove(dir string) error { return os.RemoveAll(dir) }

func (r *Region) check() error {
	l := r.l
	switch {
	case l.Magic != Magic:
		return fmt.Errorf("%w: magic %#x, want %#x", ErrInvalid, l.Magic, Magic)
	case l.Version != Version:
		return fmt.Errorf("%w: version %d, want %d", ErrInvalid, l.Version, Version)
	case l.Size != ControlFileSize:
		return fmt.Errorf("%w: size field %d, want %d", ErrInvalid, l.Size, ControlFileSize)
	case l.MaxProcs != MaxProcs:
		return fmt.Errorf("%w: max_procs %d, want %d", ErrInvalid, l.MaxProcs, MaxProcs)
	}
	return nil
}

func mapDir(dir string) (*Region, error) {
	r := &Region{dir: dir}
	var err error
	if r.ctl, err = mapFile(filepath.Join(dir, ControlName), ControlFileSize); err != nil {
		return nil, err
	}
	r.l = (*Layout)(unsafe.Pointer(&r.ctl[0]))
	for i := range MaxProcs {
		if r.procs[i], err = mapFile(filepath.Join(dir, ProcName(i)), ProcFileSize); err != nil {
			_ = r.Close()
			return nil, err
		}
		r.c[i] = (*Counters)(unsafe.Pointer(&r.procs[i][0]))
	}
	return r, nil
}

func mapFile(path string, size int) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0) //nolint:gosec // the enforcer's own run directory
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	mem, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED) //nolint:gosec // fds fit in int
	if err != nil {
		return nil, fmt.Errorf("mmap %s: %w", filepath.Base(path), err)
	}
	return mem, nil
}

// Dir returns the region's directory.
func (r *Region) Dir() string { return r.dir }

// L returns the mapped control file. It is valid until Close.
func (r *Region) L() *Layout { return r.l }

// Proc returns slot i (0 <= i < MaxProcs).
func (r *Region) Proc(i int) Proc { return Proc{Slot: &r.l.Slots[i], Counters: r.c[i]} }

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

// Intact reports whether every proc file still has its size. A process
// holds a writable descriptor of its own proc file, so it can truncate it
// (the enforcer's next access beyond the new end faults, SIGBUS) or grow
// it. The control file is never writable by a process.
func (r *Region) Intact() bool {
	for i := range MaxProcs {
		if !r.ProcIntact(i) {
			return false
		}
	}
	return true
}

// ProcIntact reports whether slot i's proc file still has its size.
func (r *Region) ProcIntact(i int) bool {
	st, err := os.Stat(filepath.Join(r.dir, ProcName(i)))
	return err == nil && st.Size() == ProcFileSize
}

// Repair restores the size of every proc file (a truncated part reads as
// zeros; a grown part is freed).
func (r *Region) Repair() error {
	var errs []error
	for i := range MaxProcs {
		if !r.ProcIntact(i) {
			errs = append(errs, os.Truncate(filepath.Join(r.dir, ProcName(i)), ProcFileSize))
		}
	}
	return errors.Join(errs...)
}

// Close unmaps the region. Its files stay.
func (r *Region) Close() error {
	var errs []error
	for i := range r.procs {
		if r.procs[i] != nil {
			errs = append(errs, unix.Munmap(r.procs[i]))
			r.procs[i], r.c[i] = nil, nil
		}
	}
	if r.ctl != nil {
		errs = append(errs, unix.Munmap(r.ctl))
		r.ctl, r.l = nil, nil
	}
	return errors.Join(errs...)
}

// Clear frees slot p: it zeroes the counters, then the start time, then the
// pid (last, so a slot with a pid always has its start time).
func (p Proc) Clear() {
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
func (p Proc) Claim(pid uint32, startTime uint64) {
	p.StartTime.Store(startTime)
	p.PID.Store(pid)
}
