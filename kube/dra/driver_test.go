package dra

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/utils/ptr"

	"github.com/mgpu-dev/mgpu/internal/policy"
)

func testDriver(t *testing.T, dir string) *Driver {
	t.Helper()
	d, err := New(Config{Node: "n1", CDIKind: "mgpu.io/gpu", DataDir: dir, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		GPUs: []GPU{
			{Index: 0, UUID: "GPU-a", Model: "H200", MemoryMiB: 81920, Policy: policy.GuaranteedBurstShare, MaxInstances: 3},
			{Index: 1, UUID: "GPU-b", Model: "H200", MemoryMiB: 81920, Policy: policy.GuaranteedBurstShare, MaxInstances: 3},
		}})
	if err != nil {
		t.Fatal(err)
	}
	d.SetActive(true)
	return d
}

// claim is an allocated claim of one share per (gpu, cores, memory).
func claim(uid, name string, pods []string, shares ...[3]string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{UID: types.UID(uid), Namespace: "ns", Name: name}}
	c.Status.Allocation = &resourceapi.AllocationResult{}
	for i, s := range shares {
		cc := map[resourceapi.QualifiedName]resource.Quantity{}
		if s[1] != "" {
			cc[CapCores] = resource.MustParse(s[1])
		}
		if s[2] != "" {
			cc[CapMemory] = resource.MustParse(s[2])
		}
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results, resourceapi.DeviceRequestAllocationResult{
			Request: "gpu", Driver: DriverName, Pool: "n1", Device: s[0], ShareID: ptr.To(types.UID(uid + "-share" + string(rune('0'+i)))),
			ConsumedCapacity: cc,
		})
	}
	for _, p := range pods {
		c.Status.ReservedFor = append(c.Status.ReservedFor, resourceapi.ResourceClaimConsumerReference{Resource: "pods", Name: "p", UID: types.UID(p)})
	}
	return c
}

func prepare(t *testing.T, d *Driver, cs ...*resourceapi.ResourceClaim) map[types.UID]kubeletplugin.PrepareResult {
	t.Helper()
	out, err := d.PrepareResourceClaims(context.Background(), cs)
	if err != nil {
		t.Fatal(err)
	}
	if len(out) != len(cs) {
		t.Fatalf("%d results for %d claims", len(out), len(cs))
	}
	return out
}

func TestResourcesPublishOneSharedDevicePerGPU(t *testing.T) {
	d := testDriver(t, t.TempDir())
	r := d.Resources()
	pool, ok := r.Pools["n1"]
	if !ok || len(pool.Slices) != 1 || len(pool.Slices[0].Devices) != 2 {
		t.Fatalf("pools %+v", r.Pools)
	}
	dev := pool.Slices[0].Devices[1]
	if dev.Name != "gpu-1" || dev.AllowMultipleAllocations == nil || !*dev.AllowMultipleAllocations {
		t.Fatalf("device %+v", dev)
	}
	if q := dev.Capacity[CapMemory].Value; q.Value() != 81920<<20 {
		t.Errorf("memory capacity %s", q.String())
	}
	if q := dev.Capacity[CapCores].Value; q.Value() != 100 {
		t.Errorf("cores capacity %s", q.String())
	}
	if q := dev.Capacity[CapInstances].Value; q.Value() != 3 {
		t.Errorf("instances capacity %s", q.String())
	}
	if p := dev.Attributes[AttrPolicy].StringValue; p == nil || *p != "guaranteed-burst-share" {
		t.Errorf("policy attribute %v", p)
	}
	if len(dev.Taints) != 0 {
		t.Errorf("taints %v on a healthy GPU", dev.Taints)
	}
	d.SetHealth(map[int]bool{0: true})
	dev = d.Resources().Pools["n1"].Slices[0].Devices[1]
	if len(dev.Taints) != 1 || dev.Taints[0].Key != TaintEnforcerDown || dev.Taints[0].Effect != resourceapi.DeviceTaintEffectNoSchedule {
		t.Errorf("GPU 1 without its enforcer: taints %v", dev.Taints)
	}
	d.SetActive(false)
	if p := d.Resources().Pools["n1"]; len(p.Slices) != 1 || len(p.Slices[0].Devices) != 0 {
		t.Errorf("inactive: want one empty slice, got %+v", p)
	}
}

func TestPrepareReservesAndAnswersTheSame(t *testing.T) {
	dir := t.TempDir()
	d := testDriver(t, dir)
	c1 := claim("u1", "c1", []string{"pod1"}, [3]string{"gpu-0", "30", "4Gi"})
	out := prepare(t, d, c1)
	r := out["u1"]
	if r.Err != nil || len(r.Devices) != 1 {
		t.Fatalf("result %+v", r)
	}
	dev := r.Devices[0]
	if dev.DeviceName != "gpu-0" || dev.PoolName != "n1" || len(dev.CDIDeviceIDs) != 1 || dev.CDIDeviceIDs[0] != "mgpu.io/gpu=0" || dev.ShareID == nil || *dev.ShareID != "u1-share0" {
		t.Fatalf("device %+v", dev)
	}
	c, ok := d.Claim("ns", "c1", "pod1")
	if !ok || len(c.Shares) != 1 || c.Shares[0].Core != 30 || c.Shares[0].MemoryMiB != 4096 || !c.ReservedFor("pod1") {
		t.Fatalf("claim %+v", c)
	}
	// Again (the kubelet restarted): the same answer, nothing more held.
	again := prepare(t, d, c1)["u1"]
	if again.Err != nil || again.Devices[0].CDIDeviceIDs[0] != "mgpu.io/gpu=0" || d.Prepared() != 1 {
		t.Fatalf("again: %+v, %d prepared", again, d.Prepared())
	}
	// The agent restarted: the checkpoint restores it, and it still counts.
	d2 := testDriver(t, dir)
	if c2, ok := d2.Claim("ns", "c1", "pod1"); !ok || c2.Shares[0] != c.Shares[0] {
		t.Fatalf("restored %+v %v", c2, ok)
	}
	over := prepare(t, d2, claim("u2", "c2", []string{"pod2"}, [3]string{"gpu-0", "71", "4Gi"}))["u2"]
	if over.Err == nil || !strings.Contains(over.Err.Error(), "101% of cores") {
		t.Fatalf("71%% beside a restored 30%%: %v", over.Err)
	}
	ok70 := prepare(t, d2, claim("u3", "c3", []string{"pod3"}, [3]string{"gpu-0", "70", "4Gi"}))["u3"]
	if ok70.Err != nil {
		t.Fatal(ok70.Err)
	}
	// Unprepare releases; twice is no error.
	for range 2 {
		res, err := d2.UnprepareResourceClaims(context.Background(), []kubeletplugin.NamespacedObject{{UID: "u1"}})
		if err != nil || res["u1"] != nil {
			t.Fatal(err, res)
		}
	}
	if _, ok := d2.Claim("ns", "c1", "pod1"); ok || d2.Prepared() != 1 {
		t.Fatalf("c1 still prepared (%d)", d2.Prepared())
	}
	if d3 := testDriver(t, dir); d3.Prepared() != 1 {
		t.Fatalf("checkpoint after unprepare holds %d", d3.Prepared())
	}
}

func TestPrepareRefuses(t *testing.T) {
	for _, tc := range []struct {
		name  string
		claim *resourceapi.ResourceClaim
		want  string
	}{
		{"no consumed cores", claim("u", "c", nil, [3]string{"gpu-0", "", "1Gi"}), "no consumed cores"},
		{"fractional memory", claim("u", "c", nil, [3]string{"gpu-0", "10", "1000Ki"}), "whole number of MiB"},
		{"memory over the card", claim("u", "c", nil, [3]string{"gpu-0", "10", "81921Mi"}), "whole number of MiB"},
		{"cores over 100", claim("u", "c", nil, [3]string{"gpu-0", "101", "1Gi"}), "from 1 to 100"},
		{"unknown GPU", claim("u", "c", nil, [3]string{"gpu-7", "10", "1Gi"}), "no GPU 7"},
		{"bad device", claim("u", "c", nil, [3]string{"gpu-01", "10", "1Gi"}), "not one of this node's GPUs"},
		{"two shares of one GPU", claim("u", "c", nil, [3]string{"gpu-0", "10", "1Gi"}, [3]string{"gpu-0", "10", "1Gi"}), "two shares of GPU 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := testDriver(t, t.TempDir())
			r := prepare(t, d, tc.claim)["u"]
			if r.Err == nil || !strings.Contains(r.Err.Error(), tc.want) {
				t.Fatalf("err %v, want %q", r.Err, tc.want)
			}
			if d.Prepared() != 0 {
				t.Fatal("a refused claim was prepared")
			}
		})
	}
	t.Run("another pool", func(t *testing.T) {
		d := testDriver(t, t.TempDir())
		c := claim("u", "c", nil, [3]string{"gpu-0", "10", "1Gi"})
		c.Status.Allocation.Devices.Results[0].Pool = "n2"
		if r := prepare(t, d, c)["u"]; r.Err == nil || !strings.Contains(r.Err.Error(), `pool "n2"`) {
			t.Fatal(r.Err)
		}
	})
	t.Run("instances", func(t *testing.T) {
		d := testDriver(t, t.TempDir())
		var cs []*resourceapi.ResourceClaim
		for _, u := range []string{"a", "b", "c", "d"} {
			cs = append(cs, claim(u, u, nil, [3]string{"gpu-1", "10", "1Gi"}))
		}
		out := prepare(t, d, cs...)
		if out["a"].Err != nil || out["c"].Err != nil || out["d"].Err == nil || !strings.Contains(out["d"].Err.Error(), "max_instances 3") {
			t.Fatalf("%+v", out)
		}
	})
	t.Run("inactive", func(t *testing.T) {
		d := testDriver(t, t.TempDir())
		d.SetActive(false)
		if r := prepare(t, d, claim("u", "c", nil, [3]string{"gpu-0", "10", "1Gi"}))["u"]; r.Err == nil || !strings.Contains(r.Err.Error(), "not dra") {
			t.Fatal(r.Err)
		}
	})
}

func TestCheckpointDamagedIsAnError(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, CheckpointName), []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := New(Config{Node: "n1", CDIKind: "mgpu.io/gpu", DataDir: dir, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err == nil || !strings.Contains(err.Error(), "does not parse") {
		t.Fatalf("err %v", err)
	}
}

// A claim made again under the name of one not yet unprepared: the
// lookup finds the one reserved for the asking pod.
func TestClaimOfTheSameNameTwice(t *testing.T) {
	d := testDriver(t, t.TempDir())
	prepare(t, d, claim("old", "c", []string{"pod-old"}, [3]string{"gpu-0", "10", "1Gi"}),
		claim("new", "c", []string{"pod-new"}, [3]string{"gpu-1", "20", "1Gi"}))
	for _, tc := range []struct{ pod, uid string }{{"pod-old", "old"}, {"pod-new", "new"}} {
		if c, ok := d.Claim("ns", "c", tc.pod); !ok || c.UID != tc.uid {
			t.Errorf("claim ns/c for %s: %+v %v, want UID %s", tc.pod, c, ok, tc.uid)
		}
	}
	if _, ok := d.Claim("ns", "c", "stranger"); !ok {
		t.Error("a claim of the name exists: the lookup finds one, for the resolver's refusal")
	}
}
