package backstop

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Process is one process the driver reports on the device.
type Process struct {
	// PID is the host pid.
	PID int
	// UsedMemory is the device memory the driver charges to the process,
	// in bytes.
	UsedMemory uint64
	// MemoryUnknown is set when the driver does not report the process's
	// memory (NVML_VALUE_NOT_AVAILABLE); UsedMemory is then 0.
	MemoryUnknown bool
}

// Source is the driver's view of one device.
type Source interface {
	// Processes returns the processes that hold a context on the device.
	Processes() ([]Process, error)
	// GPUTime returns, per host pid, the time the device was busy for the
	// process since the previous call. A pid that did not run is absent.
	GPUTime() (map[int]time.Duration, error)
}

// Defaults of the NVML source.
const (
	// DefaultMaxSamplePeriod is the longest utilization sample period NVML
	// documents (between 1/6 s and 1 s depending on the product): the most
	// one sample is ever taken to cover.
	DefaultMaxSamplePeriod = time.Second
	// gapHistory is how many recent sample gaps the period estimate uses.
	gapHistory = 64
	// minGap is the shortest gap taken as a sample period (shorter gaps
	// are jitter or duplicate samples).
	minGap = time.Millisecond
	// futureSlack is how far ahead of the host's clock a sample may be
	// before it is taken for a sample of an earlier clock (the realtime
	// clock was stepped back).
	futureSlack = time.Second
	// prevRetain is how long the newest sample of a process is kept.
	prevRetain = 10 * time.Minute
	// retries bounds the calls made when the number of samples grows
	// between go-nvml's two calls (ERROR_INSUFFICIENT_SIZE).
	retries = 3
	// notAvailable is NVML_VALUE_NOT_AVAILABLE as an unsigned long long.
	notAvailable = ^uint64(0)
)

// NVMLSource is the Source of one device through NVML. It is not safe for
// concurrent use (the Watcher serialises its calls).
type NVMLSource struct {
	lib      nvml.Interface
	dev      nvml.Device
	index    int
	graphics bool
	maxGap   time.Duration
	realtime func() time.Time

	lastSeen uint64         // newest sample timestamp seen, µs of CPU realtime
	prev     map[int]uint64 // per pid: timestamp of its newest sample
	gaps     []time.Duration
	gapNext  int
}

// SourceOption configures NewNVMLSource.
type SourceOption func(*NVMLSource)

// WithGraphicsProcesses also lists the processes that hold a graphics
// context (Vulkan, OpenGL): device memory allocated through a graphics API
// is charged to those. Only for the real driver: the simulated one does not
// provide the query.
func WithGraphicsProcesses() SourceOption { return func(s *NVMLSource) { s.graphics = true } }

// WithMaxSamplePeriod bounds the time one utilization sample is taken to
// cover (default DefaultMaxSamplePeriod).
func WithMaxSamplePeriod(d time.Duration) SourceOption {
	return func(s *NVMLSource) {
		if d > 0 {
			s.maxGap = d
		}
	}
}

// WithRealtime sets the clock that NVML sample timestamps are compared with
// (default time.Now).
func WithRealtime(now func() time.Time) SourceOption { return func(s *NVMLSource) { s.realtime = now } }

// NewNVMLSource returns the Source of device index. lib must be initialised
// (lib.Init) and stay so while the source is used.
func NewNVMLSource(lib nvml.Interface, index int, opts ...SourceOption) (*NVMLSource, error) {
	s := &NVMLSource{lib: lib, index: index, maxGap: DefaultMaxSamplePeriod, realtime: time.Now, prev: map[int]uint64{}}
	for _, o := range opts {
		o(s)
	}
	dev, ret := lib.DeviceGetHandleByIndex(index)
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("GPU %d: get handle: %w", index, ret)
	}
	s.dev = dev
	// Count from now: samples buffered before the source existed are not
	// the watcher's business.
	s.lastSeen = s.nowUS()
	return s, nil
}

func (s *NVMLSource) nowUS() uint64 {
	us := s.realtime().UnixMicro()
	if us < 0 {
		return 0
	}
	return uint64(us)
}

// Processes implements Source (nvmlDeviceGetComputeRunningProcesses, and
// the graphics ones with WithGraphicsProcesses). A process listed twice
// (compute and graphics contexts) is reported once, with the larger memory.
func (s *NVMLSource) Processes() (out []Process, err error) {
	defer recoverNVML(&err)
	infos, err := s.list("compute processes", s.lib.DeviceGetComputeRunningProcesses)
	if err != nil {
		return nil, err
	}
	if s.graphics {
		g, err := s.list("graphics processes", s.lib.DeviceGetGraphicsRunningProcesses)
		if err != nil && !errors.Is(err, nvml.ERROR_NOT_SUPPORTED) {
			return nil, err
		}
		infos = append(infos, g...)
	}
	at := map[int]int{}
	for _, in := range infos {
		p := Process{PID: int(in.Pid), UsedMemory: in.UsedGpuMemory}
		if in.UsedGpuMemory == notAvailable {
			p.UsedMemory, p.MemoryUnknown = 0, true
		}
		if i, ok := at[p.PID]; ok {
			if o := &out[i]; p.UsedMemory > o.UsedMemory || o.MemoryUnknown {
				*o = p
			}
			continue
		}
		at[p.PID] = len(out)
		out = append(out, p)
	}
	return out, nil
}

func (s *NVMLSource) list(what string, get func(nvml.Device) ([]nvml.ProcessInfo, nvml.Return)) ([]nvml.ProcessInfo, error) {
	for range retries {
		infos, ret := get(s.dev)
		switch ret {
		case nvml.SUCCESS:
			return infos, nil
		case nvml.ERROR_INSUFFICIENT_SIZE: // more processes than go-nvml asked room for: again
			continue
		}
		return nil, fmt.Errorf("GPU %d: %s: %w", s.index, what, ret)
	}
	return nil, fmt.Errorf("GPU %d: %s: %w", s.index, what, nvml.ERROR_INSUFFICIENT_SIZE)
}

// GPUTime implements Source with nvmlDeviceGetProcessUtilization, asked
// for the samples newer than the newest one seen: each contributes smUtil/100
// of the time since the previous sample of its process or the newest sample
// of the previous call, whichever is later. The first sample of a process
// is its baseline and counts nothing. The driver reports a process only
// while it is busy, so after an idle stretch (of the process or the whole
// device) that time is bounded by 1.25 sample periods, the period estimated
// from recent gaps (and never more than WithMaxSamplePeriod).
func (s *NVMLSource) GPUTime() (out map[int]time.Duration, err error) {
	defer recoverNVML(&err)
	now := s.nowUS()
	limit := now + uint64(futureSlack/time.Microsecond)
	if s.lastSeen > limit {
		// The realtime clock went back: samples stamped by the old clock
		// are ignored and counting restarts from now.
		s.lastSeen = now - min(now, uint64(s.maxGap/time.Microsecond))
		clear(s.prev)
	}
	// Forget processes without a sample for a long time (a process that
	// was forgotten loses its next sample, its baseline again).
	old := now - min(now, uint64(prevRetain/time.Microsecond))
	for pid, ts := range s.prev {
		if ts < old {
			delete(s.prev, pid)
		}
	}
	samples, err := s.samples()
	if err != nil {
		return nil, err
	}
	slices.SortFunc(samples, func(a, b nvml.ProcessUtilizationSample) int {
		switch {
		case a.TimeStamp < b.TimeStamp:
			return -1
		case a.TimeStamp > b.TimeStamp:
			return 1
		}
		return 0
	})
	base, newest := s.lastSeen, s.lastSeen
	bound := min(s.period()*5/4, s.maxGap)
	out = map[int]time.Duration{}
	for _, sm := range samples {
		ts := sm.TimeStamp
		if ts > limit || ts <= base {
			continue
		}
		pid := int(sm.Pid)
		prev, seen := s.prev[pid]
		s.prev[pid] = ts
		newest = max(newest, ts)
		if !seen {
			// What a process's first sample covers is unknown (since it
			// started, or a whole sample period): it is the baseline.
			continue
		}
		prev = max(prev, base)
		gap := time.Duration(ts-prev) * time.Microsecond
		s.addGap(gap)
		util := min(sm.SmUtil, 100)
		out[pid] += min(gap, bound) * time.Duration(util) / 100
	}
	s.lastSeen = newest
	for pid, d := range out {
		if d == 0 {
			delete(out, pid)
		}
	}
	return out, nil
}

// samples asks NVML for the samples newer than lastSeen.
func (s *NVMLSource) samples() ([]nvml.ProcessUtilizationSample, error) {
	for range retries {
		samples, ret := s.lib.DeviceGetProcessUtilization(s.dev, s.lastSeen)
		switch {
		case ret == nvml.SUCCESS:
			return samples, nil
		case ret == nvml.ERROR_NOT_FOUND:
			// No sample since lastSeen: nothing ran.
			return nil, nil
		case ret == nvml.ERROR_INSUFFICIENT_SIZE && len(samples) == 0:
			// go-nvml's sizing call found no sample to fetch.
			return nil, nil
		case ret == nvml.ERROR_INSUFFICIENT_SIZE:
			// Samples arrived between go-nvml's sizing call and the
			// fetch: ask again.
			continue
		}
		return nil, fmt.Errorf("GPU %d: process utilization: %w", s.index, ret)
	}
	return nil, fmt.Errorf("GPU %d: process utilization: %w", s.index, nvml.ERROR_INSUFFICIENT_SIZE)
}

// addGap records the gap between two consecutive samples of one process.
func (s *NVMLSource) addGap(g time.Duration) {
	if g < minGap {
		return
	}
	if len(s.gaps) < gapHistory {
		s.gaps = append(s.gaps, g)
		return
	}
	s.gaps[s.gapNext] = g
	s.gapNext = (s.gapNext + 1) % gapHistory
}

// period estimates the driver's sample period: the lower quartile of the
// recent gaps between consecutive samples of a process (a busy process is
// sampled every period; gaps of an intermittent one are multiples of it).
func (s *NVMLSource) period() time.Duration {
	if len(s.gaps) == 0 {
		return s.maxGap
	}
	g := slices.Clone(s.gaps)
	slices.Sort(g)
	return min(g[len(g)/4], s.maxGap)
}

// recoverNVML turns a panic inside go-nvml (it slices its buffer by a count
// the driver returns) into an error: a misbehaving driver must not take the
// enforcer down.
func recoverNVML(err *error) {
	if r := recover(); r != nil {
		*err = fmt.Errorf("NVML call panicked: %v", r)
	}
}
