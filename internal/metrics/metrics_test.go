package metrics

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/mgpu-dev/mgpu/enforcer/api"
)

// fake is an enforcer's answers.
type fake struct {
	dev   api.DeviceResponse
	insts []api.Instance
	stats []api.InstanceStats
	err   error
	block chan struct{} // when set, requests wait for it or their context
}

func (f *fake) wait(ctx context.Context) error {
	if f.block == nil {
		return f.err
	}
	select {
	case <-f.block:
		return f.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (f *fake) Device(ctx context.Context) (api.DeviceResponse, error) { return f.dev, f.wait(ctx) }
func (f *fake) List(ctx context.Context) ([]api.Instance, error)       { return f.insts, f.wait(ctx) }
func (f *fake) Stats(ctx context.Context) ([]api.InstanceStats, error) { return f.stats, f.wait(ctx) }

func twoInstances() *fake {
	return &fake{
		dev: api.DeviceResponse{
			Index: 0, UUID: "GPU-0", Name: "Sim GPU", MemoryMiB: 16384, Policy: "fixed-share", PolicyCode: 0,
			Instances: 2, CoreSum: 50, CoreFree: 50, MemoryAllocatedMiB: 3072, MemoryFreeMiB: 13312, BusyNs: 12_500_000_000,
		},
		insts: []api.Instance{
			{Name: "mgpu0inst0", Device: 0, Kind: api.KindContainer, ContainerID: "c0", Policy: "fixed-share", Core: 20, MemoryMiB: 1024},
			{
				Name: "mgpu0inst1", Device: 0, Kind: api.KindContainer, ContainerID: "c1", Policy: "fixed-share", Core: 30, MemoryMiB: 2048,
				Pod: &api.PodRef{Namespace: "ml", Name: "train-0", Container: "main"},
			},
		},
		stats: []api.InstanceStats{
			{Name: "mgpu0inst0", Core: 20, GPUNs: 4_000_000_000, ThrottledNs: 7_000_000_000, DemandThrottledNs: 3_000_000_000, Launches: 42, QueuedNs: 2_000_000, MemoryUsedBytes: 512 << 20, MemoryLimitBytes: 1 << 30, Processes: []api.Process{{PID: 10}}, Violations: 2},
			// an instance admitted and never used: its series exist all the same
			{Name: "mgpu0inst1", Core: 30, MemoryLimitBytes: 2 << 30, Processes: []api.Process{}},
		},
	}
}

func TestCollect(t *testing.T) {
	c := New([]Target{{Index: 0, UUID: "GPU-0", Source: twoInstances()}}, time.Second)
	want := `
# HELP mgpu_instance_gpu_seconds_total Measured GPU time of the instance's processes, exited ones included.
# TYPE mgpu_instance_gpu_seconds_total counter
mgpu_instance_gpu_seconds_total{container="",container_id="c0",device="0",mgpu_instance="mgpu0inst0",namespace="",pod=""} 4
mgpu_instance_gpu_seconds_total{container="main",container_id="c1",device="0",mgpu_instance="mgpu0inst1",namespace="ml",pod="train-0"} 0
# HELP mgpu_instance_compute_quota_ratio The instance's compute quota (core / 100; under native-burst-share its weight / 100).
# TYPE mgpu_instance_compute_quota_ratio gauge
mgpu_instance_compute_quota_ratio{container="",container_id="c0",device="0",mgpu_instance="mgpu0inst0",namespace="",pod=""} 0.2
mgpu_instance_compute_quota_ratio{container="main",container_id="c1",device="0",mgpu_instance="mgpu0inst1",namespace="ml",pod="train-0"} 0.3
# HELP mgpu_instance_memory_quota_bytes The instance's device-memory quota.
# TYPE mgpu_instance_memory_quota_bytes gauge
mgpu_instance_memory_quota_bytes{container="",container_id="c0",device="0",mgpu_instance="mgpu0inst0",namespace="",pod=""} 1.073741824e+09
mgpu_instance_memory_quota_bytes{container="main",container_id="c1",device="0",mgpu_instance="mgpu0inst1",namespace="ml",pod="train-0"} 2.147483648e+09
# HELP mgpu_instance_throttled_seconds_total Wall time the instance wanted the GPU and the arbiter gave it to another.
# TYPE mgpu_instance_throttled_seconds_total counter
mgpu_instance_throttled_seconds_total{container="",container_id="c0",device="0",mgpu_instance="mgpu0inst0",namespace="",pod=""} 3
mgpu_instance_throttled_seconds_total{container="main",container_id="c1",device="0",mgpu_instance="mgpu0inst1",namespace="ml",pod="train-0"} 0
# HELP mgpu_instance_violations_total Violations of the instance's quotas the driver backstop found (episodes; 0 while it is off).
# TYPE mgpu_instance_violations_total counter
mgpu_instance_violations_total{container="",container_id="c0",device="0",mgpu_instance="mgpu0inst0",namespace="",pod=""} 2
mgpu_instance_violations_total{container="main",container_id="c1",device="0",mgpu_instance="mgpu0inst1",namespace="ml",pod="train-0"} 0
# HELP mgpu_device_busy_seconds_total Measured GPU time of the device's instances, and of those released since the enforcer started.
# TYPE mgpu_device_busy_seconds_total counter
mgpu_device_busy_seconds_total{device="0",uuid="GPU-0"} 12.5
# HELP mgpu_device_up 1 when the device's enforcer answered this scrape, else 0.
# TYPE mgpu_device_up gauge
mgpu_device_up{device="0",uuid="GPU-0"} 1
# HELP mgpu_device_memory_free_bytes Device memory not allocated to instances' quotas.
# TYPE mgpu_device_memory_free_bytes gauge
mgpu_device_memory_free_bytes{device="0",uuid="GPU-0"} 1.3958643712e+10
`
	names := []string{"mgpu_instance_gpu_seconds_total", "mgpu_instance_compute_quota_ratio", "mgpu_instance_memory_quota_bytes",
		"mgpu_instance_throttled_seconds_total", "mgpu_instance_violations_total", "mgpu_device_busy_seconds_total",
		"mgpu_device_up", "mgpu_device_memory_free_bytes"}
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), names...); err != nil {
		t.Error(err)
	}
	// Every metric: lint clean (units, _total on counters), and one series
	// per instance or device.
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	problems, err := testutil.GatherAndLint(reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if len(mfs) != len(Metrics()) {
		t.Errorf("gathered %d metrics, Metrics() lists %d", len(mfs), len(Metrics()))
	}
	for _, mf := range mfs {
		want := 2
		if strings.HasPrefix(mf.GetName(), "mgpu_device_") {
			want = 1
		}
		if len(mf.GetMetric()) != want {
			t.Errorf("%s: %d series, want %d", mf.GetName(), len(mf.GetMetric()), want)
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "instance" || l.GetName() == "job" {
					t.Errorf("%s has a label %q, which Prometheus sets itself", mf.GetName(), l.GetName())
				}
			}
		}
	}
}

// An enforcer that does not answer: its device reads up 0 and nothing
// else, the other devices are unaffected, and the scrape ends within the
// timeout.
func TestCollectEnforcerDown(t *testing.T) {
	hung := &fake{block: make(chan struct{})}
	defer close(hung.block)
	down := &fake{err: errors.New("connection refused")}
	c := New([]Target{{Index: 0, UUID: "GPU-0", Source: twoInstances()}, {Index: 1, UUID: "GPU-1", Source: down}, {Index: 2, UUID: "GPU-2", Source: hung}}, 200*time.Millisecond)
	start := time.Now()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("the scrape took %v with a hung enforcer and a 200ms timeout", d)
	}
	up := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			dev := label(m, "device")
			if mf.GetName() == "mgpu_device_up" {
				up[dev] = m.GetGauge().GetValue()
			} else if dev != "0" {
				t.Errorf("%s for device %s, whose enforcer did not answer", mf.GetName(), dev)
			}
		}
	}
	if up["0"] != 1 || up["1"] != 0 || up["2"] != 0 {
		t.Errorf("mgpu_device_up = %v, want 1, 0, 0", up)
	}
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// docs/metrics.md names every metric with its type.
func TestDocsListEveryMetric(t *testing.T) {
	_, file, _, _ := runtime.Caller(0)
	doc, err := os.ReadFile(filepath.Join(filepath.Dir(file), "..", "..", "docs", "metrics.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range Metrics() {
		row := "| `" + m.Name + "` | " + m.Type + " |"
		if !strings.Contains(string(doc), row) {
			t.Errorf("docs/metrics.md has no row starting %q", row)
		}
	}
}
