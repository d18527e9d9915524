package admission

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
)

func pendingPod(name, pol string, core bool) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: types.UID("uid-" + name)},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "main"}}},
		Status: corev1.PodStatus{Phase: corev1.PodPending, Conditions: []corev1.PodCondition{{
			Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: corev1.PodReasonUnschedulable,
		}}},
	}
	if pol != "" {
		p.Annotations = map[string]string{PolicyKey: pol}
	}
	if core {
		p.Spec.Containers[0].Resources.Limits = corev1.ResourceList{ResourceCore: resource.MustParse("30")}
	}
	return p
}

func TestExplainer(t *testing.T) {
	t.Parallel()
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1", Labels: map[string]string{PolicyKey: "guaranteed-burst-share"}}}
	client := fake.NewClientset(node,
		pendingPod("fixed", "fixed-share", true),
		pendingPod("default", "", true),
		pendingPod("runs", "guaranteed-burst-share", true),
		pendingPod("nogpu", "fixed-share", false),
	)
	e := NewExplainer(client, slog.New(slog.NewTextHandler(io.Discard, nil)))
	ctx := context.Background()
	for range 2 { // the second pass tells nobody again
		if err := e.Once(ctx); err != nil {
			t.Fatal(err)
		}
	}
	evs, err := client.CoreV1().Events("ns").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, ev := range evs.Items {
		if ev.Reason != ExplainReason || ev.Type != corev1.EventTypeWarning || ev.InvolvedObject.Kind != "Pod" {
			t.Errorf("event %+v", ev)
		}
		if _, dup := got[ev.InvolvedObject.Name]; dup {
			t.Errorf("pod %s told twice", ev.InvolvedObject.Name)
		}
		got[ev.InvolvedObject.Name] = ev.Message
	}
	if len(got) != 2 {
		t.Fatalf("events for %v, want fixed and default", got)
	}
	for _, name := range []string{"fixed", "default"} {
		want := "no node runs compute policy fixed-share: no node is labelled vke.volcengine.com/mgpu-compute-policy=fixed-share (nodes run guaranteed-burst-share)"
		if !strings.HasPrefix(got[name], want) {
			t.Errorf("%s: %q, want it to start with %q", name, got[name], want)
		}
	}
}
