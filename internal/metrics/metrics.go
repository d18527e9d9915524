// Package metrics exports the node's GPU sharing state as Prometheus
// metrics: one collector reads every device's enforcer through its control
// API at each scrape (docs/metrics.md lists every metric).
//
// A scrape costs each enforcer three API requests; the enforcer builds the
// answers under its lock and writes them after releasing it, so a
// collection never holds the arbitration loop's lock across I/O.
package metrics

import (
	"context"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/mgpu-dev/mgpu/enforcer/api"
)

// Source is one device's enforcer (*api.Client implements it).
type Source interface {
	Device(ctx context.Context) (api.DeviceResponse, error)
	List(ctx context.Context) ([]api.Instance, error)
	Stats(ctx context.Context) ([]api.InstanceStats, error)
}

// Target is a device of the node and its enforcer.
type Target struct {
	Index  int    // NVML index
	UUID   string // the device's UUID (a label of the device's series)
	Source Source
}

// DefaultTimeout bounds the requests to one enforcer during a scrape.
const DefaultTimeout = 2 * time.Second

// Collector is a prometheus.Collector of the node's devices and instances.
type Collector struct {
	targets []Target
	timeout time.Duration
}

// New returns a collector of the targets; timeout <= 0 selects
// DefaultTimeout.
func New(targets []Target, timeout time.Duration) *Collector {
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	return &Collector{targets: targets, timeout: timeout}
}

var (
	deviceLabels   = []string{"device", "uuid"}
	instanceLabels = []string{"device", "mgpu_instance", "container_id", "namespace", "pod", "container"}
)

type desc struct {
	d    *prometheus.Desc
	name string
	typ  prometheus.ValueType
	help string
	unit string
}

func newDesc(name string, typ prometheus.ValueType, unit, help string, labels []string, extra ...string) desc {
	return desc{
		d:    prometheus.NewDesc(name, help, append(append([]string{}, labels...), extra...), nil),
		name: name, typ: typ, help: help, unit: unit,
	}
}

// The metrics. docs/metrics.md documents each; TestDocsListEveryMetric
// keeps the two in step.
var (
	devUp        = newDesc("mgpu_device_up", prometheus.GaugeValue, "", "1 when the device's enforcer answered this scrape, else 0.", deviceLabels)
	devInfo      = newDesc("mgpu_device_info", prometheus.GaugeValue, "", "Always 1: the device's name and compute policy as labels.", deviceLabels, "name", "policy")
	devPolicy    = newDesc("mgpu_device_compute_policy", prometheus.GaugeValue, "", "The compute policy the device runs: 0 fixed-share, 1 guaranteed-burst-share, 2 native-burst-share (compute_policy of mgpu-cli device info).", deviceLabels)
	devBusy      = newDesc("mgpu_device_busy_seconds_total", prometheus.CounterValue, "seconds", "Measured GPU time of the device's instances, and of those released since the enforcer started.", deviceLabels)
	devFreeW     = newDesc("mgpu_device_compute_free_weight", prometheus.GaugeValue, "", "Compute weight not allocated to instances (100 minus the sum of their cores, at least 0).", deviceLabels)
	devMemTotal  = newDesc("mgpu_device_memory_total_bytes", prometheus.GaugeValue, "bytes", "Device memory.", deviceLabels)
	devMemFree   = newDesc("mgpu_device_memory_free_bytes", prometheus.GaugeValue, "bytes", "Device memory not allocated to instances' quotas.", deviceLabels)
	devInstances = newDesc("mgpu_device_instances", prometheus.GaugeValue, "", "Instances admitted on the device.", deviceLabels)

	instInfo      = newDesc("mgpu_instance_info", prometheus.GaugeValue, "", "Always 1: the instance's compute policy, kind, priority class (online, offline) and DRA ResourceClaim (\"\" when none) as labels.", instanceLabels, "policy", "kind", "class", "claim")
	instMemQuota  = newDesc("mgpu_instance_memory_quota_bytes", prometheus.GaugeValue, "bytes", "The instance's device-memory quota.", instanceLabels)
	instMemUsed   = newDesc("mgpu_instance_memory_used_bytes", prometheus.GaugeValue, "bytes", "Device memory the instance's processes hold (what the shims reserved).", instanceLabels)
	instQuota     = newDesc("mgpu_instance_compute_quota_ratio", prometheus.GaugeValue, "ratio", "The instance's compute quota (core / 100; under native-burst-share its weight / 100).", instanceLabels)
	instGPU       = newDesc("mgpu_instance_gpu_seconds_total", prometheus.CounterValue, "seconds", "Measured GPU time of the instance's processes, exited ones included.", instanceLabels)
	instThrottled = newDesc("mgpu_instance_throttled_seconds_total", prometheus.CounterValue, "seconds", "Wall time the instance wanted the GPU and the arbiter gave it to another.", instanceLabels)
	instWait      = newDesc("mgpu_instance_wait_seconds_total", prometheus.CounterValue, "seconds", "Time the instance's threads waited for a grant, summed over threads.", instanceLabels)
	instLaunches  = newDesc("mgpu_instance_launches_total", prometheus.CounterValue, "", "Kernel and graph launches of the instance's processes.", instanceLabels)
	instQueued    = newDesc("mgpu_instance_queued_seconds", prometheus.GaugeValue, "seconds", "Estimated GPU time the instance has submitted and not yet seen complete.", instanceLabels)
	instProcs     = newDesc("mgpu_instance_processes", prometheus.GaugeValue, "", "Processes attached to the instance.", instanceLabels)
	instViol      = newDesc("mgpu_instance_violations_total", prometheus.CounterValue, "", "Violations of the instance's quotas the driver backstop found (episodes; 0 while it is off).", instanceLabels)
)

var all = []desc{
	devUp, devInfo, devPolicy, devBusy, devFreeW, devMemTotal, devMemFree, devInstances,
	instInfo, instMemQuota, instMemUsed, instQuota, instGPU, instThrottled, instWait, instLaunches, instQueued, instProcs, instViol,
}

// Metric describes one exported metric (docs, the dashboard's test).
type Metric struct {
	Name   string
	Type   string // "counter" or "gauge"
	Unit   string // "seconds", "bytes", "ratio" or ""
	Help   string
	Labels []string
}

// Metrics lists every metric the collector exports.
func Metrics() []Metric {
	out := make([]Metric, 0, len(all))
	for _, d := range all {
		m := Metric{Name: d.name, Type: "gauge", Unit: d.unit, Help: d.help}
		if d.typ == prometheus.CounterValue {
			m.Type = "counter"
		}
		if d.name[:len("mgpu_device")] == "mgpu_device" {
			m.Labels = deviceLabels
		} else {
			m.Labels = instanceLabels
		}
		switch d.name {
		case "mgpu_device_info":
			m.Labels = append(append([]string{}, deviceLabels...), "name", "policy")
		case "mgpu_instance_info":
			m.Labels = append(append([]string{}, instanceLabels...), "policy", "kind", "class", "claim")
		}
		out = append(out, m)
	}
	return out
}

// Describe sends every metric's description.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range all {
		ch <- d.d
	}
}

// snapshot is what one enforcer answered.
type snapshot struct {
	dev   api.DeviceResponse
	insts []api.Instance
	stats []api.InstanceStats
	err   error
}

// Collect reads every enforcer, concurrently, each within the timeout.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	snaps := make([]snapshot, len(c.targets))
	var wg sync.WaitGroup
	for i, t := range c.targets {
		wg.Add(1)
		go func() {
			defer wg.Done()
			snaps[i] = c.read(t.Source)
		}()
	}
	wg.Wait()
	for i, t := range c.targets {
		c.emit(ch, t, snaps[i])
	}
}

func (c *Collector) read(s Source) snapshot {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	var sn snapshot
	if sn.dev, sn.err = s.Device(ctx); sn.err != nil {
		return sn
	}
	if sn.insts, sn.err = s.List(ctx); sn.err != nil {
		return sn
	}
	sn.stats, sn.err = s.Stats(ctx)
	return sn
}

func (c *Collector) emit(ch chan<- prometheus.Metric, t Target, sn snapshot) {
	dl := []string{strconv.Itoa(t.Index), t.UUID}
	if sn.err != nil {
		ch <- prometheus.MustNewConstMetric(devUp.d, devUp.typ, 0, dl...)
		return
	}
	if t.UUID == "" {
		dl[1] = sn.dev.UUID
	}
	gauge := func(d desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d.d, d.typ, v, labels...)
	}
	gauge(devUp, 1, dl...)
	gauge(devInfo, 1, append(dl, sn.dev.Name, sn.dev.Policy)...)
	gauge(devPolicy, float64(sn.dev.PolicyCode), dl...)
	gauge(devBusy, seconds(sn.dev.BusyNs), dl...)
	gauge(devFreeW, float64(sn.dev.CoreFree), dl...)
	gauge(devMemTotal, float64(sn.dev.MemoryMiB<<20), dl...)
	gauge(devMemFree, float64(sn.dev.MemoryFreeMiB<<20), dl...)
	gauge(devInstances, float64(len(sn.insts)), dl...)

	stats := make(map[string]api.InstanceStats, len(sn.stats))
	for _, s := range sn.stats {
		stats[s.Name] = s
	}
	for _, in := range sn.insts {
		s, ok := stats[in.Name]
		if !ok {
			continue // released between the two requests
		}
		il := []string{strconv.Itoa(t.Index), in.Name, in.ContainerID, "", "", ""}
		claim := ""
		if in.Pod != nil {
			il[3], il[4], il[5] = in.Pod.Namespace, in.Pod.Name, in.Pod.Container
			claim = in.Pod.Claim
		}
		gauge(instInfo, 1, append(slices.Clone(il), in.Policy, string(in.Kind), classLabel(in.Class), claim)...)
		gauge(instMemQuota, float64(in.MemoryMiB<<20), il...)
		gauge(instMemUsed, float64(s.MemoryUsedBytes), il...)
		gauge(instQuota, float64(in.Core)/100, il...)
		gauge(instGPU, seconds(s.GPUNs), il...)
		gauge(instThrottled, seconds(uint64(max(s.DemandThrottledNs, 0))), il...) //nolint:gosec // non-negative
		gauge(instWait, seconds(s.ThrottledNs), il...)
		gauge(instLaunches, float64(s.Launches), il...)
		gauge(instQueued, seconds(s.QueuedNs), il...)
		gauge(instProcs, float64(len(s.Processes)), il...)
		gauge(instViol, float64(s.Violations), il...)
	}
}

func seconds(ns uint64) float64 { return float64(ns) / 1e9 }

// classLabel is an instance's class label: online when the enforcer does
// not say (one older than the class).
func classLabel(c string) string {
	if c == "" {
		return "online"
	}
	return c
}
