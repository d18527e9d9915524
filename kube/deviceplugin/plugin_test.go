package deviceplugin

import (
	"context"
	"fmt"
	"os"
	"testing"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

func TestRegistration(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	k := startKubelet(t, dir)
	startPlugin(t, dir, []int{0, 1}, newFakeCards(0, 1))
	r := k.next(t)
	if r.req.GetVersion() != "v1beta1" || r.req.GetEndpoint() != "mgpu-core.sock" || r.req.GetResourceName() != "vke.volcengine.com/mgpu-core" {
		t.Errorf("registration %+v", r.req)
	}
	if o := r.req.GetOptions(); !o.GetGetPreferredAllocationAvailable() || o.GetPreStartRequired() {
		t.Errorf("registration options %+v, want preferred allocation and no pre-start", o)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	o, err := r.client.GetDevicePluginOptions(ctx, &pluginapi.Empty{})
	if err != nil || !o.GetGetPreferredAllocationAvailable() {
		t.Fatalf("GetDevicePluginOptions = %+v, %v", o, err)
	}
	if _, err := r.client.PreStartContainer(ctx, &pluginapi.PreStartContainerRequest{DevicesIds: []string{"mgpu-0-00"}}); err != nil {
		t.Errorf("PreStartContainer: %v", err)
	}
}

// healthOf checks a device list: 100 IDs per GPU in order, and returns the
// health of each GPU.
func healthOf(t *testing.T, devs []*pluginapi.Device, gpus ...int) map[int]string {
	t.Helper()
	if len(devs) != IDsPerGPU*len(gpus) {
		t.Fatalf("%d devices, want %d", len(devs), IDsPerGPU*len(gpus))
	}
	out := map[int]string{}
	for i, d := range devs {
		g := gpus[i/IDsPerGPU]
		if want := fmt.Sprintf("mgpu-%d-%02d", g, i%IDsPerGPU); d.GetID() != want {
			t.Fatalf("device %d is %q, want %q", i, d.GetID(), want)
		}
		if h, ok := out[g]; ok && h != d.GetHealth() {
			t.Fatalf("GPU %d: devices of health %s and %s", g, h, d.GetHealth())
		}
		out[g] = d.GetHealth()
	}
	return out
}

func TestListAndWatch(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	k := startKubelet(t, dir)
	cards := newFakeCards(0, 2) // GPU 1's enforcer does not answer
	startPlugin(t, dir, []int{2, 0, 1}, cards)
	r := k.next(t)

	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	stream, err := r.client.ListAndWatch(ctx, &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	recv := func(want map[int]string) {
		t.Helper()
		resp, err := stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		got := healthOf(t, resp.GetDevices(), 0, 1, 2)
		for g, h := range want {
			if got[g] != h {
				t.Fatalf("health %v, want %v", got, want)
			}
		}
	}
	// The first list is sent at once and already knows GPU 1 is down.
	recv(map[int]string{0: pluginapi.Healthy, 1: pluginapi.Unhealthy, 2: pluginapi.Healthy})
	cards.set(0, 1, 2)
	recv(map[int]string{0: pluginapi.Healthy, 1: pluginapi.Healthy, 2: pluginapi.Healthy})
	cards.set(1, 2)
	recv(map[int]string{0: pluginapi.Unhealthy, 1: pluginapi.Healthy, 2: pluginapi.Healthy})

	// A second watcher gets the list as it stands.
	s2, err := r.client.ListAndWatch(ctx, &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := s2.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if h := healthOf(t, resp.GetDevices(), 0, 1, 2); h[0] != pluginapi.Unhealthy || h[1] != pluginapi.Healthy {
		t.Errorf("second watcher: health %v", h)
	}
}

func TestListAndWatchOnlyOnChange(t *testing.T) {
	t.Parallel()
	p, err := New([]int{0}, newFakeCards(0), WithLogger(testLogger()))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	p.poll(ctx)
	_, changed := p.devices()
	p.poll(ctx) // nothing changed
	select {
	case <-changed:
		t.Fatal("a poll that changed nothing woke the watchers")
	default:
	}
	p.src = newFakeCards()
	p.poll(ctx)
	select {
	case <-changed:
	default:
		t.Fatal("GPU 0 went down and the watchers were not woken")
	}
}

func TestReRegistration(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	k1 := startKubelet(t, dir)
	p := startPlugin(t, dir, []int{0}, newFakeCards(0))
	r1 := k1.next(t)
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if _, err := r1.client.GetDevicePluginOptions(ctx, &pluginapi.Empty{}); err != nil {
		t.Fatal(err)
	}

	// The kubelet restarts: it stops, removes the plugins' sockets and
	// creates kubelet.sock anew.
	k1.stop()
	if err := os.Remove(p.SocketPath()); err != nil {
		t.Fatal(err)
	}
	k2 := startKubelet(t, dir)
	r2 := k2.next(t)
	if r2.req.GetEndpoint() != SocketName || r2.req.GetResourceName() != ResourceName {
		t.Errorf("re-registration %+v", r2.req)
	}
	stream, err := r2.client.ListAndWatch(ctx, &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := stream.Recv()
	if err != nil {
		t.Fatalf("the plugin does not serve on its new socket: %v", err)
	}
	healthOf(t, resp.GetDevices(), 0)
	if !isSocket(p.SocketPath()) {
		t.Errorf("%s is not a socket", p.SocketPath())
	}
}

func TestKubeletStartsLater(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	p := startPlugin(t, dir, []int{0}, newFakeCards(0))
	eventually(t, "the plugin's socket", func() bool { return isSocket(p.SocketPath()) })
	k := startKubelet(t, dir)
	r := k.next(t)
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if _, err := r.client.GetDevicePluginOptions(ctx, &pluginapi.Empty{}); err != nil {
		t.Fatal(err)
	}
}

func TestRunWithoutDir(t *testing.T) {
	t.Parallel()
	p, err := New([]int{0}, newFakeCards(0), WithDir(t.TempDir()+"/missing"), WithLogger(testLogger()))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Run(context.Background()); err == nil {
		t.Fatal("Run in a directory that does not exist: no error")
	}
}

func TestNew(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		gpus []int
		opts []Option
	}{
		{name: "repeated GPU", gpus: []int{0, 1, 0}},
		{name: "negative GPU", gpus: []int{-1}},
		{name: "zero interval", gpus: []int{0}, opts: []Option{WithPollInterval(0)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if _, err := New(tc.gpus, newFakeCards(), tc.opts...); err == nil {
				t.Fatal("no error")
			}
		})
	}
}
