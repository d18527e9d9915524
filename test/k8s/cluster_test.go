package k8s

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mgpu-dev/mgpu/test/e2e"
	"github.com/mgpu-dev/mgpu/test/fakecuda"
	"github.com/mgpu-dev/mgpu/test/harness"
)

// workloadImage builds the image of e2e.BuildRootfs from `make build`'s
// output, skipping the test when there is none.
func workloadImage(t *testing.T) string {
	t.Helper()
	build, err := fakecuda.BuildDir()
	if err != nil {
		t.Skipf("k8s: %v", err)
	}
	shim := filepath.Join(build, "lib", "libmgpu-shim.so")
	if p := e2e.InstalledFromEnv(); p != "" {
		shim = filepath.Join(p, "lib", "mgpu", "libmgpu-shim.so") // the build holds only the fixtures
	}
	if _, err := os.Stat(filepath.Join(build, "bin", "mgpu-workload")); err != nil {
		t.Skipf("k8s: no workload in %s: run make build", build)
	}
	rootfs := filepath.Join(t.TempDir(), "rootfs")
	if err := e2e.BuildRootfs(rootfs, build, shim); err != nil {
		t.Fatal(err)
	}
	return BuildImageFromDir(t, rootfs, WorkloadImage, []string{"/bin/sh"})
}

// TestClusterRunsPod starts a cluster, runs a pod of the workload image
// that prints and exits 0, reads its log through the API, and checks that
// the teardown leaves nothing behind.
func TestClusterRunsPod(t *testing.T) {
	image := workloadImage(t)
	start := time.Now()
	c := StartCluster(t, Options{NodeLabels: map[string]string{"mgpu.test/smoke": "true"}})
	c.ImportImage(t, image)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	node, err := c.Client.CoreV1().Nodes().Get(ctx, c.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if node.Labels["mgpu.test/smoke"] != "true" {
		t.Errorf("node labels %v lack mgpu.test/smoke=true", node.Labels)
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "smoke", Namespace: metav1.NamespaceDefault},
		Spec: corev1.PodSpec{
			RestartPolicy: corev1.RestartPolicyNever,
			Containers: []corev1.Container{{
				Name: "main", Image: WorkloadImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"/bin/sh", "-c", "echo hello from $(cat /etc/hostname); ls /bin/mgpu-workload"},
			}},
		},
	}
	if _, err := c.Client.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	got := c.WaitPodPhase(t, pod.Namespace, pod.Name, corev1.PodSucceeded, 90*time.Second)
	if got.Status.PodIP == "" {
		t.Errorf("pod has no IP (pod network)")
	}
	log := c.PodLog(t, pod.Namespace, pod.Name, "main")
	if want := "hello from smoke\n/bin/mgpu-workload\n"; log != want {
		t.Errorf("pod log %q, want %q", log, want)
	}
	t.Logf("pod ran %v after the start (pod IP %s)", time.Since(start).Round(time.Millisecond), got.Status.PodIP)

	c.Stop(t)
	// Processes may take a moment to be reaped.
	if err := harness.WaitFor(10*time.Second, func() error {
		if left := c.Leftovers(); len(left) > 0 {
			return &leftovers{left}
		}
		return nil
	}); err != nil {
		t.Errorf("after the teardown: %v", err)
	}
	t.Logf("cluster run and stopped in %v", time.Since(start).Round(time.Millisecond))
}

type leftovers struct{ items []string }

func (l *leftovers) Error() string { return "left behind:\n  " + strings.Join(l.items, "\n  ") }

// TestKubeletRestartKeepsPods restarts the kubelet under a running pod:
// the pod's container keeps running, not restarted.
func TestKubeletRestartKeepsPods(t *testing.T) {
	image := workloadImage(t)
	c := StartCluster(t, Options{})
	c.ImportImage(t, image)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "sleeper", Namespace: metav1.NamespaceDefault},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: new(int64),
			Containers: []corev1.Container{{
				Name: "main", Image: WorkloadImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"/bin/sleep", "3600"},
			}},
		},
	}
	if _, err := c.Client.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	before := c.WaitPodPhase(t, pod.Namespace, pod.Name, corev1.PodRunning, 90*time.Second)
	c.RestartKubelet(t)
	after := c.WaitPodPhase(t, pod.Namespace, pod.Name, corev1.PodRunning, 30*time.Second)
	b, a := before.Status.ContainerStatuses[0], after.Status.ContainerStatuses[0]
	if a.ContainerID != b.ContainerID || a.RestartCount != 0 {
		t.Errorf("container %s (restarts %d) before the kubelet restart, %s (restarts %d) after", b.ContainerID, b.RestartCount, a.ContainerID, a.RestartCount)
	}
	if !strings.Contains(c.KubeletLog(), "=== kubelet start") || strings.Count(c.KubeletLog(), "=== kubelet start") != 2 {
		t.Errorf("the kubelet log does not show two starts")
	}
}
