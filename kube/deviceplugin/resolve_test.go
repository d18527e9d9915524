package deviceplugin

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/mgpu-dev/mgpu/kube/agentapi"
)

// fakePods is a PodSource of fixed pods.
type fakePods struct{ pods []corev1.Pod }

func (f *fakePods) Pod(_ context.Context, ns, name string) (*corev1.Pod, error) {
	for i := range f.pods {
		if f.pods[i].Namespace == ns && f.pods[i].Name == name {
			p := f.pods[i]
			return &p, nil
		}
	}
	return nil, fmt.Errorf("pods %q not found", name)
}

func (f *fakePods) NodePods(context.Context) ([]corev1.Pod, error) { return f.pods, nil }

// fakeAllocs is an AllocationSource of fixed allocations.
type fakeAllocs struct{ allocs []Allocation }

func (f *fakeAllocs) Allocations(context.Context) ([]Allocation, error) { return f.allocs, nil }

// pod makes a pod on node "n1" with one container "main" of the given
// limits (empty: not set) and policy annotation (empty: none).
func pod(name, core, memory, pol string) corev1.Pod {
	lim := corev1.ResourceList{}
	if core != "" {
		lim[ResourceName] = resource.MustParse(core)
	}
	if memory != "" {
		lim[MemoryResourceName] = resource.MustParse(memory)
	}
	p := corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, UID: types.UID("uid-" + name)},
		Spec: corev1.PodSpec{NodeName: "n1", Containers: []corev1.Container{{
			Name: "main", Resources: corev1.ResourceRequirements{Limits: lim},
		}}},
	}
	if pol != "" {
		p.Annotations = map[string]string{PolicyKey: pol}
	}
	return p
}

// ids are n IDs of gpu from k = from.
func ids(gpu, from, n int) []string {
	var out []string
	for k := from; k < from+n; k++ {
		out = append(out, ID{GPU: gpu, K: k}.String())
	}
	return out
}

func query(name string) agentapi.Container {
	return agentapi.Container{Namespace: "ns", Pod: name, UID: "uid-" + name, Container: "main"}
}

func TestResolve(t *testing.T) {
	t.Parallel()
	wrongNode := pod("elsewhere", "30", "4096", "")
	wrongNode.Spec.NodeName = "n2"
	pods := &fakePods{pods: []corev1.Pod{
		pod("share", "30", "4096", "guaranteed-burst-share"),
		pod("whole2", "200", "", ""),
		pod("whole2mem", "200", "10000", "native-burst-share"),
		pod("badpolicy", "30", "4096", "greedy"),
		pod("nocore", "", "", ""),
		pod("short", "30", "4096", ""),
		pod("split", "30", "4096", ""),
		wrongNode,
	}}
	allocs := &fakeAllocs{allocs: []Allocation{
		{Namespace: "ns", Pod: "share", Container: "main", Resource: ResourceName, IDs: ids(1, 0, 30)},
		{Namespace: "ns", Pod: "whole2", Container: "main", Resource: ResourceName, IDs: append(ids(0, 0, 100), ids(1, 0, 100)...)},
		{Namespace: "ns", Pod: "whole2mem", Container: "main", Resource: ResourceName, IDs: append(ids(0, 0, 100), ids(1, 0, 100)...)},
		{Namespace: "ns", Pod: "badpolicy", Container: "main", Resource: ResourceName, IDs: ids(0, 0, 30)},
		{Namespace: "ns", Pod: "short", Container: "main", Resource: ResourceName, IDs: ids(0, 0, 29)},
		{Namespace: "ns", Pod: "split", Container: "main", Resource: ResourceName, IDs: append(ids(0, 0, 15), ids(1, 0, 15)...)},
		{Namespace: "ns", Pod: "elsewhere", Container: "main", Resource: ResourceName, IDs: ids(0, 0, 30)},
	}}
	r := NewResolver("n1", []int{0, 1}, pods, allocs)
	for _, tc := range []struct {
		q    agentapi.Container
		want string // the GPUs, or a substring of the error
	}{
		{query("share"), "guaranteed-burst-share [{1 30 4096}]"},
		{query("whole2"), "fixed-share [{0 100 0} {1 100 0}]"},
		{query("whole2mem"), "native-burst-share [{0 100 5000} {1 100 5000}]"},
		{query("badpolicy"), `annotation vke.volcengine.com/mgpu-compute-policy`},
		{query("nocore"), "requests no vke.volcengine.com/mgpu-core"},
		{query("short"), "requests vke.volcengine.com/mgpu-core 30, and the kubelet allocated 29"},
		{query("split"), "must come from one GPU"},
		{query("elsewhere"), `bound to node "n2", not this node "n1"`},
		{query("missing"), "reading the pod from the API server"},
		{agentapi.Container{Namespace: "ns", Pod: "share", UID: "uid-old", Container: "main"}, "is UID uid-share, not the container's sandbox's uid-old"},
		{agentapi.Container{Namespace: "ns", Pod: "share", UID: "uid-share", Container: "sidecar"}, "the pod has no such container"},
		{agentapi.Container{Namespace: "ns", Pod: "share"}, "a query needs namespace, pod, uid and container"},
	} {
		a, err := r.Resolve(context.Background(), tc.q)
		got := ""
		if err != nil {
			got = err.Error()
		} else {
			gpus := make([]string, len(a.GPUs))
			for i, g := range a.GPUs {
				gpus[i] = fmt.Sprintf("{%d %d %d}", g.Index, g.Core, g.MemoryMiB)
			}
			got = a.Policy + " [" + strings.Join(gpus, " ") + "]"
			if a.Container != tc.q {
				t.Errorf("%s: answered for %+v", tc.q.Pod, a.Container)
			}
		}
		if !strings.Contains(got, tc.want) {
			t.Errorf("%s/%s: got %q, want %q", tc.q.Pod, tc.q.Container, got, tc.want)
		}
	}
}

func TestRequestOf(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		core, memory string
		want         string
	}{
		{"30", "4096", "{30 4096}"},
		{"100", "", "{100 0}"},
		{"300", "", "{300 0}"},
		{"", "", "{0 0}"},
		{"0", "1", "is not 1 to 100"},
		{"150", "1", "is not 1 to 100"},
		{"500m", "1", "is not 1 to 100"},
		{"30", "", "needs vke.volcengine.com/mgpu-memory"},
		{"", "4096", "needs vke.volcengine.com/mgpu-core"},
		{"30", "1.5", "not a whole number of MiB"},
	} {
		p := pod("x", tc.core, tc.memory, "")
		r, err := RequestOf(&p.Spec.Containers[0])
		got := fmt.Sprint(r)
		if err != nil {
			got = err.Error()
		}
		if !strings.Contains(got, tc.want) {
			t.Errorf("core %q memory %q: got %q, want %q", tc.core, tc.memory, got, tc.want)
		}
	}
}

func TestPendingMemory(t *testing.T) {
	t.Parallel()
	done := pod("done", "30", "50000", "")
	done.Status.Phase = corev1.PodSucceeded
	pods := &fakePods{pods: []corev1.Pod{
		pod("a", "30", "20000", ""), // allocated on GPU 0
		pod("w", "100", "", ""),     // allocated whole GPU 1
		pod("p1", "30", "8000", ""), // pending
		pod("p2", "30", "60000", ""),
		pod("p3", "20", "70000", ""), // pending, another size
		done,
	}}
	allocs := &fakeAllocs{allocs: []Allocation{
		{Namespace: "ns", Pod: "a", Container: "main", Resource: ResourceName, IDs: ids(0, 0, 30)},
		{Namespace: "ns", Pod: "w", Container: "main", Resource: ResourceName, IDs: ids(1, 0, 100)},
		{Namespace: "ns", Pod: "gone", Container: "main", Resource: ResourceName, IDs: ids(2, 0, 10)},
	}}
	r := NewResolver("n1", []int{0, 1, 2}, pods, allocs)
	c, err := r.pendingMemory(context.Background(), 30)
	if err != nil {
		t.Fatal(err)
	}
	if !c.known || c.pending != 60000 || c.committed[0] != 20000 || c.committed[1] != wholeCard || c.committed[2] != wholeCard {
		t.Fatalf("got %+v", c)
	}
	if c, _ := r.pendingMemory(context.Background(), 45); c.known {
		t.Fatalf("size 45: %+v", c)
	}
}

// TestPreferredPlansMemory: binpack would take the fuller GPU 0, but the
// pending container's memory fits only GPU 1.
func TestPreferredPlansMemory(t *testing.T) {
	t.Parallel()
	pods := &fakePods{pods: []corev1.Pod{pod("a", "30", "70000", ""), pod("p", "30", "20000", "")}}
	allocs := &fakeAllocs{allocs: []Allocation{{Namespace: "ns", Pod: "a", Container: "main", Resource: ResourceName, IDs: ids(0, 0, 30)}}}
	cards := newFakeCards(0, 1) // 81920 MiB each, all free as the enforcers see it
	p, err := New([]int{0, 1}, cards, WithResolver(NewResolver("n1", []int{0, 1}, pods, allocs)), WithLogger(testLogger()))
	if err != nil {
		t.Fatal(err)
	}
	avail := append(ids(0, 30, 70), ids(1, 0, 100)...)
	got, err := p.preferred(context.Background(), avail, nil, 30)
	if err != nil {
		t.Fatal(err)
	}
	if got[0] != "mgpu-1-00" || len(got) != 30 {
		t.Fatalf("preferred %v", got)
	}
	// Without the resolver, binpack by core takes GPU 0.
	p2, _ := New([]int{0, 1}, cards, WithLogger(testLogger()))
	got, _ = p2.preferred(context.Background(), avail, nil, 30)
	if got[0] != "mgpu-0-30" {
		t.Fatalf("core alone: %v", got)
	}
}

func TestAgentSocket(t *testing.T) {
	t.Parallel()
	pods := &fakePods{pods: []corev1.Pod{pod("share", "30", "4096", "")}}
	allocs := &fakeAllocs{allocs: []Allocation{{Namespace: "ns", Pod: "share", Container: "main", Resource: ResourceName, IDs: ids(0, 0, 30)}}}
	r := NewResolver("n1", []int{0}, pods, allocs)
	sock := filepath.Join(t.TempDir(), agentapi.SocketName)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ServeAgent(ctx, sock, r, testLogger()) }()
	c := agentapi.NewClient(sock)
	eventually(t, "the agent's socket", func() bool { return isSocket(sock) })
	a, err := c.Assignment(context.Background(), query("share"))
	if err != nil || len(a.GPUs) != 1 || a.GPUs[0] != (agentapi.GPU{Index: 0, Core: 30, MemoryMiB: 4096}) || a.Policy != "fixed-share" {
		t.Fatalf("got %+v, %v", a, err)
	}
	_, err = c.Assignment(context.Background(), query("other"))
	var ae *agentapi.Error
	if !errors.As(err, &ae) || ae.Status != 403 || !strings.Contains(ae.Message, `container "main" of pod ns/other`) {
		t.Fatalf("refusal: %v", err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := c.Assignment(context.Background(), query("share")); !errors.Is(err, agentapi.ErrNotRunning) {
		t.Fatalf("after the end: %v", err)
	}
}
