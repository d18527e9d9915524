package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
	"github.com/mgpu-dev/mgpu/internal/metrics"
)

// fakeEnforcer answers like a device's enforcer, from fixed data.
type fakeEnforcer struct {
	device api.DeviceResponse
	list   []api.Instance
	stats  []api.InstanceStats
	err    error
}

func (f *fakeEnforcer) Device(context.Context) (api.DeviceResponse, error) { return f.device, f.err }
func (f *fakeEnforcer) List(context.Context) ([]api.Instance, error)       { return f.list, f.err }
func (f *fakeEnforcer) Stats(context.Context) ([]api.InstanceStats, error) { return f.stats, f.err }

// t0 is when the fake node's first sample is taken.
var t0 = time.Date(2026, 12, 4, 20, 0, 0, 0, time.UTC)

const (
	fakeUUID0 = "GPU-5a1e0000-0000-4000-8000-000000000000"
	fakeUUID1 = "GPU-5a1e0000-0000-4000-8000-000000000001"
)

// fakeDevices are the fake node's GPUs: 80 GiB, and 23028 MiB (22.49 GiB,
// an A10's) to show the rounding.
func fakeDevices() []device.Info {
	return []device.Info{
		{Index: 0, UUID: fakeUUID0, Name: "Simulated-GPU-80GB", MemoryBytes: 81920 << 20},
		{Index: 1, UUID: fakeUUID1, Name: "Simulated-GPU-24GB", MemoryBytes: 23028 << 20},
	}
}

// fakeNodeConfig writes a sim node configuration with fakeDevices' GPUs and
// its run and state directories in a temporary directory (no enforcer
// runs there).
func fakeNodeConfig(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	toml := fmt.Sprintf(`version = 1
backend = "sim"
run_dir = %q
state_dir = %q

[[sim.gpu]]
name = "Simulated-GPU-80GB"
memory_mib = 81920
uuid = %q

[[sim.gpu]]
name = "Simulated-GPU-24GB"
memory_mib = 23028
uuid = %q
`, filepath.Join(dir, "run"), filepath.Join(dir, "state"), fakeUUID0, fakeUUID1)
	path := filepath.Join(dir, "node.toml")
	if err := os.WriteFile(path, []byte(toml), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// fakeDevice0 is device 0's enforcer at sample step (0 or 1, a second
// apart): two instances, one of them a Kubernetes pod's container; busy
// 620 ms of the second, mgpu0inst0 410 ms (throttled 120 ms), mgpu0inst1
// 205 ms.
func fakeDevice0(step int) *fakeEnforcer {
	s := uint64(step)
	created := t0.Add(-time.Hour)
	return &fakeEnforcer{
		device: api.DeviceResponse{
			Index: 0, UUID: fakeUUID0, Name: "Simulated-GPU-80GB", MemoryMiB: 81920,
			Policy: "fixed-share", PolicyCode: 0, ConfiguredPolicy: "fixed-share", TimesliceMS: 100, MaxInstances: 16,
			Instances: 2, CoreSum: 80, CoreFree: 20, MemoryAllocatedMiB: 8192 + 4000, MemoryFreeMiB: 81920 - 8192 - 4000,
			EnforcerPID: 1234, EnforcerEpoch: 1, Started: t0.Add(-2 * time.Hour),
			BusyNs: 500e9 + s*620e6,
		},
		list: []api.Instance{{
			Name: "mgpu0inst0", Device: 0, ID: 0, Kind: api.KindContainer,
			ContainerID: "3f2a9c0d1b7e4f5a8c6d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b", PID: 4242,
			Policy: "fixed-share", Core: 50, MemoryMiB: 8192, Created: created, Processes: 1,
			Pod: &api.PodRef{Namespace: "ml", Name: "trainer-7d9f8-x2x4q", Container: "pytorch"},
		}, {
			Name: "mgpu0inst1", Device: 0, ID: 1, Kind: api.KindContainer,
			ContainerID: "9b1c7e2a5d3f4e6a8b0c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e1f2a", PID: 5151,
			Policy: "fixed-share", Core: 30, MemoryMiB: 4000, Created: created.Add(time.Minute), Processes: 2,
		}},
		stats: []api.InstanceStats{{
			Name: "mgpu0inst0", Core: 50, GPUNs: 300e9 + s*410e6, DemandThrottledNs: 20e9 + int64(step)*120e6,
			MemoryUsedBytes: 2048<<20 + 1, MemoryLimitBytes: 8192 << 20, Processes: []api.Process{{PID: 4300}},
		}, {
			Name: "mgpu0inst1", Core: 30, GPUNs: 100e9 + s*205e6, DemandThrottledNs: 5e9,
			MemoryUsedBytes: 100 << 20, MemoryLimitBytes: 4000 << 20, Processes: []api.Process{{PID: 5200}, {PID: 5201}},
		}},
	}
}

// errNotListening is what the client returns when no enforcer runs.
var errNotListening = fmt.Errorf("%w (no one listens on /run/mgpu/gpu1/control.sock)", api.ErrNotRunning)

// fakeSources are the fake node's enforcers at sample step: device 0's, and
// none on device 1.
func fakeSources(step int) []metrics.Source {
	return []metrics.Source{fakeDevice0(step), &fakeEnforcer{err: errNotListening}}
}

// fakeSample samples the fake node at step, taken at t0 + step seconds.
func fakeSample(step int) nodeSample {
	at := t0.Add(time.Duration(step) * time.Second)
	return sampleNode(context.Background(), fakeDevices(), fakeSources(step), true, func() time.Time { return at })
}

// useFakeDevice0 makes the commands read fakeDevice0(0) as device 0's
// enforcer; the other devices keep their real (absent) enforcers.
func useFakeDevice0(t *testing.T) {
	t.Helper()
	orig := sourceOf
	sourceOf = func(cfg *config.Config, index int) metrics.Source {
		if index == 0 {
			return fakeDevice0(0)
		}
		return orig(cfg, index)
	}
	t.Cleanup(func() { sourceOf = orig })
}

func TestInspectReport(t *testing.T) {
	r := newInspectReport("node-a", "192.0.2.7", fakeSample(0))
	want := inspectReport{Node: "node-a", IP: "192.0.2.7", GPUs: []inspectGPU{
		{Index: 0, UUID: fakeUUID0, AllocatedMiB: 12192, TotalMiB: 81920, Instances: 2, Running: true},
		{Index: 1, UUID: fakeUUID1, TotalMiB: 23028, Error: "device 1: the enforcer is not running (start it: systemctl start mgpu-enforcer@1)"},
	}, AllocatedMiB: 12192, TotalMiB: 81920 + 23028}
	if fmt.Sprint(r) != fmt.Sprint(want) {
		t.Fatalf("report\n%+v\nwant\n%+v", r, want)
	}
}

func TestGiB(t *testing.T) {
	for _, tc := range []struct{ mib, want uint64 }{
		{0, 0}, {1, 1}, {1023, 1}, {1024, 1}, {1025, 2}, {12192, 12}, {23028, 23}, {81920, 80},
	} {
		if got := gib(tc.mib); got != tc.want {
			t.Errorf("gib(%d) = %d, want %d", tc.mib, got, tc.want)
		}
	}
}

func TestWriteInspect(t *testing.T) {
	for _, tc := range []struct {
		name string
		r    inspectReport
		want string
	}{{
		// The seed's node: 15 GiB GPUs, 24 of 60 GiB allocated.
		name: "seed",
		r: inspectReport{Node: "cn-shanghai.192.0.2.109", IP: "192.0.2.109", GPUs: []inspectGPU{
			{Index: 0, AllocatedMiB: 15 << 10, TotalMiB: 15 << 10, Running: true},
			{Index: 1, AllocatedMiB: 9 << 10, TotalMiB: 15 << 10, Running: true},
			{Index: 2, TotalMiB: 15 << 10, Running: true},
			{Index: 3, TotalMiB: 15 << 10, Running: true},
		}},
		want: "" +
			"NAME                     IPADDRESS    GPU0(Allocated/Total)  GPU1(Allocated/Total)  GPU2(Allocated/Total)  GPU3(Allocated/Total)  GPU Memory(GiB)\n" +
			"cn-shanghai.192.0.2.109  192.0.2.109  15/15                  9/15                   0/15                   0/15                   24/60\n" +
			strings.Repeat("-", 145) + "\n" +
			"Allocated/Total GPU Memory In Cluster:\n" +
			"24/60 (40%)\n",
	}, {
		name: "rounding and no enforcer",
		r: inspectReport{Node: "n", IP: "-", GPUs: []inspectGPU{
			{Index: 0, AllocatedMiB: 1, TotalMiB: 23028, Running: true},
			{Index: 1, AllocatedMiB: 0, TotalMiB: 23028, Running: false},
		}},
		want: "" +
			"NAME  IPADDRESS  GPU0(Allocated/Total)  GPU1(Allocated/Total)  GPU Memory(GiB)\n" +
			"n     -          1/23                   -/23                   1/46\n" +
			strings.Repeat("-", 78) + "\n" +
			"Allocated/Total GPU Memory In Cluster:\n" +
			"1/46 (2%)\n",
	}, {
		name: "no GPU",
		r:    inspectReport{Node: "n", IP: "-"},
		want: "NAME  IPADDRESS  GPU Memory(GiB)\n" +
			"n     -          0/0\n" +
			strings.Repeat("-", 32) + "\n" +
			"Allocated/Total GPU Memory In Cluster:\n" +
			"0/0 (0%)\n",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			var b strings.Builder
			if err := writeInspect(&b, tc.r); err != nil {
				t.Fatal(err)
			}
			if b.String() != tc.want {
				t.Errorf("got\n%s\nwant\n%s", b.String(), tc.want)
			}
		})
	}
}

func TestInspectCommand(t *testing.T) {
	useFakeDevice0(t)
	cfg := fakeNodeConfig(t)
	args := []string{"--config", cfg, "inspect", "--node-name", "gpu-node-1", "--ip", "192.0.2.7"}

	out, stderr, code := run(t, args...)
	if code != 0 {
		t.Fatalf("status %d: %s", code, stderr)
	}
	golden(t, "inspect.txt", out)
	if want := "mgpu: note: device 1: the enforcer is not running (start it: systemctl start mgpu-enforcer@1)\n"; stderr != want {
		t.Errorf("stderr %q, want %q", stderr, want)
	}

	out, stderr, code = run(t, append(args, "--output", "json")...)
	if code != 0 {
		t.Fatalf("json: status %d: %s", code, stderr)
	}
	golden(t, "inspect.json", out)
	var r map[string]any
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"node", "ip", "gpus", "allocated_mib", "total_mib"} {
		if _, ok := r[k]; !ok {
			t.Errorf("no %q in %s", k, out)
		}
	}
	gpus, _ := r["gpus"].([]any)
	if len(gpus) != 2 {
		t.Fatalf("gpus: %v", r["gpus"])
	}
	for _, k := range []string{"index", "uuid", "allocated_mib", "total_mib", "instances", "running"} {
		if _, ok := gpus[0].(map[string]any)[k]; !ok {
			t.Errorf("no %q in gpus[0]", k)
		}
	}
}

// TestInspectDefaults: without --node-name and --ip, the host's name and an
// address (or -) are shown, and every GPU without an enforcer shows -/80.
func TestInspectDefaults(t *testing.T) {
	out, _, code := run(t, "--config", simNode, "inspect")
	host, _ := os.Hostname()
	lines := strings.Split(out, "\n")
	if code != 0 || len(lines) != 6 || !strings.HasPrefix(lines[1], host+"  ") {
		t.Fatalf("status %d:\n%s", code, out)
	}
	f := strings.Fields(lines[1])
	if len(f) != 5 || (f[1] != "-" && strings.Count(f[1], ".") != 3) || f[2] != "-/80" || f[3] != "-/80" || f[4] != "0/160" {
		t.Errorf("row %q", lines[1])
	}
	if lines[4] != "0/160 (0%)" {
		t.Errorf("summary %q", lines[4])
	}
}

// TestInspectLive reads a running enforcer.
func TestInspectLive(t *testing.T) {
	n := startLiveNode(t)
	if _, err := n.client().Create(context.Background(), api.CreateRequest{Kind: api.KindProcessTree, PID: os.Getpid(), Core: 30, MemoryMiB: 4097}); err != nil {
		t.Fatal(err)
	}
	out, _, code := n.run(t, "inspect", "--node-name", "n", "--ip", "-")
	if code != 0 || !strings.Contains(out, "\nn     -          5/80                   -/80                   5/160\n") ||
		!strings.HasSuffix(out, "\n5/160 (3%)\n") {
		t.Fatalf("status %d:\n%s", code, out)
	}
	out, _, _ = n.run(t, "inspect", "-o", "json")
	var r inspectReport
	if err := json.Unmarshal([]byte(out), &r); err != nil || len(r.GPUs) != 2 {
		t.Fatalf("%v: %s", err, out)
	}
	if g := r.GPUs[0]; !g.Running || g.AllocatedMiB != 4097 || g.Instances != 1 || g.TotalMiB != 81920 || r.GPUs[1].Running {
		t.Errorf("%+v", r)
	}
}

func TestInspectErrors(t *testing.T) {
	for _, tc := range []struct {
		name   string
		args   []string
		stderr string
	}{
		{"bad output", []string{"-o", "yaml"}, `unknown --output "yaml" (want table or json)`},
		{"argument", []string{"node-b"}, `inspect takes no arguments, got "node-b"`},
		{"bad ip", []string{"--ip", "host"}, `--ip "host" is not an IP address`},
		{"empty node name", []string{"--node-name", ""}, "--node-name is empty"},
		{"unknown flag", []string{"--nodes"}, "flag provided but not defined: -nodes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, stderr, code := run(t, append([]string{"--config", simNode, "inspect"}, tc.args...)...)
			if code != exitUsage || out != "" || stderr != "mgpu: "+tc.stderr+"\n" {
				t.Errorf("status %d stdout %q stderr %q, want %d and %q", code, out, stderr, exitUsage, tc.stderr)
			}
		})
	}
}

func TestSampleNodeErrors(t *testing.T) {
	denied := errors.New("enforcer at /run/mgpu/gpu0/control.sock: dial unix: permission denied")
	devs := fakeDevices()
	s := sampleNode(context.Background(), devs, []metrics.Source{&fakeEnforcer{err: denied}, &fakeEnforcer{err: errNotListening}}, true, time.Now)
	if len(s.Devices) != 2 || s.Devices[0].Running() || s.Devices[0].NotRunning() || !s.Devices[1].NotRunning() {
		t.Fatalf("%+v", s)
	}
	if got, want := s.Devices[0].Problem(), "device 0: "+denied.Error(); got != want {
		t.Errorf("problem %q, want %q", got, want)
	}
	// Only the device answer is asked for without instances.
	s = sampleNode(context.Background(), devs[:1], []metrics.Source{&onlyDevice{fakeDevice0(0)}}, false, time.Now)
	if !s.Devices[0].Running() || s.Devices[0].Instances != nil {
		t.Fatalf("%+v", s)
	}
}

// onlyDevice fails the calls other than Device.
type onlyDevice struct{ *fakeEnforcer }

func (onlyDevice) List(context.Context) ([]api.Instance, error) {
	return nil, errors.New("unexpected List")
}
func (onlyDevice) Stats(context.Context) ([]api.InstanceStats, error) {
	return nil, errors.New("unexpected Stats")
}
