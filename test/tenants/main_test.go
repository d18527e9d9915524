// Package tenants holds the hostile-tenant tests (DESIGN.md, "Tenants are
// untrusted", test layer 5): processes of an instance that try to make the
// enforcer's words writable, write nonsense into their own counters, or
// bypass the shim, beside honest neighbours whose shares must not move.
// Real enforcers on a simulated node, as in test/process.
package tenants

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/attach"
	"github.com/mgpu-dev/mgpu/enforcer/region"
	"github.com/mgpu-dev/mgpu/test/harness"
	tol "github.com/mgpu-dev/mgpu/test/shares"
)

// envRole makes the test binary act as a hostile process of an instance.
const envRole = "MGPU_TENANT_ROLE"

// Roles.
const (
	roleTamper  = "tamper"  // attach, try every way to a writable mapping, print the results, hold
	roleGarbage = "garbage" // attach, then write random values into the own slot until killed
	roleFlood   = "flood"   // hold 1,024 silent connections to the client socket, reopening each one dropped
)

func TestMain(m *testing.M) {
	switch r := os.Getenv(envRole); r {
	case "":
		os.Exit(m.Run())
	case roleTamper, roleGarbage:
		os.Exit(hostile(r))
	case roleFlood:
		os.Exit(floodSocket(1024))
	default:
		fmt.Fprintf(os.Stderr, "unknown %s=%q\n", envRole, r)
		os.Exit(2)
	}
}

// hostile is what a tenant's own program can do with what it is given.
func hostile(role string) int {
	sock := filepath.Join(os.Getenv("MGPU_RUN_DIR"), "gpu0", "client", "client.sock")
	res, err := attach.Dial(sock, 5*time.Second)
	if err != nil {
		fmt.Printf("attach=error error=%q\n", err.Error())
		return 1
	}
	fmt.Printf("attach=ok slot=%d\n", res.Slot)
	files := []struct {
		name string
		f    *os.File
	}{{"control", res.Control}}
	peers, err := attach.Peers(sock, 5*time.Second)
	if err != nil {
		fmt.Printf("peers=error error=%q\n", err.Error())
		return 1
	}
	for _, f := range peers { // another attached process's slot, if any
		files = append(files, struct {
			name string
			f    *os.File
		}{"other", f})
		break
	}
	for _, f := range files {
		fmt.Printf("tamper.%s.mmap=%s tamper.%s.mprotect=%s tamper.%s.reopen=%s tamper.%s.write=%s tamper.%s.truncate=%s\n",
			f.name, mapWritable(f.f), f.name, protectWritable(f.f), f.name, reopenWritable(f.f), f.name, writeTo(f.f), f.name, errnoName(f.f.Truncate(0)))
	}
	own, err := unix.Mmap(int(res.Own.Fd()), 0, region.ProcFileSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		fmt.Printf("tamper.own.mmap=%s\n", errnoName(err))
		return 1
	}
	fmt.Println("tamper.own.mmap=ok")
	if role == roleTamper {
		fmt.Println("holding")
		select {} // until killed: the attachment is what is held
	}
	c := (*region.Counters)(unsafe.Pointer(&own[0]))
	r := rand.New(rand.NewPCG(uint64(os.Getpid()), 1)) //nolint:gosec // nonsense, not secrets
	fmt.Println("garbage")
	for i := 0; ; i++ {
		c.GPUNs.Store(r.Uint64())
		c.Launches.Store(r.Uint64())
		c.QueuedNs.Store(r.Uint64())
		c.ThrottledNs.Store(r.Uint64())
		c.MemReserved.Store(r.Uint64())
		c.Waiting.Store(r.Uint32())
		if i%1024 == 0 {
			time.Sleep(time.Millisecond) // leave the CPU to the workloads
		}
	}
}

func mapWritable(f *os.File) string {
	m, err := unix.Mmap(int(f.Fd()), 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err == nil {
		_ = unix.Munmap(m)
	}
	return errnoName(err)
}

func protectWritable(f *os.File) string {
	m, err := unix.Mmap(int(f.Fd()), 0, 4096, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return "map:" + errnoName(err)
	}
	defer func() { _ = unix.Munmap(m) }()
	return errnoName(unix.Mprotect(m, unix.PROT_READ|unix.PROT_WRITE))
}

func reopenWritable(f *os.File) string {
	g, err := os.OpenFile("/proc/self/fd/"+strconv.Itoa(int(f.Fd())), os.O_RDWR, 0)
	if err == nil {
		_ = g.Close()
	}
	return errnoName(err)
}

func writeTo(f *os.File) string {
	_, err := f.WriteAt([]byte{1}, 64) // the grant word of a control file
	return errnoName(err)
}

func errnoName(err error) string {
	if err == nil {
		return "ok"
	}
	var en unix.Errno
	if errors.As(err, &en) && unix.ErrnoName(en) != "" {
		return unix.ErrnoName(en)
	}
	return "error"
}

// newNode starts a simulated node with device 0's enforcer. Without a build
// it skips locally and fails in CI (CI=true), which always builds.
func newNode(t *testing.T, nc harness.NodeConfig) *harness.Node {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("the enforcer needs root (it hands out read-only views of regions)")
	}
	n, err := harness.NewNode(nc)
	if err != nil {
		if os.Getenv("CI") == "" {
			t.Skipf("%v", err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.Close() })
	if err := n.StartEnforcer(0); err != nil {
		t.Fatal(err)
	}
	return n
}

// self is the command line that runs this test binary as a hostile
// process with role.
func self(role string) []string {
	return []string{"/usr/bin/env", envRole + "=" + role, os.Args[0]}
}

// saturating is mgpu-workload's compute command, flat out, for secs.
func saturating(secs float64) []string {
	return []string{"compute", "--api", "launch", "--kernel-us", "200", "--depth", "16", "--seconds", fmt.Sprintf("%.1f", secs)}
}

// saturatedShares starts a saturating workload in each shell and returns
// the share of device 0 (percent) each achieves over the share window,
// after a second of settling.
func saturatedShares(t *testing.T, n *harness.Node, shells ...*harness.Shell) []float64 {
	t.Helper()
	warm, win := time.Second, tol.Window()
	procs := make([]harness.Proc, len(shells))
	for i, sh := range shells {
		var err error
		if procs[i], err = sh.Spawn(saturating((win + 10*time.Second).Seconds())...); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range procs {
		if err := p.WaitOutput("start", 15*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(warm) // settling time before the window, not synchronisation
	a, err := n.Sample()
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(win) // the measurement window
	b, err := n.Sample()
	if err != nil {
		t.Fatal(err)
	}
	out := make([]float64, len(procs))
	for i, p := range procs {
		if !p.Alive() {
			t.Fatalf("workload %d ended during the window:\n%s", i, p.Output())
		}
		out[i] = harness.Share(a, b, 0, map[int]bool{p.PID: true})
	}
	t.Logf("shares over %v: %.2f (device %.2f%%)", win, out, harness.Share(a, b, 0, nil))
	return out
}

func within(t *testing.T, what string, got, want float64) {
	t.Helper()
	if e := tol.Tolerance(); got < want-e || got > want+e {
		t.Errorf("%s: %.2f%%, want %.0f ± %.0f", what, got, want, e)
	}
}
