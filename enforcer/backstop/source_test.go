package backstop

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
)

// t0 is the realtime clock when the test sources are made.
var t0 = time.UnixMicro(1_700_000_000_000_000)

func us(d time.Duration) uint64 { return uint64(t0.Add(d).UnixMicro()) }

func mockLib(dev nvml.Device) *mock.Interface {
	return &mock.Interface{
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) {
			if i != 0 {
				return nil, nvml.ERROR_INVALID_ARGUMENT
			}
			return dev, nvml.SUCCESS
		},
	}
}

func TestNVMLSourceHandle(t *testing.T) {
	t.Parallel()
	_, err := NewNVMLSource(mockLib(&mock.Device{}), 3)
	if !errors.Is(err, nvml.ERROR_INVALID_ARGUMENT) || !strings.Contains(err.Error(), "GPU 3") {
		t.Fatalf("got %v", err)
	}
}

func TestNVMLSourceProcesses(t *testing.T) {
	t.Parallel()
	type reply struct {
		infos []nvml.ProcessInfo
		ret   nvml.Return
	}
	ok := func(infos ...nvml.ProcessInfo) []reply { return []reply{{infos, nvml.SUCCESS}} }
	for _, tc := range []struct {
		name     string
		graphics bool
		compute  []reply
		gfx      []reply
		want     []Process
		err      nvml.Return
	}{
		{name: "compute processes", compute: ok(nvml.ProcessInfo{Pid: 10, UsedGpuMemory: 5 << 20}, nvml.ProcessInfo{Pid: 11, UsedGpuMemory: 1}),
			want: []Process{{PID: 10, UsedMemory: 5 << 20}, {PID: 11, UsedMemory: 1}}},
		{name: "none", compute: ok(), want: nil},
		{name: "memory not available", compute: ok(nvml.ProcessInfo{Pid: 10, UsedGpuMemory: ^uint64(0)}),
			want: []Process{{PID: 10, MemoryUnknown: true}}},
		{name: "graphics merged, larger memory wins", graphics: true,
			compute: ok(nvml.ProcessInfo{Pid: 10, UsedGpuMemory: 5}, nvml.ProcessInfo{Pid: 11, UsedGpuMemory: 9}),
			gfx:     ok(nvml.ProcessInfo{Pid: 10, UsedGpuMemory: 7}, nvml.ProcessInfo{Pid: 11, UsedGpuMemory: 3}, nvml.ProcessInfo{Pid: 12, UsedGpuMemory: 1}),
			want:    []Process{{PID: 10, UsedMemory: 7}, {PID: 11, UsedMemory: 9}, {PID: 12, UsedMemory: 1}}},
		{name: "graphics not supported", graphics: true, compute: ok(nvml.ProcessInfo{Pid: 10, UsedGpuMemory: 5}),
			gfx: []reply{{nil, nvml.ERROR_NOT_SUPPORTED}}, want: []Process{{PID: 10, UsedMemory: 5}}},
		{name: "graphics not asked", compute: ok(nvml.ProcessInfo{Pid: 10}), want: []Process{{PID: 10}}},
		{name: "insufficient size, then the list", compute: []reply{{nil, nvml.ERROR_INSUFFICIENT_SIZE}, {[]nvml.ProcessInfo{{Pid: 10}}, nvml.SUCCESS}},
			want: []Process{{PID: 10}}},
		{name: "insufficient size for ever", compute: []reply{{nil, nvml.ERROR_INSUFFICIENT_SIZE}}, err: nvml.ERROR_INSUFFICIENT_SIZE},
		{name: "GPU lost", compute: []reply{{nil, nvml.ERROR_GPU_IS_LOST}}, err: nvml.ERROR_GPU_IS_LOST},
		{name: "graphics failing", graphics: true, compute: ok(), gfx: []reply{{nil, nvml.ERROR_UNKNOWN}}, err: nvml.ERROR_UNKNOWN},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			next := func(rs *[]reply) (*[]reply, func(nvml.Device) ([]nvml.ProcessInfo, nvml.Return)) {
				return rs, func(nvml.Device) ([]nvml.ProcessInfo, nvml.Return) {
					r := (*rs)[0]
					if len(*rs) > 1 {
						*rs = (*rs)[1:]
					}
					return r.infos, r.ret
				}
			}
			lib := mockLib(&mock.Device{})
			_, lib.DeviceGetComputeRunningProcessesFunc = next(&tc.compute)
			_, lib.DeviceGetGraphicsRunningProcessesFunc = next(&tc.gfx)
			var opts []SourceOption
			if tc.graphics {
				opts = append(opts, WithGraphicsProcesses())
			}
			s, err := NewNVMLSource(lib, 0, opts...)
			if err != nil {
				t.Fatal(err)
			}
			got, err := s.Processes()
			if tc.err != 0 {
				if !errors.Is(err, tc.err) || !strings.HasPrefix(err.Error(), "GPU 0: ") {
					t.Fatalf("got %v, %v; want %v", got, err, tc.err)
				}
				return
			}
			if err != nil || !slices.Equal(got, tc.want) {
				t.Fatalf("got %+v, %v; want %+v", got, err, tc.want)
			}
		})
	}
}

type utilReply struct {
	samples []nvml.ProcessUtilizationSample
	ret     nvml.Return
}

// utilLib answers DeviceGetProcessUtilization from a script and records the
// lastSeen timestamps it is asked for.
type utilLib struct {
	replies []utilReply
	asked   []uint64
}

func (u *utilLib) lib() *mock.Interface {
	lib := mockLib(&mock.Device{})
	lib.DeviceGetProcessUtilizationFunc = func(_ nvml.Device, last uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
		u.asked = append(u.asked, last)
		r := u.replies[0]
		u.replies = u.replies[1:]
		return r.samples, r.ret
	}
	return lib
}

func sample(pid uint32, at time.Duration, sm uint32) nvml.ProcessUtilizationSample {
	return nvml.ProcessUtilizationSample{Pid: pid, TimeStamp: us(at), SmUtil: sm, MemUtil: 99}
}

func TestNVMLSourceGPUTime(t *testing.T) {
	t.Parallel()
	ms := time.Millisecond
	now := t0
	steps := []struct {
		name   string
		now    time.Duration // realtime clock at the call, after t0
		reply  []utilReply
		asked  time.Duration // lastSeen asked for, after t0
		want   map[int]time.Duration
		errRet nvml.Return
	}{
		{name: "a process's first sample is its baseline", now: 150 * ms,
			reply: []utilReply{{[]nvml.ProcessUtilizationSample{sample(10, 100*ms, 50), sample(20, 100*ms, 100)}, nvml.SUCCESS}},
			asked: 0, want: map[int]time.Duration{}},
		{name: "several samples of one process in a call", now: 350 * ms,
			reply: []utilReply{{[]nvml.ProcessUtilizationSample{sample(10, 300*ms, 100), sample(10, 200*ms, 100), sample(20, 300*ms, 0)}, nvml.SUCCESS}},
			asked: 100 * ms, want: map[int]time.Duration{10: 200 * ms}},
		{name: "not found: nothing ran", now: 600 * ms, reply: []utilReply{{nil, nvml.ERROR_NOT_FOUND}},
			asked: 300 * ms, want: map[int]time.Duration{}},
		{name: "an error, lastSeen kept", now: 850 * ms, reply: []utilReply{{nil, nvml.ERROR_GPU_IS_LOST}},
			asked: 300 * ms, errRet: nvml.ERROR_GPU_IS_LOST},
		{name: "after an idle stretch a sample covers about one sample period", now: 1350 * ms,
			reply: []utilReply{{[]nvml.ProcessUtilizationSample{sample(10, 1300*ms, 100)}, nvml.SUCCESS}},
			asked: 300 * ms, want: map[int]time.Duration{10: 125 * ms}},
		{name: "utilization over 100 is taken as 100", now: 1450 * ms,
			reply: []utilReply{{[]nvml.ProcessUtilizationSample{sample(10, 1400*ms, 250)}, nvml.SUCCESS}},
			asked: 1300 * ms, want: map[int]time.Duration{10: 100 * ms}},
		{name: "insufficient size with no sample: nothing ran", now: 1550 * ms,
			reply: []utilReply{{[]nvml.ProcessUtilizationSample{}, nvml.ERROR_INSUFFICIENT_SIZE}},
			asked: 1400 * ms, want: map[int]time.Duration{}},
		{name: "insufficient size with samples: asked again", now: 1650 * ms,
			reply: []utilReply{
				{[]nvml.ProcessUtilizationSample{sample(10, 1500*ms, 100)}, nvml.ERROR_INSUFFICIENT_SIZE},
				{[]nvml.ProcessUtilizationSample{sample(10, 1500*ms, 100), sample(10, 1600*ms, 100)}, nvml.SUCCESS}},
			asked: 1400 * ms, want: map[int]time.Duration{10: 200 * ms}},
		{name: "samples not newer than lastSeen or from the future are ignored", now: 1750 * ms,
			reply: []utilReply{{[]nvml.ProcessUtilizationSample{sample(10, 1600*ms, 100), sample(20, 1700*ms, 100), sample(30, 1700*ms, 100), sample(10, 5*time.Second, 100)}, nvml.SUCCESS}},
			asked: 1600 * ms, want: map[int]time.Duration{20: 100 * ms}},
		{name: "insufficient size for ever", now: 1850 * ms,
			reply: []utilReply{{[]nvml.ProcessUtilizationSample{sample(10, 1800*ms, 1)}, nvml.ERROR_INSUFFICIENT_SIZE}, {[]nvml.ProcessUtilizationSample{sample(10, 1800*ms, 1)}, nvml.ERROR_INSUFFICIENT_SIZE}, {[]nvml.ProcessUtilizationSample{sample(10, 1800*ms, 1)}, nvml.ERROR_INSUFFICIENT_SIZE}},
			asked: 1700 * ms, errRet: nvml.ERROR_INSUFFICIENT_SIZE},
		{name: "realtime stepped back: counting restarts", now: 1950*ms - time.Hour,
			reply: []utilReply{{[]nvml.ProcessUtilizationSample{sample(10, 1900*ms, 100), sample(10, 1900*ms-time.Hour, 100), sample(10, 1940*ms-time.Hour, 50)}, nvml.SUCCESS}},
			asked: 950*ms - time.Hour, want: map[int]time.Duration{10: 20 * ms}},
	}
	u := &utilLib{}
	s, err := NewNVMLSource(u.lib(), 0, WithRealtime(func() time.Time { return now }))
	if err != nil {
		t.Fatal(err)
	}
	for _, st := range steps {
		now = t0.Add(st.now)
		u.replies, u.asked = st.reply, nil
		got, err := s.GPUTime()
		if len(u.asked) == 0 || u.asked[0] != us(st.asked) {
			t.Errorf("%s: asked for samples after %v, want %d", st.name, u.asked, us(st.asked))
		}
		if st.errRet != 0 {
			if !errors.Is(err, st.errRet) {
				t.Errorf("%s: got %v, %v; want %v", st.name, got, err, st.errRet)
			}
			continue
		}
		if err != nil || len(got) != len(st.want) {
			t.Errorf("%s: got %v, %v; want %v", st.name, got, err, st.want)
			continue
		}
		for pid, d := range st.want {
			if got[pid] != d {
				t.Errorf("%s: pid %d busy %v, want %v", st.name, pid, got[pid], d)
			}
		}
	}
}

func TestNVMLSourcePanicIsAnError(t *testing.T) {
	t.Parallel()
	lib := mockLib(&mock.Device{})
	lib.DeviceGetProcessUtilizationFunc = func(nvml.Device, uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
		var b []nvml.ProcessUtilizationSample
		return b[:3], nvml.SUCCESS // as go-nvml would on a count that grew
	}
	lib.DeviceGetComputeRunningProcessesFunc = func(nvml.Device) ([]nvml.ProcessInfo, nvml.Return) { panic("driver") }
	s, err := NewNVMLSource(lib, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.GPUTime(); err == nil || !strings.Contains(err.Error(), "panicked") {
		t.Errorf("GPUTime: %v", err)
	}
	if _, err := s.Processes(); err == nil || !strings.Contains(err.Error(), "panicked") {
		t.Errorf("Processes: %v", err)
	}
}

// A process that skips the shim and allocates past its quota, seen through
// NVML (go-nvml's mock), is killed; a well-behaved neighbour is not.
func TestWatcherOverNVML(t *testing.T) {
	t.Parallel()
	procs := []nvml.ProcessInfo{{Pid: 100, UsedGpuMemory: 900 << 20}, {Pid: 200, UsedGpuMemory: 8 << 30}}
	lib := mockLib(&mock.Device{})
	lib.DeviceGetComputeRunningProcessesFunc = func(nvml.Device) ([]nvml.ProcessInfo, nvml.Return) { return procs, nvml.SUCCESS }
	lib.DeviceGetProcessUtilizationFunc = func(nvml.Device, uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
		return nil, nvml.ERROR_NOT_FOUND
	}
	src, err := NewNVMLSource(lib, 0)
	if err != nil {
		t.Fatal(err)
	}
	fp := NewFakeProcs(map[int]uint64{100: 5, 200: 6})
	k := &FakeKiller{Procs: fp}
	w, err := New(src, WithProcs(fp), WithKiller(k))
	if err != nil {
		t.Fatal(err)
	}
	owner := map[int]string{100: "good", 200: "bad"}
	attr := func(pid int, _ uint64) (string, bool) { s, ok := owner[pid]; return s, ok }
	ins := []Instance{{Name: "good", MemoryQuota: 1 << 30}, {Name: "bad", MemoryQuota: 1 << 30}}
	vs, err := w.Check(tick, ins, attr)
	if err != nil || len(vs) != 1 || vs[0].Instance != "bad" || !slices.Equal(vs[0].Killed, []int{200}) {
		t.Fatalf("got %+v, %v", vs, err)
	}
	if got := k.Killed(); len(got) != 1 || got[0] != (Target{PID: 200, StartTime: 6}) {
		t.Errorf("killed %v", got)
	}
}

func TestNVMLSourceRemembersIdleProcesses(t *testing.T) {
	t.Parallel()
	ms := time.Millisecond
	now := t0
	u := &utilLib{}
	s, err := NewNVMLSource(u.lib(), 0, WithRealtime(func() time.Time { return now }))
	if err != nil {
		t.Fatal(err)
	}
	for _, st := range []struct {
		at   time.Duration // the sample, and the clock 10 ms later
		want time.Duration
	}{
		{100 * ms, 0},               // baseline
		{200 * ms, 100 * ms},        // one period
		{5 * time.Second, 125 * ms}, // after 4.8 s idle: about one period
		{5*time.Second + 100*ms, 100 * ms},
		{11 * time.Minute, 0}, // forgotten after 10 minutes: a baseline again
		{11*time.Minute + 100*ms, 100 * ms},
	} {
		now = t0.Add(st.at + 10*ms)
		u.replies = []utilReply{{[]nvml.ProcessUtilizationSample{sample(10, st.at, 100)}, nvml.SUCCESS}}
		got, err := s.GPUTime()
		if err != nil || got[10] != st.want {
			t.Errorf("sample at %v: got %v, %v; want %v", st.at, got, err, st.want)
		}
	}
}

// Whatever the driver returns, GPUTime neither fails nor reports a process
// busier than the time between its newest sample seen and the clock.
func FuzzNVMLSourceGPUTime(f *testing.F) {
	f.Add([]byte{1, 10, 100, 1, 20, 100, 2, 30, 50, 0xff, 1, 40, 250})
	f.Add([]byte{0, 0, 0, 0xff, 0, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		now := t0
		u := &utilLib{}
		s, err := NewNVMLSource(u.lib(), 0, WithRealtime(func() time.Time { return now }))
		if err != nil {
			t.Fatal(err)
		}
		for call := range 4 {
			var samples []nvml.ProcessUtilizationSample
			for len(data) >= 3 && data[0] != 0xff {
				at := time.Duration(call)*time.Second + time.Duration(int8(data[1]))*10*time.Millisecond
				samples = append(samples, sample(uint32(data[0]%4), at, uint32(data[2])))
				data = data[3:]
			}
			if len(data) > 0 {
				data = data[1:]
			}
			now = t0.Add(time.Duration(call)*time.Second + 500*time.Millisecond)
			before := s.lastSeen
			u.replies = []utilReply{{samples, nvml.SUCCESS}}
			got, err := s.GPUTime()
			if err != nil {
				t.Fatal(err)
			}
			limit := time.Duration(s.nowUS()-min(before, s.nowUS()))*time.Microsecond + futureSlack
			for pid, d := range got {
				if d <= 0 || d > limit {
					t.Fatalf("call %d: pid %d busy %v (limit %v)", call, pid, d, limit)
				}
			}
			if s.lastSeen < before {
				t.Fatalf("lastSeen went back: %d < %d", s.lastSeen, before)
			}
		}
	})
}
