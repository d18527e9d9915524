package k8s

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"github.com/mgpu-dev/mgpu/test/harness"
)

// WaitPodPhase waits until pod ns/name is in phase and returns it. It
// fails the test at the timeout, or at once when the pod reaches another
// phase it cannot leave (Succeeded, Failed), with the pod's status, its
// events and the end of the kubelet's log.
func (c *Cluster) WaitPodPhase(t testing.TB, ns, name string, phase corev1.PodPhase, timeout time.Duration) *corev1.Pod {
	t.Helper()
	var pod *corev1.Pod
	err := harness.WaitFor(timeout, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		p, err := c.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		pod = p
		if p.Status.Phase == phase {
			return nil
		}
		err = fmt.Errorf("pod %s/%s is %s, not %s", ns, name, p.Status.Phase, phase)
		if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			return harness.Permanent(err)
		}
		return err
	})
	if err != nil {
		t.Fatalf("k8s: %v\n%s", err, c.DescribePod(ns, name, pod))
	}
	return pod
}

// DescribePod is a pod's status and events, for failure messages; pod
// may be nil (then only the events).
func (c *Cluster) DescribePod(ns, name string, pod *corev1.Pod) string {
	var b strings.Builder
	if pod != nil {
		fmt.Fprintf(&b, "phase %s, reason %q, message %q, node %q\n", pod.Status.Phase, pod.Status.Reason, pod.Status.Message, pod.Spec.NodeName)
		for _, cond := range pod.Status.Conditions {
			fmt.Fprintf(&b, "  condition %s=%s %s %s\n", cond.Type, cond.Status, cond.Reason, cond.Message)
		}
		for _, cs := range append(append([]corev1.ContainerStatus{}, pod.Status.InitContainerStatuses...), pod.Status.ContainerStatuses...) {
			fmt.Fprintf(&b, "  container %s: ready=%v restarts=%d %s\n", cs.Name, cs.Ready, cs.RestartCount, describeState(cs.State))
		}
	}
	events, err := c.Events(ns, name)
	if err != nil {
		fmt.Fprintf(&b, "events: %v\n", err)
	}
	for _, e := range events {
		fmt.Fprintf(&b, "  event %s %s %s: %s\n", e.Type, e.Reason, e.Source.Component, e.Message)
	}
	fmt.Fprintf(&b, "kubelet log, the end:\n%s", tail(c.kubelet.log, 3000))
	return b.String()
}

func describeState(s corev1.ContainerState) string {
	switch {
	case s.Waiting != nil:
		return fmt.Sprintf("waiting %s: %s", s.Waiting.Reason, s.Waiting.Message)
	case s.Running != nil:
		return "running since " + s.Running.StartedAt.String()
	case s.Terminated != nil:
		return fmt.Sprintf("terminated exit %d %s: %s", s.Terminated.ExitCode, s.Terminated.Reason, s.Terminated.Message)
	}
	return "no state"
}

// Events lists the events about the object called name in namespace ns
// (any kind), oldest first.
func (c *Cluster) Events(ns, name string) ([]corev1.Event, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	list, err := c.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("involvedObject.name", name).String()})
	if err != nil {
		return nil, err
	}
	events := list.Items
	sort.SliceStable(events, func(i, j int) bool { return eventTime(events[i]).Before(eventTime(events[j])) })
	return events, nil
}

func eventTime(e corev1.Event) time.Time {
	switch {
	case !e.LastTimestamp.IsZero():
		return e.LastTimestamp.Time
	case !e.EventTime.IsZero():
		return e.EventTime.Time
	}
	return e.CreationTimestamp.Time
}

// PodLog is a container's log through the API (pods/log, which the
// apiserver reads from the kubelet); container may be empty for a pod of
// one container.
func (c *Cluster) PodLog(t testing.TB, ns, name, container string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	data, err := c.Client.CoreV1().Pods(ns).GetLogs(name, &corev1.PodLogOptions{Container: container}).DoRaw(ctx)
	if err != nil {
		t.Fatalf("k8s: log of pod %s/%s: %v", ns, name, err)
	}
	return string(data)
}
