package tenants

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/attach"
	"github.com/mgpu-dev/mgpu/enforcer/region"
	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/test/fakecuda"
	"github.com/mgpu-dev/mgpu/test/harness"
)

// restarts is how many times TestRestartUnderResize kills and starts the
// enforcer (enforcer TestRestoreUnderResizeStorm restores 1,000 times in
// process).
const restarts = 200

// envResizer makes TestResizerRole, run by TestRestartUnderResize inside an
// instance, act as the hostile process (main_test.go's roles are for
// TestMain; this one is a test of its own so that it needs no change
// there).
const envResizer = "MGPU_TENANT_RESIZER"

// TestRestartUnderResize (issue 30, points 3 and 4): a process of an
// instance holds its own slot's writable descriptor and a sibling's slot
// reopened for writing, and tries to shrink and grow both in a tight loop
// (and punches a hole in its own) while device 0's enforcer is killed
// (SIGKILL) and started again, restarts times. Every resize is refused;
// the enforcer never dies but by the kills and restores both instances
// with all their processes every time; the honest neighbour's process
// stays attached, and allocates and computes afterwards; the run directory
// (the host's /run) does not grow.
func TestRestartUnderResize(t *testing.T) {
	var logs harness.SyncBuffer
	n := newNode(t, harness.NodeConfig{Policies: map[int]policy.Policy{0: policy.FixedShare}, Log: &logs})
	a, err := n.Shell(0, 10, 1024)
	if err != nil {
		t.Fatal(err)
	}
	b, err := n.Shell(0, 50, 1024)
	if err != nil {
		t.Fatal(err)
	}
	// The sibling whose slot the resizer reopens, and the neighbour.
	sibling, err := a.Spawn("alloc", "--api", "cuMemAlloc_v2", "--mib", "64", "--hold-ms", "-1")
	if err != nil {
		t.Fatal(err)
	}
	honest, err := b.Spawn("alloc", "--api", "cuMemAlloc_v2", "--mib", "256", "--hold-ms", "-1")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []harness.Proc{sibling, honest} {
		if err := p.WaitOutput("holding", 15*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	rz, err := a.SpawnCommand("/usr/bin/env", envResizer+"=1", os.Args[0], "-test.run=^TestResizerRole$", "-test.v")
	if err != nil {
		t.Fatal(err)
	}
	if err := rz.WaitOutput("resizing", 15*time.Second); err != nil {
		t.Fatal(err)
	}
	runDir := n.RunDir
	before := duBytes(t, runDir)
	most := before
	c := n.Client(0)
	t0 := time.Now()
	for i := range restarts {
		if err := n.StopEnforcer(0, syscall.SIGKILL); err != nil {
			t.Fatalf("restart %d: the enforcer was gone before the kill: %v\n%s", i, err, logs.String())
		}
		if err := n.StartEnforcer(0); err != nil {
			t.Fatalf("restart %d: %v\n%s", i, err, logs.String())
		}
		l, err := c.List(t.Context())
		if err != nil || len(l) != 2 || l[0].Name != a.Instance.Name || l[0].Processes != 2 || l[1].Processes != 1 {
			t.Fatalf("restart %d: instances %+v, %v\n%s", i, l, err, logs.String())
		}
		if i%20 == 0 {
			most = max(most, duBytes(t, runDir))
		}
	}
	took := time.Since(t0)
	// One more second of resizing under a running enforcer.
	time.Sleep(time.Second) // the attack goes on; nothing to wait for
	after := duBytes(t, runDir)
	most = max(most, after)
	if _, err := c.Stats(t.Context()); err != nil {
		t.Fatalf("the enforcer stopped answering: %v\n%s", err, logs.String())
	}
	last := lastLine(rz.Output(), "attempts=")
	t.Logf("%d kills and restarts in %v (%v each); resizer: %s; run directory %d bytes before, %d at most, %d after",
		restarts, took.Round(time.Millisecond), (took / restarts).Round(time.Millisecond), last, before, most, after)
	if !strings.Contains(rz.Output(), "resizing fds=2 ") {
		t.Errorf("the resizer did not get its sibling's slot writable:\n%s", rz.Output())
	}
	m := fakecuda.Fields(last)
	if m["resized"] != "0" || m["attempts"] == "" || m["attempts"] == "0" {
		t.Errorf("resizer: %q, want attempts and none resized\n%s", last, rz.Output())
	}
	if !rz.Alive() || !sibling.Alive() || !honest.Alive() {
		t.Errorf("a process ended: resizer %v, sibling %v, neighbour %v", rz.Alive(), sibling.Alive(), honest.Alive())
	}
	if most > before+16<<10 {
		t.Errorf("the run directory grew from %d to %d bytes", before, most)
	}
	for _, bad := range []string{"SIGBUS", "fatal error", "panic", "faulted"} {
		if strings.Contains(logs.String(), bad) {
			t.Fatalf("the enforcer's log has %q:\n%s", bad, logs.String())
		}
	}
	// The neighbour still allocates and computes.
	alloc, err := b.Spawn("alloc", "--api", "cuMemAlloc_v2", "--mib", "64")
	if err != nil {
		t.Fatal(err)
	}
	compute, err := b.Spawn("compute", "--api", "launch", "--kernel-us", "200", "--depth", "4", "--seconds", "1")
	if err != nil {
		t.Fatal(err)
	}
	if err := alloc.WaitOutput("-> CUDA_SUCCESS", 15*time.Second); err != nil {
		t.Error(err)
	}
	if err := compute.WaitOutput("launches=", 15*time.Second); err != nil {
		t.Error(err)
	}
}

// TestResizerRole is the hostile process of TestRestartUnderResize (it
// skips unless run as that). It attaches, maps its slot as the shim does,
// reopens a sibling's slot for writing, prints "resizing", then tries to
// shrink and grow both until killed, printing its counts every 100 ms.
func TestResizerRole(t *testing.T) {
	if os.Getenv(envResizer) == "" {
		t.Skip("run by TestRestartUnderResize")
	}
	sock := filepath.Join(os.Getenv("MGPU_RUN_DIR"), "gpu0", "client", "client.sock")
	res, err := attach.Dial(sock, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	own := int(res.Own.Fd()) //nolint:gosec // fds fit in int
	if _, err := unix.Mmap(own, 0, region.ProcFileSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err != nil {
		t.Fatal(err)
	}
	fds := []int{own}
	peers, err := attach.Peers(sock, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	reopen := "none"
	for _, f := range peers {
		rw, err := unix.Open("/proc/self/fd/"+strconv.Itoa(int(f.Fd())), unix.O_RDWR|unix.O_CLOEXEC, 0) //nolint:gosec // fds fit in int
		reopen = errnoName(err)
		if err == nil {
			fds = append(fds, rw)
		}
	}
	fmt.Printf("resizing fds=%d reopen=%s\n", len(fds), reopen)
	var attempts, resized int
	next := time.Now()
	for {
		for _, fd := range fds {
			for _, err := range []error{
				unix.Ftruncate(fd, 0),
				unix.Ftruncate(fd, region.ProcFileSize/2),
				unix.Ftruncate(fd, 64<<20),
				unix.Fallocate(fd, 0, 0, 64<<20),
				unix.Fallocate(fd, unix.FALLOC_FL_KEEP_SIZE, region.ProcFileSize, 64<<20),
			} {
				attempts++
				if !errors.Is(err, unix.EPERM) {
					resized++
				}
			}
		}
		// Allowed (its own counters read back as zeros), and not a resize.
		_ = unix.Fallocate(own, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, region.ProcFileSize)
		if time.Now().After(next) {
			fmt.Printf("attempts=%d resized=%d\n", attempts, resized)
			next = time.Now().Add(100 * time.Millisecond)
		}
	}
}

// lastLine is the last line of out that starts with prefix.
func lastLine(out, prefix string) string {
	lines := strings.Split(out, "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.HasPrefix(lines[i], prefix) {
			return lines[i]
		}
	}
	return ""
}

// duBytes is the space the files under dir take (st_blocks), as du counts
// it.
func duBytes(t *testing.T, dir string) int64 {
	t.Helper()
	var total int64
	err := filepath.WalkDir(dir, func(path string, _ fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil // a file the enforcer replaced meanwhile
			}
			return err
		}
		var st unix.Stat_t
		if unix.Lstat(path, &st) == nil {
			total += st.Blocks * 512
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return total
}
