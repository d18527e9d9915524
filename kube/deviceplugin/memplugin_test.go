package deviceplugin

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/kube/agentapi"
	"github.com/mgpu-dev/mgpu/kube/allocview"
	"github.com/mgpu-dev/mgpu/kube/placement"
)

func TestMemIDs(t *testing.T) {
	t.Parallel()
	for _, id := range []MemID{{0, 0}, {1, 7}, {12, 16383}} {
		got, err := ParseMemID(id.String())
		if err != nil || got != id {
			t.Errorf("ParseMemID(%q) = %+v, %v", id.String(), got, err)
		}
	}
	if s := (MemID{GPU: 1, K: 7}).String(); s != "mgpu-1-gib-7" {
		t.Errorf("MemID{1, 7} is %q", s)
	}
	for _, bad := range []string{"mgpu-0-gib-07", "mgpu-0-gib--1", "mgpu--1-gib-0", "mgpu-0-07", "mgpu-0-gib-", "gpu-0-gib-1", "mgpu-0-gib-1x"} {
		if _, err := ParseMemID(bad); err == nil || !strings.Contains(err.Error(), "is not an aliyun.com/gpu-mem device ID") {
			t.Errorf("ParseMemID(%q): %v", bad, err)
		}
	}
}

// memPlugin is a memory plugin of GPUs 0 (80 GiB) and 1 (23028 MiB: 22
// GiB) under mode s.
func memPlugin(t *testing.T, s Scheme, opts ...Option) *Plugin {
	t.Helper()
	opts = append([]Option{WithMemory(map[int]uint64{0: 81920, 1: 23028}), WithMode(s), WithLogger(testLogger()),
		WithUUIDs(map[int]string{0: "GPU-a", 1: "GPU-b"})}, opts...)
	p, err := New([]int{0, 1}, newFakeCards(0, 1), opts...)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func gib(gpu, from, to int) []string {
	var out []string
	for k := from; k < to; k++ {
		out = append(out, MemID{GPU: gpu, K: k}.String())
	}
	return out
}

func TestMemoryPluginDevices(t *testing.T) {
	t.Parallel()
	p := memPlugin(t, SchemeCGPU)
	if p.SocketPath() != DefaultDir+"mgpu-ack-mem.sock" || p.Scheme().Core != "aliyun.com/gpu-mem" {
		t.Fatalf("socket %s, resource %s", p.SocketPath(), p.Scheme().Core)
	}
	devs, _ := p.devices()
	var got []string
	for _, d := range devs {
		got = append(got, d.ID)
	}
	if want := append(gib(0, 0, 80), gib(1, 0, 22)...); !slices.Equal(got, want) {
		t.Fatalf("devices %v\nwant %v", got, want)
	}
	// Every memory mode lists them; the others none.
	for _, s := range Schemes {
		p.SetMode(s)
		if devs, _ := p.devices(); (len(devs) == 102) != s.MemoryIDs || p.Active() != s.MemoryIDs {
			t.Errorf("mode %s: %d devices, active %v", s.Mode, len(devs), p.Active())
		}
	}
}

func preferMem(t *testing.T, p *Plugin, avail, must []string, size int) ([]string, error) {
	t.Helper()
	resp, err := p.GetPreferredAllocation(context.Background(), &pluginapi.PreferredAllocationRequest{ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{
		{AvailableDeviceIDs: avail, MustIncludeDeviceIDs: must, AllocationSize: int32(size)}}})
	if err != nil {
		return nil, err
	}
	return resp.ContainerResponses[0].DeviceIDs, nil
}

// Under cgpu, share and mps a container's GiB come from one GPU, the
// placement policy's: binpack the fullest that fits, spread the emptiest.
func TestMemoryPluginPrefersOneGPU(t *testing.T) {
	t.Parallel()
	for _, s := range []Scheme{SchemeCGPU, SchemeShare, SchemeMPS} {
		p := memPlugin(t, s)
		all := append(gib(0, 0, 80), gib(1, 0, 22)...)
		if got, err := preferMem(t, p, all, nil, 6); err != nil || !slices.Equal(got, gib(1, 0, 6)) {
			t.Errorf("%s binpack, both free: %v, %v; want the smaller GPU 1's first 6", s.Mode, got, err)
		}
		// GPU 0 has 10 GiB left, GPU 1 all 22: binpack takes GPU 0,
		// spread GPU 1; 12 GiB fit GPU 1 only.
		avail := append(gib(0, 70, 80), gib(1, 0, 22)...)
		if got, err := preferMem(t, p, avail, nil, 6); err != nil || !slices.Equal(got, gib(0, 70, 76)) {
			t.Errorf("%s binpack: %v, %v", s.Mode, got, err)
		}
		if got, err := preferMem(t, p, avail, nil, 12); err != nil || !slices.Equal(got, gib(1, 0, 12)) {
			t.Errorf("%s binpack, 12 GiB: %v, %v", s.Mode, got, err)
		}
		p.SetPolicy(placement.Spread)
		if got, err := preferMem(t, p, avail, nil, 6); err != nil || !slices.Equal(got, gib(1, 0, 6)) {
			t.Errorf("%s spread: %v, %v", s.Mode, got, err)
		}
		// Must-include IDs fix the GPU.
		if got, err := preferMem(t, p, avail, gib(0, 75, 76), 3); err != nil || !slices.Equal(got, []string{"mgpu-0-gib-70", "mgpu-0-gib-71", "mgpu-0-gib-75"}) {
			t.Errorf("%s must-include: %v, %v", s.Mode, got, err)
		}
		if _, err := preferMem(t, p, avail, append(gib(0, 75, 76), gib(1, 0, 1)...), 3); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "must come from one GPU") {
			t.Errorf("%s must-include of two GPUs: %v", s.Mode, err)
		}
		if _, err := preferMem(t, p, avail, nil, 30); status.Code(err) != codes.ResourceExhausted {
			t.Errorf("%s 30 GiB, no GPU has them: %v", s.Mode, err)
		}
		if _, err := preferMem(t, p, []string{"mgpu-0-gib-80"}, nil, 1); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "GPU 0 has 80 GiB") {
			t.Errorf("%s an ID beyond the GPU: %v", s.Mode, err)
		}
	}
}

// Under core_mem the memory IDs only count: any will do, and Allocate
// answers nothing (the core plugin's answer gives the GPU).
func TestMemoryPluginCountsUnderCoreMem(t *testing.T) {
	t.Parallel()
	p := memPlugin(t, SchemeCoreMem)
	avail := append(gib(0, 78, 80), gib(1, 0, 22)...)
	got, err := preferMem(t, p, avail, gib(1, 5, 6), 4)
	if err != nil || len(got) != 4 || !slices.Contains(got, "mgpu-1-gib-5") {
		t.Fatalf("core_mem preferred %v, %v", got, err)
	}
	resp, err := p.Allocate(context.Background(), &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: got}}})
	if err != nil || len(resp.ContainerResponses) != 1 {
		t.Fatal(err)
	}
	if r := resp.ContainerResponses[0]; len(r.Envs)+len(r.CdiDevices)+len(r.Devices)+len(r.Mounts) != 0 {
		t.Fatalf("core_mem's memory Allocate answered %+v", r)
	}
}

func allocMem(p *Plugin, ids []string) (*pluginapi.ContainerAllocateResponse, error) {
	resp, err := p.Allocate(context.Background(), &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: ids}}})
	if err != nil {
		return nil, err
	}
	return resp.ContainerResponses[0], nil
}

func TestMemoryPluginAllocate(t *testing.T) {
	t.Parallel()
	bare := WithBareDevices(map[int][]string{0: {"/run/mgpu/sim/dev/nvidia0"}, 1: {"/run/mgpu/sim/dev/nvidia1"}}, []string{"/run/mgpu/sim/dev/nvidiactl"})

	// cgpu: mgpu's CDI device, the quota for engines without the agent.
	r, err := allocMem(memPlugin(t, SchemeCGPU, bare), gib(1, 0, 6))
	if err != nil {
		t.Fatal(err)
	}
	if len(r.CdiDevices) != 1 || r.CdiDevices[0].Name != "mgpu.io/gpu=1" || len(r.Devices) != 0 ||
		r.Envs["MGPU_CORE"] != "1" || r.Envs["MGPU_MEMORY"] != "6144" || r.Envs[EnvVisibleDevices] != "1" || r.Envs[EnvCUDAVisibleDevices] != "GPU-b" {
		t.Fatalf("cgpu answered %+v", r)
	}
	if _, err := allocMem(memPlugin(t, SchemeCGPU), append(gib(0, 0, 1), gib(1, 0, 1)...)); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "must come from one GPU; got IDs of GPUs 0 and 1") {
		t.Fatalf("cgpu across GPUs: %v", err)
	}

	// share: the bare GPU, nothing of mgpu.
	r, err = allocMem(memPlugin(t, SchemeShare, bare), gib(0, 0, 4))
	if err != nil {
		t.Fatal(err)
	}
	var paths []string
	for _, d := range r.Devices {
		paths = append(paths, d.HostPath+">"+d.ContainerPath+":"+d.Permissions)
	}
	if want := []string{"/run/mgpu/sim/dev/nvidia0>/dev/nvidia0:rw", "/run/mgpu/sim/dev/nvidiactl>/dev/nvidiactl:rw"}; !slices.Equal(paths, want) ||
		len(r.CdiDevices) != 0 || r.Envs["MGPU_CORE"] != "" || r.Envs[EnvVisibleDevices] != "" || r.Envs[EnvCUDAVisibleDevices] != "GPU-a" {
		t.Fatalf("share answered %+v (devices %v)", r, paths)
	}

	// mps: the bare GPU, MPS's memory limit and pipe directory.
	r, err = allocMem(memPlugin(t, SchemeMPS, bare, WithMPSPipe("/run/nvidia-mps")), gib(1, 0, 3))
	if err != nil {
		t.Fatal(err)
	}
	if len(r.CdiDevices) != 0 || len(r.Devices) != 2 || r.Envs[EnvMPSMemLimit] != "0=3G" || r.Envs[EnvMPSPipe] != "/run/nvidia-mps" ||
		len(r.Mounts) != 1 || r.Mounts[0].HostPath != "/run/nvidia-mps" || r.Mounts[0].ContainerPath != "/run/nvidia-mps" {
		t.Fatalf("mps answered %+v", r)
	}

	// Inactive (a mode without memory IDs): refused.
	p := memPlugin(t, SchemeMGPU)
	if _, err := allocMem(p, gib(0, 0, 1)); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "aliyun.com/gpu-mem is not served on this node now") {
		t.Fatalf("inactive: %v", err)
	}
}

// ackMemPod is a pod of one container "main" that asks aliyun.com/gpu-mem.
func ackMemPod(name, gibs, pol string) corev1.Pod {
	p := pod(name, "", "", pol)
	p.Spec.Containers[0].Resources.Limits = corev1.ResourceList{ACKMemory.Core: resource.MustParse(gibs)}
	return p
}

// A cgpu container is an instance of its GiB and core 1 under its GPU's
// policy, on the GPU of its memory IDs.
func TestResolveCGPU(t *testing.T) {
	t.Parallel()
	pods := &fakePods{pods: []corev1.Pod{ackMemPod("a", "6", ""), ackMemPod("b", "2", "fixed-share"), ackMemPod("c", "4", ""), pod("d", "30", "1024", "")}}
	allocs := &fakeAllocs{allocs: []Allocation{
		{Namespace: "ns", Pod: "a", Container: "main", Resource: ACKMemory.Core, IDs: gib(1, 10, 16)},
		{Namespace: "ns", Pod: "b", Container: "main", Resource: ACKMemory.Core, IDs: gib(0, 0, 2)},
		{Namespace: "ns", Pod: "c", Container: "main", Resource: ACKMemory.Core, IDs: append(gib(0, 2, 4), gib(1, 0, 2)...)},
	}}
	r := NewResolver("n1", []int{0, 1}, pods, allocs)
	r.SetGPUPolicies(map[int]policy.Policy{0: policy.NativeBurstShare, 1: policy.GuaranteedBurstShare})
	r.SetScheme(SchemeCGPU)
	q := func(name string) agentapi.Container {
		return agentapi.Container{Namespace: "ns", Pod: name, UID: "uid-" + name, Container: "main"}
	}
	a, err := r.Resolve(context.Background(), q("a"))
	if err != nil {
		t.Fatal(err)
	}
	if a.Policy != "guaranteed-burst-share" || len(a.GPUs) != 1 || a.GPUs[0] != (agentapi.GPU{Index: 1, Core: 1, MemoryMiB: 6144}) {
		t.Fatalf("cgpu assignment %+v", a)
	}
	for name, want := range map[string]string{
		"b": `annotation vke.volcengine.com/mgpu-compute-policy is "fixed-share"; under ack.node.gpu.schedule=cgpu a container runs under its GPU's policy, native-burst-share`,
		"c": "aliyun.com/gpu-mem 4 must come from one GPU; the kubelet allocated IDs of 2 GPUs",
		"d": "requests no aliyun.com/gpu-mem",
	} {
		if _, err := r.Resolve(context.Background(), q(name)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("pod %s: %v, want %q", name, err, want)
		}
	}
	r.SetScheme(SchemeShare)
	if _, err := r.Resolve(context.Background(), q("a")); err == nil || !strings.Contains(err.Error(), "share, whose containers get the GPU without mgpu") {
		t.Errorf("share: %v", err)
	}
}

func TestModeCheck(t *testing.T) {
	t.Parallel()
	cfg := config.Default()
	cfg.Backend = config.BackendSim
	nb := policy.NativeBurstShare
	cfg.Devices = []config.DeviceConfig{{Index: 1, ComputePolicy: &nb}}
	check := modeCheck(cfg, []int{0, 1}, t.TempDir(), noDRAErr)
	for _, s := range []Scheme{SchemeMGPU, SchemeCoreMem, SchemeDefault, SchemeTopology, SchemeShare} {
		if err := check(s); err != nil {
			t.Errorf("%s: %v", s.Mode, err)
		}
	}
	if err := check(SchemeCGPU); err == nil || err.Error() != "ack.node.gpu.schedule=cgpu shares compute under the GPUs' own burst policy, and GPU 0 runs fixed-share, which would cap each container at 1%; run guaranteed-burst-share or native-burst-share (the node config's compute_policy)" {
		t.Errorf("cgpu on a fixed-share GPU: %v", err)
	}
	if err := check(SchemeMPS); err == nil || !strings.Contains(err.Error(), "this node's GPUs are simulated (backend sim), and mgpu does not simulate MPS") {
		t.Errorf("mps on the sim: %v", err)
	}
	cfg.Backend = config.BackendNVML
	pipe := t.TempDir()
	if err := modeCheck(cfg, []int{1}, pipe, noDRAErr)(SchemeMPS); err == nil || !strings.Contains(err.Error(), "needs an MPS control daemon, and "+filepath.Join(pipe, "control")+" is not its socket") {
		t.Errorf("mps without a daemon: %v", err)
	}
	if err := os.WriteFile(filepath.Join(pipe, "control"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := modeCheck(cfg, []int{1}, pipe, noDRAErr)(SchemeMPS); err == nil {
		t.Error("mps with a plain file for the daemon's socket passed")
	}
	if err := modeCheck(cfg, []int{1}, pipe, noDRAErr)(SchemeCGPU); err != nil {
		t.Errorf("cgpu on a native-burst-share GPU: %v", err)
	}
}

// In share and mps the containers are no instances: the node's view adds
// their GiB from the kubelet's allocations.
func TestAddBare(t *testing.T) {
	t.Parallel()
	view := allocview.Node{GPUs: []allocview.GPU{
		{Index: 0, AllocatedMiB: 0, TotalMiB: 81920, Running: true},
		{Index: 1, TotalMiB: 81920, Running: false},
	}}
	allocs := &fakeAllocs{allocs: []Allocation{
		{Namespace: "ns", Pod: "a", Container: "main", Resource: ACKMemory.Core, IDs: gib(0, 0, 4)},
		{Namespace: "ns", Pod: "b", Container: "main", Resource: ACKMemory.Core, IDs: gib(0, 4, 6)},
		{Namespace: "ns", Pod: "c", Container: "main", Resource: ACKMemory.Core, IDs: gib(1, 0, 6)},
		{Namespace: "ns", Pod: "d", Container: "main", Resource: ResourceName, IDs: ids(0, 0, 30)},
	}}
	if err := AddBare(context.Background(), allocs, &view); err != nil {
		t.Fatal(err)
	}
	if g := view.GPUs[0]; g.AllocatedMiB != 6144 || g.Instances != 2 {
		t.Errorf("GPU 0 %+v, want 6144 MiB in 2", g)
	}
	if g := view.GPUs[1]; g.AllocatedMiB != 0 || g.Instances != 0 {
		t.Errorf("GPU 1 (its enforcer does not answer) %+v, want none", g)
	}
}

// A pod's class annotation reaches its assignment; a bad one is refused.
func TestResolveClass(t *testing.T) {
	t.Parallel()
	off := pod("a", "30", "1024", "")
	off.Annotations = map[string]string{ClassKey: "offline"}
	bad := pod("b", "30", "1024", "")
	bad.Annotations = map[string]string{ClassKey: "Offline"}
	pods := &fakePods{pods: []corev1.Pod{off, bad}}
	allocs := &fakeAllocs{allocs: []Allocation{
		{Namespace: "ns", Pod: "a", Container: "main", Resource: ResourceName, IDs: ids(0, 0, 30)},
		{Namespace: "ns", Pod: "b", Container: "main", Resource: ResourceName, IDs: ids(0, 30, 30)},
	}}
	r := NewResolver("n1", []int{0, 1}, pods, allocs)
	a, err := r.Resolve(context.Background(), agentapi.Container{Namespace: "ns", Pod: "a", UID: "uid-a", Container: "main"})
	if err != nil || a.Class != "offline" {
		t.Fatalf("offline pod: %+v, %v", a, err)
	}
	_, err = r.Resolve(context.Background(), agentapi.Container{Namespace: "ns", Pod: "b", UID: "uid-b", Container: "main"})
	if err == nil || !strings.Contains(err.Error(), `annotation vke.volcengine.com/mgpu-class: unknown priority class "Offline" (want online or offline)`) {
		t.Fatalf("bad class: %v", err)
	}
}

// An mps container gets the MPS pipe directory read-only: a client only
// connects to the sockets there (which a read-only mount allows); with it
// writable, a tenant could unlink the daemon's socket and bind its own,
// answering every other mps container of the node.
func TestMPSPipeMountedReadOnly(t *testing.T) {
	t.Parallel()
	bare := WithBareDevices(map[int][]string{0: {"/dev/nvidia0"}}, []string{"/dev/nvidiactl"})
	r, err := allocMem(memPlugin(t, SchemeMPS, bare, WithMPSPipe("/run/nvidia-mps")), gib(0, 0, 2))
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Mounts) != 1 || r.Mounts[0].HostPath != "/run/nvidia-mps" || !r.Mounts[0].ReadOnly {
		t.Fatalf("mounts %+v, want /run/nvidia-mps read-only", r.Mounts)
	}
}

// noDRAErr is a DRA driver that runs.
func noDRAErr() error { return nil }
