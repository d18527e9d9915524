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

// Region is one mapped region: its control file and its slots' memfds.
//
// A slot gets its memfd when a process first attaches to it (Prepare, from
// TenantFDs) and keeps it for the region's life, so that the processes'
// mappings of it never go stale; a restarted enforcer finds the memfds
// again in the processes that hold them (Recover). A slot that never had a
// process, or whose memfd nobody held any more across a restart, has none.
type Region struct {
	dir   string
	ctl   []byte
	l     *Layout
	procs [MaxProcs][]byte
	c     [MaxProcs]*Counters
	// fds are the slots' memfds, kept to hand out (TenantFDs, PeerFDs);
	// -1 for a slot that has none.
	fds [MaxProcs]int
	// ro are read-only descriptions of the slots' memfds, made the first
	// time a peer asks (PeerFDs) and kept while the memfd is; -1 for none.
	ro [MaxProcs]int
}

// Proc is slot i of a region: its owner (control file) and its counters
// (the slot's memfd; nil while the slot has none).
type Proc struct {
	*Slot
	*Counters
}

// ErrInvalid is returned (wrapped) by Open for a directory that is not a
// valid region.
var ErrInvalid = errors.New("not a valid mgpu region")

// ControlName is the name of the control file in a region directory.
const ControlName = "control"

// procName is slot i's memfd's name (what /proc/<pid>/maps and fd show).
func procName(i int) string { return fmt.Sprintf("%s%03d", procPrefix, i) }

const procPrefix = "mgpu-proc."

// sealed are the seals of every slot's memfd: it can neither shrink (the
// mappings of the enforcer and the other processes would fault beyond the
// new end) nor grow (host memory), and takes no further seal.
const sealed = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL

func newRegion(dir string) *Region {
	r := &Region{dir: dir}
	for i := range r.fds {
		r.fds[i], r.ro[i] = -1, -1
	}
	return r
}

// Create makes a new region directory at dir (mode 0700; it must not
// exist) with its control file (0600) filled from p, and maps it.
func Create(dir string, p Params) (*Region, error) {
	r, err := CreateBlank(dir)
	if err != nil {
		return nil, err
	}
	r.fill(p)
	return r, nil
}

// CreateBlank makes a region directory at dir (mode 0700; it must not
// exist) with its control file, zeroed and mapped, but no header: no
// reader takes it for a region until Install moves it into place and
// writes one. An enforcer makes a blank region ahead of time so that the
// create a container start waits for is a rename.
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
	r := newRegion(dir)
	var err error
	if r.ctl, err = makeControl(filepath.Join(dir, ControlName)); err != nil {
		return nil, err
	}
	r.l = (*Layout)(unsafe.Pointer(&r.ctl[0]))
	return r, nil
}

// fill writes the header of a blank region, magic last. Processes map the
// same pages, so a store is visible at once; the control file lives in the
// run directory (tmpfs on a node), so nothing is written back.
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

// makeControl creates the control file at path (0600, it must not exist),
// sizes it and maps it shared.
func makeControl(path string) ([]byte, error) {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", ControlName, err)
	}
	defer func() { _ = unix.Close(fd) }()
	if err := unix.Ftruncate(fd, ControlFileSize); err != nil {
		return nil, fmt.Errorf("size %s: %w", ControlName, err)
	}
	mem, err := unix.Mmap(fd, 0, ControlFileSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %s: %w", ControlName, err)
	}
	return mem, nil
}

// Prepare gives slot i a memfd, zeroed and mapped, unless it has one, and
// records its identity in the control file (Slot.ProcDev, ProcIno).
func (r *Region) Prepare(i int) error {
	if r.fds[i] >= 0 {
		return nil
	}
	fd, err := newMemfd(procName(i))
	if err != nil {
		return err
	}
	var st unix.Stat_t
	err = unix.Fstat(fd, &st)
	if err == nil {
		err = r.mapProc(i, fd)
	}
	if err != nil {
		_ = unix.Close(fd)
		return fmt.Errorf("%s: %w", procName(i), err)
	}
	s := &r.l.Slots[i]
	s.ProcDev.Store(st.Dev)
	s.ProcIno.Store(st.Ino)
	return nil
}

// newMemfd makes a slot's memfd: ProcFileSize bytes, mode 0600, its page
// allocated now (so that no access needs one later), then sealed.
func newMemfd(name string) (int, error) {
	const flags = unix.MFD_CLOEXEC | unix.MFD_ALLOW_SEALING
	fd, err := unix.MemfdCreate(name, flags|unix.MFD_NOEXEC_SEAL)
	if errors.Is(err, unix.EINVAL) { // before Linux 6.3
		fd, err = unix.MemfdCreate(name, flags)
	}
	if err != nil {
		return -1, fmt.Errorf("memfd_create %s: %w", name, err)
	}
	err = unix.Ftruncate(fd, ProcFileSize)
	if err == nil {
		err = unix.Fallocate(fd, 0, 0, ProcFileSize)
	}
	if err == nil {
		// A memfd is 0777 (0666 with MFD_NOEXEC_SEAL): 0600 keeps a
		// process without CAP_DAC_OVERRIDE over the enforcer's files from
		// reopening a read-only descriptor of it for writing.
		err = unix.Fchmod(fd, 0o600)
	}
	if err == nil {
		_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, sealed)
	}
	if err != nil {
		_ = unix.Close(fd)
		return -1, fmt.Errorf("make %s: %w", name, err)
	}
	return fd, nil
}

// checkMemfd checks that fd is a slot's memfd as newMemfd makes it:
// sealed against shrinking, growing and further seals, writable, of
// ProcFileSize bytes. The seals are read first: once they hold, the size
// cannot change.
func checkMemfd(fd int) (unix.Stat_t, error) {
	var st unix.Stat_t
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return st, fmt.Errorf("%w: not a sealable memfd: %w", ErrInvalid, err)
	}
	if seals&sealed != sealed || seals&(unix.F_SEAL_WRITE|unix.F_SEAL_FUTURE_WRITE) != 0 {
		return st, fmt.Errorf("%w: memfd seals %#x, want %#x and no write seal", ErrInvalid, seals, sealed)
	}
	if err := unix.Fstat(fd, &st); err != nil {
		return st, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size != ProcFileSize {
		return st, fmt.Errorf("%w: memfd of mode %#o and size %d, want a regular file of %d bytes", ErrInvalid, st.Mode, st.Size, ProcFileSize)
	}
	return st, nil
}

// mapProc maps fd (checked by checkMemfd) as slot i's memory; the region
// keeps fd.
func (r *Region) mapProc(i, fd int) error {
	mem, err := unix.Mmap(fd, 0, ProcFileSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("mmap: %w", err)
	}
	r.procs[i], r.c[i], r.fds[i] = mem, (*Counters)(unsafe.Pointer(&mem[0])), fd
	return nil
}

// dropProc unmaps slot i's memory and closes its memfd.
func (r *Region) dropProc(i int) error {
	if r.fds[i] < 0 {
		return nil
	}
	err := errors.Join(unix.Munmap(r.procs[i]), unix.Close(r.fds[i]))
	if r.ro[i] >= 0 {
		err = errors.Join(err, unix.Close(r.ro[i]))
	}
	r.procs[i], r.c[i], r.fds[i], r.ro[i] = nil, nil, -1, -1
	return err
}

// Open maps an existing region's control file and checks its header. Its
// slots have no memory yet: the memfds died with the enforcer that made
// them, and live on only in the processes that hold them, where Recover
// finds them.
func Open(dir string) (*Region, error) {
	path := filepath.Join(dir, ControlName)
	st, err := os.Stat(path)
	if errors.Is(err, os.ErrNotExist) {
		if _, derr := os.Stat(dir); derr != nil {
			return nil, fmt.Errorf("open region: %w", derr)
		}
		return nil, fmt.Errorf("open region %q: %w: %s is missing", dir, ErrInvalid, ControlName)
	}
	if err != nil {
		return nil, fmt.Errorf("open region: %w", err)
	}
	if !st.Mode().IsRegular() || st.Size() != ControlFileSize {
		return nil, fmt.Errorf("open region %q: %w: %s has size %d, want %d", dir, ErrInvalid, ControlName, st.Size(), ControlFileSize)
	}
	r := newRegion(dir)
	if r.ctl, err = mapFile(path, ControlFileSize); err != nil {
		return nil, fmt.Errorf("open region %q: %w", dir, err)
	}
	r.l = (*Layout)(unsafe.Pointer(&r.ctl[0]))
	if err := r.check(); err != nil {
		_ = r.Close()
		return nil, fmt.Errorf("open region %q: %w", dir, err)
	}
	return r, nil
}

// Remove deletes a region directory and its control file (the mappings of
// processes that still have them stay valid).
func Remove(dir string) error { return os.RemoveAll(dir) }

func (r *Region) check() error {
	l := r.l
	switch {
	case l.Magic != Magic:
		return fmt.Errorf("%w: magic %#x, want %#x", ErrInvalid, l.Magic, Magic)
	case l.Version != Version && l.Version != versionNoUsed:
		return fmt.Errorf("%w: version %d, want %d", ErrInvalid, l.Version, Version)
	case l.Size != ControlFileSize:
		return fmt.Errorf("%w: size field %d, want %d", ErrInvalid, l.Size, ControlFileSize)
	case l.MaxProcs != MaxProcs:
		return fmt.Errorf("%w: max_procs %d, want %d", ErrInvalid, l.MaxProcs, MaxProcs)
	}
	return nil
}

// versionNoUsed is the layout before Layout.Used (the same but for it,
// zero there). Open accepts it; Upgrade makes it the current one.
const versionNoUsed = 3

// Upgrade makes a region opened in an earlier layout version the current
// one, once the caller has published its taken slots (SetUsed): the shim
// of a process attached before saw the version at its attach only.
func (r *Region) Upgrade() {
	(*atomic.Uint32)(unsafe.Pointer(&r.l.Version)).Store(Version)
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

// Proc returns slot i (0 <= i < MaxProcs). Its Counters are nil while the
// slot has no memfd.
func (r *Region) Proc(i int) Proc { return Proc{Slot: &r.l.Slots[i], Counters: r.c[i]} }

// SlotAt returns the slot whose counters' mapping holds addr.
func (r *Region) SlotAt(addr uintptr) (int, bool) {
	for i, m := range r.procs {
		if m != nil && addr-uintptr(unsafe.Pointer(&m[0])) < uintptr(len(m)) {
			return i, true
		}
	}
	return 0, false
}

// Params reads the identity and quotas from the header.
func (r *Region) Params() Params {
	l := r.l
	return Params{
		DeviceIndex: l.DeviceIndex, InstanceID: l.InstanceID, Policy: l.Policy, Core: l.Core,
		MemoryLimit: l.MemoryLimit, PeriodNs: l.PeriodNs, MaxQueuedNs: l.MaxQueuedNs,
	}
}

// SetUsed publishes the set of taken slots (Layout.Used), as the caller
// keeps it: a slot's bit must be set after Claim and cleared after Clear.
func (r *Region) SetUsed(used [MaxProcs / 64]uint64) {
	for w, v := range used {
		r.l.Used[w].Store(v)
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

// Wake issues FUTEX_WAKE (not private) for all waiters on the word. It
// never blocks, so it is a raw system call: an ordinary one tells the
// runtime it may block, which wakes the runtime's sysmon thread when it
// sleeps (every idle P), a context switch for each grant the loop writes.
func Wake(w *atomic.Uint32) {
	_, _, _ = unix.RawSyscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(w)), futexWake, math.MaxInt32, 0, 0, 0)
}

const futexWake = 1 // FUTEX_WAKE, without FUTEX_PRIVATE_FLAG

// Close unmaps the region and closes its memfds. The control file stays;
// a memfd lives on while a process holds it.
func (r *Region) Close() error {
	var errs []error
	for i := range r.procs {
		errs = append(errs, r.dropProc(i))
	}
	if r.ctl != nil {
		errs = append(errs, unix.Munmap(r.ctl))
		r.ctl, r.l = nil, nil
	}
	return errors.Join(errs...)
}

// Clear frees slot p: it zeroes the counters (a slot without memory has
// none), then the start time, then the pid (last, so a slot with a pid
// always has its start time).
func (p Proc) Clear() {
	if c := p.Counters; c != nil {
		c.Waiting.Store(0)
		c.MemReserved.Store(0)
		c.MemAhead.Store(0)
		c.GPUNs.Store(0)
		c.QueuedNs.Store(0)
		c.Launches.Store(0)
		c.ThrottledNs.Store(0)
	}
	p.StartTime.Store(0)
	p.PID.Store(0)
}

// Claim assigns a free slot to a process: start time first, then pid.
func (p Proc) Claim(pid uint32, startTime uint64) {
	p.StartTime.Store(startTime)
	p.PID.Store(pid)
}
