package deviceplugin

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/mgpu-dev/mgpu/kube/allocview"
	"github.com/mgpu-dev/mgpu/kube/placement"
)

func TestParseMode(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]string{"mgpu": "mgpu", "core_mem": "core_mem", "default": "default", "topology": "topology",
		"cgpu": "cgpu", "share": "share", "mps": "mps", "dra": "dra"} {
		s, err := ParseMode(v)
		if err != nil || s.Mode != want {
			t.Errorf("ParseMode(%q) = %+v, %v", v, s, err)
		}
	}
	for v, want := range map[string]string{
		"Core_Mem": `ack.node.gpu.schedule="Core_Mem" is not a mode (mgpu serves mgpu, core_mem, default, topology, cgpu, share, mps and dra)`,
		"":         `ack.node.gpu.schedule="" is not a mode (mgpu serves mgpu, core_mem, default, topology, cgpu, share, mps and dra)`,
	} {
		if _, err := ParseMode(v); err == nil || err.Error() != want {
			t.Errorf("ParseMode(%q): %v, want %q", v, err, want)
		}
	}
	// GiB per card, rounded down: a card never promises more than it has.
	if got := SchemeCoreMem.MemoryUnits([]uint64{81920, 23028}); got != 80+22 {
		t.Errorf("core_mem capacity %d GiB, want 102", got)
	}
	if got := SchemeMGPU.MemoryUnits([]uint64{81920, 23028}); got != 104948 {
		t.Errorf("mgpu capacity %d MiB, want 104948", got)
	}
	if got := SchemeDefault.MemoryUnits([]uint64{81920}); got != 0 {
		t.Errorf("default capacity %d, want none", got)
	}
}

// ACK's topology mode: aliyun.com/gpu, whole GPUs, the nearest set free.
func TestTopologyModePrefersNearGPUs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// GPUs 0-1 and 2-3 share a PCIe switch (rank 1); the pairs are on two
	// NUMA nodes (rank 5).
	dist := func(a, b int) int {
		switch {
		case a == b:
			return 0
		case a/2 == b/2:
			return 1
		}
		return 5
	}
	p, err := New([]int{0, 1, 2, 3}, newFakeCards(0, 1, 2, 3), WithScheme(SchemeTopology), WithTopology(dist), WithPolicy(placement.Spread), WithLogger(testLogger()))
	if err != nil {
		t.Fatal(err)
	}
	all := []string{"mgpu-0-00", "mgpu-1-00", "mgpu-2-00", "mgpu-3-00"}
	for _, tc := range []struct {
		avail, must []string
		size        int32
		want        string
	}{
		{all, nil, 2, "mgpu-0-00,mgpu-1-00"},                       // not spread's 0 and 2
		{all[1:], nil, 2, "mgpu-2-00,mgpu-3-00"},                   // 1 alone is farther
		{all[1:], []string{"mgpu-1-00"}, 2, "mgpu-1-00,mgpu-2-00"}, // its neighbour is taken
		{all, []string{"mgpu-3-00"}, 2, "mgpu-2-00,mgpu-3-00"},     // the must-include GPU's neighbour
		{all, nil, 4, "mgpu-0-00,mgpu-1-00,mgpu-2-00,mgpu-3-00"},   // all
	} {
		resp, err := p.GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{
			{AvailableDeviceIDs: tc.avail, MustIncludeDeviceIDs: tc.must, AllocationSize: tc.size},
		}})
		if err != nil || strings.Join(resp.ContainerResponses[0].DeviceIDs, ",") != tc.want {
			t.Errorf("%v must %v size %d: %v %v, want %s", tc.avail, tc.must, tc.size, resp, err, tc.want)
		}
	}
	if _, err := p.GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{
		{AvailableDeviceIDs: all[:1], AllocationSize: 2},
	}}); status.Code(err) != codes.ResourceExhausted {
		t.Errorf("2 GPUs of 1 available: %v", err)
	}
}

// ACK's default mode: nvidia.com/gpu, one device ID per GPU, each a whole
// GPU with all its memory.
func TestDefaultModeWholeGPUs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	whole := func(name, n string) corev1.Pod {
		p := pod(name, "", "", "")
		p.Spec.Containers[0].Resources.Limits = corev1.ResourceList{SchemeDefault.Core: resource.MustParse(n)}
		return p
	}
	for n, want := range map[string]int{"1": 100, "2": 200} {
		p := whole("x", n)
		if got, err := SchemeDefault.RequestOf(&p.Spec.Containers[0]); err != nil || got != (ContainerRequest{Core: want}) {
			t.Errorf("nvidia.com/gpu %s: %+v %v", n, got, err)
		}
	}
	for _, n := range []string{"0", "500m", "2000"} {
		p := whole("x", n)
		if _, err := SchemeDefault.RequestOf(&p.Spec.Containers[0]); err == nil || !strings.Contains(err.Error(), "is not a whole number of GPUs from 1 to 1024") {
			t.Errorf("nvidia.com/gpu %s: %v", n, err)
		}
	}

	p, err := New([]int{0, 1}, newFakeCards(0, 1), WithScheme(SchemeDefault), WithCDIKind("mgpu.io/gpu"), WithLogger(testLogger()))
	if err != nil {
		t.Fatal(err)
	}
	devs, _ := p.devices()
	var listed []string
	for _, d := range devs {
		listed = append(listed, d.ID)
	}
	if strings.Join(listed, " ") != "mgpu-0-00 mgpu-1-00" {
		t.Fatalf("devices %v", listed)
	}
	// Binpack over two empty GPUs takes the first; a must-include ID is kept.
	pref, err := p.GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{
		{AvailableDeviceIDs: listed, AllocationSize: 1},
		{AvailableDeviceIDs: listed, MustIncludeDeviceIDs: []string{"mgpu-1-00"}, AllocationSize: 1},
		{AvailableDeviceIDs: listed, AllocationSize: 2},
	}})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range pref.ContainerResponses {
		got = append(got, strings.Join(r.DeviceIDs, ","))
	}
	if strings.Join(got, " ") != "mgpu-0-00 mgpu-1-00 mgpu-0-00,mgpu-1-00" {
		t.Fatalf("preferred %v", got)
	}
	resp, err := p.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{"mgpu-1-00"}}}})
	if err != nil {
		t.Fatal(err)
	}
	c := resp.ContainerResponses[0]
	if len(c.CdiDevices) != 1 || c.CdiDevices[0].Name != "mgpu.io/gpu=1" || c.Envs["MGPU_CORE"] != "100" {
		t.Fatalf("allocate: %+v", c)
	}
	if _, err := p.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{"mgpu-1-05"}}}}); err == nil {
		t.Fatal("an ID that is not a whole GPU's was allocated")
	}

	pods := &fakePods{pods: []corev1.Pod{whole("one", "1"), whole("two", "2")}}
	allocs := &fakeAllocs{allocs: []Allocation{
		{Namespace: "ns", Pod: "one", Container: "main", Resource: SchemeDefault.Core, IDs: []string{"mgpu-1-00"}},
		{Namespace: "ns", Pod: "two", Container: "main", Resource: SchemeDefault.Core, IDs: []string{"mgpu-0-00"}},
	}}
	r := NewResolver("n1", []int{0, 1}, pods, allocs)
	r.SetScheme(SchemeDefault)
	a, err := r.Resolve(ctx, query("one"))
	if err != nil || len(a.GPUs) != 1 || a.GPUs[0].Index != 1 || a.GPUs[0].Core != 100 || a.GPUs[0].MemoryMiB != 0 {
		t.Fatalf("a whole GPU: %+v %v", a, err)
	}
	if _, err := r.Resolve(ctx, query("two")); err == nil || !strings.Contains(err.Error(), "requests nvidia.com/gpu 200, and the kubelet allocated 100") {
		t.Fatalf("two GPUs asked, one allocated: %v", err)
	}
}

// ackPod is a pod of ACK's core_mem resources.
func ackPod(name, core, gib string) corev1.Pod {
	p := pod(name, "", "", "")
	lim := corev1.ResourceList{}
	if core != "" {
		lim[SchemeCoreMem.Core] = resource.MustParse(core)
	}
	if gib != "" {
		lim[SchemeCoreMem.Memory] = resource.MustParse(gib)
	}
	p.Spec.Containers[0].Resources.Limits = lim
	return p
}

func TestCoreMemRequestsAndResolve(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		core, gib string
		want      ContainerRequest
		err       string
	}{
		{core: "30", gib: "6", want: ContainerRequest{Core: 30, MemoryMiB: 6144}},
		{core: "200", want: ContainerRequest{Core: 200}},
		{core: "30", err: "aliyun.com/gpu-core.percentage 30 (a share of one GPU) needs aliyun.com/gpu-mem"},
		{gib: "6", err: "aliyun.com/gpu-mem needs aliyun.com/gpu-core.percentage"},
		{core: "30", gib: "1.5", err: "aliyun.com/gpu-mem 1500m is not a whole number of GiB from 1 to 16384"},
		{core: "30", gib: "16385", err: "aliyun.com/gpu-mem 16385 is not a whole number of GiB from 1 to 16384"},
	} {
		p := ackPod("x", tc.core, tc.gib)
		got, err := SchemeCoreMem.RequestOf(&p.Spec.Containers[0])
		switch {
		case tc.err != "" && (err == nil || err.Error() != tc.err):
			t.Errorf("%s/%s: %v, want %q", tc.core, tc.gib, err, tc.err)
		case tc.err == "" && (err != nil || got != tc.want):
			t.Errorf("%s/%s: %+v %v, want %+v", tc.core, tc.gib, got, err, tc.want)
		}
	}

	pods := &fakePods{pods: []corev1.Pod{ackPod("ack", "30", "6"), pod("vke", "30", "4096", "")}}
	allocs := &fakeAllocs{allocs: []Allocation{
		{Namespace: "ns", Pod: "ack", Container: "main", Resource: SchemeCoreMem.Core, IDs: ids(1, 0, 30)},
		{Namespace: "ns", Pod: "vke", Container: "main", Resource: ResourceName, IDs: ids(0, 0, 30)},
	}}
	r := NewResolver("n1", []int{0, 1}, pods, allocs)
	r.SetScheme(SchemeCoreMem)
	a, err := r.Resolve(context.Background(), query("ack"))
	if err != nil || len(a.GPUs) != 1 || a.GPUs[0].Index != 1 || a.GPUs[0].Core != 30 || a.GPUs[0].MemoryMiB != 6144 || a.Policy != "fixed-share" {
		t.Fatalf("core_mem pod: %+v %v", a, err)
	}
	// Under core_mem a pod of the mgpu resources has no quota.
	if _, err := r.Resolve(context.Background(), query("vke")); err == nil || !strings.Contains(err.Error(), "requests no aliyun.com/gpu-core.percentage (the node's ack.node.gpu.schedule is core_mem)") {
		t.Fatalf("mgpu pod under core_mem: %v", err)
	}
}

func TestInactivePluginListsNothing(t *testing.T) {
	t.Parallel()
	p, err := New([]int{0}, newFakeCards(0), WithScheme(SchemeCoreMem), WithActive(false), WithLogger(testLogger()))
	if err != nil {
		t.Fatal(err)
	}
	devs, changed := p.devices()
	if len(devs) != 0 {
		t.Fatalf("inactive: %d devices", len(devs))
	}
	_, err = p.Allocate(context.Background(), &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: ids(0, 0, 30)}}})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "aliyun.com/gpu-core.percentage is not served on this node now") {
		t.Fatalf("allocate while inactive: %v", err)
	}
	p.SetActive(true)
	select {
	case <-changed:
	default:
		t.Fatal("activation did not wake ListAndWatch")
	}
	if devs, _ := p.devices(); len(devs) != IDsPerGPU {
		t.Fatalf("active: %d devices", len(devs))
	}
	if p.SocketPath() != DefaultDir+"mgpu-ack-core.sock" {
		t.Fatalf("socket %s", p.SocketPath())
	}
}

// Entering mps mode logs, once, that the mode schedules memory and does
// not isolate it (the limit is the tenant's environment).
func TestMPSModeLogsThatMemoryIsNotIsolated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1", Labels: map[string]string{ModeLabel: "mps"}}})
	var plugins []*Plugin
	for _, s := range PluginSchemes() {
		opts := []Option{WithScheme(s), WithLogger(testLogger()), WithMode(SchemeMGPU)}
		if s.Core == ACKMemory.Core {
			opts = append(opts, WithMemory(map[int]uint64{0: 81920}))
		}
		p, err := New([]int{0}, newFakeCards(0), opts...)
		if err != nil {
			t.Fatal(err)
		}
		plugins = append(plugins, p)
	}
	var logs strings.Builder
	log := slog.New(slog.NewTextHandler(&logs, nil))
	n := NewNodePublisher(client, "n1", nil, []uint64{81920}, plugins, placement.Binpack, log).
		WithModes(SchemeMGPU, NewResolver("n1", []int{0}, &fakePods{}, &fakeAllocs{}), &fakeAllocs{})
	for range 3 {
		if err := n.Publish(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if n.Current().Mode != "mps" {
		t.Fatalf("mode %s, want mps", n.Current().Mode)
	}
	if got := strings.Count(logs.String(), "mode mps schedules memory and does not isolate it: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT is the container's own environment"); got != 1 {
		t.Fatalf("logged %d times, want once:\n%s", got, logs.String())
	}
}

// The node's mode follows its label, the other mode's resources are 0, and
// a change waits until no container holds the current mode's device IDs.
func TestNodeModes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}})
	plugins := nodePlugins(t)
	mem := plugins[len(plugins)-1] // PluginSchemes ends with the memory plugin's
	if mem.Scheme().Core != ACKMemory.Core {
		t.Fatalf("the last plugin serves %s", mem.Scheme().Core)
	}
	r := NewResolver("n1", []int{0, 1}, &fakePods{}, &fakeAllocs{})
	allocs := &fakeAllocs{}
	noMPS := func(s Scheme) error {
		if s.Enforce == EnforceMPS {
			return errors.New("no MPS here")
		}
		return nil
	}
	pool := &fakePool{}
	n := NewNodePublisher(client, "n1", nil, []uint64{81920, 81920}, plugins, placement.Binpack, testLogger()).WithModes(SchemeMGPU, r, allocs).WithModeCheck(noMPS).WithDRA(pool)

	// check publishes and checks the mode, the DRA pool (listed in mode
	// dra only), the plugins that list devices
	// (the resources the kubelet sets: memDevs of aliyun.com/gpu-mem) and
	// the capacity the agent sets, mgpu-memory (aliyun.com/gpu-mem is the
	// memory plugin's, never patched).
	check := func(when, mode string, mgpuMem string, memDevs int) {
		t.Helper()
		if err := n.Publish(ctx); err != nil {
			t.Fatalf("%s: %v", when, err)
		}
		node, err := client.CoreV1().Nodes().Get(ctx, "n1", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if n.Current().Mode != mode || r.Scheme().Mode != mode {
			t.Fatalf("%s: mode %s, resolver %s, want %s", when, n.Current().Mode, r.Scheme().Mode, mode)
		}
		if pool.active != (mode == "dra") {
			t.Fatalf("%s: DRA pool active=%v in mode %s", when, pool.active, mode)
		}
		for _, p := range plugins {
			if want := slices.Contains(n.Current().Resources(), p.Scheme().Core); p.Active() != want {
				t.Fatalf("%s: plugin of %s active=%v", when, p.Scheme().Core, p.Active())
			}
			if p.NodeScheme().Mode != mode {
				t.Fatalf("%s: plugin of %s was told mode %s", when, p.Scheme().Core, p.NodeScheme().Mode)
			}
		}
		if devs, _ := mem.devices(); len(devs) != memDevs {
			t.Fatalf("%s: the memory plugin lists %d IDs, want %d", when, len(devs), memDevs)
		}
		if q := node.Status.Capacity[MemoryResourceName]; q.String() != mgpuMem {
			t.Fatalf("%s: capacity %s = %s, want %s", when, MemoryResourceName, q.String(), mgpuMem)
		}
		for _, res := range []corev1.ResourceName{"", ACKMemory.Core} {
			if _, ok := node.Status.Capacity[res]; ok {
				t.Fatalf("%s: the agent set capacity %q", when, res)
			}
		}
	}
	setLabel := func(v string) {
		node, err := client.CoreV1().Nodes().Get(ctx, "n1", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if node.Labels == nil {
			node.Labels = map[string]string{}
		}
		if v == "" {
			delete(node.Labels, ModeLabel)
		} else {
			node.Labels[ModeLabel] = v
		}
		if _, err := client.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	check("no label", "mgpu", "163840", 0)
	setLabel("core_mem")
	check("core_mem, node empty", "core_mem", "0", 160)
	// A pod of core_mem runs: a change back waits for it.
	allocs.allocs = []Allocation{{Namespace: "ns", Pod: "a", Container: "main", Resource: SchemeCoreMem.Core, IDs: ids(0, 0, 30)}}
	setLabel("mgpu")
	check("mgpu while a core_mem pod runs", "core_mem", "0", 160)
	setLabel("exclusive")
	check("not a mode", "core_mem", "0", 160)
	setLabel("")
	check("label removed while the pod runs", "core_mem", "0", 160)
	allocs.allocs = nil
	check("label removed, node empty", "mgpu", "163840", 0)
	setLabel("default")
	check("default: whole GPUs, no memory resource", "default", "0", 0)
	setLabel("cgpu")
	check("cgpu: memory alone", "cgpu", "0", 160)
	// A cgpu pod holds only memory IDs; share waits for it too.
	allocs.allocs = []Allocation{{Namespace: "ns", Pod: "b", Container: "main", Resource: ACKMemory.Core, IDs: []string{"mgpu-0-gib-0"}}}
	setLabel("share")
	check("share while a cgpu pod runs", "cgpu", "0", 160)
	allocs.allocs = nil
	check("share, node empty", "share", "0", 160)
	setLabel("mps")
	check("mps refused by the node's check", "share", "0", 160)
	setLabel("")
	check("back to mgpu", "mgpu", "163840", 0)

	// dra: no device plugin lists anything and mgpu-memory is 0; into it
	// once no container holds IDs, out of it once no claim is prepared.
	allocs.allocs = []Allocation{{Namespace: "ns", Pod: "a", Container: "main", Resource: ResourceName, IDs: ids(0, 0, 30)}}
	setLabel("dra")
	check("dra while an mgpu pod runs", "mgpu", "163840", 0)
	allocs.allocs = nil
	check("dra, node empty", "dra", "0", 0)
	pool.prepared = 2
	setLabel("mgpu")
	check("mgpu while two claims are prepared", "dra", "0", 0)
	setLabel("")
	check("label removed while claims are prepared", "dra", "0", 0)
	pool.prepared = 0
	check("claims released", "mgpu", "163840", 0)

	// An agent that starts on a node whose containers hold core_mem IDs
	// serves core_mem whatever the label says; one whose containers hold
	// memory IDs alone serves the label's mode of memory alone, else cgpu.
	restart := func(label string, held []Allocation) {
		setLabel(label)
		allocs.allocs = held
		n = NewNodePublisher(client, "n1", nil, []uint64{81920, 81920}, plugins, placement.Binpack, testLogger()).WithModes(SchemeMGPU, r, allocs).WithDRA(pool)
	}
	coreMem := []Allocation{
		{Namespace: "ns", Pod: "a", Container: "main", Resource: SchemeCoreMem.Core, IDs: ids(0, 0, 30)},
		{Namespace: "ns", Pod: "a", Container: "main", Resource: ACKMemory.Core, IDs: []string{"mgpu-0-gib-0"}},
	}
	memOnly := []Allocation{{Namespace: "ns", Pod: "b", Container: "main", Resource: ACKMemory.Core, IDs: []string{"mgpu-1-gib-0"}}}
	restart("", coreMem)
	check("restart with a core_mem pod", "core_mem", "0", 160)
	restart("cgpu", coreMem)
	check("restart with a core_mem pod, labelled cgpu", "core_mem", "0", 160)
	restart("share", memOnly)
	check("restart with a memory pod, labelled share", "share", "0", 160)
	restart("mgpu", memOnly)
	check("restart with a memory pod, labelled mgpu", "cgpu", "0", 160)
	// One that starts with prepared claims (its checkpoint) serves dra.
	pool.prepared = 1
	restart("", nil)
	check("restart with a prepared claim, no label", "dra", "0", 0)
}

// The node's allocation annotation is written when the enforcers' view
// differs from it or it is older than allocRefresh, and not otherwise.
func TestNodeAllocationAnnotation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}})
	p, err := New([]int{0, 1}, newFakeCards(0, 1), WithLogger(testLogger()))
	if err != nil {
		t.Fatal(err)
	}
	at := time.Date(2026, 12, 5, 1, 0, 0, 0, time.UTC)
	view := allocview.Node{GPUs: []allocview.GPU{
		{Index: 0, AllocatedMiB: 6144, TotalMiB: 81920, Instances: 1, Running: true},
		{Index: 1, TotalMiB: 81920, Running: true},
	}}
	n := NewNodePublisher(client, "n1", nil, []uint64{81920, 81920}, []*Plugin{p}, placement.Binpack, testLogger()).
		WithAllocation(func(context.Context) allocview.Node { v := view; v.Updated = at; return v })
	published := func() (allocview.Node, int) {
		t.Helper()
		client.ClearActions()
		if err := n.Publish(ctx); err != nil {
			t.Fatal(err)
		}
		patches := 0
		for _, a := range client.Actions() {
			if a.GetVerb() == "patch" && a.GetSubresource() == "" {
				patches++
			}
		}
		node, err := client.CoreV1().Nodes().Get(ctx, "n1", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		got, err := allocview.Decode(node.Annotations[allocview.Annotation])
		if err != nil {
			t.Fatal(err)
		}
		return got, patches
	}
	if got, k := published(); k != 1 || got.GPUs[0].AllocatedMiB != 6144 || !got.Updated.Equal(at) {
		t.Fatalf("first publish: %d patches, %+v", k, got)
	}
	at = at.Add(30 * time.Second)
	if _, k := published(); k != 0 {
		t.Fatalf("nothing changed, 30 s later: %d patches", k)
	}
	view.GPUs[1].AllocatedMiB, view.GPUs[1].Instances = 1024, 1
	if got, k := published(); k != 1 || got.GPUs[1].AllocatedMiB != 1024 {
		t.Fatalf("an allocation changed: %d patches, %+v", k, got)
	}
	at = at.Add(allocRefresh)
	if got, k := published(); k != 1 || !got.Updated.Equal(at) {
		t.Fatalf("after allocRefresh: %d patches, updated %v", k, got.Updated)
	}
}

// countingCards counts the source's calls.
type countingCards struct {
	fakeCards
	calls int
}

func (c *countingCards) Cards(ctx context.Context) ([]placement.Card, error) {
	c.mu.Lock()
	c.calls++
	c.mu.Unlock()
	return c.fakeCards.Cards(ctx)
}

// An inactive plugin does not ask the enforcers; activated, it asks at
// once (its health may be stale).
func TestInactivePluginDoesNotPoll(t *testing.T) {
	t.Parallel()
	src := &countingCards{}
	src.set(0)
	p, err := New([]int{0}, src, WithActive(false), WithLogger(testLogger()))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	p.pollIfActive(ctx)
	if src.calls != 0 {
		t.Fatalf("inactive plugin polled %d times", src.calls)
	}
	p.SetActive(true)
	select {
	case <-p.repoll:
	default:
		t.Fatal("activation did not ask for a poll")
	}
	p.pollIfActive(ctx)
	if src.calls != 1 {
		t.Fatalf("active plugin polled %d times", src.calls)
	}
	p.SetActive(true) // no change: no second request
	select {
	case <-p.repoll:
		t.Fatal("a repeated activation asked for a poll")
	default:
	}
}

// nodePlugins are the node agent's plugins, one per PluginSchemes, of two
// 80 GiB GPUs, in mode mgpu.
func nodePlugins(t *testing.T) []*Plugin {
	t.Helper()
	var plugins []*Plugin
	for _, s := range PluginSchemes() {
		opts := []Option{WithScheme(s), WithLogger(testLogger())}
		if s.Core == ACKMemory.Core {
			opts = append(opts, WithMemory(map[int]uint64{0: 81920, 1: 81920}))
		}
		p, err := New([]int{0, 1}, newFakeCards(0, 1), append(opts, WithMode(SchemeMGPU))...)
		if err != nil {
			t.Fatal(err)
		}
		plugins = append(plugins, p)
	}
	return plugins
}

// fakePool is a DRA driver of a fixed number of prepared claims.
type fakePool struct {
	prepared int
	active   bool
}

func (f *fakePool) Prepared() int    { return f.prepared }
func (f *fakePool) SetActive(a bool) { f.active = a }
