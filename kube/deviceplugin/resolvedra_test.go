package deviceplugin

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"

	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/kube/agentapi"
	"github.com/mgpu-dev/mgpu/kube/dra"
)

// fakeClaims are prepared DRA claims.
type fakeClaims []dra.Claim

func (f fakeClaims) Claim(ns, name, _ string) (dra.Claim, bool) {
	for _, c := range f {
		if c.Namespace == ns && c.Name == name {
			return c, true
		}
	}
	return dra.Claim{}, false
}

// draPod is a pod of one container "main" that names claim entries
// (entry: claim name; a "tmpl:" claim name is a template's, its claim
// in the status).
func draPod(name string, entries map[string]string, annotations map[string]string) corev1.Pod {
	p := pod(name, "", "", "")
	p.Annotations = annotations
	for e, c := range entries {
		p.Spec.Containers[0].Resources.Claims = append(p.Spec.Containers[0].Resources.Claims, corev1.ResourceClaim{Name: e})
		if made, ok := strings.CutPrefix(c, "tmpl:"); ok {
			p.Spec.ResourceClaims = append(p.Spec.ResourceClaims, corev1.PodResourceClaim{Name: e, ResourceClaimTemplateName: ptr.To("t")})
			if made != "" {
				p.Status.ResourceClaimStatuses = append(p.Status.ResourceClaimStatuses, corev1.PodResourceClaimStatus{Name: e, ResourceClaimName: ptr.To(made)})
			}
			continue
		}
		p.Spec.ResourceClaims = append(p.Spec.ResourceClaims, corev1.PodResourceClaim{Name: e, ResourceClaimName: ptr.To(c)})
	}
	return p
}

func TestResolveDRA(t *testing.T) {
	t.Parallel()
	share := func(gpu, core int, mib uint64) dra.Share {
		return dra.Share{Request: "gpu", Device: dra.DeviceName(gpu), GPU: gpu, Core: core, MemoryMiB: mib}
	}
	twoCtr := draPod("twoctr", map[string]string{"g": "c-two"}, nil)
	twoCtr.Spec.Containers = append(twoCtr.Spec.Containers, corev1.Container{Name: "side", Resources: twoCtr.Spec.Containers[0].Resources})
	pods := &fakePods{pods: []corev1.Pod{
		draPod("tmpl", map[string]string{"g": "tmpl:tmpl-g-x"}, nil),
		draPod("named", map[string]string{"g": "c-named"}, map[string]string{ClassKey: "offline"}),
		draPod("whole", map[string]string{"g": "c-whole"}, nil),
		draPod("notmade", map[string]string{"g": "tmpl:"}, nil),
		draPod("shared", map[string]string{"g": "c-shared"}, nil),
		draPod("other", map[string]string{"g": "c-other-driver"}, nil),
		draPod("badpol", map[string]string{"g": "c-badpol"}, map[string]string{PolicyKey: "fixed-share"}),
		draPod("stranger", map[string]string{"g": "c-named"}, nil),
		draPod("mixed", map[string]string{"g": "c-mixed"}, nil),
		twoCtr,
	}}
	claims := fakeClaims{
		{Namespace: "ns", Name: "tmpl-g-x", Pods: []string{"uid-tmpl"}, Shares: []dra.Share{share(1, 30, 4096)}},
		{Namespace: "ns", Name: "c-named", Pods: []string{"uid-named"}, Shares: []dra.Share{share(0, 70, 4096)}},
		{Namespace: "ns", Name: "c-whole", Pods: []string{"uid-whole"}, Shares: []dra.Share{share(1, 100, 81920), share(0, 100, 81920)}},
		{Namespace: "ns", Name: "c-shared", Pods: []string{"uid-shared", "uid-x"}, Shares: []dra.Share{share(0, 10, 1024)}},
		{Namespace: "ns", Name: "c-badpol", Pods: []string{"uid-badpol"}, Shares: []dra.Share{share(0, 10, 1024)}},
		{Namespace: "ns", Name: "c-mixed", Pods: []string{"uid-mixed"}, Shares: []dra.Share{share(0, 10, 1024), share(2, 10, 1024)}},
		{Namespace: "ns", Name: "c-two", Pods: []string{"uid-twoctr"}, Shares: []dra.Share{share(0, 10, 1024)}},
	}
	r := NewResolver("n1", []int{0, 1, 2}, pods, &fakeAllocs{})
	r.SetScheme(SchemeDRA)
	r.SetGPUPolicies(map[int]policy.Policy{0: policy.GuaranteedBurstShare, 1: policy.GuaranteedBurstShare, 2: policy.FixedShare})
	r.SetClaims(claims)
	for _, tc := range []struct {
		pod  string
		want []agentapi.GPU
		err  string
	}{
		{pod: "tmpl", want: []agentapi.GPU{{Index: 1, Core: 30, MemoryMiB: 4096, Claim: "tmpl-g-x"}}},
		{pod: "named", want: []agentapi.GPU{{Index: 0, Core: 70, MemoryMiB: 4096, Claim: "c-named"}}},
		{pod: "whole", want: []agentapi.GPU{{Index: 0, Core: 100, MemoryMiB: 81920, Claim: "c-whole"}, {Index: 1, Core: 100, MemoryMiB: 81920, Claim: "c-whole"}}},
		{pod: "notmade", err: "is not made yet"},
		{pod: "shared", err: "reserved for 2 pods"},
		{pod: "other", err: "no ResourceClaim of driver gpu.mgpu.io prepared"},
		{pod: "badpol", err: `annotation vke.volcengine.com/mgpu-compute-policy is "fixed-share", and its claim's GPU runs guaranteed-burst-share`},
		{pod: "stranger", err: "not reserved for this pod"},
		{pod: "mixed", err: "its GPUs run guaranteed-burst-share and fixed-share"},
		{pod: "twoctr", err: "used by 2 containers"},
	} {
		a, err := r.Resolve(context.Background(), query(tc.pod))
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%s: err %v, want %q", tc.pod, err, tc.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", tc.pod, err)
			continue
		}
		if a.Policy != "guaranteed-burst-share" || len(a.GPUs) != len(tc.want) {
			t.Errorf("%s: %+v", tc.pod, a)
			continue
		}
		for i := range a.GPUs {
			if a.GPUs[i] != tc.want[i] {
				t.Errorf("%s: GPUs %+v, want %+v", tc.pod, a.GPUs, tc.want)
			}
		}
	}
	if a, err := r.Resolve(context.Background(), query("named")); err != nil || a.Class != "offline" {
		t.Errorf("named: class %q, %v", a.Class, err)
	}
	r2 := NewResolver("n1", []int{0}, pods, &fakeAllocs{})
	r2.SetScheme(SchemeDRA)
	if _, err := r2.Resolve(context.Background(), query("named")); err == nil || !strings.Contains(err.Error(), "DRA driver is not running") {
		t.Errorf("no driver: %v", err)
	}
}
