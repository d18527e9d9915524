package deviceplugin

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/mgpu-dev/mgpu/kube/placement"
)

func TestNodePublisher(t *testing.T) {
	t.Parallel()
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{
		Name: "n1", Labels: map[string]string{"keep": "me", PlacementLabel: "spread"},
	}})
	p, err := New([]int{0, 1}, newFakeCards(0, 1), WithLogger(testLogger()))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"vke.node.gpu.schedule": "mgpu", PolicyKey: "guaranteed-burst-share"}
	n := NewNodePublisher(client, "n1", want, []uint64{81920, 81920}, []*Plugin{p}, placement.Binpack, testLogger())
	ctx := context.Background()
	if err := n.Publish(ctx); err != nil {
		t.Fatal(err)
	}
	node, err := client.CoreV1().Nodes().Get(ctx, "n1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]string{"keep": "me", "vke.node.gpu.schedule": "mgpu", PolicyKey: "guaranteed-burst-share"} {
		if node.Labels[k] != v {
			t.Errorf("label %s = %q, want %q", k, node.Labels[k], v)
		}
	}
	if q := node.Status.Capacity[MemoryResourceName]; q.String() != "163840" {
		t.Errorf("capacity %s = %s", MemoryResourceName, q.String())
	}
	if p.Policy() != placement.Spread {
		t.Errorf("placement %v, want spread from the label", p.Policy())
	}

	// Nothing differs: no write. A bad label falls back to the default.
	node.Labels[PlacementLabel] = "scatter"
	if _, err := client.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	client.ClearActions()
	if err := n.Publish(ctx); err != nil {
		t.Fatal(err)
	}
	for _, a := range client.Actions() {
		if a.GetVerb() != "get" {
			t.Errorf("unneeded %s %s", a.GetVerb(), a.GetSubresource())
		}
	}
	if p.Policy() != placement.Binpack {
		t.Errorf("placement %v after a bad label, want binpack", p.Policy())
	}
	if err := NewNodePublisher(client, "missing", want, []uint64{1}, []*Plugin{p}, placement.Binpack, testLogger()).Publish(ctx); err == nil {
		t.Error("a node that does not exist: no error")
	}
}
