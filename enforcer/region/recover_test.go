package region

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// self is this process as a holder of memfds.
func self(t *testing.T) Holder {
	t.Helper()
	fd, err := unix.PidfdOpen(os.Getpid(), 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Close(fd) })
	return Holder{PID: os.Getpid(), PidFD: fd}
}

// tenantMap maps fd as a process does (read-write or read-only) and
// closes it, as the shim does.
func tenantMap(t *testing.T, fd, prot int) *Counters {
	t.Helper()
	mem, err := unix.Mmap(fd, 0, ProcFileSize, prot, unix.MAP_SHARED)
	_ = unix.Close(fd)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Munmap(mem) })
	return (*Counters)(unsafe.Pointer(&mem[0]))
}

// TestRecover: the enforcer's memfds die with it; a new one finds every
// slot's memfd that a process still maps (its own slot read-write, a
// peer's read-only) or holds as a descriptor, and its counters with it.
// A slot that nobody holds has no memory until a process attaches to it
// again, and then gets a new memfd.
func TestRecover(t *testing.T) {
	t.Parallel()
	if os.Geteuid() != 0 {
		t.Skip("the read-only view and map_files need root (CAP_SYS_ADMIN)")
	}
	base := t.TempDir()
	dir := filepath.Join(base, "mgpu0inst2")
	r, err := Create(dir, testParams())
	if err != nil {
		t.Fatal(err)
	}
	v, err := NewView(base)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	own5, err := r.TenantFDs(v, 5)
	if err != nil {
		t.Fatal(err)
	}
	_ = unix.Close(own5[0])
	c5 := tenantMap(t, own5[1], unix.PROT_READ|unix.PROT_WRITE)
	own6, err := r.TenantFDs(v, 6) // held as a descriptor, never mapped
	if err != nil {
		t.Fatal(err)
	}
	_ = unix.Close(own6[0])
	defer unix.Close(own6[1])
	for _, i := range []int{7, 9} {
		if err := r.Prepare(i); err != nil {
			t.Fatal(err)
		}
	}
	peer, err := r.PeerFDs(v, []int{7})
	if err != nil {
		t.Fatal(err)
	}
	c7 := tenantMap(t, peer[0], unix.PROT_READ)
	c5.GPUNs.Store(5e6)
	r.Proc(6).GPUNs.Store(6e6)
	r.Proc(7).GPUNs.Store(7e6)
	lost := r.L().Slots[9].ProcIno.Load()
	if err := r.Close(); err != nil { // the enforcer is gone
		t.Fatal(err)
	}

	r2, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	if got := r2.Recover([]Holder{self(t)}); !slices.Equal(got, []int{5, 6, 7}) {
		t.Fatalf("recovered slots %v, want [5 6 7]", got)
	}
	for i, want := range map[int]uint64{5: 5e6, 6: 6e6, 7: 7e6} {
		if got := r2.Proc(i).GPUNs.Load(); got != want {
			t.Errorf("slot %d: gpu_ns %d, want %d", i, got, want)
		}
	}
	if r2.Proc(9).Counters != nil {
		t.Fatal("slot 9, held by nobody, has memory")
	}
	r2.Proc(5).Clear() // the enforcer's writes reach the process's mapping
	r2.Proc(7).MemReserved.Store(1)
	if c5.GPUNs.Load() != 0 || c7.MemReserved.Load() != 1 {
		t.Fatal("the recovered mappings are not the processes' memory")
	}
	// Handing out works as before; slot 9 gets a new memfd.
	for _, i := range []int{5, 9} {
		fds, err := r2.TenantFDs(v, i)
		if err != nil {
			t.Fatal(err)
		}
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
	}
	if ino := r2.L().Slots[9].ProcIno.Load(); ino == lost || ino == 0 || r2.Proc(9).GPUNs.Load() != 0 {
		t.Fatalf("slot 9 attached again: inode %d (was %d)", ino, lost)
	}
}

// TestRecoverRejects: what Recover maps must be the memfd the control file
// records, as the enforcer made it. A memfd that carries a slot's inode
// number (forged here by writing it into the control file, as an inode
// number that came round again would be) but not its seals or size is left
// alone, and so is everything read of a holder that exited meanwhile (its
// pid may be another process's).
func TestRecoverRejects(t *testing.T) {
	t.Parallel()
	if os.Geteuid() != 0 {
		t.Skip("map_files needs root (CAP_SYS_ADMIN)")
	}
	dir := filepath.Join(t.TempDir(), "mgpu0inst3")
	r, err := Create(dir, testParams())
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	forge := func(slot int, seals int, size int64) {
		t.Helper()
		fd, err := unix.MemfdCreate(procName(slot), unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Ftruncate(fd, size); err != nil {
			t.Fatal(err)
		}
		c := tenantMap(t, mustDup(t, fd), unix.PROT_READ|unix.PROT_WRITE)
		c.GPUNs.Store(1)
		if seals != 0 {
			if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
				t.Fatal(err)
			}
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			t.Fatal(err)
		}
		_ = unix.Close(fd)
		r.L().Slots[slot].ProcDev.Store(st.Dev)
		r.L().Slots[slot].ProcIno.Store(st.Ino)
	}
	forge(1, 0, ProcFileSize)                                   // no seals: could shrink under the enforcer
	forge(2, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW, ProcFileSize) // could take a write seal later
	forge(3, sealed|unix.F_SEAL_FUTURE_WRITE, ProcFileSize)     // not writable
	forge(4, sealed, 2*ProcFileSize)                            // the wrong size
	forge(5, sealed, ProcFileSize)                              // as the enforcer makes it
	if got := r.Recover([]Holder{self(t)}); !slices.Equal(got, []int{5}) {
		t.Fatalf("recovered %v, want [5] only", got)
	}
	_ = r.dropProc(5)

	// A holder whose pidfd says it exited: its pid may be reused by now.
	cmd := exec.Command("/bin/true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	dead, err := unix.PidfdOpen(cmd.Process.Pid, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(dead)
	_ = cmd.Wait()
	if got := r.Recover([]Holder{{PID: os.Getpid(), PidFD: dead}}); len(got) != 0 || r.Proc(5).Counters != nil {
		t.Fatalf("recovered %v through a holder that exited", got)
	}
	if got := r.Recover([]Holder{{PID: os.Getpid(), PidFD: dead}, self(t)}); !slices.Equal(got, []int{5}) {
		t.Fatalf("recovered %v, want [5] through the live holder", got)
	}
}

func mustDup(t *testing.T, fd int) int {
	t.Helper()
	d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// BenchmarkCreateBlank is what making a blank region costs (the enforcer
// does it ahead of time, at nice 19, after each create).
func BenchmarkCreateBlank(b *testing.B) {
	b.ReportAllocs()
	base := b.TempDir()
	for b.Loop() {
		dir := filepath.Join(base, "blank")
		r, err := CreateBlank(dir)
		if err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		_ = r.Close()
		_ = Remove(dir)
		b.StartTimer()
	}
}

// BenchmarkPrepare is what giving a slot its memfd costs (the first attach
// to the slot pays it, under the enforcer's lock).
func BenchmarkPrepare(b *testing.B) {
	r, err := CreateBlank(filepath.Join(b.TempDir(), "blank"))
	if err != nil {
		b.Fatal(err)
	}
	defer r.Close()
	i := 0
	for b.Loop() {
		if err := r.Prepare(i); err != nil {
			b.Fatal(err)
		}
		if i++; i == MaxProcs {
			b.StopTimer()
			for j := range MaxProcs {
				_ = r.dropProc(j)
			}
			i = 0
			b.StartTimer()
		}
	}
}
