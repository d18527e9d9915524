package enforcer

import (
	"bytes"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
)

// fakeDriver is an NVML (go-nvml's mock) whose device 0 reports one
// compute process holding some memory.
func fakeDriver(pid *atomic.Int64, used uint64) *mock.Interface {
	dev := &mock.Device{}
	return &mock.Interface{
		InitFunc:     func() nvml.Return { return nvml.SUCCESS },
		ShutdownFunc: func() nvml.Return { return nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(int) (nvml.Device, nvml.Return) {
			return dev, nvml.SUCCESS
		},
		DeviceGetComputeRunningProcessesFunc: func(nvml.Device) ([]nvml.ProcessInfo, nvml.Return) {
			if p := pid.Load(); p > 0 {
				return []nvml.ProcessInfo{{Pid: uint32(p), UsedGpuMemory: used}}, nvml.SUCCESS //nolint:gosec // a test pid
			}
			return nil, nvml.SUCCESS
		},
		DeviceGetProcessUtilizationFunc: func(nvml.Device, uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
			return nil, nvml.ERROR_NOT_FOUND
		},
	}
}

// TestBackstopKillsOverQuota: the enforcer runs the backstop over its own
// instances: a process of a 1024 MiB instance that the driver charges
// 2 GiB (it skipped the shim) is attributed to its instance and killed
// (the memory default), with a log line naming the instance.
func TestBackstopKillsOverQuota(t *testing.T) {
	env := newEnv(t, func(s string) string { return s + "\n[backstop]\ninterval = \"50ms\"\n" })
	var pid atomic.Int64
	logs := env.startLogged(t, WithNVML(fakeDriver(&pid, 2<<30)))
	sl := startSleeper(t, nil)
	if _, err := env.client().Create(ctx, tree(sl.Process.Pid, 10, 1024)); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- sl.Wait() }()
	pid.Store(int64(sl.Process.Pid))
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "killed") {
			t.Fatalf("the process ended with %v, want killed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("not killed; the log:\n%s", logs.String())
	}
	pid.Store(0)
	if !strings.Contains(logs.String(), `msg="backstop: violation" kind=memory instance=mgpu0inst0`) {
		t.Fatalf("no violation naming the instance:\n%s", logs.String())
	}
}

// TestBackstopLeavesOthersAlone: a process of no instance that uses the
// device is logged (the unattributed default), not killed.
func TestBackstopLeavesOthersAlone(t *testing.T) {
	env := newEnv(t, func(s string) string { return s + "\n[backstop]\ninterval = \"50ms\"\n" })
	var pid atomic.Int64
	logs := env.startLogged(t, WithNVML(fakeDriver(&pid, 2<<30)))
	sl := startSleeper(t, nil)
	pid.Store(int64(sl.Process.Pid))
	eventually(t, 10*time.Second, "the unattributed process logged", func() bool {
		return strings.Contains(logs.String(), `msg="backstop: violation" kind=unattributed`)
	})
	time.Sleep(200 * time.Millisecond) // four more checks, which must not log it again (no event to wait for)
	if err := sl.Process.Signal(syscall.Signal(0)); err != nil {
		t.Fatalf("the process of no instance was signalled: %v", err)
	}
	if bytes.Count([]byte(logs.String()), []byte(`msg="backstop: violation" kind=unattributed`)) != 1 {
		t.Errorf("logged every interval, want once per episode:\n%s", logs.String())
	}
}
