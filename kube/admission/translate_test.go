package admission

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	jsonpatch "gopkg.in/evanphx/json-patch.v4"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/kube/dranames"
)

// translated applies the translation's operations to pod and returns the
// result.
func translated(t *testing.T, tr *Translator, pod *corev1.Pod, pol policy.Policy) (*corev1.Pod, error) {
	t.Helper()
	ops, err := tr.Translate(context.Background(), pod, pol)
	if err != nil {
		return nil, err
	}
	doc, _ := json.Marshal(pod)
	p, _ := json.Marshal(ops)
	patch, err := jsonpatch.DecodePatch(p)
	if err != nil {
		t.Fatal(err)
	}
	out, err := patch.Apply(doc)
	if err != nil {
		t.Fatalf("the operations do not apply: %v\n%s", err, p)
	}
	var got corev1.Pod
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatal(err)
	}
	return &got, nil
}

func TestTranslate(t *testing.T) {
	t.Parallel()
	client := fake.NewClientset(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "default", Labels: map[string]string{TranslateLabel: "true"}}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "other"}})
	tr := NewTranslator(client)
	ctx := context.Background()
	if in, err := tr.OptedIn(ctx, "default"); err != nil || !in {
		t.Fatalf("default: opted in %v, %v", in, err)
	}
	if in, err := tr.OptedIn(ctx, "other"); err != nil || in {
		t.Fatalf("other: opted in %v, %v", in, err)
	}

	// Seed 000's share, and a plain container beside it.
	pod := withAnnotation(podOf(mgpu("30", "4096"), corev1.ResourceRequirements{}), "guaranteed-burst-share")
	pod.Spec.Containers[1].Name = "side"
	got, err := translated(t, tr, pod, policy.GuaranteedBurstShare)
	if err != nil {
		t.Fatal(err)
	}
	c := got.Spec.Containers[0]
	if len(c.Resources.Limits) != 0 || len(c.Resources.Claims) != 1 || c.Resources.Claims[0].Name != "mgpu-c" {
		t.Fatalf("container %+v", c.Resources)
	}
	if len(got.Spec.ResourceClaims) != 1 || *got.Spec.ResourceClaims[0].ResourceClaimTemplateName != "mgpu-guaranteed-burst-share-30c-4096mi" {
		t.Fatalf("pod claims %+v", got.Spec.ResourceClaims)
	}
	if len(got.Spec.Containers[1].Resources.Claims) != 0 {
		t.Errorf("the plain container got claims %+v", got.Spec.Containers[1].Resources.Claims)
	}
	tmpl, err := client.ResourceV1().ResourceClaimTemplates("default").Get(ctx, "mgpu-guaranteed-burst-share-30c-4096mi", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	r := tmpl.Spec.Spec.Devices.Requests[0].Exactly
	cores, mem := r.Capacity.Requests[dranames.CapCores], r.Capacity.Requests[dranames.CapMemory]
	if r.DeviceClassName != dranames.DeviceClass || cores.Value() != 30 || mem.Value() != 4096<<20 ||
		r.Selectors[0].CEL.Expression != `device.attributes["gpu.mgpu.io"].policy == "guaranteed-burst-share"` {
		t.Errorf("template request %+v %+v", r, r.Selectors)
	}
	// The same shape again reuses it; one changed since is refused.
	if _, err := translated(t, tr, pod, policy.GuaranteedBurstShare); err != nil {
		t.Fatalf("again: %v", err)
	}
	tmpl.Spec.Spec.Devices.Requests[0].Exactly.Count = 3
	if _, err := client.ResourceV1().ResourceClaimTemplates("default").Update(ctx, tmpl, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	var d *Denial
	if _, err := translated(t, tr, pod, policy.GuaranteedBurstShare); !errors.As(err, &d) || !strings.Contains(err.Error(), "is not the request mgpu-webhook made") {
		t.Fatalf("a changed template: %v", err)
	}

	// Whole GPUs, ACK's core_mem (policy annotation set) and cgpu (none).
	for _, tc := range []struct {
		name   string
		res    corev1.ResourceRequirements
		tmpl   string
		policy bool
	}{
		{"two whole GPUs", mgpu("200", ""), "mgpu-fixed-share-2gpu", true},
		{"ACK core_mem", res(map[corev1.ResourceName]string{ResourceACKCore: "30", ResourceACKMemory: "6"}), "mgpu-fixed-share-30c-6144mi", true},
		{"ACK cgpu", res(map[corev1.ResourceName]string{ResourceACKMemory: "4"}), "mgpu-burst-1c-4096mi", false},
	} {
		got, err := translated(t, tr, podOf(tc.res), policy.FixedShare)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if n := *got.Spec.ResourceClaims[0].ResourceClaimTemplateName; n != tc.tmpl {
			t.Errorf("%s: template %s, want %s", tc.name, n, tc.tmpl)
		}
		if _, ok := got.Annotations[PolicyKey]; ok != tc.policy {
			t.Errorf("%s: policy annotation %v, want %v", tc.name, got.Annotations, tc.policy)
		}
	}
	whole, err := client.ResourceV1().ResourceClaimTemplates("default").Get(ctx, "mgpu-fixed-share-2gpu", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if r := whole.Spec.Spec.Devices.Requests[0].Exactly; r.Count != 2 || r.Capacity != nil || len(whole.Spec.Spec.Devices.Constraints) != 1 {
		t.Errorf("whole GPUs: %+v, constraints %+v", r, whole.Spec.Spec.Devices.Constraints)
	}
	cgpu, err := client.ResourceV1().ResourceClaimTemplates("default").Get(ctx, "mgpu-burst-1c-4096mi", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if e := cgpu.Spec.Spec.Devices.Requests[0].Exactly.Selectors[0].CEL.Expression; e != `device.attributes["gpu.mgpu.io"].policy != "fixed-share"` {
		t.Errorf("cgpu selector %s", e)
	}
	for _, tc := range []struct {
		res  corev1.ResourceRequirements
		want string
	}{
		{res(map[corev1.ResourceName]string{ResourceACKCore: "30"}), "needs aliyun.com/gpu-mem"},
		{res(map[corev1.ResourceName]string{ResourceACKCore: "150", ResourceACKMemory: "1"}), "not 1 to 100 or a multiple of 100"},
		{res(map[corev1.ResourceName]string{ResourceACKMemory: "20000"}), "over 16384 GiB"},
		{res(map[corev1.ResourceName]string{ResourceACKMemory: "1", ResourceCore: "100"}), "use one vendor's keys"},
	} {
		if _, err := translated(t, tr, podOf(tc.res), policy.FixedShare); !errors.As(err, &d) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.res.Limits, err, tc.want)
		}
	}
}

// FuzzContainerShape: whatever quantities a container's limits and
// requests hold (the tenant's to write), containerShape either refuses
// with one line or returns a shape the driver can serve (a share of 1..99
// cores with memory, whole GPUs, or ACK's memory alone), whose template
// name is a valid object name and whose template validates as the API
// server would need (a request of the class, capacity only with a share).
func FuzzContainerShape(f *testing.F) {
	for _, s := range [][4]string{{"30", "4096", "", ""}, {"200", "", "", ""}, {"300", "9000", "", ""}, {"", "", "30", "6"},
		{"", "", "", "4"}, {"0", "1", "", ""}, {"150", "1", "", ""}, {"1e3", "1k", "", ""}, {"", "", "101", "1"}, {"-1", "", "", "20000"}} {
		f.Add(s[0], s[1], s[2], s[3])
	}
	f.Fuzz(func(t *testing.T, core, mem, ackCore, ackMem string) {
		lim := corev1.ResourceList{}
		for n, v := range map[corev1.ResourceName]string{ResourceCore: core, ResourceMemory: mem, ResourceACKCore: ackCore, ResourceACKMemory: ackMem} {
			if v == "" {
				continue
			}
			q, err := resource.ParseQuantity(v)
			if err != nil {
				return
			}
			lim[n] = q
		}
		c := &corev1.Container{Name: "c", Resources: corev1.ResourceRequirements{Limits: lim}}
		s, names, ok, err := containerShape(c)
		switch {
		case err != nil:
			if ok || strings.Contains(err.Error(), "\n") {
				t.Fatalf("refused with ok %v: %q", ok, err)
			}
			return
		case !ok:
			if len(lim) != 0 {
				t.Fatalf("%v: not a request, with no error", lim)
			}
			return
		}
		if len(names) == 0 || len(names) != len(lim) {
			t.Fatalf("%v: replaces %v", lim, names)
		}
		switch {
		case s.count > 0:
			if s.cores != 0 || s.burst {
				t.Fatalf("whole GPUs %+v", s)
			}
		case s.burst:
			if s.cores != 1 || s.mib < 1024 || s.mib > maxACKGiB*1024 {
				t.Fatalf("memory alone %+v", s)
			}
		default:
			if s.cores < 1 || s.cores > 99 || s.mib < 1 {
				t.Fatalf("share %+v", s)
			}
		}
		tmpl := s.template("ns", policy.GuaranteedBurstShare)
		if errs := validation.IsDNS1123Subdomain(tmpl.Name); len(errs) > 0 {
			t.Fatalf("template name %q: %v", tmpl.Name, errs)
		}
		r := tmpl.Spec.Spec.Devices.Requests[0].Exactly
		hasCores := false
		if r.Capacity != nil {
			_, hasCores = r.Capacity.Requests[dranames.CapCores]
		}
		if r.DeviceClassName != dranames.DeviceClass || r.Count < 1 || (s.count == 0) != hasCores {
			t.Fatalf("template %+v for %+v", r, s)
		}
	})
}
