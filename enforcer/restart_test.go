package enforcer

import (
	"bytes"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/enforcer/attach"
	"github.com/mgpu-dev/mgpu/enforcer/region"
)

// daemon is mgpu-enforcer (Command) running in a subprocess: the test
// binary re-executed in the enforcer role.
type daemon struct {
	cmd    *exec.Cmd
	stderr *bytes.Buffer
}

func startDaemon(t *testing.T, env *testEnv) *daemon {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	cmd.Env = append(os.Environ(), "MGPU_TEST_ROLE="+roleEnforcer,
		"MGPU_TEST_ARGS=--device 0 --config "+env.cfgPath+" --log-level debug")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	d := &daemon{cmd: cmd, stderr: &stderr}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("enforcer stderr:\n%s", stderr.String())
		}
	})
	c := env.client()
	eventually(t, 10*time.Second, "enforcer answers", func() bool {
		_, err := c.Device(ctx)
		return err == nil
	})
	return d
}

// TestKillAndRestart: kill -9 of the enforcer, then a new one restores the
// instance, re-adopts the attached process's slot (bumping
// enforcer_epoch), keeps its counters, and still grants it.
func TestKillAndRestart(t *testing.T) {
	env := newEnv(t, nil)
	d := startDaemon(t, env)
	c := env.client()
	if _, err := c.Create(ctx, tree(os.Getpid(), 40, 2048)); err != nil {
		t.Fatal(err)
	}
	sl := startSleeper(t, nil)
	if _, err := c.Create(ctx, tree(sl.Process.Pid, 10, 10)); err != nil {
		t.Fatal(err)
	}
	res, err := attach.Dial(api.ClientSocket(env.runDir()), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	l, p := mapAttach(t, res)
	epoch := l.EnforcerEpoch.Load()
	// Act like the shim: work measured, memory reserved, a thread waiting.
	p.GPUNs.Store(7e6)
	p.Launches.Store(70)
	p.MemReserved.Store(512 << 20)
	p.Waiting.Store(1)
	eventually(t, 5*time.Second, "grant before the kill", func() bool { return l.Grant.Load() != 0 })

	if err := d.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = d.cmd.Wait()
	// The sleeper's tree dies while no enforcer runs.
	_ = sl.Process.Kill()
	_ = sl.Wait()
	p.Waiting.Store(0)
	// As if the dead enforcer had revoked the grant (through the host's
	// files: the process's own mapping is read-only).
	openRegion(t, env.runDir()+"/regions/mgpu0inst0").L().Grant.Store(0)

	startDaemon(t, env)
	list, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 1 || list[0].Name != "mgpu0inst0" || list[0].Processes != 1 || list[0].Core != 40 {
		t.Fatalf("restored %+v", list)
	}
	if got := l.EnforcerEpoch.Load(); got != epoch+1 {
		t.Fatalf("enforcer_epoch %d, want %d", got, epoch+1)
	}
	if p.PID.Load() != uint32(os.Getpid()) || p.MemReserved.Load() != 512<<20 {
		t.Fatalf("slot lost: pid %d mem %d", p.PID.Load(), p.MemReserved.Load())
	}
	stats, _ := c.Stats(ctx)
	if stats[0].GPUNs != 7e6 || stats[0].MemoryUsedBytes != 512<<20 {
		t.Fatalf("stats after restart %+v", stats[0])
	}
	// The attached process keeps working: it waits, and is granted.
	p.Waiting.Store(1)
	eventually(t, 5*time.Second, "grant after the restart", func() bool { return l.Grant.Load() != 0 })
	hb := l.HeartbeatNs.Load()
	eventually(t, 5*time.Second, "heartbeat moves", func() bool { return l.HeartbeatNs.Load() > hb })
	if dev, _ := c.Device(ctx); dev.EnforcerEpoch < 2 {
		t.Fatalf("device epoch %d", dev.EnforcerEpoch)
	}
}

func TestSignalShutdownKeepsInstances(t *testing.T) {
	env := newEnv(t, nil)
	d := startDaemon(t, env)
	c := env.client()
	if _, err := c.Create(ctx, tree(os.Getpid(), 40, 2048)); err != nil {
		t.Fatal(err)
	}
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := d.cmd.Wait(); err != nil {
		t.Fatalf("exit after SIGTERM: %v\n%s", err, d.stderr)
	}
	if _, err := os.Stat(api.ControlSocket(env.runDir())); !os.IsNotExist(err) {
		t.Fatalf("control socket left behind: %v", err)
	}
	if _, err := os.Stat(env.runDir() + "/regions/mgpu0inst0"); err != nil {
		t.Fatalf("region gone: %v", err)
	}
	if _, err := c.List(ctx); err == nil || !strings.Contains(err.Error(), "not running") {
		t.Fatalf("list without enforcer: %v", err)
	}
	startDaemon(t, env)
	if l, _ := c.List(ctx); len(l) != 1 {
		t.Fatalf("after restart %+v", l)
	}
}

func TestCorruptStateBinaryOneLine(t *testing.T) {
	env := newEnv(t, nil)
	_ = os.MkdirAll(env.cfg.DeviceStateDir(0), 0o700)
	if err := os.WriteFile(env.statePath(), []byte("{garbage"), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "MGPU_TEST_ROLE="+roleEnforcer, "MGPU_TEST_ARGS=--device 0 --config "+env.cfgPath)
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatal("started with a corrupt state file")
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != 1 || !strings.HasPrefix(lines[0], "mgpu-enforcer: state file "+env.statePath()+" is corrupt") {
		t.Fatalf("output %q", out)
	}
}

// TestPolicyChangeWaitsForEmpty: a config that changes the policy of a
// device with instances is refused at restart; the device keeps its policy
// until it is empty, then switches.
func TestPolicyChangeWaitsForEmpty(t *testing.T) {
	env := newEnv(t, nil)
	_, stop := env.start(t)
	c := env.client()
	if _, err := c.Create(ctx, tree(os.Getpid(), 40, 2048)); err != nil {
		t.Fatal(err)
	}
	stop()
	env.writeConfig(t, withPolicy("native-burst-share"))
	e, _ := env.start(t)
	dev, err := c.Device(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if dev.Policy != "fixed-share" || dev.ConfiguredPolicy != "native-burst-share" || dev.Instances != 1 {
		t.Fatalf("device %+v", dev)
	}
	// New instances are admitted under the running policy.
	if _, err := c.Create(ctx, api.CreateRequest{Kind: api.KindProcessTree, PID: os.Getpid(), Policy: "native-burst-share", Core: 10, MemoryMiB: 1}); err == nil ||
		err.Error() != "device 0 runs fixed-share, process tree asks native-burst-share" {
		t.Fatalf("create under the old policy: %v", err)
	}
	if _, err := c.Destroy(ctx, "mgpu0inst0"); err != nil {
		t.Fatal(err)
	}
	if dev, _ := c.Device(ctx); dev.Policy != "native-burst-share" || dev.PolicyCode != 2 {
		t.Fatalf("after empty: %+v", dev)
	}
	// SIGHUP-style reload on an empty device applies at once.
	env.writeConfig(t, withPolicy("guaranteed-burst-share"))
	if err := e.Reload(env.cfg); err != nil {
		t.Fatal(err)
	}
	if dev, _ := c.Device(ctx); dev.Policy != "guaranteed-burst-share" {
		t.Fatalf("after reload: %+v", dev)
	}
}

// TestRestoreUnderResizeStorm: a process holding its slot's writable
// descriptor tries to shrink and grow it as fast as it can while the
// enforcer is closed and made again, restoreIterations times (in process,
// New and Close: New restores, as a restarted enforcer does; test/tenants
// kills and restarts real enforcers). Every attempt is refused (the slot
// is a sealed memfd), the enforcer never faults (it would take this test
// process with it), restores both instances with their processes and
// counters every time, the neighbour's grant works afterwards, and the run
// directory does not grow.
func TestRestoreUnderResizeStorm(t *testing.T) {
	const restoreIterations = 1000
	env := newEnv(t, nil)
	var logs syncBuffer
	quiet := WithLogger(slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn})))
	_, stop := env.start(t, quiet)
	c := env.client()
	if _, err := c.Create(ctx, tree(os.Getpid(), 40, 2048)); err != nil {
		t.Fatal(err)
	}
	sock := api.ClientSocket(env.runDir())
	res, err := attach.Dial(sock, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	own, err := unix.FcntlInt(res.Own.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(own)
	slot := int(res.Slot)
	_, p := mapAttach(t, res)
	p.GPUNs.Store(7e6)
	p.MemReserved.Store(512 << 20)
	h := startHelper(t, sock, nil) // the honest neighbour
	if _, err := c.Create(ctx, tree(h.cmd.Process.Pid, 30, 100)); err != nil {
		t.Fatal(err)
	}
	if line := h.attach(t); line != "ok slot=0 instance=1" {
		t.Fatalf("helper: %s", line)
	}
	stop()
	before := duBytes(t, env.runDir())

	var attempts, resized atomic.Int64
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-done:
				return
			default:
			}
			for _, err := range []error{
				unix.Ftruncate(own, 0),
				unix.Ftruncate(own, 64<<20),
				unix.Fallocate(own, 0, 0, 64<<20),
				unix.Ftruncate(own, region.ProcFileSize/2),
			} {
				attempts.Add(1)
				if err == nil {
					resized.Add(1)
				}
			}
		}
	}()
	t0 := time.Now()
	most := before
	for i := range restoreIterations {
		e, err := New(env.cfg, 0, quiet)
		if err != nil {
			t.Fatalf("restore %d: %v\n%s", i, err, logs.String())
		}
		e.mu.Lock()
		var got []string
		var gpu, mem uint64
		for _, in := range e.list {
			got = append(got, fmt.Sprintf("%s:%d", in.name, in.nused))
		}
		if len(e.list) == 2 && e.list[0].slotUsed(slot) {
			pa := e.list[0].reg.Proc(slot)
			gpu, mem = pa.GPUNs.Load(), pa.MemReserved.Load()
		}
		e.mu.Unlock()
		e.Close()
		if strings.Join(got, " ") != "mgpu0inst0:1 mgpu0inst1:1" || gpu != 7e6 || mem != 512<<20 {
			t.Fatalf("restore %d: instances %v, slot %d: gpu_ns %d, mem_reserved %d\n%s", i, got, slot, gpu, mem, logs.String())
		}
		if i%50 == 0 {
			most = max(most, duBytes(t, env.runDir()))
		}
	}
	took := time.Since(t0)
	close(done)
	wg.Wait()
	after := duBytes(t, env.runDir())
	most = max(most, after)
	t.Logf("%d restores in %v (%v each) under %d resize attempts; run directory %d bytes before, %d at most, %d after",
		restoreIterations, took.Round(time.Millisecond), (took / restoreIterations).Round(time.Microsecond), attempts.Load(), before, most, after)
	if n := resized.Load(); n != 0 {
		t.Fatalf("%d of %d resize attempts succeeded", n, attempts.Load())
	}
	if most > before+16<<10 {
		t.Fatalf("the run directory grew from %d to %d bytes", before, most)
	}
	for _, bad := range []string{"fault", "no more", "unusable", "level=ERROR"} {
		if strings.Contains(logs.String(), bad) {
			t.Fatalf("the enforcer's log has %q:\n%s", bad, logs.String())
		}
	}
	// A running enforcer after all that: both instances, the counters, and
	// the neighbour's grant when it waits.
	env.start(t, quiet)
	st, err := c.Stats(ctx)
	if err != nil || len(st) != 2 || st[0].GPUNs != 7e6 || st[0].MemoryUsedBytes != 512<<20 || len(st[1].Processes) != 1 {
		t.Fatalf("stats %+v, %v", st, err)
	}
	nb := openRegion(t, env.runDir()+"/regions/mgpu0inst1")
	nb.Proc(0).Waiting.Store(1)
	eventually(t, 5*time.Second, "the neighbour's grant", func() bool { return nb.L().Grant.Load() != 0 })
	h.exit()
}

// duBytes is the space the files under dir take (st_blocks), as du counts.
func duBytes(t testing.TB, dir string) int64 {
	t.Helper()
	var n int64
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(path, &st); err == nil {
			n += st.Blocks * 512
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}
