package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer"
	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/config"
)

// liveNode is a simulated node whose device 0 has an in-process enforcer.
type liveNode struct {
	cfgPath string
	cfg     *config.Config
	shim    string
}

func startLiveNode(t *testing.T) *liveNode {
	t.Helper()
	dir, err := os.MkdirTemp("", "mgpu-cli-live")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	b, err := os.ReadFile(simNodeFile)
	if err != nil {
		t.Fatal(err)
	}
	prefix := fmt.Sprintf("run_dir = %q\nstate_dir = %q\n", filepath.Join(dir, "run"), filepath.Join(dir, "state"))
	n := &liveNode{cfgPath: filepath.Join(dir, "node.toml"), shim: filepath.Join(dir, "libmgpu-shim.so")}
	if err := os.WriteFile(n.cfgPath, append([]byte(prefix), b...), 0o600); err != nil {
		t.Fatal(err)
	}
	// A stand-in for the shim: an empty file (the loader warns and goes on;
	// the commands run here never call CUDA).
	if err := os.WriteFile(n.shim, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if n.cfg, err = config.Load(n.cfgPath); err != nil {
		t.Fatal(err)
	}
	e, err := enforcer.New(n.cfg, 0)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return n
}

func (n *liveNode) client() *api.Client {
	return api.NewClient(api.ControlSocket(n.cfg.DeviceRunDir(0)))
}

func (n *liveNode) run(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	return run(t, append([]string{"--config", n.cfgPath}, args...)...)
}

func TestRunCommand(t *testing.T) {
	n := startLiveNode(t)
	out, errs, code := n.run(t, "run", "--device", "0", "--core", "30", "--memory", "1024", "--shim", n.shim, "--",
		"sh", "-c", `echo "$LD_PRELOAD|$MGPU_RUN_DIR|$MGPU_VISIBLE_DEVICES|$CUDA_VISIBLE_DEVICES"; exit 3`)
	if code != 3 {
		t.Fatalf("status %d, want 3 (stderr %s)", code, errs)
	}
	if want := n.shim + "|" + n.cfg.RunDir + "|0|0\n"; out != want {
		t.Fatalf("CMD saw %q, want %q", out, want)
	}
	if l, _ := n.client().List(context.Background()); len(l) != 0 {
		t.Fatalf("instance not released: %+v", l)
	}
	// A refusal prints the enforcer's line and runs nothing.
	out, errs, code = n.run(t, "run", "--device", "0", "--core", "30", "--memory", "1024", "--policy", "native-burst-share",
		"--shim", n.shim, "--", "echo", "ran")
	if code != 1 || out != "" || errs != "mgpu: device 0 runs fixed-share, process tree asks native-burst-share\n" {
		t.Fatalf("refusal: %d %q %q", code, out, errs)
	}
	if _, errs, code = n.run(t, "run", "--device", "0", "--core", "30", "--", "true"); code != 2 || !strings.Contains(errs, "--memory is required") {
		t.Fatalf("missing flag: %d %q", code, errs)
	}
	// --class: a bad value is a usage error; offline on a device without
	// online_offline_switch is the enforcer's refusal.
	if _, errs, code = n.run(t, "run", "--device", "0", "--core", "30", "--memory", "1", "--class", "batch", "--", "true"); code != 2 || !strings.Contains(errs, `--class "batch": want online or offline`) {
		t.Fatalf("bad class: %d %q", code, errs)
	}
	out, errs, code = n.run(t, "run", "--device", "0", "--core", "30", "--memory", "1", "--class", "offline", "--shim", n.shim, "--", "echo", "ran")
	if code != 1 || out != "" || !strings.Contains(errs, "mgpu: device 0 does not admit offline instances (online_offline_switch = 0)") {
		t.Fatalf("offline refused: %d %q %q", code, out, errs)
	}
}

// TestRunSignals: the instance lives while CMD runs, SIGTERM is forwarded,
// a SIGKILLed CMD gives 137, and the instance goes in both cases.
func TestRunSignals(t *testing.T) {
	n := startLiveNode(t)
	c := n.client()
	for _, tc := range []struct {
		name string
		send func(child int)
		want int
	}{
		{"sigterm forwarded", func(int) { _ = syscall.Kill(os.Getpid(), syscall.SIGTERM) }, 128 + 15},
		{"child killed", func(child int) { _ = syscall.Kill(child, syscall.SIGKILL) }, 128 + 9},
	} {
		t.Run(tc.name, func(t *testing.T) {
			codes := make(chan int, 1)
			go func() {
				_, _, code := n.run(t, "run", "--device", "0", "--core", "10", "--memory", "10", "--shim", n.shim, "--", "sleep", "60")
				codes <- code
			}()
			var child int
			deadline := time.Now().Add(10 * time.Second)
			for child == 0 {
				if time.Now().After(deadline) {
					t.Fatal("CMD did not start")
				}
				if l, _ := c.List(context.Background()); len(l) == 1 && l[0].PID == os.Getpid() {
					child = findChild(t, "sleep")
				}
				time.Sleep(time.Millisecond) // polling interval
			}
			tc.send(child)
			select {
			case code := <-codes:
				if code != tc.want {
					t.Fatalf("status %d, want %d", code, tc.want)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("mgpu-cli run did not return")
			}
			if l, _ := c.List(context.Background()); len(l) != 0 {
				t.Fatalf("instance not released: %+v", l)
			}
		})
	}
}

// findChild returns the pid of a child of this process running comm, or 0.
func findChild(t *testing.T, comm string) int {
	t.Helper()
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 || !strings.Contains(s[:i], "("+comm) {
			continue
		}
		f := strings.Fields(s[i+1:])
		if len(f) > 1 && f[1] == strconv.Itoa(os.Getpid()) {
			return pid
		}
	}
	return 0
}

func TestInstanceListAndLiveDeviceInfo(t *testing.T) {
	n := startLiveNode(t)
	c := n.client()
	if _, err := c.Create(context.Background(), api.CreateRequest{Kind: api.KindProcessTree, PID: os.Getpid(), Core: 30, MemoryMiB: 4096}); err != nil {
		t.Fatal(err)
	}
	out, errs, code := n.run(t, "instance", "list", "--device", "0")
	if code != 0 {
		t.Fatalf("status %d: %s", code, errs)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], "NAME") || !strings.HasPrefix(lines[1], "mgpu0inst0") ||
		!strings.Contains(lines[1], "fixed-share") || !strings.Contains(lines[1], "4096 MiB") {
		t.Fatalf("table:\n%s", out)
	}
	out, errs, code = n.run(t, "instance", "list", "-o", "json")
	var list []api.Instance
	if code != 0 || json.Unmarshal([]byte(out), &list) != nil || len(list) != 1 || list[0].Core != 30 {
		t.Fatalf("json %d %q %q", code, out, errs)
	}
	if !strings.Contains(errs, "no enforcer runs for device 1") {
		t.Fatalf("note about device 1 missing: %q", errs)
	}
	if _, errs, code = n.run(t, "instance", "list", "--device", "1"); code != 1 || !strings.Contains(errs, "device 1: the enforcer is not running") {
		t.Fatalf("device 1: %d %q", code, errs)
	}
	out, _, code = n.run(t, "device", "info", "--device", "0", "-o", "json")
	var reps []DeviceReport
	if code != 0 || json.Unmarshal([]byte(out), &reps) != nil || len(reps) != 1 {
		t.Fatalf("device info %d %q", code, out)
	}
	if r := reps[0]; r.ComputeFreeWeight != 70 || r.ComputeQoSEnabled != 1 || r.VmemFreeBytes != (81920-4096)<<20 {
		t.Fatalf("live report %+v", r)
	}
	out, _, code = n.run(t, "instance", "release", "mgpu0inst0")
	if code != 0 || out != "released mgpu0inst0\n" {
		t.Fatalf("release %d %q", code, out)
	}
	out, _, _ = n.run(t, "instance", "release", "mgpu0inst0")
	if out != "mgpu0inst0: no such instance (nothing to release)\n" {
		t.Fatalf("release again %q", out)
	}
}
