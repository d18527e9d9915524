package region

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

func testParams() Params {
	return Params{DeviceIndex: 1, InstanceID: 7, Policy: PolicyGuaranteedBurstShare, Core: 30,
		MemoryLimit: 4096 << 20, PeriodNs: 100e6, MaxQueuedNs: 5e6}
}

func TestCreateOpen(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "mgpu1inst7")
	r, err := Create(dir, testParams())
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	for name, want := range map[string]int64{"": -1, ControlName: ControlFileSize} {
		st, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if want < 0 {
			if !st.IsDir() || st.Mode().Perm() != 0o700 {
				t.Fatalf("region dir mode %v, want a 0700 directory", st.Mode())
			}
			continue
		}
		if st.Size() != want || st.Mode().Perm() != 0o600 {
			t.Fatalf("%s: size %d mode %v, want %d 0600", name, st.Size(), st.Mode().Perm(), want)
		}
	}
	// The slots are memfds, in no directory.
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Fatalf("%d files in the region, want the control file only", len(ents))
	}
	l := r.L()
	if l.Magic != Magic || l.Version != Version || l.Size != ControlFileSize || l.MaxProcs != MaxProcs {
		t.Fatalf("header %#x %d %d %d", l.Magic, l.Version, l.Size, l.MaxProcs)
	}
	if got := r.Params(); got != testParams() {
		t.Fatalf("params %+v, want %+v", got, testParams())
	}
	// A slot gets its memfd when a process first attaches to it.
	if r.Proc(0).Counters != nil || l.Slots[0].ProcIno.Load() != 0 {
		t.Fatal("slot 0 has memory before any process attached to it")
	}
	inos := map[uint64]bool{}
	for i := range MaxProcs {
		if err := r.Prepare(i); err != nil {
			t.Fatal(err)
		}
		s := &l.Slots[i]
		var st unix.Stat_t
		if err := unix.Fstat(r.fds[i], &st); err != nil || st.Ino != s.ProcIno.Load() || st.Dev != s.ProcDev.Load() || inos[st.Ino] {
			t.Fatalf("slot %d: memfd %d:%d (%v), control records %d:%d", i, st.Dev, st.Ino, err, s.ProcDev.Load(), s.ProcIno.Load())
		}
		inos[st.Ino] = true
	}
	if _, err := Create(dir, testParams()); !errors.Is(err, os.ErrExist) {
		t.Fatalf("second create: %v, want ErrExist", err)
	}

	// A second mapping of the control file (as another process would
	// have) shares the words.
	r2, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	if r2.Params() != testParams() {
		t.Fatalf("reopened params %+v", r2.Params())
	}
	r.Proc(5).Claim(1234, 99)
	if p := r2.Proc(5); p.PID.Load() != 1234 || p.StartTime.Load() != 99 || p.Counters != nil {
		t.Fatalf("slot 5 in second mapping: pid %d start %d counters %p", p.PID.Load(), p.StartTime.Load(), p.Counters)
	}
	r.Proc(5).GPUNs.Add(42)
	r.Proc(5).Clear()
	if p := r.Proc(5); p.PID.Load() != 0 || p.StartTime.Load() != 0 || p.GPUNs.Load() != 0 {
		t.Fatal("cleared slot not zero")
	}
	// Raw byte offsets agree with the header's (checked against C elsewhere).
	r.L().Grant.Store(0xdeadbeef)
	r.Proc(3).MemReserved.Store(0x0102030405060708)
	raw, err := os.ReadFile(filepath.Join(dir, ControlName))
	if err != nil {
		t.Fatal(err)
	}
	if g := uint32(raw[64]) | uint32(raw[65])<<8 | uint32(raw[66])<<16 | uint32(raw[67])<<24; g != 0xdeadbeef {
		t.Fatalf("grant at byte 64 of the control file reads %#x", g)
	}
	raw = make([]byte, 16)
	if _, err := unix.Pread(r.fds[3], raw, 0); err != nil {
		t.Fatal(err)
	}
	if raw[8] != 8 || raw[15] != 1 {
		t.Fatalf("mem_reserved at byte 8 of slot 3 reads % x", raw[8:16])
	}
}

func TestOpenRejects(t *testing.T) {
	t.Parallel()
	base := t.TempDir()
	good := filepath.Join(base, "good")
	r, err := Create(good, testParams())
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	ctl, err := os.ReadFile(filepath.Join(good, ControlName))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		data   []byte
		remove bool
	}{
		{name: "empty control", data: nil},
		{name: "short control", data: ctl[:4096]},
		{name: "bad magic", data: append([]byte{0, 0, 0, 0}, ctl[4:]...)},
		{name: "version 2", data: append(append(append([]byte{}, ctl[:4]...), 2, 0, 0, 0), ctl[8:]...)},
		{name: "missing control", remove: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(base, strings.ReplaceAll(tc.name, " ", "_"))
			if r, err := Create(dir, testParams()); err != nil {
				t.Fatal(err)
			} else {
				r.Close()
			}
			p := filepath.Join(dir, ControlName)
			if tc.remove {
				if err := os.Remove(p); err != nil {
					t.Fatal(err)
				}
			} else if err := os.WriteFile(p, tc.data, 0o600); err != nil {
				t.Fatal(err)
			}
			if _, err := Open(dir); !errors.Is(err, ErrInvalid) {
				t.Fatalf("Open: %v, want ErrInvalid", err)
			}
		})
	}
	if _, err := Open(filepath.Join(base, "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing: %v", err)
	}
}

// TestOpenUpgrades opens a region of the layout before the used bitmap
// (version 3): it is accepted, and Upgrade makes it the current version
// once the taken slots are published.
func TestOpenUpgrades(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "mgpu0inst1")
	r, err := Create(dir, testParams())
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	p := filepath.Join(dir, ControlName)
	ctl, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	ctl[4] = versionNoUsed
	if err := os.WriteFile(p, ctl, 0o600); err != nil {
		t.Fatal(err)
	}
	r, err = Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if v := r.L().Version; v != versionNoUsed {
		t.Fatalf("version %d before Upgrade, want %d", v, versionNoUsed)
	}
	r.SetUsed([MaxProcs / 64]uint64{1 << 3, 1 << 1})
	r.Upgrade()
	if l := r.L(); l.Version != Version || l.Used[0].Load() != 1<<3 || l.Used[1].Load() != 1<<1 {
		t.Fatalf("version %d used %#x %#x, want %d 0x8 0x2", l.Version, l.Used[0].Load(), l.Used[1].Load(), Version)
	}
}

// TestPeerFDsShared checks that peers of a slot get duplicates of one
// read-only description of its memfd, made once (no path lookup per
// request), never of the enforcer's, and that it goes with the memfd.
func TestPeerFDsShared(t *testing.T) {
	t.Parallel()
	if os.Geteuid() != 0 {
		t.Skip("the read-only view needs root (CAP_SYS_ADMIN)")
	}
	r, v := regionAndView(t, "mgpu0inst5")
	if err := r.Prepare(2); err != nil {
		t.Fatal(err)
	}
	a, err := r.PeerFDs(v, []int{2})
	if err != nil {
		t.Fatal(err)
	}
	b, err := r.PeerFDs(v, []int{2})
	if err != nil {
		t.Fatal(err)
	}
	defer closeAll(append(a, b...))
	// File status flags belong to a description: set on one request's
	// descriptor, the other's shows them, the enforcer's does not.
	if _, err := unix.FcntlInt(uintptr(a[0]), unix.F_SETFL, unix.O_NONBLOCK); err != nil {
		t.Fatal(err)
	}
	flags := func(fd int) int {
		fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
		if err != nil {
			t.Fatal(err)
		}
		return fl
	}
	if fl := flags(b[0]); fl&unix.O_NONBLOCK == 0 || fl&unix.O_ACCMODE != unix.O_RDONLY {
		t.Fatalf("the second request's descriptor has flags %#x: not the first's read-only description", fl)
	}
	if fl := flags(r.fds[2]); fl&unix.O_NONBLOCK != 0 {
		t.Fatalf("the enforcer's memfd has flags %#x after a peer set O_NONBLOCK on its own", fl)
	}
	ro := r.ro[2]
	if err := r.dropProc(2); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.FcntlInt(uintptr(ro), unix.F_GETFD, 0); !errors.Is(err, unix.EBADF) || r.ro[2] != -1 {
		t.Fatalf("the read-only description outlived its slot's memfd (fcntl %v, ro %d)", err, r.ro[2])
	}
}

func closeAll(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}

// TestTenantFDs checks what a process receives: its control file cannot
// be made writable by any route a process has (mmap, mprotect, reopening
// /proc/self/fd/N, ftruncate), even as root; the other slots' read-only
// descriptors cannot be mapped or mprotect-ed writable, but root can reopen
// them for writing (a memfd is in no read-only mount; TestSlotSeals says
// what that leaves); its own slot is writable and shared with the
// enforcer.
func TestTenantFDs(t *testing.T) {
	t.Parallel()
	if os.Geteuid() != 0 {
		t.Skip("the read-only view needs root (CAP_SYS_ADMIN)")
	}
	r, v := regionAndView(t, "mgpu0inst3")
	const slot = 9
	if err := r.Prepare(3); err != nil { // another attached process's slot
		t.Fatal(err)
	}
	fds, err := r.TenantFDs(v, slot)
	if err != nil {
		t.Fatal(err)
	}
	peers, err := r.PeerFDs(v, []int{3, slot})
	if err != nil {
		t.Fatal(err)
	}
	fds = append(fds, peers...)
	defer func() {
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
	}()
	if len(fds) != 4 {
		t.Fatalf("%d descriptors, want 4", len(fds))
	}
	for _, tc := range []struct {
		name   string
		fd     int
		size   int
		reopen error // of /proc/self/fd/N for writing, as root
	}{
		{"control", fds[0], ControlFileSize, unix.EROFS},
		{"other slot", fds[2], ProcFileSize, nil},
		{"own slot, read-only copy", fds[3], ProcFileSize, nil},
	} {
		if _, err := unix.Mmap(tc.fd, 0, tc.size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); !errors.Is(err, unix.EACCES) {
			t.Errorf("%s: mmap PROT_WRITE: %v, want EACCES", tc.name, err)
		}
		mem, err := unix.Mmap(tc.fd, 0, tc.size, unix.PROT_READ, unix.MAP_SHARED)
		if err != nil {
			t.Fatalf("%s: mmap PROT_READ: %v", tc.name, err)
		}
		if err := unix.Mprotect(mem, unix.PROT_READ|unix.PROT_WRITE); !errors.Is(err, unix.EACCES) {
			t.Errorf("%s: mprotect PROT_WRITE: %v, want EACCES", tc.name, err)
		}
		_ = unix.Munmap(mem)
		fd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(tc.fd), unix.O_RDWR, 0)
		if err == nil {
			_ = unix.Close(fd)
		}
		if !errors.Is(err, tc.reopen) {
			t.Errorf("%s: reopen /proc/self/fd for writing: %v, want %v", tc.name, err, tc.reopen)
		}
		if err := unix.Ftruncate(tc.fd, 0); err == nil {
			t.Errorf("%s: ftruncate of a read-only descriptor succeeded", tc.name)
		}
		if _, err := unix.Write(tc.fd, []byte{1}); err == nil {
			t.Errorf("%s: write(2) through a read-only descriptor succeeded", tc.name)
		}
	}
	// The read-only views show what the enforcer writes.
	ctl, err := unix.Mmap(fds[0], 0, ControlFileSize, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(ctl)
	r.L().Grant.Store(1)
	if (*Layout)(unsafe.Pointer(&ctl[0])).Grant.Load() != 1 || (*Layout)(unsafe.Pointer(&ctl[0])).Magic != Magic {
		t.Fatal("the read-only control mapping does not show the enforcer's words")
	}
	// The own slot is writable, and the enforcer sees the writes.
	own, err := unix.Mmap(fds[1], 0, ProcFileSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatalf("own slot: %v", err)
	}
	defer unix.Munmap(own)
	(*Counters)(unsafe.Pointer(&own[0])).GPUNs.Store(777)
	if r.Proc(slot).GPUNs.Load() != 777 {
		t.Fatal("a write to the own slot is not seen by the enforcer")
	}
	// It is a file description of its own: what the process sets on it
	// does not reach the enforcer's.
	if _, err := unix.FcntlInt(uintptr(fds[1]), unix.F_SETFL, unix.O_NONBLOCK); err != nil {
		t.Fatal(err)
	}
	if fl, err := unix.FcntlInt(uintptr(r.fds[slot]), unix.F_GETFL, 0); err != nil || fl&unix.O_NONBLOCK != 0 {
		t.Fatalf("the enforcer's memfd flags %#x (%v) after the process set O_NONBLOCK on its own", fl, err)
	}
	if r.Proc(3).GPUNs.Load() != 0 {
		t.Fatal("another slot changed")
	}
	// A region outside the view is refused.
	other, err := Create(filepath.Join(t.TempDir(), "mgpu0inst4"), testParams())
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if _, err := other.PeerFDs(v, []int{0}); !errors.Is(err, ErrNotInView) {
		t.Fatalf("region outside the view: %v, want ErrNotInView", err)
	}
	if _, err := other.TenantFDs(v, 0); !errors.Is(err, ErrNotInView) {
		t.Fatalf("region outside the view: %v, want ErrNotInView", err)
	}
}

// TestGrantWakesFutexWaiter blocks a thread in FUTEX_WAIT on the grant word
// of a second mapping and checks that SetGrant wakes it.
func TestGrantWakesFutexWaiter(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "r")
	r, err := Create(path, testParams())
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	other, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()

	tids := make(chan int, 1)
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		tids <- unix.Gettid()
		ts := unix.NsecToTimespec(int64(20 * time.Second))
		// FUTEX_WAIT (shared) while grant == 0.
		_, _, e := unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(&other.L().Grant)), 0, 0, uintptr(unsafe.Pointer(&ts)), 0, 0)
		if e != 0 && e != unix.EAGAIN && e != unix.EINTR {
			done <- e
			return
		}
		done <- nil
	}()
	tid := <-tids
	// Wait until the thread sits in the futex system call.
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, _ := os.ReadFile("/proc/self/task/" + strconv.Itoa(tid) + "/syscall")
		if f := strings.Fields(string(b)); len(f) > 0 && f[0] == strconv.Itoa(unix.SYS_FUTEX) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("waiter never entered futex wait")
		}
		runtime.Gosched()
	}
	start := time.Now()
	if !r.SetGrant(1) {
		t.Fatal("SetGrant(1) reported no change")
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el > 5*time.Second {
		t.Fatalf("waiter woke after %v: not by the wake", el)
	}
	if r.SetGrant(1) {
		t.Fatal("SetGrant(1) twice reported a change")
	}
}

// A blank region is no region until Install moves it into place and writes
// its header; an Install that cannot move it leaves it blank where it was.
func TestBlankInstall(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	blank := filepath.Join(root, ".blank")
	b, err := CreateBlank(blank)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if ents, _ := os.ReadDir(blank); len(ents) != 1 {
		t.Fatalf("%d files in the blank region, want the control file only", len(ents))
	}
	if _, err := Open(blank); !errors.Is(err, ErrInvalid) {
		t.Fatalf("open of a blank region: %v, want ErrInvalid", err)
	}

	taken := filepath.Join(root, "mgpu1inst6")
	if err := os.MkdirAll(filepath.Join(taken, "x"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := b.Install(taken, testParams()); err == nil {
		t.Fatal("install over a non-empty directory succeeded")
	}
	if b.Dir() != blank || b.L().Magic != 0 {
		t.Fatalf("after a failed install: dir %s magic %#x, want %s and no header", b.Dir(), b.L().Magic, blank)
	}

	dir := filepath.Join(root, "mgpu1inst7")
	if err := b.Install(dir, testParams()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(blank); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the blank directory is still there: %v", err)
	}
	r, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if got := r.Params(); got != testParams() {
		t.Fatalf("params %+v, want %+v", got, testParams())
	}
	// The installed mapping and a fresh one are the same pages.
	b.Proc(3).Claim(42, 99)
	if p := r.Proc(3); p.PID.Load() != 42 || p.StartTime.Load() != 99 {
		t.Fatalf("slot 3 through a new mapping: pid %d start %d", p.PID.Load(), p.StartTime.Load())
	}
	if err := b.Install(filepath.Join(root, "again"), testParams()); err == nil {
		t.Fatal("a second install of the same region succeeded")
	}
}

// TestSlotSeals: a slot's memfd can be neither shrunk nor grown, by any
// descriptor of it (its owner's, or a read-only one reopened for writing
// by root), nor sealed further; the enforcer's mapping keeps its size and
// never faults. Without CAP_DAC_OVERRIDE a read-only descriptor cannot be
// reopened for writing (the memfd is 0600, the enforcer's).
func TestSlotSeals(t *testing.T) {
	t.Parallel()
	if os.Geteuid() != 0 {
		t.Skip("the read-only view needs root (CAP_SYS_ADMIN)")
	}
	r, v := regionAndView(t, "mgpu0inst1")
	fds, err := r.TenantFDs(v, 2)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Prepare(4); err != nil {
		t.Fatal(err)
	}
	peer, err := r.PeerFDs(v, []int{4})
	if err != nil {
		t.Fatal(err)
	}
	fds = append(fds, peer...)
	defer func() {
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
	}()
	rw, err := unix.Open("/proc/self/fd/"+strconv.Itoa(fds[2]), unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("root reopens a peer's slot for writing: %v", err)
	}
	defer unix.Close(rw)
	for _, tc := range []struct {
		name string
		fd   int
		slot int
	}{{"own slot", fds[1], 2}, {"peer's slot reopened for writing", rw, 4}} {
		r.Proc(tc.slot).GPUNs.Store(99)
		for what, err := range map[string]error{
			"ftruncate to 0":           unix.Ftruncate(tc.fd, 0),
			"ftruncate to 1 byte less": unix.Ftruncate(tc.fd, ProcFileSize-1),
			"ftruncate to 64 MiB":      unix.Ftruncate(tc.fd, 64<<20),
			"fallocate 64 MiB":         unix.Fallocate(tc.fd, 0, 0, 64<<20),
			"fallocate past the end":   unix.Fallocate(tc.fd, unix.FALLOC_FL_KEEP_SIZE, ProcFileSize, 64<<20),
		} {
			if !errors.Is(err, unix.EPERM) {
				t.Errorf("%s: %s: %v, want EPERM", tc.name, what, err)
			}
		}
		if _, err := unix.FcntlInt(uintptr(tc.fd), unix.F_ADD_SEALS, unix.F_SEAL_FUTURE_WRITE); !errors.Is(err, unix.EPERM) {
			t.Errorf("%s: another seal: %v, want EPERM", tc.name, err)
		}
		var st unix.Stat_t
		if err := unix.Fstat(tc.fd, &st); err != nil || st.Size != ProcFileSize || st.Blocks*512 > 2*ProcFileSize {
			t.Errorf("%s: size %d, %d blocks (%v)", tc.name, st.Size, st.Blocks, err)
		}
		if got := r.Proc(tc.slot).GPUNs.Load(); got != 99 {
			t.Errorf("%s: the enforcer reads %d, want 99", tc.name, got)
		}
	}
	// Without CAP_DAC_OVERRIDE (a non-root tenant, or root in a user
	// namespace): on a thread of its own whose effective uid is not 0.
	res := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, ^uintptr(0), 65534, ^uintptr(0)); e != 0 {
			res <- e
			return
		}
		fd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(fds[2]), unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err == nil {
			_ = unix.Close(fd)
		}
		res <- err
	}()
	if err := <-res; !errors.Is(err, unix.EACCES) {
		t.Errorf("reopen of a peer's slot for writing without CAP_DAC_OVERRIDE: %v, want EACCES", err)
	}
}

// regionAndView creates region name in a temporary directory and a
// read-only view of that directory, both closed when the test ends.
func regionAndView(t *testing.T, name string) (*Region, *View) {
	t.Helper()
	base := t.TempDir()
	r, err := Create(filepath.Join(base, name), testParams())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	v, err := NewView(base)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = v.Close() })
	return r, v
}
