package enforcer

import (
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/enforcer/attach"
)

// What the metrics read: a container's pod is kept with its instance and
// listed; the device's busy total is its instances' measured GPU time and
// keeps a released instance's.
func TestPodAndDeviceBusy(t *testing.T) {
	env := newEnv(t, nil)
	env.start(t)
	c := env.client()
	h := startHelper(t, api.ClientSocket(env.runDir()), &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID})
	pod := &api.PodRef{Namespace: "ml", Name: "train-0", Container: "main"}
	out, err := c.Create(ctx, api.CreateRequest{ContainerID: "pod-c", PID: h.cmd.Process.Pid, Core: 10, MemoryMiB: 1, Pod: pod})
	if err != nil {
		t.Fatal(err)
	}
	if out.Instance.Pod == nil || *out.Instance.Pod != *pod {
		t.Fatalf("created %+v", out.Instance)
	}
	if got, err := c.Get(ctx, out.Instance.Name); err != nil || got.Pod == nil || *got.Pod != *pod {
		t.Fatalf("get: %+v, %v", got, err)
	}

	tr, err := c.Create(ctx, tree(os.Getpid(), 20, 16))
	if err != nil {
		t.Fatal(err)
	}
	res, err := attach.Dial(api.ClientSocket(env.runDir()), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_, p := mapAttach(t, res)
	p.GPUNs.Store(7e6) // as the shim would: 7 ms measured
	eventually(t, 5*time.Second, "busy_ns of 7 ms", func() bool {
		d, err := c.Device(ctx)
		return err == nil && d.BusyNs == 7e6
	})
	stats, err := c.Stats(ctx)
	if err != nil || len(stats) != 2 || stats[0].Violations != 0 {
		t.Fatalf("stats %+v, %v", stats, err)
	}
	if _, err := c.Destroy(ctx, tr.Instance.Name); err != nil {
		t.Fatal(err)
	}
	if d, err := c.Device(ctx); err != nil || d.BusyNs != 7e6 || d.Instances != 1 {
		t.Fatalf("after the release: %+v, %v", d, err)
	}
}
