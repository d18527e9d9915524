package k8s

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/kube/admission"
	"github.com/mgpu-dev/mgpu/kube/dra"
	"github.com/mgpu-dev/mgpu/test/harness"
)

// claimTemplate creates a ResourceClaimTemplate of one share of one GPU
// of mgpu's DeviceClass: cores percent and memoryMiB.
func (m *mgpuNode) claimTemplate(t *testing.T, name string, cores, memoryMiB int) {
	t.Helper()
	tmpl := &resourcev1.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: resourcev1.ResourceClaimTemplateSpec{Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{
			Requests: []resourcev1.DeviceRequest{{Name: "gpu", Exactly: &resourcev1.ExactDeviceRequest{
				DeviceClassName: dra.DeviceClassName,
				Capacity: &resourcev1.CapacityRequirements{Requests: map[resourcev1.QualifiedName]resource.Quantity{
					dra.CapCores:  *resource.NewQuantity(int64(cores), resource.DecimalSI),
					dra.CapMemory: resource.MustParse(fmt.Sprintf("%dMi", memoryMiB)),
				}},
			}}},
		}}},
	}
	ctx := context.Background()
	if _, err := m.Client.ResourceV1().ResourceClaimTemplates("default").Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = m.Client.ResourceV1().ResourceClaimTemplates("default").Delete(context.Background(), name, metav1.DeleteOptions{})
	})
}

// draDeployment is a Deployment of one pod whose container "main" has the
// claim of template tmpl.
func draDeployment(name, tmpl, script string) *appsv1.Deployment {
	d := seedDeployment(name, "", 0, 0, script)
	d.Spec.Template.Annotations = nil
	spec := &d.Spec.Template.Spec
	spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: &tmpl}}
	spec.Containers[0].Resources = corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "gpu"}}}
	return d
}

// waitDRASlice waits until the node's ResourceSlice of mgpu's driver lists
// want devices (0: an empty pool) and returns them.
func (m *mgpuNode) waitDRASlice(t *testing.T, want int) []resourcev1.Device {
	t.Helper()
	var devs []resourcev1.Device
	err := harness.WaitFor(60*time.Second, func() error {
		l, err := m.Client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
		if err != nil {
			return err
		}
		devs = nil
		n := 0
		for _, s := range l.Items {
			if s.Spec.Driver == dra.DriverName && s.Spec.NodeName != nil && *s.Spec.NodeName == m.NodeName {
				n++
				devs = append(devs, s.Spec.Devices...)
			}
		}
		if n == 0 || len(devs) != want {
			return fmt.Errorf("%d ResourceSlices of %s on node %s with %d devices, want %d devices", n, dra.DriverName, m.NodeName, len(devs), want)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return devs
}

// checkpointClaims are the claims of the DRA driver's checkpoint.
func checkpointClaims(t *testing.T) []dra.Claim {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dra.DataDir(KubeletRootDir), dra.CheckpointName))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var cp struct{ Claims []dra.Claim }
	if err := json.Unmarshal(b, &cp); err != nil {
		t.Fatal(err)
	}
	return cp.Claims
}

// claimOf is the ResourceClaim the controller made for a pod's entry "gpu".
func (m *mgpuNode) claimOf(t *testing.T, pod *corev1.Pod) string {
	t.Helper()
	p, err := m.Client.CoreV1().Pods("default").Get(context.Background(), pod.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range p.Status.ResourceClaimStatuses {
		if s.Name == "gpu" && s.ResourceClaimName != nil {
			return *s.ResourceClaimName
		}
	}
	t.Fatalf("pod %s has no claim: %+v", pod.Name, p.Status.ResourceClaimStatuses)
	return ""
}

// testDRA is node mode dra: the device plugins list nothing, the DRA
// driver's ResourceSlice lists both GPUs with their capacities and
// policy, and claims of a share are placed per GPU by the scheduler and
// enforced as their consumedCapacity; deleting a pod releases its claim
// and instance; the mode goes back once no claim is prepared.
func testDRA(t *testing.T, m *mgpuNode) {
	ctx := context.Background()
	testDevicePluginFit(t, m)
	m.setMode(t, "dra", false)
	m.waitNodeResources(t, map[corev1.ResourceName]int64{coreKey: 0, memoryKey: 0})
	devs := m.waitDRASlice(t, 2)
	for _, d := range devs {
		mem, cores := d.Capacity[dra.CapMemory].Value, d.Capacity[dra.CapCores].Value
		pol := d.Attributes[dra.AttrPolicy].StringValue
		if d.AllowMultipleAllocations == nil || !*d.AllowMultipleAllocations || mem.Value() != gpuMiB<<20 || cores.Value() != 100 ||
			pol == nil || *pol != "guaranteed-burst-share" {
			t.Errorf("ResourceSlice device %s: shared %v, memory %s, cores %s, policy %v", d.Name, d.AllowMultipleAllocations, mem.String(), cores.String(), pol)
		}
	}

	m.claimTemplate(t, "dra-30", 30, 4096)
	m.claimTemplate(t, "dra-70", 70, 4096)
	p30 := m.running(t, m.deploy(t, draDeployment("dra30", "dra-30", saturate(3600))).Name, "start")
	if log := m.PodLog(t, "default", p30.Name, "main"); !strings.Contains(log, "mem_total=4294967296") {
		t.Errorf("cuMemGetInfo in the DRA container does not say 4096 MiB:\n%s", log)
	}
	in30 := m.instanceOf(t, p30)
	if in30.Core != 30 || in30.MemoryMiB != 4096 || in30.Policy != "guaranteed-burst-share" {
		t.Errorf("instance %+v, want core 30, 4096 MiB, guaranteed-burst-share", in30)
	}
	p70 := m.running(t, m.deploy(t, draDeployment("dra70", "dra-70",
		"/bin/mgpu-workload info; /bin/mgpu-workload compute --api launch --kernel-us 100 --depth 64 --seconds 20; echo idle; "+idle)).Name, "start")
	in70 := m.instanceOf(t, p70)
	if in70.Device != in30.Device || in70.Core != 70 {
		t.Fatalf("the 70 is %+v, the 30 on GPU %d: the scheduler puts both on the first GPU that fits", in70, in30.Device)
	}
	prepared := checkpointClaims(t)
	m.checkDRAInspect(t, []*corev1.Pod{p30, p70}, []int{30, 70})
	for _, p := range []*corev1.Pod{p30, p70} {
		name := m.claimOf(t, p)
		if in := m.instanceOf(t, p); in.Pod == nil || in.Pod.Claim != name {
			t.Errorf("instance of pod %s: pod ref %+v, want claim %s (top, metrics)", p.Name, in.Pod, name)
		}
		i := slices.IndexFunc(prepared, func(c dra.Claim) bool { return c.Name == name })
		if i < 0 || !prepared[i].ReservedFor(string(p.UID)) || len(prepared[i].Shares) != 1 || prepared[i].Shares[0].ShareID == "" {
			t.Errorf("claim %s of pod %s is not prepared for it with a shareID: %+v", name, p.Name, prepared)
		}
	}
	m.check3070(t, "DRA ", p30, p70)
	testDRARestarts(t, m, p30, p70)

	claim70 := m.claimOf(t, p70)
	start := time.Now()
	m.testRelease(t, p70)
	err := harness.WaitFor(30*time.Second, func() error {
		if slices.ContainsFunc(checkpointClaims(t), func(c dra.Claim) bool { return c.Name == claim70 }) {
			return fmt.Errorf("claim %s still prepared", claim70)
		}
		if _, err := m.Client.ResourceV1().ResourceClaims("default").Get(ctx, claim70, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("claim %s still there (%w)", claim70, err)
		}
		return nil
	})
	took := time.Since(start)
	t.Logf("pod %s deleted: claim %s unprepared and deleted after %v", p70.Name, claim70, took.Round(time.Millisecond))
	if err != nil || took > 2*time.Second {
		t.Errorf("claim %s of deleted pod %s released after %v (%v), want within 2s", claim70, p70.Name, took, err)
	}
	m.deleteDeployment(t, "dra70")
	m.deleteDeployment(t, "dra30")

	testDRAFit(t, m)
	testDRASeed(t, m)

	// Back to mgpu once no claim is prepared.
	m.setMode(t, "", false)
	m.waitNodeResources(t, map[corev1.ResourceName]int64{coreKey: 200, memoryKey: 2 * gpuMiB})
	m.waitDRASlice(t, 0)
}

// testDRARestarts: with the 30 and the 70 running, a kubelet restart and an
// agent restart keep their instances and the driver's prepared claims (the
// restarted agent restores them from its checkpoint and serves dra again),
// and the 30 still gets the GPU beside the idle 70.
func testDRARestarts(t *testing.T, m *mgpuNode, p30, p70 *corev1.Pod) {
	before := []api.Instance{m.instanceOf(t, p30), m.instanceOf(t, p70)}
	claims := checkpointClaims(t)
	same := func(when string) {
		t.Helper()
		for i, p := range []*corev1.Pod{p30, p70} {
			if now := m.instanceOf(t, p); now.Name != before[i].Name || now.PID != before[i].PID || now.Core != before[i].Core {
				t.Errorf("%s: instance %+v became %+v", when, before[i], now)
			}
		}
		if now := checkpointClaims(t); !reflect.DeepEqual(now, claims) {
			t.Errorf("%s: prepared claims %+v, were %+v", when, now, claims)
		}
	}
	m.RestartKubelet(t)
	m.WaitPodPhase(t, "default", p30.Name, corev1.PodRunning, 60*time.Second)
	m.WaitPodPhase(t, "default", p70.Name, corev1.PodRunning, 60*time.Second)
	same("after the kubelet restart")
	m.restartAgent(t)
	m.waitLogged(t, 30*time.Second, "msg=\"DRA claims restored", fmt.Sprintf("claims=%d", len(claims)))
	m.waitLogged(t, 30*time.Second, "msg=mode ", "to=dra")
	m.waitDRASlice(t, 2)
	same("after the agent restart")
	s := m.shares(t, []*corev1.Pod{p30}, time.Second, 5*time.Second)
	t.Logf("DRA 30 beside the idle 70 after the kubelet and agent restarts: %.2f", s[0])
	if s[0] < 95 {
		t.Errorf("the DRA 30 beside an idle 70 got %.2f%% after the restarts, want >= 95", s[0])
	}
}

// testDRAFit: the scheduler fits claims per GPU. With 50 GiB (and 60 and
// 50 cores) taken on the two GPUs, a claim of 40 GiB and one of 60 cores
// stay Pending with the scheduler's reason, though the node's totals have
// room for both; once the first GPU frees up, both schedule.
func testDRAFit(t *testing.T, m *mgpuNode) {
	m.claimTemplate(t, "fit-a", 60, 50*1024)
	m.claimTemplate(t, "fit-b", 50, 50*1024)
	m.claimTemplate(t, "fit-mem", 10, 40*1024)
	m.claimTemplate(t, "fit-core", 60, 1024)
	a := m.running(t, m.deploy(t, draDeployment("fit-a", "fit-a", "echo up; "+idle)).Name, "up")
	b := m.running(t, m.deploy(t, draDeployment("fit-b", "fit-b", "echo up; "+idle)).Name, "up")
	if ga, gb := m.instanceOf(t, a).Device, m.instanceOf(t, b).Device; ga == gb {
		t.Fatalf("two claims of 50 GiB on one 80 GiB GPU (%d)", ga)
	}
	for _, name := range []string{"fit-mem", "fit-core"} {
		p := m.deploy(t, draDeployment(name, name, "echo up; "+idle))
		ev := m.waitEvent(t, p.Name, "FailedScheduling", "claim", 60*time.Second)
		t.Logf("%s: FailedScheduling: %s", name, ev.Message)
	}
	m.deleteDeployment(t, "fit-a")
	for _, name := range []string{"fit-mem", "fit-core"} {
		p := m.waitBound(t, "app="+name, 60*time.Second)
		m.running(t, p.Name, "up")
	}
	for _, name := range []string{"fit-b", "fit-mem", "fit-core"} {
		m.deleteDeployment(t, name)
	}
}

// translateDefault opts the namespace default into the webhook's DRA
// translation until the test ends.
func (m *mgpuNode) translateDefault(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	set := func(v *string) error {
		b, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{admission.TranslateLabel: v}}})
		_, err := m.Client.CoreV1().Namespaces().Patch(ctx, "default", types.MergePatchType, b, metav1.PatchOptions{})
		return err
	}
	yes := "true"
	if err := set(&yes); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := set(nil); err != nil {
			t.Errorf("namespace default: remove %s: %v", admission.TranslateLabel, err)
		}
	})
}

// testDRASeed: in a namespace that opts in, seed 000's Deployment,
// unchanged, runs on the DRA node as a claim of the per-namespace template
// of its request (30 % and 4096 MiB under guaranteed-burst-share), and the
// same Deployment of a policy no GPU runs stays Pending with an event that
// names it. Ten seed pods of mixed requests created at once then never
// over-commit a GPU, and those that cannot fit stay Pending with the
// scheduler's reason.
func testDRASeed(t *testing.T, m *mgpuNode) {
	m.translateDefault(t)
	p := m.running(t, m.deploy(t, seedDeployment("seed-dra", "guaranteed-burst-share", 30, 4096, saturate(3600))).Name, "start")
	if len(p.Spec.ResourceClaims) != 1 || p.Spec.ResourceClaims[0].ResourceClaimTemplateName == nil ||
		*p.Spec.ResourceClaims[0].ResourceClaimTemplateName != "mgpu-guaranteed-burst-share-30c-4096mi" {
		t.Errorf("the seed's pod was not translated: resourceClaims %+v", p.Spec.ResourceClaims)
	}
	if _, ok := p.Spec.Containers[0].Resources.Limits[coreKey]; ok {
		t.Errorf("the translated pod still asks for %s", coreKey)
	}
	if log := m.PodLog(t, "default", p.Name, "main"); !strings.Contains(log, "mem_total=4294967296") {
		t.Errorf("cuMemGetInfo in the translated seed pod does not say 4096 MiB:\n%s", log)
	}
	if in := m.instanceOf(t, p); in.Core != 30 || in.MemoryMiB != 4096 || in.Policy != "guaranteed-burst-share" {
		t.Errorf("the translated seed pod's instance %+v, want core 30, 4096 MiB, guaranteed-burst-share", in)
	}
	fixed := m.deploy(t, seedDeployment("seed-dra-fixed", "fixed-share", 30, 4096, saturate(3600)))
	ev := m.waitEvent(t, fixed.Name, "FailedScheduling", "fixed-share", 60*time.Second)
	t.Logf("translated fixed-share pod: FailedScheduling: %s", ev.Message)
	m.deleteDeployment(t, "seed-dra-fixed")
	m.deleteDeployment(t, "seed-dra")

	testDRATenPods(t, m)
}

// testDRATenPods creates ten translated pods of mixed requests at once.
func testDRATenPods(t *testing.T, m *mgpuNode) {
	defer m.deleteAll(t, "test=dra-ten") // before the mode goes back to mgpu
	pods := m.startTen(t, "dra-ten", "echo ready; "+idle)
	m.committed(t)
	running := 0
	for i := range pods {
		p := &pods[i]
		switch p.Status.Phase {
		case corev1.PodRunning:
			running++
			m.instanceOf(t, p)
		case corev1.PodPending:
			if p.Spec.NodeName != "" {
				t.Errorf("pod %s is bound and not running: %+v", p.Name, p.Status)
				continue
			}
			ev := m.waitEvent(t, p.Name, "FailedScheduling", "cannot allocate all claims", 30*time.Second)
			t.Logf("%s pending: %s", p.Name, ev.Message)
		default:
			t.Errorf("pod %s is %s", p.Name, p.Status.Phase)
		}
	}
	if running == 0 || running == len(pods) {
		t.Errorf("%d of %d pods run; the requests fit some but not all", running, len(pods))
	}
}

// inspectShare is a DRA claim's share in `inspect --cluster --output json`.
type inspectShare struct {
	GPU       int      `json:"gpu"`
	Claim     string   `json:"claim"`
	Pods      []string `json:"pods"`
	Core      int      `json:"core"`
	MemoryMiB uint64   `json:"memory_mib"`
}

// checkDRAInspect: `mgpu-cli inspect --cluster` lists the pods' claims on
// the node, each with its pod, cores and 4096 MiB.
func (m *mgpuNode) checkDRAInspect(t *testing.T, pods []*corev1.Pod, cores []int) {
	t.Helper()
	out, err := exec.Command(m.n.CLI, "inspect", "--cluster", "--kubeconfig", m.AdminKubeconfig, "--output", "json").Output() //nolint:gosec // the build's CLI
	if err != nil {
		t.Fatalf("inspect --cluster: %v", err)
	}
	var r struct {
		Nodes []struct {
			Node string         `json:"node"`
			DRA  []inspectShare `json:"dra_claims"`
		} `json:"nodes"`
	}
	if err := json.Unmarshal(out, &r); err != nil || len(r.Nodes) != 1 {
		t.Fatalf("inspect --cluster: %v\n%s", err, out)
	}
	for i, p := range pods {
		name := m.claimOf(t, p)
		k := slices.IndexFunc(r.Nodes[0].DRA, func(s inspectShare) bool { return s.Claim == name })
		if k < 0 {
			t.Errorf("inspect --cluster does not show claim %s:\n%s", name, out)
			continue
		}
		if s := r.Nodes[0].DRA[k]; s.Core != cores[i] || s.MemoryMiB != 4096 || !slices.Equal(s.Pods, []string{p.Name}) {
			t.Errorf("inspect --cluster shows claim %s as %+v", name, s)
		}
	}
	table, _ := exec.Command(m.n.CLI, "inspect", "--cluster", "--kubeconfig", m.AdminKubeconfig).Output() //nolint:gosec // the build's CLI
	t.Logf("inspect --cluster:\n%s", table)
}

// testDevicePluginFit is the device plugins' side of testDRAFit, on the
// same node in mode mgpu: with 50 GiB taken on each GPU, a pod of 40 GiB
// passes the scheduler (the node has 60 GiB left in total) and fails on
// the node, where no GPU has 40 GiB.
func testDevicePluginFit(t *testing.T, m *mgpuNode) {
	a := m.running(t, m.deploy(t, seedDeployment("dp-50a", "guaranteed-burst-share", 10, 50*1024, "echo up; "+idle)).Name, "up")
	b := m.running(t, m.deploy(t, seedDeployment("dp-50b", "guaranteed-burst-share", 10, 50*1024, "echo up; "+idle)).Name, "up")
	if ga, gb := m.instanceOf(t, a).Device, m.instanceOf(t, b).Device; ga == gb {
		t.Fatalf("two pods of 50 GiB on one 80 GiB GPU (%d)", ga)
	}
	p := m.deploy(t, seedDeployment("dp-40", "guaranteed-burst-share", 10, 40*1024, "echo up; "+idle))
	bound := m.waitBound(t, "app=dp-40", 60*time.Second)
	ev := m.waitEvent(t, p.Name, "Failed", "MiB memory free", 60*time.Second)
	t.Logf("device plugins: the 40 GiB pod passed the scheduler (bound to %s) and failed on the node: %s", bound.Spec.NodeName, ev.Message)
	for _, name := range []string{"dp-40", "dp-50a", "dp-50b"} {
		m.deleteDeployment(t, name)
	}
}
