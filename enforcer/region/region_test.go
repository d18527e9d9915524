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
	path := filepath.Join(t.TempDir(), "mgpu1inst7")
	r, err := Create(path, testParams())
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() != FileSize || st.Mode().Perm() != 0o600 {
		t.Fatalf("file size %d mode %v, want %d 0600", st.Size(), st.Mode().Perm(), FileSize)
	}
	l := r.L()
	if l.Magic != Magic || l.Version != Version || l.Size != FileSize || l.MaxProcs != MaxProcs {
		t.Fatalf("header %#x %d %d %d", l.Magic, l.Version, l.Size, l.MaxProcs)
	}
	if got := r.Params(); got != testParams() {
		t.Fatalf("params %+v, want %+v", got, testParams())
	}
	if _, err := Create(path, testParams()); !errors.Is(err, os.ErrExist) {
		t.Fatalf("second create: %v, want ErrExist", err)
	}

	// A second mapping (as another process would have) shares the words.
	r2, err := Open(path)
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
	if *r2.Proc(5) != (Proc{}) {
		t.Fatal("cleared slot not zero")
	}
	// Raw byte offsets agree with the header's (checked against C elsewhere).
	r.L().Grant.Store(0xdeadbeef)
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if g := uint32(raw[64]) | uint32(raw[65])<<8 | uint32(raw[66])<<16 | uint32(raw[67])<<24; g != 0xdeadbeef {
		t.Fatalf("grant at byte 64 reads %#x", g)
	}
}

func TestOpenRejects(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	good := filepath.Join(dir, "good")
	r, err := Create(good, testParams())
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	data, err := os.ReadFile(good)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		data []byte
	}{
		{"empty", nil},
		{"short", data[:4096]},
		{"bad magic", append([]byte{0, 0, 0, 0}, data[4:]...)},
		{"bad version", append(append(append([]byte{}, data[:4]...), 9, 0, 0, 0), data[8:]...)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "_"))
			if err := os.WriteFile(p, tc.data, 0o600); err != nil {
				t.Fatal(err)
			}
			if _, err := Open(p); !errors.Is(err, ErrInvalid) {
				t.Fatalf("Open: %v, want ErrInvalid", err)
			}
		})
	}
	if _, err := Open(filepath.Join(dir, "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing: %v", err)
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
