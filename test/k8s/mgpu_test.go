package k8s

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/kube/admission"
	"github.com/mgpu-dev/mgpu/test/e2e"
	"github.com/mgpu-dev/mgpu/test/fakecuda"
	"github.com/mgpu-dev/mgpu/test/harness"
)

// Keys of the seed's Deployment.
const (
	coreKey   corev1.ResourceName = "vke.volcengine.com/mgpu-core"
	memoryKey corev1.ResourceName = "vke.volcengine.com/mgpu-memory"
	policyKey                     = "vke.volcengine.com/mgpu-compute-policy"
	// gpuMiB is each simulated GPU's memory (80 GiB).
	gpuMiB = 81920
	// epsilon is the normative tolerance of a share, in points.
	epsilon = 2.0
)

// mgpuNode is a cluster with mgpu installed from the build: two simulated
// 80 GiB GPUs and their enforcers, the CDI spec, the device plugin (node
// agent) with the chart's ServiceAccount or the kubelet's credentials, and
// the admission webhook.
type mgpuNode struct {
	*Cluster
	n      *e2e.Node
	plugin *exec.Cmd
	// agentArgs and agentLog start the agent again (restartAgent).
	agentArgs []string
	agentLog  *os.File
	log       string // the plugin's log
}

// Credentials of the node agent.
const (
	// agentAsServiceAccount: the chart's ServiceAccount, RBAC and node
	// policy, with a token bound to a pod on the node, as the DaemonSet's.
	agentAsServiceAccount = iota
	// agentAsKubelet: the kubelet's own kubeconfig, as the systemd unit uses
	// (the Node authorizer and NodeRestriction apply).
	agentAsKubelet
)

// startMGPU sets everything up; policy is what both GPUs run, creds the
// agent's credentials.
func startMGPU(t *testing.T, policy string, creds int) *mgpuNode {
	t.Helper()
	m := startNode(t, policy)
	m.startWebhook(t)
	m.startPlugin(t, creds)
	return m
}

// startNode starts the node side mgpu's package would run (the enforcers
// of two simulated GPUs running policy, the CDI spec) and a cluster whose
// containerd reads that spec, with the workload image imported; neither
// the agent nor the webhook runs yet.
func startNode(t *testing.T, policy string) *mgpuNode {
	t.Helper()
	return startNodeWith(t, policy, true)
}

// startNodeWith is startNode; without hostSide, the node has the simulated
// GPUs (their state, the workloads' fixtures) but runs no enforcer and has
// no CDI spec: something else (the chart in image mode) installs them with
// the node's configuration.
func startNodeWith(t *testing.T, policy string, hostSide bool) *mgpuNode {
	t.Helper()
	image := workloadImage(t)
	// Online/offline co-location is on: pods are online unless they say
	// otherwise (testOffline).
	// With MGPU_E2E_INSTALLED (test/packaging's TestChartFromPackage), the
	// enforcers, the CLI, the hook and the shim are an installed package's.
	n, err := e2e.NewNode(e2e.NodeOptions{Devices: 2, MemoryMiB: gpuMiB, Policies: map[int]string{0: policy, 1: policy}, OnlineOffline: 1,
		Installed: e2e.InstalledFromEnv()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Errorf("mgpu node: %v", err)
		}
	})
	if hostSide {
		for dev := range 2 {
			if err := n.StartEnforcer(dev); err != nil {
				t.Fatal(err)
			}
		}
		// The CDI spec of the node's kind (cdi_kind, which Allocate names).
		spec := filepath.Join(e2e.CDISpecDir, fmt.Sprintf("mgpu-k8s-%d.yaml", os.Getpid()))
		if out, err := exec.Command(n.CLI, "--config", n.ConfigPath, "cdi", "generate", "--output", spec).CombinedOutput(); err != nil { //nolint:gosec // the build's CLI
			t.Fatalf("mgpu-cli cdi generate: %v\n%s", err, out)
		}
		t.Cleanup(func() { _ = os.Remove(spec) })
	}

	c := StartCluster(t, Options{CDISpecDirs: []string{e2e.CDISpecDir}})
	c.ImportImage(t, image)
	return &mgpuNode{Cluster: c, n: n}
}

// startWebhook serves bin/mgpu-webhook on loopback with a certificate of
// its `cert` command and registers it.
func (m *mgpuNode) startWebhook(t *testing.T) {
	t.Helper()
	bin, err := buildBin("mgpu-webhook")
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(m.Dir, "webhook")
	if out, err := exec.Command(bin, "cert", "--out", dir, "--ip", "127.0.0.1").CombinedOutput(); err != nil { //nolint:gosec // the build's binary
		t.Fatalf("mgpu-webhook cert: %v\n%s", err, out)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	logf, err := os.Create(filepath.Join(dir, "webhook.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--listen", addr, "--tls-cert-file", filepath.Join(dir, admission.CertFile), //nolint:gosec // the build's binary
		"--tls-key-file", filepath.Join(dir, admission.KeyFile), "--kubeconfig", m.AdminKubeconfig, "--explain-interval", "2s")
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = logf.Close()
		if t.Failed() {
			data, _ := os.ReadFile(logf.Name())
			t.Logf("mgpu-webhook log:\n%s", tailLines(string(data), 40))
		}
	})
	ca, err := os.ReadFile(filepath.Join(dir, admission.CAFile))
	if err != nil {
		t.Fatal(err)
	}
	wh := admission.WebhookConfiguration("mgpu-policy", admission.URLClient("https://"+addr+"/mutate", ca))
	ctx := context.Background()
	if _, err := m.Client.AdmissionregistrationV1().MutatingWebhookConfigurations().Create(ctx, wh, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The webhook is in force once a denial comes back from it.
	bad := workloadPod("probe", "", 150, 1, "sleep 1")
	err = harness.WaitFor(30*time.Second, func() error {
		_, err := m.Client.CoreV1().Pods("default").Create(ctx, bad, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if err != nil && strings.Contains(err.Error(), string(coreKey)) {
			return nil
		}
		return fmt.Errorf("a pod of core 150 is not denied yet: %w", err)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// buildBin is a program of `make build`.
func buildBin(name string) (string, error) {
	build, err := fakecuda.BuildDir()
	if err != nil {
		return "", err
	}
	p := filepath.Join(build, "bin", name)
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("%s: run make build", p)
	}
	return p, nil
}

// startPlugin runs bin/mgpu-device-plugin on the host with the chart's
// ServiceAccount (its RBAC and node policy applied, a token bound to a pod
// on the node) or the kubelet's credentials, then waits for the node's
// mgpu resources and labels: under the node policy, the patches the agent
// makes are let through.
func (m *mgpuNode) startPlugin(t *testing.T, creds int) {
	t.Helper()
	bin, err := buildBin("mgpu-device-plugin")
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig := m.NodeKubeconfig()
	if creds == agentAsServiceAccount {
		kubeconfig = m.agentKubeconfig(t, applyNodeChart(t, m.Cluster))
	}
	m.log = filepath.Join(m.Dir, "device-plugin.log")
	logf, err := os.Create(m.log)
	if err != nil {
		t.Fatal(err)
	}
	m.agentArgs = []string{bin, "--config", m.n.ConfigPath, "--kubeconfig", kubeconfig,
		"--node-name", m.NodeName, "--node-interval", "1s", "--log-level", "debug"}
	m.agentLog = logf
	m.startAgent(t)
	t.Cleanup(func() {
		m.stopAgent()
		_ = logf.Close()
		if t.Failed() {
			data, _ := os.ReadFile(m.log)
			t.Logf("mgpu-device-plugin log:\n%s", tailLines(string(data), 60))
		}
	})
	m.waitResources(t, 60*time.Second)
}

// startAgent starts the agent's process (m.agentArgs, its output to
// m.agentLog) as m.plugin.
func (m *mgpuNode) startAgent(t *testing.T) {
	t.Helper()
	cmd := exec.Command(m.agentArgs[0], m.agentArgs[1:]...) //nolint:gosec // the build's binary
	cmd.Stdout, cmd.Stderr = m.agentLog, m.agentLog
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	m.plugin = cmd
}

// stopAgent stops m.plugin as SIGINT does, killing it after 10 s.
func (m *mgpuNode) stopAgent() {
	cmd := m.plugin
	_ = cmd.Process.Signal(os.Interrupt)
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

// restartAgent stops the agent and starts it again, as a DaemonSet's
// rolling update or a crash would.
func (m *mgpuNode) restartAgent(t *testing.T) {
	t.Helper()
	m.stopAgent()
	m.startAgent(t)
}

// waitResources waits until the node offers 200 mgpu-core and all the
// GPUs' memory.
func (m *mgpuNode) waitResources(t *testing.T, within time.Duration) {
	t.Helper()
	err := harness.WaitFor(within, func() error {
		node, err := m.Client.CoreV1().Nodes().Get(context.Background(), m.NodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		core, mem := node.Status.Allocatable[coreKey], node.Status.Allocatable[memoryKey]
		if core.Value() != 200 || mem.Value() != 2*gpuMiB || node.Labels["vke.node.gpu.schedule"] != "mgpu" {
			return fmt.Errorf("node allocatable %s=%s %s=%s, labels %v", coreKey, core.String(), memoryKey, mem.String(), node.Labels)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// applyNodeChart creates the node agent's ServiceAccount, ClusterRole and
// binding and the ValidatingAdmissionPolicy that scopes its node patches
// to its own Node, as the chart renders them (package mode: the agent of a
// node with the package; the test runs the agent itself on the host), and
// returns the ServiceAccount's name.
func applyNodeChart(t *testing.T, c *Cluster) string {
	t.Helper()
	ctx := context.Background()
	sa := ""
	for _, obj := range RenderChart(t, "mgpu", admission.ExcludedNamespace, "--set", "mode=package", "--set", "webhook.enabled=false",
		"--api-versions", "resource.k8s.io/v1/DeviceClass") {
		var err error
		switch o := obj.(type) {
		case *corev1.ServiceAccount:
			sa = o.Name
			_, err = c.Client.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRole:
			_, err = c.Client.RbacV1().ClusterRoles().Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRoleBinding:
			_, err = c.Client.RbacV1().ClusterRoleBindings().Create(ctx, o, metav1.CreateOptions{})
		case *admissionregistrationv1.ValidatingAdmissionPolicy:
			_, err = c.Client.AdmissionregistrationV1().ValidatingAdmissionPolicies().Create(ctx, o, metav1.CreateOptions{})
		case *admissionregistrationv1.ValidatingAdmissionPolicyBinding:
			_, err = c.Client.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Create(ctx, o, metav1.CreateOptions{})
		case *resourcev1.DeviceClass:
			_, err = c.Client.ResourceV1().DeviceClasses().Create(ctx, o, metav1.CreateOptions{})
		default:
			continue // the DaemonSet and its ConfigMaps: the agent runs on the host
		}
		if err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatalf("%T: %v", obj, err)
		}
	}
	if sa == "" {
		t.Fatal("the chart renders no ServiceAccount for the node agent")
	}
	return sa
}

// agentKubeconfig is a kubeconfig of the agent's ServiceAccount with a
// token bound to a pod of that ServiceAccount on the node, as the
// DaemonSet's pod has: the token names the node, which the chart's
// admission policy requires. Before returning, it waits until that policy
// is in force: a patch of a label the agent does not own is refused.
func (m *mgpuNode) agentKubeconfig(t *testing.T, sa string) string {
	t.Helper()
	ctx := context.Background()
	no := false
	grace := int64(2)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "mgpu-agent-identity", Namespace: admission.ExcludedNamespace},
		Spec: corev1.PodSpec{
			ServiceAccountName:            sa,
			AutomountServiceAccountToken:  &no,
			TerminationGracePeriodSeconds: &grace,
			Containers: []corev1.Container{{Name: "main", Image: WorkloadImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"/bin/sh", "-c", idle}}},
		},
	}
	if _, err := m.Client.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod = m.WaitPodPhase(t, pod.Namespace, pod.Name, corev1.PodRunning, 60*time.Second)
	kubeconfig := m.PodServiceAccountKubeconfig(t, pod)
	agent := ClientFor(t, kubeconfig)
	const notOwned = "mgpu.test/not-owned"
	patch := []byte(`{"metadata":{"labels":{"` + notOwned + `":"1"}}}`)
	err := harness.WaitFor(30*time.Second, func() error {
		_, err := agent.CoreV1().Nodes().Patch(ctx, m.NodeName, types.MergePatchType, patch, metav1.PatchOptions{})
		if err == nil {
			// The policy is not loaded yet: take the label back.
			undo := []byte(`{"metadata":{"labels":{"` + notOwned + `":null}}}`)
			if _, err := m.Client.CoreV1().Nodes().Patch(ctx, m.NodeName, types.MergePatchType, undo, metav1.PatchOptions{}); err != nil {
				return harness.Permanent(err)
			}
			return errors.New("the agent's token may set a label it does not own")
		}
		if !strings.Contains(err.Error(), "ValidatingAdmissionPolicy") {
			return harness.Permanent(fmt.Errorf("the patch was refused, not by the node policy: %w", err))
		}
		t.Logf("the chart's node policy refuses the agent a label it does not own: %v", err)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return kubeconfig
}

func tailLines(s string, n int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}

// workloadPod is a pod of the workload image that runs script under sh,
// with the seed's requests (requests = limits; 0: not set) and policy
// annotation ("" for none), and what it needs of the simulated GPU.
func workloadPod(name, policy string, core, memoryMiB int, script string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", Annotations: policyAnnotation(policy)},
		Spec:       podSpec(core, memoryMiB, script),
	}
}

func policyAnnotation(policy string) map[string]string {
	if policy == "" {
		return nil
	}
	return map[string]string{policyKey: policy}
}

// fakeState is the simulated GPU's state directory, shared by the host's
// enforcers and the containers (set by startMGPU's node).
var fakeState string

func podSpec(core, memoryMiB int, script string) corev1.PodSpec {
	res := corev1.ResourceList{}
	if core != 0 {
		res[coreKey] = *resource.NewQuantity(int64(core), resource.DecimalSI)
	}
	if memoryMiB != 0 {
		res[memoryKey] = *resource.NewQuantity(int64(memoryMiB), resource.DecimalSI)
	}
	var env []corev1.EnvVar
	for _, kv := range fakeEnv {
		k, v, _ := strings.Cut(kv, "=")
		env = append(env, corev1.EnvVar{Name: k, Value: v})
	}
	grace := int64(2)
	return corev1.PodSpec{
		RestartPolicy:                 corev1.RestartPolicyAlways,
		TerminationGracePeriodSeconds: &grace,
		Containers: []corev1.Container{{
			Name:            "main",
			Image:           WorkloadImage,
			ImagePullPolicy: corev1.PullNever,
			Command:         []string{"/bin/sh", "-c", script},
			Env:             env,
			Resources:       corev1.ResourceRequirements{Requests: res, Limits: res},
			VolumeMounts:    []corev1.VolumeMount{{Name: "fakecuda", MountPath: fakeState}},
		}},
		Volumes: []corev1.Volume{{Name: "fakecuda", VolumeSource: corev1.VolumeSource{
			HostPath: &corev1.HostPathVolumeSource{Path: fakeState},
		}}},
	}
}

var fakeEnv []string

// seedDeployment is seed 000's Deployment with the workload image.
func seedDeployment(name, policy string, core, memoryMiB int, script string) *appsv1.Deployment {
	one := int32(1)
	labels := map[string]string{"app": name}
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: appsv1.DeploymentSpec{
			Replicas: &one,
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels, Annotations: policyAnnotation(policy)},
				Spec:       podSpec(core, memoryMiB, script),
			},
		},
	}
}

// saturate is a workload that reports its memory and keeps the GPU busy
// for secs.
func saturate(secs int) string {
	return fmt.Sprintf("/bin/mgpu-workload info; exec /bin/mgpu-workload compute --api launch --kernel-us 100 --depth 64 --seconds %d", secs)
}

// idle waits, as a workload that has nothing to do, and exits on SIGTERM
// (a container's init has no default signal action).
const idle = "trap 'exit 0' TERM; sleep 3600 & wait"

// deploy creates a Deployment and returns its one pod once it exists.
func (m *mgpuNode) deploy(t *testing.T, d *appsv1.Deployment) *corev1.Pod {
	t.Helper()
	ctx := context.Background()
	if _, err := m.Client.AppsV1().Deployments("default").Create(ctx, d, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.deleteDeployment(t, d.Name) })
	var pod *corev1.Pod
	err := harness.WaitFor(60*time.Second, func() error {
		l, err := m.Client.CoreV1().Pods("default").List(ctx, metav1.ListOptions{LabelSelector: "app=" + d.Name})
		if err != nil {
			return err
		}
		if len(l.Items) != 1 {
			return fmt.Errorf("deployment %s has %d pods", d.Name, len(l.Items))
		}
		pod = &l.Items[0]
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return pod
}

func (m *mgpuNode) deleteDeployment(t *testing.T, name string) {
	ctx := context.Background()
	if l, err := m.Client.CoreV1().Pods("default").List(ctx, metav1.ListOptions{LabelSelector: "app=" + name}); err == nil {
		defer m.waitReleased(t, l.Items)
	}
	fg := metav1.DeletePropagationForeground
	err := m.Client.AppsV1().Deployments("default").Delete(ctx, name, metav1.DeleteOptions{PropagationPolicy: &fg})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("delete deployment %s: %v", name, err)
	}
	m.waitNoPods(t, "app="+name)
}

func (m *mgpuNode) waitNoPods(t *testing.T, selector string) {
	t.Helper()
	err := harness.WaitFor(60*time.Second, func() error {
		l, err := m.Client.CoreV1().Pods("default").List(context.Background(), metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			return err
		}
		if len(l.Items) > 0 {
			return fmt.Errorf("%d pods of %s left", len(l.Items), selector)
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}
}

// containerID is the CRI id of a running pod's container.
func containerID(t *testing.T, pod *corev1.Pod) string {
	t.Helper()
	for _, s := range pod.Status.ContainerStatuses {
		if s.Name == "main" && s.ContainerID != "" {
			_, id, _ := strings.Cut(s.ContainerID, "://")
			return id
		}
	}
	t.Fatalf("pod %s has no container id: %+v", pod.Name, pod.Status.ContainerStatuses)
	return ""
}

// instanceOf is the mgpu instance of a pod's container.
func (m *mgpuNode) instanceOf(t *testing.T, pod *corev1.Pod) api.Instance {
	t.Helper()
	id := containerID(t, pod)
	insts, err := m.n.Instances()
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range insts {
		if in.ContainerID == id {
			return in
		}
	}
	t.Fatalf("no instance of pod %s (container %s) among %+v", pod.Name, id, insts)
	return api.Instance{}
}

// running waits until pod ns/name runs and its log says ready.
func (m *mgpuNode) running(t *testing.T, name, ready string) *corev1.Pod {
	t.Helper()
	m.WaitPodPhase(t, "default", name, corev1.PodRunning, 90*time.Second)
	err := harness.WaitFor(30*time.Second, func() error {
		if log := m.PodLog(t, "default", name, "main"); !strings.Contains(log, ready) {
			return fmt.Errorf("pod %s has not printed %q:\n%s", name, ready, log)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	pod, err := m.Client.CoreV1().Pods("default").Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pod
}

// sample is the simulated device 0's busy time per pid namespace.
type sample struct {
	at   time.Time
	busy map[uint64]uint64
}

func (m *mgpuNode) sample(t *testing.T) sample {
	t.Helper()
	t0 := time.Now()
	st, err := m.n.Stat()
	t1 := time.Now()
	if err != nil {
		t.Fatal(err)
	}
	at, ok := harness.MonoTime(st.AtNs)
	if !ok {
		at = t0.Add(t1.Sub(t0) / 2)
	}
	s := sample{at: at, busy: map[uint64]uint64{}}
	for _, dev := range st.Devices {
		for _, p := range dev.Procs {
			s.busy[p.PIDNS] += p.BusyNs
		}
	}
	return s
}

// shares measures each pod's share of its GPU over win after warm.
func (m *mgpuNode) shares(t *testing.T, pods []*corev1.Pod, warm, win time.Duration) []float64 {
	t.Helper()
	var nss []uint64
	for _, p := range pods {
		ns, err := e2e.PIDNamespace(m.instanceOf(t, p).PID)
		if err != nil {
			t.Fatal(err)
		}
		nss = append(nss, ns)
	}
	time.Sleep(warm) // settling before the window, not synchronisation
	a := m.sample(t)
	time.Sleep(win) // the measurement window
	b := m.sample(t)
	out := make([]float64, len(nss))
	for i, ns := range nss {
		out[i] = 100 * float64(b.busy[ns]-a.busy[ns]) / float64(b.at.Sub(a.at))
	}
	return out
}

// TestMGPU runs seed 000's scenarios on a node labelled
// guaranteed-burst-share, one cluster for all.
func TestMGPU(t *testing.T) {
	m := startMGPU(t, "guaranteed-burst-share", agentAsServiceAccount)
	fakeEnvOf(m)

	t.Run("SeedDeployment", func(t *testing.T) { testSeed(t, m) })
	t.Run("PolicyScheduling", func(t *testing.T) { testPolicyScheduling(t, m) })
	t.Run("InvalidRequests", func(t *testing.T) { testInvalid(t, m) })
	t.Run("Placement", func(t *testing.T) { testPlacement(t, m) })
	t.Run("TenPods", func(t *testing.T) { testTenPods(t, m) })
	t.Run("KubeletRestart", func(t *testing.T) { testKubeletRestart(t, m) })
	t.Run("CGPU", func(t *testing.T) { testCGPU(t, m) })
	t.Run("DRA", func(t *testing.T) { testDRA(t, m) })
	t.Run("Share", func(t *testing.T) { testShare(t, m) })
}

func fakeEnvOf(m *mgpuNode) {
	fakeEnv = m.n.FakeEnv()
	fakeState = m.n.FakeState
}

func testSeed(t *testing.T, m *mgpuNode) {
	p30 := m.deploy(t, seedDeployment("seed", "guaranteed-burst-share", 30, 4096, saturate(3600)))
	p30 = m.running(t, p30.Name, "start")
	if log := m.PodLog(t, "default", p30.Name, "main"); !strings.Contains(log, "mem_total=4294967296") {
		t.Errorf("cuMemGetInfo in the container does not say 4096 MiB:\n%s", log)
	}
	in := m.instanceOf(t, p30)
	if in.Core != 30 || in.MemoryMiB != 4096 || in.Policy != "guaranteed-burst-share" {
		t.Errorf("instance %+v, want core 30, 4096 MiB, guaranteed-burst-share", in)
	}
	// The 70 runs 20 s, then idles (its container stays, its instance too).
	p70 := m.deploy(t, seedDeployment("seed70", "guaranteed-burst-share", 70, 4096, "/bin/mgpu-workload info; /bin/mgpu-workload compute --api launch --kernel-us 100 --depth 64 --seconds 20; echo idle; "+idle))
	p70 = m.running(t, p70.Name, "start")
	if g30, g70 := m.instanceOf(t, p30).Device, m.instanceOf(t, p70).Device; g30 != g70 {
		t.Fatalf("the 30 is on GPU %d and the 70 on GPU %d: binpack puts them on one", g30, g70)
	}
	m.check3070(t, "", p30, p70)
	m.testRelease(t, p70)
}

// check3070: the 30 and the 70 (which idles after 20 s) share their GPU
// 30 / 70 (± epsilon, measured by the device) while both are busy, and the
// 30 gets at least 95 % beside the idle 70. what prefixes the log lines.
func (m *mgpuNode) check3070(t *testing.T, what string, p30, p70 *corev1.Pod) {
	t.Helper()
	s := m.shares(t, []*corev1.Pod{p30, p70}, 2*time.Second, 5*time.Second)
	t.Logf("%s30 / 70 both busy: %.2f / %.2f", what, s[0], s[1])
	if math.Abs(s[0]-30) > epsilon || math.Abs(s[1]-70) > epsilon {
		t.Errorf("%sshares %.2f / %.2f, want 30 / 70 ± %.0f", what, s[0], s[1], epsilon)
	}
	m.running(t, p70.Name, "idle")
	s = m.shares(t, []*corev1.Pod{p30}, time.Second, 5*time.Second)
	t.Logf("%s30 beside an idle 70: %.2f", what, s[0])
	if s[0] < 95 {
		t.Errorf("%sthe 30 beside an idle 70 got %.2f%%, want >= 95", what, s[0])
	}
}

// testRelease deletes a pod and checks that its instance goes within 2 s.
func (m *mgpuNode) testRelease(t *testing.T, pod *corev1.Pod) {
	t.Helper()
	in := m.instanceOf(t, pod)
	ctx := context.Background()
	start := time.Now()
	if err := m.Client.CoreV1().Pods("default").Delete(ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err := harness.WaitFor(10*time.Second, func() error {
		insts, err := m.n.Instances()
		if err != nil {
			return err
		}
		if slices.ContainsFunc(insts, func(i api.Instance) bool { return i.Name == in.Name }) {
			return errors.New("instance " + in.Name + " still there")
		}
		return nil
	})
	took := time.Since(start)
	t.Logf("pod %s deleted: instance %s released after %v", pod.Name, in.Name, took.Round(time.Millisecond))
	if err != nil || took > 2*time.Second {
		t.Errorf("instance %s of deleted pod %s released after %v (%v), want within 2s", in.Name, pod.Name, took, err)
	}
}

// testPolicyScheduling: a fixed-share Deployment, and one without an
// annotation (fixed-share by default), stay Pending on a
// guaranteed-burst-share node with a FailedScheduling event naming the
// policy; a node that runs fixed-share takes the one without annotation.
func testPolicyScheduling(t *testing.T, m *mgpuNode) {
	for _, tc := range []struct{ name, policy string }{{"fixed", "fixed-share"}, {"noannotation", ""}} {
		pod := m.deploy(t, seedDeployment(tc.name, tc.policy, 30, 4096, saturate(3600)))
		ev := m.waitEvent(t, pod.Name, "FailedScheduling", "fixed-share", 60*time.Second)
		t.Logf("%s: FailedScheduling: %s", tc.name, ev.Message)
		p, err := m.Client.CoreV1().Pods("default").Get(context.Background(), pod.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if p.Status.Phase != corev1.PodPending {
			t.Errorf("%s is %s, want Pending", pod.Name, p.Status.Phase)
		}
	}
	// Label the node fixed-share as a node that runs it would be (the
	// scheduler only sees the label): the pod without annotation runs.
	// The agent sets the label back to what the GPUs run within its
	// interval; by then the pod is bound.
	m.deleteDeployment(t, "fixed")
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:"fixed-share"}}}`, policyKey)
	if _, err := m.Client.CoreV1().Nodes().Patch(context.Background(), m.NodeName, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	_ = m.waitBound(t, "app=noannotation", 30*time.Second)
	m.deleteDeployment(t, "noannotation")
	err := harness.WaitFor(30*time.Second, func() error {
		node, err := m.Client.CoreV1().Nodes().Get(context.Background(), m.NodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if v := node.Labels[policyKey]; v != "guaranteed-burst-share" {
			return fmt.Errorf("label %s=%s", policyKey, v)
		}
		return nil
	})
	if err != nil {
		t.Errorf("the agent did not set the policy label back: %v", err)
	}
}

// describe is a pod's status and events, without the kubelet's log.
func (m *mgpuNode) describe(name string) string {
	pod, err := m.Client.CoreV1().Pods("default").Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		pod = nil
	}
	d, _, _ := strings.Cut(m.DescribePod("default", name, pod), "kubelet log, the end:")
	return d
}

// waitBound waits until the pod of selector is bound to the node.
func (m *mgpuNode) waitBound(t *testing.T, selector string, within time.Duration) *corev1.Pod {
	t.Helper()
	var pod *corev1.Pod
	err := harness.WaitFor(within, func() error {
		l, err := m.Client.CoreV1().Pods("default").List(context.Background(), metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			return err
		}
		for i := range l.Items {
			if l.Items[i].Spec.NodeName == m.NodeName {
				pod = &l.Items[i]
				return nil
			}
		}
		return fmt.Errorf("no pod of %s is bound", selector)
	})
	if err != nil {
		t.Fatal(err)
	}
	return pod
}

// waitEvent waits for an event of pod name with reason whose message
// contains s.
func (m *mgpuNode) waitEvent(t *testing.T, name, reason, s string, within time.Duration) corev1.Event {
	t.Helper()
	var found corev1.Event
	var seen []string
	err := harness.WaitFor(within, func() error {
		evs, err := m.Events("default", name)
		if err != nil {
			return err
		}
		seen = seen[:0]
		for _, e := range evs {
			seen = append(seen, e.Reason+": "+e.Message)
			if e.Reason == reason && strings.Contains(e.Message, s) {
				found = e
				return nil
			}
		}
		return fmt.Errorf("no %s event naming %q", reason, s)
	})
	if err != nil {
		t.Fatalf("pod %s: %v; events:\n%s\n%s", name, err, strings.Join(seen, "\n"), m.describe(name))
	}
	return found
}

// tenRequests are the mixed requests (core, MiB) of the ten-pod tests.
var tenRequests = []struct{ core, mem int }{{50, 40000}, {30, 30000}, {60, 20000}, {20, 50000}, {100, 0}, {10, 10000}, {40, 30000}, {30, 70000}, {90, 1000}, {5, 2000}}

// startTen creates a pod of each of tenRequests at once, named
// <prefix>-<i>, labelled test=<prefix> and running script, and returns
// them once they settled: no pod changed phase or readiness for 10 s.
func (m *mgpuNode) startTen(t *testing.T, prefix, script string) []corev1.Pod {
	t.Helper()
	ctx := context.Background()
	t.Cleanup(func() { m.deleteAll(t, "test="+prefix) })
	for i, r := range tenRequests {
		pod := workloadPod(fmt.Sprintf("%s-%d", prefix, i), "guaranteed-burst-share", r.core, r.mem, script)
		pod.Labels = map[string]string{"test": prefix}
		if _, err := m.Client.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	var last string
	var stableSince time.Time
	var pods []corev1.Pod
	err := harness.WaitFor(150*time.Second, func() error {
		l, err := m.Client.CoreV1().Pods("default").List(ctx, metav1.ListOptions{LabelSelector: "test=" + prefix})
		if err != nil {
			return err
		}
		var b strings.Builder
		for _, p := range l.Items {
			ready := len(p.Status.ContainerStatuses) > 0 && p.Status.ContainerStatuses[0].Ready
			fmt.Fprintf(&b, "%s=%s/%v ", p.Name, p.Status.Phase, ready)
		}
		if b.String() != last {
			last, stableSince = b.String(), time.Now()
		}
		pods = l.Items
		if time.Since(stableSince) < 10*time.Second {
			return errors.New("pods still change: " + last)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("settled: %s", last)
	return pods
}

// committed is what the instances hold of each GPU (core, MiB); a GPU
// holding more than it has is an error.
func (m *mgpuNode) committed(t *testing.T) (core map[int]int, mem map[int]uint64) {
	t.Helper()
	insts, err := m.n.Instances()
	if err != nil {
		t.Fatal(err)
	}
	core, mem = map[int]int{}, map[int]uint64{}
	for _, in := range insts {
		core[in.Device] += in.Core
		mem[in.Device] += in.MemoryMiB
	}
	for g := range 2 {
		t.Logf("GPU %d: core %d, memory %d MiB", g, core[g], mem[g])
		if core[g] > 100 || mem[g] > gpuMiB {
			t.Errorf("GPU %d over-committed: core %d, memory %d MiB", g, core[g], mem[g])
		}
	}
	return core, mem
}

// testInvalid: the webhook denies bad requests at creation, naming the field.
func testInvalid(t *testing.T, m *mgpuNode) {
	for _, tc := range []struct {
		name         string
		policy       string
		core, memory int
		want1, want2 string
	}{
		{"core0", "", 0, 4096, string(coreKey), "0 is not"},
		{"memoryonly", "", 0, 4096, string(memoryKey), "needs mgpu-core"},
		{"core150", "", 150, 4096, string(coreKey), "150"},
		{"nomemory", "", 30, 0, string(memoryKey), "30"},
		{"policy", "greedy", 30, 4096, policyKey, "greedy"},
	} {
		pod := workloadPod("bad-"+tc.name, tc.policy, tc.core, tc.memory, "true")
		if tc.name == "core0" {
			pod.Spec.Containers[0].Resources.Limits[coreKey] = resource.MustParse("0")
			pod.Spec.Containers[0].Resources.Requests[coreKey] = resource.MustParse("0")
		}
		_, err := m.Client.CoreV1().Pods("default").Create(context.Background(), pod, metav1.CreateOptions{})
		if err == nil {
			t.Errorf("%s: created", tc.name)
			continue
		}
		t.Logf("%s: %v", tc.name, err)
		if !strings.Contains(err.Error(), tc.want1) || !strings.Contains(err.Error(), tc.want2) {
			t.Errorf("%s: denial %q does not name %q and %q", tc.name, err, tc.want1, tc.want2)
		}
	}
}

// testPlacement: binpack puts shares on GPU 0 while it has room; with the
// node labelled ack.node.gpu.placement=spread they go to the emptier GPU.
func testPlacement(t *testing.T, m *mgpuNode) {
	gpuOf := func(name string, core int) int {
		pod := workloadPod(name, "guaranteed-burst-share", core, 1024, "echo ready; "+idle)
		pod.Labels = map[string]string{"test": "placement"}
		if _, err := m.Client.CoreV1().Pods("default").Create(context.Background(), pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		return m.instanceOf(t, m.running(t, name, "ready")).Device
	}
	defer m.deleteAll(t, "test=placement")
	if a, b := gpuOf("bin-a", 20), gpuOf("bin-b", 20); a != 0 || b != 0 {
		t.Errorf("binpack: GPUs %d and %d, want 0 and 0", a, b)
	}
	// Seed 001's binpack pattern: GPU 0 is filled first.
	m.checkClusterInspect(t, []uint64{2048, 0})
	m.setPlacement(t, "spread")
	defer m.setPlacement(t, "")
	if c := gpuOf("spread-c", 20); c != 1 {
		t.Errorf("spread: GPU %d, want 1 (GPU 0 has 40%% taken)", c)
	}
	if d := gpuOf("spread-d", 30); d != 1 {
		t.Errorf("spread: GPU %d, want 1 (GPU 0 has 60%% free, GPU 1 80%%)", d)
	}
	// Spread evens it out: two pods of 1024 MiB on each GPU. The cluster
	// view (the agent's annotation, read from the API server) is the
	// node's own.
	m.checkClusterInspect(t, []uint64{2048, 2048})
}

// inspectGPUs are the GPUs of mgpu-cli inspect's JSON, local or cluster.
type inspectGPUs []struct {
	Index        int    `json:"index"`
	AllocatedMiB uint64 `json:"allocated_mib"`
	TotalMiB     uint64 `json:"total_mib"`
	Instances    int    `json:"instances"`
	Running      bool   `json:"running"`
}

// checkClusterInspect waits until `mgpu-cli inspect --cluster` (as the
// admin) shows the node's GPUs as the local `mgpu-cli inspect` does, with
// allocated MiB per GPU want, and logs both tables.
func (m *mgpuNode) checkClusterInspect(t *testing.T, want []uint64) {
	t.Helper()
	m.inspectCluster(t, want, true)
}

// inspectCluster waits until `mgpu-cli inspect --cluster` shows allocated
// MiB per GPU want (and, with local, the node's GPUs as the local
// `mgpu-cli inspect` does), and logs the table.
func (m *mgpuNode) inspectCluster(t *testing.T, want []uint64, sameAsLocal bool) {
	t.Helper()
	cli := func(args ...string) (string, error) {
		out, err := exec.Command(m.n.CLI, args...).Output() //nolint:gosec // the build's CLI
		return string(out), err
	}
	var local, cluster string
	err := harness.WaitFor(20*time.Second, func() error {
		var err error
		if cluster, err = cli("inspect", "--cluster", "--kubeconfig", m.AdminKubeconfig, "--output", "json"); err != nil {
			return fmt.Errorf("inspect --cluster: %w", err)
		}
		var c struct {
			Nodes []struct {
				Node string      `json:"node"`
				GPUs inspectGPUs `json:"gpus"`
			} `json:"nodes"`
		}
		if err := json.Unmarshal([]byte(cluster), &c); err != nil {
			return err
		}
		if !sameAsLocal {
			if len(c.Nodes) != 1 || len(c.Nodes[0].GPUs) != len(want) {
				return fmt.Errorf("cluster view %s", cluster)
			}
			for i, g := range c.Nodes[0].GPUs {
				if g.AllocatedMiB != want[i] {
					return fmt.Errorf("cluster view %s, want allocated %v MiB", cluster, want)
				}
			}
			return nil
		}
		if local, err = cli("--config", m.n.ConfigPath, "inspect", "--output", "json", "--node-name", m.NodeName); err != nil {
			return fmt.Errorf("inspect: %w", err)
		}
		var l struct {
			GPUs inspectGPUs `json:"gpus"`
		}
		if err := json.Unmarshal([]byte(local), &l); err != nil {
			return err
		}
		if len(c.Nodes) != 1 || c.Nodes[0].Node != m.NodeName || !slices.Equal(c.Nodes[0].GPUs, l.GPUs) {
			return fmt.Errorf("cluster view %s, node's %s", cluster, local)
		}
		for i, g := range l.GPUs {
			if i >= len(want) || g.AllocatedMiB != want[i] {
				return fmt.Errorf("node's view %s, want allocated %v MiB", local, want)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	table, err := cli("inspect", "--cluster", "--kubeconfig", m.AdminKubeconfig)
	if err != nil {
		t.Fatalf("inspect --cluster: %v", err)
	}
	t.Logf("mgpu-cli inspect --cluster:\n%s", table)
}

// setPlacement labels the node (empty: removes the label) and waits until
// the plugin has read it.
func (m *mgpuNode) setPlacement(t *testing.T, value string) {
	t.Helper()
	patch := fmt.Sprintf(`{"metadata":{"labels":{"ack.node.gpu.placement":%q}}}`, value)
	if value == "" {
		patch = `{"metadata":{"labels":{"ack.node.gpu.placement":null}}}`
	}
	if _, err := m.Client.CoreV1().Nodes().Patch(context.Background(), m.NodeName, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	want := "policy=" + value
	if value == "" {
		want = "policy=binpack"
	}
	m.waitLogged(t, 10*time.Second, "msg=placement", want)
}

func (m *mgpuNode) deleteAll(t *testing.T, selector string) {
	ctx := context.Background()
	l, err := m.Client.CoreV1().Pods("default").List(ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		t.Errorf("pods %s: %v", selector, err)
		return
	}
	err = m.Client.CoreV1().Pods("default").DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		t.Errorf("delete pods %s: %v", selector, err)
	}
	m.waitNoPods(t, selector)
	m.waitReleased(t, l.Items)
}

// waitReleased waits until no instance is of a container of pods.
func (m *mgpuNode) waitReleased(t *testing.T, pods []corev1.Pod) {
	ids := map[string]bool{}
	for _, p := range pods {
		for _, s := range p.Status.ContainerStatuses {
			if _, id, ok := strings.Cut(s.ContainerID, "://"); ok {
				ids[id] = true
			}
		}
	}
	err := harness.WaitFor(30*time.Second, func() error {
		insts, err := m.n.Instances()
		if err != nil {
			return err
		}
		for _, in := range insts {
			if ids[in.ContainerID] {
				return fmt.Errorf("instance %s of a deleted pod is still there", in.Name)
			}
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}
}

// testTenPods creates ten pods of mixed requests at once on the two 80 GiB
// GPUs: each that runs has exactly its own quota, no card is
// over-committed, and each that does not run says why and fits no card.
func testTenPods(t *testing.T, m *mgpuNode) {
	reqs := tenRequests
	pods := m.startTen(t, "ten", "/bin/mgpu-workload info; echo ready; "+idle)
	core, mem := m.committed(t)
	for _, p := range pods {
		i, _ := strconv.Atoi(strings.TrimPrefix(p.Name, "ten-"))
		r := reqs[i]
		ready := len(p.Status.ContainerStatuses) > 0 && p.Status.ContainerStatuses[0].Ready
		if p.Status.Phase == corev1.PodRunning && ready {
			in := m.instanceOf(t, &p)
			wantMem := uint64(r.mem)
			if r.core == 100 {
				wantMem = gpuMiB
			}
			if in.Core != r.core || in.MemoryMiB != wantMem {
				t.Errorf("%s asks core %d and %d MiB, its instance has %d and %d", p.Name, r.core, r.mem, in.Core, in.MemoryMiB)
			}
			wantTotal := fmt.Sprintf("mem_total=%d", wantMem<<20)
			if log := m.PodLog(t, "default", p.Name, "main"); !strings.Contains(log, wantTotal) {
				t.Errorf("%s: the container does not see %d MiB:\n%s\n%s", p.Name, wantMem, log, m.describe(p.Name))
			}
			continue
		}
		t.Logf("%s (core %d, %d MiB) does not run: %s", p.Name, r.core, r.mem, m.describe(p.Name))
		for g := range 2 {
			fitsCore := core[g]+r.core <= 100 && (r.core < 100 || core[g] == 0)
			fitsMem := mem[g]+uint64(r.mem) <= gpuMiB && (r.core < 100 || mem[g] == 0)
			if fitsCore && fitsMem {
				t.Errorf("%s (core %d, %d MiB) fits GPU %d (core %d, %d MiB used) and does not run", p.Name, r.core, r.mem, g, core[g], mem[g])
			}
		}
	}
}

// testKubeletRestart: instances and shares survive a kubelet restart, the
// plugin registers again, and a new pod schedules afterwards.
func testKubeletRestart(t *testing.T, m *mgpuNode) {
	a := m.deploy(t, seedDeployment("keep30", "guaranteed-burst-share", 30, 4096, saturate(3600)))
	b := m.deploy(t, seedDeployment("keep70", "guaranteed-burst-share", 70, 4096, saturate(3600)))
	a, b = m.running(t, a.Name, "start"), m.running(t, b.Name, "start")
	before := []api.Instance{m.instanceOf(t, a), m.instanceOf(t, b)}
	registrations := func() int {
		data, _ := os.ReadFile(m.log)
		return strings.Count(string(data), `msg="registered with the kubelet"`)
	}
	n0 := registrations()
	m.RestartKubelet(t)
	if err := harness.WaitFor(30*time.Second, func() error {
		if registrations() <= n0 {
			return errors.New("the plugin has not registered with the new kubelet")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	m.waitResources(t, 60*time.Second)
	after := []api.Instance{m.instanceOf(t, a), m.instanceOf(t, b)}
	for i := range before {
		if before[i].Name != after[i].Name || before[i].PID != after[i].PID {
			t.Errorf("instance %+v became %+v across the kubelet restart", before[i], after[i])
		}
	}
	s := m.shares(t, []*corev1.Pod{a, b}, time.Second, 5*time.Second)
	t.Logf("after the kubelet restart: %.2f / %.2f", s[0], s[1])
	if math.Abs(s[0]-30) > epsilon || math.Abs(s[1]-70) > epsilon {
		t.Errorf("shares after the kubelet restart %.2f / %.2f, want 30 / 70 ± %.0f", s[0], s[1], epsilon)
	}
	c := workloadPod("after-restart", "guaranteed-burst-share", 50, 1024, "echo ready; "+idle)
	c.Labels = map[string]string{"test": "restart"}
	if _, err := m.Client.CoreV1().Pods("default").Create(context.Background(), c, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	defer m.deleteAll(t, "test=restart")
	in := m.instanceOf(t, m.running(t, c.Name, "ready"))
	if in.Device != 1 || in.Core != 50 {
		t.Errorf("the new pod's instance %+v, want core 50 on GPU 1 (GPU 0 is full)", in)
	}
}

// TestMGPUFixedShareNode: on a node whose GPUs run fixed-share, the seed's
// Deployment without an annotation runs with fixed-share, and one that asks
// for guaranteed-burst-share stays Pending with the event naming it. The
// agent runs with the kubelet's credentials here, as the systemd unit does.
func TestMGPUFixedShareNode(t *testing.T) {
	m := startMGPU(t, "fixed-share", agentAsKubelet)
	fakeEnvOf(m)
	pod := m.deploy(t, seedDeployment("plain", "", 30, 4096, saturate(3600)))
	pod = m.running(t, pod.Name, "start")
	if in := m.instanceOf(t, pod); in.Policy != "fixed-share" || in.Core != 30 || in.MemoryMiB != 4096 {
		t.Errorf("instance %+v, want fixed-share, core 30, 4096 MiB", in)
	}
	g := m.deploy(t, seedDeployment("guaranteed", "guaranteed-burst-share", 30, 4096, saturate(3600)))
	ev := m.waitEvent(t, g.Name, "FailedScheduling", "no node runs compute policy guaranteed-burst-share", 60*time.Second)
	t.Logf("guaranteed-burst-share on a fixed-share node: %s", ev.Message)
	m.deleteDeployment(t, "plain")
	m.deleteDeployment(t, "guaranteed")
	t.Run("CoreMem", func(t *testing.T) { testCoreMem(t, m) })
	t.Run("Default", func(t *testing.T) { testDefaultMode(t, m) })
	t.Run("Topology", func(t *testing.T) { testTopologyMode(t, m) })
	t.Run("Offline", func(t *testing.T) { testOffline(t, m) })
	t.Run("CGPURefused", func(t *testing.T) {
		// cgpu would cap each container at its core 1 under fixed-share.
		m.labelMode(t, "cgpu")
		m.waitLogged(t, 15*time.Second, `msg="the node's mode label is not served`, "GPU 0 runs fixed-share")
		m.setMode(t, "", false)
	})
}

// testOffline: a pod annotated vke.volcengine.com/mgpu-class: offline is
// an offline instance; beside a fixed-share online 30 on its GPU it gets the
// rest of the GPU's time while the 30 keeps its 30.
func testOffline(t *testing.T, m *mgpuNode) {
	on := m.running(t, m.deploy(t, seedDeployment("online30", "", 30, 4096, saturate(3600))).Name, "start")
	d := seedDeployment("offline50", "", 50, 4096, saturate(3600))
	d.Spec.Template.Annotations = map[string]string{"vke.volcengine.com/mgpu-class": "offline"}
	off := m.running(t, m.deploy(t, d).Name, "start")
	inOn, inOff := m.instanceOf(t, on), m.instanceOf(t, off)
	if inOn.Class != "online" || inOff.Class != "offline" || inOff.Core != 50 || inOn.Device != inOff.Device {
		t.Fatalf("instances %+v and %+v, want an online 30 and an offline 50 on one GPU (binpack)", inOn, inOff)
	}
	s := m.shares(t, []*corev1.Pod{on, off}, 2*time.Second, 5*time.Second)
	t.Logf("online 30 beside an offline 50: %.2f / %.2f", s[0], s[1])
	if math.Abs(s[0]-30) > epsilon || s[1] < 100-s[0]-epsilon {
		t.Errorf("online %.2f (want 30 ± %.0f), offline %.2f (want the rest, %.2f, - %.0f)", s[0], epsilon, s[1], 100-s[0], epsilon)
	}
	m.deleteDeployment(t, "online30")
	m.deleteDeployment(t, "offline50")
}

// Keys of ACK's core_mem mode.
const (
	ackCoreKey corev1.ResourceName = "aliyun.com/gpu-core.percentage"
	ackMemKey  corev1.ResourceName = "aliyun.com/gpu-mem"
	modeLabel                      = "ack.node.gpu.schedule"
)

// ackDeployment is seed 001's core_mem request: GiB of memory and percent
// of compute, no policy annotation.
func ackDeployment(name string, core, gib int, script string) *appsv1.Deployment {
	d := seedDeployment(name, "", 0, 0, script)
	res := corev1.ResourceList{
		ackCoreKey: *resource.NewQuantity(int64(core), resource.DecimalSI),
		ackMemKey:  *resource.NewQuantity(int64(gib), resource.DecimalSI),
	}
	d.Spec.Template.Spec.Containers[0].Resources = corev1.ResourceRequirements{Requests: res, Limits: res}
	return d
}

// labelMode labels the node with ACK's mode and returns.
func (m *mgpuNode) labelMode(t *testing.T, value string) {
	t.Helper()
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, modeLabel, value)
	if _, err := m.Client.CoreV1().Nodes().Patch(context.Background(), m.NodeName, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

// setMode labels the node with ACK's mode (empty: removes the label) and
// waits until the agent has logged what it makes of it: the switch
// ("msg=mode ... to=X") or, with deferred, that the change waits.
func (m *mgpuNode) setMode(t *testing.T, value string, deferred bool) {
	t.Helper()
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, modeLabel, value)
	if value == "" {
		patch = fmt.Sprintf(`{"metadata":{"labels":{%q:null}}}`, modeLabel)
		value = "mgpu"
	}
	if _, err := m.Client.CoreV1().Nodes().Patch(context.Background(), m.NodeName, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	msg, want := "msg=mode ", "to="+value
	if deferred {
		msg = `msg="mode change waits`
	}
	m.waitLogged(t, 15*time.Second, msg, want)
}

// waitLogged waits until the agent's last log line with msg also has want.
func (m *mgpuNode) waitLogged(t *testing.T, within time.Duration, msg, want string) {
	t.Helper()
	err := harness.WaitFor(within, func() error {
		data, err := os.ReadFile(m.log)
		if err != nil {
			return err
		}
		lines := strings.Split(string(data), "\n")
		for i := len(lines) - 1; i >= 0; i-- {
			if strings.Contains(lines[i], msg) {
				if strings.Contains(lines[i], want) {
					return nil
				}
				break
			}
		}
		return fmt.Errorf("the agent has not logged %s with %s", msg, want)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// waitNodeResources waits until the node's allocatable resources are want.
func (m *mgpuNode) waitNodeResources(t *testing.T, want map[corev1.ResourceName]int64) {
	t.Helper()
	err := harness.WaitFor(60*time.Second, func() error {
		node, err := m.Client.CoreV1().Nodes().Get(context.Background(), m.NodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for k, v := range want {
			if q := node.Status.Allocatable[k]; q.Value() != v {
				return fmt.Errorf("node allocatable %s=%s, want %d", k, q.String(), v)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// testCoreMem is seed 001's core_mem node: labelled ack.node.gpu.schedule=
// core_mem it offers aliyun.com/gpu-core.percentage and aliyun.com/gpu-mem
// (GiB) and no mgpu resources; pods of 30 % / 6 GiB and 70 % / 6 GiB share
// a GPU 30/70; relabelling while they run changes nothing until they are
// gone.
func testCoreMem(t *testing.T, m *mgpuNode) {
	m.setMode(t, "core_mem", false)
	m.waitNodeResources(t, map[corev1.ResourceName]int64{ackCoreKey: 200, ackMemKey: 2 * gpuMiB / 1024, coreKey: 0, memoryKey: 0})
	p30 := m.running(t, m.deploy(t, ackDeployment("ack30", 30, 6, saturate(3600))).Name, "start")
	if log := m.PodLog(t, "default", p30.Name, "main"); !strings.Contains(log, "mem_total=6442450944") {
		t.Errorf("cuMemGetInfo in the container does not say 6 GiB:\n%s", log)
	}
	in30 := m.instanceOf(t, p30)
	if in30.Core != 30 || in30.MemoryMiB != 6144 || in30.Policy != "fixed-share" {
		t.Errorf("instance %+v, want core 30, 6144 MiB, fixed-share", in30)
	}
	p70 := m.running(t, m.deploy(t, ackDeployment("ack70", 70, 6, saturate(3600))).Name, "start")
	in70 := m.instanceOf(t, p70)
	if in70.Device != in30.Device {
		t.Fatalf("the 30 is on GPU %d and the 70 on GPU %d: binpack puts them on one", in30.Device, in70.Device)
	}
	want := []uint64{0, 0}
	want[in30.Device] = 2 * 6144
	m.checkClusterInspect(t, want)
	s := m.shares(t, []*corev1.Pod{p30, p70}, 2*time.Second, 5*time.Second)
	t.Logf("core_mem 30 / 70 both busy: %.2f / %.2f", s[0], s[1])
	if math.Abs(s[0]-30) > epsilon || math.Abs(s[1]-70) > epsilon {
		t.Errorf("shares %.2f / %.2f, want 30 / 70 ± %.0f", s[0], s[1], epsilon)
	}
	node, err := m.Client.CoreV1().Nodes().Get(context.Background(), m.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("node capacity with core_mem: %s=%s %s=%s %s=%s %s=%s", ackCoreKey, qty(node.Status.Capacity[ackCoreKey]), ackMemKey, qty(node.Status.Capacity[ackMemKey]),
		coreKey, qty(node.Status.Capacity[coreKey]), memoryKey, qty(node.Status.Capacity[memoryKey]))

	// Back to mgpu while the pods run: nothing changes until they are gone.
	m.setMode(t, "", true)
	m.waitNodeResources(t, map[corev1.ResourceName]int64{ackCoreKey: 200, ackMemKey: 2 * gpuMiB / 1024, coreKey: 0, memoryKey: 0})
	for _, was := range []api.Instance{in30, in70} {
		pod := p30
		if was.Name == in70.Name {
			pod = p70
		}
		if now := m.instanceOf(t, pod); now.Name != was.Name || now.Device != was.Device || now.Core != was.Core || now.MemoryMiB != was.MemoryMiB {
			t.Errorf("instance changed with the mode label: %+v, was %+v", now, was)
		}
	}
	m.deleteDeployment(t, "ack30")
	m.deleteDeployment(t, "ack70")
	m.waitNodeResources(t, map[corev1.ResourceName]int64{ackCoreKey: 0, ackMemKey: 0, coreKey: 200, memoryKey: 2 * gpuMiB})
}

func qty(q resource.Quantity) string { return q.String() }

// memDeployment asks for gib of aliyun.com/gpu-mem alone, as seed 001's
// cgpu, share and mps pods do.
func memDeployment(name string, gib int, script string) *appsv1.Deployment {
	d := seedDeployment(name, "", 0, 0, script)
	res := corev1.ResourceList{ackMemKey: *resource.NewQuantity(int64(gib), resource.DecimalSI)}
	d.Spec.Template.Spec.Containers[0].Resources = corev1.ResourceRequirements{Requests: res, Limits: res}
	return d
}

// testCGPU is ACK's cgpu mode on GPUs of guaranteed-burst-share: the node
// offers aliyun.com/gpu-mem alone; a pod of 4 GiB sees 4 GiB and cannot
// allocate 5, and alone takes all of its GPU's time; a second one beside
// it shares the GPU equally.
func testCGPU(t *testing.T, m *mgpuNode) {
	m.setMode(t, "cgpu", false)
	m.waitNodeResources(t, map[corev1.ResourceName]int64{ackMemKey: 2 * gpuMiB / 1024, ackCoreKey: 0, coreKey: 0, memoryKey: 0})
	script := "/bin/mgpu-workload alloc --api cuMemAlloc_v2 --mib 3072 --free; /bin/mgpu-workload alloc --api cuMemAlloc_v2 --mib 5120; " + saturate(3600)
	a := m.running(t, m.deploy(t, memDeployment("cgpu-a", 4, script)).Name, "start")
	log := m.PodLog(t, "default", a.Name, "main")
	if !strings.Contains(log, "mem_total=4294967296") || !strings.Contains(log, "allocated=1 failed=0") || !strings.Contains(log, "allocated=0 failed=1") {
		t.Errorf("in a cgpu container of 4 GiB, want 4 GiB total, 3 GiB allocated and 5 GiB refused:\n%s", log)
	}
	inA := m.instanceOf(t, a)
	if inA.Core != 1 || inA.MemoryMiB != 4096 || inA.Policy != "guaranteed-burst-share" {
		t.Errorf("instance %+v, want core 1, 4096 MiB, guaranteed-burst-share (the GPU's)", inA)
	}
	s := m.shares(t, []*corev1.Pod{a}, 2*time.Second, 5*time.Second)
	t.Logf("cgpu, one pod busy alone: %.2f", s[0])
	if s[0] < 95 {
		t.Errorf("a lone cgpu pod got %.2f %% of its GPU, want at least 95 (compute is not capped)", s[0])
	}
	b := m.running(t, m.deploy(t, memDeployment("cgpu-b", 4, saturate(3600))).Name, "start")
	if inB := m.instanceOf(t, b); inB.Device != inA.Device {
		t.Fatalf("the second cgpu pod is on GPU %d, the first on %d: binpack puts them on one", inB.Device, inA.Device)
	}
	s = m.shares(t, []*corev1.Pod{a, b}, 2*time.Second, 5*time.Second)
	t.Logf("cgpu, two pods busy: %.2f / %.2f", s[0], s[1])
	if math.Abs(s[0]-50) > epsilon || math.Abs(s[1]-50) > epsilon {
		t.Errorf("two cgpu pods got %.2f / %.2f, want 50 / 50 ± %.0f (equal weights)", s[0], s[1], epsilon)
	}
	want := []uint64{0, 0}
	want[inA.Device] = 2 * 4096
	m.checkClusterInspect(t, want)
	// share, asked while they run, waits until they are gone: their
	// instances stay as they were.
	m.setMode(t, "share", true)
	m.waitNodeResources(t, map[corev1.ResourceName]int64{ackMemKey: 2 * gpuMiB / 1024, coreKey: 0})
	if now := m.instanceOf(t, a); now.Name != inA.Name || now.Device != inA.Device || now.Core != inA.Core || now.MemoryMiB != inA.MemoryMiB {
		t.Errorf("instance changed with the mode label: %+v, was %+v", now, inA)
	}
	m.deleteDeployment(t, "cgpu-a")
	m.deleteDeployment(t, "cgpu-b")
	m.waitLogged(t, 30*time.Second, "msg=mode ", "to=share")
	m.setMode(t, "", false)
	m.waitNodeResources(t, map[corev1.ResourceName]int64{ackMemKey: 0, coreKey: 200, memoryKey: 2 * gpuMiB})
}

// testShare is ACK's share mode: aliyun.com/gpu-mem schedules and nothing
// is enforced: a pod of 4 GiB is no mgpu instance, sees its whole GPU and
// allocates 8 GiB; a pod of more GiB than the node has left stays Pending.
// The cluster view counts the pod's GiB. mps, labelled next, is refused on
// the simulated node and the mode stays share.
func testShare(t *testing.T, m *mgpuNode) {
	m.setMode(t, "share", false)
	m.waitNodeResources(t, map[corev1.ResourceName]int64{ackMemKey: 2 * gpuMiB / 1024, ackCoreKey: 0, coreKey: 0, memoryKey: 0})
	script := "/bin/mgpu-workload info; /bin/mgpu-workload alloc --api cuMemAlloc_v2 --mib 8192 --free; echo ready; " + idle
	a := m.running(t, m.deploy(t, memDeployment("share-a", 4, script)).Name, "ready")
	log := m.PodLog(t, "default", a.Name, "main")
	if !strings.Contains(log, fmt.Sprintf("mem_total=%d", uint64(gpuMiB)<<20)) || !strings.Contains(log, "allocated=1 failed=0") || !strings.Contains(log, "\ndevice_count=1\n") {
		t.Errorf("in a share container of 4 GiB, want one GPU of all its memory and 8 GiB allocated:\n%s", log)
	}
	insts, err := m.n.Instances()
	if err != nil {
		t.Fatal(err)
	}
	if id := containerID(t, a); slices.ContainsFunc(insts, func(in api.Instance) bool { return in.ContainerID == id }) {
		t.Errorf("the share pod is an mgpu instance: %+v", insts)
	}
	m.inspectCluster(t, []uint64{4096, 0}, false) // binpack: GPU 0 (equal GPUs, lowest index)
	c := m.deploy(t, memDeployment("share-big", 2*gpuMiB/1024, idle))
	ev := m.waitEvent(t, c.Name, "FailedScheduling", "Insufficient aliyun.com/gpu-mem", 60*time.Second)
	t.Logf("160 GiB with 4 taken: %s", ev.Message)

	m.labelMode(t, "mps")
	m.waitLogged(t, 15*time.Second, `msg="the node's mode label is not served`, "mgpu does not simulate MPS")
	m.deleteDeployment(t, "share-big")
	m.deleteDeployment(t, "share-a")
	m.setMode(t, "", false)
	m.waitNodeResources(t, map[corev1.ResourceName]int64{ackMemKey: 0, coreKey: 200, memoryKey: 2 * gpuMiB})
}

// nvidiaGPU is the resource of ACK's default mode (and of NVIDIA's plugin).
const nvidiaGPU corev1.ResourceName = "nvidia.com/gpu"

// aliyunGPU is the resource of ACK's topology mode.
const aliyunGPU corev1.ResourceName = "aliyun.com/gpu"

// wholeDeployment asks for n whole GPUs as seed 001's default-mode Job does.
func wholeDeployment(name string, n int, script string) *appsv1.Deployment {
	return wholeOf(nvidiaGPU, name, n, script)
}

// wholeOf asks for n of the whole-GPU resource res.
func wholeOf(r corev1.ResourceName, name string, n int, script string) *appsv1.Deployment {
	d := seedDeployment(name, "", 0, 0, script)
	res := corev1.ResourceList{r: *resource.NewQuantity(int64(n), resource.DecimalSI)}
	d.Spec.Template.Spec.Containers[0].Resources = corev1.ResourceRequirements{Requests: res, Limits: res}
	return d
}

// testDefaultMode is ACK's default (exclusive) mode: the node offers its
// two GPUs as nvidia.com/gpu and nothing of the other modes; a pod of one
// GPU gets a whole GPU (all its memory, all its time), a second one the
// other GPU, a third waits; emptied and unlabelled, the node is mgpu's again.
func testDefaultMode(t *testing.T, m *mgpuNode) {
	m.setMode(t, "default", false)
	m.waitNodeResources(t, map[corev1.ResourceName]int64{nvidiaGPU: 2, ackCoreKey: 0, ackMemKey: 0, coreKey: 0, memoryKey: 0})
	a := m.running(t, m.deploy(t, wholeDeployment("whole-a", 1, saturate(3600))).Name, "start")
	if log := m.PodLog(t, "default", a.Name, "main"); !strings.Contains(log, fmt.Sprintf("mem_total=%d", uint64(gpuMiB)<<20)) {
		t.Errorf("cuMemGetInfo in the container does not say the whole GPU:\n%s", log)
	}
	inA := m.instanceOf(t, a)
	if inA.Core != 100 || inA.MemoryMiB != gpuMiB {
		t.Errorf("instance %+v, want core 100 and all %d MiB", inA, gpuMiB)
	}
	s := m.shares(t, []*corev1.Pod{a}, 2*time.Second, 5*time.Second)
	t.Logf("default mode, one whole GPU busy alone: %.2f", s[0])
	if s[0] < 95 {
		t.Errorf("a whole GPU gave %.2f %% of its time, want at least 95", s[0])
	}
	b := m.running(t, m.deploy(t, wholeDeployment("whole-b", 1, "echo ready; "+idle)).Name, "ready")
	if inB := m.instanceOf(t, b); inB.Device == inA.Device || inB.Core != 100 {
		t.Errorf("second whole GPU: %+v, first on GPU %d", inB, inA.Device)
	}
	want := []uint64{gpuMiB, gpuMiB}
	m.checkClusterInspect(t, want)
	c := m.deploy(t, wholeDeployment("whole-c", 1, idle))
	ev := m.waitEvent(t, c.Name, "FailedScheduling", "Insufficient nvidia.com/gpu", 60*time.Second)
	t.Logf("a third whole GPU on a node of two: %s", ev.Message)
	for _, d := range []string{"whole-a", "whole-b", "whole-c"} {
		m.deleteDeployment(t, d)
	}
	m.setMode(t, "", false)
	m.waitNodeResources(t, map[corev1.ResourceName]int64{nvidiaGPU: 0, coreKey: 200, memoryKey: 2 * gpuMiB})
}

// testTopologyMode is ACK's topology-aware mode: the node offers its GPUs
// as aliyun.com/gpu (seed 001's check: "aliyun.com/gpu: 2"), and a pod of
// two gets both, whole. (Which GPUs are nearest is the plugin's unit test:
// the simulated node's two GPUs are one set.)
func testTopologyMode(t *testing.T, m *mgpuNode) {
	m.setMode(t, "topology", false)
	m.waitNodeResources(t, map[corev1.ResourceName]int64{aliyunGPU: 2, nvidiaGPU: 0, ackCoreKey: 0, ackMemKey: 0, coreKey: 0, memoryKey: 0})
	p := m.running(t, m.deploy(t, wholeOf(aliyunGPU, "near", 2, "/bin/mgpu-workload info; echo ready; "+idle)).Name, "ready")
	if log := m.PodLog(t, "default", p.Name, "main"); !strings.Contains(log, "device_count=2") {
		t.Errorf("the container does not see two GPUs:\n%s", log)
	}
	m.checkClusterInspect(t, []uint64{gpuMiB, gpuMiB})
	m.deleteDeployment(t, "near")
	m.setMode(t, "", false)
	m.waitNodeResources(t, map[corev1.ResourceName]int64{aliyunGPU: 0, coreKey: 200, memoryKey: 2 * gpuMiB})
}
