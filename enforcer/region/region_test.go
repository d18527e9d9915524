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
	for name, want := range map[string]int64{"": -1, ControlName: ControlFileSize, ProcName(0): ProcFileSize, ProcName(MaxProcs - 1): ProcFileSize} {
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
	if ents, _ := os.ReadDir(dir); len(ents) != MaxProcs+1 {
		t.Fatalf("%d files in the region, want %d", len(ents), MaxProcs+1)
	}
	l := r.L()
	if l.Magic != Magic || l.Version != Version || l.Size != ControlFileSize || l.MaxProcs != MaxProcs {
		t.Fatalf("header %#x %d %d %d", l.Magic, l.Version, l.Size, l.MaxProcs)
	}
	if got := r.Params(); got != testParams() {
		t.Fatalf("params %+v, want %+v", got, testParams())
	}
	if _, err := Create(dir, testParams()); !errors.Is(err, os.ErrExist) {
		t.Fatalf("second create: %v, want ErrExist", err)
	}

	// A second mapping (as another process would have) shares the words.
	r2, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	if r2.Params() != testParams() {
		t.Fatalf("reopened params %+v", r2.Params())
	}
	r.Proc(5).Claim(1234, 99)
	r2.Proc(5).GPUNs.Add(42)
	if p := r2.Proc(5); p.PID.Load() != 1234 || p.StartTime.Load() != 99 {
		t.Fatalf("slot 5 in second mapping: pid %d start %d", p.PID.Load(), p.StartTime.Load())
	}
	if r.Proc(5).GPUNs.Load() != 42 {
		t.Fatal("counter written through the second mapping not visible in the first")
	}
	r.Proc(5).Clear()
	if p := r2.Proc(5); p.PID.Load() != 0 || p.StartTime.Load() != 0 || p.GPUNs.Load() != 0 {
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
	raw, err = os.ReadFile(filepath.Join(dir, ProcName(3)))
	if err != nil {
		t.Fatal(err)
	}
	if raw[8] != 8 || raw[15] != 1 {
		t.Fatalf("mem_reserved at byte 8 of proc.003 reads % x", raw[8:16])
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
		file   string
		data   []byte
		remove bool
	}{
		{name: "empty control", file: ControlName, data: nil},
		{name: "short control", file: ControlName, data: ctl[:1024]},
		{name: "bad magic", file: ControlName, data: append([]byte{0, 0, 0, 0}, ctl[4:]...)},
		{name: "version 1", file: ControlName, data: append(append(append([]byte{}, ctl[:4]...), 1, 0, 0, 0), ctl[8:]...)},
		{name: "missing control", file: ControlName, remove: true},
		{name: "missing proc file", file: ProcName(17), remove: true},
		{name: "short proc file", file: ProcName(17), data: make([]byte, 64)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(base, strings.ReplaceAll(tc.name, " ", "_"))
			if r, err := Create(dir, testParams()); err != nil {
				t.Fatal(err)
			} else {
				r.Close()
			}
			p := filepath.Join(dir, tc.file)
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

// TestTenantFDs checks what a process receives: its control file and
// every other slot's counters cannot be made writable by any route a
// process has (mmap, mprotect, reopening /proc/self/fd/N, ftruncate), even
// as root; its own proc file is writable and shared with the enforcer.
func TestTenantFDs(t *testing.T) {
	t.Parallel()
	if os.Geteuid() != 0 {
		t.Skip("the read-only view needs root (CAP_SYS_ADMIN)")
	}
	base := t.TempDir()
	r, err := Create(filepath.Join(base, "mgpu0inst3"), testParams())
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	v, err := NewView(base)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	const slot = 9
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
		name string
		fd   int
		size int
	}{
		{"control", fds[0], ControlFileSize},
		{"other slot", fds[2], ProcFileSize},
		{"own slot, read-only copy", fds[3], ProcFileSize},
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
		if fd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(tc.fd), unix.O_RDWR, 0); !errors.Is(err, unix.EROFS) {
			if err == nil {
				_ = unix.Close(fd)
			}
			t.Errorf("%s: reopen /proc/self/fd for writing: %v, want EROFS", tc.name, err)
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
	// The own proc file is writable, and the enforcer sees the writes.
	own, err := unix.Mmap(fds[1], 0, ProcFileSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatalf("own proc file: %v", err)
	}
	defer unix.Munmap(own)
	(*Counters)(unsafe.Pointer(&own[0])).GPUNs.Store(777)
	if r.Proc(slot).GPUNs.Load() != 777 {
		t.Fatal("a write to the own proc file is not seen by the enforcer")
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
	if ents, _ := os.ReadDir(blank); len(ents) != MaxProcs+1 {
		t.Fatalf("%d files in the blank region, want %d", len(ents), MaxProcs+1)
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
